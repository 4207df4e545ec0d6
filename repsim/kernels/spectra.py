"""Spectra (Fig. E.2), angular visual hardness (Fig. E.1) and cosine-distance samples (Fig. E.3).

* Singular values of the centred activations X_c = X - 1 x̄ᵀ: the square roots of the eigenvalues
  of the smaller of X_c X_cᵀ (n × n Gram) and X_cᵀ X_c (p × p scatter), in one shot
  (:func:`activation_spectrum`) or streamed from a mergeable p × p scatter
  (:class:`ActivationSpectrum`, Chan et al. updates, :mod:`repsim.kernels._moments`).
* Singular values of the final-layer weights W (K × P) (:func:`weight_spectrum`) and of the class
  centroids, i.e. class means minus the mean of the class means (:func:`centroid_spectrum`;
  ``CollapseStats.centered_means()`` gives the same matrix when streaming).
* Angular visual hardness (Chen et al. 2020, paper ref. [12], App. Fig. E.1):
  AVH(x) = arccos(sim(x, w_y)) / Σ_k arccos(sim(x, w_k)) with w_k the rows of W (no bias).
* Within- and between-class cosine distances 1 - sim(x_i, x_j) of a bounded, seeded random sample
  of example pairs (Fig. E.3), see :func:`cosine_distance_samples` for the sampling scheme.

All outputs are float64 NumPy arrays (for plotting); the heavy products run in the inputs' namespace.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.kernels._moments import ClassMoments
from repsim.array_api import (array_namespace, asarray_like, check_finite, compute_dtype, flatten_examples,
                        host_labels, to_numpy, unit_rows)

__all__ = ["activation_spectrum", "ActivationSpectrum", "weight_spectrum", "centroid_spectrum",
           "angular_visual_hardness", "cosine_distance_samples"]


def _sqrt_eigs(S: Any, xp: Any) -> np.ndarray:
    """Square roots of the eigenvalues of a PSD matrix, descending, negatives from rounding -> 0."""
    ev = np.asarray(to_numpy(xp.linalg.eigvalsh(S)), dtype=np.float64)[::-1]
    return np.sqrt(np.clip(ev, 0.0, None))


def activation_spectrum(X: Any, *, xp: Any = None) -> np.ndarray:
    """Singular values (min(n, p) of them, descending) of the column-centred activations X (n, ...)."""
    xp = array_namespace(X, xp=xp)
    X = flatten_examples(X, xp, compute_dtype(xp, X))
    check_finite(X, xp)
    if X.shape[0] < 2:
        raise ValueError(f"activation spectrum needs n >= 2 examples, got {X.shape[0]}")
    Xc = X - xp.mean(X, axis=0, keepdims=True)
    T = xp.matrix_transpose
    S = Xc @ T(Xc) if X.shape[0] <= X.shape[1] else T(Xc) @ Xc
    return _sqrt_eigs(S, xp)


class ActivationSpectrum:
    """Streaming singular values of centred activations from the p × p scatter (same protocol)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.moments = ClassMoments(1, second="matrix")

    def update(self, X: Any, *, xp: Any = None) -> "ActivationSpectrum":
        xp = array_namespace(X, xp=xp)
        X = flatten_examples(X, xp, compute_dtype(xp, X), self.name or "X")
        deferred: list = []  # on an accelerator: checked with the batch's one copy to the host
        check_finite(X, xp, self.name or "X", deferred)
        self.moments.update(X, np.zeros(X.shape[0], dtype=np.int64), xp, deferred)
        return self

    def merge(self, other: "ActivationSpectrum") -> "ActivationSpectrum":
        self.moments.merge(other.moments)
        return self

    def result(self) -> np.ndarray:
        """Singular values (p of them, descending) of the centred activations seen so far."""
        if self.moments.n < 2:
            raise ValueError(f"{self.name or 'ActivationSpectrum'}: needs at least 2 examples")
        return _sqrt_eigs(self.moments.m2, np)

    def to_state(self) -> dict[str, Any]:
        return {"kind": "ActivationSpectrum", "name": self.name, **self.moments.to_state("moments_")}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ActivationSpectrum":
        if str(state.get("kind")) != "ActivationSpectrum":
            raise ValueError(f"not an ActivationSpectrum state (kind={state.get('kind')!r})")
        acc = cls(str(state["name"]))
        acc.moments = ClassMoments.from_state(state, "moments_")
        return acc


