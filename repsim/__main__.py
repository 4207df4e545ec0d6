from repsim.commands.main import main

raise SystemExit(main())
