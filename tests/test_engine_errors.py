"""Bad data in stores (docs/architecture.md "Numerics"): NaN/inf, constant layers and empty classes give a
ValueError naming the store and layer, on every engine path (minibatch CKA with narrow columns and
with wide columns reduced to Gram factors, exact CKA on both routes, the streaming drivers)."""
from __future__ import annotations

import numpy as np
import pytest

import repsim
from test_engine_helpers import correlated_layers, make_store

N = 60


@pytest.fixture(scope="module")
def layers():
    # wide: p = 300 >= 4 b (Gram factor in minibatch CKA, Gram route in exact CKA); narrow: p = 5
    return correlated_layers(np.random.default_rng(0), N, {"wide": (300,), "narrow": (5,)})


@pytest.mark.parametrize("bad", ["wide", "narrow"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_values_name_store_and_layer(tmp_path, layers, bad, value):
    data = {k: v.astype(np.float32) for k, v in layers.items()}
    data[bad][37, 3] = value
    store = make_store(tmp_path / "broken.zarr", data, chunk_rows=10)
    with pytest.raises(ValueError, match=f"broken/{bad}.*NaN or infinite"):
        repsim.cka_matrix(store, batch_size=20, epochs=1, shuffle=False, progress=False)
    with np.errstate(all="ignore"), pytest.raises(ValueError, match=f"NaN or infinite.*broken/{bad}"):
        repsim.cka_matrix(store, method="exact", progress=False)
    with pytest.raises(ValueError, match=f"broken/{bad}.*NaN or infinite"):
        repsim.layer_metrics(store.path, [bad], distances=("cosine",), sparsity=True, progress=False)


@pytest.mark.parametrize("bad", ["wide", "narrow"])
def test_float32_values_whose_products_overflow_are_named_not_read_as_zero_or_constant(tmp_path, layers, bad):
    """|x| ~ 1e20 in float32: finite values whose squares overflow float32 Grams. Named as such (the
    in-memory CKA returned 0.0 and the engine called the layer constant), by every float32 route."""
    data = {k: v.astype(np.float32) for k, v in layers.items()}
    data[bad] = (layers[bad] * 1e20).astype(np.float32)
    assert np.isfinite(data[bad]).all()
    store = make_store(tmp_path / "huge.zarr", data, chunk_rows=10)
    with np.errstate(all="ignore"):
        with pytest.raises(ValueError, match=f"huge/{bad}.*(too large for float32|overflow)"):
            repsim.cka_matrix(store, batch_size=20, epochs=1, shuffle=False, progress=False)
        for debiased in (False, True):
            with pytest.raises(ValueError, match="too large for float32 products"):
                repsim.linear_cka(data[bad], data["narrow" if bad == "wide" else "wide"], debiased=debiased)
        scaled = repsim.linear_cka(data[bad].astype(np.float64) / 1e20, layers["narrow" if bad == "wide" else "wide"])
        assert scaled == pytest.approx(repsim.linear_cka(layers[bad], layers["narrow" if bad == "wide" else "wide"]), rel=1e-6)


@pytest.mark.parametrize("method", ["minibatch", "exact"])
@pytest.mark.parametrize("flat", ["wide", "narrow"])
def test_constant_layer_gives_nan_pairs_and_one_line(tmp_path, layers, method, flat, capfd):
    """A constant column's pairs are NaN (blank cells), every other pair is computed, and one line
    names it (docs/architecture.md "Numerics")."""
    data = {k: v.astype(np.float32) for k, v in layers.items()}
    good = repsim.cka_matrix(make_store(tmp_path / "ok.zarr", data, chunk_rows=10), batch_size=20, epochs=1,
                             shuffle=False, method=method, progress=False)
    data[flat][:] = 2.5
    store = make_store(tmp_path / "flat.zarr", data, chunk_rows=10)
    got = repsim.cka_matrix(store, batch_size=20, epochs=1, shuffle=False, method=method, progress=False)
    k = [c[1] for c in got.index].index(flat)
    assert np.isnan(got.values[k]).all() and np.isnan(got.values[:, k]).all()
    keep = [i for i in range(len(got.index)) if i != k]
    np.testing.assert_allclose(got.values[np.ix_(keep, keep)], good.values[np.ix_(keep, keep)], rtol=1e-9)
    assert got.meta["undefined_columns"] == [f"flat/{flat}"]
    err = capfd.readouterr().err
    assert err.count("CKA is undefined") == 1 and f"flat/{flat}" in err and "--dtype float32" in err


def test_empty_class_names_store_and_layer(tmp_path, layers):
    labels = np.arange(N) % 3
    labels[labels == 1] = 2  # class 1 never occurs, classes 0 and 2 do
    store = make_store(tmp_path / "gap.zarr", {"narrow": layers["narrow"]}, labels=labels, chunk_rows=10)
    for kw in (dict(distances=("cosine",)), dict(collapse=True), dict(spectra=True)):
        with pytest.raises(ValueError, match="gap/narrow.*class 1"):
            repsim.layer_metrics(store.path, ["narrow"], progress=False, **kw)


def test_constant_layer_gives_nan_metrics_and_one_line(tmp_path, layers, capfd):
    """The same policy for the streaming drivers: a constant layer's R² and collapse metrics are
    NaN, its sparsity and every other layer's metrics are computed, and one line names it."""
    data = {k: v.astype(np.float32) for k, v in layers.items()}
    data["narrow"][:] = 2.5
    store = make_store(tmp_path / "flat.zarr", data, labels=np.arange(N) % 3, chunk_rows=10)
    res = repsim.layer_metrics(store.path, distances=("cosine", "sqeuclidean"), sparsity=True, collapse=True,
                               progress=False)
    flat, ok = res[("flat", "narrow")], res[("flat", "wide")]
    assert all(np.isnan(v) for v in flat["separation"].values())
    assert all(np.isnan(v) for v in flat["collapse"].values()) and "nc1" in flat["collapse"]
    assert flat["sparsity"] == 1.0  # (the fraction of non-zero activations: 2.5 everywhere)
    assert np.isfinite(list(ok["separation"].values())).all() and np.isfinite(ok["collapse"]["nc1"])
    err = capfd.readouterr().err
    assert err.count("undefined (NaN)") == 1 and "flat/narrow" in err and "flat/wide" not in err


def test_unlabelled_examples_are_named_by_the_label_metrics(tmp_path, layers):
    """-1 (an unlabelled example) in a store's labels: separation and collapse name the store and the
    count (they said "num_classes must be >= 1, got 0" when every label was -1); sparsity needs none."""
    y = np.arange(N) % 3
    y[:7] = -1
    store = make_store(tmp_path / "unl.zarr", {"narrow": layers["narrow"]}, labels=y)
    for kw in ({"distances": ("cosine",)}, {"collapse": True}):
        with pytest.raises(ValueError, match=r"store 'unl': 7 of its \d+ labels are negative \(-1 marks an unlabelled"):
            repsim.layer_metrics(store.path, **kw, progress=False)
    assert repsim.layer_metrics(store.path, sparsity=True, progress=False)
