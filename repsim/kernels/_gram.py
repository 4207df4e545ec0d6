"""The machinery behind all-pairs HSIC on NumPy (:func:`repsim.kernels.hsic.batch_hsic`): Gram products
under the precision rule (float32 slabs summed in float64, :mod:`repsim.kernels._precision`; the error
bound is derived in :mod:`repsim.kernels.hsic`), a layer's validation and centring, the row panels of
the buffer A, the buffers reused between layers and batches, and the split of the BLAS thread budget
over columns (:mod:`repsim.blas`).  Private to :mod:`repsim.kernels`: nothing here is part of the
API, and nothing outside the subpackage imports it (tests/test_layering.py)."""
from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from repsim.array_api import asarray_like, check_finite, diagonal, flatten_examples, row_sq_norms
from repsim.array_api import astype as _astype
from repsim.kernels._precision import (GRAM_SLAB, CenteredGram, ProductOverflow, center_rounded, check_products,
                                      constant_tolerance, is_constant)

HOST_BLOCK_BYTES = 1 << 30  # default bound of the buffer A on NumPy (upper-triangle panels)
DEVICE_BLOCK_BYTES = 4 << 30  # ... and on an accelerator (whole Gram rows; kernels/_cka_device.py)


def is_numpy(xp: Any) -> bool:
    return getattr(xp, "__name__", "") == "numpy"


def _slabs(p: int) -> list[slice]:
    return [slice(s, min(p, s + GRAM_SLAB)) for s in range(0, p, GRAM_SLAB)] if p > GRAM_SLAB else [slice(None)]


def sq_norms64(Xc: Any, xp: Any) -> Any:
    """Squared row norms of Xc (the Gram's diagonal) in float64: float32 dot products over feature
    slabs of at most :data:`GRAM_SLAB`, the slabs summed in float64."""
    out = None
    for s in _slabs(Xc.shape[1]):
        part = row_sq_norms(Xc[:, s], xp)
        part = part if part.dtype == xp.float64 else _astype(part, xp.float64, xp)
        out = part if out is None else out + part
    return out


def gram64(A: Any, B: Any, xp: Any, scratch: "HostScratch | None" = None, key: str = "gram") -> Any:
    """A Bᵀ (rows · rows) with float32 products summed over feature slabs of at most
    :data:`GRAM_SLAB` and the slabs in float64; a single product (in the inputs' dtype) when the
    features fit one slab.  Same buffer for A and B: a SYRK in NumPy.  With ``scratch`` (NumPy)
    the products land in reused buffers (the result is a view of one, valid until its next use)."""
    if scratch is not None:
        shape = (A.shape[0], B.shape[0])
        if A.shape[1] <= GRAM_SLAB or A.dtype == np.float64:
            return np.matmul(A, B.T, out=scratch.take(key, shape, A.dtype))
        acc = scratch.take(key + "64", shape, np.float64)
        part = scratch.take(key, shape, A.dtype)
        for i, s in enumerate(_slabs(A.shape[1])):
            np.matmul(A[:, s], B[:, s].T, out=part)
            if i:
                acc += part
            else:
                acc[...] = part
        return acc
    if A.shape[1] <= GRAM_SLAB or A.dtype == xp.float64:
        return A @ B.T
    out = None
    for s in _slabs(A.shape[1]):
        part = _astype(A[:, s] @ B[:, s].T, xp.float64, xp)
        out = part if out is None else out + part
    return out


def centered_gram_slabs(X: np.ndarray, dtype: Any) -> tuple[np.ndarray, float]:
    """K_c = Σ_slabs X_c[:, s] X_c[:, s]ᵀ over slabs of :data:`GRAM_SLAB` features (NumPy), summed
    in float64; returns (K_c float64 (n, n), ‖x̄‖²).

    Centring is per feature, so each slab is cast, centred (:func:`center_rounded`: the same values
    as centring X whole) and multiplied while it sits in cache (n × 2048 float32 = 2 MiB at n = 256),
    instead of several passes over the whole n × p batch in memory and a centred copy of it: for
    wide layers (p ≫ n) one pass over the data does it all.
    """
    dtype = np.dtype(dtype)
    n, p = X.shape
    K = np.zeros((n, n), dtype=np.float64)
    mean_sq = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported by the caller
        for s in range(0, p, GRAM_SLAB):
            slab = X[:, s:s + GRAM_SLAB]
            fresh = slab.dtype != dtype
            S = _astype(slab, dtype, np) if fresh else slab
            S, m = center_rounded(S, np, dtype, fresh=fresh)
            K += S @ S.T
            mean_sq += float(np.sum(m * m))
    return K, mean_sq


