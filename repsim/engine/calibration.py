"""Calibrated similarity in the engine: the null a run asked for (:func:`null_request`), each
measure's null on the exact route (:func:`exact_calibration`) and the arrays a result keeps
(:func:`calibration_arrays`) — p-values, thresholds τ and calibrated scores (Gröger et al. 2026;
:mod:`repsim.kernels.permutation`)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim.kernels.measures import Measure, NoNull
from repsim.kernels.permutation import calibrate, check_null

__all__ = ["null_request", "calibration_arrays", "exact_calibration", "analytic_arrays"]

SCHEME = ("entry (i, j), i <= j for symmetric measures, is m(column i, column j with its rows permuted); every "
          "column of one store shares a draw's permutation (layer-aggregate calibration, Groeger et al. 2026 "
          "Algorithm 2); minibatch: permutations within each batch of the first epoch (observed values from the same "
          "batches)")


def null_request(permutations: int | None, alpha: float, null: str, seed: int, measures: Sequence[Measure],
                 groups: Sequence[int]) -> dict[str, Any] | None:
    """The run's null as plain data (None: no calibration), after refusing what cannot be computed:
    K < 1, α outside (0, 1), K too small for α, a measure without a null, an analytic null for a
    measure other than the CKA family, or an analytic null given a permutation count."""
    if permutations is None and null != "analytic":
        return None
    check_null(permutations if permutations is not None else 1, alpha, null)
    if null == "analytic":
        if permutations is not None:
            raise ValueError("the analytic null uses no permutations: drop permutations (--permutations) or use "
                             "null='permutation'")
        from repsim.kernels.measures.linear_cka import CKAFamily

        other = [m.name for m in measures if not isinstance(m, CKAFamily)]
        if other:
            raise ValueError(f"no analytic null for {', '.join(other)} (only linear_cka and rbf_cka have exact "
                             "permutation moments): use null='permutation' (--null permutation --permutations K)")
    else:
        missing = [m.name for m in measures if not m.has_null()]
        if missing:
            raise NoNull(f"{', '.join(missing)} define(s) no permutation null: drop it from the measures or "
                         "calibrate without it")
    return {"kind": null, "permutations": None if permutations is None else int(permutations),
            "alpha": float(alpha), "seed": int(seed), "groups": [int(g) for g in groups]}


def smax_of(measure: Measure) -> float | None:
    from repsim.kernels.measures.exact import smax_of as _smax

    return _smax(measure)


def calibration_arrays(measure: Measure, observed: np.ndarray, nulls: np.ndarray, alpha: float) -> dict[str, np.ndarray]:
    """{"observed", "null", "pvalues", "threshold", "calibrated"} of one measure from its observed (L, L)
    and null (K, L, L) values."""
    cal, p, tau = calibrate(np.asarray(observed, dtype=np.float64), np.asarray(nulls, dtype=np.float64), alpha,
                            smax_of(measure))
    return {"observed": np.asarray(observed, dtype=np.float64), "null": np.asarray(nulls, dtype=np.float64),
            "pvalues": p, "threshold": tau, "calibrated": cal}


def analytic_arrays(measure: Measure, observed: np.ndarray, mean: np.ndarray, var: np.ndarray, mu3: np.ndarray,
                    alpha: float) -> dict[str, np.ndarray]:
    """As :func:`calibration_arrays` for the analytic null: its moments instead of draws."""
    from repsim.kernels.analytic_null import pearson3_calibration

    cal, p, tau = pearson3_calibration(observed, mean, var, mu3, alpha, smax_of(measure))
    return {"observed": np.asarray(observed, dtype=np.float64), "null_mean": mean, "null_var": var,
            "null_mu3": mu3, "pvalues": p, "threshold": tau, "calibrated": cal}


def exact_calibration(measure: Measure, prepared: Sequence[Any], values: np.ndarray, n: int,
                      request: dict[str, Any], progress: Any = None) -> dict[str, np.ndarray]:
    """One measure's calibration on the exact route from its prepared columns (computed once for its
    values: Grams, whitened bases, neighbour lists are reused by every draw)."""
    if request["kind"] == "analytic":
        from repsim.kernels.analytic_null import invariants, permutation_moments

        L = len(prepared)
        live = [i for i, p in enumerate(prepared) if p is not None]
        mean, var, mu3 = (np.full((L, L), np.nan) for _ in range(3))
        if live:
            inv = invariants(np.stack([prepared[i][0] for i in live]))
            m, v, t = permutation_moments(inv, inv, n)
            h = np.sqrt([prepared[i][1] for i in live])
            norm = np.outer(h, h)
            ix = np.ix_(live, live)
            mean[ix], var[ix], mu3[ix] = m / norm, v / norm ** 2, t / norm ** 3
        if progress is not None:
            progress(L)
        return analytic_arrays(measure, values, mean, var, mu3, request["alpha"])
    from repsim.kernels.measures.exact import exact_null

    nulls = exact_null(measure, prepared, request["groups"], request["permutations"], request["seed"], n, progress)
    return calibration_arrays(measure, values, nulls, request["alpha"])
