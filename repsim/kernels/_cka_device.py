"""All-pairs HSIC of one batch, shaped for an accelerator: a few large operations, one host transfer.

The route :func:`repsim.kernels.hsic.batch_hsic` (and so :meth:`MinibatchCKA.update`) takes for every
array namespace but NumPy — CuPy on a GPU, and array-api-strict in the tests, which prove that the
code uses only the standard array API.  The NumPy route cuts each Gram into cache-sized row panels
and spreads layers over CPU threads; replayed on a GPU that design became thousands of small
kernel launches and a host synchronisation per layer (768 Gram calls, ~4,500 casts and sums for
L = 64, n = 1,500: 10-13× the time of the Grams alone on an H200, bench/RESULTS.md "gpu").

Here, per batch of n examples and L layers (Song et al. 2012's unbiased HSIC, as in the module
docstring of :mod:`repsim.kernels.hsic`):

1. each layer's rows are centred with float64 column means, rounded once to the Gram dtype
   (:func:`~repsim.kernels._precision.center_rounded`: a handful of elementwise passes);
2. its Gram K_l = X_c X_cᵀ is formed whole — one float64 GEMM where the Gram dtype is float64 (on
   GPUs with fast float64 products, :func:`repsim.array_api.fast_float64_products`), else
   ``ceil(p / GRAM_SLAB)`` float32 GEMMs whose products are summed in float64 (:func:`gram_rows`),
   the precision rule and error bound of the host route;
3. K_l's rows go into row l of A (L, n·n) float64; for debiased HSIC the diagonal entries are
   zeroed there (K̃) and the row sums R_l = K̃_l 1 taken from A;
4. all pairs at once: tr(K̃_i K̃_j) = (A Aᵀ)_ij — one float64 product (:func:`row_products`) — and

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

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from repsim.array_api import cupy_array_module, astype, flatten_examples, on_device, row_sq_norms, to_numpy
from repsim.kernels._precision import CenteredGram, is_constant, zero_constant

__all__ = ["device_batch_hsic", "gram_rows", "center_once", "centered_gram_slabs", "row_products", "Tuning", "TUNING"]

_EPS64 = float(np.finfo(np.float64).eps)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the accelerator route forms its products (bench/gpu.py times each choice).

    ``product``: A Aᵀ as one GEMM (``"gemm"``: an (L, L) output over k = n² terms, few thread
    blocks) or as ``chunks`` GEMMs of k = n²/chunks terms each in one strided-batched cuBLAS call
    whose (chunks, L, L) outputs are then summed (``"batched"``, CuPy only: the same products,
    spread over the whole chip, no copy of A); ``"auto"`` takes ``"batched"`` on CuPy.
    ``colsum``: the column sums of the centring as a float64 reduction (``"reduce"``) or as a
    float64 product with a row of ones (``"gemv"``)."""

    product: str = "auto"
    chunks: int = 256
    colsum: str = "reduce"


TUNING = Tuning()
_OUT_BYTES = 64 << 20  # at most this much for the batched product's (chunks, L, L) partial sums


def center_once(X: Any, xp: Any) -> tuple[Any, Any]:
    """``(X - fl(x̄), ‖x̄‖²)`` for X (n, p) in its (Gram) dtype: the column means x̄ summed in float64
    and rounded once to X's dtype; ‖x̄‖² a 0-d float64 array.  Three passes over X and no float64
    copy of it.

    The host route also subtracts the rounding residue lo = x̄ - fl(x̄) (:func:`center_rounded`);
    here it stays in: a per-feature constant c (|c| <= u|x̄|/2) added to every row changes the Gram
    by terms of the form a_i + a_j + const, which U-centring (and the biased estimator's centring
    matrix) removes exactly (module docstring of :mod:`repsim.kernels.hsic`), and it enlarges the
    rows that the float32 products' rounding scales with by a factor of at most 1 + u·|x̄|/σ
    (1 + 6e-4 at a mean 10⁴ times the spread σ).
    """
    n = X.shape[0]
    if TUNING.colsum == "gemv":
        ones = on_device(xp.ones, (1, n), dtype=xp.float64, device=X.device)
        mean = xp.reshape(ones @ astype(X, xp.float64, xp), (-1,)) / n
    else:
        mean = xp.sum(X, axis=0, dtype=xp.float64) / n
    Xc = X - (mean if X.dtype == xp.float64 else astype(mean, X.dtype, xp))
    return Xc, row_sq_norms(xp.reshape(mean, (1, -1)), xp)[0]


