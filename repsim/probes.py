"""Transfer probes on fixed features: linear (App. A.2), kNN (Table 1), multi-label (Table D.1).

- :func:`linear_probe`: L2-regularised multinomial logistic regression, objective
  ``Σ_i CE_i + λ‖W‖²_F`` (bias unpenalised; scikit-learn's ``LogisticRegression(C=1/(2λ))``), λ chosen
  from 45 log-spaced values in [1e-6, 1e5] on a stratified validation split of the training set, each
  fit warm-started from the previous λ's; then refit on train+validation with the chosen λ and scored
  on the test set. Solver: :mod:`repsim._logreg` (L-BFGS, exact reparameterisations that make it fast,
  a line search on logits that are linear in the parameters: two (N×P)·(P×K) products per iteration).
- :func:`knn_probe`: cosine-similarity k-nearest neighbours; k chosen by leave-one-out accuracy on the
  training set; top-k computed chunk by chunk (never an N×N matrix).
- :func:`multilabel_probe`: one binary L2-regularised logistic regression per class, λ chosen per class
  by validation AUC, AUC on the test set from 1000 equal bins (:func:`binned_auc`).

Ties: the selected λ / k is the first best in grid order (the smallest λ, the smallest k). kNN vote ties
go to the class of the nearest neighbour among the tied classes; neighbours are ordered by decreasing
similarity, then increasing training index.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from repsim._xp import array_namespace, to_numpy

DEFAULT_LAMBDAS = np.logspace(-6, 5, 45)
DEFAULT_KS = (1, 3, 5, 10, 20, 50, 100)
METRICS = ("top1", "mean_per_class")


@dataclass
class ProbeResult:
    """Outcome of one probe.

    ``accuracy``: test metric; ``best_param``: chosen λ (linear) or k (knn); ``curve``: {param:
    validation (linear) or leave-one-out (knn) metric}; ``predictions``: test predictions in the
    original label values; ``coef_`` (K, P) and ``intercept_`` (K,) for the linear probe (original
    feature space, float64); ``info``: timings, iteration counts, solver messages, and for the linear
    probe the counts of (N×P)·(P×K)-sized products (``products_sweep``, ``products_refit``, the
    solver's cost unit) and of line-search trials (elementwise work only).
    """

    probe: str
    metric: str
    accuracy: float
    best_param: float
    curve: dict
    predictions: np.ndarray
    classes: np.ndarray
    coef_: np.ndarray | None = None
    intercept_: np.ndarray | None = None
    info: dict = field(default_factory=dict)

    @property
    def best_lambda(self) -> float:
        if self.probe != "linear":
            raise AttributeError("best_lambda is defined for linear probes only")
        return float(self.best_param)

    @property
    def best_k(self) -> int:
        if self.probe != "knn":
            raise AttributeError("best_k is defined for kNN probes only")
        return int(self.best_param)

    def to_dict(self) -> dict:
        """JSON-ready summary (no weights, no predictions)."""
        return {"probe": self.probe, "metric": self.metric, "accuracy": self.accuracy,
                "best_param": self.best_param,
                "curve": {repr(float(k)): float(v) for k, v in self.curve.items()},
                "info": {k: v for k, v in self.info.items() if _jsonable(v)}}


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, list, dict)) or v is None


# ------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------

def accuracy(y_true: np.ndarray, y_pred: np.ndarray, metric: str = "top1") -> float:
    """Top-1 accuracy, or the mean over the classes present in ``y_true`` of per-class recall."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if metric == "top1":
        return float(np.mean(y_true == y_pred)) if y_true.size else float("nan")
    if metric == "mean_per_class":
        classes = np.unique(y_true)
        return float(np.mean([np.mean(y_pred[y_true == c] == c) for c in classes]))
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train_idx, val_idx): per class, ``round(val_fraction·n_c)`` random examples go to
    validation (at least one when the class has ≥ 2 examples, never all of them)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    val = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if idx.size < 2:
            continue
        n_val = min(max(int(round(val_fraction * idx.size)), 1), idx.size - 1)
        val.append(rng.permutation(idx)[:n_val])
    val_idx = np.sort(np.concatenate(val)) if val else np.zeros(0, dtype=np.int64)
    train_mask = np.ones(labels.size, dtype=bool)
    train_mask[val_idx] = False
    return np.flatnonzero(train_mask), val_idx


