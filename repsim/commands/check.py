"""`repsim check`: validate activation stores: schema, completeness, alignment, NaN/Inf (issue 2; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "validate activation stores: schema, completeness, alignment, NaN/Inf"


def run(args) -> int:
    return not_implemented("check", 2)
