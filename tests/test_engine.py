"""cka_matrix over real Zarr stores vs in-memory references (issue 4 acceptance, single process)."""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest

import repsim
from repsim.engine.drivers import layer_metrics
from repsim.engine.result import CKAResult
from repsim.engine.minibatch import cka_matrix
from repsim.engine.exact import choose_routes
from repsim.engine.blocks import BatchPlan, BlockReader, block_rows_for, resolve_columns
from test_engine_helpers import (consecutive_batches, correlated_layers, make_store, minibatch_reference,
                                 stored)

N = 203  # not a multiple of the batch size or of any chunk size


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory):
    """Store a: a conv layer (4-D) and a dense layer; store b: one dense layer; different chunk sizes."""
    def build(dtype):
        root = tmp_path_factory.mktemp(f"stores_{np.dtype(dtype).name}")
        rng = np.random.default_rng(0)
        la = correlated_layers(rng, N, {"conv": (3, 4, 4), "fc": (17,)})
        lb = correlated_layers(rng, N, {"pool": (9,)})
        a = make_store(root / "a.zarr", {k: v.astype(dtype) for k, v in la.items()}, chunk_rows=16)
        b = make_store(root / "b.zarr", {k: v.astype(dtype) for k, v in lb.items()}, chunk_rows=24)
        return [a, b]
    return {np.float64: build(np.float64), np.float16: build(np.float16)}


def stored_columns(stores):
    return [stored(s, layer) for s in stores for layer in s.layers]


# ---------------------------------------------------------------------------------------------- plans


def test_plan_consecutive_batches_and_trailing_drop():
    sizes = [[r.size for r in BatchPlan(n=n, batch_size=5, shuffle="none").batches(0)] for n in (23, 24)]
    assert sizes == [[5, 5, 5, 5], [5, 5, 5, 5, 4]]  # a trailing batch of 3 < 4 rows is dropped, 4 kept
    plan = BatchPlan(n=24, batch_size=5, shuffle="none")
    for got, want in zip(plan.batches(0), consecutive_batches(24, 5)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="batch_size"):
        BatchPlan(n=24, batch_size=3)


