"""``python -m train`` (also under torchrun): same as ``repsim train``."""
import sys

from repsim.cli import main

raise SystemExit(main(["train", *sys.argv[1:]]))
