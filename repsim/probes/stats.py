"""Statistics behind the paper's tables.

- :func:`mean_se`: per-seed mean ± standard error, ``s.e. = std(ddof=1) / sqrt(n)``.
- :func:`ttest`: two-sample Student t-test (pooled variance, two-sided; ``equal_var=False`` for Welch).
- :func:`not_significantly_worse`: the names whose mean is the best, or not significantly different
  from the best at ``alpha`` (Table 1/B.1/D.1 bold-facing: "values not significantly different than the
  best are bold-faced (p < 0.05, t-test)"), by Student's pooled two-sample t-test unless ``equal_var=False``.
  As in the paper, the best is chosen from the same data and each comparison is at ``alpha`` with no
  multiplicity correction: with 9 equal groups of 2 seeds, 0.095 of the others are un-bolded per
  comparison, and at least one in 0.37 of samples (statistical audit).
- :func:`spearman`: Spearman's ρ with its two-sided p-value (Fig. 5a: ρ = −0.93, p = 0.002): exact (all n!
  pairings of the ranks) for n ≤ :data:`SPEARMAN_EXACT_MAX_N` pairs, the t approximation beyond; and
  :func:`spearman_null`, the exact null distribution of ρ for untied ranks.
- :func:`anova_two_way`: p-value of the main effect of the row factor in a balanced two-way ANOVA
  (Table 2's "Avg." column: "two-way ANOVA for average"), and :func:`not_significantly_worse_anova`.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Mapping, Sequence

import numpy as np
from scipy import stats as _st


def mean_se(values: Sequence[float] | np.ndarray, axis: int = 0) -> tuple[np.ndarray | float, np.ndarray | float]:
    """(mean, standard error of the mean) along ``axis``; s.e. is NaN for a single value."""
    v = np.asarray(values, dtype=np.float64)
    n = v.shape[axis]
    if n == 0:
        raise ValueError("mean_se of an empty sample")
    m = v.mean(axis=axis)
    se = v.std(axis=axis, ddof=1) / np.sqrt(n) if n > 1 else np.full_like(m, np.nan)
    return (float(m), float(se)) if np.ndim(m) == 0 else (m, se)


def ttest(a: Sequence[float], b: Sequence[float], equal_var: bool = True) -> tuple[float, float]:
    """(t, two-sided p) of the two-sample t-test of a vs b.  (Groups whose values agree to ~1e-15 make
    SciPy warn about precision loss in the variance; the test is still what it computes — reports
    print p with two digits — so that warning is not passed on to every figure's log.)"""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        raise ValueError(f"a t-test needs at least 2 values per group, got {a.size} and {b.size}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Precision loss occurred", category=RuntimeWarning)
        r = _st.ttest_ind(a, b, equal_var=equal_var)
    return float(r.statistic), float(r.pvalue)


def ttest_p(a: Sequence[float], b: Sequence[float], equal_var: bool = True) -> float | None:
    """Two-sided p of :func:`ttest` of a vs b as the bold rule reads it: None with fewer than 2 values in
    either group (no test); with no spread in either, its limit: 1 for equal means, 0 for different ones."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        return None
    if np.all(a == a[0]) and np.all(b == b[0]):
        return 1.0 if a[0] == b[0] else 0.0
    return ttest(a, b, equal_var)[1]


def not_significantly_worse(groups: Mapping[str, Sequence[float]], alpha: float = 0.05,
                            higher_is_better: bool = True, equal_var: bool = True) -> set[str]:
    """Names to bold-face: the group with the best mean and every group whose t-test (Student's pooled;
    Welch's with ``equal_var=False``) against it has p ≥ ``alpha``, not corrected for the number of
    comparisons nor for the best being chosen from the same data. Groups of one value cannot be tested:
    they are included only if they are the best (or equal to it). Identical constant groups count as tied
    (p = 1)."""
    def tied(v, best) -> bool:  # (equal constant groups: equal means, which _best_and_ties keeps anyway)
        p = ttest_p(v, best, equal_var)
        return p is not None and p >= alpha  # untestable, or zero variance with different means: not tied

    return _best_and_ties(groups, higher_is_better, tied)


def _best_and_ties(groups: Mapping[str, Sequence[float]], higher_is_better: bool, tied) -> set[str]:
    """The group with the best mean, groups with an equal mean, and those ``tied(values, best values)``."""
    if not groups:
        return set()
    means = {k: float(np.mean(v)) for k, v in groups.items()}
    best = (max if higher_is_better else min)(means, key=means.get)
    return {k for k, v in groups.items() if k == best or means[k] == means[best] or tied(v, groups[best])}


SPEARMAN_EXACT_MAX_N = 9  # 9! = 362,880 pairings: enumerated in a few tens of milliseconds


@functools.lru_cache(maxsize=None)
def _orderings(n: int) -> np.ndarray:
    """All n! orderings of range(n) as an (n!, n) int8 array, built by inserting each new element at every
    position of the orderings of the previous ones (read-only: it is cached)."""
    p = np.zeros((1, 0), dtype=np.int8)
    for k in range(n):
        m = p.shape[0]
        out = np.empty((m * (k + 1), k + 1), dtype=np.int8)
        for i in range(k + 1):
            blk = out[i * m:(i + 1) * m]
            blk[:, :i], blk[:, i], blk[:, i + 1:] = p[:, :i], k, p[:, i:]
        p = out
    p.setflags(write=False)
    return p


def _pairing_sums(rx: np.ndarray, ry: np.ndarray) -> tuple[float, np.ndarray]:
    """(observed Σ 2rx·2ry, the same sum under every pairing of ``ry`` with ``rx``): average ranks doubled are
    integers, so the sums are exact in float64, and ρ is increasing in the sum (its other terms do not depend
    on the pairing)."""
    a, b = 2.0 * rx, 2.0 * ry
    return float(a @ b), b[_orderings(len(b))] @ a


def spearman(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(ρ, two-sided p) of Spearman's rank correlation. For n ≤ :data:`SPEARMAN_EXACT_MAX_N` pairs p is the
    exact permutation p over all n! pairings of the ranks (ties: average ranks), two-sided as in
    ``scipy.stats.permutation_test``: 2 · min(P(ρ* ≤ ρ), P(ρ* ≥ ρ)), at most 1. Beyond that, scipy's
    t-distribution approximation, which at small n is anticonservative (n = 5: ρ = 0.9 gets p = 0.037,
    exact 0.083). p is NaN when either sample is constant."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 3:
        raise ValueError(f"spearman needs two 1-D samples of equal length ≥ 3, got {x.shape}, {y.shape}")
    r = _st.spearmanr(x, y)
    rho = float(r.statistic)
    if x.size > SPEARMAN_EXACT_MAX_N or not np.isfinite(rho):
        return rho, float(r.pvalue)
    obs, null = _pairing_sums(_st.rankdata(x), _st.rankdata(y))
    p = 2 * min(np.count_nonzero(null <= obs), np.count_nonzero(null >= obs)) / null.size
    return rho, float(min(p, 1.0))


def spearman_null(n: int) -> np.ndarray:
    """ρ under each of the n! pairings of two untied rankings of n (n ≤ :data:`SPEARMAN_EXACT_MAX_N`): the
    exact null distribution of Spearman's ρ, 1 − 6 Σd² / (n(n² − 1))."""
    if not 2 <= n <= SPEARMAN_EXACT_MAX_N:
        raise ValueError(f"the exact null is enumerated for 2 ≤ n ≤ {SPEARMAN_EXACT_MAX_N}, got {n}")
    d2 = ((_orderings(n) - np.arange(n)) ** 2).sum(axis=1)
    return 1.0 - 6.0 * d2 / (n * (n * n - 1))


def anova_two_way(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(F, p) of the main effect "a vs b" in a balanced two-way ANOVA with replication.

    ``a`` and ``b`` are (n, T) arrays: n replicates (seeds) × T levels of the second factor (tasks) for
    each of the two groups (objectives). Sums of squares of the balanced design: SS_group = nT Σ_g (ḡ −
    m)²; with n ≥ 2 the error is the within-cell sum of squares (df 2T(n − 1), the model with
    interaction); with n = 1 the interaction is the error (df T − 1, the additive model). F = SS_group /
    MS_error on (1, df) degrees of freedom. With T = 1 this is the pooled two-sample t-test (F = t²).
    """
    if np.ndim(a) != 2 or np.shape(a) != np.shape(b) or min(np.shape(a)) < 1:
        raise ValueError(f"anova_two_way needs two equal (n, T) arrays, got {np.shape(a)} and {np.shape(b)}")
    x = np.stack([np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)])  # (2, n, T)
    _, n, T = x.shape
    m = x.mean()
    cell = x.mean(axis=1)                                   # (2, T)
    g, t = cell.mean(axis=1), cell.mean(axis=0)             # (2,), (T,)
    ss_group = n * T * ((g - m) ** 2).sum()
    if n >= 2:
        ss_err, df = ((x - cell[:, None, :]) ** 2).sum(), 2 * T * (n - 1)
    else:
        ss_err, df = (n * (cell - g[:, None] - t[None, :] + m) ** 2).sum(), T - 1
    if df < 1:
        raise ValueError("anova_two_way needs at least 2 replicates or 2 levels of the second factor")
    if ss_err == 0:
        return (math.inf, 0.0) if ss_group > 0 else (math.nan, 1.0)
    F = ss_group / (ss_err / df)
    return float(F), float(_st.f.sf(F, 1, df))


def not_significantly_worse_anova(groups: Mapping[str, np.ndarray], alpha: float = 0.05,
                                  higher_is_better: bool = True) -> set[str]:
    """:func:`not_significantly_worse` for (n, T) arrays (seeds × tasks), comparing the average over
    tasks: the group with the best mean and every group whose :func:`anova_two_way` against it has
    p ≥ ``alpha`` (Table 2, "Avg.")."""
    return _best_and_ties(groups, higher_is_better, lambda v, best: anova_two_way(v, best)[1] >= alpha)


__all__ = ["mean_se", "ttest", "ttest_p", "not_significantly_worse", "spearman", "spearman_null", "anova_two_way",
           "not_significantly_worse_anova"]
