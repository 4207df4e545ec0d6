"""Batch Grams of wide columns: a b × p batch reduced to its centred b × b Gram (all that linear HSIC
sees of it), and the precision it is formed in (:func:`gram_dtype`)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from repsim._xp import astype as fast_astype
from repsim._xp import diagonal, is_gpu_namespace
from repsim.kernels.cka import CentredGram


REDUCE_FACTOR = 4  # columns wider than this many times the batch are reduced to their b × b Gram


def centred_gram(x: Any, xp: Any, what: str = "X", dtype: Any = None) -> CentredGram:
    """The batch's centred Gram ``K_c = X_c X_cᵀ`` (b × b, float64), which is all that linear HSIC
    sees of a layer: b² numbers instead of b·p, handed to ``MinibatchCKA.update`` as a
    :class:`~repsim.kernels.cka.CentredGram`.

    X_c (the batch, column-centred) and the product are formed in ``dtype`` (default: float64 on
    the CPU, float32 on a GPU; the engine passes :func:`gram_dtype` of the column); K_c is kept in
    float64.  NaN or infinite values make tr(K_c) non-finite: ``ValueError`` naming ``what``; so
    does a layer that is constant over the batch (tr(K_c) within the rounding of the mean, the
    rule of ``repsim.kernels.cka``'s feature path).
    """
    if dtype is None:
        dtype = xp.float32 if is_gpu_namespace(xp) else xp.float64
    X = xp.reshape(x, (x.shape[0], -1))
    if isinstance(X, np.ndarray) and X.shape[1] > 2 * GRAM_COLUMN_BLOCK:
        K, mean_sq = _centred_gram_blocked(X, np.dtype(dtype))
    else:
        X = fast_astype(X, dtype, xp) if X.dtype != dtype else X - 0  # a fresh array: centred in place
        mean = xp.mean(X, axis=0, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported below, by name
            X -= mean
        K = fast_astype(X @ X.T, xp.float64, xp)  # (X.T: CuPy <= 13 lacks matrix_transpose)
        mean_sq = float(xp.sum(mean * mean))
        del X
    b = K.shape[0]
    tr = float(xp.sum(diagonal(K, xp)))
    if not math.isfinite(tr):
        raise ValueError(f"{what} contains NaN or infinite values")
    tol = (4 * b * float(xp.finfo(dtype).eps)) ** 2 * b * mean_sq
    if tr <= tol:
        raise ValueError(f"{what} is constant over the examples (zero variance): CKA is undefined")
    return CentredGram(K)


GRAM_COLUMN_BLOCK = 2048  # features per slab of the blocked host Gram


def _centred_gram_blocked(X: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, float]:
    """K_c = Σ_slabs X_c[:, s] X_c[:, s]ᵀ over slabs of ``GRAM_COLUMN_BLOCK`` features (NumPy).

    Centring is per feature, so each slab is cast, centred and multiplied while it sits in cache
    (b × 2048 float32 = 2 MiB at b = 256) instead of three passes over the whole b × p batch in
    memory: ~20 % less CPU per wide column on the CI box.  Returns (K_c in float64, ‖mean‖²).
    """
    b, p = X.shape
    K = np.zeros((b, b), dtype=dtype)
    mean_sq = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported by the caller
        for s in range(0, p, GRAM_COLUMN_BLOCK):
            slab = X[:, s:s + GRAM_COLUMN_BLOCK]
            S = fast_astype(slab, dtype, np) if slab.dtype != dtype else np.array(slab, dtype=dtype)
            m = S.mean(axis=0, keepdims=True)
            S -= m
            K += S @ S.T
            mean_sq += float(np.sum(m * m, dtype=np.float64))
    return K.astype(np.float64), mean_sq


def gram_dtype(stored: str, xp: Any, requested: str | None = None) -> Any:
    """Precision of a wide column's batch Gram (docs/architecture.md "Numerics").

    ``requested`` ("float32" | "float64") wins.  Otherwise float32 for columns stored in float16
    (every product of two float16 values is exact in float32; only the sums round, ~√p·2⁻²⁴
    relative, far below the 2⁻¹¹ of the stored values, and float32 GEMMs run at twice the rate
    and half the memory traffic of float64), and on a GPU for every column not stored in float64;
    float64 for float32/float64 columns on the CPU.  The b × b Grams are then kept and summed in
    float64 either way.
    """
    if requested is not None:
        if requested not in ("float32", "float64"):
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {requested!r}")
        return getattr(xp, requested)
    size = np.dtype(stored).itemsize
    if size <= 2 or (is_gpu_namespace(xp) and size < 8):
        return xp.float32
    return xp.float64
