"""similarity_matrix over real Zarr stores: every measure's exact route equals the in-memory measure on
the stored data, minibatch linear + RBF CKA share one pass (and linear CKA equals cka_matrix), resume
and distributed runs give the same result, results round-trip through load_result, and the CLI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import repsim
from repsim.kernels.measures import get_measure, measure_names
from repsim.kernels.measures.exact import exact_matrix, full_column
from test_engine_helpers import correlated_layers, make_store, stored

N = 130


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    rng = np.random.default_rng(0)
    la = correlated_layers(rng, N, {"conv": (4, 8, 8), "fc": (17,)})  # conv: p = 256 > n (the Gram route)
    lb = correlated_layers(rng, N, {"pool": (9,)})
    return [make_store(root / "a.zarr", {k: v.astype(np.float32) for k, v in la.items()}, chunk_rows=16),
            make_store(root / "b.zarr", {k: v.astype(np.float32) for k, v in lb.items()}, chunk_rows=24)]


def in_memory(stores):
    return [full_column(stored(s, layer), f"{s.name}/{layer}") for s in stores for layer in s.layers]


def test_exact_route_equals_the_in_memory_measures(stores):
    names = measure_names()
    names.remove("pwcca")  # conv is wider than n: refused, tested below
    res = repsim.similarity_matrix(stores, names, method="exact", progress=False)
    assert res.measures == names and res.meta["estimators"] == {m: "exact" for m in names}
    cols = in_memory(stores)
    for m in names:
        want = exact_matrix(get_measure(m), cols).values
        np.testing.assert_allclose(res.matrix(m), want, atol=1e-6, rtol=0, err_msg=m)
        assert res.info(m)["name"] == m
    cka = repsim.cka_matrix(stores, method="exact", progress=False)
    np.testing.assert_array_equal(res.matrix("linear_cka"), cka.values)


def test_pwcca_refuses_a_wide_column_in_one_line(stores):
    with pytest.raises(ValueError, match="pwcca needs the features of a/conv"):
        repsim.similarity_matrix(stores, ["pwcca"], method="exact", progress=False)
    got = repsim.similarity_matrix(stores, ["pwcca"], layers={"a": ["fc"], "b": ["pool"]}, method="exact",
                                   progress=False)
    assert got.matrix("pwcca").shape == (2, 2) and got.matrix("pwcca")[0, 0] == pytest.approx(1.0)


def test_minibatch_linear_and_rbf_in_one_pass(stores, tmp_path):
    kw = dict(batch_size=40, epochs=2, seed=3, progress=False)
    both = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka", "procrustes"], **kw)
    assert both.meta["estimators"] == {"linear_cka": "minibatch", "rbf_cka": "minibatch", "procrustes": "exact"}
    alone = repsim.cka_matrix(stores, **kw)
    # with RBF CKA every column enters as its centred Gram (formed once for both): the same linear CKA
    np.testing.assert_allclose(both.matrix("linear_cka"), alone.values, atol=1e-7)
    rbf = repsim.similarity_matrix(stores, ["rbf_cka"], **kw)
    np.testing.assert_allclose(both.matrix("rbf_cka"), rbf.matrix("rbf_cka"), atol=1e-12)
    assert np.allclose(np.diag(both.matrix("rbf_cka")), 1.0)
    lo, hi = both.ci("rbf_cka", n_boot=50)
    assert np.all(lo <= both.matrix("rbf_cka") + 1e-9) and np.all(hi >= both.matrix("rbf_cka") - 1e-9)
    path = both.save(tmp_path / "sim.npz")
    back = repsim.load_result(path)
    assert back.measures == both.measures and back.index == both.index
    for m in both.measures:
        np.testing.assert_array_equal(back.matrix(m), both.matrix(m))
    np.testing.assert_array_equal(back.ci("rbf_cka", n_boot=50)[0], lo)
    cka_file = alone.save(tmp_path / "cka.npz")
    assert repsim.load_result(cka_file).measures == ["linear_cka"]


def test_resume_and_distributed_give_the_same_result(stores, tmp_path):
    kw = dict(batch_size=40, seed=1, progress=False, checkpoint_every=1)
    ckpt = tmp_path / "s.ckpt.npz"
    repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=1, checkpoint=ckpt, **kw)
    resumed = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, checkpoint=ckpt, **kw)
    fresh = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, **kw)
    for m in fresh.measures:
        np.testing.assert_array_equal(resumed.matrix(m), fresh.matrix(m))
    # bit-identical given the same BLAS thread count per process (docs/architecture.md): Dask's workers
    # run one (its nanny's pre-spawn environment), so this process does too, whatever the suite's pin
    with threadpool_limits(limits=1, user_api="blas"):
        fresh = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, **kw)
    with repsim.engine.scheduler.scheduler("local:1"):
        remote = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], epochs=2, **kw)
    for m in fresh.measures:
        np.testing.assert_array_equal(remote.matrix(m), fresh.matrix(m))


def test_constant_column_is_nan_with_one_line_per_measure(tmp_path, capfd):
    rng = np.random.default_rng(5)
    layers = correlated_layers(rng, 60, {"x": (6,), "flat": (5,)})
    layers["flat"][:] = 1.5
    store = make_store(tmp_path / "c.zarr", {k: v.astype(np.float32) for k, v in layers.items()}, chunk_rows=16)
    got = repsim.similarity_matrix(store, ["rbf_cka", "rsa", "mutual_knn"], batch_size=20, epochs=1, progress=False)
    err = capfd.readouterr().err
    for m in got.measures:
        k = [c[1] for c in got.index].index("flat")
        assert np.isnan(got.matrix(m)[k]).all() and got.meta["undefined"][m]["columns"] == ["c/flat"]
        assert err.count(f"{m} is undefined") == 1


def test_undefined_columns_are_reported_with_the_measures_own_condition(tmp_path, capfd):
    """Beyond constant columns: a zero median distance (rbf_cka: most examples all zero), too few
    examples for k (mutual_knn), one feature (rsa): each line says that condition, not "constant"."""
    rng = np.random.default_rng(6)
    sparse = np.zeros((40, 5))
    sparse[:10] = rng.normal(size=(10, 5))  # 75 % of the examples all zero: the median distance is 0
    layers = {"x": rng.normal(size=(40, 6)), "sparse": sparse, "one": rng.normal(size=(40, 1))}
    store = make_store(tmp_path / "u.zarr", {k: v.astype(np.float32) for k, v in layers.items()}, chunk_rows=16)
    repsim.similarity_matrix(store, ["rbf_cka", "rsa"], method="exact", progress=False)
    err = capfd.readouterr().err
    assert "rbf_cka is undefined (NaN, blank in figures) for 1 column(s): u/sparse; a column has no rbf_cka when it " \
           "is constant over the examples, or with a median squared distance of 0" in err
    assert "rsa is undefined (NaN, blank in figures) for 1 column(s): u/one;" in err and "at least 2 features" in err
    repsim.similarity_matrix(store, ["mutual_knn"], method="exact", options={"knn_k": 39}, progress=False)
    err = capfd.readouterr().err
    assert "for 3 column(s)" in err and "too few examples for knn_k = 39" in err
    with pytest.raises(ValueError, match="unknown option.*'topk' for mutual_knn"):
        repsim.similarity_matrix(store, ["mutual_knn"], method="exact", options={"topk": 5}, progress=False)


def test_cli_similarity(stores, tmp_path):
    out = tmp_path / "s.npz"
    paths = [s.path for s in stores]
    run = subprocess.run([sys.executable, "-m", "repsim", "similarity", *paths, "--measures",
                          "linear_cka,rbf_cka,mutual_knn", "--batch-size", "40", "--epochs", "1",
                          "--knn-k", "5", "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    res = repsim.load_result(out)
    assert res.measures == ["linear_cka", "rbf_cka", "mutual_knn"] and res.info("mutual_knn")["options"]["knn_k"] == 5
    # the values: the in-memory API with the same settings (the CLI's defaults are the API's)
    api = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka", "mutual_knn"], batch_size=40, epochs=1,
                                   options={"knn_k": 5}, progress=False)
    assert res.index == api.index
    for m in api.measures:
        np.testing.assert_allclose(res.matrix(m), api.matrix(m), rtol=0, atol=1e-12, err_msg=m)
    knn6 = repsim.similarity_matrix(stores, ["mutual_knn"], options={"knn_k": 6}, progress=False)
    assert not np.allclose(knn6.matrix("mutual_knn"), res.matrix("mutual_knn"))  # --knn-k took effect
    again = subprocess.run([sys.executable, "-m", "repsim", "similarity", *paths, "--measures", "nope",
                            "--out", str(tmp_path / "t.npz")], capture_output=True, text=True)
    assert again.returncode == 2 and "unknown measure 'nope'" in again.stderr


@pytest.mark.parametrize("device", [None, "device1"])
def test_minibatch_rbf_on_a_device_equals_the_cpu(stores, device, monkeypatch):
    """similarity_matrix(device=array-api-strict) — its CPU device and device1 (blocks uploaded there;
    np.asarray refused, as for CuPy) — gives the CPU's linear and RBF CKA, with one copy to the host
    per measure and batch: the RBF Grams are made on the device."""
    xps = pytest.importorskip("array_api_strict")
    from test_engine_helpers import consecutive_batches, strict_device

    # float64 Grams on both routes (float32 stores: the CPU would form float32 Grams, strict float64 ones)
    kw = dict(batch_size=40, epochs=1, shuffle=False, progress=False, compute_dtype="float64")
    ref = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], **kw)
    count = strict_device(monkeypatch, None if device is None else xps.Device(device))
    got = repsim.similarity_matrix(stores, ["linear_cka", "rbf_cka"], device=xps, **kw)
    for m in ("linear_cka", "rbf_cka"):
        np.testing.assert_allclose(got.matrix(m), ref.matrix(m), atol=1e-9, rtol=0, err_msg=m)
    assert count["host"] == 2 * len(consecutive_batches(N, 40))


@pytest.mark.parametrize("flag, value, measure, option, default", [
    ("--rbf-threshold", "0.5", "rbf_cka", "rbf_threshold", 1.0),
    ("--knn-k", "4", "mutual_knn", "knn_k", 10),
    ("--rsa-max-rows", "60", "rsa", "rsa_max_rows", 2000),  # below n = 130: a seeded subsample
    ("--ridge-folds", "3", "ridge_r2", "ridge_folds", 5),
])
def test_cli_measure_options_run_with_valid_values(stores, tmp_path, flag, value, measure, option, default):
    """Each measure option run once with a valid value (their refusals: tests/test_refusals.py): the file
    records it, its values are the in-memory API's with that option, and differ from the default's."""
    from repsim.commands.main import main

    out = tmp_path / "o.npz"
    rc = main(["similarity", *[s.path for s in stores], "--measures", measure, "--batch-size", "40", "--epochs", "1",
               "--seed", "2", flag, value, "--no-progress", "--out", str(out)])
    assert rc == 0
    got = repsim.load_result(out)
    typed = type(default)(value)
    assert got.info(measure)["options"][option] == typed
    seeded = {"rsa_seed": 2} if measure == "rsa" else {"ridge_seed": 2} if measure == "ridge_r2" else {}
    kw = dict(batch_size=40, epochs=1, seed=2, progress=False)
    api = repsim.similarity_matrix(stores, [measure], options={option: typed, **seeded}, **kw)
    np.testing.assert_allclose(got.matrix(measure), api.matrix(measure), rtol=0, atol=1e-12)
    plain = repsim.similarity_matrix(stores, [measure], options={option: default, **seeded}, **kw)
    assert not np.allclose(got.matrix(measure), plain.matrix(measure), rtol=0, atol=1e-6)
