"""Class separation R² (paper Eq. 11/12; Appendix E.1-E.2, Table E.1), streamed from per-class sums.

    R² = 1 - d̄_within / d̄_total,
    d̄_within = Σ_k Σ_{m,n ∈ k} d(x_m, x_n) / (K N_k²),
    d̄_total  = Σ_{j,k} Σ_{m ∈ j, n ∈ k} d(x_m, x_n) / (K² N_j N_k),

every class weighted 1/K whatever its size, pairs m = n included (docs/architecture.md). Distances:

* ``"cosine"``: d = 1 - sim(x, y). With unit vectors u = x/‖x‖, 1 - sim = ‖u - v‖²/2 (Eq. 13).
* ``"cosine_centered"``: cosine after subtracting the mean activation over *all examples*
  (Table E.1, "mean-subtracted").
* ``"sqeuclidean"``: d = ‖x - y‖² on the raw embeddings (Table E.1, "Euclidean distance").

With v the (normalised or raw) vectors and per-class mean μ_k and M2_k = Σ_{i∈k} ‖v_i - μ_k‖²,
the pair sums collapse (Eq. 16-20) to

    W = (1/K) Σ_k M2_k / N_k,   B = (1/K) Σ_k ‖μ_k - μ̄‖²,  μ̄ = (1/K) Σ_k μ_k,   R² = B / (W + B),

(d̄_within = c·W and d̄_total = c·(W + B), c = 1 for cosine, 2 for sqeuclidean). So one pass
over the examples with O(K·P) memory suffices, never an n × n matrix: the accumulator keeps
per-class counts, means and M2 (merged exactly, :mod:`repsim.kernels._moments`).

``cosine_centered`` needs the global mean before any example can be normalised, and no finite
statistic of the raw data is sufficient for the normalised vectors, so it takes **two passes**:
pass 1 accumulates the global sum and count (mergeable); ``next_pass()`` turns the merged pass-1
accumulator into an empty pass-2 accumulator carrying the centre; pass 2 is the cosine pass on
x - centre. A centre known in advance can be passed as ``center=`` to skip pass 1.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.kernels._moments import ClassMoments
from repsim.array_api import (UndefinedMetric, array_namespace, as_array, asarray_like, check_finite, compute_dtype,
                        flatten_examples, host_labels, to_host_checked, to_numpy, unit_rows)

__all__ = ["DISTANCES", "ClassSeparation", "class_separation"]

DISTANCES = ("cosine", "cosine_centered", "sqeuclidean")


class ClassSeparation:
    """Streaming R² accumulator (protocol: update / merge / result / to_state / from_state).

    ``update(X, labels)`` with X (b, ...) (flattened) and integer labels in [0, num_classes).
    For ``"cosine_centered"`` without ``center``: stream pass 1, merge, call ``next_pass()``, stream
    pass 2 into the accumulator it returns (``needs_second_pass`` tells a driver which phase it is in).
    """

    def __init__(self, num_classes: int, distance: str = "cosine", *, center: Any = None,
                 name: str = "") -> None:
        if distance not in DISTANCES:
            raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
        if center is not None and distance != "cosine_centered":
            raise ValueError("center= only applies to distance='cosine_centered'")
        self.num_classes = int(num_classes)
        self.distance = distance
        self.name = name
        self.center = None if center is None else np.asarray(to_numpy(center), dtype=np.float64).reshape(-1)
        self.moments = ClassMoments(self.num_classes, second="trace")
        self.global_sum: np.ndarray | None = None
        self.global_count = 0

    @property
    def needs_second_pass(self) -> bool:
        """True while this accumulator is collecting the global mean (pass 1 of cosine_centered)."""
        return self.distance == "cosine_centered" and self.center is None

    # -- protocol ------------------------------------------------------------------------------
    def update(self, X: Any, labels: Any, *, xp: Any = None) -> "ClassSeparation":
        xp = array_namespace(X, xp=xp)
        X = flatten_examples(X, xp, compute_dtype(xp, X), self._what())
        y = host_labels(labels, X.shape[0], self.num_classes)
        deferred: list = []  # on an accelerator: checked with the batch's one copy to the host
        check_finite(X, xp, self._what(), deferred)
        if self.needs_second_pass:
            (s,) = to_host_checked([xp.sum(X, axis=0)], xp, deferred)
            self.global_sum = s if self.global_sum is None else self.global_sum + s
            self.global_count += X.shape[0]
            return self
        if self.center is not None:
            if self.center.shape[0] != X.shape[1]:
                raise ValueError(f"center has {self.center.shape[0]} features, X has {X.shape[1]}")
            X = X - asarray_like(self.center, X, xp, dtype=X.dtype)[None, :]
        if self.distance != "sqeuclidean":
            X = unit_rows(X, xp, self._what(), deferred)
        self.moments.update(X, y, xp, deferred)
        return self

    def merge(self, other: "ClassSeparation") -> "ClassSeparation":
        if not isinstance(other, ClassSeparation):
            raise TypeError(f"cannot merge {type(other).__name__} into ClassSeparation")
        if (other.num_classes, other.distance) != (self.num_classes, self.distance):
            raise ValueError("cannot merge ClassSeparation accumulators with different classes or distance")
        if other.needs_second_pass != self.needs_second_pass or (
                self.center is not None and not np.array_equal(self.center, other.center)):
            raise ValueError("cannot merge cosine_centered accumulators from different passes or centres")
        if other.global_sum is not None:
            self.global_sum = other.global_sum.copy() if self.global_sum is None else self.global_sum + other.global_sum
        self.global_count += other.global_count
        self.moments.merge(other.moments)
        return self

    def next_pass(self) -> "ClassSeparation":
        """From a merged pass-1 (global mean) accumulator, an empty pass-2 one carrying the centre."""
        if not self.needs_second_pass:
            raise ValueError(f"distance={self.distance!r} with a known centre needs no further pass")
        if self.global_count == 0:
            raise ValueError(f"{self._what()}: pass 1 saw no examples")
        return ClassSeparation(self.num_classes, self.distance,
                               center=self.global_sum / self.global_count, name=self.name)

    def parts(self) -> dict[str, float]:
        """``within`` W, ``between`` B, ``total`` W + B (module docstring) and ``r2`` = B / (W + B)."""
        if self.needs_second_pass:
            raise ValueError("cosine_centered: this is pass 1 (global mean); call next_pass() and stream again")
        m = self.moments
        m.check_nonempty(self._what())
        within = float(np.mean(m.m2 / m.counts))
        mu_bar = m.means.mean(axis=0)
        between = float(np.mean(np.sum((m.means - mu_bar) ** 2, axis=1)))
        total = within + between
        scale = within + float(np.mean(np.sum(m.means**2, axis=1)))
        if not total > 1e-12 * scale:
            raise UndefinedMetric(f"{self._what()}: all embeddings are identical (zero total distance); R² is undefined")
        return {"within": within, "between": between, "total": total, "r2": between / total}

    def result(self) -> float:
        """R² of Eq. 11 (Table E.1 variants)."""
        return self.parts()["r2"]

    def to_state(self) -> dict[str, Any]:
        return {
            "kind": "ClassSeparation",
            "num_classes": self.num_classes,
            "distance": self.distance,
            "name": self.name,
            "has_center": self.center is not None,
            "center": np.zeros(0) if self.center is None else self.center.copy(),
            "has_global": self.global_sum is not None,
            "global_sum": np.zeros(0) if self.global_sum is None else self.global_sum.copy(),
            "global_count": self.global_count,
            **self.moments.to_state("moments_"),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ClassSeparation":
        if str(state.get("kind")) != "ClassSeparation":
            raise ValueError(f"not a ClassSeparation state (kind={state.get('kind')!r})")
        acc = cls(int(state["num_classes"]), str(state["distance"]),
                  center=np.array(state["center"]) if bool(state["has_center"]) else None,
                  name=str(state["name"]))
        if bool(state["has_global"]):
            acc.global_sum = np.array(state["global_sum"], dtype=np.float64)
        acc.global_count = int(state["global_count"])
        acc.moments = ClassMoments.from_state(state, "moments_")
        return acc

    def _what(self) -> str:
        return self.name or "X"


def class_separation(X: Any, labels: Any, distance: str = "cosine", *,
                     num_classes: int | None = None, xp: Any = None) -> float:
    """R² class separation of embeddings X (n, ...) with integer ``labels`` (paper Eq. 11).

    Without ``num_classes`` the classes are the distinct labels present; with it, labels must lie
    in [0, num_classes) and every class must occur.
    """
    X = as_array(X)
    xp = array_namespace(X, xp=xp)
    y = host_labels(labels, X.shape[0], num_classes)
    if num_classes is None:
        _, y = np.unique(y, return_inverse=True)
        num_classes = int(y.max()) + 1 if y.size else 0
    if num_classes < 2:
        raise ValueError(f"class separation needs at least 2 classes, got {num_classes}")
    acc = ClassSeparation(num_classes, distance).update(X, y, xp=xp)
    if acc.needs_second_pass:
        acc = acc.next_pass().update(X, y, xp=xp)
    return acc.result()
