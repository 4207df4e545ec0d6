"""The precision rule shared by both routes of all-pairs CKA (:mod:`repsim.kernels.hsic` on NumPy,
:mod:`repsim.kernels._cka_device` on an accelerator): the float32 slab of a Gram product, centring with
float64 means rounded once, the tolerance below which a layer counts as constant, and the
:class:`CenteredGram` a driver may hand in place of a layer's rows.  The error bound these give is
derived in :mod:`repsim.kernels.hsic`'s docstring ("Precision and error bound")."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.array_api import astype as _astype

__all__ = ["GRAM_SLAB", "CenteredGram", "center_rounded", "check_products", "constant_tolerance", "is_constant",
           "max_trace", "zero_constant"]

GRAM_SLAB = 2048  # features per float32 slab of a Gram product; the slabs are summed in float64


def center_rounded(X: Any, xp: Any, dt: Any, *, fresh: bool = False, out: Any = None) -> tuple[Any, Any]:
    """``(X - x̄, x̄)`` for X (n, p) with float64 column means x̄, returned as (1, p) float64.

    In float32 the mean is split into two float32 terms, x̄ = hi + lo + O(u²|x̄|) (hi = fl(x̄),
    lo = fl(x̄ - hi)), and X_c = fl(fl(X - hi) - lo): |X_c - (X - x̄)| <= 2u|X - x̄| + 2u²|x̄|
    elementwise (u = 2⁻²⁴), so the centred values are right to a few units of their own last place
    however far the mean lies from zero, and their column means are at most ~2u times their
    spread — no float64 temporary of X.  ``fresh``: X is a temporary that may be overwritten.
    ``out`` (NumPy only): an (n, p) ``dt`` buffer that receives the centred values (the same
    arithmetic; no new array).
    """
    n = X.shape[0]
    mean = xp.sum(X, axis=0, keepdims=True, dtype=xp.float64) / n
    if out is not None:
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN: reported by the caller
            if dt == xp.float64 or X.dtype == xp.float64:
                out[...] = X
                out -= _astype(mean, dt, xp)
            else:
                hi = _astype(mean, dt, xp)
                np.subtract(X, hi, out=out)
                out -= _astype(mean - _astype(hi, xp.float64, xp), dt, xp)
        return out, mean
    if dt == xp.float64 or X.dtype == xp.float64:
        Y = X if X.dtype == dt else _astype(X, dt, xp)
        if fresh or Y is not X:
            Y -= _astype(mean, dt, xp)
            return Y, mean
        return Y - _astype(mean, dt, xp), mean
    hi = _astype(mean, dt, xp)
    lo = _astype(mean - _astype(hi, xp.float64, xp), dt, xp)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN: reported by the caller
        if fresh:
            X -= hi
        else:
            X = X - hi
        X -= lo
    return X, mean


_F64_MAX = float(np.finfo(np.float64).max)


def max_trace(n: int) -> float:
    """The largest trace tr K = Σ_i ‖x_i − x̄‖² of a layer's centred Gram over ``n`` rows whose HSIC
    products float64 can hold — the one magnitude rule of every CKA route.

    Every HSIC term is bounded by tr K · tr L (K, L centred, positive semi-definite): ⟨K, L⟩ ≤
    ‖K‖_F ‖L‖_F ≤ tr K tr L; the debiased estimator's largest intermediate, 1ᵀK̃L̃1 with K̃ = K less
    its diagonal (‖K̃‖₂ ≤ 2 tr K, ‖K̃1‖ ≤ 2√n tr K), is at most 4n tr K tr L before its division by
    n − 2. So tr K ≤ √(max₆₄ / (16 n)) keeps every product finite with a factor 4 to spare; beyond
    it an HSIC may overflow to inf or NaN, which downstream reads as a constant (undefined) layer."""
    return math.sqrt(_F64_MAX / (16 * max(int(n), 1)))


class ProductOverflow(ValueError):
    """A layer whose values are too large for the products CKA forms (a refusal naming overflow)."""


def check_products(what: str, trace: float, n: int, largest_row: float | None = None, dtype: Any = None) -> None:
    """Refuse, naming ``what``, a layer whose centred Gram over ``n`` rows has a non-finite trace
    (NaN or infinity in the layer, or squares that overflowed), a trace beyond :func:`max_trace`
    (its HSIC products overflow float64), or a row whose squared norm ``largest_row`` does not fit
    the Gram's ``dtype`` (float32 Gram entries overflow: compute in float64)."""
    if not math.isfinite(trace):
        raise ValueError(f"{what} contains NaN or infinite values, or values so large that their products "
                         "overflow (rescale the layer: CKA does not change)")
    limit = max_trace(n)
    if trace > limit:
        raise ProductOverflow(
            f"{what}: overflow: its centred values' sum of squares over {n} rows is {trace:.3g}, beyond the "
            f"{limit:.3g} whose HSIC products float64 can hold; rescale the layer (CKA does not change)")
    name = _float_name(dtype)
    if largest_row is not None and name in ("float16", "float32") and largest_row > float(np.finfo(name).max) / 2:
        raise ProductOverflow(
            f"{what}: overflow: a row's squared norm ({largest_row:.3g}) does not fit {name} Gram entries; "
            "rescale the layer (CKA does not change) or compute in float64 (compute_dtype='float64')")


