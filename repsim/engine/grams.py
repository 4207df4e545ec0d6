"""Batch Grams of wide columns: a b × p batch reduced to its centred b × b Gram (all that linear HSIC
sees of it), and the precision it is formed in (:func:`gram_dtype`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim._xp import astype as fast_astype
from repsim._xp import gram_dtype
from repsim.kernels.cka import GRAM_SLAB, CentredGram, centre_rounded, centred_gram_slabs, check_gram, gram64

__all__ = ["REDUCE_FACTOR", "centred_gram", "gram_dtype"]

REDUCE_FACTOR = 4  # columns wider than this many times the batch are reduced to their b × b Gram


def centred_gram(x: Any, xp: Any, what: str = "X", dtype: Any = None) -> CentredGram:
    """The batch's centred Gram ``K_c = X_c X_cᵀ`` (b × b, float64), which is all that linear HSIC
    sees of a layer: b² numbers instead of b·p, handed to ``MinibatchCKA.update`` as a
    :class:`~repsim.kernels.cka.CentredGram`.

    ``dtype`` (default :func:`gram_dtype` of ``x``; the engine passes it for the column) is the
    precision of the products, with the rule of ``repsim.kernels.cka`` ("Error bound"): X is
    centred with float64 means and rounded once to ``dtype``, products are summed in ``dtype``
    over feature slabs of at most ``GRAM_SLAB`` and the slabs in float64; K_c is float64.
    NaN or infinite values make tr(K_c) non-finite: ``ValueError`` naming ``what``; so does a
    layer that is constant over the batch (tr(K_c) within the rounding of the mean,
    :func:`~repsim.kernels.cka.constant_tolerance`).
    """
    X = xp.reshape(x, (x.shape[0], -1))
    if dtype is None:
        dtype = gram_dtype(X.dtype, xp)
    if isinstance(X, np.ndarray) and X.shape[1] > 2 * GRAM_SLAB:
        K, mean_sq = centred_gram_slabs(X, dtype)
    else:
        fresh = X.dtype != dtype
        X = fast_astype(X, dtype, xp) if fresh else X
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported below, by name
            X, mean = centre_rounded(X, xp, dtype, fresh=fresh)
        K = gram64(X, X, xp)
        K = K if K.dtype == xp.float64 else fast_astype(K, xp.float64, xp)
        mean_sq = float(xp.sum(mean * mean))
        del X
    check_gram(K, xp, mean_sq, what)
    return CentredGram(K)
