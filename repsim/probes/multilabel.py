"""The multi-label probe (CheXpert, Table D.1): one binary L2-regularised logistic regression per class,
λ chosen per class by validation AUC, AUC on the test set from 1000 equal bins (:func:`binned_auc`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, asarray_like, to_numpy
from repsim.probes._common import _as_2d, _take_rows
from repsim.probes.linear import DEFAULT_LAMBDAS


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
    from repsim.probes import _logreg

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
    blind = np.flatnonzero(np.isnan(val_auc).all(axis=0))  # one class only in the validation rows
    if blind.size:
        seen = np.setdiff1d(np.arange(K), blind)
        if not seen.size:
            raise ValueError("multi-label probe: no target has both positives and negatives among the validation "
                             f"rows ({n_val} of {n}): no λ can be chosen; give more examples or a larger val_fraction")
        shared = int(np.argmax(np.nanmean(val_auc[:, seen], axis=1)))  # best mean AUC over the other targets
        best_i[blind] = shared
        warnings.warn(f"multi-label probe: target(s) {blind.tolist()} have only positives or only negatives among "
                      f"the {n_val} validation rows, so their validation AUC is undefined; they take the λ with the best "
                      f"mean validation AUC over the other targets ({grid[shared]:.3g})", UserWarning, stacklevel=2)
    best_lam = grid[best_i]
    init = _logreg.Solution(Wd=np.stack([sols[i][0][:, k] for k, i in enumerate(best_i)], axis=1),
                            b=np.array([sols[i][1][k] for k, i in enumerate(best_i)]), n_iter=0,
                            converged=True)
    full = _logreg.LogisticObjective(rp, Yo, K, loss="sigmoid")
    final = full.solve(best_lam, init, tol=refit_tol, max_iter=max_iter)
    W, b = rp.to_original(final.Wd, final.b)
    dt = rp.dtype
    Zt = xp.matmul(xp.astype(X_test, dt), asarray_like(W, X_test, xp, dt)) + asarray_like(b, X_test, xp, dt)
    scores = 1.0 / (1.0 + np.exp(-np.asarray(to_numpy(Zt), dtype=np.float64)))
    auc = np.array([binned_auc(scores[:, k], Y_test[:, k], bins) for k in range(K)])
    return MultiLabelResult(auc=auc, best_lambda=best_lam, lambdas=grid, val_auc=val_auc,
                            scores=scores, info={"refit_iterations": final.n_iter,
                                                 "refit_converged": final.converged})


__all__ = ["MultiLabelResult", "multilabel_probe", "binned_auc"]
