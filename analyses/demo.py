"""`repsim demo`: end-to-end demo on the scikit-learn digits set (issue 8; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "end-to-end demo on the scikit-learn digits set"


def run(args) -> int:
    return not_implemented("demo", 8)
