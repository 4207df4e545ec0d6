"""Linear CKA and the all-pairs minibatch estimator against brute-force references.

References are written straight from the papers: Eq. 10 with the centring matrix H, and Song et
al. (2012)'s unbiased HSIC formula on uncentred Grams with zeroed diagonals.
"""
from __future__ import annotations

import itertools

import array_api_strict
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from repsim.kernels._precision import CenteredGram
from repsim.kernels.cka import linear_cka
from repsim.kernels.hsic import batch_hsic, double_center, ucenter
from repsim.kernels.minibatch_cka import MinibatchCKA

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(array_api_strict, id="strict")]


def song_hsic(X: np.ndarray, Y: np.ndarray) -> float:
    """Song et al. 2012, Eq. 5: unbiased HSIC from Grams with zero diagonal (no centring)."""
    return song_hsic_gram(X @ X.T, Y @ Y.T)


def song_hsic_gram(K: np.ndarray, L: np.ndarray) -> float:
    n = K.shape[0]
    K = K.copy()
    L = L.copy()
    np.fill_diagonal(K, 0)
    np.fill_diagonal(L, 0)
    one = np.ones(n, dtype=K.dtype)
    return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / K.dtype.type((n - 1) * (n - 2))
            - K.dtype.type(2 / (n - 2)) * (one @ K @ L @ one)) / K.dtype.type(n * (n - 3))


def biased_hsic(X: np.ndarray, Y: np.ndarray) -> float:
    """tr(K H L H) / (n-1)^2 with H = I - 11ᵀ/n (Gretton et al. 2005)."""
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    return float(np.trace(X @ X.T @ H @ Y @ Y.T @ H) / (n - 1) ** 2)


def ref_cka(X: np.ndarray, Y: np.ndarray, debiased: bool) -> float:
    h = song_hsic if debiased else biased_hsic
    return h(X, Y) / np.sqrt(h(X, X) * h(Y, Y))


def planted(rng: np.random.Generator, n: int, ps: list[int], mean: float = 0.0) -> list[np.ndarray]:
    """Layers sharing a low-dimensional latent, plus noise and an offset (planted structure)."""
    z = rng.normal(size=(n, 3))
    return [z @ rng.normal(size=(3, p)) + 0.7 * rng.normal(size=(n, p)) + mean for p in ps]


def as_xp(xp, *arrays):
    out = [xp.asarray(a) for a in arrays]
    return out if len(out) > 1 else out[0]


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / np.maximum(np.abs(b), 1e-300)))


# --- one-shot ----------------------------------------------------------------------------------
@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("debiased", [False, True])
@pytest.mark.parametrize("shape", [(40, 3, 5), (30, 70, 90), (25, 4, 2, 3)])  # feature / Gram / 4-D
def test_linear_cka_matches_reference(xp, debiased, shape):
    rng = np.random.default_rng(1)
    n, p1, *rest = shape
    X = rng.normal(size=(n, p1)) + 2.0
    Y = X[:, :1] * rng.normal(size=(1, rest[0])) + rng.normal(size=(n, rest[0]))
    if len(rest) > 1:  # conv-like (n, C, H, W) input is flattened
        Y4 = rng.normal(size=(n, *rest)) + X[:, :1, None, None]
        ref = ref_cka(X, Y4.reshape(n, -1), debiased)
        got = linear_cka(*as_xp(xp, X, Y4), debiased=debiased)
    else:
        ref = ref_cka(X, Y, debiased)
        got = linear_cka(*as_xp(xp, X, Y), debiased=debiased)
    assert isinstance(got, float)
    assert got == pytest.approx(ref, rel=1e-9)


def ustat_hsic(K: np.ndarray, L: np.ndarray) -> float:
    """HSIC as a U-statistic over ordered 4-tuples of distinct examples (Song et al. 2012, Thm. 2):
    (1/(n)_4) Σ_{(i,j,q,r) distinct} [K_ij L_ij + K_ij L_qr - 2 K_ij L_iq]. Shares nothing with the
    closed forms (Song's Eq. 5, U-centering) that the implementation and song_hsic use."""
    idx = np.array(list(itertools.permutations(range(K.shape[0]), 4)))
    i, j, q, r = idx.T
    return float(np.mean(K[i, j] * L[i, j] + K[i, j] * L[q, r] - 2 * K[i, j] * L[i, q]))


