"""`repsim cka`: minibatch CKA between every (store, layer) pair (issue 4; not implemented yet)."""
from __future__ import annotations

from repsim.commands import no_arguments as configure, not_implemented

HELP = "minibatch CKA between every (store, layer) pair"


def run(args) -> int:
    return not_implemented("cka", 4)
