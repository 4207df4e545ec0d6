"""Shared test configuration."""
from __future__ import annotations

import os

# Keep BLAS single-threaded per xdist worker so parallel tests do not oversubscribe the 2 CI cores.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")


def pytest_configure(config) -> None:
    # Most test stores are anonymous on purpose (save_store without example_ids or a dataset name);
    # tests/test_refusals.py checks the warning that such stores get.
    config.addinivalue_line("filterwarnings", "ignore:store .* example_ids default to:UserWarning")
