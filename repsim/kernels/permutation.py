"""Permutation nulls of similarity measures: the draws, the calibration rule and the batched null
products (array API: NumPy, CuPy, array-api-strict).

**Calibration** (Gröger, Wen & Brbić 2026, arXiv 2602.14486, Algorithms 1-2; their package
``calibrated-similarity`` 0.1.1): for an observed score s and K null scores s₁..s_K (the measure on the
same columns with the rows of one side permuted),

    p = (1 + #{k : s_k ≥ s}) / (K + 1),
    τ = the ⌈(1 − α)(K + 1)⌉-th smallest of {s, s₁, ..., s_K},
    calibrated = clip((s − τ) / (s_max − τ), 0, 1)   (s_max the measure's upper bound),
                 max(s − τ, 0)                        (a measure without an upper bound).

p is a valid permutation p-value (P(p ≤ u) ≤ u under exchangeability); the smallest it can be is
1/(K + 1), so K must reach 1/α − 1 for anything to be significant at α (:func:`check_null`).

**Draws** (:func:`permutations`): K permutations of n rows from ``numpy.random.default_rng(key)``
(host NumPy, so NumPy, CuPy and a resumed run draw the same ones).  A permutation π applies to a
column Y as Y' = Y[π] (row i of Y' is row π(i) of Y, the reference tool's ``Y[pi]``); its Gram
becomes K' = K[π][:, π] and its neighbour lists N'(i) = π⁻¹(N(π(i))).

**Null products** (:func:`gram_null_products`): HSIC is bilinear in the two (centred) Grams, so the
null of every pair for draw k is ⟨A_i, P_k B_j P_kᵀ⟩ — one gather of each permuted Gram's upper
triangle and one matrix product with the row columns' triangles, batched over draws.  The diagonal
enters separately (zero for U-centred Grams, Song et al. 2012).

**Mutual k-NN** (:func:`knn_null_overlaps`): the permuted lists are an index map of the stored ones,
so a draw costs O(n k log(n k)) (one sorted search), not a new neighbour search.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, on_device

__all__ = ["check_null", "permutations", "calibrate", "order_index", "gram_null_products", "triangle",
           "knn_null_overlaps", "GATHER_BYTES"]

GATHER_BYTES = 256 << 20  # permuted Gram triangles gathered at once (draws × columns × n(n−1)/2 float64)


def order_index(permutations: int, alpha: float) -> int:
    """The 0-based position of τ among the sorted K + 1 scores: ⌈(1 − α)(K + 1)⌉ − 1."""
    return int(math.ceil((1.0 - float(alpha)) * (int(permutations) + 1))) - 1


def check_null(permutations: Any, alpha: Any, null: str = "permutation") -> None:
    """Refuse (``ValueError``, one line) a null that cannot answer: K < 1, α outside (0, 1), an unknown
    kind, or K too small for α (the smallest p-value 1/(K + 1) above α: τ would always be the largest
    score and nothing could be significant)."""
    if null not in ("permutation", "analytic"):
        raise ValueError(f"null must be 'permutation' or 'analytic', got {null!r}")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if null == "analytic":
        return
    if isinstance(permutations, bool) or int(permutations) != permutations or int(permutations) < 1:
        raise ValueError(f"permutations must be an integer >= 1, got {permutations}")
    K = int(permutations)
    if 1.0 / (K + 1) > float(alpha):
        need = int(math.ceil(1.0 / float(alpha) - 1.0 - 1e-12))
        raise ValueError(f"{K} permutation(s) cannot reach alpha = {alpha}: the smallest p-value is 1/(K + 1) = "
                         f"{1.0 / (K + 1):.3g}, so nothing could be significant; use at least {need} permutations")


def permutations(K: int, n: int, key: Sequence[int] | int) -> np.ndarray:
    """(K, n) int64: K uniform permutations of ``range(n)`` from ``numpy.random.default_rng(key)``."""
    rng = np.random.default_rng(key)
    return np.argsort(rng.random((int(K), int(n))), axis=1, kind="stable").astype(np.int64)


def calibrate(observed: Any, nulls: Any, alpha: float, smax: float | None = 1.0, *,
              xp: Any = None) -> tuple[Any, Any, Any]:
    """(calibrated, p, τ), each shaped like ``observed``, from ``nulls`` (K, ...) (module docstring;
    ``smax`` None or infinite: max(s − τ, 0)).  NaN where the observed score or any null is NaN (an
    undefined pair).  The reference tool clamps s_max − τ at 1e-12; so does this."""
    xp = array_namespace(observed, nulls, xp=xp)
    obs = xp.asarray(observed)
    nul = xp.asarray(nulls)
    K = nul.shape[0]
    both = xp.concat([obs[None, ...], nul], axis=0)
    tau = xp.sort(both, axis=0)[order_index(K, alpha), ...]
    count = xp.sum(xp.astype(nul >= obs[None, ...], xp.float64), axis=0)
    p = (1.0 + count) / (K + 1)
    if smax is None or not math.isfinite(float(smax)):
        cal = xp.maximum(obs - tau, 0.0)
    else:
        cal = xp.clip((obs - tau) / xp.maximum(float(smax) - tau, 1e-12), 0.0, 1.0)
    bad = xp.isnan(obs) | xp.any(xp.isnan(nul), axis=0)
    nan = xp.asarray(float("nan"), dtype=xp.float64)
    return xp.where(bad, nan, cal), xp.where(bad, nan, p), xp.where(bad, nan, tau)


def triangle(n: int, xp: Any = np, device: Any = None) -> tuple[Any, Any]:
    """The strict upper triangle's (rows, columns) of an n × n matrix, int64 on ``device``."""
    i, j = np.triu_indices(int(n), 1)
    return (on_device(xp.asarray, i.astype(np.int64), device=device),
            on_device(xp.asarray, j.astype(np.int64), device=device))


