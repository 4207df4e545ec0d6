"""Simulations with a known population value for the coverage of the toolkit's intervals.

Shared by tests/test_coverage.py (a few hundred replicates per case, a binomial band around the level)
and bench/coverage.py (thousands, the numbers docs/architecture.md quotes).

Minibatch CKA (:meth:`repsim.MinibatchCKA.ci`). Layers X = Z (p features, Z ~ N(0, Σ), Σ = diag(1, ..., 1/p))
and Y = Z M + σ E (E ~ N(0, I)): population linear CKA

    CKA = ‖Σ_XY‖²_F / (‖Σ_XX‖_F ‖Σ_YY‖_F),  Σ_XY = Σ M,  Σ_YY = Mᵀ Σ M + σ² I,

which per-batch debiased HSIC₁ estimates without bias in its numerator and denominators (Song et al. 2012).
The per-batch HSIC₁ of every replicate is computed at once (:func:`hsic1`, Song's formula, vectorised
over replicates and batches; :func:`check_against_batch_hsic` shows it equals the toolkit's
``batch_hsic``), and each replicate's records go through the toolkit's own ``MinibatchCKA.ci``.

Finding 2 (:func:`repsim.analyses.findings.bootstrap_gaps`). A population of objectives: objective j's
same-objective CKA at layer l is S[l, j] = μ_S(l) + a_j(l) + noise and its cross CKA with k is
C[l, j, k] = μ_C(l) + b_j(l) + b_k(l) + noise (symmetric). The population gaps are μ_S − μ_C averaged
over the early and late layers; the bootstrap resamples the objectives.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np


# -- minibatch CKA ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gaussian:
    """Two jointly Gaussian layers with a planted linear relation (module docstring)."""

    p: int = 6
    q: int = 4
    noise: float = 1.5
    seed: int = 0

    def mixing(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        scale = np.sqrt(1.0 / np.arange(1, self.p + 1))  # Σ = diag(1, 1/2, ..., 1/p)
        return scale, rng.standard_normal((self.p, self.q))

    def population_cka(self) -> float:
        scale, M = self.mixing()
        S = np.diag(scale ** 2)
        sxy = S @ M
        syy = M.T @ S @ M + self.noise ** 2 * np.eye(self.q)
        return float(np.sum(sxy ** 2) / (np.linalg.norm(S) * np.linalg.norm(syy)))

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(X, Y) of shape (*shape, p) and (*shape, q)."""
        scale, M = self.mixing()
        X = rng.standard_normal((*shape, self.p)) * scale
        Y = X @ M + self.noise * rng.standard_normal((*shape, self.q))
        return X, Y


def hsic1(K: np.ndarray, L: np.ndarray) -> np.ndarray:
    """Song et al.'s unbiased HSIC₁ of Grams (..., n, n), vectorised over the leading axes:
    [tr(K̃L̃) + 1ᵀK̃1 · 1ᵀL̃1 / ((n-1)(n-2)) − 2/(n-2) · 1ᵀK̃L̃1] / (n(n-3)), K̃ = K with a zero diagonal."""
    n = K.shape[-1]
    eye = np.eye(n, dtype=bool)
    Kt, Lt = np.where(eye, 0.0, K), np.where(eye, 0.0, L)
    rk, rl = Kt.sum(-1), Lt.sum(-1)
    return ((Kt * Lt).sum((-2, -1)) + rk.sum(-1) * rl.sum(-1) / ((n - 1) * (n - 2))
            - 2.0 / (n - 2) * (rk * rl).sum(-1)) / (n * (n - 3))


