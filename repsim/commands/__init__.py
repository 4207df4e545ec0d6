"""The ``repsim`` command line: :mod:`repsim.commands.main` (the entry point) and one module per
analysis subcommand (``HELP``, ``configure(parser)``, ``run(args)``).

May import every other layer (imported inside ``run``, so ``repsim --help`` stays fast).
"""
