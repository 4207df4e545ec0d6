"""`repsim separation`: class separation R^2 per layer (issue 4; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "class separation R^2 per layer"


def run(args) -> int:
    return not_implemented("separation", 4)
