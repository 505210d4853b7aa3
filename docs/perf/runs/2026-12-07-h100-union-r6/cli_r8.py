# the CLI with the union ring's stages holding 2, 4 or 8 rows of x (no 6-row stage)
import glm_ep.backend.cuda.ring as ring
ring.UNION_RING_ROWS = (2, 4, 8)
from glm_ep.app.cli import main
raise SystemExit(main())