def _as_2d(X: Any, name: str) -> Any:
    if X.ndim < 2:
        raise ValueError(f"{name} must have shape (N, features...), got {tuple(X.shape)}")
    if X.ndim > 2:
        xp = array_namespace(X)
        X = xp.reshape(X, (X.shape[0], -1))
    return X


def _take_rows(X: Any, idx: np.ndarray, xp: Any) -> Any:
    return X[idx] if xp is np else xp.take(X, xp.asarray(idx), axis=0)


def _check_xy(X: Any, y: Any, name: str) -> tuple[Any, np.ndarray]:
    X = _as_2d(X, name)
    y = np.asarray(to_numpy(y))
    if y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{name} has {X.shape[0]} rows but its labels have shape {y.shape}")
    xp = array_namespace(X)
    if not bool(xp.all(xp.isfinite(X))):
        raise ValueError(f"{name} contains NaN or inf")
    return X, y


# ------------------------------------------------------------------------------------------------
# linear probe
# ------------------------------------------------------------------------------------------------

def linear_probe(X_train: Any, y_train: Any, X_test: Any, y_test: Any,
                 lambdas: Sequence[float] = DEFAULT_LAMBDAS, val_fraction: float = 0.2,
                 metric: str = "top1", seed: int = 0, *, direction: str = "down",
                 warm_start: bool = True, extrapolate: bool = True, tol: float = 1e-3,
                 refit_tol: float = 1e-4,
                 max_iter: int = 1000, progress: bool = False) -> ProbeResult:
    """The paper's linear probe (App. A.2); see the module docstring.

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
    from repsim import _logreg

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    X_train, y_train = _check_xy(X_train, y_train, "X_train")
    X_test, y_test = _check_xy(X_test, y_test, "X_test")
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_train has {X_train.shape[1]} features but X_test has {X_test.shape[1]}")
    lambdas = np.asarray(lambdas, dtype=np.float64)
    if lambdas.ndim != 1 or lambdas.size == 0 or np.any(lambdas <= 0):
        raise ValueError("lambdas must be a non-empty 1-D sequence of positive values")
    xp = array_namespace(X_train)
    classes, y_tr = np.unique(y_train, return_inverse=True)
    K = classes.size
    if K < 2:
        raise ValueError(f"the training set has {K} class; a linear probe needs at least 2")

    t0 = time.perf_counter()
    tr_idx, val_idx = stratified_split(y_tr, val_fraction, seed)
    if val_idx.size == 0:
        raise ValueError("the validation split is empty (every class has a single example)")
    order = np.concatenate([tr_idx, val_idx])
    Xo = _take_rows(X_train, order, xp)
    rp = _logreg.rotate(Xo, xp=xp, overwrite=True)
    del Xo
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

    # --- refit on train + validation at the chosen λ (warm start from the sweep's solution there)
    t2 = time.perf_counter()
    full = _logreg.LogisticObjective(rp, y_tr[order], K)
    final = full.solve(best, best_sol[1], tol=refit_tol, max_iter=max_iter)
    W, b = rp.to_original(final.Wd, final.b)
    t_refit = time.perf_counter() - t2

    dt = rp.dtype
    Zt = xp.matmul(X_test if X_test.dtype == dt else xp.astype(X_test, dt), xp.asarray(W, dtype=dt))
    Zt = Zt + xp.asarray(b, dtype=dt)
    pred_test = classes[np.asarray(to_numpy(xp.argmax(Zt, axis=1)))]
    acc = accuracy(y_test, pred_test, metric)
    info = {"seconds_prepare": t_prep, "seconds_sweep": t_sweep, "seconds_refit": t_refit,
            "iterations": {repr(k): v for k, v in iters.items()},
            "iterations_total": int(sum(iters.values())), "refit_iterations": final.n_iter,
            "evaluations_sweep": obj.n_evals, "evaluations_refit": full.n_evals,
            "products_sweep": obj.n_products, "products_refit": full.n_products,
            "line_search_trials": obj.n_trials + full.n_trials,
            "refit_converged": final.converged, "refit_message": final.message,
            "rank": rp.rank, "n_train": int(n_tr), "n_val": int(val_idx.size),
            "direction": direction, "warm_start": warm_start, "dtype": str(np.dtype(
                "float64" if dt == xp.float64 else "float32"))}
    return ProbeResult(probe="linear", metric=metric, accuracy=acc, best_param=float(best),
                       curve=curve, predictions=pred_test, classes=classes,
                       coef_=W.T.copy(), intercept_=b, info=info)


def _better(curve: dict, a: float, b: float) -> bool:
    """Is λ=a preferred to λ=b: higher validation metric, ties to the smaller λ."""
    return (curve[a], -a) > (curve[b], -b)


def fit_logistic(X: Any, y: Any, lam: float | np.ndarray, *, loss: str = "softmax",
                 tol: float = 1e-7, max_iter: int = 1000) -> tuple[np.ndarray, np.ndarray, dict]:
    """One fit at fixed λ: minimise ``Σ_i loss_i + Σ_k λ_k‖W_k‖²``; returns (coef (K, P), intercept (K,),
    info). ``loss="softmax"``: y are class indices 0..K-1 (K = max+1); ``"sigmoid"``: y is (N, K) 0/1.
    Equal to ``LogisticRegression(C=1/(2λ))`` for softmax."""
    from repsim import _logreg

    X = _as_2d(X, "X")
    y = np.asarray(to_numpy(y))
    K = int(y.max()) + 1 if loss == "softmax" else int(y.shape[1])
    rp = _logreg.rotate(X)
    obj = _logreg.LogisticObjective(rp, y, K, loss=loss)
    sol = obj.solve(lam, tol=tol, max_iter=max_iter)
    W, b = rp.to_original(sol.Wd, sol.b)
    return W.T.copy(), b, {"n_iter": sol.n_iter, "converged": sol.converged, "message": sol.message}


def _progress_fn(enabled: bool, desc: str):
    """A tqdm wrapper when ``enabled`` and stderr is a terminal, else None."""
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return lambda it: tqdm(it, desc=desc, leave=False)


# ------------------------------------------------------------------------------------------------
# kNN probe
# ------------------------------------------------------------------------------------------------

def _normalise_rows(X: Any, xp: Any) -> Any:
    dt = xp.float64 if X.dtype == xp.float64 else xp.float32
    X = xp.astype(X, dt)
    norms = xp.sqrt(xp.sum(X * X, axis=1, keepdims=True))
    return X / xp.where(norms > 0, norms, xp.ones_like(norms))


def knn_neighbours(Q: Any, X: Any, k: int, *, exclude_self: bool = False,
                   chunk_bytes: int = 128 * 2**20) -> tuple[np.ndarray, np.ndarray]:
    """Indices (M, k) and cosine similarities (M, k) of each query row's k nearest rows of X, in
    decreasing similarity (ties: increasing index). ``exclude_self``: Q is X and row i never counts
    itself (leave-one-out). Memory: one (chunk, N) similarity block, chunk chosen from ``chunk_bytes``.
    Zero rows have similarity 0 to everything."""
    xp = array_namespace(Q, X)
    Qn, Xn = _normalise_rows(Q, xp), _normalise_rows(X, xp)
    m, n = Qn.shape[0], Xn.shape[0]
    if k > n - int(exclude_self):
        raise ValueError(f"k={k} needs at least {k + int(exclude_self)} training rows, have {n}")
    itemsize = 8 if Xn.dtype == xp.float64 else 4
    chunk = max(1, min(m, chunk_bytes // (4 * itemsize * max(n, 1))))
    XnT = xp.permute_dims(Xn, (1, 0))
    cols = xp.arange(n)
    idx_out = np.empty((m, k), dtype=np.int64)
    sim_out = np.empty((m, k), dtype=np.float64)
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        S = xp.matmul(Qn[start:stop, ...], XnT)
        if exclude_self:
            rows = xp.arange(start, stop)
            S = xp.where(rows[:, None] == cols[None, :], xp.asarray(-xp.inf, dtype=S.dtype), S)
        if xp is np:
            part = np.argpartition(-S, k - 1, axis=1)[:, :k]
        else:
            part = xp.argsort(-S, axis=1, stable=True)[:, :k]
        cand_sim = np.asarray(to_numpy(xp.take_along_axis(S, part, axis=1)), dtype=np.float64)
        part = np.asarray(to_numpy(part))
        o = np.lexsort((part, -cand_sim), axis=1)
        idx_out[start:stop] = np.take_along_axis(part, o, axis=1)
        sim_out[start:stop] = np.take_along_axis(cand_sim, o, axis=1)
    return idx_out, sim_out


def knn_vote(neighbour_labels: np.ndarray, ks: Sequence[int], n_classes: int) -> dict[int, np.ndarray]:
    """Predictions for every k in ``ks`` from labels of neighbours sorted nearest first (M, kmax).

    One vote per neighbour; among classes with the most votes, the class of the nearest neighbour wins.
    """
    L = np.asarray(neighbour_labels)
    m, kmax = L.shape
    rows = np.arange(m)
    counts = np.zeros((m, n_classes), dtype=np.int64)
    first = np.full((m, n_classes), kmax, dtype=np.int64)
    out: dict[int, np.ndarray] = {}
    want = set(int(k) for k in ks)
    for j in range(kmax):
        c = L[:, j]
        counts[rows, c] += 1
        first[rows, c] = np.minimum(first[rows, c], j)
        if j + 1 in want:
            out[j + 1] = np.argmax(counts * (kmax + 1) - first, axis=1)
    return out


def knn_probe(X_train: Any, y_train: Any, X_test: Any, y_test: Any,
              ks: Sequence[int] = DEFAULT_KS, metric: str = "top1", *,
              chunk_bytes: int = 128 * 2**20) -> ProbeResult:
    """Cosine kNN probe (Table 1): k from ``ks`` by leave-one-out ``metric`` on the training set
    (each training example classified by its k nearest *other* training examples), then the test set
    classified with that k against the whole training set. ``curve`` = {k: LOO metric}."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    X_train, y_train = _check_xy(X_train, y_train, "X_train")
    X_test, y_test = _check_xy(X_test, y_test, "X_test")
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_train has {X_train.shape[1]} features but X_test has {X_test.shape[1]}")
    n = X_train.shape[0]
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    usable = [k for k in ks if k <= n - 1]
    if not usable:
        raise ValueError(f"no k in {ks} is below the number of training examples ({n})")
    classes, y_idx = np.unique(y_train, return_inverse=True)
    t0 = time.perf_counter()
    nb, _ = knn_neighbours(X_train, X_train, usable[-1], exclude_self=True, chunk_bytes=chunk_bytes)
    votes = knn_vote(y_idx[nb], usable, classes.size)
    curve = {k: accuracy(y_idx, votes[k], metric) for k in usable}
    best = max(usable, key=lambda k: (curve[k], -k))
    nb_test, _ = knn_neighbours(X_test, X_train, best, chunk_bytes=chunk_bytes)
    pred = classes[knn_vote(y_idx[nb_test], [best], classes.size)[best]]
    return ProbeResult(probe="knn", metric=metric, accuracy=accuracy(y_test, pred, metric),
                       best_param=int(best), curve=curve, predictions=pred, classes=classes,
                       info={"seconds": time.perf_counter() - t0, "skipped_ks": [k for k in ks
                                                                                 if k not in usable]})