@pytest.mark.parametrize("xp", NAMESPACES)
def test_unbiased_hsic_is_the_u_statistic(xp):
    rng = np.random.default_rng(12)
    n = 8
    layers = planted(rng, n, [3, 5, 40], mean=2.0)  # 40 > n: linear_cka takes the Gram route for it
    grams = [a @ a.T for a in layers]
    ref = np.array([[ustat_hsic(K, L) for L in grams] for K in grams])
    assert song_hsic_gram(grams[0], grams[1]) == pytest.approx(ref[0, 1], rel=1e-10)  # the test's own formula
    got = batch_hsic([xp.asarray(a) for a in layers], debiased=True)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    for a, b in ((0, 1), (0, 2), (1, 2)):
        cka = ref[a, b] / np.sqrt(ref[a, a] * ref[b, b])
        assert linear_cka(*as_xp(xp, layers[a], layers[b]), debiased=True) == pytest.approx(cka, rel=1e-9)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_ucenter_matches_definition(xp):
    rng = np.random.default_rng(2)
    X, Y = planted(rng, 12, [5, 7], mean=1.0)
    K = X @ X.T
    n = K.shape[0]
    U = np.zeros_like(K)  # straight from the definition, loops and all
    S = sum(K[k, l] for k in range(n) for l in range(n) if k != l)
    for i in range(n):
        for j in range(n):
            if i != j:
                ri = sum(K[i, l] for l in range(n) if l != i)
                rj = sum(K[k, j] for k in range(n) if k != j)
                U[i, j] = K[i, j] - ri / (n - 2) - rj / (n - 2) + S / ((n - 1) * (n - 2))
    got = np.asarray(ucenter(xp.asarray(K)))
    np.testing.assert_allclose(got, U, rtol=1e-10, atol=1e-10 * np.abs(K).max())
    Ug = np.asarray(ucenter(xp.asarray(Y @ Y.T)))
    assert float(np.sum(got * Ug)) / (n * (n - 3)) == pytest.approx(song_hsic(X, Y), rel=1e-9)
    with pytest.raises(ValueError, match="n >= 4"):
        ucenter(xp.asarray(K[:3, :3]))


@pytest.mark.parametrize("xp", NAMESPACES)
def test_double_center_is_h_k_h(xp):
    """double_center(K) = H K H with H = I − 11ᵀ/n (the matrix product itself), for Grams of rows far
    from the origin and of a constant column; its rows and columns sum to zero; ``overwrite`` centres K in
    its own memory, to the same numbers; the Gram of centred rows X̃ X̃ᵀ is that of X."""
    rng = np.random.default_rng(5)
    for n, p, shift in ((4, 3, 0.0), (23, 6, 50.0), (40, 60, 1.0)):
        X = rng.normal(size=(n, p)) + shift
        K = X @ X.T
        H = np.eye(n) - np.ones((n, n)) / n
        got = double_center(xp.asarray(K))
        assert type(got) is type(xp.asarray(K)) and got.dtype == xp.float64
        got = np.asarray(got)
        np.testing.assert_allclose(got, H @ K @ H, rtol=0, atol=1e-13 * np.abs(K).max())
        Xc = X - X.mean(axis=0)
        np.testing.assert_allclose(got, Xc @ Xc.T, rtol=0, atol=1e-12 * np.abs(K).max())
        np.testing.assert_allclose(got.sum(axis=0), 0.0, atol=1e-11 * np.abs(K).max())
        Kx = xp.asarray(K.copy())
        same = double_center(Kx, overwrite=True)
        assert same is Kx and np.array_equal(np.asarray(same), got)
    assert np.array_equal(np.asarray(double_center(xp.asarray(np.full((5, 5), 3.0)))), np.zeros((5, 5)))
    with pytest.raises(ValueError, match="square matrix"):
        double_center(xp.asarray(np.ones((3, 4))))


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("debiased", [False, True])
def test_invariances(xp, debiased):
    rng = np.random.default_rng(3)
    X, Y = planted(rng, 30, [8, 12], mean=0.5)
    base = linear_cka(*as_xp(xp, X, Y), debiased=debiased)
    Q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    perm = rng.permutation(30)
    assert linear_cka(*as_xp(xp, X @ Q, Y), debiased=debiased) == pytest.approx(base, rel=1e-10)
    assert linear_cka(*as_xp(xp, 7.5 * X, 0.01 * Y), debiased=debiased) == pytest.approx(base, rel=1e-10)
    assert linear_cka(*as_xp(xp, X[perm], Y[perm]), debiased=debiased) == pytest.approx(base, rel=1e-10)
    assert linear_cka(*as_xp(xp, X + 100.0, Y), debiased=debiased) == pytest.approx(base, rel=1e-8)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_known_answers(xp):
    rng = np.random.default_rng(4)
    X = rng.normal(size=(60, 20))
    for deb in (False, True):
        assert linear_cka(*as_xp(xp, X, X), debiased=deb) == pytest.approx(1.0, abs=1e-12)
    # independent data: debiased CKA ~ 0 while biased CKA is inflated by the finite sample
    A, B = rng.normal(size=(400, 60)), rng.normal(size=(400, 60))
    assert abs(linear_cka(*as_xp(xp, A, B), debiased=True)) < 0.02
    assert linear_cka(*as_xp(xp, A, B), debiased=False) > 0.1


