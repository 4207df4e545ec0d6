"""Shared test configuration."""
from __future__ import annotations

import os

# Keep BLAS single-threaded per xdist worker so parallel tests do not oversubscribe the 2 CI cores.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
