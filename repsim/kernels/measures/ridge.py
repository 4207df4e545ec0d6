"""``ridge_r2``: linear predictivity, the cross-validated R² of ridge regression from one
representation to the other (asymmetric: row = predictor, column = target).

    R²(X → Y) = 1 − Σ_folds ‖Y_te − Ŷ_te‖²_F / Σ_folds ‖Y_te − ȳ_tr‖²_F,
    Ŷ_te = ȳ_tr + (X_te − x̄_tr) W,  W = argmin ‖Ỹ_tr − X̃_tr W‖² + λ‖W‖²,

over ``ridge_folds`` (default 5) seeded folds (``default_rng(ridge_seed).permutation(n)``, cut into
near-equal parts; the same folds for every pair), λ chosen per fold by efficient leave-one-out on its
training part (as scikit-learn's RidgeCV, Rifkin & Lippert 2007) from a grid of 10⁻⁶..10² × the mean
squared singular value of X̃_tr, ‖X̃_tr‖²_F / min(n_tr, p) (its min(n_tr, p) singular values, zeros
included, whatever route holds the column).  R² pools all target features (variance-weighted), as in
the linear-predictivity measures of Schrimpf et al. 2018 (Brain-Score) and Klabunde et al. 2023's
survey.  Identical inputs give ≈ 1 (not exactly: ridge shrinks and it is cross-validated); independent
noise gives ≤ 0 about.  Invariant to orthogonal transforms and isotropic scaling of either side.

Ridge predictions depend on X only through X̃_tr's SVD and on Y through rotation-invariant norms, so a
wide column uses its n × r factor (:meth:`FullColumn.factor`) with the same result: no p × p matrix.
Cost per fold: one thin SVD of the predictor O(n r²), then O(n r r_y) per pair.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo

ALPHAS = np.logspace(-6, 2, 9)


def folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    """The test rows of each fold."""
    return np.array_split(np.random.default_rng(seed).permutation(n), k)


class Fold(NamedTuple):
    train: np.ndarray
    test: np.ndarray
    mean: np.ndarray  # x̄_tr
    U: np.ndarray
    s: np.ndarray
    Vt: np.ndarray
    scale: float  # the λ grid's unit: X̃_tr's mean squared singular value, ‖X̃_tr‖²_F / min(n_tr, p)


class Prepared(NamedTuple):
    R: np.ndarray
    folds: list[Fold]


def _fit_predict(f: Fold, Rx: np.ndarray, Ry: np.ndarray) -> tuple[float, float]:
    """(SSE, SST) of fold ``f`` predicting Ry from Rx, λ by leave-one-out on the training rows."""
    Ytr = Ry[f.train]
    ybar = Ytr.mean(axis=0)
    Yc = Ytr - ybar
    s2 = f.s ** 2
    UtY = f.U.T @ Yc
    best, lam = math.inf, None
    for alpha in ALPHAS:
        lam_ = alpha * f.scale if f.scale > 0 else alpha
        shrink = s2 / (s2 + lam_)
        fitted = f.U @ (shrink[:, None] * UtY)
        h = np.einsum("ij,j,ij->i", f.U, shrink, f.U) + 1.0 / f.train.size  # hat diagonal (+ intercept)
        loo = np.sum(((Yc - fitted) / (1.0 - np.minimum(h, 1 - 1e-12))[:, None]) ** 2)
        if loo < best:
            best, lam = loo, lam_
    coef = f.Vt.T @ ((f.s / (s2 + lam))[:, None] * UtY)
    Yte = Ry[f.test]
    pred = ybar + (Rx[f.test] - f.mean) @ coef
    return float(np.sum((Yte - pred) ** 2)), float(np.sum((Yte - ybar) ** 2))


@register
class RidgeR2(Measure):
    info = MeasureInfo(
        name="ridge_r2", display="ridge R²", order=8, formula="cross-validated R² of ridge regression X → Y (λ by leave-one-out per fold)",
        source="linear predictivity: Yamins et al. 2014, Schrimpf et al. 2018; Klabunde et al. 2023 (survey)",
        estimators=("exact",), symmetric=False, range=(-math.inf, 1.0), identical=1.0, null="≤ 0",
        invariances=("orthogonal", "isotropic scaling", "translation"))
    OPTIONS = {"ridge_folds": 5, "ridge_seed": 0}

    def undefined_when(self) -> str:
        k = int(self.options["ridge_folds"])
        return f"constant over the examples, or with fewer than {2 * k} examples for ridge_folds = {k} folds"

    def prepare(self, column: FullColumn) -> Any:
        k = int(self.options["ridge_folds"])
        if column.is_constant() or column.n < 2 * k or k < 2:
            return None
        R = column.factor()
        out = []
        for test in folds(column.n, k, int(self.options["ridge_seed"])):
            train = np.setdiff1d(np.arange(column.n), test)
            mean = R[train].mean(axis=0)
            U, s, Vt = np.linalg.svd(R[train] - mean, full_matrices=False)
            # the mean over X̃_tr's min(n_tr, p) singular values, not the factor's r: the same λ grid as
            # the features themselves give (a wide column's factor, or dead units, would move it)
            out.append(Fold(train, test, mean, U, s, Vt, float(np.sum(s ** 2)) / min(train.size, column.features)))
        return Prepared(R, out)

    def permute(self, prepared: Prepared, perm: np.ndarray) -> Prepared:
        """The target side's rows permuted (a pair reads only the target's R; the folds are the
        predictor's)."""
        return Prepared(prepared.R[perm], prepared.folds)

    def pair(self, a: Prepared, b: Prepared) -> float:
        sse = sst = 0.0
        for f in a.folds:
            e, t = _fit_predict(f, a.R, b.R)
            sse, sst = sse + e, sst + t
        return 1.0 - sse / sst if sst > 0 else math.nan
