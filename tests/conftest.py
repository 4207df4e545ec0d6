"""Shared test configuration."""
from __future__ import annotations

import importlib.abc
import os
import sys

import pytest

# BLAS threads: pinned by tests/threads_pin.py (``-p threads_pin`` in pyproject's addopts), which runs
# before the plugins that import NumPy; too late here.

# Hypothesis: "ci" (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples on every run
# (derandomize: a red CI is reproducible and a green one is not luck of the draw); "dev", the default,
# draws new ones each run, as Hypothesis does. Neither has a deadline: a loaded 2-core machine is no bug.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
_hypothesis_settings.register_profile("dev", deadline=None)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The storage of pandas' inferred strings, for tests/test_env_matrix.py's runs: "python" hides pyarrow
# (pandas 3 then keeps str columns in Python objects), "pyarrow" turns on pandas 2's
# future.infer_string (pandas 3's default with pyarrow installed). Checked in pytest_configure.
PANDAS_STRINGS = os.environ.get("REPSIM_TEST_PANDAS_STRINGS", "")


class _HidePyarrow(importlib.abc.MetaPathFinder):
    """``import pyarrow`` raises ModuleNotFoundError, as where it is not installed (a None entry in
    sys.modules would do the same for imports but not for code that looks it up there, e.g. sklearn)."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - the finder protocol
        if name.split(".")[0] == "pyarrow":
            raise ModuleNotFoundError(f"No module named {name!r} (REPSIM_TEST_PANDAS_STRINGS=python)", name=name)
        return None


if PANDAS_STRINGS == "python":
    sys.meta_path.insert(0, _HidePyarrow())


def pandas_string_storage() -> str:
    """Where pandas keeps a column of strings it infers: "pyarrow", "python" or "object" (pandas 2)."""
    import pandas as pd

    dtype = pd.Series(["a"]).dtype
    storage = str(getattr(dtype, "storage", "object"))
    return "pyarrow" if storage == "pyarrow_numpy" else storage  # pandas 2.2 names Arrow strings so


def pytest_configure(config) -> None:
    if PANDAS_STRINGS == "pyarrow":
        import pandas as pd

        if int(pd.__version__.split(".")[0]) < 3:
            pd.options.future.infer_string = True
    if PANDAS_STRINGS and pandas_string_storage() not in ((PANDAS_STRINGS, "object") if PANDAS_STRINGS == "python"
                                                           else (PANDAS_STRINGS,)):
        raise pytest.UsageError(f"REPSIM_TEST_PANDAS_STRINGS={PANDAS_STRINGS} did not take: pandas stores "
                                f"strings as {pandas_string_storage()}")
    # Most test stores are anonymous on purpose (save_store without example_ids or a dataset name);
    # tests/test_refusals.py checks the warning that such stores get.
    config.addinivalue_line("filterwarnings", "ignore:store .* example_ids default to:UserWarning")


@pytest.fixture(autouse=True)
def _fresh_batched_dgemm_flag(monkeypatch):
    """Each test starts with CuPy's batched DGEMM not yet written off (repsim.kernels._cka_device
    ``_BATCHED_UNAVAILABLE`` is process-wide): a test that switched it off must not change how a
    later test in the same worker runs."""
    module = sys.modules.get("repsim.kernels._cka_device")
    if module is not None:
        monkeypatch.setattr(module, "_BATCHED_UNAVAILABLE", [])
