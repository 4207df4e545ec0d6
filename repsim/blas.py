"""The BLAS thread budget, spent on independent items instead of inside each BLAS call.

Many small products (one layer's Gram blocks, then its element-wise U-centring) scale badly when
each call is split over the BLAS library's threads: every call ends on a barrier, and the
element-wise work between calls runs on one core.  :func:`blas_thread_split` hands the caller the
number of threads NumPy's BLAS is configured to use (``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``
/ the core count) and sets BLAS to one thread meanwhile, so that the caller can run that many
Python threads, each doing single-threaded BLAS and NumPy element-wise work (both release the GIL):
the same cores, no barriers, and the element-wise work in parallel too.  Nested or concurrent
users share one setting (reference-counted); the original setting comes back when the last one
leaves.  Without threadpoolctl's control over the BLAS library the split is 1 (nothing changes);
so it is when the setting does not take — threadpoolctl (>= 3.8) lets only one thread at a time
change OpenBLAS's process-wide pool size (e.g. a ``threadpool_limits`` block open in another
thread) — so that k threads never run k-threaded BLAS each.  A split may be entered in one thread
and left in another (the last user out restores the setting), so each of its settings gives that
control back at once (:func:`_release_control`): otherwise the restore from a thread other than
the one that set one thread would be ignored, and BLAS would stay at one thread for the rest of
the process.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["blas_thread_split"]

_lock = threading.Lock()
_state: dict[str, Any] = {"depth": 0, "threads": 1, "limiter": None, "controller": None}


def _controller() -> Any:
    """threadpoolctl's view of the loaded thread pools, rebuilt when modules were imported since it
    was taken: an import can load another BLAS (SciPy ships its own OpenBLAS beside NumPy's), which
    an older view would leave multi-threaded inside the caller's threads."""
    ctl = _state["controller"]
    if ctl is None or _state.get("modules") != len(sys.modules):
        _state["modules"] = len(sys.modules)
        try:
            from threadpoolctl import ThreadpoolController

            ctl = ThreadpoolController()
        except Exception:  # noqa: BLE001 - no control: run sequentially
            ctl = False
        _state["controller"] = ctl
    return ctl


def _release_control() -> None:
    """Give back threadpoolctl's control of OpenBLAS's shared pool if this thread holds it.

    threadpoolctl >= 3.8 lets only the first thread that sets OpenBLAS's (pthreads) thread count
    change it until that thread clears its control or ends; settings from other threads are
    silently dropped.  Older threadpoolctl has no such control: nothing to do."""
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:  # no threadpoolctl, or one without per-library controllers
        return
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear()  # without force: only if this thread is the one in control


@contextmanager
def blas_thread_split() -> Iterator[int]:
    """Yield the BLAS thread count k (>= 1) with BLAS set to one thread until the block exits."""
    with _lock:
        if _state["depth"] == 0:
            ctl = _controller()
            blas = ctl.select(user_api="blas") if ctl else None
            libs = list(blas.lib_controllers) if blas else []
            k = max((int(lib.get_num_threads() or 1) for lib in libs), default=1)
            limiter = ctl.limit(limits=1, user_api="blas") if k > 1 else None
            if limiter is not None and any(int(lib.get_num_threads() or 1) > 1 for lib in libs):
                limiter.restore_original_limits()  # another thread controls the pool: run sequentially
                limiter, k = None, 1
            if k > 1:
                _release_control()
            _state["threads"], _state["limiter"] = max(1, k), limiter
        _state["depth"] += 1
        k = _state["threads"]
    try:
        yield k
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["limiter"] is not None:
                _state["limiter"].restore_original_limits()
                _state["limiter"] = None
                _release_control()
