"""All-pairs HSIC of one batch, shaped for an accelerator: a few large operations, one host transfer.

The route :func:`repsim.kernels.cka.batch_hsic` (and so :meth:`MinibatchCKA.update`) takes for every
array namespace but NumPy — CuPy on a GPU, and array-api-strict in the tests, which prove that the
code uses only the standard array API.  The NumPy route cuts each Gram into cache-sized row panels
and spreads layers over CPU threads; replayed on a GPU that design became thousands of small
kernel launches and a host synchronisation per layer (768 Gram calls, ~4,500 casts and sums for
L = 64, n = 1,500: 10-13× the time of the Grams alone on an H200, bench/RESULTS.md "gpu").

Here, per batch of n examples and L layers (Song et al. 2012's unbiased HSIC, as in the module
docstring of :mod:`repsim.kernels.cka`):

1. each layer's rows are centred with float64 column means, rounded once to the Gram dtype
   (:func:`~repsim.kernels.cka.centre_rounded`: a handful of elementwise passes);
2. its Gram K_l = X_c X_cᵀ is formed whole — ``ceil(p / GRAM_SLAB)`` float32 GEMMs whose products
   are summed in float64 (:func:`gram_rows`), the precision rule and error bound of the host route;
3. K_l's rows go into row l of A (L, n·n) float64; for debiased HSIC the diagonal entries are
   zeroed there (K̃) and the row sums R_l = K̃_l 1 taken from A;
4. all pairs at once: tr(K̃_i K̃_j) = (A Aᵀ)_ij — one float64 GEMM — and

       n(n-3)·HSIC₁ = A Aᵀ + t tᵀ/((n-1)(n-2)) - 2/(n-2) · R Rᵀ,   t = R 1;

   biased, (n-1)²·HSIC₀ = ⟨K, L⟩ = A Aᵀ with the diagonals kept.

So a batch costs Σ_l ceil(p_l / GRAM_SLAB) + 2 matrix products and O(L) elementwise operations,
with no host synchronisation per layer: the checks the host route makes layer by layer (NaN or
infinity, a layer constant over the batch) are kept on the device — tr K_l and ‖x̄_l‖² — and
copied to the host with the (L, L) result in one transfer, then checked in layer order with the
host route's messages.  A's rows hold full Gram rows (n² values, twice the host route's upper
triangles): the float64 product then errs by at most γ_{n²}|A||A|ᵀ, the bound of the host route's
step (c) with m = n².  When A would exceed ``block_bytes`` the example rows are cut into groups of
g rows (L·g·n·8 <= ``block_bytes``), each a slice of every Gram (K_l[a:b, :] = X_c[a:b] X_cᵀ, the
same products in parts) whose A Aᵀ and row sums add up; the centred layers are then kept until the
last group.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from repsim._xp import astype, flatten_examples, to_numpy
from repsim.kernels._precision import CentredGram, centre_rounded, constant_tolerance

__all__ = ["device_batch_hsic", "gram_rows"]

_EPS64 = float(np.finfo(np.float64).eps)


def gram_rows(Xa: Any, Xc: Any, xp: Any, slab: int) -> Any:
    """Xa Xcᵀ in float64: products in the inputs' dtype over feature slabs of at most ``slab``
    columns, each slab's product widened and the slabs summed in float64 (one product when the
    features fit one slab, or the inputs are float64)."""
    p = Xc.shape[1]
    T = xp.matrix_transpose
    if p <= slab or Xc.dtype == xp.float64:
        K = xp.matmul(Xa, T(Xc))
        return K if K.dtype == xp.float64 else astype(K, xp.float64, xp)
    out = None
    for s in range(0, p, slab):
        e = min(p, s + slab)
        part = astype(xp.matmul(Xa[:, s:e], T(Xc[:, s:e])), xp.float64, xp)
        if out is None:
            out = part
        else:
            out += part
    return out


def raise_failed(what: str, trace: float, mean_sq: float, n: int) -> None:
    """The host route's errors for a layer whose (tr K, ‖x̄‖²) came back from the device."""
    if not math.isfinite(trace):
        raise ValueError(f"{what} contains NaN or infinite values")
    if trace <= constant_tolerance(n, mean_sq):
        raise ValueError(f"{what} is constant over the examples (zero variance): CKA is undefined")


