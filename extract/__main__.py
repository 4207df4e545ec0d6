"""``python -m extract`` (also under torchrun): same as ``repsim extract``."""
import sys

from repsim.cli import main

raise SystemExit(main(["extract", *sys.argv[1:]]))
