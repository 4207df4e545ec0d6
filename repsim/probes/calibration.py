"""Calibration of a network's predictions (paper Table C.3, after Guo et al. 2017).

- :func:`probabilities`: softmax of the logits; for sigmoid-trained networks, ``σ(z_k) / Σ_j σ(z_j)``
  (Table C.3: "we normalize the probability distribution by summing probabilities over all classes").
- :func:`nll`: mean negative log-likelihood of the true class, ``−(1/N) Σ_i log p_i,y_i``.
- :func:`ece`: expected calibration error with 15 equal-width confidence bins,
  ``ECE = Σ_b (|B_b|/N) |acc(B_b) − conf(B_b)|``, confidence = max_k p_ik, bin b = ((b−1)/15, b/15].
- :func:`fit_temperature`: the T > 0 minimising the NLL of ``probabilities(z / T)`` on a holdout set.
- :func:`calibration_report`: NLL and ECE before and after temperature scaling.
- :func:`calibration_report_rows`: the same from logits read chunk by chunk (a store's; issue 31):
  every quantity is a sum over examples, ``NLL(T) = −(1/N) Σ_blocks Σ_i log p_i,y_i(T)`` and the ECE's
  per-bin counts, confidence and accuracy sums, so one pass gives them for any number of T (the 41 grid
  values at once, then one pass per Brent step); memory O(block × K + bins), never O(N × K).
  Same numbers as the in-memory route up to summation order (tests: 1e-9 relative).

The in-memory functions too work on row blocks of ``BLOCK_VALUES`` logits, cast to float64 block by
block: they hold the logits as given plus one block's temporaries (issue 31 measured five (N, K)
float64 copies before: ~400 MB at 50,000 × 1,000 classes).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax

KINDS = ("softmax", "sigmoid")


BLOCK_VALUES = 1 << 16  # nll / ece work on row blocks of this many logits (float64 temporaries: 512 KiB each)


def _check(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Logits in their own floating dtype (each block is cast to float64 where it is used: no (N, K)
    float64 copy) and labels, validated."""
    z = np.asarray(logits)
    if not np.issubdtype(z.dtype, np.floating):
        z = z.astype(np.float64)
    y = np.asarray(labels)
    if z.ndim != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"logits must be (N, K) and labels (N,), got {z.shape} and {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= z.shape[1]):
        raise ValueError(f"labels must lie in [0, {z.shape[1]}), got range [{y.min()}, {y.max()}]")
    if not np.all(np.isfinite(z)):
        raise ValueError("logits contain NaN or inf")
    return z, y


