"""`repsim probe`: linear and kNN transfer probes on stored features (issue 7; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "linear and kNN transfer probes on stored features"


def run(args) -> int:
    return not_implemented("probe", 7)