@pytest.mark.parametrize("xp", NAMESPACES)
def test_bad_input_errors(xp):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(10, 4))
    with pytest.raises(ValueError, match="n >= 4"):
        linear_cka(*as_xp(xp, X[:3], X[:3]), debiased=True)
    Xn = X.copy()
    Xn[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        linear_cka(*as_xp(xp, Xn, X))
    for const in (np.ones((10, 3)), np.full((10, 3), 0.1), np.full((10, 2, 2), 1e8 / 3)):
        with pytest.raises(ValueError, match="constant"):
            linear_cka(*as_xp(xp, X, const))
    with pytest.raises(ValueError, match="examples"):
        linear_cka(*as_xp(xp, X, X[:8]))
    acc = MinibatchCKA(2, names=["storeA/block1", "storeA/block2"])
    with pytest.raises(ValueError, match="before any update"):
        acc.result()
    with pytest.raises(ValueError, match="storeA/block2 contains NaN"):
        acc.update(as_xp(xp, X, Xn[:, :2]))
    with pytest.raises(ValueError, match="n >= 4"):
        acc.update(as_xp(xp, X[:3], X[:3]))
    with pytest.raises(ValueError, match="expected 2"):
        acc.update(as_xp(xp, X, X, X))


@pytest.mark.parametrize("xp", NAMESPACES)
def test_constant_layers_give_nan_pairs_and_leave_the_others(xp):
    """A layer constant over every batch has no CKA: NaN in its row and column, one warning naming
    it, every other pair as without it; a layer constant in one batch only adds nothing there."""
    rng = np.random.default_rng(6)
    batches = [planted(rng, 12, [3, 5]) for _ in range(3)]
    ref = MinibatchCKA(2).update(batches[0]).update(batches[1]).update(batches[2]).result()
    acc = MinibatchCKA(3, names=["s/a", "s/flat", "s/b"])
    for a, b in batches:
        acc.update(as_xp(xp, a, np.full((12, 2, 2), 1e8 / 3), b))
    assert acc.undefined() == ["s/flat"]
    with pytest.warns(RuntimeWarning, match="undefined.*s/flat"):
        got = acc.result()
    assert np.isnan(got[1]).all() and np.isnan(got[:, 1]).all()
    np.testing.assert_allclose(got[np.ix_([0, 2], [0, 2])], ref, rtol=1e-12)
    with pytest.warns(RuntimeWarning):
        lo, hi = acc.ci(0.9, n_boot=20)
    assert np.isnan(lo[1]).all() and np.isfinite(lo[np.ix_([0, 2], [0, 2])]).all()
    # constant in one batch only: that batch adds nothing to the layer's sums
    part = MinibatchCKA(2)
    part.update(as_xp(xp, batches[0][0], np.ones((12, 5))))
    part.update(as_xp(xp, *batches[1]))
    np.testing.assert_allclose(part.hsic, MinibatchCKA(2).update(batches[1]).hsic
                               + np.diag([MinibatchCKA(1).update([batches[0][0]]).hsic[0, 0], 0.0]), rtol=1e-12)


def test_a_bootstrap_over_one_batch_is_refused():
    rng = np.random.default_rng(7)
    acc = MinibatchCKA(2).update(planted(rng, 20, [3, 4]))
    with pytest.raises(ValueError, match="only one.*lo = hi"):
        acc.ci(0.95)
    acc.update(planted(rng, 20, [3, 4]))
    with pytest.raises(ValueError, match="each resample holds only one"):
        acc.ci(0.95, draws=1)
    assert acc.ci(0.95)[0].shape == (2, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ci'"):  # one return type: the bounds are ci()'s
        acc.result(ci=0.95)


# --- minibatch, all pairs ------------------------------------------------------------------------
@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("debiased", [False, True])
def test_batch_hsic_all_pairs_matches_song(xp, debiased):
    rng = np.random.default_rng(6)
    layers = planted(rng, 37, [3, 16, 50, 9], mean=3.0)
    layers.append(rng.normal(size=(37, 2, 3, 3)))  # conv-like
    flat = [a.reshape(37, -1) for a in layers]
    h = song_hsic if debiased else biased_hsic
    ref = np.array([[h(a, b) for b in flat] for a in flat])
    # one row block; blocks of 5 rows in groups of one block; single-row blocks (rectangles only)
    for block_bytes, block_rows in ((1 << 28, 128), (2000, 5), (1 << 28, 1), (1 << 28, 36)):
        got = batch_hsic([xp.asarray(a) for a in layers], debiased=debiased, block_bytes=block_bytes,
                         block_rows=block_rows)
        assert isinstance(got, np.ndarray) and got.dtype == np.float64
        np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("debiased", [True, False])
def test_centered_grams_stand_in_for_their_features(xp, debiased):
    """A layer given as its centred Gram X_c X_cᵀ gives the same HSIC row as its rows X."""
    rng = np.random.default_rng(16)
    layers = planted(rng, 29, [4, 40, 7], mean=2.0)
    flat = [a.reshape(29, -1) for a in layers]
    h = song_hsic if debiased else biased_hsic
    ref = np.array([[h(a, b) for b in flat] for a in flat])
    grams = [CenteredGram(xp.asarray((a - a.mean(0)) @ (a - a.mean(0)).T)) for a in flat]
    for mixed in ([grams[0], xp.asarray(flat[1]), grams[2]], grams):
        for block_bytes, block_rows in ((1 << 28, 128), (900, 4)):
            got = batch_hsic(mixed, debiased=debiased, block_bytes=block_bytes, block_rows=block_rows)
            np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-12 * np.abs(ref).max())
    acc = MinibatchCKA(3, debiased=debiased).update(grams)
    np.testing.assert_allclose(acc.result(), MinibatchCKA(3, debiased=debiased).update(
        [xp.asarray(a) for a in flat]).result(), rtol=1e-10)
    bad = np.array(grams[0].K if xp is np else np.asarray(grams[0].K), copy=True)
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="layer 0 contains NaN"):
        batch_hsic([CenteredGram(xp.asarray(bad)), xp.asarray(flat[1])])
    with pytest.raises(ValueError, match="square"):
        CenteredGram(xp.asarray(flat[1]))
    with pytest.raises(ValueError, match="examples"):
        batch_hsic([xp.asarray(flat[1]), CenteredGram(xp.asarray(np.eye(5)))])


