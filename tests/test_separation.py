"""Class separation R² (Eq. 11/12, Table E.1) against the paper's pairwise O(n²) sums."""
from __future__ import annotations

import array_api_strict
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from repsim.kernels.separation import ClassSeparation, class_separation

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(array_api_strict, id="strict")]


def brute_r2(X: np.ndarray, y: np.ndarray, distance: str) -> float:
    """Eq. 11 written out: average pairwise distances within and over all class pairs."""
    X = X.reshape(len(X), -1).astype(np.float64)
    if distance == "cosine_centered":
        X = X - X.mean(axis=0)
    if distance == "sqeuclidean":
        D = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    else:
        nrm = np.linalg.norm(X, axis=1)
        D = 1.0 - (X @ X.T) / np.outer(nrm, nrm)
    classes = np.unique(y)
    K = len(classes)
    within = sum(D[np.ix_(y == k, y == k)].sum() / (K * (y == k).sum() ** 2) for k in classes)
    total = sum(D[np.ix_(y == j, y == k)].sum() / (K**2 * (y == j).sum() * (y == k).sum())
                for j in classes for k in classes)
    return 1.0 - within / total


def planted(rng, n, p, K, spread=1.0, mean=0.0):
    y = rng.integers(0, K, n)
    y[:K] = np.arange(K)  # every class present
    centers = rng.normal(size=(K, p)) * 2.0
    return centers[y] + spread * rng.normal(size=(n, p)) + mean, y


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("distance", ["cosine", "cosine_centered", "sqeuclidean"])
def test_matches_pairwise_sums(xp, distance):
    rng = np.random.default_rng(0)
    for n, p, K, mean in [(50, 7, 4, 0.0), (80, 3, 6, 2.0), (30, 2, 2, 0.5)]:
        X, y = planted(rng, n, p, K, mean=mean)
        got = class_separation(xp.asarray(X), xp.asarray(y), distance)
        assert got == pytest.approx(brute_r2(X, y, distance), rel=1e-10)
    X4 = rng.normal(size=(40, 2, 3, 3)) + 1.0  # conv maps are flattened
    y4 = np.arange(40) % 3
    assert class_separation(xp.asarray(X4), y4, distance) == pytest.approx(brute_r2(X4, y4, distance), rel=1e-10)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_known_answers(xp):
    rng = np.random.default_rng(1)
    dirs = rng.normal(size=(5, 6))
    y = np.repeat(np.arange(5), 7)
    scales = rng.uniform(0.5, 3.0, size=(35, 1))
    collapsed = dirs[y] * scales  # each class on one ray: cosine distances within classes are 0
    assert class_separation(xp.asarray(collapsed), y, "cosine") == pytest.approx(1.0, abs=1e-12)
    assert class_separation(xp.asarray(dirs[y]), y, "sqeuclidean") == pytest.approx(1.0, abs=1e-12)
    # App. E.1, balanced classes: R² = 1 - σ²_within/σ²_total = σ²_between/σ²_total (Eq. 18-20)
    X = rng.normal(size=(35, 6)) + 0.8 * dirs[y]
    Xt = X / np.linalg.norm(X, axis=1, keepdims=True)
    s_total = Xt.var(axis=0).sum()
    s_within = np.mean([Xt[y == k].var(axis=0).sum() for k in range(5)])
    M = np.stack([Xt[y == k].mean(axis=0) for k in range(5)])
    s_between = M.var(axis=0).sum()
    r2 = class_separation(xp.asarray(X), y, "cosine")
    assert r2 == pytest.approx(1 - s_within / s_total, rel=1e-10)
    assert r2 == pytest.approx(s_between / s_total, rel=1e-10)
    # labels carry no information about a shuffled copy: R² near 0 for a large sample
    Z = rng.normal(size=(3000, 6))
    assert class_separation(xp.asarray(Z), rng.integers(0, 5, 3000), "cosine") < 0.01


