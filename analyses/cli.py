"""`repsim figures`: regenerate the paper's figures and tables from stores and results (issue 8; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "regenerate the paper's figures and tables from stores and results"


def run(args) -> int:
    return not_implemented("figures", 8)
