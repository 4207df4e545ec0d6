"""Best-of timing shared by the benchmarks."""
from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeats: int, warmup: bool = True,
            sync: Callable[[], object] | None = None) -> float:
    """Best wall time of ``repeats`` calls of ``fn``, after one warm-up call (imports, page cache,
    cuDNN autotuning, allocators) when ``warmup``; ``sync`` (e.g. a device synchronisation) ends each
    timed call and the warm-up."""
    if warmup:
        fn()
        if sync is not None:
            sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best
