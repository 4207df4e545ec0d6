"""`repsim extract`: extract per-block activations into a Zarr store (issue 6; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "extract per-block activations into a Zarr store"


def run(args) -> int:
    return not_implemented("extract", 6)
