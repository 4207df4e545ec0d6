"""Table E.2 neural-collapse metrics against definitions written out with loops."""
from __future__ import annotations

import array_api_strict
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from repsim.kernels.collapse import COLLAPSE_KEYS, CollapseStats, collapse_metrics
from repsim.kernels.separation import class_separation

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(array_api_strict, id="strict")]


def brute(H: np.ndarray, y: np.ndarray, W: np.ndarray) -> dict[str, float]:
    C = int(y.max()) + 1
    N, P = H.shape
    mu = np.array([H[y == c].mean(axis=0) for c in range(C)])
    Mt = mu - mu.mean(axis=0)
    Sw = np.zeros((P, P))
    for i in range(N):
        r = H[i] - mu[y[i]]
        Sw += np.outer(r, r)
    Sw /= N
    Sb = sum(np.outer(m, m) for m in Mt) / C

    def sim(a, b):
        return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))

    def pair_stats(V):
        s = np.array([sim(V[c], V[d]) for c in range(C) for d in range(c + 1, C)])
        return np.std(s), np.mean(np.abs(s + 1 / (C - 1)))

    def cv(V):
        nr = np.linalg.norm(V, axis=1)
        return np.std(nr) / np.mean(nr)

    cm, em = pair_stats(Mt)
    cw, ew = pair_stats(W)
    return {
        "norm_cv_means": cv(Mt), "norm_cv_weights": cv(W), "cos_std_means": cm, "cos_std_weights": cw,
        "equiangular_means": em, "equiangular_weights": ew,
        "self_duality": np.linalg.norm(W / np.linalg.norm(W) - Mt / np.linalg.norm(Mt)) ** 2,
        "nc1": np.trace(Sw @ np.linalg.pinv(Sb, rcond=1e-9, hermitian=True)) / C,
    }


def data(rng, n=90, P=6, C=4, mean=2.0):
    y = np.arange(n) % C
    rng.shuffle(y)
    H = rng.normal(size=(C, P))[y] * 1.5 + rng.normal(size=(n, P)) + mean
    W = rng.normal(size=(C, P))
    return H, y, W


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("shape", [(90, 6, 4), (60, 3, 5), (40, 12, 3)])  # P > C-1, P < C-1
def test_matches_definitions(xp, shape):
    rng = np.random.default_rng(0)
    H, y, W = data(rng, *shape)
    got = collapse_metrics(xp.asarray(H), xp.asarray(y), xp.asarray(W))
    assert tuple(got) == COLLAPSE_KEYS
    ref = brute(H, y, W)
    for k in COLLAPSE_KEYS:
        assert got[k] == pytest.approx(ref[k], rel=1e-8), k
    no_w = collapse_metrics(xp.asarray(H), xp.asarray(y))
    assert set(no_w) == {"norm_cv_means", "cos_std_means", "equiangular_means", "nc1"}


def etf(C: int, P: int, rng) -> np.ndarray:
    """Simplex equiangular tight frame: C unit vectors in P >= C-1 dims, pairwise cosine -1/(C-1)."""
    E = np.eye(C) - 1.0 / C  # rows: the ETF in the (C-1)-dim subspace orthogonal to 1
    U, _, _ = np.linalg.svd(E)
    embed, _ = np.linalg.qr(rng.normal(size=(P, C - 1)))  # random isometry R^(C-1) -> R^P
    V = E @ U[:, : C - 1] @ embed.T
    return V / np.linalg.norm(V, axis=1, keepdims=True)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_known_answers(xp):
    rng = np.random.default_rng(1)
    C, P = 5, 4  # C = P + 1: the ETF spans the space and Σ_B ∝ I
    M = etf(C, P, rng)
    s = 0.3  # within-class residuals ±s e_p: Σ_W = (s²/P) I exactly, class means untouched
    res = np.concatenate([s * np.eye(P), -s * np.eye(P)])
    H = np.concatenate([M[c] + res for c in range(C)]) + 7.0
    y = np.repeat(np.arange(C), 2 * P)
    got = collapse_metrics(xp.asarray(H), xp.asarray(y), xp.asarray(2.0 * M))
    for k in ("norm_cv_means", "norm_cv_weights", "cos_std_means", "cos_std_weights",
              "equiangular_means", "equiangular_weights", "self_duality"):
        assert abs(got[k]) < 1e-12, k  # a simplex ETF with self-dual classifier
    # isotropic Σ_W and Σ_B: Tr(Σ_W Σ_B⁺)/C = P/C (1/R² - 1) with the squared-Euclidean R² (Table E.2)
    r2 = class_separation(xp.asarray(H), y, "sqeuclidean")
    assert got["nc1"] == pytest.approx(P / C * (1 / r2 - 1), rel=1e-10)
    exact = collapse_metrics(xp.asarray(np.repeat(M, 3, axis=0)), np.repeat(np.arange(C), 3))
    assert exact["nc1"] == pytest.approx(0.0, abs=1e-20)


