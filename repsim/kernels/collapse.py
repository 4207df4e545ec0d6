"""Neural-collapse / simplex-ETF measurements of Table E.2 (Papyan, Han & Donoho 2020).

C classes, class means μ_c, global mean μ_G = (1/C) Σ_c μ_c (the mean of the class means),
μ̃_c = μ_c - μ_G (rows of M, C × P), classifier rows w_c (rows of W, C × P). Keys (Table E.2; docs/architecture.md):

* ``norm_cv_means``       Std_c ‖μ̃_c‖ / Avg_c ‖μ̃_c‖
* ``norm_cv_weights``     Std_c ‖w_c‖ / Avg_c ‖w_c‖
* ``cos_std_means``       Std_{c<c'} sim(μ̃_c, μ̃_c')
* ``cos_std_weights``     Std_{c<c'} sim(w_c, w_c')
* ``equiangular_means``   Avg_{c<c'} |sim(μ̃_c, μ̃_c') + 1/(C-1)|
* ``equiangular_weights`` Avg_{c<c'} |sim(w_c, w_c') + 1/(C-1)|
* ``self_duality``        ‖W/‖W‖_F - M/‖M‖_F‖²_F
* ``nc1``                 Tr(Σ_W Σ_B⁺) / C,  Σ_W = (1/N) Σ_i (h_i - μ_{y_i})(h_i - μ_{y_i})ᵀ,
                          Σ_B = (1/C) Σ_c μ̃_c μ̃_cᵀ = MᵀM / C

Standard deviations are population ones (ddof=0); pairwise statistics run over the C(C-1)/2
unordered pairs. The ``*_weights`` keys and ``self_duality`` are present only when W is given.

Sufficient statistics (mergeable, float64): per-class counts and means and the pooled within-class
scatter S_W = N Σ_W (P × P), combined with Chan et al.'s update (:mod:`repsim.kernels._moments`).

Pseudo-inverse: M has rank ≤ C - 1 because its rows sum to zero. That null direction is removed
exactly, not by a tolerance: M is written in an orthonormal basis of the sum-zero subspace of R^C
(``_sum_zero_rows``: R with RᵀR = MᵀM, C - 1 rows). Its rounding-level singular value would
otherwise survive any tolerance relative to max(s) once the global mean is large against the class
spread, and blow nc1 up by ~1/eps². Then Σ_B⁺ is formed from the SVD R = U diag(s) Vᵀ,
Σ_B⁺ = V diag(C / s²) Vᵀ over the singular values s_k > rtol · ‖μ‖₂ (spectral norm of the
uncentred class means, ≥ max(s): the scale of the rounding in M = μ - mean(μ)), so
Tr(Σ_W Σ_B⁺) = Σ_k (C / s_k²) v_kᵀ Σ_W v_k. The default ``rtol = max(C, P) · eps(float64)`` is
the NumPy ``matrix_rank`` rule applied to M (not to Σ_B, whose singular values are squared); it
only matters for genuinely degenerate class means (e.g. collinear ones).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.kernels._moments import ClassMoments
from repsim.results import COLLAPSE_KEYS  # the result keys are collapse.csv's columns (declared there)
from repsim.array_api import (UndefinedMetric, array_namespace, as_array, check_finite, compute_dtype, flatten_examples,
                        host_labels, to_numpy)

__all__ = ["COLLAPSE_KEYS", "CollapseStats", "collapse_metrics"]


def _pairwise_cos(V: np.ndarray, what: str) -> np.ndarray:
    norms = np.linalg.norm(V, axis=1)
    if np.any(norms == 0):
        raise UndefinedMetric(f"{what}: a row has zero norm; cosine similarity is undefined")
    U = V / norms[:, None]
    iu = np.triu_indices(V.shape[0], k=1)
    return (U @ U.T)[iu]


def _sum_zero_rows(M: np.ndarray) -> np.ndarray:
    """(C-1, P) matrix R with RᵀR = MᵀM for M whose rows sum to zero, without M's null direction.

    R is M in an orthonormal basis of {v ∈ R^C : Σ v = 0} (a Householder reflection H taking
    1/√C to e₁; R = (H M)[1:]). In exact arithmetic 1ᵀM = 0, so nothing is lost; in floating point
    the rounding of M = μ - mean(μ) leaves 1ᵀM ≈ eps·‖μ‖ rather than 0, and that spurious singular
    value would enter Σ_B⁺ as 1/(eps‖μ‖)² whenever the global mean dwarfs the class spread
    (post-ReLU features): dropping the direction exactly makes nc1 independent of that offset.
    """
    C = M.shape[0]
    v = np.full(C, 1.0 / np.sqrt(C))
    v[0] -= 1.0
    nv = np.linalg.norm(v)
    if nv == 0.0:  # C == 1
        return M[:0]
    v /= nv
    return (M - 2.0 * np.outer(v, v @ M))[1:]


def _norm_cv(V: np.ndarray) -> float:
    norms = np.linalg.norm(V, axis=1)
    return float(norms.std() / norms.mean())


class CollapseStats:
    """Streaming Table E.2 statistics (protocol: update / merge / result / to_state / from_state)."""

    def __init__(self, num_classes: int, name: str = "") -> None:
        if int(num_classes) < 2:
            raise ValueError(f"collapse metrics need at least 2 classes, got {num_classes}")
        self.num_classes = int(num_classes)
        self.name = name
        self.moments = ClassMoments(self.num_classes, second="matrix")

    def update(self, H: Any, labels: Any, *, xp: Any = None) -> "CollapseStats":
        """Add penultimate features H (b, P) (more axes are flattened) with labels in [0, C)."""
        xp = array_namespace(H, xp=xp)
        H = flatten_examples(H, xp, compute_dtype(xp, H), self._what())
        deferred: list = []  # on an accelerator: checked with the batch's one copy to the host
        check_finite(H, xp, self._what(), deferred)
        y = host_labels(labels, H.shape[0], self.num_classes)
        self.moments.update(H, y, xp, deferred)
        return self

    def merge(self, other: "CollapseStats") -> "CollapseStats":
        if not isinstance(other, CollapseStats):
            raise TypeError(f"cannot merge {type(other).__name__} into CollapseStats")
        self.moments.merge(other.moments)
        return self

    def class_means(self) -> np.ndarray:
        """(C, P) float64 class means μ_c."""
        self.moments.check_nonempty(self._what())
        return self.moments.means.copy()

    def centered_means(self) -> np.ndarray:
        """(C, P) M: class means minus the mean of the class means."""
        mu = self.class_means()
        return mu - mu.mean(axis=0)

    def within_covariance(self) -> np.ndarray:
        """Σ_W (P, P) = pooled within-class scatter / N."""
        self.moments.check_nonempty(self._what())
        return self.moments.m2 / self.moments.n

    def result(self, W: Any = None, *, rtol: float | None = None) -> dict[str, float]:
        """Table E.2 quantities (module docstring); W (C, P) classifier weights or None."""
        C = self.num_classes
        M = self.centered_means()
        P = M.shape[1]
        what = self._what()
        cos_m = _pairwise_cos(M, f"{what}: centred class means")
        out = {
            "norm_cv_means": _norm_cv(M),
            "cos_std_means": float(cos_m.std()),
            "equiangular_means": float(np.mean(np.abs(cos_m + 1.0 / (C - 1)))),
        }
        if W is not None:
            Wn = np.asarray(to_numpy(W), dtype=np.float64)
            if Wn.shape != (C, P):
                raise ValueError(f"W must have shape (C, P) = {(C, P)}, got {Wn.shape}")
            if not np.all(np.isfinite(Wn)):
                raise ValueError("W contains NaN or infinite values")
            cos_w = _pairwise_cos(Wn, "W")
            out["norm_cv_weights"] = _norm_cv(Wn)
            out["cos_std_weights"] = float(cos_w.std())
            out["equiangular_weights"] = float(np.mean(np.abs(cos_w + 1.0 / (C - 1))))
            out["self_duality"] = float(np.sum((Wn / np.linalg.norm(Wn) - M / np.linalg.norm(M)) ** 2))
        out["nc1"] = self.nc1(rtol=rtol)
        return {k: out[k] for k in COLLAPSE_KEYS if k in out}

    def nc1(self, *, rtol: float | None = None) -> float:
        """Tr(Σ_W Σ_B⁺) / C with the rank tolerance of the module docstring."""
        mu = self.class_means()
        C, P = mu.shape
        _, s, Vt = np.linalg.svd(_sum_zero_rows(mu - mu.mean(axis=0)), full_matrices=False)
        scale = float(np.linalg.norm(mu, 2))  # >= s[0]; the rounding of mu - mean(mu) is relative to it
        tol = (max(C, P) * np.finfo(np.float64).eps if rtol is None else float(rtol)) * scale
        keep = s > tol
        if not np.any(keep):
            raise UndefinedMetric(f"{self._what()}: all class means coincide; Σ_B is zero and nc1 is undefined")
        V = Vt[keep]
        proj = np.einsum("kp,pq,kq->k", V, self.within_covariance(), V)
        return float(np.sum(C / s[keep] ** 2 * proj) / C)

    def to_state(self) -> dict[str, Any]:
        return {"kind": "CollapseStats", "num_classes": self.num_classes, "name": self.name,
                **self.moments.to_state("moments_")}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "CollapseStats":
        if str(state.get("kind")) != "CollapseStats":
            raise ValueError(f"not a CollapseStats state (kind={state.get('kind')!r})")
        acc = cls(int(state["num_classes"]), str(state["name"]))
        acc.moments = ClassMoments.from_state(state, "moments_")
        return acc

    def _what(self) -> str:
        return self.name or "H"


def collapse_metrics(H: Any, labels: Any, W: Any = None, *, num_classes: int | None = None,
                     rtol: float | None = None, xp: Any = None) -> dict[str, float]:
    """Table E.2 quantities of penultimate features H (n, P) with labels (and classifier W (C, P)).

    ``num_classes`` defaults to max(label) + 1 (labels index the rows of W); every class must occur.
    """
    H = as_array(H)
    y = host_labels(labels, H.shape[0], num_classes)
    if num_classes is None:
        num_classes = int(y.max()) + 1 if y.size else 0
    return CollapseStats(num_classes).update(H, y, xp=xp).result(W, rtol=rtol)
