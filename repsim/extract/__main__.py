"""``python -m repsim.extract`` (also under torchrun): same as ``repsim extract``."""
import sys

from repsim.commands.main import main

raise SystemExit(main(["extract", *sys.argv[1:]]))
