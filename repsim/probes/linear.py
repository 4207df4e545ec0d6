"""The linear probe (App. A.2): L2-regularised multinomial logistic regression on fixed features.

Objective ``Σ_i CE_i + λ‖W‖²_F`` (bias unpenalised; scikit-learn's ``LogisticRegression(C=1/(2λ))``),
λ chosen from 45 log-spaced values in [1e-6, 1e5] on a stratified validation split of the training
set, each fit warm-started from the previous λ's; then refit on train+validation with the chosen λ
and scored on the test set. Solver: :mod:`repsim.probes._logreg` (L-BFGS, exact reparameterisations
that make it fast, a line search on logits that are linear in the parameters: two (N×P)·(P×K)
products per iteration). Ties: the selected λ is the first best in grid order (the smallest λ).
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, asarray_like, to_numpy
from repsim.probes.rows import Rows
from repsim.probes._common import (METRICS, ProbeResult, _as_2d, _check_xy, _progress_fn, _take_rows, accuracy,
                                   stratified_split)


DEFAULT_LAMBDAS = np.logspace(-6, 5, 45)
# the streamed probe scores test rows this many at a time (a float32 copy of 2 MiB at P = 512), so that
# a test store's chunk adds only its decoded rows, whatever its size
PREDICT_ROWS = 1024


def linear_probe(X_train: Any, y_train: Any, X_test: Any, y_test: Any,
                 lambdas: Sequence[float] = DEFAULT_LAMBDAS, val_fraction: float = 0.2,
                 metric: str = "top1", seed: int = 0, *, direction: str = "down",
                 warm_start: bool = True, extrapolate: bool = True, tol: float = 1e-3,
                 refit_tol: float = 1e-4,
                 max_iter: int = 1000, progress: bool = False, streamed: bool = False) -> ProbeResult:
    """The paper's linear probe (App. A.2); see the module docstring.

    ``streamed=True`` takes the out-of-core route (:func:`linear_probe_rows`) over the arrays' row
    blocks; a layer wider than n whose N × N Gram would exceed ``_logreg.GRAM_BYTES`` always does.

    ``direction``: order in which the λ grid is swept with warm starts. Every λ's problem is strictly
    convex, so the chosen λ and the curve do not depend on it (up to ``tol``); only the time does.
    ``"down"`` (default) starts cold at the largest λ, whose solution is near 0 and takes a handful of
    iterations, and reaches the ill-conditioned small-λ problems already close to their solutions;
    ``"up"`` is the paper's order (cold start on the hardest, nearly unregularised problem, whose
    under-converged solution then seeds the next ones). On bench/probe.py (10,000 × 512, 100 classes)
    the sweep took 2.0× ("up") and 10× (cold starts) the time of "down"; they picked λ = 0.56, 1 and
    1.78 ("down"), where the tightly converged curve's best is 1.78 and the curve is flat (0.379-0.382).
    ``extrapolate``: predictor step along the path for each warm start (see ``_logreg.sweep``).
    ``tol``: each λ's L-BFGS stops once the largest entry of the (preconditioned) gradient of the mean
    objective is below ``tol`` times the objective; ``refit_tol``: the same for the final
    train+validation fit. The sweep only has to rank λ values: at the default 1e-3 the validation
    curve stays within 0.4 points of a tightly converged one for λ in [1e-2, 1e2] on the 10,000 × 512
    benchmark (1.5 points at worst, at λ ≥ 1e3 where accuracy is ≤ 13 %; scikit-learn's default: 3.5
    points; see bench/RESULTS.md).
    Features are used as given (no standardisation); float64 inputs are solved in float64,
    others in float32 with float64 accumulation.
    """
    from repsim.probes import _logreg

    _check_params(metric, direction, lambdas)
    X_train, y_train = _check_xy(X_train, y_train, "X_train")
    X_test, y_test = _check_xy(X_test, y_test, "X_test")
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_train has {X_train.shape[1]} features but X_test has {X_test.shape[1]}")
    xp = array_namespace(X_train)
    wide = X_train.shape[1] > X_train.shape[0] and X_train.shape[0] ** 2 * 8 > _logreg.GRAM_BYTES
    if streamed or wide:  # the out-of-core route over the arrays' row blocks (no N × N Gram)
        if xp is not np:
            raise ValueError(f"the out-of-core linear probe runs on NumPy arrays (layer {X_train.shape[0]} x "
                             f"{X_train.shape[1]}, wider than n, on {xp.__name__})")
        return linear_probe_rows(Rows.from_array(X_train), y_train, Rows.from_array(X_test), y_test,
                                 lambdas=lambdas, val_fraction=val_fraction, metric=metric, seed=seed,
                                 direction=direction, warm_start=warm_start, extrapolate=extrapolate, tol=tol,
                                 refit_tol=refit_tol, max_iter=max_iter, progress=progress)

    def prepare(order: np.ndarray):
        return _logreg.rotate(_take_rows(X_train, order, xp), xp=xp, overwrite=True)

    def predict(W: np.ndarray, b: np.ndarray, dt: Any) -> np.ndarray:
        Zt = xp.matmul(X_test if X_test.dtype == dt else xp.astype(X_test, dt), asarray_like(W, X_test, xp, dt))
        Zt = Zt + asarray_like(b, X_test, xp, dt)
        return np.asarray(to_numpy(xp.argmax(Zt, axis=1)))

    return _fit(prepare, predict, y_train, y_test, lambdas, val_fraction, metric, seed, direction=direction,
                warm_start=warm_start, extrapolate=extrapolate, tol=tol, refit_tol=refit_tol,
                max_iter=max_iter, progress=progress)


def linear_probe_rows(train: Rows, y_train: Any, test: Rows, y_test: Any,
                      lambdas: Sequence[float] = DEFAULT_LAMBDAS, val_fraction: float = 0.2,
                      metric: str = "top1", seed: int = 0, *, train_select: np.ndarray | None = None,
                      test_select: np.ndarray | None = None, **kw) -> ProbeResult:
    """:func:`linear_probe` out of core: the features are :class:`repsim.probes.rows.Rows` (a store's
    layer chunk by chunk, or an array's row blocks), rows ``train_select`` / ``test_select`` of them
    (default all; labels given for those rows, in that order). Every solver product is a pass over the
    blocks (``repsim.probes._streamed``): memory O(P² + P·K + n·K) floats plus one block, never the
    (n, P) features. Same protocol, same optimum; the numbers agree with the in-memory route to the
    solver's tolerance (other summation order)."""
    from repsim.probes._streamed import streamed_problem

    _check_params(metric, kw.get("direction", "down"), lambdas)
    if train.p != test.p:
        raise ValueError(f"X_train has {train.p} features but X_test has {test.p}")
    tr_sel = np.arange(train.n) if train_select is None else np.asarray(train_select, dtype=np.int64)
    te_sel = np.arange(test.n) if test_select is None else np.asarray(test_select, dtype=np.int64)
    y_train, y_test = np.asarray(to_numpy(y_train)), np.asarray(to_numpy(y_test))
    if y_train.shape != (tr_sel.size,) or y_test.shape != (te_sel.size,):
        raise ValueError(f"labels {y_train.shape} / {y_test.shape} do not match the {tr_sel.size} training "
                         f"and {te_sel.size} test rows")

    def prepare(order: np.ndarray):
        return streamed_problem(train, tr_sel[order])

    def predict(W: np.ndarray, b: np.ndarray, dt: Any) -> np.ndarray:
        """The test rows' classes, read once (not worth the cache): all rows in order are taken from the
        decoded chunks as they are (no gathered copy), and converted PREDICT_ROWS rows at a time."""
        Wt, bt = np.asarray(W, dtype=dt), np.asarray(b, dtype=dt)
        pred = np.empty(te_sel.size, dtype=np.int64)
        for pos, X in test.blocks(None if test_select is None else te_sel, keep=False):
            idx = np.arange(te_sel.size)[pos] if isinstance(pos, slice) else pos
            for a in range(0, X.shape[0], PREDICT_ROWS):
                Xs = X[a:a + PREDICT_ROWS]
                pred[idx[a:a + PREDICT_ROWS]] = np.argmax((Xs if Xs.dtype == dt else Xs.astype(dt)) @ Wt + bt, axis=1)
            del X, Xs
        return pred

    return _fit(prepare, predict, y_train, y_test, lambdas, val_fraction, metric, seed, **kw)


def _check_params(metric: str, direction: str, lambdas: Any) -> np.ndarray:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    lambdas = np.asarray(lambdas, dtype=np.float64)
    if lambdas.ndim != 1 or lambdas.size == 0 or np.any(lambdas <= 0):
        raise ValueError("lambdas must be a non-empty 1-D sequence of positive values")
    return lambdas


def _fit(prepare, predict, y_train: np.ndarray, y_test: np.ndarray, lambdas, val_fraction: float,
         metric: str, seed: int, *, direction: str = "down", warm_start: bool = True,
         extrapolate: bool = True, tol: float = 1e-3, refit_tol: float = 1e-4, max_iter: int = 1000,
         progress: bool = False) -> ProbeResult:
    """The protocol, whatever holds the features: ``prepare(order)`` centres and rotates the training
    rows in ``order`` (a RotatedProblem or StreamedProblem), ``predict(W, b, dtype)`` gives the test
    rows' argmax class indices for original-space weights."""
    from repsim.probes import _logreg

    lambdas = _check_params(metric, direction, lambdas)
    classes, y_tr = np.unique(y_train, return_inverse=True)
    K = classes.size
    if K < 2:
        raise ValueError(f"the training set has {K} class; a linear probe needs at least 2")

    t0 = time.perf_counter()
    tr_idx, val_idx = stratified_split(y_tr, val_fraction, seed)
    if val_idx.size == 0:
        raise ValueError("the validation split is empty (every class has a single example)")
    order = np.concatenate([tr_idx, val_idx])
    rp = prepare(order)
    xp = rp.xp
    t_prep = time.perf_counter() - t0

    # --- sweep on the training part, score on the validation part
    n_tr = tr_idx.size
    obj = _logreg.LogisticObjective(rp, y_tr[tr_idx], K, n=n_tr)
    X_val = rp.Xh[n_tr:, ...]
    y_val = y_tr[val_idx]
    grid = np.sort(lambdas)
    sweep = grid[::-1] if direction == "down" else grid
    curve: dict[float, float] = {}
    iters: dict[float, int] = {}
    best_sol = None
    t1 = time.perf_counter()
    for lam, sol in obj.sweep(sweep, warm_start=warm_start, extrapolate=extrapolate, tol=tol,
                              max_iter=max_iter, progress=_progress_fn(progress, "λ sweep")):
        pred = np.asarray(to_numpy(xp.argmax(obj.logits(X_val, sol.Wd, sol.b), axis=1)))
        curve[float(lam)] = accuracy(y_val, pred, metric)
        iters[float(lam)] = sol.n_iter
        if best_sol is None or _better(curve, float(lam), best_sol[0]):
            # the refit is another objective: it cannot use the sweep's logits or L-BFGS pairs
            best_sol = (float(lam), _logreg.Solution(Wd=sol.Wd, b=sol.b, n_iter=sol.n_iter,
                                                     converged=sol.converged))
    t_sweep = time.perf_counter() - t1
    curve = {float(lam): curve[float(lam)] for lam in grid}
    best = best_sol[0]
    at_edge = edge_warning(curve, best)

    # --- refit on train + validation at the chosen λ (warm start from the sweep's solution there)
    t2 = time.perf_counter()
    full = _logreg.LogisticObjective(rp, y_tr[order], K)
    final = full.solve(best, best_sol[1], tol=refit_tol, max_iter=max_iter)
    W, b = rp.to_original(final.Wd, final.b)
    t_refit = time.perf_counter() - t2

    dt = rp.dtype
    pred_test = classes[predict(W, b, dt)]
    acc = accuracy(y_test, pred_test, metric)
    info = {"seconds_prepare": t_prep, "seconds_sweep": t_sweep, "seconds_refit": t_refit,
            "iterations": {repr(k): v for k, v in iters.items()},
            "iterations_total": int(sum(iters.values())), "refit_iterations": final.n_iter,
            "evaluations_sweep": obj.n_evals, "evaluations_refit": full.n_evals,
            "products_sweep": obj.n_products, "products_refit": full.n_products,
            "line_search_trials": obj.n_trials + full.n_trials,
            "refit_converged": final.converged, "refit_message": final.message,
            "rank": rp.rank, "n_train": int(n_tr), "n_val": int(val_idx.size),
            "direction": direction, "warm_start": warm_start, "lambda_at_edge": at_edge, "streamed": bool(rp.stats.get("streamed")),
            "dtype": str(np.dtype(
                "float64" if dt == xp.float64 else "float32"))}
    return ProbeResult(probe="linear", metric=metric, accuracy=acc, best_param=float(best),
                       curve=curve, predictions=pred_test, classes=classes,
                       coef_=W.T.copy(), intercept_=b, info=info)


def edge_warning(curve: dict, best: float) -> bool:
    """Warn (one ``RuntimeWarning`` line) when the chosen λ is the smallest or largest of the grid and its
    validation metric beats its neighbour's: the best λ may lie beyond the grid.  Returns whether it did."""
    grid = sorted(curve)
    if len(grid) < 3 or best not in (grid[0], grid[-1]):
        return False
    inner = grid[1] if best == grid[0] else grid[-2]
    if curve[best] <= curve[inner]:  # a plateau that reaches the edge: no sign that more lies beyond it
        return False
    side = "smallest" if best == grid[0] else "largest"
    warnings.warn(f"linear probe: λ = {best:g}, the {side} of the grid ({grid[0]:g} to {grid[-1]:g}), scored best "
                  f"on validation ({curve[best]:.4f} against {curve[inner]:.4f} at {inner:g}): the best λ may lie "
                  "beyond the grid (repsim.linear_probe(..., lambdas=...) takes a wider one)", RuntimeWarning, stacklevel=4)
    return True


def _better(curve: dict, a: float, b: float) -> bool:
    """Is λ=a preferred to λ=b: higher validation metric, ties to the smaller λ."""
    return (curve[a], -a) > (curve[b], -b)


def fit_logistic(X: Any, y: Any, lam: float | np.ndarray, *, loss: str = "softmax",
                 tol: float = 1e-7, max_iter: int = 1000) -> tuple[np.ndarray, np.ndarray, dict]:
    """One fit at fixed λ: minimise ``Σ_i loss_i + Σ_k λ_k‖W_k‖²``; returns (coef (K, P), intercept (K,),
    info). ``loss="softmax"``: y are class indices 0..K-1 (K = max+1); ``"sigmoid"``: y is (N, K) 0/1.
    Equal to ``LogisticRegression(C=1/(2λ))`` for softmax."""
    from repsim.probes import _logreg

    X = _as_2d(X, "X")
    y = np.asarray(to_numpy(y))
    K = int(y.max()) + 1 if loss == "softmax" else int(y.shape[1])
    rp = _logreg.rotate(X)
    obj = _logreg.LogisticObjective(rp, y, K, loss=loss)
    sol = obj.solve(lam, tol=tol, max_iter=max_iter)
    W, b = rp.to_original(sol.Wd, sol.b)
    return W.T.copy(), b, {"n_iter": sol.n_iter, "converged": sol.converged, "message": sol.message}
