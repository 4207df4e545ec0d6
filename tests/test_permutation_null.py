"""Permutation nulls and calibrated similarity (repsim/kernels/permutation.py, minibatch_null.py,
analytic_null.py, measures/_null.py; the engine's calibration): each kernel against a brute-force
reference written from its formula (NumPy and array-api-strict), the exact permutation moments against
all 7! permutations and a Monte Carlo null, the p-values' calibration where the truth is known (uniform
on independent data, 1/(K + 1) on dependent data), and agreement with the reference tool
``calibrated_similarity`` (Gröger et al. 2026) on the same arrays and permutations."""
from __future__ import annotations

import itertools
import math

import array_api_strict as xs
import numpy as np
import pytest
from scipy import stats

from repsim.kernels.analytic_null import MinibatchAnalytic, invariants, pearson3_calibration, permutation_moments
from repsim.kernels.measures import Measure, get_measure, measure_names
from repsim.kernels.measures.exact import full_column
from repsim.kernels.measures.exact import calibrated_similarity, exact_null, group_permutations
from repsim.kernels.measures.linear_cka import hsic_prepared
from repsim.kernels.minibatch_cka import MinibatchCKA
from repsim.kernels.minibatch_null import MinibatchNull
from repsim.kernels.permutation import (calibrate, check_null, gram_null_products, knn_null_overlaps, order_index,
                                        permutations)

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(xs, id="strict")]


def related(rng, n, p=(8, 5), noise=1.0):
    X = rng.normal(size=(n, p[0]))
    return X, X @ rng.normal(size=(p[0], p[1])) + noise * rng.normal(size=(n, p[1]))


def centered(X):
    Xc = X - X.mean(axis=0)
    return Xc @ Xc.T


# --- the calibration rule ---------------------------------------------------------------------------------

def brute_calibrate(s, nulls, alpha, smax):
    K = len(nulls)
    both = sorted([s, *nulls])
    tau = both[math.ceil((1 - alpha) * (K + 1)) - 1]
    p = (1 + sum(v >= s for v in nulls)) / (K + 1)
    cal = max(s - tau, 0.0) if smax is None else min(1.0, max(0.0, (s - tau) / max(smax - tau, 1e-12)))
    return cal, p, tau


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("smax", [1.0, None])
def test_calibrate_is_groeger_et_al_rule(xp, smax):
    rng = np.random.default_rng(0)
    obs = rng.uniform(0, 1, size=(3, 4))
    obs[0, 0] = np.nan
    nulls = rng.uniform(0, 0.9, size=(39, 3, 4))
    nulls[:, 1, 1] = obs[1, 1]  # ties count as "≥ observed"
    nulls[5, 2, 3] = np.nan
    cal, p, tau = (np.asarray(a) for a in calibrate(xp.asarray(obs), xp.asarray(nulls), 0.1, smax))
    for i, j in itertools.product(range(3), range(4)):
        if (i, j) in ((0, 0), (2, 3)):
            assert np.isnan(p[i, j]) and np.isnan(tau[i, j]) and np.isnan(cal[i, j])
            continue
        want = brute_calibrate(obs[i, j], list(nulls[:, i, j]), 0.1, smax)
        np.testing.assert_allclose([cal[i, j], p[i, j], tau[i, j]], want, rtol=0, atol=1e-15)
    assert p[1, 1] == 1.0
    assert order_index(199, 0.05) == 189  # ⌈0.95 · 200⌉ = 190th order statistic


@pytest.mark.parametrize("K, alpha, message", [
    (0, 0.05, "permutations must be an integer >= 1"), (2.5, 0.05, "integer >= 1"),
    (100, 0.0, r"alpha must lie in \(0, 1\)"), (100, 1.0, "alpha must lie"),
    (10, 0.05, "cannot reach alpha = 0.05: the smallest p-value is 1/\\(K \\+ 1\\) = 0.0909.*at least 19"),
])
def test_check_null_refuses_in_one_line(K, alpha, message):
    with pytest.raises(ValueError, match=message) as err:
        check_null(K, alpha)
    assert "\n" not in str(err.value)


def test_check_null_accepts_the_smallest_k_for_alpha():
    check_null(19, 0.05)
    check_null(99, 0.01)
    with pytest.raises(ValueError, match="null must be"):
        check_null(100, 0.05, "bootstrap")