def is_wide(shape: tuple[int, ...]) -> bool:
    """A host layer that enters :func:`batch_hsic` as its centred Gram (:func:`centered_gram`, formed
    slab by slab): more than two slabs of features and at least 4 features per example."""
    p = math.prod(int(d) for d in shape[1:])
    return p > 2 * GRAM_SLAB and p >= 4 * shape[0]


def check_gram(K: Any, xp: Any, mean_sq: float, what: str) -> bool:
    """The checks of :func:`prepare_layer` on a centred Gram: NaN/inf anywhere in the layer make its trace
    non-finite (``ValueError`` naming ``what``); returns whether the layer is constant over the
    batch: its trace within the rounding of the mean (``mean_sq`` = ‖x̄‖², 0 when unknown: then a
    trace <= 0)."""
    return is_constant(what, float(xp.sum(diagonal(K, xp))), mean_sq, K.shape[0])


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # another namespace's dtype object (array-api-strict)
        return str(dtype)


def prepare_layer(X: Any, xp: Any, dtype: Any, n: int | None, what: str,
                  scratch: "HostScratch | None" = None) -> tuple[Any, Any, bool]:
    """Flatten, cast, validate and column-centre one layer's batch (:func:`center_rounded`);
    returns the centred rows, their float64 squared norms (:func:`sq_norms64`, the centred
    Gram's diagonal) and whether the layer is constant over the batch.  With ``scratch`` (NumPy) the centred rows are written into a reused buffer.

    NaN/inf anywhere in X makes its column mean non-finite, so the finiteness check runs on the
    (p,) mean. X is constant to working precision when the centred rows' squared norms are all
    within the rounding of the (float64) mean: Σ_i ‖x_i - x̄‖² <= (4 n eps₆₄)² · n · ‖x̄‖²
    (:func:`constant_tolerance`).
    """
    X = flatten_examples(X, xp, None, what)
    fresh = X.dtype != dtype  # a cast (float16: the exact fast upcast of _xp.astype) makes a new array
    out = scratch.take("centered", X.shape, dtype) if scratch is not None and not fresh else None
    X = flatten_examples(X, xp, dtype, what)
    if n is not None and X.shape[0] != n:
        raise ValueError(f"{what} has {X.shape[0]} examples, expected {n} (all layers must share examples)")
    Xc, mean = (center_rounded(X, xp, dtype, out=out) if out is not None
                else center_rounded(X, xp, dtype, fresh=fresh))
    check_finite(mean, xp, what)
    d = sq_norms64(Xc, xp)
    spread = float(xp.sum(d))
    if not math.isfinite(spread):  # finite values (the mean is) whose squares overflow the working dtype
        big = float(xp.max(xp.abs(X)))
        raise ProductOverflow(f"{what}: overflow: its values (up to {big:.3g} in magnitude) are too large for "
                              f"{_dtype_name(dtype)} products; rescale the layer (CKA does not change) or compute "
                              "in float64 (compute_dtype='float64')")
    check_products(what, spread, X.shape[0], float(xp.max(d)) if d.shape[0] else 0.0, dtype)
    return Xc, d, spread <= constant_tolerance(X.shape[0], float(xp.sum(mean * mean)))


def prepare_gram(G: "CenteredGram", xp: Any, n: int | None, what: str) -> tuple["CenteredGram", bool]:
    """Validate a :class:`CenteredGram` (the counterpart of :func:`prepare_layer`; K is kept as given) and
    say whether its layer is constant over the batch."""
    if n is not None and G.shape[0] != n:
        raise ValueError(f"{what} has {G.shape[0]} examples, expected {n} (all layers must share examples)")
    return G, check_gram(G.K, xp, 0.0 if G.mean_sq is None else float(G.mean_sq), what)  # no mean: trace <= 0


