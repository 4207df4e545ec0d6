"""``procrustes``: orthogonal Procrustes similarity of column-centred representations,

    P(X, Y) = ‖X̃ᵀỸ‖_* / (‖X̃‖_F ‖Ỹ‖_F)  ∈ [0, 1]   (‖·‖_* the nuclear norm: the sum of singular values),

the cosine of Williams et al. 2021's angular Procrustes shape distance (NeurIPS, "Generalized Shape
Metrics on Neural Representations"), d(X, Y) = arccos P(X, Y) (:func:`procrustes_distance`), and
equal to the normalised Bures similarity of the linear kernels (Harvey et al. 2023): it is
max_Q tr(QᵀX̃ᵀỸ)/(‖X̃‖‖Ỹ‖) over orthogonal Q, so identical (or rotated, scaled, shifted) inputs give 1.

Exact only.  The singular values of X̃ᵀỸ are those of R_xᵀR_y for any R = X̃Q (Q orthonormal), so a
wide column (p > n) uses the n × r eigen-factor of its centred Gram (:meth:`FullColumn.factor`):
no p × p or p₁ × p₂ matrix beyond r = min(p, n).  Cost per pair O(n r₁ r₂ + min(r)² max(r)).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.kernels.measures import register
from repsim.kernels.measures._batched import cross_singular_values, null_singular_values
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo


def procrustes_distance(similarity: float | np.ndarray) -> float | np.ndarray:
    """Williams et al. 2021's angular Procrustes distance arccos(P) from the similarity P."""
    return np.arccos(np.clip(similarity, -1.0, 1.0))


@register
class Procrustes(Measure):
    info = MeasureInfo(
        name="procrustes", display="Procrustes", order=2,
        formula="‖X̃ᵀỸ‖_* / (‖X̃‖_F ‖Ỹ‖_F), column-centred; distance arccos of it",
        source="Williams et al. 2021 (NeurIPS), angular Procrustes; Ding et al. 2021",
        estimators=("exact",), symmetric=True, range=(0.0, 1.0), identical=1.0, null="small > 0",
        invariances=("orthogonal", "isotropic scaling", "translation"))

    def prepare(self, column: FullColumn) -> Any:
        if column.is_constant():
            return None
        R = column.factor()
        return R, float(np.linalg.norm(R))

    def pair(self, a: Any, b: Any) -> float:
        return self._value(np.linalg.svd(a[0].T @ b[0], compute_uv=False), a, b)

    def pairs(self, a: Any, bs: Sequence[Any]) -> list[float]:
        return [self._value(s, a, b) for s, b in zip(cross_singular_values(a[0], [b[0] for b in bs]), bs)]

    def permute(self, prepared: Any, perm: np.ndarray) -> Any:
        return prepared[0][perm], prepared[1]

    def null_block(self, rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
        """Per pair, the K nulls' singular values in stacked SVDs (:func:`null_singular_values`)."""
        out = np.full((perms.shape[0], len(rows), len(cols)), np.nan)
        for c, b in enumerate(cols):
            for r, a in enumerate(rows):
                if a is not None and b is not None:
                    out[:, r, c] = [self._value(s, a, b) for s in null_singular_values(a[0], b[0], perms)]
        return out

    @staticmethod
    def _value(s: np.ndarray, a: Any, b: Any) -> float:
        value = float(np.sum(s)) / (a[1] * b[1])
        return min(value, 1.0) if math.isfinite(value) else math.nan