@pytest.mark.parametrize("scheme", ["window", "examples"])
def test_plan_shuffle_is_a_seeded_permutation_per_epoch(scheme):
    plan = BatchPlan(n=230, batch_size=20, shuffle=scheme, seed=7, block_rows=16, window_rows=40)
    e0, e1 = plan.batches(0), plan.batches(1)
    rows = np.concatenate(e0)
    assert np.unique(rows).size == rows.size == 230  # every row exactly once per epoch
    sizes = [b.size for b in e0]
    assert min(sizes) >= 20 - 16 // 2 - 1 and max(sizes) <= 20 + 16 // 2 + 1, sizes
    if scheme == "examples":
        assert max(sizes) - min(sizes) <= 1 and len(sizes) == round(230 / 20), sizes
    if scheme == "window":  # batches never straddle windows: each group reads only its own blocks
        for g in plan.groups(0):
            assert set(np.unique(np.concatenate(g.batches) // 16)) <= set(g.blocks.tolist())
    assert not all(np.array_equal(x, y) for x, y in zip(e0, e1))  # a fresh permutation each epoch
    again = BatchPlan(n=230, batch_size=20, shuffle=scheme, seed=7, block_rows=16, window_rows=40)
    assert all(np.array_equal(x, y) for x, y in zip(e1, again.batches(1)))  # a function of (seed, epoch)
    other = BatchPlan(n=230, batch_size=20, shuffle=scheme, seed=8, block_rows=16, window_rows=40)
    assert not all(np.array_equal(x, y) for x, y in zip(e1, other.batches(1)))


@pytest.mark.parametrize("n,block,b,window,want", [
    (5000, 64, 1500, 0, [1667, 1667, 1666]),  # windows of 4 * b > n: one window, not 78 blocks + a runt of 1
    (5000, 64, 1500, 5000, [1667, 1667, 1666]),  # a window of n: a full permutation
    (1003, 100, 1500, 0, [1003]),  # b >= n: one batch
    (5000, 64, 400, 0, None),  # several windows: near-equal, none a leftover of a few blocks
])
def test_window_batches_are_near_equal_never_a_runt(n, block, b, window, want):
    """The minibatch estimate weighs every batch equally: a 64-row batch beside 1,645-row ones (the
    leftover blocks as a window of their own) made the seed-to-seed spread 60x larger."""
    for epoch in range(3):
        plan = BatchPlan(n=n, batch_size=b, shuffle="window", seed=epoch, block_rows=block, window_rows=window)
        sizes = sorted((r.size for r in plan.batches(epoch)), reverse=True)
        assert sum(sizes) == n
        if want is not None:
            assert sizes == want
        assert min(sizes) >= 0.6 * b and max(sizes) <= 1.5 * b, sizes
    ex = BatchPlan(n=5000, batch_size=1500, shuffle="examples", seed=1).batches(0)
    assert sorted((r.size for r in ex), reverse=True) == [1667, 1667, 1666]  # not 1500 x 3 + 500


class CountingReader(BlockReader):
    """The real reader, counting how often each (column, block) is read."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.reads: dict[tuple[int, int], int] = {}

    def read_span(self, c, blocks):
        for k in blocks.tolist():
            self.reads[(c, k)] = self.reads.get((c, k), 0) + 1
        return super().read_span(c, blocks)


def test_window_shuffle_reads_each_block_once_per_epoch_and_gathers_the_right_rows(two_stores):
    stores = two_stores[np.float64]
    _, columns, ids = resolve_columns(stores)
    g = block_rows_for(columns, N)
    assert g == 48  # lcm(16, 24): every block is whole chunks in both stores
    plan = BatchPlan(n=N, batch_size=20, shuffle="window", seed=3, block_rows=g, window_rows=60)
    data = [x.reshape(N, -1) for x in stored_columns(stores)]
    with CountingReader(columns, N, g, prefetch=2) as reader:
        for group in plan.groups(0):
            for c, full in enumerate(data):
                for rows, got in zip(group.batches, reader.gather(c, group)):
                    np.testing.assert_array_equal(got, full[rows])
        assert reader.reads == {(c, k): 1 for c in range(3) for k in range(-(-N // g))}


# --------------------------------------------------------------------------------- minibatch equality


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float16, 1e-4)])
def test_unshuffled_equals_in_memory_minibatch_cka(two_stores, dtype, rtol):
    stores = two_stores[dtype]
    with pytest.warns(UserWarning, match="shuffle 'none' cuts the same consecutive batches every epoch"):
        res = cka_matrix(stores, batch_size=40, epochs=2, shuffle=False, progress=False, checkpoint_every=2)
    ref = minibatch_reference(stored_columns(stores), consecutive_batches(N, 40) * 2)
    assert res.index == [("a", "conv"), ("a", "fc"), ("b", "pool")]
    np.testing.assert_allclose(res.values, ref, rtol=rtol, atol=0)  # the second epoch repeats the first
    # 203 = 5 * 40 + 3: the trailing 3 rows are dropped; the one epoch run has 5 batches
    assert res.meta["n_batches"] == 5 and res.meta["rows_dropped_per_epoch"] == 3


def test_partial_trailing_batch_of_four_or_more_is_kept(two_stores):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, batch_size=50, epochs=1, shuffle=False, progress=False)  # 4*50 + 3 -> 4 batches
    ref = minibatch_reference(stored_columns(stores), consecutive_batches(N, 50))
    np.testing.assert_allclose(res.values, ref, rtol=1e-10)
    res = cka_matrix(stores, batch_size=33, epochs=1, shuffle=False, progress=False)  # 6*33 + 5 -> 7 batches
    ref = minibatch_reference(stored_columns(stores), consecutive_batches(N, 33))
    assert res.meta["n_batches"] == 7
    np.testing.assert_allclose(res.values, ref, rtol=1e-10)


@pytest.mark.parametrize("scheme", ["window", "examples"])
def test_shuffled_equals_in_memory_on_the_same_batches(two_stores, scheme):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, batch_size=30, epochs=2, seed=5, shuffle=scheme, shuffle_window=70, progress=False,
                     checkpoint_every=3)
    plan = BatchPlan(n=N, batch_size=30, shuffle=scheme, seed=5, block_rows=48, window_rows=70)
    assert res.meta["n_batches"] == len(plan.batches(0)) + len(plan.batches(1))
    ref = minibatch_reference(stored_columns(stores), plan.batches(0) + plan.batches(1))
    np.testing.assert_allclose(res.values, ref, rtol=1e-10)
    assert res.meta["shuffle"] == scheme and res.meta["seed"] == 5


def test_batch_size_n_equals_debiased_linear_cka(two_stores):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, batch_size=N, epochs=1, shuffle=False, progress=False)
    cols = stored_columns(stores)
    ref = np.array([[repsim.linear_cka(x, y, debiased=True) for y in cols] for x in cols])
    np.testing.assert_allclose(res.values, ref, rtol=1e-10)


def test_spatial_mean_pools_conv_maps_first(two_stores):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, batch_size=50, epochs=1, shuffle=False, spatial="mean", progress=False)
    cols = stored_columns(stores)
    cols[0] = cols[0].mean(axis=(2, 3))
    np.testing.assert_allclose(res.values, minibatch_reference(cols, consecutive_batches(N, 50)), rtol=1e-6)
    flat = cka_matrix(stores, batch_size=50, epochs=1, shuffle=False, progress=False)
    assert not np.allclose(res.values[0], flat.values[0])


def test_spatial_mean_averages_a_token_sequence_over_its_tokens(tmp_path):
    """A (token, feature) layer (`extract --tokens flatten`, a ViT's blocks) under ``spatial="mean"``:
    its tokens averaged (what `extract --tokens mean` stores), by every route — minibatch and exact
    CKA, R², and per-channel sparsity counted per feature — not its features averaged per token."""
    from repsim.store.writer import StoreWriter

    rng = np.random.default_rng(3)
    T, D = 5, 7
    tok = rng.standard_normal((N, T, D))
    tok[tok < -0.5] = 0.0  # zeros for sparsity, at different rates per feature
    tok[:, :, 0] = np.maximum(tok[:, :, 0], 0)
    conv = np.einsum("ntd,dc->nc", tok, rng.standard_normal((D, 3)))[:, :, None, None] + 0.3 * rng.standard_normal((N, 3, 2, 2))
    labels = np.arange(N) % 3
    w = StoreWriter.create(str(tmp_path / "t.zarr"), n=N, chunk_rows=32,
                           layers={"tok": ((T, D), "float64", "tokens"), "conv": ((3, 2, 2), "float64")},
                           meta={"dataset": {"name": "t", "split": "test"}})
    for k in range(0, N, 32):
        w.write_chunk(k // 32, layers={"tok": tok[k:k + 32], "conv": conv[k:k + 32]}, labels=labels[k:k + 32],
                      example_ids=np.arange(k, min(N, k + 32)))
    store = w.finalize()
    pooled = [tok.mean(axis=1), conv.mean(axis=(2, 3))]

    res = cka_matrix([store], batch_size=50, epochs=1, shuffle=False, spatial="mean", progress=False)
    np.testing.assert_allclose(res.values, minibatch_reference(pooled, consecutive_batches(N, 50)), rtol=1e-9)
    exact = cka_matrix([store], method="exact", debiased=False, spatial="mean", progress=False)
    assert exact.values[0, 1] == pytest.approx(repsim.linear_cka(*pooled, debiased=False), rel=1e-9)
    wrong = repsim.linear_cka(tok.mean(axis=2), pooled[1], debiased=False)  # the features averaged per token
    assert abs(exact.values[0, 1] - wrong) > 0.05

    m = layer_metrics([store], ["tok"], distances=("sqeuclidean",), sparsity=True, spatial="mean", progress=False)
    (got,) = m.values()
    assert got["separation"]["sqeuclidean"] == pytest.approx(repsim.class_separation(pooled[0], labels, "sqeuclidean"),
                                                             rel=1e-9)
    np.testing.assert_allclose(got["sparsity_per_channel"], (tok != 0).mean(axis=(0, 1)), rtol=1e-12)
    assert got["sparsity"] == pytest.approx((tok != 0).mean(), rel=1e-12)


def test_a_checkpoint_of_a_token_column_under_the_old_mean_is_not_resumed(tmp_path, capsys):
    """A `repsim cka` checkpoint written before `spatial="mean"` averaged a token column's tokens (its
    partial sums are of features averaged per token) has a fingerprint without the column's token
    mark: it is not resumed; one written now is."""
    import json

    from repsim.store.writer import StoreWriter

    rng = np.random.default_rng(4)
    w = StoreWriter.create(str(tmp_path / "t.zarr"), n=N, chunk_rows=32,
                           layers={"tok": ((5, 7), "float64", "tokens"), "fc": ((6,), "float64")},
                           meta={"dataset": {"name": "t", "split": "test"}})
    tok, fc = rng.standard_normal((N, 5, 7)), rng.standard_normal((N, 6))
    for k in range(0, N, 32):
        w.write_chunk(k // 32, layers={"tok": tok[k:k + 32], "fc": fc[k:k + 32]}, labels=np.arange(k, min(N, k + 32)) % 3,
                      example_ids=np.arange(k, min(N, k + 32)))
    store = w.finalize()
    kw = dict(batch_size=20, seed=2, progress=False, checkpoint_every=3, spatial="mean")
    ckpt = tmp_path / "run.ckpt.npz"
    cka_matrix([store], epochs=1, checkpoint=ckpt, **kw)
    capsys.readouterr()
    cka_matrix([store], epochs=2, checkpoint=ckpt, **kw)
    assert "resuming" in capsys.readouterr().err  # today's checkpoint resumes

    cka_matrix([store], epochs=1, checkpoint=ckpt, **kw)
    with np.load(ckpt, allow_pickle=False) as z:
        saved = dict(z)
    fp = json.loads(str(saved["fingerprint"]))
    assert [c[2:] for c in fp["columns"]] == [["tokens"], []]
    fp["columns"] = [c[:2] for c in fp["columns"]]  # as the code before the fix fingerprinted it
    saved["fingerprint"] = np.asarray(json.dumps(fp, sort_keys=True))
    np.savez(ckpt, **saved)
    capsys.readouterr()
    with pytest.raises(ValueError, match="belongs to a different computation"):  # refused, not resumed
        cka_matrix([store], epochs=2, checkpoint=ckpt, **kw)


def test_layers_selection_per_store(two_stores):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, layers={"a": ["fc"], "b": ["pool"]}, batch_size=50, epochs=1, shuffle=False,
                     progress=False)
    assert res.index == [("a", "fc"), ("b", "pool")]
    full = cka_matrix(stores, batch_size=50, epochs=1, shuffle=False, progress=False)
    assert res.get("a", "fc", "b", "pool") == pytest.approx(full.get("a", "fc", "b", "pool"), rel=1e-10)


# ----------------------------------------------------------------------------------------------- exact


@pytest.mark.parametrize("debiased", [False, True])
def test_exact_equals_linear_cka_on_all_data_with_both_routes(tmp_path, debiased):
    rng = np.random.default_rng(1)
    n = 61
    # a Gram for "wide" (p > n) only; the 2- and 1-feature columns take the cross route, with each
    # other and with "wide" (both kinds of cross pair)
    layers = correlated_layers(rng, n, {"wide": (80,), "conv": (1, 1, 2), "narrow": (1,)})
    store = make_store(tmp_path / "w.zarr", layers, chunk_rows=8)
    cols = [stored(store, k) for k in layers]
    ref = np.array([[repsim.linear_cka(x, y, debiased=debiased) for y in cols] for x in cols])
    for budget in (1 << 30, 6_000):  # one Gram panel, or many panels (several passes)
        res = cka_matrix(store, method="exact", debiased=debiased, memory_budget=budget, progress=False)
        np.testing.assert_allclose(res.values, ref, rtol=1e-9)
        assert set(res.meta["exact_routes"].values()) == {"cross", "gram"}
    assert res.meta["exact_passes"] > 2 and res.state is None


def test_exact_route_rule():
    """Grams go to the widest columns, as many as pay off; a pair uses the Gram route iff both have one."""
    from repsim.engine.exact import choose_gram_columns

    widths, n = [1, 1500, 1200], 1000
    assert choose_gram_columns(widths, n) == [1, 2]
    routes = choose_routes(widths, n)
    assert routes[(1, 1)] == routes[(1, 2)] == routes[(2, 2)] == "gram"
    assert routes[(0, 0)] == routes[(0, 1)] == routes[(0, 2)] == "cross"  # 1 feature: XᵀY is cheaper than a Gram
    # the FLOP model, brute force over every prefix of the widest-first order
    def cost(G):
        pairs = [(i, j) for i in range(len(widths)) for j in range(i, len(widths))]
        return (sum(2 * n * n * widths[k] for k in G) + len(G) ** 2 * n * n
                + sum(2 * n * widths[i] * widths[j] for i, j in pairs if not (i in G and j in G)))
    for widths, n in (([10, 1000, 500], 100), ([300] * 5 + [20, 3], 225), ([50, 60, 70], 10_000)):
        order = sorted(range(len(widths)), key=lambda k: -widths[k])
        best = min((sorted(order[:k]) for k in range(len(widths) + 1)), key=cost)
        assert cost(choose_gram_columns(widths, n)) == cost(best)
    # small n (the demo: 225 examples, hundreds of features per layer): every column gets a Gram,
    # narrow ones included once a wide one has its own
    assert choose_gram_columns([2048, 512, 8, 10], 225) == [0, 1, 2, 3]
    assert choose_gram_columns([80, 1, 2], 61) == [0]  # ... unless XᵀY is cheaper still


def test_exact_route_memory_is_bounded_and_refused_beyond_max_memory(tmp_path):
    """The exact route's n × n Grams were bounded by nothing (and a second flattened copy of all of them
    was made), and once they passed ``memory_budget`` every panel was one block: ⌈n/block⌉ passes. The
    route now keeps within ``max_memory`` (fewer Grams, or a refusal naming what to do) and sizes its
    panels from ``memory_budget`` alone."""
    from repsim.engine.exact import choose_gram_columns, route_bytes

    rng = np.random.default_rng(4)
    n = 96
    layers = correlated_layers(rng, n, {"wide": (8, 4, 4), "mid": (120,), "pool": (8,)})
    store = make_store(tmp_path / "m.zarr", layers, chunk_rows=8)
    cols = [stored(store, k) for k in layers]
    ref = np.array([[repsim.linear_cka(x, y, debiased=True) for y in cols] for x in cols])
    widths = [128, 120, 8]
    free = choose_gram_columns(widths, n)
    assert len(free) == 3 and route_bytes(widths, n, 3) == 8 * n * n * 4
    # a limit below three Grams: fewer of them (the cheapest route that fits), same values
    limit = route_bytes(widths, n, 3) - 1
    fewer = choose_gram_columns(widths, n, limit)
    assert len(fewer) < 3 and route_bytes(widths, n, len(fewer)) <= limit
    res = cka_matrix(store, method="exact", max_memory=limit, memory_budget=20_000, progress=False)
    np.testing.assert_allclose(res.values, ref, rtol=1e-9)
    # Grams larger than memory_budget no longer shrink the panels to one block (12 blocks: 12 passes)
    big = cka_matrix(store, method="exact", memory_budget=150_000, progress=False)
    np.testing.assert_allclose(big.values, ref, rtol=1e-9)
    assert big.meta["exact_gram_bytes"] > 150_000 and big.meta["exact_passes"] <= 3
    with pytest.raises(ValueError, match=r"exact CKA would hold at least .* over the limit of .*--spatial mean"):
        cka_matrix(store, method="exact", max_memory=10_000, progress=False)


# ------------------------------------------------------------------------------------------ validation


def _copy(src, dst):
    shutil.copytree(src.path, dst)
    return repsim.open_store(dst)


def _corrupt_layer_data(store_path, layer):
    """Remove every chunk object of a layer: any read of it would fail."""
    root = os.path.join(store_path, "layers", layer, "c")
    shutil.rmtree(root)


def test_misaligned_example_ids_raise_before_compute(tmp_path):
    rng = np.random.default_rng(2)
    layers = correlated_layers(rng, 40, {"x": (5,)})
    a = make_store(tmp_path / "net_a.zarr", layers)
    b = make_store(tmp_path / "net_b.zarr", layers, example_ids=np.arange(40)[::-1].copy())
    c = make_store(tmp_path / "net_c.zarr", {"x": layers["x"][:39]})
    _corrupt_layer_data(a.path, "x")  # validation must fail before any layer data is read
    with pytest.raises(ValueError, match="misaligned example_ids") as exc:
        cka_matrix([a.path, b.path, c.path], batch_size=10, progress=False)
    assert "net_b" in str(exc.value) and "net_c" in str(exc.value)


def test_stores_of_another_split_are_named_as_such_not_as_misaligned_ids(tmp_path):
    """A test store beside a holdout store (other ids, other n): the refusal says the splits differ."""
    rng = np.random.default_rng(2)
    a = make_store(tmp_path / "a.zarr", correlated_layers(rng, 40, {"x": (5,)}),
                   meta={"dataset": {"name": "digits", "split": "test"}})
    b = make_store(tmp_path / "b.zarr", correlated_layers(rng, 30, {"x": (5,)}), example_ids=np.arange(100, 130),
                   meta={"dataset": {"name": "digits", "split": "holdout"}})
    with pytest.raises(ValueError, match=r"different datasets: 'b' vs 'a': split 'holdout' vs 'test', so their "
                                         r"example_ids differ too \('b' has n=30 vs n=40 in 'a'\)"):
        cka_matrix([a.path, b.path], batch_size=10, progress=False)


def test_missing_layer_raises_naming_store(tmp_path):
    rng = np.random.default_rng(3)
    layers = correlated_layers(rng, 40, {"x": (5,), "y": (4,)})
    a = make_store(tmp_path / "net_a.zarr", layers)
    b = make_store(tmp_path / "net_b.zarr", {"x": layers["x"]})
    _corrupt_layer_data(a.path, "x")
    with pytest.raises(ValueError, match="missing layer") as exc:
        cka_matrix([a, b], layers=["x", "y"], batch_size=10, progress=False)
    assert "net_b" in str(exc.value) and "'y'" in str(exc.value)


def test_incomplete_store_raises_naming_store(tmp_path):
    from repsim.store.writer import StoreWriter

    rng = np.random.default_rng(4)
    layers = correlated_layers(rng, 40, {"x": (5,)})
    a = make_store(tmp_path / "net_a.zarr", layers, chunk_rows=10)
    w = StoreWriter.create(tmp_path / "net_half.zarr", n=40, layers={"x": ((5,), "float32")}, chunk_rows=10)
    w.write_chunk(0, layers={"x": layers["x"][:10].astype(np.float32)}, labels=np.zeros(10, int),
                  example_ids=np.arange(10))
    with pytest.raises(ValueError, match="incomplete") as exc:
        cka_matrix([a.path, str(tmp_path / "net_half.zarr")], batch_size=10, progress=False)
    assert "net_half" in str(exc.value)
    with pytest.raises(ValueError, match="incomplete"):
        layer_metrics(str(tmp_path / "net_half.zarr"), sparsity=True, progress=False)


def test_bad_arguments(two_stores):
    stores = two_stores[np.float64]
    with pytest.raises(ValueError, match="spatial"):
        cka_matrix(stores, spatial="max")
    with pytest.raises(ValueError, match="shuffle"):
        cka_matrix(stores, shuffle="chunks", progress=False)
    with pytest.raises(ValueError, match="no store matches"):
        cka_matrix(["/nonexistent/*.zarr"])


# ------------------------------------------------------------------------------------ result, resume


def test_result_save_load_roundtrip_and_bootstrap_ci(two_stores, tmp_path):
    stores = two_stores[np.float64]
    res = cka_matrix(stores, batch_size=20, epochs=2, seed=1, progress=False)
    path = res.save(tmp_path / "cka_test.npz")
    with np.load(path) as z:  # the documented layout, readable without repsim
        assert {"values", "stores", "layers", "meta"} <= set(z.files)
        assert z["stores"].tolist() == ["a", "a", "b"] and z["layers"].tolist() == ["conv", "fc", "pool"]
    back = CKAResult.load(path)
    np.testing.assert_array_equal(back.values, res.values)
    assert back.index == res.index and back.meta == res.meta
    meta = back.meta
    assert (meta["method"], meta["debiased"], meta["batch_size"], meta["epochs"], meta["seed"], meta["n"]) == \
        ("minibatch", True, 20, 2, 1, N)
    assert "window" in meta["shuffle_scheme"] and meta["batch_size_range"][1] <= 20 + 24
    assert set(meta["stores"]) == {"a", "b"} and meta["stores"]["a"]["attrs"]["repsim_store_version"] == 2
    lo, hi = back.ci(0.9)
    assert lo.shape == hi.shape == (3, 3)
    assert np.all(lo <= res.values + 1e-12) and np.all(res.values <= hi + 1e-12) and np.any(hi - lo > 1e-4)
    # 2 epochs re-read the same examples: resamples have one epoch's batches, not all records
    acc = repsim.MinibatchCKA.from_state(back.state)
    per_epoch = meta["batches_per_epoch"][0]
    assert acc.n_batches == sum(meta["batches_per_epoch"]) > per_epoch
    lo1, hi1 = acc.ci(0.9, draws=per_epoch)
    np.testing.assert_array_equal((lo, hi), (lo1, hi1))
    lo_all, hi_all = acc.ci(0.9)
    off = ~np.eye(3, dtype=bool)
    assert np.all((hi - lo)[off] >= (hi_all - lo_all)[off] - 1e-12)
    np.testing.assert_allclose(res.block("a", "b"), res.values[:2, 2:])
    assert res.layers("b") == ["pool"] and res.stores == ["a", "b"]


def test_checkpoint_resume_is_exact_and_extends_epochs(two_stores, tmp_path, capsys):
    stores = two_stores[np.float64]
    kw = dict(batch_size=20, seed=2, progress=False, checkpoint_every=3)
    fresh = cka_matrix(stores, epochs=3, **kw)
    ckpt = tmp_path / "run.ckpt.npz"
    cka_matrix(stores, epochs=1, checkpoint=ckpt, **kw)  # "interrupted" after epoch 1
    assert ckpt.exists()
    resumed = cka_matrix(stores, epochs=3, checkpoint=ckpt, **kw)
    assert "resuming" in capsys.readouterr().err
    np.testing.assert_array_equal(resumed.values, fresh.values)  # bit-identical
    np.testing.assert_array_equal(resumed.state["batches"], fresh.state["batches"])
    # a checkpoint of a different computation is refused: neither trusted nor overwritten (issue 43)
    before = ckpt.read_bytes()
    with pytest.raises(ValueError, match="belongs to a different computation"):
        cka_matrix(stores, epochs=3, checkpoint=ckpt, **{**kw, "seed": 9})
    assert ckpt.read_bytes() == before


# -------------------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("spatial", ["flatten", "mean"])
@pytest.mark.parametrize("device", [None, "device1"])
def test_array_namespace_device_matches_numpy(two_stores, device, spatial, monkeypatch):
    """The engine's device route on array-api-strict — blocks uploaded onto its device1 too, where an
    array made without ``device=`` fails to mix, and np.asarray refused as for CuPy — gives the CPU's
    CKA with one copy to the host per batch."""
    xps = pytest.importorskip("array_api_strict")
    from test_engine_helpers import strict_device

    stores = two_stores[np.float64]
    kw = dict(batch_size=40, epochs=1, shuffle=False, progress=False, spatial=spatial)
    ref = cka_matrix(stores, **kw)
    count = strict_device(monkeypatch, None if device is None else xps.Device(device))
    got = cka_matrix(stores, device=xps, **kw)
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-12)
    assert got.meta["device"] == "array_api_strict"
    batches = len(consecutive_batches(N, 40))
    assert count["upload"] >= batches * 3 and count["host"] == batches


def test_cuda_without_cupy_is_a_clear_error(two_stores):
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="CuPy") as info:
        cka_matrix(two_stores[np.float64], device="cuda")
    # the message names the extras that install CuPy, as pyproject.toml spells them: [gpu-cuda13] for
    # CUDA 13 as well as [gpu-cuda12]/[gpu] for CUDA 12
    import re
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    cupy_extras = {name for name, deps in extras["project"]["optional-dependencies"].items()
                   if any(d.startswith("cupy") for d in deps)}
    named = set(re.findall(r"\[([\w-]+)\]", str(info.value)))
    assert {"gpu-cuda12", "gpu-cuda13"} <= named and named <= cupy_extras, (named, cupy_extras)
    assert "CUDA 13" in str(info.value) and "CUDA 12" in str(info.value)


def test_array_module_cuda_fills_cupy13_gaps(monkeypatch):
    """array_module("cuda") hands out the namespace CuPy's arrays get (repsim.array_api.array_namespace),
    which fills the names CuPy <= 13 lacks: the GPU-decoding route calls xp.concat on it
    (BlockReader.gather_decoded_span), which the bare CuPy 13 module does not have."""
    import types

    from repsim import array_api
    from repsim.engine.scheduler import array_module, device_name, reader_threads

    class OldCupy(types.ModuleType):  # NumPy standing in for CuPy 13: no concat/astype/... (array_api._CUPY_GAPS)
        def __getattr__(self, name):
            if name in array_api._CUPY_GAPS:
                raise AttributeError(f"module 'cupy' has no attribute {name!r}")
            return getattr(np, name)

    fake = OldCupy("cupy")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "array_api_compat.cupy", None)  # -> repsim's own filler
    monkeypatch.setattr(array_api, "_NAMESPACE_CACHE", {})
    xp = array_module("cuda")
    assert xp is not fake and array_api.is_cupy_namespace(xp)
    a, b = np.ones((2, 3)), np.zeros((1, 3))
    assert xp.concat([a, b], axis=0).shape == (3, 3)
    assert xp.astype(a, np.float32).dtype == np.float32
    assert device_name(xp) == "cuda" and reader_threads(None, xp) >= 2


def test_wide_columns_enter_as_centered_grams_without_changing_the_result(tmp_path):
    """p >= 4b: the engine hands MinibatchCKA the b x b centred Gram instead of the b x p rows."""
    rng = np.random.default_rng(6)
    layers = correlated_layers(rng, 120, {"wide": (400,), "conv": (8, 5, 5), "narrow": (9,)})
    store = make_store(tmp_path / "wide.zarr", {k: v.astype(np.float32) for k, v in layers.items()}, chunk_rows=10)
    res = cka_matrix(store, batch_size=30, epochs=1, shuffle=False, progress=False, compute_dtype="float64")
    cols = [stored(store, k) for k in layers]
    ref = minibatch_reference(cols, consecutive_batches(120, 30))
    np.testing.assert_allclose(res.values, ref, rtol=1e-9)
    biased = cka_matrix(store, batch_size=30, epochs=1, shuffle=False, debiased=False, progress=False,
                        compute_dtype="float64")
    np.testing.assert_allclose(biased.values, minibatch_reference(cols, consecutive_batches(120, 30), debiased=False),
                               rtol=1e-9)
    # the default (float32 Grams of these float32 columns, float64 sums) within 1e-7 of it
    default = cka_matrix(store, batch_size=30, epochs=1, shuffle=False, progress=False)
    assert default.meta["gram_dtypes"] == {"float32": "float32"}
    np.testing.assert_allclose(default.values, ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("p", [300, 2 * 2048 + 777])  # one slab / the blocked path with a ragged last slab
def test_centered_gram_matches_brute_force(p):
    from repsim.kernels._precision import CenteredGram
    from repsim.engine.grams import centered_gram

    rng = np.random.default_rng(p)
    x = np.maximum(rng.normal(size=(40, p)) + 0.5, 0).astype(np.float16)
    Xc = x.astype(np.float64) - x.astype(np.float64).mean(axis=0)
    ref = Xc @ Xc.T
    for dtype, tol in ((np.float32, 1e-6), (np.float64, 1e-12)):
        G = centered_gram(x.reshape(40, -1, 1), np, "s/l", dtype)
        assert isinstance(G, CenteredGram) and G.K.dtype == np.float64
        np.testing.assert_allclose(G.K, ref, rtol=0, atol=tol * np.abs(ref).max())
    # a namespace without the array-API astype / matrix_transpose functions (CuPy <= 13 as a module)
    import types

    bare = types.SimpleNamespace(**{k: getattr(np, k) for k in ("reshape", "mean", "sum", "finfo", "diagonal",
                                                                "float32", "float64")})
    G = centered_gram(x[:, :300], bare, "s/l", np.float64)
    ref300 = Xc[:, :300] @ Xc[:, :300].T
    np.testing.assert_allclose(G.K, ref300, rtol=0, atol=1e-12 * np.abs(ref300).max())
    bad = x.copy()
    bad[3, 7] = np.inf
    with pytest.raises(ValueError, match="s/l contains NaN"):
        centered_gram(bad, np, "s/l", np.float32)
    flat = centered_gram(np.full((40, p), 2.5, np.float16), np, "s/l", np.float32)  # constant: batch_hsic
    assert flat.mean_sq == pytest.approx(2.5 ** 2 * p)  # decides, from the mean it keeps


def test_float16_columns_use_float32_grams_unless_asked(tmp_path):
    """float16 stores: batch Grams in float32 by default (within 1e-5 of float64), exactly the
    float64 reference with compute_dtype="float64"; a bad compute_dtype fails before any compute."""
    rng = np.random.default_rng(8)
    layers = correlated_layers(rng, 96, {"wide": (12, 6, 6), "mid": (40,), "narrow": (5,)})
    store = make_store(tmp_path / "h.zarr", {k: v.astype(np.float16) for k, v in layers.items()}, chunk_rows=16)
    cols = [stored(store, k) for k in layers]
    ref = minibatch_reference(cols, consecutive_batches(96, 24))
    default = cka_matrix(store, batch_size=24, epochs=1, shuffle=False, progress=False)
    assert default.meta["gram_dtypes"] == {"float16": "float32"}
    np.testing.assert_allclose(default.values, ref, rtol=1e-5)
    exact = cka_matrix(store, batch_size=24, epochs=1, shuffle=False, progress=False, compute_dtype="float64")
    np.testing.assert_allclose(exact.values, ref, rtol=1e-10)
    assert not np.array_equal(default.values, exact.values)  # the float32 path really ran
    with pytest.raises(ValueError, match="compute_dtype"):
        cka_matrix(store, batch_size=24, epochs=1, progress=False, compute_dtype="float16")


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_cuda_device_matches_cpu(two_stores):
    stores = two_stores[np.float16]
    ref = cka_matrix(stores, batch_size=40, epochs=1, shuffle=False, progress=False)
    got = cka_matrix(stores, batch_size=40, epochs=1, shuffle=False, progress=False, device="cuda")
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-4)  # float32 Grams on the GPU
    res = layer_metrics([s.path for s in stores], distances=("cosine",), sparsity=True, progress=False,
                        device="cuda")
    cpu = layer_metrics([s.path for s in stores], distances=("cosine",), sparsity=True, progress=False)
    for key in cpu:
        assert res[key]["sparsity"] == cpu[key]["sparsity"]
        assert res[key]["separation"]["cosine"] == pytest.approx(cpu[key]["separation"]["cosine"], rel=1e-4)


@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("call_bytes", [0, 1 << 30])
def test_cuda_chunks_decoded_by_nvcomp_match_the_cpu_decoded_pass(two_stores, monkeypatch, call_bytes):
    """REPSIM_GPU_DECODE=1 with nvCOMP installed: the chunks are decoded on the GPU (a call per column
    with a 0-byte call limit, a call per batch group otherwise) and the pass equals the same pass with
    the CPU decoding them to 1e-9 (the issue's bar; the bytes decoded are the same)."""
    pytest.importorskip("nvidia.nvcomp")
    from repsim.engine import device_decode

    stores = two_stores[np.float16]
    kw = dict(batch_size=40, epochs=1, shuffle=True, progress=False, device="cuda")
    monkeypatch.setenv("REPSIM_GPU_DECODE", "0")
    ref = cka_matrix(stores, **kw)
    calls = []
    real = device_decode.NvcompZstd.decode

    def counted(self, bodies, nbytes):
        calls.append(len(bodies))
        return real(self, bodies, nbytes)

    monkeypatch.setattr(device_decode.NvcompZstd, "decode", counted)
    monkeypatch.setattr(device_decode, "DECODE_CALL_BYTES", call_bytes)
    monkeypatch.setenv("REPSIM_GPU_DECODE", "1")
    got = cka_matrix(stores, **kw)
    assert calls, "the GPU did not decode"
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-9, atol=1e-9)


def test_readers_run_ahead_within_the_byte_budget():
    """The host readers queue loads ahead of the batch being updated: at least 4 × threads (and
    prefetch), more while the reduced columns fit AHEAD_BYTES (b·min(p, 4b) float64 per batch)."""
    from repsim.engine.blocks import Column, Group
    from repsim.engine.minibatch import AHEAD_BYTES, _read_ahead

    spec = {"prefetch": 2, "threads": 2, "spatial": "flatten"}
    groups = [Group(np.arange(2), [np.arange(256)])]
    narrow = [Column("s", "p", f"l{i}", (64,), "float16", 256) for i in range(300)]
    wide = [Column("s", "p", "w", (4096, 8, 8), "float16", 256)]  # reduced to its 256 x 256 Gram
    assert _read_ahead(narrow, groups, spec) == AHEAD_BYTES // (256 * 64 * 8)  # a whole group and more
    assert _read_ahead(narrow + wide, groups, spec) == AHEAD_BYTES // (256 * 1024 * 8)
    huge = [Column("s", "p", "w", (4096, 8, 8), "float16", 256)]
    big_groups = [Group(np.arange(40), [np.arange(6000)])]  # 6000-row batches: 6000 x 24000 float64 each
    assert _read_ahead(huge, big_groups, spec) == 8  # the floor, 4 × threads
    assert _read_ahead(huge, [], spec) == 8


@pytest.mark.parametrize("spatial", ["flatten", "mean"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("device", [None, "device1"])
@pytest.mark.parametrize("call_bytes", [0, 1 << 30])
def test_chunks_decoded_on_the_device_route_give_the_same_cka(two_stores, monkeypatch, spatial, shuffle, device,
                                                              call_bytes):
    """The GPU-decoding route (engine/device_decode.py: compressed objects read and checked on the
    CPU, decoded by the device, rows picked there) with its host stand-in on array-api-strict (its
    CPU device, and device1: the decoded chunks land there, and every index array made to pick rows
    must too) gives the numbers of the usual route; float64 layers keep the usual route, also beside
    decoded ones in one call's span. One decoding call per (batch group, column) with a call limit of
    0 bytes, one per batch group when the group's columns fit the limit."""
    xps = pytest.importorskip("array_api_strict")
    from repsim.engine import device_decode, minibatch
    from repsim.engine.blocks import BlockReader
    from repsim.engine.device_decode import HostZstd
    from test_engine_helpers import strict_device

    stores = two_stores[np.float16]
    kw = dict(batch_size=40, epochs=1, shuffle=shuffle, progress=False, device=xps, spatial=spatial)
    ref = cka_matrix(stores, **kw)
    mixed = [stores[0], two_stores[np.float64][1], stores[1]]  # a float64 store between two float16 ones
    ref_mixed = cka_matrix(mixed, **kw)
    strict_device(monkeypatch, None if device is None else xps.Device(device))
    used, calls, groups = [], [], []
    real = BlockReader.gather_decoded_span

    def counted(self, cols, group, *a, **k):
        got = real(self, cols, group, *a, **k)
        used.extend(g is not None for g in got)
        groups.append(id(group))
        return got

    class Counted(HostZstd):
        def decode(self, bodies, nbytes):
            calls.append(len(bodies))
            return super().decode(bodies, nbytes)

    monkeypatch.setattr(BlockReader, "gather_decoded_span", counted)
    monkeypatch.setattr(minibatch, "device_decoder", lambda xp: Counted(xp))
    monkeypatch.setattr(device_decode, "DECODE_CALL_BYTES", call_bytes)
    got = cka_matrix(stores, **kw)
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-12, atol=1e-12)
    assert used and all(used)
    columns = sum(len(s.layers) for s in stores)
    assert len(calls) == len(set(groups)) * (columns if call_bytes == 0 else 1)
    used.clear()
    cka_matrix(two_stores[np.float64], **kw)  # float64: the host's magnitude check, the usual route
    assert used and not any(used)
    used.clear()
    got = cka_matrix(mixed, **kw)
    np.testing.assert_allclose(got.values, ref_mixed.values, rtol=1e-12, atol=1e-12)
    assert any(used) and not all(used)


def test_decode_spans_cover_every_column_once_in_order_within_the_limit():
    """decode_spans: consecutive runs, each within the limit unless one column alone passes it."""
    from repsim.engine.device_decode import decode_spans

    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 100, size=int(rng.integers(0, 12))).tolist()
        limit = int(rng.integers(0, 250))
        spans = decode_spans(sizes, limit)
        assert [c for s in spans for c in s] == list(range(len(sizes)))
        for s in spans:
            assert len(s) >= 1
            assert len(s) == 1 or sum(sizes[c] for c in s) <= limit
        for s, t in zip(spans, spans[1:]):  # a run stops only where the next column would pass the limit
            assert sum(sizes[c] for c in s) + sizes[t[0]] > limit
    assert decode_spans([10, 20, 30, 100, 5, 5], 50) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]


