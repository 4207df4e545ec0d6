"""The analytic permutation null of linear CKA: exact permutation moments and Pearson type III p-values.

For symmetric n × n matrices A, B whose rows sum to zero (centred Grams: the formulas assume it) and π uniform over the n! permutations, the statistic
T = tr(A P B Pᵀ) = Σ_ab A_ab B_π(a)π(b) has first three moments that depend on each matrix only through
eight invariants (:func:`invariants`): T = tr A, T2 = Σ A², S2 = Σ diag(A)², T3 = tr(A³),
S3 = Σ diag(A)³, U = Σ A∘A∘A, R = diag(A)·diag(A²), B = diag(A)ᵀ A diag(A) (Kazi-Aoual, Hitier,
Sabatier & Lebreton 1995, Comput. Stat. Data Anal. 20:643-656, "Refined approximations to permutation
tests for multivariate inference"; in the sums-over-distinct-indices form of Bilodeau & Guetsop Nangue
2017).  Biased linear CKA is the RV coefficient (Escoufier 1973): T with A, B the double-centred Grams,
over √(tr A² tr B²); debiased CKA is T with the U-centred Grams (Song et al. 2012), whose diagonal is
zero — its null mean is then exactly 0 and its variance 2/(n(n − 3)) whatever the data.

p-values (:func:`pearson3_calibration`): the standardised statistic against a Pearson type III
distribution with the exact mean, variance and skewness (Kazi-Aoual et al.'s approximation, as in
FactoMineR's ``coeffRV``); τ its (1 − α) quantile.  On the minibatch route the batches are permuted
independently, so the cumulants of Σ_B T_B are sums of the batches' (:class:`MinibatchAnalytic`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, diagonal, to_numpy
from repsim.kernels._gram import is_numpy
from repsim.kernels._precision import CenteredGram

__all__ = ["invariants", "permutation_moments", "pearson3_calibration", "MinibatchAnalytic"]

NAMES = ("T", "T2", "S2", "T3", "S3", "U", "R", "B")


def invariants(A: Any, *, xp: Any = None, scratch: Any = None) -> np.ndarray:
    """(L, 8) float64 host array: the eight invariants of each symmetric matrix of ``A`` (L, n, n)
    (module docstring).  One O(n³) product per matrix, A Aᵀ = A² (a symmetric rank-k update on
    NumPy: half a GEMM), for tr(A³) = Σ A²∘A; the rest is O(n²): diag(A²) is the row sums of A∘A
    (A symmetric), so R = diag(A)·rowsum(A∘A), T2 = Σ A∘A and U = ⟨A∘A, A⟩ share one elementwise
    square, and B = diag(A)ᵀ (A diag(A)) is a matrix-vector product.  The sums are float64 (A's
    dtype: callers pass float64).  ``scratch``: two n × n float64 NumPy buffers for A∘A and A²
    (reused from call to call: no new n × n arrays)."""
    xp = array_namespace(A, xp=xp)
    rows = []
    for l_ in range(A.shape[0]):
        M = A[l_, ...]
        d = diagonal(M, xp)
        if scratch is not None and is_numpy(xp):
            sq = np.multiply(M, M, out=scratch[0])
            MM = np.matmul(M, M.T, out=scratch[1])
        else:
            sq = M * M
            MM = M @ xp.matrix_transpose(M)  # A² (A symmetric)
        rowsq = xp.sum(sq, axis=1)  # diag(A²)
        vals = [xp.sum(d), xp.sum(rowsq), xp.sum(d * d), _inner(MM, M, xp), xp.sum(d * d * d), _inner(sq, M, xp),
                xp.sum(d * rowsq), xp.sum(d * (M @ d))]
        del sq, MM
        rows.append(xp.stack([xp.asarray(v, dtype=xp.float64) for v in vals]))
    if not rows:
        return np.empty((0, 8))
    return np.asarray(to_numpy(xp.stack(rows)), dtype=np.float64).reshape(-1, 8)  # one transfer


def _inner(a: Any, b: Any, xp: Any) -> Any:
    """Σ a∘b of two same-shaped arrays (a BLAS dot on NumPy: no temporary)."""
    if is_numpy(xp):
        return np.vdot(a, b)
    return xp.sum(a * b)


def permutation_moments(a: np.ndarray, b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, variance, third central moment), each (L_a, L_b), of T = tr(A P B Pᵀ) over uniform
    permutations, for the invariants ``a`` (L_a, 8) and ``b`` (L_b, 8) of symmetric n × n matrices with
    zero row sums (tests/test_permutation_null.py checks them against all 7! permutations)."""
    if n < 6:
        raise ValueError(f"the exact permutation moments need n >= 6 examples, got {n}")
    T, T2, S2, T3, S3, U, R, B = (a[:, k] for k in range(8))
    t, t2, s2, t3, s3, u, r, bb = (b[:, k] for k in range(8))

    def P(f: Any, g: Any) -> np.ndarray:  # the outer product of a per-matrix term with the same term of B
        return np.multiply.outer(f, g)

    f1 = n
    f2 = n * (n - 1)
    f3 = f2 * (n - 2)
    f4 = f3 * (n - 3)
    f5 = f4 * (n - 4)
    f6 = f5 * (n - 5)
    m1 = P(T, t) / f1 + P(-T, -t) / f2
    m2 = (P(S2, s2) / f1
          + (P(T ** 2 - S2, t ** 2 - s2) + 2 * P(T2 - S2, t2 - s2) + 4 * P(-S2, -s2)) / f2
          + (4 * P(2 * S2 - T2, 2 * s2 - t2) + 2 * P(2 * S2 - T ** 2, 2 * s2 - t ** 2)) / f3
          + P(2 * T2 - 6 * S2 + T ** 2, 2 * t2 - 6 * s2 + t ** 2) / f4)
    sp1 = P(S3, s3) / f1
    sp2 = (4 * P(-S3 + U, -s3 + u) + 3 * P(T * S2 - S3, t * s2 - s3) + 6 * P(-S3, -s3)
           + 12 * P(-S3 + R, -s3 + r) + 6 * P(-S3 + B, -s3 + bb)) / f2
    sp3 = (3 * P(-T * S2 + 2 * S3, -t * s2 + 2 * s3) + P(T ** 3 - 3 * T * S2 + 2 * S3, t ** 3 - 3 * t * s2 + 2 * s3)
           + 12 * P(-T * S2 + 2 * S3 - B, -t * s2 + 2 * s3 - bb) + 12 * P(2 * S3 - R, 2 * s3 - r)
           + 24 * P(2 * S3 - R - B, 2 * s3 - r - bb) + 6 * P(T * (T2 - S2) + 2 * S3 - 2 * R, t * (t2 - s2) + 2 * s3 - 2 * r)
           + 24 * P(2 * S3 - U - R, 2 * s3 - u - r) + 8 * P(T3 + 2 * S3 - 3 * R, t3 + 2 * s3 - 3 * r)) / f3
    sp4 = (12 * P(T * S2 - 6 * S3 + 2 * R + 2 * B, t * s2 - 6 * s3 + 2 * r + 2 * bb)
           + 6 * P(T * (-T2 + S2) - 6 * S3 + 2 * U + 4 * R, t * (-t2 + s2) - 6 * s3 + 2 * u + 4 * r)
           + 3 * P(-T ** 3 + 5 * T * S2 - 6 * S3 + 2 * B, -t ** 3 + 5 * t * s2 - 6 * s3 + 2 * bb)
           + 12 * P(T * (-T2 + 2 * S2) - 6 * S3 + 3 * R + 2 * B, t * (-t2 + 2 * s2) - 6 * s3 + 3 * r + 2 * bb)
           + 8 * P(-6 * S3 + 2 * U + 3 * R, -6 * s3 + 2 * u + 3 * r)
           + 24 * P(-T3 - 6 * S3 + U + 5 * R + B, -t3 - 6 * s3 + u + 5 * r + bb)) / f4
    sp5 = (3 * P(T ** 3 + 2 * T * (T2 - 5 * S2) + 24 * S3 - 8 * R - 8 * B,
                 t ** 3 + 2 * t * (t2 - 5 * s2) + 24 * s3 - 8 * r - 8 * bb)
           + 12 * P(T * (T2 - 2 * S2) + 2 * T3 + 24 * S3 - 4 * U - 16 * R - 4 * B,
                    t * (t2 - 2 * s2) + 2 * t3 + 24 * s3 - 4 * u - 16 * r - 4 * bb)) / f5
    sp6 = P(-T ** 3 - 6 * T * (T2 - 3 * S2) - 8 * T3 - 120 * S3 + 16 * U + 72 * R + 24 * B,
            -t ** 3 - 6 * t * (t2 - 3 * s2) - 8 * t3 - 120 * s3 + 16 * u + 72 * r + 24 * bb) / f6
    m3 = sp1 + sp2 + sp3 + sp4 + sp5 + sp6
    var = m2 - m1 ** 2
    mu3 = m3 - 3 * var * m1 - m1 ** 3
    return m1, np.maximum(var, 0.0), mu3