# ------------------------------------------------------------------------------------------------
# multi-label probe (CheXpert, Table D.1)
# ------------------------------------------------------------------------------------------------

def binned_auc(scores: np.ndarray, targets: np.ndarray, bins: int = 1000) -> float:
    """ROC AUC with scores in [0, 1] quantised to ``bins`` equal bins (Table D.1: 1000 bins).

    Equals the trapezoidal area under the ROC curve traced by the ``bins + 1`` thresholds, i.e.
    ``P(bin(s⁺) > bin(s⁻)) + ½ P(bin(s⁺) = bin(s⁻))``. NaN when one class is absent.
    """
    scores = np.asarray(scores, dtype=np.float64)
    t = np.asarray(targets).astype(bool)
    if scores.shape != t.shape:
        raise ValueError(f"scores {scores.shape} and targets {t.shape} differ in shape")
    b = np.clip((scores * bins).astype(np.int64), 0, bins - 1)
    pos = np.bincount(b[t], minlength=bins).astype(np.float64)
    neg = np.bincount(b[~t], minlength=bins).astype(np.float64)
    P, N = pos.sum(), neg.sum()
    if P == 0 or N == 0:
        return float("nan")
    neg_below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
    return float(np.sum(pos * (neg_below + 0.5 * neg)) / (P * N))


