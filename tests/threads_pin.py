"""The test process's BLAS/OpenMP thread count, fixed before any library reads it.

Loaded by ``-p threads_pin`` in pyproject's ``addopts`` (``pythonpath = ["tests"]`` makes it importable):
pytest imports ``-p`` plugins before the entry-point plugins, and one of those (``zarr.testing``)
imports NumPy, whose OpenBLAS reads ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` once, when it loads.
A ``setdefault`` in ``tests/conftest.py`` came too late: OpenBLAS ran one thread per core in the test
process while subprocesses and Dask workers got 1.

The count is the first of ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` that is set
(``OMP_NUM_THREADS=2 pytest`` runs the suite at two threads), else 1 (xdist's workers on a 2-core CI
machine would otherwise oversubscribe it); all three variables get it, so that every library loaded
later, and every subprocess, agrees.  Should NumPy be in the process already (a runner that imported it
before pytest), threadpoolctl sets the loaded libraries to the same count.  ``tests/test_blas.py``
checks that the pin holds inside a test.
"""
from __future__ import annotations

import os
import sys

VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pinned_threads() -> int:
    """The BLAS thread count of the test process: ``OPENBLAS_NUM_THREADS``, which OpenBLAS reads first."""
    return int(os.environ["OPENBLAS_NUM_THREADS"])


_threads = next((os.environ[v].strip() for v in VARS if os.environ.get(v, "").strip()), "1")
for _var in VARS:
    os.environ.setdefault(_var, _threads)

if "numpy" in sys.modules:  # too late for the environment: limit what is loaded
    from threadpoolctl import threadpool_limits

    _LIMITS = threadpool_limits(limits=int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")
