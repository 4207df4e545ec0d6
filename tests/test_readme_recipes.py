"""README.md's recipes, read from README.md and run: what a new user copies must work as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import repsim
from test_engine_helpers import correlated_layers, make_store

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _line(pattern: str) -> str:
    lines = [ln.strip() for ln in README.splitlines() if re.search(pattern, ln)]
    assert lines, f"README.md has no line matching {pattern!r}"
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    layers = correlated_layers(rng, 40, {"block16": (4, 3, 3), "pool": (6,)})
    return make_store(tmp_path_factory.mktemp("readme") / "cos-s0.zarr", layers, labels=np.arange(40) % 4,
                      chunk_rows=10)


def test_xarray_recipe(store):
    pytest.importorskip("xarray")
    code = _line(r"\.to_xarray\(").split("#")[0]
    da = eval(code.split("=", 1)[1].replace("stores/cos-s0.zarr", store.path), {"repsim": repsim})
    assert da.dims == ("example", "channel", "y", "x")  # the stores' dimension_names
    np.testing.assert_array_equal(da["example"].values, store.example_ids)
    np.testing.assert_array_equal(da["label"].values, store.labels)
    np.testing.assert_array_equal(da.values, np.asarray(store.layer("block16")))
    assert da.name == "block16"


def test_result_save_load_recipe(store, tmp_path):
    res = repsim.cka_matrix([store.path], batch_size=20, epochs=1, progress=False)
    code = _line(r"CKAResult\.load\(").split("#")[0].replace("cka.npz", str(tmp_path / "cka.npz"))
    env = {"repsim": repsim, "res": res}
    exec(code, env)
    np.testing.assert_array_equal(env["res"].values, res.values)
    assert env["res"].index == res.index


def test_extract_recipe_names_a_checkpoint_training_writes():
    """The README's extraction line names a file that `repsim train` writes (repsim/train/loop.py)."""
    name = Path(re.search(r"--checkpoint (\S+\.pt)", _line(r"^repsim extract --checkpoint runs/")).group(1)).name
    loop = (ROOT / "train" / "loop.py").read_text()
    assert f'"{name}"' in loop, f"README extracts {name}, which repsim/train/loop.py never writes"


def test_check_exit_status_of_a_missing_store_is_as_documented(tmp_path):
    row = _line(r"^\| a missing, incomplete, corrupted or misaligned store")
    documented = int(re.search(r"`check`: (\d)", row).group(1))
    r = subprocess.run([sys.executable, "-m", "repsim", "check", str(tmp_path / "nope.zarr")],
                       capture_output=True, text=True)
    assert r.returncode == documented, r.stderr
    assert "does not exist" in r.stdout + r.stderr
