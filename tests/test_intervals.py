"""Intervals of every measure and route through the engine and the CLI over real Zarr stores
(:meth:`SimilarityResult.ci`): the exact route's delete-a-group jackknife replicates are the measures
recomputed on the stored columns with each group of examples left out, the interval is the formula's,
results round-trip, the minibatch route keeps its bootstrap over batches beside the jackknife of the
exact measures, and bad requests are refused in one line.  Coverage: tests/test_coverage.py."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import repsim
from repsim.engine.result import load_result
from repsim.kernels.measures import get_measure, measure_names
from repsim.kernels.measures.exact import exact_matrix, full_column
from repsim.kernels.jackknife import jackknife_groups, jackknife_interval, subset_column
from test_engine_helpers import correlated_layers, make_store, stored

N = 72
G = 6
OPTIONS = {"knn_k": 5}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("intervals")
    rng = np.random.default_rng(3)
    la = correlated_layers(rng, N, {"conv": (2, 6, 6), "fc": (9,)})  # conv: p = 72 >= n - |group| (the Gram route)
    lb = correlated_layers(rng, N, {"pool": (6,)})
    return [make_store(root / "a.zarr", {k: v.astype(np.float32) for k, v in la.items()}, chunk_rows=16),
            make_store(root / "b.zarr", {k: v.astype(np.float32) for k, v in lb.items()}, chunk_rows=24)]


def held(stores):
    return [(f"{s.name}/{layer}", stored(s, layer)) for s in stores for layer in s.layers]


def test_groups_partition_the_examples_at_random():
    parts = jackknife_groups(50, 7, seed=2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(50))
    assert {len(p) for p in parts} == {7, 8}
    assert not all(np.array_equal(p, np.arange(p[0], p[0] + len(p))) for p in parts)  # not contiguous blocks
    assert all(np.array_equal(a, b) for a, b in zip(parts, jackknife_groups(50, 7, seed=2)))
    with pytest.raises(ValueError, match="at least 5 groups"):
        jackknife_groups(50, 4)
    with pytest.raises(ValueError, match="at most one group per example"):
        jackknife_groups(6, 7)


def test_subset_of_a_gram_column_is_the_column_of_the_kept_rows():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(20, 30)) + 5.0  # p > n: the shifted-Gram route, rows far from the origin
    keep = np.sort(rng.choice(20, 14, replace=False))
    sub, direct = subset_column(full_column(X), keep), full_column(X[keep])
    assert sub.rows is None
    np.testing.assert_allclose(sub.centered_gram(), direct.centered_gram(), rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(sub.raw_gram(), direct.raw_gram(), rtol=1e-12)
    np.testing.assert_allclose(sub.row_sums(), direct.row_sums(), rtol=1e-12)


def test_interval_is_the_t_formula_of_the_replicates():
    rng = np.random.default_rng(5)
    est = np.array([[0.5, 0.2], [0.2, 0.9]])
    reps = est + 0.05 * rng.normal(size=(8, 2, 2))
    lo, hi = jackknife_interval(est, reps, 0.9, (0.0, 1.0))
    dev = reps - reps.mean(0)
    half = stats.t.ppf(0.95, 7) * np.sqrt(7 / 8 * (dev ** 2).sum(0))
    np.testing.assert_allclose(lo, np.clip(est - half, 0, 1), rtol=1e-14)
    np.testing.assert_allclose(hi, np.clip(est + half, 0, 1), rtol=1e-14)
    reps[3, 0, 1] = np.nan
    lo, hi = jackknife_interval(est, reps, 0.9)
    assert np.isnan(lo[0, 1]) and np.isnan(hi[0, 1]) and not np.isnan(lo[1, 0])
    with pytest.raises(ValueError, match="level"):
        jackknife_interval(est, reps, 1.5)


def test_exact_route_replicates_are_the_measures_without_each_group(stores, tmp_path):
    names = [m for m in measure_names() if m != "pwcca"]  # pwcca refuses p > n (the conv column)
    seed = 7
    res = repsim.similarity_matrix(stores, names, method="exact", jackknife=G, seed=seed, options=OPTIONS,
                                   progress=False)
    cols = held(stores)
    parts = jackknife_groups(N, G, seed)
    for name in names:
        m = get_measure(name, **OPTIONS)
        reps = res.jackknife[name]
        assert reps.shape == (G, len(cols), len(cols))
        for g, part in enumerate(parts):
            keep = np.setdiff1d(np.arange(N), part)
            want = exact_matrix(m, [full_column(x[keep], label) for label, x in cols]).values
            np.testing.assert_allclose(reps[g], want, rtol=1e-7, atol=1e-9, err_msg=f"{name}, group {g}")
        lo, hi = res.ci(name)
        assert lo.shape == hi.shape == res.matrix(name).shape
        ok = ~np.isnan(lo)
        assert ok.any(), name
        v = res.matrix(name)
        assert np.all(lo[ok] <= v[ok] + 1e-12) and np.all(v[ok] <= hi[ok] + 1e-12), name
        lo90, hi90 = res.ci(name, level=0.9)
        assert np.all(hi90[ok] - lo90[ok] <= hi[ok] - lo[ok] + 1e-12), name
    assert res.meta["jackknife"] == {"groups": G, "seed": seed, "measures": names}
    back = load_result(res.save(tmp_path / "r.npz"))
    for name in names:
        np.testing.assert_array_equal(back.jackknife[name], res.jackknife[name])
        for a, b in zip(back.ci(name), res.ci(name)):
            np.testing.assert_array_equal(a, b)


def test_minibatch_route_keeps_its_bootstrap_and_jackknifes_the_exact_measures(stores):
    res = repsim.similarity_matrix(stores, ["linear_cka", "procrustes"], jackknife=G, batch_size=8, epochs=1,
                                   progress=False)
    assert list(res.jackknife) == ["procrustes"] and res.meta["estimators"]["linear_cka"] == "minibatch"
    with pytest.warns(RuntimeWarning, match="undercovers"):  # 9 batches: the bootstrap says so
        lo, hi = res.ci("linear_cka", n_boot=200)
    v = res.matrix("linear_cka")
    assert np.all(lo <= v + 1e-12) and np.all(v <= hi + 1e-12) and np.any(hi > lo)
    plain = repsim.similarity_matrix(stores, ["procrustes"], method="exact", progress=False)
    with pytest.raises(ValueError, match=r"procrustes has no interval .*jackknife=G \(repsim similarity --jackknife G\)"):
        plain.ci("procrustes")
    with pytest.raises(ValueError, match="jackknife must be a number of groups >= 5"):
        repsim.similarity_matrix(stores, ["procrustes"], method="exact", jackknife=3, progress=False)
    with pytest.raises(ValueError, match="jackknife asks for 100 groups .* n = 72"):
        repsim.similarity_matrix(stores, ["procrustes"], method="exact", jackknife=100, progress=False)


def test_cli_jackknife(stores, tmp_path):
    out = tmp_path / "s.npz"
    run = subprocess.run([sys.executable, "-m", "repsim", "similarity", *[s.path for s in stores],
                          "--measures", "rsa,mutual_knn", "--knn-k", "5", "--jackknife", "5", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    res = load_result(out)
    assert set(res.jackknife) == {"rsa", "mutual_knn"} and res.jackknife["rsa"].shape[0] == 5
    bad = subprocess.run([sys.executable, "-m", "repsim", "similarity", *[s.path for s in stores],
                          "--jackknife", "2", "--out", str(tmp_path / "t.npz")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--jackknife: must be >= 5, got 2" in bad.stderr
