from glm_ep.cli import main

raise SystemExit(main())
