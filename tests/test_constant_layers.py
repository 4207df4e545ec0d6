"""A layer that holds the same value in every example (float16 rounding a tiny variance away, or a
zero-initialised head): `extract` and `check` say so on real stores, naming the layer and the fix, and
the analyses give NaN for it instead of refusing the whole matrix (tests/test_engine_errors.py)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repsim.extract import extract_store  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402

import repsim  # noqa: E402


class Squash(torch.nn.Module):
    """1e-9·x: varies in float32, zero everywhere once rounded to float16 (smallest subnormal 6e-8)."""

    def forward(self, x):
        return 1e-9 * x


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), Squash(), torch.nn.Flatten(),
                               torch.nn.Linear(144, 10))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_extract_warns_when_float16_rounds_a_layer_to_a_constant(tmp_path, capfd, dtype):
    path = tmp_path / f"{dtype}.zarr"
    extract_store(_model(), "digits", path, split="test", batch_size=64, progress=False, dtype=dtype)
    err = capfd.readouterr().err
    pool = np.asarray(open_store(path).layer("pool"))
    if dtype == "float16":
        assert (pool == pool[:1]).all()
        assert "1 layer(s) hold the same value in every example: pool" in err and "--dtype float32" in err
    else:
        assert not (pool == pool[:1]).all() and "same value in every example" not in err


def test_check_names_a_constant_layer_and_cka_leaves_it_blank(tmp_path, capfd):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 5)).astype(np.float32)
    path = tmp_path / "s.zarr"
    repsim.save_store(path, layers={"x": x, "flat": np.full((60, 3), 1.0 + 1e-9, np.float32)},
                      labels=np.arange(60) % 3, dtype="float16", meta={"dataset": {"name": "t", "split": "test"}})
    r = subprocess.run([sys.executable, "-m", "repsim", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 0  # a warning, not a broken store
    assert "layer flat holds the same value in every example" in r.stderr and "--dtype float32" in r.stderr
    assert "layer x holds" not in r.stderr
    res = repsim.cka_matrix([str(path)], batch_size=20, epochs=1, progress=False)
    assert np.isnan(res.values[1]).all() and res.values[0, 0] == pytest.approx(1.0)
