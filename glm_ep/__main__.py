from glm_ep.app.cli import main

raise SystemExit(main())