@pytest.mark.parametrize("xp", NAMESPACES)
def test_minibatch_cka_matches_definition(xp):
    rng = np.random.default_rng(7)
    batches = [planted(rng, n, [6, 10, 4], mean=1.0) for n in (20, 31, 12)]
    acc = MinibatchCKA(3)
    for b in batches:
        acc.update([xp.asarray(a) for a in b])
    sums = np.zeros((3, 3))
    for b in batches:
        sums += np.array([[song_hsic(x, y) for y in b] for x in b])
    ref = sums / np.sqrt(np.outer(np.diag(sums), np.diag(sums)))
    np.testing.assert_allclose(acc.result(), ref, rtol=1e-9)
    assert acc.n_batches == 3 and acc.n_examples == 63
    np.testing.assert_allclose(acc.hsic, sums, rtol=1e-9)
    # one batch: minibatch CKA is linear_cka
    one = MinibatchCKA(3, debiased=False).update([xp.asarray(a) for a in batches[1]])
    assert one.result()[0, 2] == pytest.approx(
        linear_cka(*as_xp(xp, batches[1][0], batches[1][2]), debiased=False), rel=1e-10)


@pytest.mark.parametrize("debiased", [True, False])
def test_wide_layers_take_the_slab_gram_path_with_the_same_answers(debiased):
    """A host layer with p > 2·GRAM_SLAB features and p >= 4n enters batch_hsic as its centred Gram,
    formed slab by slab (kernels._gram.centered_gram_slabs); HSIC matches Song's/the biased formula in
    float64 (float32 input: to the float32 Gram bound), in any mix with narrow layers and groups,
    NaN wide layers are refused by name and constant ones give zero rows."""
    from repsim.kernels._gram import is_wide
    from repsim.kernels._precision import GRAM_SLAB

    rng = np.random.default_rng(21)
    n = 36
    layers = planted(rng, n, [3 * GRAM_SLAB + 7, 12, 2 * GRAM_SLAB + 1], mean=2.5)
    assert is_wide(layers[0].shape) and not is_wide(layers[1].shape) and is_wide(layers[2].shape)
    h = song_hsic if debiased else biased_hsic
    ref = np.array([[h(a, b) for b in layers] for a in layers])
    for block_bytes, block_rows in ((1 << 28, 128), (1500, 8)):
        got = batch_hsic(layers, debiased=debiased, block_bytes=block_bytes, block_rows=block_rows)
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    f32 = batch_hsic([a.astype(np.float32) for a in layers], debiased=debiased)
    cka = lambda H: H / np.sqrt(np.outer(np.diag(H), np.diag(H)))  # noqa: E731
    assert np.max(np.abs(cka(f32) - cka(ref))) < 1e-5
    bad = [a.copy() for a in layers]
    bad[2][5, GRAM_SLAB + 3] = np.nan
    with pytest.raises(ValueError, match="layer 2 contains NaN"):
        batch_hsic(bad, debiased=debiased)
    bad = [a.copy() for a in layers]
    bad[0][:] = 1.5  # constant: its row and column of the batch's HSIC are zero, the rest unchanged
    got = batch_hsic(bad, debiased=debiased)
    assert not got[0].any() and not got[:, 0].any()
    np.testing.assert_allclose(got[1:, 1:], ref[1:, 1:], rtol=1e-9, atol=1e-12 * np.abs(ref).max())


