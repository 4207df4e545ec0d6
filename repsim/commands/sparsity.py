"""`repsim sparsity`: fraction of non-zero activations per layer (issue 4; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "fraction of non-zero activations per layer"


def run(args) -> int:
    return not_implemented("sparsity", 4)
