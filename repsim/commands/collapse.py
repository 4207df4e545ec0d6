"""`repsim collapse`: neural-collapse / simplex-ETF metrics (issue 4; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "neural-collapse / simplex-ETF metrics"


def run(args) -> int:
    return not_implemented("collapse", 4)
