"""`repsim check`: schema, completeness, alignment across stores, NaN/Inf counts, corruption."""
from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np

from repsim.commands.main import main
from repsim.store.check import check_stores
from repsim.store.writer import StoreWriter, save_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_store(path, n=300, seed=0, ids=None, labels=None, conv=None, **kw):
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((n, 4, 3, 3)).astype(np.float16) if conv is None else conv
    layers = {"conv": conv, "pool": rng.standard_normal((n, 16)).astype(np.float32)}
    labels = np.arange(n) % 5 if labels is None else labels
    return save_store(path, layers, labels, example_ids=ids, logits=rng.standard_normal((n, 5)), chunk_rows=64, **kw)


def run_check(capsys, *args):
    code = main(["check", "--no-progress", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line]


def test_good_stores_pass_with_table(tmp_path, capsys):
    make_store(tmp_path / "A.zarr", seed=0)
    make_store(tmp_path / "B.zarr", seed=1)
    code, out, err = run_check(capsys, tmp_path / "A.zarr", tmp_path / "B.zarr")
    assert code == 0, err
    assert err == []
    lines = out.splitlines()
    assert lines[0].split() == ["store", "layer", "shape", "dtype", "stored", "ratio", "NaN", "Inf"]
    rows = [line.split() for line in lines[2:-1]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("A", "conv", "300x4x3x3", "float16"), ("A", "pool", "300x16", "float32"), ("A", "logits", "300x5", "float32"),
        ("B", "conv", "300x4x3x3", "float16"), ("B", "pool", "300x16", "float32"), ("B", "logits", "300x5", "float32"),
    ]
    assert all(r[-2:] == ["0", "0"] for r in rows)
    assert lines[-1] == "2 store(s) OK"
    code, out, err = run_check(capsys, "--no-values", tmp_path / "A.zarr")  # says what it did not read
    assert code == 0 and out.splitlines()[-1].startswith("1 store(s) OK (metadata, ids and labels; --no-values read no")


def test_stored_size_and_compression_ratio(tmp_path):
    n = 4000
    save_store(tmp_path / "Z.zarr", {"zeros": np.zeros((n, 64), np.float32), "noise": np.random.default_rng(0).random((n, 64), dtype=np.float32)}, np.zeros(n, int))
    report = check_stores([tmp_path / "Z.zarr"], progress=False)
    assert report.ok
    by = {a.layer: a for a in report.arrays}
    assert by["zeros"].nbytes == by["noise"].nbytes == n * 64 * 4
    assert by["zeros"].ratio > 100  # all-zero chunks compress to a few bytes
    assert 0.9 < by["noise"].ratio < 1.3  # random mantissas barely compress
    assert by["noise"].stored >= n * 64 * 4 * 0.75


def test_different_example_ids_fail_naming_both(tmp_path, capsys):
    make_store(tmp_path / "A.zarr")
    ids = np.arange(300)
    ids[17], ids[200] = 1000, 1001
    make_store(tmp_path / "B.zarr", ids=ids)
    code, out, err = run_check(capsys, "--compare", tmp_path / "A.zarr", tmp_path / "B.zarr")
    assert code == 1
    assert "store B: example_ids differ from store A (first mismatch at row 17)" in err
    assert err[-1] == "repsim check: 1 problem(s)"
    assert "B" in out  # the table is still printed


def test_different_sizes_and_labels(tmp_path, capsys):
    make_store(tmp_path / "A.zarr")
    make_store(tmp_path / "short.zarr", n=250)
    labels = np.arange(300) % 5
    labels[42] = 4 if labels[42] != 4 else 3
    make_store(tmp_path / "C.zarr", labels=labels)
    code, _, err = run_check(capsys, "--compare", tmp_path / "A.zarr", tmp_path / "short.zarr", tmp_path / "C.zarr")
    assert code == 1
    assert "store short: 250 examples but store A has 300; example_ids differ" in err
    assert "store C: labels differ from store A (first mismatch at row 42)" in err


def test_incomplete_store_reported(tmp_path, capsys):
    make_store(tmp_path / "A.zarr")
    w = StoreWriter.create(tmp_path / "half.zarr", n=300, layers={"conv": ((4, 3, 3), np.float16)}, chunk_rows=64)
    for i in (0, 1):
        a, b = w.rows(i)
        w.write_chunk(i, layers={"conv": np.random.default_rng(i).standard_normal((b - a, 4, 3, 3))}, labels=np.arange(a, b) % 5, example_ids=np.arange(a, b))
    code, _, err = run_check(capsys, "--compare", tmp_path / "A.zarr", tmp_path / "half.zarr")
    assert code == 1
    assert err[0].startswith("store half: incomplete: 2 of 5 chunks written")
    # rows that were written agree with A, and unwritten (fill) rows are not reported as misaligned
    assert len(err) == 2, err


def test_nan_and_inf_counted_per_layer(tmp_path, capsys):
    conv = np.random.default_rng(0).standard_normal((300, 4, 3, 3)).astype(np.float16)
    conv[5, 0, 0, 0] = conv[250, 3, 2, 2] = np.nan
    conv[100, 1, 1, 1] = -np.inf
    make_store(tmp_path / "bad.zarr", conv=conv)
    code, out, err = run_check(capsys, tmp_path / "bad.zarr")
    assert code == 1
    assert "store bad: layer conv: 2 NaN and 1 Inf values" in err
    row = next(line.split() for line in out.splitlines() if line.startswith("bad") and " conv " in line)
    assert row[-2:] == ["2", "1"]


def test_corrupted_chunk_reported_with_layer_and_chunk(tmp_path, capsys):
    make_store(tmp_path / "A.zarr")
    f = tmp_path / "A.zarr" / "layers" / "pool" / "c" / "3" / "0"
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0x01
    f.write_bytes(bytes(raw))
    code, _, err = run_check(capsys, tmp_path / "A.zarr")
    assert code == 1
    assert any(line.startswith("store A: layers/pool: chunk 3 (rows 192:256) could not be read") for line in err), err


def test_deleted_chunk_reported(tmp_path, capsys):
    make_store(tmp_path / "A.zarr")
    (tmp_path / "A.zarr" / "layers" / "conv" / "c" / "1" / "0" / "0" / "0").unlink()
    code, _, err = run_check(capsys, tmp_path / "A.zarr")
    assert code == 1
    assert any(line.startswith("store A: layers/conv: chunk 1 (rows 64:128) is missing from disk") for line in err), err


def test_schema_problems(tmp_path, capsys):
    import zarr

    make_store(tmp_path / "ghost.zarr")
    g = zarr.open_group(str(tmp_path / "ghost.zarr"), mode="r+")
    g.attrs["layers"] = ["conv", "pool", "block9"]
    make_store(tmp_path / "dims.zarr")
    g = zarr.open_group(str(tmp_path / "dims.zarr"), mode="r+")
    old = g["layers/pool"][...]
    g["layers"].create_array("pool", shape=old.shape, chunks=(64, 16), dtype="float32", dimension_names=["n", "f"], overwrite=True)[...] = old
    g.attrs["dataset"] = {"n": 299}
    code, _, err = run_check(capsys, tmp_path / "ghost.zarr", tmp_path / "dims.zarr")
    assert code == 1
    assert err[0] == f"store ghost ({tmp_path / 'ghost.zarr'}): layer 'block9' is listed in attrs but has no array 'layers/block9'"
    assert "store dims: layer pool: dimension names ('n', 'f'), expected ('example', 'feature')" in err
    assert "store dims: attrs dataset.n = 299 but the store has 300 examples" in err


def test_not_a_store(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_check(capsys, tmp_path / "missing.zarr", tmp_path / "empty")
    assert code == 1
    assert err[0].startswith("store missing: ") and "does not exist" in err[0]
    assert err[1].startswith("store empty")


def test_duplicate_names_use_paths(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    make_store(tmp_path / "x" / "net.zarr")
    make_store(tmp_path / "y" / "net.zarr", ids=np.arange(300) + 1)
    code, _, err = run_check(capsys, "--compare", tmp_path / "x" / "net.zarr", tmp_path / "y" / "net.zarr")
    assert code == 1
    assert f"store {tmp_path / 'y' / 'net.zarr'}: example_ids differ from store {tmp_path / 'x' / 'net.zarr'} (first mismatch at row 0)" in err


def test_scan_is_streamed(tmp_path):
    # 16 chunks of 1 MiB; the NaN/Inf scan holds one chunk (plus zarr's decode buffers) at a time
    rows, width, n = 1024, 256, 16 * 1024
    x = np.random.default_rng(0).random((n, width), dtype=np.float32)
    save_store(tmp_path / "big.zarr", {"f": x}, np.zeros(n, int), chunk_rows=rows)
    del x
    check_stores([tmp_path / "big.zarr"], progress=False)  # warm imports and caches
    tracemalloc.start()
    try:
        report = check_stores([tmp_path / "big.zarr"], progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok and report.arrays[0].nan == 0
    chunk = rows * width * 4
    # measured ~4.2 chunks: zarr's read path (compressed bytes, crc-stripped copy, decompressed
    # buffer, output) plus the NaN/Inf masks; reading the layer whole would need >= 16
    assert peak < 6 * chunk, peak / chunk


def test_console_exit_code(tmp_path):
    make_store(tmp_path / "A.zarr")
    make_store(tmp_path / "B.zarr", ids=np.arange(300)[::-1].copy())
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "repsim", "check", "--compare", str(tmp_path / "A.zarr"),
                        str(tmp_path / "B.zarr")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1
    assert "store B: example_ids differ from store A (first mismatch at row 0)" in r.stderr


def test_stores_of_other_data_are_each_checked_on_their_own(tmp_path, capsys):
    """A model's train, holdout and test stores: three good stores (one note saying how they differ),
    unless --compare says they are meant to be compared; the --allow-mixed-datasets hint only then."""
    make_store(tmp_path / "test.zarr", meta={"dataset": {"name": "digits", "split": "test"}})
    make_store(tmp_path / "train.zarr", n=400, ids=np.arange(400) + 1000, meta={"dataset": {"name": "digits", "split": "train"}})
    code, out, err = run_check(capsys, tmp_path / "test.zarr", tmp_path / "train.zarr")
    assert code == 0, err
    assert out.splitlines()[-1] == "2 store(s) OK"
    assert len(err) == 1 and err[0].startswith("note: the stores hold different examples or data (store train: other data")
    assert "--compare" in err[0] and "--allow-mixed-datasets" not in err[0]
    code, _, err = run_check(capsys, "--compare", tmp_path / "test.zarr", tmp_path / "train.zarr")
    assert code == 1 and "pass --allow-mixed-datasets if they hold the same examples" in err[0]
    assert err[-1] == "repsim check: 1 problem(s)"


def test_logits_kept_as_a_layer_are_listed_once(tmp_path, capsys):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((100, 5)).astype(np.float32)
    z[3, 1] = np.nan
    save_store(tmp_path / "L.zarr", {"pool": rng.standard_normal((100, 8)).astype(np.float32), "logits": z},
               np.arange(100) % 5, logits=z, chunk_rows=64)
    code, out, err = run_check(capsys, tmp_path / "L.zarr")
    rows = [line.split() for line in out.splitlines()[2:] if line.startswith("L ")]
    assert [r[1] for r in rows] == ["pool", "logits"]
    assert rows[1][-2:] == ["1", "0"]  # its NaN counted once, in its one row
    assert code == 1 and "store L: layer logits: 1 NaN and 0 Inf values" in err
