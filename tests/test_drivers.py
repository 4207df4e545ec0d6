"""Streaming drivers (R², sparsity, collapse, spectra by layer) vs the in-memory kernels."""
from __future__ import annotations

import csv

import numpy as np
import pytest

import repsim
from repsim.engine.drivers import (DISTANCES, collapse_rows, layer_metrics, separation_rows, sparsity_rows,
                                   spectra_arrays)
from repsim.results import write_csv
from repsim.kernels.spectra import activation_spectrum, centroid_spectrum, weight_spectrum
from test_engine_helpers import make_store, stored

N, K = 157, 5


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """A store with a post-ReLU conv block (sparse), a penultimate layer and a final-layer head."""
    root = tmp_path_factory.mktemp("drivers")
    rng = np.random.default_rng(0)
    y = np.concatenate([np.arange(K), rng.integers(0, K, N - K)])  # every class present
    means = rng.normal(size=(K, 8)) * 1.5
    pool = (means[y] + rng.normal(size=(N, 8)) + 4.0).astype(np.float32)  # large mean: centring matters
    conv = np.maximum(rng.normal(size=(N, 3, 4, 4)) + 0.4 * y[:, None, None, None] - 0.8, 0).astype(np.float16)
    W = rng.normal(size=(K, 8)).astype(np.float32)
    meta = {"model": {"arch": "toy", "objective": "softmax", "seed": 3}}
    store = make_store(root / "toy.zarr", {"block1": conv, "pool": pool}, labels=y, chunk_rows=20,
                       head=(W, np.zeros(K, np.float32)), meta=meta)
    return store, y, W


def test_separation_all_distances_match_in_memory_kernel(net):
    store, y, _ = net
    res = layer_metrics(store.path, distances=DISTANCES, progress=False, blocks_per_task=2)
    for layer in ("block1", "pool"):
        X = stored(store, layer).astype(np.float64)
        for d in DISTANCES:
            want = repsim.class_separation(X.reshape(N, -1), y, distance=d)
            assert res[("toy", layer)]["separation"][d] == pytest.approx(want, rel=1e-9, abs=1e-12)
    # cosine_centered really centres (differs from cosine on the large-mean pool layer)
    assert abs(res[("toy", "pool")]["separation"]["cosine_centered"]
               - res[("toy", "pool")]["separation"]["cosine"]) > 1e-3


def test_separation_spatial_mean(net):
    store, y, _ = net
    res = layer_metrics(store.path, ["block1"], distances=("cosine",), spatial="mean", progress=False)
    X = stored(store, "block1").astype(np.float64).mean(axis=(2, 3))
    assert res[("toy", "block1")]["separation"]["cosine"] == pytest.approx(repsim.class_separation(X, y), rel=1e-9)


def test_sparsity_matches_kernel_exactly(net):
    store, _, _ = net
    res = layer_metrics(store.path, sparsity=True, progress=False, blocks_per_task=3)
    X = stored(store, "block1")
    assert res[("toy", "block1")]["sparsity"] == repsim.nonzero_fraction(X)  # integer counts: exact
    np.testing.assert_array_equal(res[("toy", "block1")]["sparsity_per_channel"],
                                  repsim.nonzero_fraction_per_channel(X))
    assert 0.05 < res[("toy", "block1")]["sparsity"] < 0.95