class LazyLayers:
    """A sequence that 'loads' a layer's batch on access and counts the loads."""

    def __init__(self, layers):
        self.layers, self.loads = layers, []

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        self.loads.append(i)
        return self.layers[i].copy()


def test_layers_are_read_once_in_order():
    rng = np.random.default_rng(11)
    layers = planted(rng, 30, [4, 9, 2, 7], mean=1.0)
    ref = batch_hsic(layers)
    lazy = LazyLayers(layers)
    acc = MinibatchCKA(4).update(lazy)
    assert lazy.loads == [0, 1, 2, 3]  # one group: each layer read once, in order
    np.testing.assert_allclose(acc.hsic, ref, rtol=1e-12)
    lazy = LazyLayers(layers)
    np.testing.assert_allclose(batch_hsic(lazy, block_bytes=400, block_rows=4), ref, rtol=1e-10)
    assert lazy.loads == [0, 1, 2, 3]  # several groups: centred layers kept, still read once
    with pytest.raises(TypeError, match="namespace"):
        batch_hsic([layers[0], array_api_strict.asarray(layers[1])])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_accumulators_any_split_any_merge_order(data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n_batches = data.draw(st.integers(2, 6))  # (a bootstrap over one batch is refused)
    sizes = data.draw(st.lists(st.integers(4, 12), min_size=n_batches, max_size=n_batches))
    batches = [planted(rng, n, [3, 5], mean=2.0) for n in sizes]
    one_shot = MinibatchCKA(2)
    for b in batches:
        one_shot.update(b)
    n_parts = data.draw(st.integers(1, n_batches))
    owner = data.draw(st.lists(st.integers(0, n_parts - 1), min_size=n_batches, max_size=n_batches))
    parts = [MinibatchCKA(2) for _ in range(n_parts)]
    for b, o in zip(batches, owner):
        parts[o].update(b)
    parts = [MinibatchCKA.from_state(p.to_state()) for p in parts]  # ship across "workers"
    order = data.draw(st.permutations(range(n_parts)))
    merged = parts[order[0]]
    for i in order[1:]:
        merged.merge(parts[i])
    np.testing.assert_allclose(merged.hsic, one_shot.hsic, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(merged.result(), one_shot.result(), rtol=1e-12)
    lo1, hi1 = merged.ci(0.9, n_boot=50)
    lo2, hi2 = one_shot.ci(0.9, n_boot=50)
    np.testing.assert_allclose(lo1, lo2, rtol=1e-12)
    np.testing.assert_allclose(hi1, hi2, rtol=1e-12)


def test_state_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(8)
    acc = MinibatchCKA(3, names=["a/b1", "a/b2", "b/b1"])
    for n in (9, 14):
        acc.update(planted(rng, n, [4, 4, 6]))
    state = acc.to_state()
    for v in state.values():
        assert isinstance(v, (np.ndarray, int, float, bool, str))
    np.savez(tmp_path / "s.npz", **state)  # survives a plain npz checkpoint
    loaded = dict(np.load(tmp_path / "s.npz"))
    back = MinibatchCKA.from_state(loaded)
    s2 = back.to_state()
    assert state.keys() == s2.keys()
    for k in state:
        np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(s2[k]))
    np.testing.assert_array_equal(back.result(), acc.result())
    with pytest.raises(ValueError, match="cannot merge"):
        back.merge(MinibatchCKA(2))


def test_bootstrap_ci_matches_explicit_resampling():
    rng = np.random.default_rng(9)
    acc = MinibatchCKA(3)
    for _ in range(8):
        acc.update(planted(rng, 16, [5, 5, 5], mean=1.0))
    per = acc.batch_hsic()  # canonical order, (B, L, L)
    for m in (None, 3):  # all B records per resample, or an m-out-of-n bootstrap
        values = acc.result()
        lower, upper = acc.ci(0.8, n_boot=200, seed=3, draws=m)
        draws = np.random.default_rng(3).integers(0, per.shape[0], size=(200, m or per.shape[0]))
        boots = []
        for d in draws:
            s = per[d].sum(axis=0)
            boots.append(s / np.sqrt(np.outer(np.diag(s), np.diag(s))))
        boots = np.array(boots)
        np.testing.assert_allclose(lower, np.percentile(boots, 10, axis=0), rtol=1e-10)
        np.testing.assert_allclose(upper, np.percentile(boots, 90, axis=0), rtol=1e-10)
        assert np.all(lower <= upper) and np.all(np.diag(lower) == pytest.approx(1.0))
        assert np.all((lower <= values + 1e-12) | (upper >= values - 1e-12))
    with pytest.raises(ValueError, match="draws"):
        acc.ci(0.8, draws=9)
    with pytest.raises(ValueError, match="keep_batches"):
        MinibatchCKA(3, keep_batches=False).update(planted(rng, 8, [2, 2, 2])).ci(0.9)


@pytest.mark.slow  # p = 100,000-200,000 features
def test_float32_post_relu_matches_float64():
    """Post-ReLU features with mean ~3, 200,000 features, n = 64: float32 within 1e-3 of float64."""
    rng = np.random.default_rng(10)
    n, p = 64, 200_000
    z = rng.standard_normal((n, 4), dtype=np.float32)  # a weak shared latent: CKA ~ 0.36

    def relu_layer():
        w = rng.standard_normal((4, p), dtype=np.float32)
        return np.maximum(rng.standard_normal((n, p), dtype=np.float32) + 3.0 + 0.03 * (z @ w), 0)

    X, Y = relu_layer(), relu_layer()
    assert 2.5 < float(X.mean()) < 3.5
    # float64 reference: Song's formula on float64 Grams of the same data
    K64, L64 = (X.astype(np.float64) @ X.T.astype(np.float64)), (Y.astype(np.float64) @ Y.T.astype(np.float64))
    ref = song_hsic_gram(K64, L64) / np.sqrt(song_hsic_gram(K64, K64) * song_hsic_gram(L64, L64))
    assert 0.2 < ref < 0.6
    got32 = MinibatchCKA(2, compute_dtype="float32").update([X, Y]).result()[0, 1]
    assert abs(got32 - ref) <= 1e-3 * abs(ref)

    # the data really is hard: Song's formula on uncentred float32 Grams is off by more than 3x
    K32, L32 = X @ X.T, Y @ Y.T
    with np.errstate(all="ignore"):
        naive = song_hsic_gram(K32, L32) / np.sqrt(song_hsic_gram(K32, K32) * song_hsic_gram(L32, L32))
    assert not abs(naive - ref) <= 2 * abs(ref)


# --- default precision: float32 Grams, float64 sums (module docstring, "Precision and error bound") ---
def _kappas(layers: list[np.ndarray], acc64: MinibatchCKA) -> np.ndarray:
    """κ_l = tr K_l / ‖U(K_l)‖_F of one batch, with ‖U(K)‖²_F = n(n-3)·HSIC₁(K, K) from the float64
    accumulator and tr K = ‖X_c‖²_F in float64."""
    n = layers[0].shape[0]
    tr = np.array([np.sum((x.reshape(n, -1) - x.reshape(n, -1).mean(axis=0, dtype=np.float64)) ** 2) for x in layers])
    return tr / np.sqrt(n * (n - 3) * np.diag(acc64.hsic))


def _hard_case(name: str, rng: np.random.Generator) -> list[np.ndarray]:
    f32 = np.float32
    if name == "relu_mean_1e4_spread_1":  # post-ReLU, mean ≫ spread: uncentred float32 Grams cancel
        n, p = 256, 512
        z = rng.standard_normal((n, 8)).astype(f32)
        return [np.maximum(1e4 + z @ rng.standard_normal((8, p), dtype=f32) + rng.standard_normal((n, p), dtype=f32), 0)
                for _ in range(3)]
    if name == "p_1e5":  # wide: float32 sums over 10^5 features (slabs), and an isotropic layer (κ ~ √p)
        n, p = 64, 100_000
        z = rng.standard_normal((n, 4)).astype(f32)
        relu = [np.maximum(rng.standard_normal((n, p), dtype=f32) + 3 + 0.03 * (z @ rng.standard_normal((4, p), dtype=f32)), 0)
                for _ in range(2)]
        return relu + [rng.standard_normal((n, p), dtype=f32)]
    if name == "sigmoid_logits":  # every logit near -9, spread ~0.05: what a sigmoid network emits
        n, k = 2000, 10
        z = rng.standard_normal((n, 3)).astype(f32)
        return [(-9 + 0.05 * (z @ rng.standard_normal((3, k), dtype=f32)) + 0.01 * rng.standard_normal((n, k), dtype=f32)
                 ).astype(f32) for _ in range(3)]
    if name == "many_pairs":  # n = 600: A Aᵀ sums 179,700 products per entry (float32 sums erred by ~1e-6 here)
        n, p = 600, 384
        z = rng.standard_normal((n, 16)).astype(f32)
        return [np.maximum(z @ (0.5 * rng.standard_normal((16, p), dtype=f32)) + rng.standard_normal((n, p), dtype=f32) + 0.5, 0)
                for _ in range(6)]
    raise AssertionError(name)


def _eps(s: int) -> float:
    """ε = γ_s + 4u of the module docstring for float32 dot products of length s, capped at the slab."""
    from repsim.kernels._precision import GRAM_SLAB

    u, s = 2.0 ** -24, min(s, GRAM_SLAB)
    return s * u / (1 - s * u) + 4 * u


def _linear_cka_bound(X: np.ndarray, Y: np.ndarray, debiased: bool, kappas_u: np.ndarray) -> float:
    """First-order bound 2(ε_X κ_X + ε_Y κ_Y) on linear_cka's float32 error, for the route it takes
    (its docstring's cost rule). Gram route: dot products over the p features, κ from U-centring
    (debiased; ``kappas_u``) or from H-centring, κ = tr K / ‖K_c‖_F. Feature route (biased only):
    C = X_cᵀ Y_c has entries that are dot products over the n rows, |ΔC_ab| <= ε_n ‖x_a‖ ‖y_b‖, so
    ‖ΔC‖_F <= ε_n (tr K tr L)^½ and ‖ΔX_cᵀX_c‖_F <= ε_n tr K; with ‖C‖²_F = ⟨K_c, L_c⟩ and CKA <= 1 the
    same bound follows with ε_n and the H-centring κ."""
    n, p1, p2 = X.shape[0], X.shape[1], Y.shape[1]
    features = p1 * p2 + p1 * p1 + p2 * p2 <= n * (p1 + p2) + 3 * n and not debiased
    if debiased:
        kx, ky = kappas_u
    else:
        def kappa_h(A: np.ndarray) -> float:
            Ac = A.astype(np.float64) - A.astype(np.float64).mean(axis=0)
            K = Ac @ Ac.T
            return float(np.trace(K) / np.linalg.norm(K))

        kx, ky = kappa_h(X), kappa_h(Y)
    ex, ey = (_eps(n), _eps(n)) if features else (_eps(p1), _eps(p2))
    return 2 * (ex * kx + ey * ky)


@pytest.mark.parametrize("case", ["relu_mean_1e4_spread_1", "p_1e5", "sigmoid_logits", "many_pairs"])
def test_default_float32_grams_keep_float64_accuracy_on_hard_cases(case):
    """float32 layers get float32 Grams by default; against the float64 computation of the same
    inputs the CKA error is inside the derived bound 2(ε_i κ_i + ε_j κ_j) of the module docstring,
    which holds for any correct BLAS (summation order, FMA, vector width). No fixed number: the
    measured errors depend on the kernel (sigmoid_logits through linear_cka's feature route:
    1.0e-8 with OpenBLAS's Haswell kernel, 1.27e-7 with SkylakeX; the bound there is 7.5e-4)."""
    layers = _hard_case(case, np.random.default_rng(sum(map(ord, case))))
    acc64 = MinibatchCKA(len(layers), compute_dtype="float64").update(layers)
    ref = acc64.result()
    got = MinibatchCKA(len(layers)).update(layers).result()
    assert not np.array_equal(got, ref)  # the float32 path really ran
    err = np.abs(got - ref)
    eps = _eps(int(np.prod(layers[0].shape[1:])))
    kap = _kappas(layers, acc64)
    bound = 2 * eps * (kap[:, None] + kap[None, :])
    assert np.all(err <= bound), (err.max(), bound.min())
    if case == "p_1e5":
        assert kap[2] > 100  # the isotropic layer: the bound is loose, the error still tiny
        return
    # the same through linear_cka (the feature route for narrow layers), against its route's bound
    for debiased in (False, True):
        got1 = linear_cka(layers[0], layers[1], debiased=debiased)
        ref1 = linear_cka(layers[0], layers[1], debiased=debiased, compute_dtype="float64")
        assert abs(got1 - ref1) <= _linear_cka_bound(layers[0], layers[1], debiased, kap[:2]), (got1, ref1)


def test_hard_cases_are_hard_for_uncentered_float32_grams():
    """What the peers compute (Song's formula on uncentred float32 Grams) is far off on these cases."""
    for case in ("relu_mean_1e4_spread_1", "sigmoid_logits"):
        X, Y = _hard_case(case, np.random.default_rng(sum(map(ord, case))))[:2]
        if X.shape[0] > 400:
            X, Y = X[:400], Y[:400]
        ref = linear_cka(X, Y, debiased=True, compute_dtype="float64")
        K, L = X @ X.T, Y @ Y.T
        with np.errstate(all="ignore"):
            naive = song_hsic_gram(K, L) / np.sqrt(song_hsic_gram(K, K) * song_hsic_gram(L, L))
        assert not abs(naive - ref) <= 1e-2, (case, naive, ref)


def test_batch_records_are_bounded_and_keep_the_interval_width():
    """One record per batch of every epoch grew memory and checkpoints with n (O(epochs·n/b·L²); the
    checkpoints, rewriting them all every segment, wrote O(n²) bytes). Past ``max_records`` adjacent records
    are summed in pairs: the sums stay exact, the records stay bounded, and the bootstrap over records of m
    batches gives the interval of the one over single batches, to its own Monte-Carlo noise."""
    rng = np.random.default_rng(21)
    batches = [planted(rng, 12, [4, 4, 6], mean=0.3) for _ in range(600)]
    every = MinibatchCKA(3, max_records=10_000)
    capped = MinibatchCKA(3, max_records=64)
    halves = [MinibatchCKA(3, max_records=64), MinibatchCKA(3, max_records=64)]
    for i, b in enumerate(batches):
        every.update(b)
        capped.update(b)
        halves[i >= 300].update(b)
    merged = halves[0].merge(halves[1])
    for acc in (capped, merged):
        assert len(acc._batches) <= 64 and acc.record_batches.sum() == 600 and acc.n_batches == 600
        np.testing.assert_allclose(acc.hsic, every.hsic, rtol=1e-12)
        np.testing.assert_allclose(acc.result(), every.result(), rtol=1e-12)
        assert acc.to_state()["batches"].shape[0] <= 64
    assert set(capped.record_batches.tolist()) <= {16, 8}  # 600 batches: 37 records of 16, one of 8
    for draws in (None, 100):  # all batches, or one epoch's worth (CKAResult.ci's m-out-of-n)
        lo_e, hi_e = every.ci(0.9, n_boot=2000, seed=1, draws=draws)
        lo_c, hi_c = capped.ci(0.9, n_boot=2000, seed=1, draws=draws)
        width_e, width_c = (hi_e - lo_e)[np.triu_indices(3, 1)], (hi_c - lo_c)[np.triu_indices(3, 1)]
        np.testing.assert_allclose(width_c, width_e, rtol=0.25)
        assert np.all(lo_c <= capped.result() + 1e-12) and np.all(hi_c >= capped.result() - 1e-12)
    back = MinibatchCKA.from_state(capped.to_state())  # the records, their sizes and m survive a checkpoint
    np.testing.assert_array_equal(back.record_batches, capped.record_batches)
    back.update(batches[0])
    assert back._per_record == capped._per_record and back.n_batches == 601
    old = every.to_state()  # a version-1 state: one record per batch, no sizes; paired up on load
    for key in ("record_batches", "per_record", "max_records"):
        old.pop(key)
    assert len(MinibatchCKA.from_state(old)._batches) <= 512
    # 20 batches are 1.25 records of 16: every record is resampled and the deviations widened by √(600/20)
    # (a resample of 1-2 records covered 80 % for a nominal 95 %), the width of 20 single batches
    lo_e, hi_e = every.ci(0.9, n_boot=2000, seed=1, draws=20)
    lo_c, hi_c = capped.ci(0.9, n_boot=2000, seed=1, draws=20)
    np.testing.assert_allclose((hi_c - lo_c)[np.triu_indices(3, 1)], (hi_e - lo_e)[np.triu_indices(3, 1)], rtol=0.25)


def test_an_interval_over_few_batches_warns_that_it_undercovers():
    """A percentile bootstrap over 8 batches covers 88 % for a nominal 95 % (16: 91 %; bench/coverage.py):
    fewer than MIN_CI_BATCHES batches per resample say so; 30 or more do not."""
    from repsim.kernels.minibatch_cka import MIN_CI_BATCHES

    rng = np.random.default_rng(5)
    acc = MinibatchCKA(2)
    for _ in range(MIN_CI_BATCHES):
        acc.update(planted(rng, 12, [3, 3]))
    with pytest.warns(RuntimeWarning, match="a bootstrap over 8 batches undercovers"):
        acc.ci(0.95, n_boot=50, draws=8)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.ci(0.95, n_boot=50)