@pytest.mark.parametrize("xp", NAMESPACES)
def test_invariances(xp):
    rng = np.random.default_rng(2)
    X, y = planted(rng, 60, 5, 4, mean=1.0)
    Q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    perm = rng.permutation(60)
    for d in ("cosine", "cosine_centered", "sqeuclidean"):
        base = class_separation(xp.asarray(X), y, d)
        assert class_separation(xp.asarray(X @ Q), y, d) == pytest.approx(base, rel=1e-10)
        assert class_separation(xp.asarray(3.7 * X), y, d) == pytest.approx(base, rel=1e-10)
        assert class_separation(xp.asarray(X[perm]), y[perm], d) == pytest.approx(base, rel=1e-10)
        relabel = np.array([2, 0, 3, 1])[y]  # class names do not matter
        assert class_separation(xp.asarray(X), relabel, d) == pytest.approx(base, rel=1e-10)
    for d in ("cosine_centered", "sqeuclidean"):  # translation invariant; plain cosine is not
        assert class_separation(xp.asarray(X + 5.0), y, d) == pytest.approx(
            class_separation(xp.asarray(X), y, d), rel=1e-9)
    scaled = X * rng.uniform(0.1, 10, size=(60, 1))  # per-example scale: cosine only
    assert class_separation(xp.asarray(scaled), y, "cosine") == pytest.approx(
        class_separation(xp.asarray(X), y, "cosine"), rel=1e-10)


def stream(batches, K, distance):
    acc = ClassSeparation(K, distance)
    for X, y in batches:
        acc.update(X, y)
    if acc.needs_second_pass:
        acc = acc.next_pass()
        for X, y in batches:
            acc.update(X, y)
    return acc


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_accumulator_any_split_any_merge_order(data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    distance = data.draw(st.sampled_from(["cosine", "cosine_centered", "sqeuclidean"]))
    rng = np.random.default_rng(seed)
    K = data.draw(st.integers(2, 5))
    X, y = planted(rng, 40, 4, K, mean=1.0)
    cuts = sorted(data.draw(st.lists(st.integers(1, 39), max_size=5, unique=True)))
    bounds = [0, *cuts, 40]
    batches = [(X[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    owner = data.draw(st.lists(st.integers(0, 2), min_size=len(batches), max_size=len(batches)))
    order = data.draw(st.permutations(range(3)))

    def merged_pass(make):
        parts = [make() for _ in range(3)]
        for (xb, yb), o in zip(batches, owner):
            parts[o].update(xb, yb)
        parts = [ClassSeparation.from_state(p.to_state()) for p in parts]
        acc = parts[order[0]]
        for i in order[1:]:
            acc.merge(parts[i])
        return acc

    acc = merged_pass(lambda: ClassSeparation(K, distance))
    if acc.needs_second_pass:
        template = acc.next_pass().to_state()
        acc = merged_pass(lambda: ClassSeparation.from_state(template))
    ref = brute_r2(X, y, distance)
    assert acc.result() == pytest.approx(ref, rel=1e-9, abs=1e-12)
    assert stream(batches, K, distance).result() == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_state_round_trip_and_parts(tmp_path):
    rng = np.random.default_rng(3)
    X, y = planted(rng, 30, 4, 3)
    acc = ClassSeparation(3, "cosine_centered", name="s/pool").update(X, y)
    nxt = acc.next_pass().update(X, y)
    for a in (acc, nxt):
        st_ = a.to_state()
        np.savez(tmp_path / "s.npz", **st_)
        back = ClassSeparation.from_state(dict(np.load(tmp_path / "s.npz")))
        for k, v in back.to_state().items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(st_[k]))
    parts = nxt.parts()
    assert parts["total"] == pytest.approx(parts["within"] + parts["between"])
    assert parts["r2"] == pytest.approx(brute_r2(X, y, "cosine_centered"), rel=1e-10)


def test_errors():
    rng = np.random.default_rng(4)
    X, y = planted(rng, 20, 3, 2)
    with pytest.raises(ValueError, match="class"):
        ClassSeparation(3).update(X, y).result()  # class 2 has no examples
    Xn = X.copy()
    Xn[3, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        class_separation(Xn, y)
    Xz = X.copy()
    Xz[5] = 0.0
    with pytest.raises(ValueError, match="all zero"):
        class_separation(Xz, y, "cosine")
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        ClassSeparation(2).update(X, y + 1)
    for same in (np.full((20, 3), 0.1), np.tile(rng.normal(size=(1, 3)), (20, 1))):
        for d in ("cosine", "sqeuclidean"):
            with pytest.raises(ValueError, match="identical"):
                class_separation(same, y, d)
    with pytest.raises(ValueError, match="next_pass"):
        ClassSeparation(2, "cosine_centered").update(X, y).result()
    with pytest.raises(ValueError, match="distance"):
        ClassSeparation(2, "euclid")
    with pytest.raises(ValueError, match="at least 2 classes"):
        class_separation(X, np.zeros(20, dtype=int))
    with pytest.raises(ValueError, match="different passes"):
        ClassSeparation(2, "cosine_centered").merge(ClassSeparation(2, "cosine_centered", center=np.zeros(3)))