def gram_rows(Xa: Any, Xc: Any, xp: Any, slab: int, out: Any = None) -> Any:
    """Xa Xcᵀ in float64: products in the inputs' dtype over feature slabs of at most ``slab``
    columns, each slab's product widened and the slabs summed in float64 (one product when the
    features fit one slab, or the inputs are float64).  ``out``: a float64 array of Xa Xcᵀ's size
    (any shape, e.g. a row of A) that receives the result, widened as it is written."""
    p = Xc.shape[1]
    cuts = [(0, p)] if p <= slab or Xc.dtype == xp.float64 else [(s, min(p, s + slab)) for s in range(0, p, slab)]
    for i, (s, e) in enumerate(cuts):
        part = Xa[:, s:e] @ Xc[:, s:e].T if len(cuts) > 1 else Xa @ Xc.T
        if out is None:
            out = part if part.dtype == xp.float64 else astype(part, xp.float64, xp)
            continue
        part = xp.reshape(part, out.shape)
        if i:
            out += part
        else:
            out[...] = part
    return out


WIDE_BYTES = 512 << 20  # a wide layer's cast and centred copies are made this many bytes of features at a time


def centered_gram_slabs(X: Any, xp: Any, dtype: Any, slab: int, cap: int | None = None) -> tuple[Any, Any]:
    """(K_c float64 (b, b), ‖x̄‖²) of a batch X (b, p) on the accelerator, in feature slabs of at
    most ``cap`` bytes in ``dtype`` (default :data:`WIDE_BYTES`): each slab cast, centred
    (:func:`center_once`: the means are per feature, so slab by slab is exact) and multiplied
    (:func:`gram_rows`), the slabs' Grams and ‖x̄_s‖² summed.  One slab when X fits: a float16 block
    of a full conv map (b = 1,024, p = 802,816) would otherwise need two 6.6 GB float64 copies."""
    b, p = X.shape
    itemsize = xp.finfo(dtype).bits // 8
    width = max(slab, (int(cap if cap is not None else WIDE_BYTES) // max(1, b * itemsize)) // slab * slab)
    K = None
    mean_sq = None
    for s in range(0, p, width):
        Xs = X[:, s:min(p, s + width)] if width < p else X
        Xs = astype(Xs, dtype, xp) if Xs.dtype != dtype else Xs
        Xs, m = center_once(Xs, xp)
        K = gram_rows(Xs, Xs, xp, slab, out=K) if K is None else K + gram_rows(Xs, Xs, xp, slab)
        mean_sq = m if mean_sq is None else mean_sq + m
    return K, mean_sq


def row_products(A: Any, xp: Any) -> Any:
    """A Aᵀ (L, L) of a C-contiguous float64 A (L, N): one product (``xp``'s matmul), or on CuPy
    (:class:`Tuning` ``product``) the sum over c chunks of N of A[:, chunk] A[:, chunk]ᵀ, all c
    in one strided-batched DGEMM that reads A in place (the same terms, summed in float64 in
    another order: the same error bound, γ_N |A||A|ᵀ).  The batched call is tried only on a real
    CuPy array (not on another namespace's array handed in with a CuPy-named namespace, which
    would switch it off for the process: :data:`_BATCHED_UNAVAILABLE`)."""
    if TUNING.product == "gemm" or _BATCHED_UNAVAILABLE or cupy_array_module(A) is None:
        return A @ A.T
    try:
        return _batched_row_products(A, TUNING.chunks)
    except (ImportError, AttributeError, TypeError) as exc:  # a CuPy without this cuBLAS binding
        _note_batched_unavailable(exc)
        return A @ A.T


_BATCHED_UNAVAILABLE: list[str] = []


def _note_batched_unavailable(exc: BaseException) -> None:
    import warnings

    _BATCHED_UNAVAILABLE.append(f"{type(exc).__name__}: {exc}")
    warnings.warn(f"repsim: CuPy's strided-batched DGEMM is not usable here ({_BATCHED_UNAVAILABLE[0]}); "
                  "all-pairs CKA takes one GEMM per batch instead (slower, same numbers)", RuntimeWarning, stacklevel=3)


def _batched_row_products(A: Any, chunks: int) -> Any:
    """CuPy: Σ_j A_j A_jᵀ over column chunks A_j of A by ``cublasDgemmStridedBatched``.

    In cuBLAS's column-major view, A (L, N) C-contiguous is the matrix M (N, L) with leading
    dimension N; chunk j is rows [j·k, (j+1)·k) of M, so batch j is C_j = M_jᵀ M_j
    (transa = T, transb = N, m = n = L, lda = ldb = N, strideA = strideB = k); a shorter last
    chunk is a second call of one batch."""
    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    L, N = A.shape
    if A.dtype != cp.float64 or not A.flags.c_contiguous:
        raise TypeError("batched row products need a C-contiguous float64 array")
    c = max(1, min(int(chunks), _OUT_BYTES // max(1, L * L * 8), N))
    k = -(-N // c)
    full, tail = N // k, N % k
    out = cp.empty((full + (tail > 0), L, L), dtype=cp.float64)
    one, zero = np.array(1.0), np.array(0.0)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.dgemmStridedBatched(handle, 1, 0, L, L, k, one.ctypes.data, A.data.ptr, N, k, A.data.ptr, N, k,
                               zero.ctypes.data, out.data.ptr, L, L * L, full)
    if tail:
        at = A.data.ptr + full * k * 8
        cublas.dgemmStridedBatched(handle, 1, 0, L, L, tail, one.ctypes.data, at, N, 0, at, N, 0,
                                   zero.ctypes.data, out.data.ptr + full * L * L * 8, L, L * L, 1)
    return cp.sum(out, axis=0)


def device_batch_hsic(items: Iterator[tuple[int, Any]], L: int, n: int, debiased: bool, xp: Any,
                      dtype_of: Callable[[Any], Any], block_bytes: int, names: Sequence[str],
                      centered: bool, slab: int, device: Any = None) -> np.ndarray:
    """(L, L) float64 NumPy HSIC of one batch (module docstring), computed on ``device`` (the
    layers' ``x.device``: every array made here is made there).

    ``items`` yields ``(l, X)`` in layer order, each X an (n, ...) array of ``xp`` or a
    :class:`~repsim.kernels._precision.CenteredGram`, read once; ``dtype_of(X)`` is the Gram dtype of
    a layer; ``centered``: the rows are centred already (``linear_cka``, which checked them).

    Per layer: its centring (:func:`center_once`) and one product per feature slab written into
    its row of A; per group of rows, for all layers at once: the traces, the zeroed diagonals and
    the row sums (strided views of A), and A Aᵀ."""
    rows = max(1, min(n, int(block_bytes) // max(L * n * 8, 1)))
    bounds = list(range(0, n, rows)) + [n]
    kept: list[Any] | None = [None] * L if len(bounds) > 2 else None
    mean_sqs: list[Any] = [None] * L
    traces = on_device(xp.zeros, (L,), dtype=xp.float64, device=device)
    R = on_device(xp.zeros, (L, n), dtype=xp.float64, device=device) if debiased else None
    H = None
    for gi, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        A = on_device(xp.empty, (L, (b - a) * n), dtype=xp.float64, device=device)
        source = items if gi == 0 else ((l_, kept[l_]) for l_ in range(L))
        for l_, X in source:
            if gi == 0:  # first sight: centre (rows) or take as is (a centred Gram)
                if isinstance(X, CenteredGram):
                    mean_sqs[l_] = X.mean_sq
                else:
                    X = flatten_examples(X, xp, None, names[l_])
                    dt = dtype_of(X)
                    if not centered and X.shape[0] * X.shape[1] * (xp.finfo(dt).bits // 8) > WIDE_BYTES:
                        # a wide layer: its centred Gram slab by slab, not a whole cast and centred copy
                        K, mean_sqs[l_] = centered_gram_slabs(X, xp, dt, slab)
                        X = CenteredGram(K, mean_sq=mean_sqs[l_])
                    else:
                        X = astype(X, dt, xp) if X.dtype != dt else X
                        if not centered:
                            X, mean_sqs[l_] = center_once(X, xp)
                if X.shape[0] != n:
                    raise ValueError(f"{names[l_]} has {X.shape[0]} examples, expected {n} "
                                     "(all layers must share examples)")
                if kept is not None:
                    kept[l_] = X
            if isinstance(X, CenteredGram):
                A[l_, :] = xp.reshape(X.K[a:b, :], (-1,))
            else:
                gram_rows(X[a:b, :], X, xp, slab, out=A[l_, :])
            del X
        diag = A[:, a::n + 1]  # entries (i, a + i) of the group's rows: the Grams' diagonals
        traces = traces + xp.sum(diag, axis=1)
        del diag
        if debiased:
            A[:, a::n + 1] = 0.0
            R[:, a:b] = xp.sum(xp.reshape(A, (L, b - a, n)), axis=2)
        P = row_products(A, xp)
        H = P if H is None else H + P
        del A
    if debiased:
        t = xp.sum(R, axis=1)
        H = (H + t[:, None] * t[None, :] / ((n - 1) * (n - 2))
             - (2 / (n - 2)) * (R @ R.T)) / (n * (n - 3))
    else:
        H = H / ((n - 1) ** 2)
    zero = on_device(xp.zeros, (), dtype=xp.float64, device=device)
    checks = xp.stack([zero if m is None else xp.asarray(m, dtype=xp.float64) for m in mean_sqs])
    flat = to_numpy(xp.concat([xp.reshape(H, (-1,)), traces, checks]))  # the batch's one device -> host copy
    constant = [is_constant(names[l_], float(flat[L * L + l_]), float(flat[L * L + L + l_]), n) for l_ in range(L)]
    return zero_constant(np.array(flat[:L * L], dtype=np.float64).reshape(L, L), constant)
