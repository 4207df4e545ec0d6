"""Give the C heap's free pages back to the operating system between batches (glibc's ``malloc_trim``).

The host readers and ``MinibatchCKA.update`` allocate and free arrays of a few MiB on several
threads, batch after batch.  glibc serves them from per-thread arenas once its dynamic mmap threshold
has risen past their size, and the freed chunks, fragmented across arenas, stay resident: a long run
over a large store then peaks higher than a short one over a small store (``repsim cka`` with default
chunks: 264 → 308 MiB from n = 20k to 80k, bench/memory.py).  ``malloc_trim(0)`` after each group of
batches returns those pages (``madvise`` on free chunks, not only the top of the heap): 319 → 335 MiB,
at no measurable cost in time (a fixed 4 MiB mmap threshold flattened it too, but cost 5-9 % in page
faults).  Elsewhere than glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

__all__ = ["release_free_memory"]

_trim: Any = None


def release_free_memory() -> None:
    """``malloc_trim(0)`` where the C library is glibc; a no-op elsewhere (looked up once)."""
    global _trim
    if _trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _trim = getattr(libc, "malloc_trim", False)
        except OSError:
            _trim = False
    if _trim:
        _trim(0)
