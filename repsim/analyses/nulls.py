"""Calibrated similarity in the report (issue 44): the permutation null of a results file, averaged over
pairs of networks as Fig. 2 averages their values, and over layers as finding 2 does.

A Fig. 2 cell is a mean over pairs of networks, m̄ = (1/P) Σ_p m(a_p, b_p). Its null is the same mean of
each draw's null scores, m̄_k = (1/P) Σ_p m(a_p, π_k b_p), where the engine permutes the rows of each
network's every layer alike within a draw (one permutation per store and draw: ``repsim similarity
--permutations K``, Gröger, Wen & Brbić 2026, Algorithm 2, "calibrate_layers"); so the mean over pairs, and
over any set of layers, has a null like a single pair's, and the rule of Gröger et al. gives its p-value
(1 + #{m̄_k ≥ m̄}) / (K + 1), threshold τ (the ⌈(1 − α)(K + 1)⌉-th smallest of m̄ and the m̄_k) and calibrated
score clip((m̄ − τ)/(s_max − τ), 0, 1) (max(m̄ − τ, 0) without an upper bound): 0 where the mean does
not exceed what the same networks give with their examples shuffled (:func:`repsim.kernels.permutation.calibrate`).
A cell is *not significant* when p > α."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from repsim.analyses.data import Missing


@dataclass
class Calibrated:
    """One calibrated mean over pairs of networks: each array shaped like the block (rows: layers of the
    first network)."""
    value: np.ndarray  # the observed mean over pairs
    pvalue: np.ndarray
    threshold: np.ndarray
    calibrated: np.ndarray
    pairs: int
    permutations: int
    alpha: float

    @property
    def not_significant(self) -> np.ndarray:
        """p > α (the marked cells; an undefined, NaN cell is not one)."""
        return np.isfinite(self.pvalue) & (np.nan_to_num(self.pvalue) > self.alpha)


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
    """The calibrated mean over ``pairs`` (store a, store b) of the (layers_a × layers_b) blocks (module
    docstring); ``reduce="diagonal_mean"``: of the mean over the block's diagonal (corresponding layers,
    layers_a[i] with layers_b[i]), a layer aggregate. None when no pair has values."""
    from repsim.kernels.permutation import calibrate

    null = require_null(mm)
    obs, draws = [], []
    for a, b in pairs:
        got = mm.null_block(a, b, layers_a, layers_b)
        if got is None:
            continue
        o, d = got
        if reduce == "diagonal_mean":
            o, d = np.mean(np.diagonal(o))[None, None], np.mean(np.diagonal(d, axis1=1, axis2=2), axis=1)[:, None, None]
        obs.append(o)
        draws.append(d)
    if not obs:
        return None
    value, nulls = np.mean(obs, axis=0), np.mean(draws, axis=0)
    cal, p, tau = calibrate(value, nulls, null["alpha"], upper_bound(mm))
    return Calibrated(value, np.asarray(p), np.asarray(tau), np.asarray(cal), len(obs), null["permutations"],
                      null["alpha"])


def null_text(mm) -> str:
    """Caption fragment: what the calibrated scores and the marks are, with K and α."""
    null = require_null(mm)
    top = "1" if upper_bound(mm) is not None else "∞"
    return (f"Calibrated score (Gröger et al. 2026): clip((s − τ)/(s_max − τ), 0, 1), s_max = {top}, τ the "
            f"⌈(1 − α)(K + 1)⌉-th smallest of s and its K = {null['permutations']} permutation-null values "
            f"(the examples of the second network shuffled, every layer alike within a draw); 0 = not above "
            f"chance. A mean over pairs of networks is calibrated against the same mean of each draw. "
            f"Dot: not significant (p = (1 + #{{null ≥ s}})/(K + 1) > α = {null['alpha']:g}; the smallest "
            f"p is 1/(K + 1) = {1 / (null['permutations'] + 1):.3g})")
