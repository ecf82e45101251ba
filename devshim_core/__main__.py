from devshim_core.cli import main

raise SystemExit(main())