def weight_spectrum(W: Any) -> np.ndarray:
    """Singular values of the final-layer weight matrix W (K × P), descending."""
    W = np.asarray(to_numpy(W), dtype=np.float64)  # K × P is small: decompose on the host
    if W.ndim != 2:
        raise ValueError(f"W must be a (K, P) matrix, got shape {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("W contains NaN or infinite values")
    return np.linalg.svd(W, compute_uv=False)


def centroid_spectrum(H: Any, labels: Any, *, center: bool = True, xp: Any = None) -> np.ndarray:
    """Singular values of the class centroids of H (n, P) (every label present is a class).

    ``center=True`` subtracts the mean of the class means first (the M of Table E.2); the centred
    means have rank at most C − 1, so min(C − 1, P) values are returned (the C-th is zero but for
    rounding, ~1e-15, which a log axis would show as a value).
    """
    xp = array_namespace(H, xp=xp)
    H = flatten_examples(H, xp, compute_dtype(xp, H), "H")
    check_finite(H, xp, "H")
    y = host_labels(labels, H.shape[0], None)
    _, y = np.unique(y, return_inverse=True)
    m = ClassMoments(int(y.max()) + 1, second="trace")
    m.update(H, y, xp)
    if not center:
        return np.linalg.svd(m.means, compute_uv=False)
    return centered_means_spectrum(m.means - m.means.mean(axis=0))


def centered_means_spectrum(M: np.ndarray) -> np.ndarray:
    """Singular values of class means M (C, P) whose mean row was subtracted: the first min(C − 1, P)
    (the rest are structurally zero)."""
    return np.linalg.svd(M, compute_uv=False)[:max(1, min(M.shape[0] - 1, M.shape[1]))]


def angular_visual_hardness(X: Any, labels: Any, W: Any, *, xp: Any = None) -> np.ndarray:
    """AVH of each example (Chen et al. 2020): arccos(sim(x, w_y)) / Σ_k arccos(sim(x, w_k)).

    X (n, P) penultimate features, labels in [0, K), W (K, P) final-layer weights. Returns (n,).
    """
    xp = array_namespace(X, W, xp=xp)
    dt = compute_dtype(xp, X)
    X = flatten_examples(X, xp, dt, "X")
    W = flatten_examples(W, xp, dt, "W")
    check_finite(X, xp, "X")
    check_finite(W, xp, "W")
    if W.shape[1] != X.shape[1]:
        raise ValueError(f"W has {W.shape[1]} features, X has {X.shape[1]}")
    y = host_labels(labels, X.shape[0], W.shape[0])
    cos = unit_rows(X, xp, "X") @ xp.matrix_transpose(unit_rows(W, xp, "W"))  # (n, K)
    ang = xp.acos(xp.clip(cos, -1.0, 1.0))
    onehot = np.zeros((X.shape[0], W.shape[0]))
    onehot[np.arange(X.shape[0]), y] = 1.0
    own = xp.sum(ang * asarray_like(onehot, ang, xp, dtype=ang.dtype), axis=1)
    return np.asarray(to_numpy(own / xp.sum(ang, axis=1)), dtype=np.float64)


def cosine_distance_samples(X: Any, labels: Any, n_pairs: int = 10_000, *, seed: int = 0,
                            xp: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(within, between): cosine distances 1 - sim(x_i, x_j) of ``n_pairs`` sampled pairs each.

    Sampling (``numpy.random.default_rng(seed)``, i ≠ j always): a within-class pair draws i
    uniformly among examples whose class has at least two members, then j uniformly among the
    other members of i's class; a between-class pair draws i uniformly among all examples, then j
    uniformly among the examples of other classes. For balanced classes both are uniform over the
    respective ordered pairs. Memory and time are O(n_pairs · P), whatever n.
    """
    xp = array_namespace(X, xp=xp)
    X = flatten_examples(X, xp, compute_dtype(xp, X), "X")
    check_finite(X, xp, "X")
    y = host_labels(labels, X.shape[0], None)
    n = y.shape[0]
    rng = np.random.default_rng(seed)
    order = np.argsort(y, kind="stable")
    classes, start, size = np.unique(y[order], return_index=True, return_counts=True)
    if classes.size < 2:
        raise ValueError("cosine_distance_samples needs at least 2 classes")
    cls_of = np.searchsorted(classes, y)  # class position of every example
    pos_in_sorted = np.empty(n, dtype=np.int64)
    pos_in_sorted[order] = np.arange(n)

    eligible = np.flatnonzero(size[cls_of] >= 2)
    if eligible.size == 0:
        raise ValueError("no class has two examples; within-class distances are undefined")
    wi = eligible[rng.integers(0, eligible.size, n_pairs)]
    c = cls_of[wi]
    offset = pos_in_sorted[wi] - start[c]  # rank of i inside its class
    other = (offset + 1 + rng.integers(0, size[c] - 1)) % size[c]
    wj = order[start[c] + other]

    bi = rng.integers(0, n, n_pairs)
    c = cls_of[bi]
    r = rng.integers(0, n - size[c])
    bj = order[np.where(r < start[c], r, r + size[c])]

    U = unit_rows(X, xp, "X")

    def dist(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        a = xp.take(U, asarray_like(i, U, xp, dtype=xp.int64), axis=0)
        b = xp.take(U, asarray_like(j, U, xp, dtype=xp.int64), axis=0)
        return np.asarray(to_numpy(1.0 - xp.sum(a * b, axis=1)), dtype=np.float64)

    return dist(wi, wj), dist(bi, bj)