def log_probabilities(logits: np.ndarray, kind: str = "softmax", temperature: float = 1.0) -> np.ndarray:
    """log p (N, K) from logits divided by ``temperature``; see :func:`probabilities`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = np.asarray(logits, dtype=np.float64) / temperature
    if kind == "softmax":
        return log_softmax(z, axis=1)
    # log σ(z) = −softplus(−z); normalise in log space for stability.
    ls = -np.logaddexp(0.0, -z)
    return ls - np.logaddexp.reduce(ls, axis=1, keepdims=True)


def probabilities(logits: np.ndarray, kind: str = "softmax", temperature: float = 1.0) -> np.ndarray:
    """Class probabilities (N, K): softmax(z/T), or σ(z/T) normalised to sum to 1 (sigmoid nets)."""
    return np.exp(log_probabilities(logits, kind, temperature))


def _row_blocks(z: np.ndarray):
    """Row slices of at most :data:`BLOCK_VALUES` logits: the (N, K) temporaries of nll and ece are
    one block's, whatever N."""
    step = max(1, BLOCK_VALUES // max(1, z.shape[1]))
    for a in range(0, z.shape[0], step):
        yield slice(a, min(z.shape[0], a + step))


def nll(logits: np.ndarray, labels: np.ndarray, kind: str = "softmax", temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the labels (summed over row blocks: memory independent of N)."""
    z, y = _check(logits, labels)
    log_probabilities(z[:0], kind, temperature)          # argument checks, also for N = 0
    total = 0.0
    for sl in _row_blocks(z):
        lp = log_probabilities(z[sl], kind, temperature)
        total -= float(lp[np.arange(lp.shape[0]), y[sl]].sum())
    return total / y.size if y.size else float("nan")


def ece_from_probabilities(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """ECE of probability vectors (N, K): confidence max_k p, prediction argmax_k p, ``bins`` equal bins
    ((b−1)/B, b/B] (a confidence of exactly 0 goes to the first bin)."""
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels)
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    b = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    acc_b = np.bincount(b, weights=correct, minlength=bins)
    conf_b = np.bincount(b, weights=conf, minlength=bins)
    return float(np.sum(np.abs(acc_b - conf_b)) / max(y.size, 1))


def ece(logits: np.ndarray, labels: np.ndarray, kind: str = "softmax", temperature: float = 1.0,
        bins: int = 15) -> float:
    """Expected calibration error (15 equal bins by default) of the network's probabilities."""
    z, y = _check(logits, labels)
    log_probabilities(z[:0], kind, temperature)          # argument checks
    n_b, acc_b, conf_b = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    for sl in _row_blocks(z):                            # ece_from_probabilities' sums, block by block
        p = probabilities(z[sl], kind, temperature)
        conf, correct = p.max(axis=1), (p.argmax(axis=1) == y[sl]).astype(np.float64)
        b = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
        n_b += np.bincount(b, minlength=bins)
        acc_b += np.bincount(b, weights=correct, minlength=bins)
        conf_b += np.bincount(b, weights=conf, minlength=bins)
    return float(np.sum(np.abs(acc_b - conf_b)) / max(y.size, 1))


TEMPERATURE_BOUNDS = (1e-2, 1e2)  # the search range of fit_temperature
TEMPERATURE_GRID_POINTS = 41  # points of fit_temperature's grid, evenly spaced in log T over the bounds


def temperature_grid_step(bounds: tuple[float, float] = TEMPERATURE_BOUNDS) -> float:
    """The spacing in log T of :func:`fit_temperature`'s grid over ``bounds``."""
    return float((np.log(bounds[1]) - np.log(bounds[0])) / (TEMPERATURE_GRID_POINTS - 1))


def temperature_at_bound(temperature: Any, bounds: tuple[float, float] = TEMPERATURE_BOUNDS) -> np.ndarray:
    """Whether fitted temperatures lie within one step of :func:`fit_temperature`'s log-T grid of either
    end of the search range (elementwise; NaN: False): a holdout classified perfectly has NLL 0 (to float
    precision) at every T near the lower bound, so its tie lands on the bound or the grid point next to
    it; neither is a calibration."""
    t = np.asarray(temperature, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logT = np.log(np.clip(t, 1e-300, None))
    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    tol = temperature_grid_step(bounds) * (1 + 1e-6)  # the grid point itself, through exp/log
    return (np.abs(logT - lo) <= tol) | (np.abs(hi - logT) <= tol)


def fit_temperature(logits: np.ndarray, labels: np.ndarray, kind: str = "softmax",
                    bounds: tuple[float, float] = TEMPERATURE_BOUNDS) -> float:
    """argmin_T NLL(z/T) on a holdout set: a grid over log T, then bounded Brent around the best point.

    (For softmax the NLL is convex in 1/T; the grid guards the sigmoid-normalised case.)
    """
    z, y = _check(logits, labels)
    return _minimise_temperature(lambda ts: [nll(z, y, kind, t) for t in ts], bounds)


def _minimise_temperature(nlls, bounds: tuple[float, float]) -> float:
    """The search of :func:`fit_temperature` given ``nlls(temperatures) -> NLL at each``."""
    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    grid = np.linspace(lo, hi, TEMPERATURE_GRID_POINTS)
    vals = list(nlls([float(np.exp(g)) for g in grid]))
    i = int(np.argmin(vals))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    res = minimize_scalar(lambda t: nlls([float(np.exp(t))])[0], bounds=(a, b),
                          method="bounded", options={"xatol": 1e-6})
    best = res.x if res.fun <= vals[i] else grid[i]
    return float(np.exp(best))


def calibration_report(logits: np.ndarray, labels: np.ndarray, holdout_logits: np.ndarray,
                       holdout_labels: np.ndarray, kind: str = "softmax", bins: int = 15) -> dict:
    """Table C.3 row: NLL and ECE uncalibrated and after temperature scaling fitted on the holdout."""
    T = fit_temperature(holdout_logits, holdout_labels, kind)
    return {"nll": nll(logits, labels, kind), "ece": ece(logits, labels, kind, bins=bins),
            "temperature": T, "nll_ts": nll(logits, labels, kind, T),
            "ece_ts": ece(logits, labels, kind, T, bins)}


def _pass(rows, labels: np.ndarray, kind: str, temps, bins: int = 15) -> tuple[np.ndarray, float, float]:
    """One pass over logits ``rows`` (:class:`repsim.probes.rows.Rows`): (mean NLL at each T in
    ``temps``, ECE at ``temps[0]``, top-1 accuracy)."""
    y_all = np.asarray(labels)
    if y_all.shape != (rows.n,):
        raise ValueError(f"logits must be (N, K) and labels (N,), got ({rows.n}, {rows.p}) and {y_all.shape}")
    tot = np.zeros(len(temps))
    n_b, acc_b, conf_b = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    hits = 0
    for pos, Z in rows.blocks():
        z, y = _check(Z, y_all[pos])
        for j, T in enumerate(temps):
            lp = log_probabilities(z, kind, T)
            tot[j] -= lp[np.arange(y.size), y].sum()
            if j == 0:
                p = np.exp(lp)
                conf, correct = p.max(axis=1), (p.argmax(axis=1) == y).astype(np.float64)
                b = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
                n_b += np.bincount(b, minlength=bins)
                acc_b += np.bincount(b, weights=correct, minlength=bins)
                conf_b += np.bincount(b, weights=conf, minlength=bins)
        hits += int(np.sum(z.argmax(axis=1) == y))
    n = max(rows.n, 1)
    return tot / n, float(np.sum(np.abs(acc_b - conf_b)) / n), hits / n


def calibration_report_rows(rows, labels: np.ndarray, holdout_rows, holdout_labels: np.ndarray,
                            kind: str = "softmax", bins: int = 15) -> dict:
    """:func:`calibration_report` from logits read block by block (module doc), plus ``top1`` and
    ``holdout_top1``."""
    T = _minimise_temperature(lambda ts: _pass(holdout_rows, holdout_labels, kind, ts, bins)[0],
                              (1e-2, 1e2))
    (nll1,), ece1, top1 = _pass(rows, labels, kind, [1.0], bins)
    (nll_t,), ece_t, _ = _pass(rows, labels, kind, [T], bins)
    return {"nll": float(nll1), "ece": ece1, "temperature": T, "nll_ts": float(nll_t), "ece_ts": ece_t,
            "top1": top1, "holdout_top1": _pass(holdout_rows, holdout_labels, kind, [1.0], bins)[2]}


__all__ = ["calibration_report_rows", "probabilities", "log_probabilities", "nll", "ece", "ece_from_probabilities",
           "fit_temperature", "calibration_report"]
