"""Calibrated similarity in the report (issue 44): the permutation null of a results file for Fig. 2's
means over pairs of networks and finding 2's layer aggregates.

Per pair of networks (a, b) the results hold, for every layer pair, the p-value (1 + #{null ≥ s})/(K + 1)
and the calibrated score clip((s − τ)/(s_max − τ), 0, 1) of Gröger, Wen & Brbić 2026 (τ the
⌈(1 − α)(K + 1)⌉-th smallest of s and its K null scores; max(s − τ, 0) without an upper bound;
:func:`repsim.kernels.permutation.calibrate`). A Fig. 2 cell averages P pairs of networks; it shows the mean
of their calibrated scores and counts as *significant* only when every one of the P pairs is (the largest p
≤ α: an intersection-union test, valid whatever the dependence between the networks); a dot marks the
others. The mean is not calibrated against the mean of each draw: the engine draws one permutation per
network, so two seeds of one objective, which are dependent, are permuted apart within a draw and the
draws' mean spreads less than the observed mean does by chance — anti-conservative (on the planted stores
of tests/test_analyses_calibrated.py, 11 of 56 cells between independent objectives came out significant at
α = 0.05 that way).

A layer aggregate of one pair (finding 2: the mean over the last third's corresponding layers) is
calibrated against the same aggregate of each draw: valid, because the engine permutes every layer of a
network alike within a draw (Gröger et al.'s Algorithm 2, ``calibrate_layers``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from repsim.analyses.data import Missing


@dataclass
class Calibrated:
    """Pairs of networks' calibration of one block (rows: layers of the first network of each pair)."""
    calibrated: np.ndarray  # the mean over the pairs of each pair's calibrated score
    pvalue: np.ndarray  # the largest p over the pairs (every pair significant when ≤ α)
    pairs: int
    permutations: int
    alpha: float

    @property
    def not_significant(self) -> np.ndarray:
        """Some pair has p > α (the marked cells; an undefined, NaN cell is not one)."""
        from repsim.engine.heatmap import above_alpha

        return above_alpha(self.pvalue, self.alpha)


def upper_bound(mm) -> float | None:
    """The measure's upper bound s_max for the calibrated score (None: unbounded)."""
    hi = mm.range[1]
    return float(hi) if math.isfinite(hi) else None


def require_null(mm) -> dict:
    """The measure's permutation null (:attr:`MeasureMatrices.null`), or Missing saying how to compute it."""
    null = mm.null
    if null is None:
        raise Missing(f"the results hold no permutation null of {mm.display}: compute it with `repsim similarity "
                      f"... --measures {mm.name} --permutations K` (K ≥ 19 for α = 0.05)")
    return null


def calibrate_pairs(mm, pairs: Sequence[tuple[str, str]], layers_a: list[str], layers_b: list[str],
                    reduce: str | None = None) -> Calibrated | None:
    """The calibration of ``pairs`` (store a, store b) over the (layers_a × layers_b) block (module docstring):
    each pair's calibrated score and p from the results; ``reduce="diagonal_mean"``: of each pair's mean over
    the block's diagonal (corresponding layers, layers_a[i] with layers_b[i]) against the same mean of each
    of its draws, a layer aggregate. None when no pair has values."""
    from repsim.kernels.permutation import calibrate

    null = require_null(mm)
    cals, ps = [], []
    for a, b in pairs:
        if reduce == "diagonal_mean":
            got = mm.null_block(a, b, layers_a, layers_b)
            if got is None:
                continue
            o, d = got
            cal, p, _ = calibrate(np.mean(np.diagonal(o)), np.mean(np.diagonal(d, axis1=1, axis2=2), axis=1),
                                  null["alpha"], upper_bound(mm))
            cal, p = np.asarray(cal).reshape(1, 1), np.asarray(p).reshape(1, 1)
        else:
            got = mm.calibrated_block(a, b, layers_a, layers_b)
            if got is None:
                continue
            cal, p = got
        cals.append(cal)
        ps.append(p)
    if not cals:
        return None
    return Calibrated(np.mean(cals, axis=0), np.max(ps, axis=0), len(cals), null["permutations"], null["alpha"])


def null_text(mm) -> str:
    """Caption fragment: what the calibrated scores and the dots are, with K and α."""
    null = require_null(mm)
    top = "1" if upper_bound(mm) is not None else "∞"
    return (f"Calibrated score (Gröger et al. 2026): clip((s − τ)/(s_max − τ), 0, 1), s_max = {top}, τ the "
            f"⌈(1 − α)(K + 1)⌉-th smallest of s and its K = {null['permutations']} permutation-null values "
            f"(the examples of the second network shuffled); 0 = not above chance; a cell shows the mean of its "
            f"pairs of networks' calibrated scores. Dot: some pair of networks in the cell is not significant "
            f"(its p = (1 + #{{null ≥ s}})/(K + 1) > α = {null['alpha']:g}); a cell without a dot has every "
            f"pair above chance (smallest possible p 1/(K + 1) = {1 / (null['permutations'] + 1):.3g})")