def test_invariances():
    rng = np.random.default_rng(2)
    H, y, W = data(rng)
    base = collapse_metrics(H, y, W)
    Q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    perm = rng.permutation(len(y))
    for got in (collapse_metrics(H @ Q, y, W @ Q), collapse_metrics(3.0 * H, y, 0.2 * W),
                collapse_metrics(H[perm], y[perm], W), collapse_metrics(H + 4.0, y, W)):
        for k in COLLAPSE_KEYS:
            assert got[k] == pytest.approx(base[k], rel=1e-8), k


@pytest.mark.parametrize("offset", [1e2, 1e4, 1e6])
def test_large_global_mean_does_not_leak_into_nc1(offset):
    """Post-ReLU-like features: a global mean far above the class spread. M = μ - mean(μ) then
    has a rounding-level singular value along 1; it must not enter Σ_B⁺ (it used to: ~1e26)."""
    rng = np.random.default_rng(4)
    C, P, n = 10, 64, 600
    y = np.arange(n) % C
    H = rng.normal(size=(C, P))[y] + 3.0 * rng.normal(size=(n, P))
    base = collapse_metrics(H, y)
    ref = brute(H, y, rng.normal(size=(C, P)))["nc1"]  # pinv of Σ_B, on the offset-free data
    assert base["nc1"] == pytest.approx(ref, rel=1e-8)
    shifted = collapse_metrics(H + offset, y)
    for k in shifted:
        assert shifted[k] == pytest.approx(base[k], rel=1e-6), k


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_split_any_merge_order(d):
    rng = np.random.default_rng(d.draw(st.integers(0, 2**31 - 1)))
    H, y, W = data(rng, n=36, P=5, C=3)
    cuts = sorted(d.draw(st.lists(st.integers(1, 35), max_size=5, unique=True)))
    bounds = [0, *cuts, 36]
    parts = [CollapseStats(3).update(H[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    parts = [CollapseStats.from_state(p.to_state()) for p in parts]
    order = d.draw(st.permutations(range(len(parts))))
    acc = parts[order[0]]
    for i in order[1:]:
        acc.merge(parts[i])
    ref = collapse_metrics(H, y, W)
    got = acc.result(W)
    for k in COLLAPSE_KEYS:
        assert got[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-13), k


def test_errors_and_state(tmp_path):
    rng = np.random.default_rng(3)
    H, y, W = data(rng)
    with pytest.raises(ValueError, match="no examples"):
        CollapseStats(5).update(H, y).result()
    Hn = H.copy()
    Hn[0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        collapse_metrics(Hn, y)
    with pytest.raises(ValueError, match="shape"):
        collapse_metrics(H, y, W[:, :3])
    with pytest.raises(ValueError, match="at least 2 classes"):
        CollapseStats(1)
    acc = CollapseStats(4, name="s/pool").update(H, y)
    np.savez(tmp_path / "c.npz", **acc.to_state())
    back = CollapseStats.from_state(dict(np.load(tmp_path / "c.npz")))
    for k, v in back.to_state().items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(acc.to_state()[k]))
    assert back.result(W) == acc.result(W)


def test_scatter_merge_is_in_place():
    """Merging a part's P × P scatter made new arrays for each sum (m2 + m2_b + product: ~3 P² alive
    beside the state), so collapse and --spectra peaked at 2.6-4x the state the drivers budget by. The
    merge adds in place: one P × P product beside the state and the part, and the same numbers."""
    import tracemalloc

    from repsim.kernels._moments import ClassMoments

    rng = np.random.default_rng(3)
    P, K = 400, 5
    parts = []
    for _ in range(2):
        X = rng.normal(size=(300, P))
        y = np.arange(300) % K
        part = ClassMoments(K, second="matrix")
        part.update(X, y, np)
        parts.append((part, X, y))
    acc = ClassMoments(K, second="matrix")
    acc.merge(parts[0][0])
    tracemalloc.start()
    acc.merge(parts[1][0])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.5 * 8 * P * P, peak / (8 * P * P)
    X = np.concatenate([parts[0][1], parts[1][1]])
    y = np.concatenate([parts[0][2], parts[1][2]])
    R = X - np.stack([X[y == k].mean(axis=0) for k in range(K)])[y]
    np.testing.assert_allclose(acc.m2, R.T @ R, rtol=1e-10, atol=1e-8)