def test_permutations_are_uniform_and_seeded():
    P = permutations(4000, 5, [7, 1])
    assert np.array_equal(np.sort(P, axis=1), np.tile(np.arange(5), (4000, 1)))
    assert np.array_equal(P, permutations(4000, 5, [7, 1])) and not np.array_equal(P, permutations(4000, 5, [7, 2]))
    counts = np.bincount(P[:, 0], minlength=5)  # where row 0 goes: uniform
    assert stats.chisquare(counts).pvalue > 1e-3


# --- batched null products --------------------------------------------------------------------------------

@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("diagonal", [True, False])
def test_gram_null_products_equal_permuted_frobenius_products(xp, diagonal):
    rng = np.random.default_rng(1)
    n = 9
    A = rng.normal(size=(3, n, n))
    A = A + np.transpose(A, (0, 2, 1))
    B = A[1:] * 1.5 + 0.1
    if not diagonal:
        for M in (A, B):
            M[:, np.arange(n), np.arange(n)] = 0.0
    P = permutations(6, n, 0)
    got = np.asarray(gram_null_products(xp.asarray(A), xp.asarray(B), P, diagonal=diagonal, gather_bytes=2000))
    want = np.array([[[np.sum(a * b[np.ix_(p, p)]) for b in B] for a in A] for p in P])
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_knn_null_overlaps_equal_the_measure_on_permuted_rows(xp):
    rng = np.random.default_rng(2)
    n, k = 40, 4
    m = get_measure("mutual_knn", knn_k=k)
    X, Y = related(rng, n)
    Z = rng.normal(size=(n, 6))
    lists = [m.prepare(full_column(c)) for c in (X, Y, Z)]
    P = permutations(5, n, 3)
    got = np.asarray(knn_null_overlaps([xs.asarray(a) if xp is xs else a for a in lists],
                                       [xs.asarray(b) if xp is xs else b for b in lists[1:]], P))
    want = np.array([[[m.pair(a, m.prepare(full_column(c[p]))) for c in (Y, Z)] for a in lists] for p in P])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", measure_names())
def test_every_measure_null_is_the_measure_of_permuted_data(name):
    """null_block (batched where a measure batches it) = the measure recomputed on the permuted rows."""
    rng = np.random.default_rng(3)
    n = 50
    X, Y = related(rng, n)
    wide = rng.normal(size=(n, 80))  # p > n: the Gram / factor route
    cols = [X, Y] if name == "pwcca" else [X, Y, wide]
    m = get_measure(name, knn_k=5)
    assert m.has_null()
    prep = [m.prepare(full_column(c)) for c in cols]
    P = permutations(4, m.null_rows(n), 5)
    got = m.null_block(prep, prep, P)
    want = np.array([[[m.pair(a, m.prepare(full_column(c[p]))) for c in cols] for a in prep] for p in P])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(Measure.null_block(m, prep, prep, P), want, rtol=0, atol=1e-12)


def test_rsa_subsample_permutes_the_rows_it_uses():
    rng = np.random.default_rng(4)
    X, Y = related(rng, 60)
    m = get_measure("rsa", rsa_max_rows=30)
    assert m.null_rows(60) == 30
    a, b = m.prepare(full_column(X)), m.prepare(full_column(Y))
    perm = permutations(1, 30, 0)[0]
    used = m.rows_used(60)
    Yp = Y.copy()
    Yp[used] = Y[used][perm]  # the subsampled rows permuted among themselves
    assert m.pair(a, m.permute(b, perm)) == pytest.approx(m.pair(a, m.prepare(full_column(Yp))), abs=1e-12)


