"""Permutation nulls of one measure's exact estimator over all pairs of in-memory columns, and the
one-pair convenience :func:`calibrated_similarity`.

Layer-aggregate calibration (Gröger et al. 2026, Algorithm 2, ``calibrate_layers``): within a draw k
every column of one group (a store) is permuted by the same π_{g,k}, and a pair (i, j) is compared as
m(column i, column j permuted by its group's π) — so a block of pairs between two stores sees one
permutation per draw, and a maximum or mean over the block has a valid null
(:meth:`repsim.engine.result.SimilarityResult.aggregate`).  Symmetric measures compute i <= j and mirror.
Each group's draws come from ``default_rng([seed, g])`` (:func:`repsim.kernels.permutation.permutations`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.kernels.measures._protocol import Measure
from repsim.kernels.permutation import calibrate, check_null, permutations


def group_permutations(K: int, n: int, seed: int, group: int) -> np.ndarray:
    """Group ``group``'s K permutations of n rows."""
    return permutations(K, n, [int(seed), int(group)])


def exact_null(measure: Measure, prepared: Sequence[Any], groups: Sequence[int], K: int, seed: int, n: int,
               progress: Any = None) -> np.ndarray:
    """(K, L, L) null values of ``measure`` for prepared columns (None: undefined) in ``groups`` (a
    group id per column), entry (i, j) = m(col i, col j[π_{groups[j], k}]) (module docstring)."""
    L = len(prepared)
    rows_n = measure.null_rows(n)
    out = np.full((int(K), L, L), np.nan)
    for g in dict.fromkeys(groups):
        cols = [j for j in range(L) if groups[j] == g]
        perms = group_permutations(K, rows_n, seed, g)
        block = measure.null_block(list(prepared), [prepared[j] for j in cols], perms)  # (K, L, L_g)
        out[:, :, cols] = block
        if progress is not None:
            progress(len(cols))
    if measure.info.symmetric:
        iu = np.triu_indices(L, 1)
        out[:, iu[1], iu[0]] = out[:, iu[0], iu[1]]
    return out


def smax_of(measure: Measure) -> float | None:
    """The measure's upper bound for the calibrated score (None: unbounded, ReLU(s − τ))."""
    top = float(measure.info.range[1])
    return top if math.isfinite(top) else None


def calibrated_similarity(X: Any, Y: Any, measure: str | Measure = "linear_cka", *, permutations: int = 200,
                          seed: int = 0, alpha: float = 0.05, **options: Any) -> dict[str, Any]:
    """One pair's exact value with its permutation null (rows of Y permuted; Gröger et al.'s Algorithm 1):
    ``{"value", "pvalue", "threshold", "calibrated", "null" (K,)}``."""
    from repsim.kernels.measures import check_options, get_measure
    from repsim.kernels.measures._exact import full_column

    check_null(permutations, alpha)
    if isinstance(measure, str):
        check_options([measure], options)
        m = get_measure(measure, **options)
    else:
        m = measure
    a, b = full_column(X, "X"), full_column(Y, "Y")
    if a.n != b.n:
        raise ValueError(f"X has {a.n} examples and Y {b.n}: a similarity compares the same examples")
    pa, pb = m.prepare(a), m.prepare(b)
    if pa is None or pb is None:
        nan = float("nan")
        return {"value": nan, "pvalue": nan, "threshold": nan, "calibrated": nan, "null": np.full(permutations, nan)}
    value = float(m.pair(pa, pb))
    null = m.null_block([pa], [pb], group_permutations(permutations, m.null_rows(a.n), seed, 1))[:, 0, 0]
    cal, p, tau = calibrate(np.asarray(value), null, alpha, smax_of(m))
    return {"value": value, "pvalue": float(p), "threshold": float(tau), "calibrated": float(cal), "null": null}