def batch_records(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Per-batch HSIC₁ records (..., 3) in MinibatchCKA's triangle order (0,0), (0,1), (1,1) of the
    linear Grams of X (..., b, p) and Y (..., b, q)."""
    K = X @ np.swapaxes(X, -1, -2)
    L = Y @ np.swapaxes(Y, -1, -2)
    return np.stack([hsic1(K, K), hsic1(K, L), hsic1(L, L)], axis=-1)


def check_against_batch_hsic(model: Gaussian, b: int, seed: int = 99) -> None:
    """:func:`batch_records` equals the toolkit's ``batch_hsic`` on a few batches (float64 rounding)."""
    from repsim.kernels.hsic import batch_hsic

    X, Y = model.sample(np.random.default_rng(seed), (3, b))
    mine = batch_records(X, Y)
    for i in range(3):
        h = batch_hsic([X[i], Y[i]])
        np.testing.assert_allclose(mine[i], [h[0, 0], h[0, 1], h[1, 1]], rtol=1e-10, atol=1e-12)


def accumulator(records: np.ndarray, b: int, max_records: int = 512):
    """A MinibatchCKA holding ``records`` (B, 3) as its per-batch statistics (one batch each, in arrival
    order; past ``max_records`` the accumulator pairs them up as it does while updating)."""
    from repsim.kernels.minibatch_cka import MinibatchCKA

    acc = MinibatchCKA(2, max_records=max_records)
    for r in records:
        acc._add_record(np.asarray(r, dtype=np.float64), 1)  # what update() does after batch_hsic
    total = records.sum(0)
    acc.hsic = np.array([[total[0], total[1]], [total[1], total[2]]])
    acc.n_batches, acc.n_examples = len(records), len(records) * b
    return acc


def cka_records(model: Gaussian, reps: int, batches: int, b: int, seed: int, epochs: int = 1,
                chunk: int = 100) -> np.ndarray:
    """(reps, epochs · batches, 3) per-batch HSIC₁ records: each replicate draws n = batches · b examples
    once and cuts them into batches in ``epochs`` independent random orders (epoch-major)."""
    rng = np.random.default_rng(seed)
    out = np.empty((reps, epochs * batches, 3))
    for s in range(0, reps, chunk):
        r = min(chunk, reps - s)
        X, Y = model.sample(rng, (r, batches * b))
        for e in range(epochs):
            order = np.argsort(rng.random((r, batches * b)), axis=1) if e else np.arange(batches * b)[None]
            Xe = np.take_along_axis(X, order[..., None], axis=1).reshape(r, batches, b, -1)
            Ye = np.take_along_axis(Y, order[..., None], axis=1).reshape(r, batches, b, -1)
            out[s:s + r, e * batches:(e + 1) * batches] = batch_records(Xe, Ye)
    return out


def cka_coverage(model: Gaussian, reps: int, batches: int, b: int = 24, *, epochs: int = 1, level: float = 0.95,
                 n_boot: int = 1000, seed: int = 0, max_records: int = 512, narrow: float = 1.0) -> dict:
    """Fraction of replicates whose ``MinibatchCKA.ci(level, draws=batches)`` holds the population CKA.
    ``narrow`` < 1 shrinks each interval about its estimate by that factor (a deliberately wrong
    interval, for the test of the test). Also returns the mean width and the count behind the fraction."""
    truth = model.population_cka()
    recs = cka_records(model, reps, batches, b, seed, epochs)
    hit, width = 0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the few-batches warning: measured here
        for i in range(reps):
            acc = accumulator(recs[i], b, max_records)
            draws = batches if epochs > 1 or max_records < batches else None  # (None: every record, once)
            lo, hi = acc.ci(level, n_boot=n_boot, seed=i, draws=draws)
            lo, hi = lo[0, 1], hi[0, 1]
            if narrow != 1.0:
                est = acc.result()[0, 1]
                lo, hi = est + narrow * (lo - est), est + narrow * (hi - est)
            hit += bool(lo <= truth <= hi)
            width += hi - lo
    return {"coverage": hit / reps, "hits": hit, "reps": reps, "width": width / reps, "truth": truth}


# -- exact-route jackknife (repsim.kernels.jackknife) ---------------------------------------
def exact_cka(K: np.ndarray, L: np.ndarray, debiased: bool) -> np.ndarray:
    """Exact linear CKA of Grams (..., n, n), vectorised over the leading axes: HSIC₁ (:func:`hsic1`) or
    the double-centred HSIC₀ (its 1/(n−1)² cancels in the ratio)."""
    if debiased:
        return hsic1(K, L) / np.sqrt(hsic1(K, K) * hsic1(L, L))
    def center(M: np.ndarray) -> np.ndarray:  # H M H = M − row means − column means + grand mean
        r = M.mean(-1, keepdims=True)
        return M - r - np.swapaxes(r, -1, -2) + r.mean(-2, keepdims=True)

    Kc, Lc = center(K), center(L)
    return (Kc * Lc).sum((-2, -1)) / np.sqrt((Kc * Kc).sum((-2, -1)) * (Lc * Lc).sum((-2, -1)))


def jackknife_cka_values(X: np.ndarray, Y: np.ndarray, groups: int, debiased: bool, seed: int = 0
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(estimates (reps,), delete-a-group replicates (G, reps)) of exact linear CKA between X (reps, n, p)
    and Y (reps, n, q), with the toolkit's groups (:func:`repsim.kernels.jackknife.jackknife_groups`)."""
    from repsim.kernels.jackknife import jackknife_groups

    n = X.shape[1]
    K = X @ np.swapaxes(X, -1, -2)
    L = Y @ np.swapaxes(Y, -1, -2)
    est = exact_cka(K, L, debiased)
    reps = []
    for part in jackknife_groups(n, groups, seed):
        keep = np.setdiff1d(np.arange(n), part)
        reps.append(exact_cka(K[:, keep][:, :, keep], L[:, keep][:, :, keep], debiased))
    return est, np.stack(reps)


def check_jackknife_against_toolkit(model: Gaussian, n: int, groups: int, debiased: bool, seed: int = 98) -> None:
    """:func:`jackknife_cka_values` equals the toolkit's replicates (``jackknife_replicates`` on
    ``full_column``s: every exact measure's path) on a few data sets."""
    from repsim.kernels.measures import get_measure
    from repsim.kernels.measures.exact import full_column
    from repsim.kernels.jackknife import jackknife_replicates

    X, Y = model.sample(np.random.default_rng(seed), (2, n))
    est, reps = jackknife_cka_values(X, Y, groups, debiased, seed=3)
    m = get_measure("linear_cka", debiased=debiased)
    for i in range(2):
        got = jackknife_replicates(m, [full_column(X[i]), full_column(Y[i])], groups, seed=3)
        np.testing.assert_allclose(got[:, 0, 1], reps[:, i], rtol=1e-10, atol=1e-12)


def jackknife_coverage(model: Gaussian, reps: int, n: int, groups: int = 20, *, debiased: bool = True,
                       level: float = 0.95, seed: int = 0, chunk: int = 50, narrow: float = 1.0) -> dict:
    """Fraction of replicates (data sets of n examples) whose exact-route jackknife interval of linear
    CKA (the toolkit's :func:`~repsim.kernels.jackknife.jackknife_interval`) holds the population
    CKA; ``narrow`` as in :func:`cka_coverage`.  Also the mean width and the estimator's mean bias."""
    from repsim.kernels.jackknife import jackknife_interval

    truth = model.population_cka()
    rng = np.random.default_rng(seed)
    hit, width, bias = 0, 0.0, 0.0
    for s in range(0, reps, chunk):
        r = min(chunk, reps - s)
        X, Y = model.sample(rng, (r, n))
        est, jr = jackknife_cka_values(X, Y, groups, debiased, seed=s)
        lo, hi = jackknife_interval(est, jr, level, (0.0, 1.0))
        lo, hi = est + narrow * (lo - est), est + narrow * (hi - est)
        hit += int(np.sum((lo <= truth) & (truth <= hi)))
        width += float(np.sum(hi - lo))
        bias += float(np.sum(est - truth))
    return {"coverage": hit / reps, "hits": hit, "reps": reps, "width": width / reps, "bias": bias / reps,
            "truth": truth}


# -- finding 2 ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Objectives:
    """A population of objectives' per-layer CKA (module docstring): 12 layers, the last 4 "late"
    (the gap μ_S − μ_C is ``early_gap`` before them and ``late_gap`` in them), objective effects of
    s.d. ``spread`` and pair noise of s.d. ``noise``."""

    layers: int = 12
    n_late: int = 4
    early_gap: float = 0.01
    late_gap: float = 0.08
    spread: float = 0.03
    noise: float = 0.01

    @property
    def early(self) -> list[int]:
        return list(range(self.layers - self.n_late))

    @property
    def late(self) -> list[int]:
        return list(range(self.layers - self.n_late, self.layers))

    def truth(self) -> dict[str, float]:
        return {"early": self.early_gap, "late": self.late_gap, "late-early": self.late_gap - self.early_gap}

    def sample(self, rng: np.random.Generator, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(S (layers, k), C (layers, k, k)) for k objectives drawn from the population (C's diagonal NaN,
        as repsim.analyses.findings._pair_means leaves it)."""
        L = self.layers
        gap = np.where(np.arange(L) < L - self.n_late, self.early_gap, self.late_gap)
        mu_c = np.linspace(0.9, 0.4, L)
        S = mu_c[:, None] + gap[:, None] + self.spread * rng.standard_normal((L, k)) \
            + self.noise * rng.standard_normal((L, k))
        b = self.spread * rng.standard_normal((L, k))
        e = self.noise * rng.standard_normal((L, k, k))
        C = mu_c[:, None, None] + b[:, :, None] + b[:, None, :] + (e + np.swapaxes(e, 1, 2)) / np.sqrt(2)
        C[:, np.arange(k), np.arange(k)] = np.nan
        return S, C


def gaps_coverage(model: Objectives, reps: int, k: int = 9, *, n_boot: int = 2000, seed: int = 0,
                  narrow: float = 1.0) -> dict:
    """Per statistic (early, late, late − early): the fraction of replicates of k objectives whose
    ``bootstrap_gaps`` interval holds the population value (``narrow``: as in :func:`cka_coverage`)."""
    from repsim.analyses.findings import _same_cross, bootstrap_gaps

    rng = np.random.default_rng(seed)
    truth = model.truth()
    hits = dict.fromkeys(truth, 0)
    for i in range(reps):
        S, C = model.sample(rng, k)
        ci = bootstrap_gaps(S, C, model.early, model.late, n_boot=n_boot, seed=i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            g = np.subtract(*_same_cross(S, C, np.arange(k)))
        est = {"early": np.mean(g[model.early]), "late": np.mean(g[model.late])}
        est["late-early"] = est["late"] - est["early"]
        for key, (lo, hi) in ci.items():
            lo, hi = est[key] + narrow * (lo - est[key]), est[key] + narrow * (hi - est[key])
            hits[key] += bool(lo <= truth[key] <= hi)
    return {key: {"coverage": h / reps, "hits": h, "reps": reps} for key, h in hits.items()}


def binomial_band(level: float, reps: int, z: float = 3.5) -> tuple[float, float]:
    """level ± z binomial standard errors of a coverage fraction from ``reps`` replicates."""
    se = np.sqrt(level * (1 - level) / reps)
    return level - z * se, level + z * se