def test_collapse_on_pool_uses_stored_head_and_spectra(net):
    store, y, W = net
    rows, spectra = collapse_rows(store.path, spectra=True, progress=False)
    H = stored(store, "pool").astype(np.float64)
    want = repsim.collapse_metrics(H, y, W.astype(np.float64))
    assert "self_duality" in want and len(rows) == 1
    row = rows[0]
    assert (row["store"], row["objective"], row["seed"], row["layer"]) == ("toy", "softmax", 3, "pool")
    for key, value in want.items():
        assert row[key] == pytest.approx(value, rel=1e-8, abs=1e-12), key
    np.testing.assert_allclose(spectra["toy/pool/activations"], activation_spectrum(H), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(spectra["toy/pool/centroids"], centroid_spectrum(H, y), rtol=1e-9, atol=1e-12)  # rank C-1
    np.testing.assert_allclose(spectra["toy/pool/weights"], weight_spectrum(W.astype(np.float64)), rtol=1e-6)
    assert spectra_arrays(store.path, progress=False).keys() == spectra.keys()


def test_a_cosine_heads_weights_enter_collapse_and_spectra_normalised(net, tmp_path):
    """A cosine softmax head's logits are sim(W_k, x)/τ + b_k (Eq. 7): its row norms never reach the
    output, so Table E.2's weight statistics and Fig. E.2's weight spectrum see W_k / ‖W_k‖ (the paper:
    Std‖w‖/Avg‖w‖ = 0); other objectives' heads are used as stored."""
    store, y, W = net
    scaled = W * np.arange(1, K + 1, dtype=np.float32)[:, None]  # rows of very different norms
    pool = stored(store, "pool")
    rows = {}
    for objective in ("cosine_softmax", "softmax"):
        s = make_store(tmp_path / f"{objective}.zarr", {"pool": pool}, labels=y, chunk_rows=20,
                       head=(scaled, np.zeros(K, np.float32)), meta={"model": {"objective": objective, "seed": 0}})
        (rows[objective],), spectra = collapse_rows(s.path, spectra=True, progress=False)
        W64 = scaled.astype(np.float64)
        used = W64 / np.linalg.norm(W64, axis=1, keepdims=True) if objective == "cosine_softmax" else W64
        want = repsim.collapse_metrics(pool.astype(np.float64), y, used)
        for key in ("norm_cv_weights", "cos_std_weights", "equiangular_weights", "self_duality"):
            assert rows[objective][key] == pytest.approx(want[key], rel=1e-8, abs=1e-12), (objective, key)
        np.testing.assert_allclose(spectra[f"{objective}/pool/weights"], weight_spectrum(used), rtol=1e-6)
    assert rows["cosine_softmax"]["norm_cv_weights"] == pytest.approx(0.0, abs=1e-7)
    assert rows["softmax"]["norm_cv_weights"] > 0.3


def test_collapse_refuses_huge_scatter_matrices(tmp_path):
    x = np.zeros((8, 130, 130), np.float16)
    store = make_store(tmp_path / "wide.zarr", {"conv": x})
    with pytest.raises(ValueError, match="spatial='mean'"):
        layer_metrics(store.path, collapse=True, progress=False)


def test_tables_have_contract_columns(net, tmp_path):
    store, _, _ = net
    sep = separation_rows([store.path], distances=("cosine", "sqeuclidean"), progress=False)
    spa = sparsity_rows([store.path], progress=False)
    meta = ["dataset", "split", "n", "spatial", "method", "engine_spatial"]  # estimator metadata
    assert list(sep[0]) == ["store", "objective", "seed", "layer", "distance", "r2", *meta] and len(sep) == 4
    assert list(spa[0]) == ["store", "objective", "seed", "layer", "nonzero_fraction", *meta] and len(spa) == 2
    assert {k: sep[0][k] for k in meta} == {"dataset": "", "split": "", "n": N, "spatial": "", "method": "exact",
                                            "engine_spatial": "flatten"}
    mean = separation_rows([store.path], ["block1"], spatial="mean", progress=False)[0]
    assert mean["engine_spatial"] == "mean" and mean["n"] == N
    path = write_csv(sep, tmp_path / "separation.csv")
    with open(path) as fh:
        back = list(csv.DictReader(fh))
    assert back[0]["objective"] == "softmax" and float(back[0]["r2"]) == pytest.approx(sep[0]["r2"])


def _flat(d, pre=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{pre}{k}.")
        else:
            yield pre + k, v


# (options, layers, passes, host copies per layer, block and pass): one per accumulator
DEVICE_CASES = {
    "cosine": (dict(distances=("cosine",)), ["block1", "pool"], 1, 1),
    "sqeuclidean": (dict(distances=("sqeuclidean",)), ["block1", "pool"], 1, 1),
    "cosine_centered": (dict(distances=("cosine_centered",)), ["block1", "pool"], 2, 1),
    "sparsity (conv: raw blocks)": (dict(sparsity=True), ["block1", "pool"], 1, 1),
    "collapse": (dict(collapse=True), ["pool"], 1, 1),
    "spectra": (dict(spectra=True), ["pool"], 1, 2),
    "collapse, spatial=mean": (dict(collapse=True, spatial="mean"), ["block1"], 1, 1),
    "raw and rows fed together": (dict(distances=("cosine",), sparsity=True, spectra=True), ["block1", "pool"], 1, 4),
}


@pytest.mark.parametrize("case", list(DEVICE_CASES))
@pytest.mark.parametrize("device", [None, "device1"])
def test_array_namespace_device(net, case, device, monkeypatch):
    """Every per-layer metric on the device route (array-api-strict: its CPU device, and device1, where
    an array made without ``device=`` fails to mix with the uploaded blocks; ``np.asarray`` refused as
    for CuPy) equals the CPU route; each block of each layer is uploaded once per pass (also when
    sparsity reads the raw conv block and the others its features) and reaches the host once per
    accumulator — its checks ride with its statistics — however many blocks there are."""
    xps = pytest.importorskip("array_api_strict")
    from test_engine_helpers import strict_device

    store, _, _ = net
    opts, layers, passes, copies = DEVICE_CASES[case]
    ref = layer_metrics(store.path, layers, progress=False, **opts)
    count = strict_device(monkeypatch, None if device is None else xps.Device(device))
    got = layer_metrics(store.path, layers, progress=False, device=xps, **opts)
    n_blocks = -(-N // 20)
    assert count["upload"] == n_blocks * len(layers) * passes
    assert count["host"] == n_blocks * len(layers) * passes * copies
    assert got.keys() == ref.keys()
    for key in ref:
        want, have = dict(_flat(ref[key])), dict(_flat(got[key]))
        assert have.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(np.asarray(have[k], dtype=float), np.asarray(want[k], dtype=float),
                                       rtol=1e-9, atol=1e-12, err_msg=f"{key} {k}")


def test_device_route_reports_bad_blocks_with_the_host_messages(monkeypatch):
    """The checks kept on the device until the batch's copy to the host raise the host's errors."""
    xps = pytest.importorskip("array_api_strict")
    from repsim.kernels.collapse import CollapseStats
    from repsim.kernels.separation import ClassSeparation
    from repsim.kernels.sparsity import Sparsity

    dev = xps.Device("device1")
    X = np.abs(np.random.default_rng(1).normal(size=(12, 4))) + 1.0
    y = np.arange(12) % 3
    nan, zero = X.copy(), X.copy()
    nan[2, 1] = np.nan
    zero[5] = 0.0
    put = lambda a: xps.asarray(a, device=dev)  # noqa: E731
    for d in ("cosine", "sqeuclidean", "cosine_centered"):
        with pytest.raises(ValueError, match="L contains NaN or infinite values"):
            ClassSeparation(3, d, name="L").update(put(nan), y)
    with pytest.raises(ValueError, match="L: 1 row\\(s\\) are all zero; cosine similarity is undefined"):
        ClassSeparation(3, "cosine", name="L").update(put(zero), y)
    with pytest.raises(ValueError, match="contains NaN"):
        CollapseStats(3, name="L").update(put(nan), y)
    with pytest.raises(ValueError, match="L contains NaN"):
        Sparsity("L").update(put(nan))
    acc = ClassSeparation(3, "cosine", name="L").update(put(X), y)  # and nothing was added by a refused batch
    with pytest.raises(ValueError):
        acc.update(put(zero), y)
    assert acc.moments.n == 12


def test_layers_are_grouped_into_passes_by_state_size(net):
    """A tight memory budget splits the layers into one pass each, with identical results."""
    from repsim.engine.drivers import group_layers, requested, state_bytes
    from repsim.engine.blocks import resolve_columns

    store, _, _ = net
    _, cols, _ = resolve_columns([store.path])
    metrics = requested(distances=("cosine",), sparsity=True)
    sizes = [state_bytes(c, metrics, K, "flatten") for c in cols]
    assert sizes == [8 * (K * 48 + 3), 8 * (K * 8 + 8)]  # K·P means + C channel counts
    assert [len(g) for g in group_layers(cols, sizes, sum(sizes))] == [2]
    assert [len(g) for g in group_layers(cols, sizes, max(sizes))] == [1, 1]
    one = layer_metrics(store.path, distances=("cosine",), sparsity=True, progress=False)
    split = layer_metrics(store.path, distances=("cosine",), sparsity=True, progress=False, memory_budget=1)
    for key in one:
        assert split[key]["separation"] == one[key]["separation"]
        assert split[key]["sparsity"] == one[key]["sparsity"]
