"""Mergeable per-class first and second moments (the sufficient statistics behind R², collapse, spectra).

For each class k the accumulator keeps the count N_k, the mean μ_k (P,) and a centred second
moment: either the scalar M2_k = Σ_{i∈k} ‖x_i - μ_k‖² (``second="trace"``), or the pooled
within-class scatter S_W = Σ_k Σ_{i∈k} (x_i - μ_k)(x_i - μ_k)ᵀ (``second="matrix"``, P × P).

A batch's moments are computed around the batch's own class means (no large-mean cancellation)
and combined with Chan, Golub & LeVeque's pairwise update (1979): for parts a and b of class k,
n = n_a + n_b, δ = μ_b - μ_a, μ = μ_a + δ n_b / n, M2 = M2_a + M2_b + ‖δ‖² n_a n_b / n (and
δ δᵀ n_a n_b / n for the matrix). The update is associative and commutative up to float64
rounding, so any split and merge order gives the same statistics. Batch statistics are formed in
the inputs' array namespace with a one-hot matrix (standard array API: no scatter-add) and
accumulated on the host in float64.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim.array_api import asarray_like, to_host_checked

__all__ = ["ClassMoments", "batch_class_moments"]


def batch_class_moments(X: Any, y: np.ndarray, num_classes: int, xp: Any, second: str,
                        deferred: Sequence[Any] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts (K,), means (K, P), M2 (K,) or scatter (P, P)) of one batch, as float64 host arrays.

    ``X`` is (b, P) in namespace ``xp`` (any real floating dtype), ``y`` host int labels in [0, K).
    ``deferred``: the batch's checks kept on the device (:func:`repsim.array_api.check_finite`), run on
    the host with the means and second moments, in one copy (:func:`repsim.array_api.to_host_checked`).
    """
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    onehot_h = np.zeros((y.shape[0], num_classes), dtype=np.float64)
    onehot_h[np.arange(y.shape[0]), y] = 1.0
    onehot = asarray_like(onehot_h, X, xp, dtype=X.dtype)
    inv = asarray_like(1.0 / np.maximum(counts, 1), X, xp, dtype=X.dtype)
    means = (xp.matrix_transpose(onehot) @ X) * inv[:, None]  # (K, P)
    R = X - xp.take(means, asarray_like(y, X, xp, dtype=xp.int64), axis=0)  # residuals from class means
    if second == "trace":
        sec = xp.matrix_transpose(onehot) @ xp.sum(R * R, axis=1)  # (K,)
    elif second == "matrix":
        sec = xp.matrix_transpose(R) @ R  # (P, P)
    else:  # pragma: no cover - guarded by ClassMoments
        raise ValueError(f"unknown second moment {second!r}")
    means_h, sec_h = to_host_checked([means, sec], xp, deferred)
    return counts, means_h, sec_h


class ClassMoments:
    """Counts, means and centred second moments per class, merged exactly (Chan et al. 1979)."""

    def __init__(self, num_classes: int, dim: int | None = None, second: str = "trace") -> None:
        if int(num_classes) < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if second not in ("trace", "matrix"):
            raise ValueError(f"second must be 'trace' or 'matrix', got {second!r}")
        self.num_classes = int(num_classes)
        self.second = second
        self.dim = None if dim is None else int(dim)
        self.counts = np.zeros(self.num_classes, dtype=np.int64)
        self.means: np.ndarray | None = None
        self.m2: np.ndarray | None = None
        if self.dim is not None:
            self._alloc(self.dim)

    def _alloc(self, dim: int) -> None:
        self.dim = dim
        self.means = np.zeros((self.num_classes, dim))
        self.m2 = np.zeros(self.num_classes) if self.second == "trace" else np.zeros((dim, dim))

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def add(self, counts: np.ndarray, means: np.ndarray, m2: np.ndarray) -> None:
        """Merge the moments (counts, means, second) of another part into these."""
        if self.means is None:
            self._alloc(means.shape[1])
        elif means.shape[1] != self.dim:
            raise ValueError(f"feature dimension changed from {self.dim} to {means.shape[1]}")
        na = self.counts.astype(np.float64)
        nb = counts.astype(np.float64)
        n = na + nb
        w_b = np.divide(nb, n, out=np.zeros_like(n), where=n > 0)
        w_ab = np.divide(na * nb, n, out=np.zeros_like(n), where=n > 0)
        delta = means - self.means
        if self.second == "trace":
            self.m2 = self.m2 + m2 + w_ab * np.einsum("kp,kp->k", delta, delta)
        else:  # P × P: in place, so that an update holds the state, the part's m2 and one product
            self.m2 += m2  # (self.m2 is this object's own array: _alloc, from_state copy)
            self.m2 += (delta * w_ab[:, None]).T @ delta
        self.means = self.means + delta * w_b[:, None]
        self.counts = self.counts + counts

    def update(self, X: Any, y: np.ndarray, xp: Any, deferred: Sequence[Any] = ()) -> None:
        self.add(*batch_class_moments(X, y, self.num_classes, xp, self.second, deferred))

    def merge(self, other: "ClassMoments") -> None:
        if (other.num_classes, other.second) != (self.num_classes, self.second):
            raise ValueError("cannot merge moments with different classes or second-moment kind")
        if other.means is not None:
            self.add(other.counts, other.means, other.m2)

    def to_state(self, prefix: str = "") -> dict[str, Any]:
        empty = self.means is None
        return {
            f"{prefix}num_classes": self.num_classes,
            f"{prefix}second": self.second,
            f"{prefix}dim": -1 if empty else int(self.dim),
            f"{prefix}counts": self.counts.copy(),
            f"{prefix}means": np.zeros((0, 0)) if empty else self.means.copy(),
            f"{prefix}m2": np.zeros((0,)) if empty else self.m2.copy(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], prefix: str = "") -> "ClassMoments":
        dim = int(state[f"{prefix}dim"])
        acc = cls(int(state[f"{prefix}num_classes"]), None, str(state[f"{prefix}second"]))
        acc.counts = np.array(state[f"{prefix}counts"], dtype=np.int64)
        if dim >= 0:
            acc.dim = dim
            acc.means = np.array(state[f"{prefix}means"], dtype=np.float64)
            acc.m2 = np.array(state[f"{prefix}m2"], dtype=np.float64)
        return acc

    def check_nonempty(self, what: str = "") -> None:
        empty = np.flatnonzero(self.counts == 0)
        if empty.size:
            listed = ", ".join(str(int(k)) for k in empty[:10])
            raise ValueError(
                f"{what + ': ' if what else ''}{empty.size} class(es) have no examples "
                f"(class {listed}{' ...' if empty.size > 10 else ''}); every class needs at least one"
            )