def test_epochs_that_would_repeat_the_same_batches_run_once(two_stores):
    """Every epoch cuts the same batches when one batch holds all n rows, or with shuffle 'none': an
    unbiased HSIC does not depend on the order of a batch's rows, so further epochs only repeat the first
    one (the 18-network heatmap's default run spent 10x its time on that). They run once, with a warning,
    and the estimate is the brute-force one; epochs that differ still all run."""
    stores = [s.path for s in two_stores[np.float64]]
    arrays = [np.asarray(a, np.float64).reshape(N, -1) for s in two_stores[np.float64]
              for a in (s.zarr_array(layer) for layer in s.layers)]
    for kw, batches in ((dict(batch_size=4 * N, shuffle="window"), [np.arange(N)]),
                        (dict(batch_size=N // 3, shuffle="none"), consecutive_batches(N, N // 3))):
        with pytest.warns(UserWarning, match="so each of the 5 epochs asked for would repeat the same computation"):
            r = cka_matrix(stores, epochs=5, progress=False, **kw)
        assert r.meta["epochs"] == 1 and r.meta["epochs_requested"] == 5
        assert r.meta["n_batches"] == len(batches)
        np.testing.assert_allclose(r.values, minibatch_reference(arrays, batches), rtol=1e-10, atol=1e-12)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        r = cka_matrix(stores, epochs=2, batch_size=N // 4, progress=False)  # window shuffle: epochs differ
    assert r.meta["epochs"] == 2 and "epochs_requested" not in r.meta


def test_default_epochs_cut_to_one_without_a_warning_when_every_pass_is_the_same(two_stores):
    """At the default epochs (None: the paper's 10) a batch of all n rows runs one epoch without a
    warning (the README's own-models recipe on 450 examples warned about epochs nobody asked for), with
    the numbers of an explicit single epoch; with batches that differ per epoch the default is 10."""
    import warnings

    stores = [s.path for s in two_stores[np.float64]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        r = cka_matrix(stores, batch_size=4 * N, progress=False)
        many = cka_matrix(stores, batch_size=N // 4, progress=False)
    one = cka_matrix(stores, batch_size=4 * N, epochs=1, progress=False)
    assert r.meta["epochs"] == 1 and "epochs_requested" not in r.meta
    np.testing.assert_array_equal(r.values, one.values)
    assert many.meta["epochs"] == 10