def gram_null_products(rows: Any, cols: Any, perms: Any, *, diagonal: bool = True, xp: Any = None,
                       gather_bytes: int = GATHER_BYTES) -> Any:
    """(K, L_r, L_c) float64: ⟨A_i, P_k B_j P_kᵀ⟩ = Σ_ab A_i[a, b] B_j[π_k(a), π_k(b)] for the symmetric
    n × n matrices ``rows`` (L_r, n, n) and ``cols`` (L_c, n, n) and the permutations ``perms`` (K, n).

    As 2 Σ_{a<b} (triangles) + Σ_a (diagonals): per chunk of draws one gather of the permuted
    triangles of every B_j and one product with the triangles of every A_i.  ``diagonal=False``
    skips the diagonal term (U-centred Grams have a zero diagonal)."""
    xp = array_namespace(rows, cols, xp=xp)
    dev = getattr(rows, "device", None)
    Lr, n = rows.shape[0], rows.shape[1]
    Lc = cols.shape[0]
    P = on_device(xp.asarray, np.asarray(perms, dtype=np.int64), device=dev) if isinstance(perms, np.ndarray) else perms
    K = P.shape[0]
    ia, ib = triangle(n, xp, dev)
    flat_r = xp.reshape(rows, (Lr, n * n))
    flat_c = xp.reshape(cols, (Lc, n * n))
    At = xp.take(flat_r, ia * n + ib, axis=1)  # (L_r, m)
    m = int(At.shape[1])
    if diagonal:
        d = on_device(xp.arange, n, dtype=xp.int64, device=dev)
        Ad = xp.take(flat_r, d * (n + 1), axis=1)  # (L_r, n)
    out = []
    step = max(1, int(gather_bytes // max(1, 8 * Lc * max(m, 1))))
    for k0 in range(0, K, step):
        Pk = P[k0:min(K, k0 + step), :]
        c = Pk.shape[0]
        pa = xp.take(Pk, ia, axis=1)  # (c, m): π(a)
        pb = xp.take(Pk, ib, axis=1)
        idx = xp.reshape(pa * n + pb, (c * m,))
        Bt = xp.reshape(xp.take(flat_c, idx, axis=1), (Lc * c, m))  # rows (column j, draw k)
        prod = 2.0 * (At @ xp.matrix_transpose(Bt))  # (L_r, L_c·c)
        if diagonal:
            Bd = xp.reshape(xp.take(flat_c, xp.reshape(Pk * (n + 1), (c * n,)), axis=1), (Lc * c, n))
            prod = prod + Ad @ xp.matrix_transpose(Bd)
        out.append(xp.moveaxis(xp.reshape(prod, (Lr, Lc, c)), 2, 0))
    return xp.concat(out, axis=0) if len(out) > 1 else out[0]


def knn_null_overlaps(rows: Sequence[Any], cols: Sequence[Any], perms: Any, *, xp: Any = None) -> Any:
    """(K, L_r, L_c) float64: the mutual k-NN overlap (1/(n k)) Σ_i |N_a(i) ∩ N'_b(i)| of every row
    column's neighbour lists ``rows[r]`` (n, k) with every column's lists ``cols[c]`` permuted by each
    π_k: N'_b(i) = π⁻¹(N_b(π(i))), an index map (O(n k) per draw), then one sorted search of its
    (row, neighbour) keys in the row column's sorted keys."""
    xp = array_namespace(rows[0], xp=xp)
    dev = getattr(rows[0], "device", None)
    P = on_device(xp.asarray, np.asarray(perms, dtype=np.int64), device=dev) if isinstance(perms, np.ndarray) else perms
    K, n = P.shape
    k = rows[0].shape[1]
    ar = on_device(xp.arange, n, dtype=xp.int64, device=dev)
    # π⁻¹ by scattering (array API has no put): the inverse of π is argsort(π)
    inv = xp.argsort(P, axis=1)
    base = xp.reshape(ar * n, (1, n, 1))
    offsets = xp.reshape(on_device(xp.arange, K, dtype=xp.int64, device=dev), (K, 1)) * n
    row_keys = [xp.reshape(xp.sort(xp.reshape(ar * n, (n, 1)) + xp.astype(a, xp.int64), axis=1), (n * k,))
                for a in rows]
    out = []
    for b in cols:
        b = xp.astype(b, xp.int64)
        moved = xp.take(b, xp.reshape(P, (K * n,)), axis=0)  # (K n, k): N_b(π(i))
        moved = xp.reshape(moved, (K, n * k))
        mapped = xp.take(xp.reshape(inv, (K * n,)), xp.reshape(offsets + moved, (K * n * k,)), axis=0)  # π⁻¹(...)
        keys = xp.reshape(base + xp.reshape(mapped, (K, n, k)), (K * n * k,))
        col = []
        for rk in row_keys:
            pos = xp.searchsorted(rk, keys)
            pos = xp.clip(pos, 0, n * k - 1)
            hit = xp.take(rk, pos, axis=0) == keys
            col.append(xp.sum(xp.reshape(xp.astype(hit, xp.float64), (K, n * k)), axis=1) / (n * k))
        out.append(xp.stack(col, axis=1))  # (K, L_r)
    return xp.stack(out, axis=2)