def pearson3_calibration(observed: np.ndarray, mean: np.ndarray, var: np.ndarray, mu3: np.ndarray, alpha: float,
                         smax: float | None = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(calibrated, p, τ) from the exact null moments: p = P(X ≥ s) and τ the (1 − α) quantile of the
    Pearson type III X with that mean, variance and skewness (a zero-variance null: p = 1 at or below its
    mean, 0 above, τ the mean); the calibrated score as :func:`repsim.kernels.permutation.calibrate`."""
    from scipy.stats import pearson3

    obs = np.asarray(observed, dtype=np.float64)
    sd = np.sqrt(var)
    with np.errstate(invalid="ignore", divide="ignore"):
        skew = np.where(sd > 0, mu3 / np.where(sd > 0, sd, 1.0) ** 3, 0.0)
        dist = pearson3(skew, loc=mean, scale=np.where(sd > 0, sd, 1.0))
        p = np.where(sd > 0, dist.sf(obs), np.where(obs > mean, 0.0, 1.0))
        tau = np.where(sd > 0, dist.ppf(1.0 - float(alpha)), mean)
        if smax is None or not math.isfinite(float(smax)):
            cal = np.maximum(obs - tau, 0.0)
        else:
            cal = np.clip((obs - tau) / np.maximum(float(smax) - tau, 1e-12), 0.0, 1.0)
    bad = ~np.isfinite(obs) | ~np.isfinite(mean)
    return np.where(bad, np.nan, cal), np.where(bad, np.nan, p), np.where(bad, np.nan, tau)


class MinibatchAnalytic:
    """Per-batch exact permutation cumulants of minibatch CKA's HSIC sums, summed over batches (the
    batches are permuted independently): observed sums (L, L) and the null's mean, variance and third
    central moment (L, L each) of Σ_B h_B(i, j)."""

    def __init__(self, n_layers: int, *, debiased: bool = True, names: Sequence[str] | None = None,
                 compute_dtype: str | None = None) -> None:
        self.n_layers = int(n_layers)
        self.compute_dtype = compute_dtype
        self.debiased = bool(debiased)
        self.names = [str(s) for s in names] if names is not None else [f"layer {i}" for i in range(self.n_layers)]
        L = self.n_layers
        self.obs = np.zeros((L, L))
        self.mean = np.zeros((L, L))
        self.var = np.zeros((L, L))
        self.mu3 = np.zeros((L, L))
        self.n_batches = 0
        self._buffers: np.ndarray | None = None  # NumPy: (L + 2, b, b) float64, reused by every update

    def update(self, batch: Sequence[Any], key: Sequence[int] = ()) -> "MinibatchAnalytic":
        from repsim.kernels.minibatch_null import MinibatchNull

        first = batch[0].K if isinstance(batch[0], CenteredGram) else batch[0]
        xp = array_namespace(first)
        shaper = MinibatchNull(self.n_layers, [0] * self.n_layers, 1, debiased=self.debiased, names=self.names,
                               compute_dtype=self.compute_dtype)
        L, b = self.n_layers, first.shape[0]
        if is_numpy(xp):  # the columns' matrices and the products' scratch in buffers kept from batch to batch
            if self._buffers is None or self._buffers.shape[1] != b:
                self._buffers = np.empty((L + 2, b, b))
            A = self._buffers[:L]
            for l_, (x, name) in enumerate(zip(batch, self.names)):
                shaper._centered(x, name, xp, out=A[l_])
            scratch = self._buffers[L:]
        else:
            A = xp.stack([shaper._centered(x, name, xp) for x, name in zip(batch, self.names)])
            scratch = None
        return self.add_batch(A, invariants(A, xp=xp, scratch=scratch), xp)

    def add_batch(self, A: Any, inv: Any, xp: Any) -> "MinibatchAnalytic":
        """Add one batch: the observed HSIC products of its (L, b, b) centred matrices ``A`` and the
        permutation moments from their invariants ``inv`` (:func:`invariants`)."""
        L, b = A.shape[0], A.shape[1]
        flat = xp.reshape(A, (L, b * b))
        obs = to_numpy(flat @ xp.matrix_transpose(flat))
        m, v, t = permutation_moments(inv, inv, b)
        self.obs += (obs + obs.T) / 2
        self.mean += m
        self.var += v
        self.mu3 += t
        self.n_batches += 1
        return self

    def merge(self, other: "MinibatchAnalytic") -> "MinibatchAnalytic":
        for k in ("obs", "mean", "var", "mu3"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.n_batches += other.n_batches
        return self

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(observed CKA, null mean, null variance, null third central moment), each (L, L), of CKA."""
        d = np.diag(self.obs)
        with np.errstate(invalid="ignore", divide="ignore"):
            root = np.sqrt(np.where(d > 0, d, np.nan))
            norm = np.outer(root, root)
            return self.obs / norm, self.mean / norm, self.var / norm ** 2, self.mu3 / norm ** 3

    def to_state(self) -> dict[str, Any]:
        return {"kind": "MinibatchAnalytic", "n_layers": self.n_layers, "debiased": self.debiased,
                "names": np.asarray(self.names, dtype=np.str_), "obs": self.obs.copy(), "mean": self.mean.copy(),
                "var": self.var.copy(), "mu3": self.mu3.copy(), "n_batches": self.n_batches,
                "compute_dtype": self.compute_dtype or ""}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "MinibatchAnalytic":
        acc = cls(int(state["n_layers"]), debiased=bool(state["debiased"]),
                  names=[str(s) for s in np.asarray(state["names"]).reshape(-1)],
                  compute_dtype=str(state.get("compute_dtype", "")) or None)
        for k in ("obs", "mean", "var", "mu3"):
            setattr(acc, k, np.array(state[k], dtype=np.float64))
        acc.n_batches = int(state["n_batches"])
        return acc
