"""Lab: the glm-ep CLI with RING_CLAIMS_MIN_ITEMS set to argv[1] (the kernels' define and the host's pre-filter)."""
import sys
import glm_ep.backend.cuda.kernel_loader as KL
n = int(sys.argv.pop(1))
KL.RING_CLAIMS_MIN_ITEMS = n
KL.DEFINES["RING_CLAIMS_MIN_ITEMS"] = n
import glm_ep.backend.cuda.routed as R
R.RING_CLAIMS_MIN_ITEMS = n
from glm_ep.app.cli import main
raise SystemExit(main())