def device_batch_hsic(items: Iterator[tuple[int, Any]], L: int, n: int, debiased: bool, xp: Any,
                      dtype_of: Callable[[Any], Any], block_bytes: int, names: Sequence[str],
                      centred: bool, slab: int) -> np.ndarray:
    """(L, L) float64 NumPy HSIC of one batch (module docstring).

    ``items`` yields ``(l, X)`` in layer order, each X an (n, ...) array of ``xp`` or a
    :class:`~repsim.kernels.cka.CentredGram`, read once; ``dtype_of(X)`` is the Gram dtype of a
    layer; ``centred``: the rows are centred already (``linear_cka``, which checked them)."""
    rows = max(1, min(n, int(block_bytes) // max(L * n * 8, 1)))
    bounds = list(range(0, n, rows)) + [n]
    kept: list[Any] | None = [None] * L if len(bounds) > 2 else None
    traces: list[Any] = [None] * L
    mean_sqs: list[Any] = [None] * L
    R = xp.zeros((L, n), dtype=xp.float64) if debiased else None
    H = None
    for gi, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        A = xp.empty((L, (b - a) * n), dtype=xp.float64)
        source = items if gi == 0 else ((l_, kept[l_]) for l_ in range(L))
        for l_, X in source:
            if gi == 0:  # first sight: centre (rows) or take as is (a centred Gram)
                ms = None
                if isinstance(X, CentredGram):
                    ms = X.mean_sq
                else:
                    X = flatten_examples(X, xp, None, names[l_])
                    dt = dtype_of(X)
                    fresh = X.dtype != dt
                    X = astype(X, dt, xp) if fresh else X
                    if not centred:
                        X, mean = centre_rounded(X, xp, dt, fresh=fresh)
                        ms = xp.sum(mean * mean)
                if X.shape[0] != n:
                    raise ValueError(f"{names[l_]} has {X.shape[0]} examples, expected {n} "
                                     "(all layers must share examples)")
                mean_sqs[l_] = ms
                if kept is not None:
                    kept[l_] = X
            if isinstance(X, CentredGram):
                K = X.K[a:b, :]
                K = K if K.dtype == xp.float64 else astype(K, xp.float64, xp)
            else:
                K = gram_rows(X[a:b, :], X, xp, slab)
            A[l_, :] = xp.reshape(K, (-1,))
            del K
            diag = A[l_, a::n + 1]  # entries (i, a + i) of the group's rows: the Gram's diagonal
            tr = xp.sum(diag)
            traces[l_] = tr if traces[l_] is None else traces[l_] + tr
            if debiased:
                A[l_, a::n + 1] = 0.0
                R[l_, a:b] = xp.sum(xp.reshape(A[l_, :], (b - a, n)), axis=1)
            del X
        P = xp.matmul(A, xp.matrix_transpose(A))
        H = P if H is None else H + P
        del A
    if debiased:
        t = xp.sum(R, axis=1)
        H = (H + t[:, None] * t[None, :] / ((n - 1) * (n - 2))
             - (2 / (n - 2)) * xp.matmul(R, xp.matrix_transpose(R))) / (n * (n - 3))
    else:
        H = H / ((n - 1) ** 2)
    zero = xp.zeros((), dtype=xp.float64)
    checks = xp.stack([traces[l_] for l_ in range(L)]
                      + [zero if m is None else xp.asarray(m, dtype=xp.float64) for m in mean_sqs])
    flat = to_numpy(xp.concat([xp.reshape(H, (-1,)), checks]))  # the batch's one device -> host copy
    for l_ in range(L):
        raise_failed(names[l_], float(flat[L * L + l_]), float(flat[L * L + L + l_]), n)
    out = np.array(flat[:L * L], dtype=np.float64).reshape(L, L)
    return (out + out.T) / 2