def test_exact_null_shares_one_permutation_per_group():
    rng = np.random.default_rng(5)
    n = 30
    X, Y = related(rng, n)
    Z = rng.normal(size=(n, 4))
    m = get_measure("linear_cka")
    prep = [m.prepare(full_column(c)) for c in (X, Y, Z)]
    nulls = exact_null(m, prep, [0, 0, 1], 5, 11, n)
    P0, P1 = group_permutations(5, n, 11, 0), group_permutations(5, n, 11, 1)
    for k in range(5):
        assert nulls[k, 0, 1] == pytest.approx(m.pair(prep[0], m.prepare(full_column(Y[P0[k]]))), abs=1e-14)
        assert nulls[k, 0, 2] == pytest.approx(m.pair(prep[0], m.prepare(full_column(Z[P1[k]]))), abs=1e-14)
        assert nulls[k, 1, 2] == pytest.approx(m.pair(prep[1], m.prepare(full_column(Z[P1[k]]))), abs=1e-14)
    np.testing.assert_array_equal(nulls, np.transpose(nulls, (0, 2, 1)))


# --- the within-batch null --------------------------------------------------------------------------------

def feed(acc, cols, b, xp=np):
    for t in range(cols[0].shape[0] // b):
        batch = [xp.asarray(c[t * b:(t + 1) * b]) for c in cols]
        acc.update(batch) if isinstance(acc, MinibatchCKA) else acc.update(batch, key=(0, t))
    return acc


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("debiased", [True, False])
def test_minibatch_null_is_the_sum_of_permuted_batch_hsic(xp, debiased):
    rng = np.random.default_rng(6)
    n, b, K = 96, 24, 4
    X, Y = related(rng, n)
    cols, groups = [X, Y, rng.normal(size=(n, 120))], [0, 0, 1]
    acc = feed(MinibatchNull(3, groups, K, seed=9, debiased=debiased), cols, b, xp)
    obs, null = acc.result()
    ref = feed(MinibatchCKA(3, debiased=debiased), cols, b)
    np.testing.assert_allclose(obs, ref.result(), atol=1e-12)
    want, selfh = np.zeros((K, 3, 3)), np.zeros(3)
    for t in range(n // b):
        A = [hsic_prepared(centered(c[t * b:(t + 1) * b]), debiased)[0] for c in cols]
        selfh += [np.sum(a * a) for a in A]
        for g in (0, 1):
            P = permutations(K, b, [9, 0, t, g])
            for k, i, j in itertools.product(range(K), range(3), range(3)):
                if groups[j] == g and i <= j:
                    want[k, i, j] += np.sum(A[i] * A[j][np.ix_(P[k], P[k])])
    want /= np.sqrt(np.outer(selfh, selfh))
    iu = np.triu_indices(3, 1)
    want[:, iu[1], iu[0]] = want[:, iu[0], iu[1]]
    np.testing.assert_allclose(null, want, rtol=0, atol=1e-13)


def test_minibatch_null_merges_and_round_trips():
    rng = np.random.default_rng(7)
    X, Y = related(rng, 80)
    whole = feed(MinibatchNull(2, [0, 1], 6, seed=1), [X, Y], 20)
    a = MinibatchNull(2, [0, 1], 6, seed=1)
    b = MinibatchNull(2, [0, 1], 6, seed=1)
    for t in range(4):
        (a if t < 2 else b).update([X[t * 20:(t + 1) * 20], Y[t * 20:(t + 1) * 20]], key=(0, t))
    merged = MinibatchNull.from_state(a.to_state()).merge(MinibatchNull.from_state(b.to_state()))
    np.testing.assert_allclose(merged.result()[1], whole.result()[1], rtol=1e-14)
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(MinibatchNull(2, [0, 1], 5, seed=1))


# --- analytic null: exact permutation moments -------------------------------------------------------------

@pytest.mark.parametrize("debiased", [False, True])
def test_permutation_moments_equal_enumeration_of_all_permutations(debiased):
    rng = np.random.default_rng(8)
    n = 7
    X = rng.normal(size=(n, 3)) ** 2  # skewed, so the third moment is not ~0
    Y = rng.exponential(size=(n, 4))
    A = hsic_prepared(centered(X), debiased)[0]
    B = hsic_prepared(centered(Y), debiased)[0]
    T = np.array([np.sum(A * B[np.ix_(p, p)]) for p in itertools.permutations(range(n))])
    mean, var, mu3 = (v[0, 0] for v in permutation_moments(invariants(A[None]), invariants(B[None]), n))
    scale = np.sqrt(np.sum(A * A) * np.sum(B * B))
    assert mean == pytest.approx(T.mean(), abs=1e-12 * scale)
    assert var == pytest.approx(T.var(), rel=1e-10)
    assert mu3 == pytest.approx(np.mean((T - T.mean()) ** 3), rel=1e-8, abs=1e-12 * scale ** 3)
    if debiased:  # U-centred Grams: mean 0, variance 2 ‖A‖² ‖B‖² / (n(n − 3)) whatever the data
        assert abs(mean) < 1e-12 * scale
        assert var == pytest.approx(2 * scale ** 2 / (n * (n - 3)), rel=1e-10)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_invariants_equal_their_definitions(xp):
    """The eight invariants against their formulas written out (tr(A³) as a triple sum), on symmetric
    matrices with a non-zero diagonal; NumPy with and without the reused scratch buffers, and
    array-api-strict."""
    rng = np.random.default_rng(13)
    n = 9
    mats = []
    for _ in range(3):
        X = rng.normal(size=(n, 4)) ** 2
        mats.append(centered(X) / 7.0)
    A = np.stack(mats)
    want = []
    for M in A:
        d = np.diag(M)
        want.append([d.sum(), sum(M[i, j] ** 2 for i in range(n) for j in range(n)), (d ** 2).sum(),
                     sum(M[i, j] * M[j, k] * M[k, i] for i in range(n) for j in range(n) for k in range(n)),
                     (d ** 3).sum(), (M ** 3).sum(), sum(d[i] * sum(M[i, k] ** 2 for k in range(n)) for i in range(n)),
                     sum(d[i] * M[i, j] * d[j] for i in range(n) for j in range(n))])
    got = invariants(xp.asarray(A))
    np.testing.assert_allclose(got, np.array(want), rtol=1e-12, atol=1e-12)
    if xp is np:
        scratch = np.full((2, n, n), np.nan)
        np.testing.assert_allclose(invariants(A, scratch=scratch), got, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(invariants(A, scratch=scratch), got, rtol=1e-14, atol=1e-14)  # reused


def test_minibatch_analytic_reuses_its_buffers_without_carrying_batches_over():
    """Fed the same batches, two accumulators agree whatever was in the first's buffers (a batch of
    another column built there before), and batches of another size get new buffers."""
    rng = np.random.default_rng(14)
    X, Y = related(rng, 60, noise=2.0)
    a = feed(MinibatchAnalytic(2), [X, Y], 20)
    b = MinibatchAnalytic(2)
    b.update([X[:30] * 3, Y[:30]])
    b.obs[:], b.mean[:], b.var[:], b.mu3[:], b.n_batches = 0, 0, 0, 0, 0
    b = feed(b, [X, Y], 20)
    for u, v in zip(a.result(), b.result()):
        np.testing.assert_allclose(u, v, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("debiased", [False, True])
def test_analytic_null_matches_a_monte_carlo_null(debiased):
    """Mean and variance of 10,000 permutations equal the exact moments within Monte Carlo error (4 s.e.)."""
    rng = np.random.default_rng(9)
    n, K = 40, 10_000
    X = rng.normal(size=(n, 5)) ** 2
    Y = rng.normal(size=(n, 3))
    a, b = hsic_prepared(centered(X), debiased), hsic_prepared(centered(Y), debiased)
    draws = gram_null_products(a[0][None], b[0][None], permutations(K, n, 0), diagonal=not debiased)[:, 0, 0]
    draws = draws / np.sqrt(a[1] * b[1])
    mean, var, _ = (v[0, 0] / (a[1] * b[1]) ** (e / 2) for v, e in
                    zip(permutation_moments(invariants(a[0][None]), invariants(b[0][None]), n), (1, 2, 3)))
    sd = np.sqrt(var)
    assert abs(draws.mean() - mean) < 4 * sd / np.sqrt(K)
    kurt = np.mean((draws - draws.mean()) ** 4) / draws.var() ** 2
    assert abs(draws.var() - var) < 4 * var * np.sqrt((kurt - 1) / K)


def test_pearson3_calibration_is_the_normal_limit_without_skew_and_refuses_nothing_at_zero_variance():
    cal, p, tau = pearson3_calibration(np.array([0.0, 0.2, 0.5]), np.zeros(3), np.full(3, 0.01), np.zeros(3), 0.05)
    np.testing.assert_allclose(p, stats.norm.sf([0.0, 2.0, 5.0]), rtol=1e-9)
    np.testing.assert_allclose(tau, 0.1 * stats.norm.ppf(0.95), rtol=1e-9)
    assert cal[0] == 0.0 and cal[2] == pytest.approx((0.5 - tau[2]) / (1 - tau[2]))
    cal, p, tau = pearson3_calibration(np.array([0.3, -0.1]), np.zeros(2), np.zeros(2), np.zeros(2), 0.05)
    assert list(p) == [0.0, 1.0] and list(tau) == [0.0, 0.0]


def test_minibatch_analytic_sums_batch_cumulants():
    rng = np.random.default_rng(10)
    X, Y = related(rng, 60, noise=5.0)
    acc = feed(MinibatchAnalytic(2), [X, Y], 20)
    obs, mean, var, mu3 = acc.result()
    K = 4000
    mc = feed(MinibatchNull(2, [0, 1], K, seed=2), [X, Y], 20).result()[1][:, 0, 1]
    assert abs(mc.mean() - mean[0, 1]) < 4 * np.sqrt(var[0, 1] / K)
    assert mc.var() == pytest.approx(var[0, 1], rel=0.1)
    assert obs[0, 1] == pytest.approx(feed(MinibatchCKA(2), [X, Y], 20).result()[0, 1], abs=1e-12)


# --- validity: the p-values' calibration ------------------------------------------------------------------

def test_pvalues_are_uniform_on_independent_data():
    """400 pairs of related columns with the rows of one side shuffled: KS does not reject uniformity
    of the permutation p-values and the rejection rate at 0.05 lies in [0.02, 0.08] (exact route,
    linear CKA and mutual k-NN; K = 99)."""
    rng = np.random.default_rng(11)
    ps = {"linear_cka": [], "mutual_knn": []}
    for r in range(200):
        X, Y = related(rng, 30, p=(6, 4), noise=0.5)
        Y = Y[rng.permutation(30)]  # independent of X: the truth is known
        for name in ps:
            ps[name].append(calibrated_similarity(X, Y, name, permutations=99, seed=r, knn_k=3)["pvalue"])
    allp = np.concatenate([ps[m] for m in ps])
    assert stats.kstest(allp, "uniform").pvalue > 0.01
    for name, p in ps.items():
        # p is discrete (multiples of 1/100): its ≤ 0.05 rate is 0.05 exactly under the null
        assert stats.kstest(p, "uniform").pvalue > 0.01, name
    assert 0.02 <= np.mean(allp <= 0.05) <= 0.08


def test_minibatch_pvalues_are_uniform_on_independent_data():
    rng = np.random.default_rng(12)
    ps = []
    for r in range(240):
        X, Y = related(rng, 48, p=(5, 3), noise=0.5)
        Y = Y[rng.permutation(48)]
        acc = feed(MinibatchNull(2, [0, 1], 99, seed=r), [X, Y], 12)
        obs, null = acc.result()
        ps.append(float(calibrate(obs[0, 1], null[:, 0, 1], 0.05)[1]))
    assert stats.kstest(ps, "uniform").pvalue > 0.01
    assert 0.02 <= np.mean(np.array(ps) <= 0.05) <= 0.08


@pytest.mark.parametrize("name", ["linear_cka", "mutual_knn", "rsa", "procrustes", "cca", "ridge_r2"])
def test_dependent_data_reach_the_smallest_pvalue(name):
    rng = np.random.default_rng(13)
    X, Y = related(rng, 60, noise=0.05)
    out = calibrated_similarity(X, Y, name, permutations=49, knn_k=5)
    assert out["pvalue"] == pytest.approx(1 / 50)
    assert out["calibrated"] > 0 and out["threshold"] < out["value"]


# --- agreement with the reference tool --------------------------------------------------------------------

torch = pytest.importorskip("torch")
reference = pytest.importorskip("calibrated_similarity")


def torch_cka_debiased(X, Y):
    """Debiased linear CKA (Song et al.'s HSIC₁; repsim's default convention) in float64, from the formula."""
    def u(K):
        n = K.shape[0]
        K = K.clone()
        K.fill_diagonal_(0)
        r = K.sum(1)
        U = K - (r[:, None] + r[None, :]) / (n - 2) + r.sum() / ((n - 1) * (n - 2))
        U.fill_diagonal_(0)
        return U
    Kx, Ky = u(X @ X.T), u(Y @ Y.T)
    return (Kx * Ky).sum() / torch.sqrt((Kx * Kx).sum() * (Ky * Ky).sum())


def torch_mutual_knn(k):
    """Huh et al. 2024's mutual_knn (platonic-rep): cosine neighbours excluding self, mean overlap / k."""
    def sim(X, Y):
        def knn(F):
            F = F / F.norm(dim=1, keepdim=True)
            S = F @ F.T
            S.fill_diagonal_(-1e8)
            return S.argsort(dim=1, descending=True)[:, :k]
        a, b = knn(X), knn(Y)
        return (a[:, :, None] == b[:, None, :]).any(2).sum(1).double().mean() / k
    return sim


def perm_feed(P):
    it = iter(P)
    return lambda n, device: torch.as_tensor(next(it))


@pytest.mark.parametrize("name, sim", [("linear_cka", torch_cka_debiased), ("mutual_knn", torch_mutual_knn(5))])
def test_exact_route_equals_calibrated_similarity(name, sim):
    """Same arrays, same permutations (the perm_fn hook): τ and p equal the reference's, which keeps every
    score in float32 — so τ_ref = float32(τ) exactly, p_ref = float32(p), and the calibrated score equals
    the reference's to float32 rounding (and exactly when repsim's rule runs on the float32 scores)."""
    rng = np.random.default_rng(14)
    K = 199
    for noise in (0.3, 3.0, 30.0):
        X, Y = related(rng, 50, noise=noise)
        ours = calibrated_similarity(X, Y, name, permutations=K, seed=1, knn_k=5)
        P = group_permutations(K, 50, 1, 1)
        cal, p, tau = reference.calibrate(torch.as_tensor(X), torch.as_tensor(Y), sim, K=K, alpha=0.05,
                                          perm_fn=perm_feed(P))
        assert float(tau) == float(np.float32(ours["threshold"]))
        assert float(p) == float(np.float32(ours["pvalue"]))
        assert abs(float(cal) - ours["calibrated"]) < 1e-6
        s32 = np.float32(ours["value"])
        c32 = calibrate(np.asarray(s32), ours["null"].astype(np.float32), 0.05)[0]
        assert abs(float(cal) - float(c32)) <= 1e-9


@pytest.mark.parametrize("agg", ["max", "mean"])
def test_layer_aggregate_equals_calibrate_layers(tmp_path, agg):
    """Two stores of 3 and 2 layers through the engine's exact route: the (a × b) block's aggregate,
    calibrated against one permutation of store b per draw, equals calibrate_layers' on the same arrays
    and draws (float32 as above); per-pair results equal calibrate's."""
    import repsim
    from test_engine_helpers import make_store, stored

    rng = np.random.default_rng(15)
    n, K = 48, 99
    X = rng.normal(size=(n, 6))
    la = {"l0": X, "l1": np.tanh(X @ rng.normal(size=(6, 5))), "l2": rng.normal(size=(n, 4))}
    lb = {"m0": X[:, :3] + 2 * rng.normal(size=(n, 3)), "m1": rng.normal(size=(n, 7))}
    stores = [make_store(tmp_path / "a.zarr", la, chunk_rows=16), make_store(tmp_path / "b.zarr", lb, chunk_rows=16)]
    res = repsim.similarity_matrix(stores, ["linear_cka"], method="exact", permutations=K, seed=4, progress=False)
    A = [torch.as_tensor(stored(stores[0], k).astype(np.float64)) for k in la]
    B = [torch.as_tensor(stored(stores[1], k).astype(np.float64)) for k in lb]
    P = group_permutations(K, n, 4, 1)  # store b is group 1
    cal, p, tau = reference.calibrate_layers(A, B, torch_cka_debiased, agg=agg, K=K, alpha=0.05, perm_fn=perm_feed(P))
    ours = res.aggregate("linear_cka", "a", "b", agg=agg)
    assert float(tau) == float(np.float32(ours["threshold"])) or abs(float(tau) - ours["threshold"]) < 1e-7
    assert float(p) == float(np.float32(ours["pvalue"]))
    assert abs(float(cal) - ours["calibrated"]) < 1e-6
    for i, j in [(0, 0), (1, 1), (2, 0)]:
        c1, p1, t1 = reference.calibrate(A[i], B[j], torch_cka_debiased, K=K, alpha=0.05, perm_fn=perm_feed(P))
        assert float(p1) == float(np.float32(res.pvalues("linear_cka")[i, 3 + j]))
        assert abs(float(t1) - res.threshold("linear_cka")[i, 3 + j]) < 1e-7


def test_within_batch_route_agrees_with_the_reference_within_monte_carlo_error():
    """The reference with minibatch CKA over fixed batches as its statistic and within-batch permutations
    as perm_fn (its restricted-permutation hook), its own random draws (K = 1,000): its p-value and τ
    agree with repsim's within-batch null within Monte Carlo error; with repsim's draws, exactly (float32)."""
    rng = np.random.default_rng(16)
    n, b, K = 64, 16, 1000
    X, Y = related(rng, n, noise=6.0)  # weakly dependent: p in the middle, where MC error is largest

    def mb_cka(Xt, Yt):
        num = dx = dy = 0.0
        for t in range(n // b):
            s = slice(t * b, (t + 1) * b)
            Kx = torch.as_tensor(centered(Xt[s].numpy()))
            Ky = torch.as_tensor(centered(Yt[s].numpy()))
            u = [hsic_prepared(M.numpy(), True)[0] for M in (Kx, Ky)]
            num += np.sum(u[0] * u[1])
            dx += np.sum(u[0] * u[0])
            dy += np.sum(u[1] * u[1])
        return torch.tensor(num / np.sqrt(dx * dy))

    gen = np.random.default_rng(17)

    def within_batches(n_, device):
        return torch.as_tensor(np.concatenate([t * b + gen.permutation(b) for t in range(n // b)]))

    cal, p_ref, tau_ref = reference.calibrate(torch.as_tensor(X), torch.as_tensor(Y), mb_cka, K=K, alpha=0.05,
                                              perm_fn=within_batches)
    obs, null = feed(MinibatchNull(2, [0, 1], K, seed=3), [X, Y], b).result()
    ours_cal, p, tau = calibrate(obs[0, 1], null[:, 0, 1], 0.05)
    assert 0.05 < float(p) < 0.95  # the comparison is informative
    se = math.sqrt(2 * float(p) * (1 - float(p)) / K)
    assert abs(float(p_ref) - float(p)) < 4 * se
    q_se = null[:, 0, 1].std() * 0.3  # the 95 % quantile's s.e. at K = 1000 is ~0.1 sd; 3× that
    assert abs(float(tau_ref) - float(tau)) < q_se
    # the same draws: repsim's batch permutations handed over one draw at a time
    P = np.stack([np.concatenate([t * b + permutations(K, b, [3, 0, t, 1])[k] for t in range(n // b)])
                  for k in range(K)])
    _, p_same, tau_same = reference.calibrate(torch.as_tensor(X), torch.as_tensor(Y), mb_cka, K=K, alpha=0.05,
                                              perm_fn=perm_feed(P))
    assert float(p_same) == float(np.float32(p))
    assert abs(float(tau_same) - float(tau)) < 1e-7


def test_calibrated_matrix_is_calibrated_similarity_per_pair_with_one_permutation_per_draw():
    import repsim

    rng = np.random.default_rng(18)
    X, Y = related(rng, 40)
    A, B = [X, np.tanh(X)], [Y, rng.normal(size=(40, 3)), X[:, :2]]
    out = repsim.calibrated_matrix(A, B, "mutual_knn", permutations=39, seed=2, knn_k=4)
    for i, j in itertools.product(range(2), range(3)):
        one = repsim.calibrated_similarity(A[i], B[j], "mutual_knn", permutations=39, seed=2, knn_k=4)
        assert out["values"][i, j] == one["value"] and out["pvalues"][i, j] == one["pvalue"]
        assert out["threshold"][i, j] == one["threshold"] and out["calibrated"][i, j] == one["calibrated"]
        np.testing.assert_array_equal(out["null"][:, i, j], one["null"])