class HostScratch(threading.local):
    """Reused NumPy buffers, one set per worker thread, for the duration of one batch.

    Allocating each layer's centred copy and Gram blocks afresh costs more than the arithmetic
    on them when several threads do it: every large temporary is a fresh mapping whose pages
    fault in on first touch and whose release flushes every core's TLB, and both serialise the
    threads (measured: k threads forming fresh Grams ran no faster than one).  ``take`` returns a
    view of a buffer that only grows, so after the first layer no memory is mapped."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def take(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        size = math.prod(shape)
        buf = self.bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self.bufs[key] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)


def _gram_block(Xc: Any, a: int, b: int, c: int, e: int, xp: Any,
                scratch: HostScratch | None = None, key: str = "gram") -> Any:
    """Block [a:b, c:e] of a layer's centred Gram: from the rows Xc (:func:`gram64`, into
    ``scratch`` when given), or a view of a :class:`CenteredGram`'s matrix."""
    if isinstance(Xc, CenteredGram):
        return Xc.K[a:b, c:e]
    return gram64(Xc[a:b, :], Xc[c:e, :], xp, scratch, key)


class BufferCache:
    """The buffer A of the last batch, kept for the next one (NumPy).

    A is the largest temporary of a batch (L × ~n²/2 float64: 111 MB at L = 64, n = 600), and a
    fresh one costs more than filling it: its pages fault in and are zeroed on first touch, and
    freeing it flushes every core's TLB while the worker threads run — about a tenth of a batch's
    time at that size.  So one buffer of at most ``max_bytes`` (default 256 MiB; larger ones are
    freed as before) is kept between batches and handed out to one caller at a time (thread-safe:
    a second concurrent batch allocates its own).  :func:`release_buffers` frees it.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self._buf: np.ndarray | None = None
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        size = math.prod(shape)
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype=np.float64)  # (a smaller cached one is dropped)
        return buf[:size].reshape(shape)

    def give(self, view: np.ndarray) -> None:
        buf = view.base if view.base is not None else view
        if buf.nbytes > self.max_bytes:
            return
        with self._lock:
            if self._buf is None or self._buf.size < buf.size:
                self._buf = buf

    def release(self) -> None:
        with self._lock:
            self._buf = None


A_CACHE = BufferCache()


_MASK_CACHE: dict[tuple, Any] = {}


def _panel_mask(xp: Any, ref: Any, r: int, width: int) -> Any:
    """(r, width) float64 mask of a row panel K[a:a+r, a:]: 0 on and below the diagonal of its
    leading r × r block (pairs i >= j), 1 elsewhere (the pairs i < j the panel owns)."""
    key = (xp.__name__, str(getattr(ref, "device", "")), r, width)
    mask = _MASK_CACHE.get(key)
    if mask is None:
        m = np.ones((r, width))
        m[:, :r] = np.triu(m[:, :r], 1)
        mask = asarray_like(m, ref, xp, dtype=xp.float64)
        if len(_MASK_CACHE) > 64:
            _MASK_CACHE.clear()
        _MASK_CACHE[key] = mask
    return mask


def pair_groups(n: int, block_rows: int, cap: int) -> list[list[tuple[int, int, int]]]:
    """Row panels [a, b) with their lengths in A, grouped so each group holds <= ``cap`` values.

    Panel [a, b) is the block K[a:b, a:] of rows a..b-1 from column a on, r (n - a) values
    (r = b - a): it owns the pairs i < j with a <= i < b, which are the whole rectangle
    K[a:b, b:] and the strict upper triangle of its leading r × r block; the rest of that block
    (i >= j) is stored as zeros, so a panel is one contiguous product and one contiguous write,
    and the zeros add nothing to A Aᵀ.
    """
    bounds = list(range(0, n, block_rows)) + [n]
    groups: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = (b - a) * (n - a)
        if groups[-1] and size + m > cap:
            groups.append([])
            size = 0
        groups[-1].append((a, b, m))
        size += m
    return groups


def write_panels(A: Any, l_: int, Xc: Any, group: list[tuple[int, int, int]], want_sums: bool, xp: Any,
                 scratch: HostScratch | None = None) -> Any:
    """Write layer l's Gram entries K_ij, i < j, of the panels in ``group`` (:func:`pair_groups`)
    into row A[l] as float64, and return (``want_sums``) their share of the row sums of K̃ (the
    Gram with its diagonal zeroed), float64 (n,): entry (i, j) adds to r_i and r_j.  ``scratch``
    (NumPy): the Gram is formed in reused buffers, whole (one SYRK) when ``group`` holds every
    panel, else panel by panel."""
    n = Xc.shape[0]
    host = scratch is not None
    whole = None
    if host and not isinstance(Xc, CenteredGram) and group[0][0] == 0 and group[-1][1] == n:
        whole = gram64(Xc, Xc, np, scratch, "gram")  # every panel: one SYRK (Xc Xcᵀ of one buffer)
    sums = xp.zeros((n,), dtype=xp.float64) if want_sums else None
    off = 0
    for a, b, k in group:
        r = b - a
        if host:
            G = whole[a:b, a:] if whole is not None else _gram_block(Xc, a, b, a, n, np, scratch, "panel")
            V = A[l_, off:off + k].reshape(r, n - a)
            np.multiply(G[:, :r], _panel_mask(np, V, r, r), out=V[:, :r])  # cast; i >= j -> 0
            V[:, r:] = G[:, r:]
        else:
            V = xp.astype(_gram_block(Xc, a, b, a, n, xp), xp.float64, copy=True)
            V = V * _panel_mask(xp, V, r, n - a)
            A[l_, off:off + k] = xp.reshape(V, (-1,))
        if sums is not None and host:  # float64 GEMVs: ~2x numpy's axis sums here
            sums[a:b] += V @ np.ones(n - a)
            sums[a:] += np.ones(r) @ V
        elif sums is not None:
            sums[a:b] = sums[a:b] + xp.sum(V, axis=1)
            sums[a:] = sums[a:] + xp.sum(V, axis=0)
        off += k
    return sums


def row_products(A: np.ndarray) -> np.ndarray:
    """A Aᵀ in float64 (NumPy; the accelerator route forms its own): split along A's long axis into
    k column slabs, one per thread of the BLAS budget, each a single-threaded SYRK, and the k (L, L)
    parts summed — the same sums in another order.  Unlike one k-threaded BLAS call this leaves no
    BLAS worker threads busy-waiting (OpenBLAS spins ~0.1 s after a threaded call) to slow the next
    batch's columns."""
    from repsim.blas import blas_thread_split

    with blas_thread_split() as k:
        m = A.shape[1]
        k = max(1, min(k, m // 4096))
        if k == 1:
            return A @ A.T
        from concurrent.futures import ThreadPoolExecutor

        cuts = [m * i // k for i in range(k + 1)]
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="repsim-hsic") as pool:
            parts = list(pool.map(lambda i: A[:, cuts[i]:cuts[i + 1]] @ A[:, cuts[i]:cuts[i + 1]].T, range(k)))
    return sum(parts[1:], parts[0])


def each_column(items: Any, work: Any, parallel: bool) -> None:
    """``work(l, X)`` for each ``(l, X)`` of ``items`` (consumed in order on this thread).

    With ``parallel`` (NumPy) the BLAS thread budget is spent across columns: k worker threads,
    each with single-threaded BLAS (:func:`repsim.blas.blas_thread_split`).  At most k + 1
    columns are in flight (the next one is read while k are computed) and a finished column
    frees its slot whichever it is, so no worker waits for a slower neighbour.  After a failure
    no new column starts and the error of the lowest failed column is raised.  Each column
    writes only its own row of A, so the result does not depend on the split.
    """
    if parallel:
        from repsim.blas import blas_thread_split

        with blas_thread_split() as k:
            if k > 1:
                from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

                with ThreadPoolExecutor(max_workers=k, thread_name_prefix="repsim-hsic") as pool:
                    pending: dict[Any, int] = {}
                    failed: list[tuple[int, BaseException]] = []

                    def settle(block: bool) -> None:
                        done, _ = wait(list(pending), return_when=FIRST_COMPLETED) if block else (
                            [f for f in pending if f.done()], None)
                        for f in done:
                            err = f.exception()
                            if err is not None:
                                failed.append((pending[f], err))
                            del pending[f]

                    try:
                        for l_, X in items:
                            pending[pool.submit(work, l_, X)] = l_
                            del X
                            settle(block=len(pending) > k)
                            if failed:
                                break
                        while pending:
                            settle(block=True)
                    finally:
                        for f in pending:
                            f.cancel()
                    if failed:
                        raise min(failed, key=lambda e: e[0])[1]
                return
    for l_, X in items:
        work(l_, X)
