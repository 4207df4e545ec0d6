"""The environment matrix inside `make test`: the suite runs on this machine's defaults, and these tests
rerun targeted parts of it under the other side of two environment switches users' machines differ on,
so that a tolerance tied to one BLAS kernel, or analyses tied to one pandas string storage, fail here
first (issue 25: an AVX-512 OpenBLAS kernel and pandas 3 with pyarrow broke tests that passed on CI).

- BLAS: the numerical tests (kernels, probes, solver) under a second OpenBLAS core type
  (``OPENBLAS_CORETYPE``: another summation order, vector width and FMA use than the default's).
- pandas: the analyses' tests with strings stored the other way (pyarrow vs Python objects;
  ``REPSIM_TEST_PANDAS_STRINGS``, applied and checked by ``tests/conftest.py``).

Each runs pytest in a subprocess on one core (about 25 s and 50 s on an idle 2-core machine).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pandas_string_storage

ROOT = Path(__file__).resolve().parents[1]

# The files whose checks are closest to a kernel's rounding: CKA against brute force at tight tolerances, and
# the L-BFGS probe, whose stopping rule once stalled on OpenBLAS's AVX-512 kernel (repsim.probes._logreg).
# The other numerical files (multilabel and calibration probes share that solver; collapse, separation,
# spectra, sparsity, stats) stay on the default kernel: rerunning them doubled this test's time (51 s on CI)
# for code whose tolerances no kernel has broken.
NUMERICAL = ["tests/test_cka.py", "tests/test_logreg_solver.py", "tests/test_probes.py"]
# Every item rendered from results files (the pandas 3 + pyarrow break, c7f375b, was in one of them) and
# the recipes' tables; the store items' full report (test_analyses_stores.py, 40 s) reads its strings
# from store metadata through the same repsim.analyses.data frames.
ANALYSES = ["tests/test_analyses_figures.py", "tests/test_analyses_recipes.py"]

_ARCH = "import threadpoolctl; print(*[i['architecture'] for i in threadpoolctl.threadpool_info() " \
        "if i.get('internal_api') == 'openblas'][:1])"


def _openblas_arch(env: dict[str, str] | None = None) -> str:
    """The core type of the first OpenBLAS that NumPy and SciPy load ("" without OpenBLAS)."""
    code = "import numpy, scipy.linalg; " + _ARCH
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def second_core_type(current: str, cpu_flags: set[str]) -> str | None:
    """Another OpenBLAS core type this CPU runs: Haswell (AVX2 + FMA) unless that is the current one,
    then SkylakeX (AVX-512) where the CPU has it, else Sandybridge (AVX) or Prescott (SSE3)."""
    cur = current.lower()
    if cur != "haswell" and {"avx2", "fma"} <= cpu_flags:
        return "Haswell"
    if cur not in ("skylakex", "cooperlake", "sapphirerapids") and {"avx512f", "avx512bw", "avx512dq",
                                                                      "avx512vl"} <= cpu_flags:
        return "SkylakeX"
    if cur != "sandybridge" and "avx" in cpu_flags:
        return "Sandybridge"
    return "Prescott" if cur != "prescott" and "pni" in cpu_flags else None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def test_second_core_type_rule():
    avx512 = {"avx", "avx2", "fma", "pni", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
    assert second_core_type("SkylakeX", avx512) == "Haswell"
    assert second_core_type("Haswell", avx512) == "SkylakeX"
    assert second_core_type("Zen", {"avx", "avx2", "fma", "pni"}) == "Haswell"
    assert second_core_type("Haswell", {"avx", "avx2", "fma", "pni"}) == "Sandybridge"
    assert second_core_type("Prescott", {"pni"}) is None


def _pytest(files: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", "COV_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_numerical_tests_under_a_second_openblas_kernel():
    current = _openblas_arch()
    if not current:
        pytest.skip("NumPy's BLAS is not OpenBLAS: OPENBLAS_CORETYPE has no effect")
    other = os.environ.get("REPSIM_TEST_CORETYPE") or second_core_type(current, _cpu_flags())
    if other is None:
        pytest.skip(f"no second OpenBLAS core type for this CPU (running {current})")
    env = dict(os.environ, OPENBLAS_CORETYPE=other)
    got = _openblas_arch(env)
    assert got.lower() == other.lower(), f"OPENBLAS_CORETYPE={other} did not take (OpenBLAS runs {got})"
    r = _pytest(NUMERICAL, env, timeout=600)
    assert r.returncode == 0, f"under OPENBLAS_CORETYPE={other} (default {current}):\n{r.stdout[-4000:]}"


@pytest.mark.slow
def test_analyses_with_the_other_pandas_string_storage():
    here = pandas_string_storage()
    other = "python" if here == "pyarrow" else "pyarrow"
    if other == "pyarrow":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            pytest.skip("pyarrow is not installed (it is in the [dev] extra): pip install pyarrow")
    r = _pytest(ANALYSES, dict(os.environ, REPSIM_TEST_PANDAS_STRINGS=other), timeout=600)
    assert r.returncode == 0, f"with pandas strings stored as {other} (here: {here}):\n{r.stdout[-4000:]}"