def _float_name(dtype: Any) -> str:
    """The NumPy name of a (NumPy or another namespace's) float dtype, ``float32``; "" for None."""
    text = "" if dtype is None else str(dtype)
    return next((name for name in ("float16", "float32", "float64") if name in text), "")


def constant_tolerance(n: int, mean_sq: float) -> float:
    """A layer whose centred rows have Σ_i ‖x_i - x̄‖² at most this is constant to working
    precision: the float64 column means of n rows are exact to about n·eps₆₄·|x̄|, so
    (4 n eps₆₄)² · n · ‖x̄‖² is the spread that rounding alone could leave."""
    return (4 * n * float(np.finfo(np.float64).eps)) ** 2 * n * mean_sq


class CenteredGram:
    """A batch's centred Gram matrix ``K_c = X_c X_cᵀ`` (b × b), given in place of its rows X.

    Linear HSIC (biased or debiased) sees a layer only through ``K_c``, so a driver that has formed
    it already (the out-of-core engine does, for layers with p ≫ b) hands it to :func:`batch_hsic` /
    :meth:`MinibatchCKA.update` in this wrapper instead of the b × p features: the result is the
    same (to rounding) as for X, and no b × b × p product is repeated.  ``K`` must be symmetric with
    rows summing to zero (column-centred features); it is not re-centred.  ``mean_sq`` (optional,
    a float or a 0-d array of K's namespace): ‖x̄‖² of the features' column means, for the check
    that the layer is not constant (:func:`constant_tolerance`; without it, a trace <= 0).
    """

    __slots__ = ("K", "mean_sq")

    def __init__(self, K: Any, mean_sq: Any = None):
        if K.ndim != 2 or K.shape[0] != K.shape[1]:
            raise ValueError(f"CenteredGram needs a square matrix, got shape {K.shape}")
        self.K = K
        self.mean_sq = mean_sq

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.K.shape)

    @property
    def ndim(self) -> int:
        return 2


def zero_constant(H: np.ndarray, constant: Sequence[bool]) -> np.ndarray:
    """One batch's (L, L) HSIC, symmetrised exactly (GEMM rounding may differ by an ulp), with the
    rows and columns of the layers that are ``constant`` over the batch set to 0: HSIC is bilinear in
    the Grams, so that is the batch with those Grams exactly zero, i.e. with the rounding noise
    of a constant layer's centring removed."""
    out = (H + H.T) / 2
    idx = [l_ for l_, c in enumerate(constant) if c]
    out[idx, :] = 0.0
    out[:, idx] = 0.0
    return out


def is_constant(what: str, trace: float, mean_sq: float, n: int) -> bool:
    """The checks of a layer from its centred Gram's trace tr K and ‖x̄‖² (0 when unknown): NaN or
    infinity anywhere in the layer makes tr K non-finite, a ``ValueError`` naming ``what``; returns
    whether the layer is constant over the batch (tr K within the rounding of the mean,
    :func:`constant_tolerance`)."""
    check_products(what, trace, n)
    return trace <= constant_tolerance(n, mean_sq)
