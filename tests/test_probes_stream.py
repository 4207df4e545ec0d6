"""The out-of-core probes (issue 31) give the in-memory probes' numbers: linear probe to the solver's
tolerance, kNN exactly; `repsim probe --memory-budget 0` forces them on stores."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from repsim.commands.main import main
from repsim.probes import _logreg
from repsim.probes.rows import Rows
from repsim.probes.knn import knn_probe, knn_probe_rows
from repsim.probes.linear import linear_probe, linear_probe_rows
from repsim.store.writer import save_store


def relu_features(n, p, k, seed=0, sep=1.0, noise=1.0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    rng.shuffle(y)
    means = rng.normal(size=(k, p)) * sep
    return np.maximum(means[y] + noise * rng.normal(size=(n, p)) + 0.5, 0.0).astype(np.float32), y


def test_linear_streamed_matches_in_memory():
    X, y = relu_features(600, 24, 4, seed=1, sep=0.5, noise=1.5)
    Xt, yt = relu_features(300, 24, 4, seed=2, sep=0.5, noise=1.5)
    lambdas = np.logspace(-4, 3, 15)
    ref = linear_probe(X, y, Xt, yt, lambdas=lambdas)
    # blocks of 64 rows: every product is a pass over 10 blocks, rows gathered out of order
    got = linear_probe_rows(Rows.from_array(X, block_rows=64), y, Rows.from_array(Xt, block_rows=64), yt,
                            lambdas=lambdas)
    assert got.info["streamed"] and not ref.info["streamed"]
    assert got.best_param == ref.best_param and got.curve == ref.curve and got.accuracy == ref.accuracy
    np.testing.assert_array_equal(got.predictions, ref.predictions)
    # the refit stops at max|∇| <= 1e-4·f in both routes: the weights agree to about that
    assert np.abs(got.coef_ - ref.coef_).max() <= 1e-3 * np.abs(ref.coef_).max()


def test_wide_layer_needs_no_n_by_n_gram(monkeypatch):
    """P > N: above GRAM_BYTES the probe takes the identity basis (no N × N Gram), same optimum."""
    X, y = relu_features(80, 200, 3, seed=3)
    Xt, yt = relu_features(60, 200, 3, seed=4)
    lambdas = np.logspace(-1, 3, 5)
    ref = linear_probe(X, y, Xt, yt, lambdas=lambdas, refit_tol=1e-7)
    monkeypatch.setattr(_logreg, "GRAM_BYTES", 80 * 80 * 8 - 1)
    with pytest.raises(ValueError, match="wider than n"):
        _logreg.rotate(X)
    got = linear_probe(X, y, Xt, yt, lambdas=lambdas, refit_tol=1e-7)
    assert got.info["streamed"] and got.best_param == ref.best_param
    np.testing.assert_array_equal(got.predictions, ref.predictions)
    assert np.abs(got.coef_ - ref.coef_).max() <= 1e-3 * np.abs(ref.coef_).max()


def test_knn_streamed_is_exact():
    X, y = relu_features(500, 16, 5, seed=5, sep=0.4)
    Xt, yt = relu_features(200, 16, 5, seed=6, sep=0.4)
    ref = knn_probe(X, y, Xt, yt, ks=[1, 3, 10, 50])
    # 7 training blocks, query blocks of 4 rows: many merges of the running top-k
    got = knn_probe_rows(Rows.from_array(X, block_rows=77), y, Rows.from_array(Xt, block_rows=33), yt,
                         ks=[1, 3, 10, 50], query_bytes=4 * 4 * 77)
    assert got.curve == ref.curve and got.best_param == ref.best_param and got.accuracy == ref.accuracy
    np.testing.assert_array_equal(got.predictions, ref.predictions)


def _stores(tmp_path, seed=0, n=(240, 120), nan_row=None):
    out = {}
    for split, m in zip(("train", "test"), n):
        X, y = relu_features(m, 12, 3, seed=seed + (split == "test"), sep=0.8)
        if nan_row is not None and split == "train":
            X[nan_row, 2] = np.nan
        out[split] = save_store(tmp_path / f"net_{split}.zarr", {"pool": X}, y, chunk_rows=50,
                                logits=X[:, :3] * 2.0,
                                meta={"model": {"objective": "softmax", "seed": seed},
                                      "dataset": {"name": "toy", "split": split}})
    return out


def _rows(path):
    return [{k: r[k] for k in ("probe", "accuracy", "best_param", "n", "train_n")}
            for r in csv.DictReader(open(path, newline=""))]


@pytest.mark.parametrize("cache", [0, 6000])
def test_cli_out_of_core_equals_in_memory(tmp_path, monkeypatch, cache):
    """--memory-budget 0: out of core; ``cache`` bytes of training rows kept (the default budget keeps
    half of it; here part of the 240 × 12 float32 rows, the rest read on every pass)."""
    from repsim.probes import writers

    monkeypatch.setattr(writers, "cache_bytes", lambda budget_mib: cache)
    s = _stores(tmp_path)
    base = ["--train", s["train"].path, "--test", s["test"].path, "--lambdas", "9", "--ks", "1", "5", "20",
            "--no-progress"]
    assert main(["probe", *base, "--out", str(tmp_path / "mem")]) == 0
    assert main(["probe", *base, "--memory-budget", "0", "--out", str(tmp_path / "ooc")]) == 0
    assert _rows(tmp_path / "ooc" / "probes.csv") == _rows(tmp_path / "mem" / "probes.csv")
    rel = ["--relearn", s["train"].path, "--per-class", "5", "--lambdas", "9", "--no-progress"]
    assert main(["probe", *rel, "--out", str(tmp_path / "rmem")]) == 0
    assert main(["probe", *rel, "--memory-budget", "0", "--out", str(tmp_path / "rooc")]) == 0
    assert _rows(tmp_path / "rooc" / "probes.csv") == _rows(tmp_path / "rmem" / "probes.csv")


def test_cli_out_of_core_refuses_nan_naming_the_store(tmp_path, capsys):
    s = _stores(tmp_path, nan_row=137)
    assert main(["probe", "--train", s["train"].path, "--test", s["test"].path, "--memory-budget", "0",
                 "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"store {s['train'].name}: layer 'pool' holds 1 NaN/Inf value(s) in 1 row(s) (first: row 137)" in err


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_calibration_streamed_matches_in_memory(kind):
    from repsim.probes.calibration import calibration_report, calibration_report_rows

    rng = np.random.default_rng(7)
    y, yh = rng.integers(0, 5, 300), rng.integers(0, 5, 200)
    z = 3.0 * (rng.normal(size=(300, 5)) + 1.5 * np.eye(5)[y])
    zh = 3.0 * (rng.normal(size=(200, 5)) + 1.5 * np.eye(5)[yh])
    ref = calibration_report(z, y, zh, yh, kind=kind)
    got = calibration_report_rows(Rows.from_array(z, block_rows=23), y, Rows.from_array(zh, block_rows=23), yh,
                                  kind=kind)
    for key in ("nll", "ece", "temperature", "nll_ts", "ece_ts"):
        assert got[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), key
    assert got["top1"] == np.mean(z.argmax(1) == y) and got["holdout_top1"] == np.mean(zh.argmax(1) == yh)



@pytest.mark.slow  # n = 3,000 and 12,000 in fresh processes, per probe kind
@pytest.mark.parametrize("command", [["--probe", "linear", "--lambdas", "3"], ["--probe", "knn", "--ks", "1", "5"],
                                     ["--relearn", "--lambdas", "3"]])
def test_out_of_core_probe_memory_is_flat_in_n(tmp_path, monkeypatch, command):
    """Peak traced memory of `repsim probe --memory-budget 0` at n = 3,000 and 12,000 (width 256): the
    growth stays far below what holding the layer would add (9,000 × 256 × 16 bytes ≈ 35 MiB; one
    float32 copy: 9 MiB). Measured in a fresh process (RSS, bench/probe.py): flat too."""
    import tracemalloc

    from repsim.probes import knn

    monkeypatch.setattr(knn, "QUERY_BYTES", 1 << 20)  # 262 queries per block: both sizes above the cap
    peaks = []
    for n in (3000, 12000):
        X, y = relu_features(n, 256, 3, seed=n)
        kw = dict(chunk_rows=1000, meta={"model": {"objective": "softmax", "seed": 0}})
        tr = save_store(tmp_path / f"tr{n}.zarr", {"pool": X.astype(np.float16)}, y, logits=X[:, :3], **kw)
        te = save_store(tmp_path / f"te{n}.zarr", {"pool": X[: n // 4].astype(np.float16)}, y[: n // 4],
                        example_ids=np.arange(n // 4) + n, **kw)
        stores = [tr.path] if "--relearn" in command else ["--train", tr.path, "--test", te.path]
        tracemalloc.start()
        try:
            assert main(["probe", *stores, *command, "--memory-budget", "0", "--no-progress",
                         "--out", str(tmp_path / "o")]) == 0
            peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
        finally:
            tracemalloc.stop()
    assert peaks[1] - peaks[0] < 4, peaks


@pytest.mark.parametrize("cache_rows", [0, 250, 600])
def test_cached_rows_give_the_uncached_numbers(cache_rows):
    """The out-of-core caches (``Rows.cache_bytes``: decoded blocks; ``_streamed.CenteredCache``: the
    linear probe's centred rows) hold the values a pass computes: none, part (250 of 600 rows) or
    all of the training rows cached give the in-memory probes' numbers, and the cache stays within
    its bytes."""
    from repsim.probes import _streamed

    X, y = relu_features(600, 24, 4, seed=1, sep=0.5, noise=1.5)
    Xt, yt = relu_features(300, 24, 4, seed=2, sep=0.5, noise=1.5)
    lambdas = np.logspace(-4, 3, 15)
    cache = cache_rows * 24 * 4
    ref = linear_probe(X, y, Xt, yt, lambdas=lambdas)
    rows = Rows.from_array(X.astype(np.float16), block_rows=64, cache_bytes=cache)
    got = linear_probe_rows(rows, y, Rows.from_array(Xt.astype(np.float16), block_rows=64), yt, lambdas=lambdas)
    ref16 = linear_probe(X.astype(np.float16), y, Xt.astype(np.float16), yt, lambdas=lambdas)
    assert got.best_param == ref16.best_param and got.curve == ref16.curve and got.accuracy == ref16.accuracy
    np.testing.assert_array_equal(got.predictions, ref16.predictions)
    assert np.abs(got.coef_ - ref16.coef_).max() <= 1e-3 * np.abs(ref16.coef_).max()
    assert rows._cached_bytes == 0          # the linear probe keeps its centred rows, not the blocks
    problem = _streamed.streamed_problem(rows, np.random.default_rng(0).permutation(600))
    assert problem.stats["cached_rows"] == min(cache_rows, 600)
    assert sum(b.nbytes for b in (problem.Xh.cache.blocks if problem.Xh.cache else [])) <= cache
    # the kNN search keeps decoded training blocks (float32, read-only) up to cache bytes
    knn_ref = knn_probe(X, y, Xt, yt, ks=[1, 5, 20])
    krows = Rows.from_array(X, block_rows=64, cache_bytes=cache)
    kgot = knn_probe_rows(krows, y, Rows.from_array(Xt, block_rows=50), yt, ks=[1, 5, 20], query_bytes=4 * 4 * 64)
    assert kgot.curve == knn_ref.curve and kgot.accuracy == knn_ref.accuracy
    np.testing.assert_array_equal(kgot.predictions, knn_ref.predictions)
    sizes = [(min(600, (i + 1) * 64) - i * 64) * 24 * 4 for i in range(krows.n_blocks)]
    kept = int(np.searchsorted(np.cumsum(sizes), cache, side="right"))   # the first blocks that fit
    assert set(range(kept)) <= set(krows._cache) and krows._cached_bytes == sum(sizes[i] for i in krows._cache) <= cache
    assert all(not b.flags.writeable for b in krows._cache.values())
    np.testing.assert_array_equal(np.concatenate([x for _, x in krows.blocks()]), X)