@dataclass
class MultiLabelResult:
    """Per-class test AUCs (K,), chosen λ per class (K,), validation AUC curves (n_λ, K)."""

    auc: np.ndarray
    best_lambda: np.ndarray
    lambdas: np.ndarray
    val_auc: np.ndarray
    scores: np.ndarray
    info: dict = field(default_factory=dict)

    @property
    def mean_auc(self) -> float:
        return float(np.nanmean(self.auc))


def multilabel_probe(X_train: Any, Y_train: Any, X_test: Any, Y_test: Any,
                     lambdas: Sequence[float] = DEFAULT_LAMBDAS, val_fraction: float = 0.2,
                     seed: int = 0, *, bins: int = 1000, tol: float = 1e-3, refit_tol: float = 1e-4,
                     max_iter: int = 1000) -> MultiLabelResult:
    """Table D.1: K independent L2-regularised binary logistic regressions on fixed features.

    Y are (N, K) 0/1 targets (uncertain/unmentioned findings already mapped to 0 by the caller, as in
    the paper). For each λ of the grid (swept downward, warm-started) all K problems are solved at once
    (the objective separates by class); each class keeps the λ with the best validation AUC, then all
    classes are refit on train+validation with their own λ and scored by :func:`binned_auc`. The
    validation split is random (not stratified: examples carry several labels).
    """
    from repsim import _logreg

    X_train, X_test = _as_2d(X_train, "X_train"), _as_2d(X_test, "X_test")
    Y_train, Y_test = np.asarray(to_numpy(Y_train)), np.asarray(to_numpy(Y_test))
    if Y_train.ndim != 2 or Y_train.shape[0] != X_train.shape[0]:
        raise ValueError(f"Y_train must have shape ({X_train.shape[0]}, K), got {Y_train.shape}")
    xp = array_namespace(X_train)
    n, K = Y_train.shape
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    n_val = min(max(int(round(val_fraction * n)), 1), n - 1)
    order = np.concatenate([np.sort(perm[n_val:]), np.sort(perm[:n_val])])
    n_tr = n - n_val
    Xo = _take_rows(X_train, order, xp)
    rp = _logreg.rotate(Xo, xp=xp, overwrite=True)
    del Xo
    Yo = Y_train[order].astype(np.float64)
    obj = _logreg.LogisticObjective(rp, Yo[:n_tr], K, n=n_tr, loss="sigmoid")
    grid = np.sort(np.asarray(lambdas, dtype=np.float64))
    val_auc = np.full((grid.size, K), np.nan)
    sols = {}
    for lam, sol in obj.sweep(grid[::-1], tol=tol, max_iter=max_iter):
        i = int(np.searchsorted(grid, lam))
        sols[i] = (sol.Wd, sol.b)          # not the solution's logits / L-BFGS memory (N·K each)
        Z = np.asarray(to_numpy(obj.logits(rp.Xh[n_tr:, ...], sol.Wd, sol.b)), dtype=np.float64)
        P = 1.0 / (1.0 + np.exp(-Z))
        val_auc[i] = [binned_auc(P[:, k], Yo[n_tr:, k], bins) for k in range(K)]
    filled = np.where(np.isnan(val_auc), -np.inf, val_auc)
    best_i = np.argmax(filled, axis=0)          # first best = smallest λ
    best_lam = grid[best_i]
    init = _logreg.Solution(Wd=np.stack([sols[i][0][:, k] for k, i in enumerate(best_i)], axis=1),
                            b=np.array([sols[i][1][k] for k, i in enumerate(best_i)]), n_iter=0,
                            converged=True)
    full = _logreg.LogisticObjective(rp, Yo, K, loss="sigmoid")
    final = full.solve(best_lam, init, tol=refit_tol, max_iter=max_iter)
    W, b = rp.to_original(final.Wd, final.b)
    dt = rp.dtype
    Zt = xp.matmul(xp.astype(X_test, dt), xp.asarray(W, dtype=dt)) + xp.asarray(b, dtype=dt)
    scores = 1.0 / (1.0 + np.exp(-np.asarray(to_numpy(Zt), dtype=np.float64)))
    auc = np.array([binned_auc(scores[:, k], Y_test[:, k], bins) for k in range(K)])
    return MultiLabelResult(auc=auc, best_lambda=best_lam, lambdas=grid, val_auc=val_auc,
                            scores=scores, info={"refit_iterations": final.n_iter,
                                                 "refit_converged": final.converged})


__all__ = ["ProbeResult", "MultiLabelResult", "linear_probe", "knn_probe", "multilabel_probe",
           "fit_logistic", "binned_auc", "accuracy", "stratified_split", "knn_neighbours",
           "knn_vote", "DEFAULT_LAMBDAS", "DEFAULT_KS"]
