"""`repsim train`: train a network under one of the nine objectives (issue 5; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "train a network under one of the nine objectives"


def run(args) -> int:
    return not_implemented("train", 5)
