"""Calibrated similarity through the engine and the CLI over real Zarr stores: the exact route's nulls are
the in-memory nulls of the stored columns for every measure, the minibatch route's are the within-batch
nulls of its batch plan, resumed / distributed / device runs equal a fresh CPU run, results round-trip,
and bad requests are refused in one line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import repsim
from repsim.engine.blocks import BatchPlan
from repsim.engine.result import load_result
from repsim.kernels.measures import get_measure, measure_names
from repsim.kernels.measures.exact import full_column
from repsim.kernels.measures.exact import exact_null
from repsim.kernels.minibatch_null import MinibatchNull
from repsim.kernels.permutation import calibrate
from test_engine_helpers import correlated_layers, make_store, stored

N = 96


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    rng = np.random.default_rng(0)
    la = correlated_layers(rng, N, {"conv": (3, 6, 6), "fc": (11,)})  # conv: p = 108 > n (the Gram route)
    lb = correlated_layers(rng, N, {"pool": (7,)})
    lb["noise"] = rng.normal(size=(N, 5))
    return [make_store(root / "a.zarr", {k: v.astype(np.float32) for k, v in la.items()}, chunk_rows=16),
            make_store(root / "b.zarr", {k: v.astype(np.float32) for k, v in lb.items()}, chunk_rows=24)]


def columns(stores):
    return [full_column(stored(s, layer), f"{s.name}/{layer}") for s in stores for layer in s.layers]


def test_exact_route_nulls_are_the_in_memory_nulls(stores, tmp_path):
    names = [m for m in measure_names() if m != "pwcca"]
    K, seed = 19, 5
    res = repsim.similarity_matrix(stores, names, method="exact", permutations=K, seed=seed, options={"knn_k": 5},
                                   progress=False)
    cols = columns(stores)
    groups = [0] * len(stores[0].layers) + [1] * len(stores[1].layers)
    for name in names:
        m = get_measure(name, knn_k=5)
        prep = [m.prepare(c) for c in cols]
        want = exact_null(m, prep, groups, K, seed, N)
        np.testing.assert_allclose(res.null(name), want, atol=1e-6, rtol=0, err_msg=name)
        top = m.info.range[1]
        cal, p, tau = calibrate(res.matrix(name), res.null(name), 0.05, top if np.isfinite(top) else None)
        np.testing.assert_array_equal(res.pvalues(name), p)
        np.testing.assert_array_equal(res.threshold(name), tau)
        np.testing.assert_array_equal(res.calibrated(name), cal)
        assert res.pvalues(name).shape == res.matrix(name).shape
    assert res.meta["calibration"]["permutations"] == K and res.meta["calibration"]["alpha"] == 0.05
    back = load_result(res.save(tmp_path / "r.npz"))
    for name in names:
        for what in ("pvalues", "threshold", "calibrated", "null"):
            np.testing.assert_array_equal(getattr(back, what)(name), getattr(res, what)(name))


def test_minibatch_route_is_the_within_batch_null_of_its_plan(stores):
    K, seed, b = 29, 2, 24
    res = repsim.similarity_matrix(stores, ["linear_cka"], batch_size=b, epochs=1, shuffle=False,
                                   permutations=K, seed=seed, compute_dtype="float64", progress=False)
    cols = [stored(s, layer).astype(np.float64).reshape(N, -1) for s in stores for layer in s.layers]
    groups = [0] * len(stores[0].layers) + [1] * len(stores[1].layers)
    acc = MinibatchNull(len(cols), groups, K, seed)
    plan = BatchPlan(n=N, batch_size=b, shuffle="none", seed=seed, block_rows=16)
    for g, group in enumerate(plan.groups(0)):
        for i, rows in enumerate(group.batches):
            acc.update([c[rows] for c in cols], key=(0, g, i))
    obs, null = acc.result()
    np.testing.assert_allclose(res.null("linear_cka"), null, atol=1e-12)
    np.testing.assert_allclose(res.calibration["linear_cka"]["observed"], res.matrix("linear_cka"), atol=1e-12)
    assert res.pvalues("linear_cka")[0, 1] == pytest.approx(1 / (K + 1))  # conv and fc share a code


def test_resume_distributed_and_device_give_the_fresh_result(stores, tmp_path, monkeypatch):
    kw = dict(batch_size=24, seed=1, progress=False, checkpoint_every=1, permutations=19)
    ckpt = tmp_path / "c.ckpt.npz"
    repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=1, checkpoint=ckpt, **kw)
    resumed = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, checkpoint=ckpt, **kw)
    fresh = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, **kw)
    for m in fresh.measures:
        np.testing.assert_array_equal(resumed.null(m), fresh.null(m))
        np.testing.assert_array_equal(resumed.pvalues(m), fresh.pvalues(m))
    with repsim.engine.scheduler.scheduler("local:1"):
        remote = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, **kw)
    for m in fresh.measures:
        np.testing.assert_array_equal(remote.null(m), fresh.null(m))
    xps = pytest.importorskip("array_api_strict")
    from test_engine_helpers import strict_device

    kw64 = dict(kw, epochs=1, compute_dtype="float64")
    ref = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], **kw64)
    strict_device(monkeypatch, xps.Device("device1"))
    dev = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], device=xps, **kw64)
    for m in ref.measures:
        np.testing.assert_allclose(dev.null(m), ref.null(m), atol=1e-9, rtol=0, err_msg=m)


def test_the_minibatch_null_uses_the_first_epoch(stores):
    """Later epochs re-pair the same examples: the null (and its observed values) come from epoch 0 alone."""
    kw = dict(batch_size=24, seed=6, progress=False, permutations=19)
    one = repsim.similarity_matrix(stores, ["linear_cka"], epochs=1, **kw)
    three = repsim.similarity_matrix(stores, ["linear_cka"], epochs=3, **kw)
    for what in ("null", "pvalues", "threshold", "calibrated"):
        np.testing.assert_array_equal(getattr(three, what)("linear_cka"), getattr(one, what)("linear_cka"))
    assert three.meta["calibration"]["minibatch_batches"] == one.meta["n_batches"] == three.meta["n_batches"] // 3


def test_analytic_null_on_both_routes(stores):
    for method in ("exact", "minibatch"):
        res = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], method=method, batch_size=24, epochs=1,
                                       null="analytic", progress=False)
        p = res.pvalues("linear_cka")
        assert p[0, 1] < 1e-6  # conv and fc share a code
        assert res.calibrated("linear_cka")[0, 1] > 0
        tau = res.threshold("linear_cka")
        assert np.all(tau[~np.isnan(tau)] < 0.3)
        with pytest.raises(ValueError, match="analytic .*no draws"):
            res.aggregate("linear_cka", "a", "b")


@pytest.mark.parametrize("kw, message", [
    (dict(permutations=0), "permutations must be an integer >= 1"),
    (dict(permutations=100, alpha=1.5), r"alpha must lie in \(0, 1\)"),
    (dict(permutations=10), "cannot reach alpha = 0.05.*use at least 19 permutations"),
    (dict(null="analytic", measures=["mutual_knn"]), "no analytic null for mutual_knn"),
    (dict(null="analytic", permutations=99), "the analytic null uses no permutations"),
])
def test_bad_requests_are_refused_in_one_line(stores, kw, message):
    kw = dict(kw)
    measures = kw.pop("measures", ["linear_cka"])
    with pytest.raises(ValueError, match=message) as err:
        repsim.similarity_matrix(stores, measures, method="exact", progress=False, **kw)
    assert "\n" not in str(err.value)


def test_a_result_without_a_null_says_how_to_get_one(stores):
    res = repsim.similarity_matrix(stores, ["linear_cka"], method="exact", progress=False)
    with pytest.raises(ValueError, match="--permutations K"):
        res.pvalues("linear_cka")


def test_cli_calibration(stores, tmp_path):
    paths = [s.path for s in stores]
    out = tmp_path / "s.npz"
    run = subprocess.run([sys.executable, "-m", "repsim", "similarity", *paths, "--measures", "linear_cka,mutual_knn",
                          "--method", "exact", "--knn-k", "5", "--permutations", "19", "--seed", "3", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "linear_cka: " in run.stderr and "significant at alpha = 0.05 (19 permutations)" in run.stderr
    res = load_result(out)
    assert res.pvalues("mutual_knn").shape == (4, 4) and res.meta["calibration"]["seed"] == 3
    for args, message in [(["--permutations", "10"], "cannot reach alpha = 0.05"),
                          (["--permutations", "0"], "--permutations"),
                          (["--permutations", "99", "--alpha", "2"], "alpha must lie in (0, 1)"),
                          (["--null", "analytic", "--measures", "rsa"], "no analytic null for rsa")]:
        bad = subprocess.run([sys.executable, "-m", "repsim", "similarity", *paths, *args,
                              "--out", str(tmp_path / "t.npz")], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
