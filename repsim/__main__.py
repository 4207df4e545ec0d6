from repsim.cli import main

raise SystemExit(main())
