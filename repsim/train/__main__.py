"""``python -m repsim.train`` (also under torchrun): same as ``repsim train``."""
import sys

from repsim.commands.main import main

raise SystemExit(main(["train", *sys.argv[1:]]))
