"""Delete-a-group jackknife intervals over examples for the exact estimators of every measure.

The n examples are split at random (``default_rng([seed, JACKKNIFE_STREAM])``) into G groups of
⌊n/G⌋ or ⌈n/G⌉; replicate g is the measure on the n − |g| examples outside group g, every pair at
once (:func:`jackknife_replicates`: each column's :class:`FullColumn` restricted to the kept rows,
then :func:`repsim.kernels.measures.exact.exact_matrix`, so a replicate costs one exact pass over
held columns and nothing is re-read).  The interval (:func:`jackknife_interval`) is

    θ̂ ± t_{G−1, (1+level)/2} · se,   se² = (G − 1)/G · Σ_g (θ_(g) − θ̄)²,   θ̄ = mean_g θ_(g)

(Quenouille 1956, Tukey 1958; the delete-a-group form of Kott 2001, "The delete-a-group jackknife",
J. Official Statistics 17:521-526; Efron & Tibshirani 1993, ch. 11), clipped to the measure's declared
range (widened to hold the estimate: debiased CKA can fall below 0).  It is an interval for the estimator's expectation at this n: the centre is the reported value,
not bias-corrected, so where a measure's finite-sample bias is comparable to its standard error (the
biased HSIC₀ CKA at small n, CCA's and mutual k-NN's positive value on independent data) it covers the
population value less often than ``level`` says (docs/measures.md "Intervals"; tests/test_coverage.py
measures it).  A deleted group of rows is a subsample of the examples, so the interval speaks about
resampling examples from the population they were drawn from, with the networks fixed.

The group of row i never depends on the measure, so the replicates of several measures delete the
same rows (their intervals are comparable), and RSA's row cap (``rsa_max_rows``) and ridge's folds are
drawn afresh inside each replicate by the measure itself, as on the full data.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from repsim.kernels.measures import FullColumn, Measure

__all__ = ["JACKKNIFE_STREAM", "MIN_GROUPS", "jackknife_groups", "subset_column", "jackknife_replicates",
           "jackknife_interval"]

JACKKNIFE_STREAM = 0x4A4B  # "JK": the groups' random stream, apart from the permutations' and the batches'
MIN_GROUPS = 5  # below this t_{G-1} is too wide to say anything (t_3 = 3.18 at 95 %)


def jackknife_groups(n: int, groups: int, seed: int = 0) -> list[np.ndarray]:
    """A random partition of range(n) into ``groups`` sorted index arrays of ⌊n/G⌋ or ⌈n/G⌉."""
    groups = int(groups)
    if groups < MIN_GROUPS:
        raise ValueError(f"the jackknife needs at least {MIN_GROUPS} groups, got {groups}")
    if groups > n:
        raise ValueError(f"the jackknife has {groups} groups for n = {n} examples (at most one group per example)")
    order = np.random.default_rng([int(seed), JACKKNIFE_STREAM]).permutation(n)
    return [np.sort(part) for part in np.array_split(order, groups)]


def subset_column(column: FullColumn, keep: np.ndarray) -> FullColumn:
    """``column`` on the examples ``keep`` only: its rows, or its shifted Gram's rows and columns with
    the per-example sums and shift products (the shift m itself is any fixed vector, so it stays)."""
    if column.rows is not None:
        return FullColumn(column.name, column.features, rows=column.rows[keep], source_eps=column.source_eps)

    def take(v: np.ndarray | None) -> np.ndarray | None:
        return None if v is None else v[keep]

    return FullColumn(column.name, column.features, gram=column.gram[np.ix_(keep, keep)], sums=take(column.sums),
                      shift=column.shift, shift_dots=take(column.shift_dots),
                      shift_dots_c=take(column.shift_dots_c), source_eps=column.source_eps)


def jackknife_replicates(measure: Measure, columns: Sequence[FullColumn], groups: int, seed: int = 0,
                         progress: Callable[[int], Any] | None = None) -> np.ndarray:
    """(G, L, L) float64: the measure's matrix with each group of examples left out (module docstring);
    NaN where a replicate leaves a column or pair undefined.  ``progress(1)`` after each replicate."""
    from repsim.kernels.measures.exact import exact_matrix

    if not columns:
        return np.zeros((int(groups), 0, 0))
    n = columns[0].n
    parts = jackknife_groups(n, groups, seed)
    out = np.empty((len(parts), len(columns), len(columns)))
    everything = np.arange(n)
    for g, part in enumerate(parts):
        keep = np.setdiff1d(everything, part, assume_unique=True)
        out[g] = exact_matrix(measure, columns, view=lambda c: subset_column(c, keep)).values
        if progress is not None:
            progress(1)
    return out


def jackknife_interval(values: np.ndarray, replicates: np.ndarray, level: float = 0.95,
                       value_range: tuple[float, float] = (-math.inf, math.inf)) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper), each shaped like ``values``: θ̂ ± t_{G−1} · se of the delete-a-group replicates
    (module docstring), clipped to ``value_range`` (widened to hold the estimate itself: debiased CKA
    can fall below 0); NaN where the value or any replicate is NaN."""
    from scipy.stats import t as student_t

    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    reps = np.asarray(replicates, dtype=np.float64)
    G = reps.shape[0]
    if G < 2:
        raise ValueError(f"a jackknife interval needs at least 2 replicates, got {G}")
    est = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        se = np.sqrt((G - 1) / G * np.sum((reps - reps.mean(axis=0)) ** 2, axis=0))
        half = float(student_t.ppf((1.0 + float(level)) / 2.0, G - 1)) * se
        # clipped to the range, widened to hold the estimate (debiased CKA can fall below its range's 0)
        lo = np.maximum(est - half, np.minimum(float(value_range[0]), est))
        hi = np.minimum(est + half, np.maximum(float(value_range[1]), est))
    bad = ~np.isfinite(est) | ~np.all(np.isfinite(reps), axis=0)
    return np.where(bad, np.nan, lo), np.where(bad, np.nan, hi)
