"""The linear probe's features out of core: :func:`streamed_problem` is :func:`repsim.probes._logreg.rotate`
for features read in row blocks (:class:`repsim.probes.rows.Rows`), holding O(P² + P·K) floats and
one block instead of the (N, P) rotated copy.

The solver needs only two products with the rotated features ``X̂ = (X − μ) V`` (module doc of
``_logreg``): logits ``Aᵀ X̂ᵀ`` and gradients ``R X̂``. Both are taken without forming X̂:

    A X̂ᵀ = (A Vᵀ)(X − μ)ᵀ        R X̂ = (R (X − μ)) V

block by block (``(X − μ)`` in the compute dtype, products accumulated in float64 across blocks), so a
pass costs n·P·K flops, not n·P·r. The basis: ``C = Σ_blocks (X_b − μ)ᵀ(X_b − μ)`` (float64, a second
pass after the mean), ``V`` its eigenvectors, ``s = diag(Vᵀ C V)`` — the same reparameterisation as
``rotate`` (any orthonormal basis of the centred row space gives the same optimum in W). When the Gram
would exceed ``GRAM_BYTES`` (P > 4,096) the basis is the identity (V = None: no rotation, the diagonal
preconditioner from the column sums of squares ``s_j = Σ_i (x_ij − μ_j)²``): the same optimum again,
at O(P·K) memory; a layer wider than n takes this route too, never an N × N matrix.

Speed: a pass decodes every chunk, gathers the selected rows and centres them, which costs more than
its products (K ≪ P). So, within ``cache_bytes`` (``Rows.cache_bytes``, from ``--memory-budget``),
the centred rows of the selection are kept once, in the compute dtype and in the selection's order
(:class:`CenteredCache`, built on the Gram pass), and every later pass takes them as contiguous slices
— the in-memory route's work, in blocks; rows beyond the cache are read on each pass. The cached
blocks hold exactly the values a pass would compute; only the products' blocking (summation order)
differs, so the fit agrees with an uncached one to the solver's tolerance.

Numbers: the products round differently from the in-memory route's (other summation order), so the
fit agrees with it to the solver's tolerance, not bit for bit (tests/test_probes_stream.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repsim.probes._logreg import GRAM_BYTES
from repsim.probes.rows import Rows



CACHE_BLOCK_ROWS = 4096   # rows per block of the centred cache (float32 × P = 2 MiB at P = 128)


@dataclass
class CenteredCache:
    """The first ``n_rows`` rows of a selection, centred, in the compute dtype, in selection order:
    ``blocks[j]`` holds positions ``[j·block_rows, …)`` (read-only by convention)."""

    block_rows: int
    blocks: list = field(default_factory=list)
    n_rows: int = 0

    @classmethod
    def sized(cls, n: int, p: int, itemsize: int, cache_bytes: int) -> "CenteredCache | None":
        rows = min(n, int(cache_bytes) // max(1, p * itemsize))
        return cls(block_rows=max(1, min(CACHE_BLOCK_ROWS, rows)), n_rows=rows) if rows > 0 else None


@dataclass
class StreamedX:
    """Rows ``select`` (any order) of ``rows``, centred by ``mean`` and rotated by ``V`` (None: the
    identity), as the solver's X̂; supports the solver's products and row slicing. ``cache`` holds the
    centred rows of positions ``[0, cache.n_rows)`` of the selection this one is the slice
    ``[offset, offset + len(select))`` of."""

    rows: Rows
    select: np.ndarray
    mean: np.ndarray           # (P,) in the compute dtype
    V: np.ndarray | None       # (P, r) float64, or None
    dtype: Any
    cache: CenteredCache | None = None
    offset: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.select.size), int(self.rows.p if self.V is None else self.V.shape[1]))

    def __getitem__(self, key) -> "StreamedX":
        key = key[0] if isinstance(key, tuple) else key
        if isinstance(key, slice) and key.step in (None, 1) and self.cache is not None:
            start, _, _ = key.indices(self.select.size)
            return StreamedX(self.rows, self.select[key], self.mean, self.V, self.dtype, self.cache,
                             self.offset + start)
        return StreamedX(self.rows, self.select[key], self.mean, self.V, self.dtype)

    def _centered(self):
        """Yield ``(positions, centred rows)``: the cached positions first, as views (not to be
        written), then the others read from the blocks."""
        m, done = int(self.select.size), 0
        c = self.cache
        if c is not None and self.offset < c.n_rows:
            hi = min(self.offset + m, c.n_rows)
            j = self.offset // c.block_rows
            while j * c.block_rows < hi:
                a = j * c.block_rows
                lo_, hi_ = max(a, self.offset), min(a + c.block_rows, hi)
                yield slice(lo_ - self.offset, hi_ - self.offset), c.blocks[j][lo_ - a:hi_ - a]
                j += 1
            done = hi - self.offset
        rest = self.select[done:] if done else self.select
        if rest.size == 0:
            return
        # the gathered rows and their centred copy go to two buffers reused block after block and
        # pass after pass (Rows.scratch: nothing block-sized is allocated per block)
        with self.rows.scratch(self.rows.dtype) as raw, self.rows.scratch(self.dtype) as buf:
            for pos, X in self.rows.blocks(rest, keep=False, into=raw):
                Xc = np.subtract(X, self.mean, out=buf[:X.shape[0]])   # = X.astype(dtype) - mean
                del X
                yield (pos + done if done else pos), Xc
                del Xc

    def _to_p(self, A: np.ndarray) -> np.ndarray:
        """(K, r) rotated coefficients -> (K, P) in the original coordinates (float64)."""
        A = np.asarray(A, dtype=np.float64)
        return A if self.V is None else A @ self.V.T

    def t_matmul(self, A: np.ndarray) -> np.ndarray:
        """``A X̂ᵀ`` (K, m) in the compute dtype, for A (K, r)."""
        B = np.ascontiguousarray(self._to_p(A), dtype=self.dtype)
        out = np.empty((B.shape[0], self.shape[0]), dtype=self.dtype)
        for pos, Xc in self._centered():
            out[:, pos] = B @ Xc.T
            del Xc
        return out

    def matmul_left(self, R: Any) -> np.ndarray:
        """``R X̂`` (K, r) float64, for R (K, m)."""
        Gt = np.zeros((self.rows.p, R.shape[0]))
        for pos, Xc in self._centered():  # Xcᵀ Rᵀ: OpenBLAS is ~9x faster this way round than R Xc (K ≪ m)
            Gt += Xc.T @ np.ascontiguousarray(R[:, pos]).T
            del Xc
        return Gt.T if self.V is None else Gt.T @ self.V

    def abs_blocks(self):
        """Yield ``(positions, |X̂ block|)`` (the rounding bound of ``gradient_floor``: rotates the block)."""
        for pos, Xc in self._centered():
            Xh = Xc if self.V is None else Xc @ np.asarray(self.V, dtype=self.dtype)
            del Xc
            Xh = np.abs(Xh, out=Xh) if Xh.flags.writeable else np.abs(Xh)  # cached blocks are read-only
            yield pos, Xh
            del Xh


@dataclass
class StreamedProblem:
    """:class:`repsim.probes._logreg.RotatedProblem` for streamed rows (the same fields; ``Xh`` is a
    :class:`StreamedX`; ``V`` None means the identity basis)."""

    Xh: StreamedX
    V: np.ndarray | None
    mean: np.ndarray
    s: np.ndarray
    xp: Any
    dtype: Any
    stats: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.Xh.shape[1])

    def to_original(self, Wd: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        W = Wd if self.V is None else self.V @ Wd
        return W, b - self.mean @ W


def streamed_problem(rows: Rows, select: np.ndarray, *, gram_bytes: int = GRAM_BYTES,
                     cache_bytes: int | None = None) -> StreamedProblem:
    """Centre and rotate rows ``select`` of ``rows`` in two passes (mean; centred Gram or column sums of
    squares), keeping up to ``cache_bytes`` (default ``rows.cache_bytes``) of the centred rows for the
    later passes; see the module doc. float64 sources are solved in float64, others in float32."""
    dt = np.dtype(np.float64 if rows.dtype == np.float64 else np.float32)
    select = np.asarray(select, dtype=np.int64)
    n, p = int(select.size), rows.p
    total = np.zeros(p)
    for _, X in rows.blocks(select, keep=False):
        total += X.sum(axis=0, dtype=np.float64)
        del X
    mean = (total / max(n, 1)).astype(dt)
    rotate = p <= n and p * p * 8 <= gram_bytes
    view = StreamedX(rows, select, mean, None, dt)
    cache = CenteredCache.sized(n, p, dt.itemsize, rows.cache_bytes if cache_bytes is None else cache_bytes)
    if cache is not None:       # the second pass keeps the centred rows of positions [0, cache.n_rows)
        view = _filled(view, cache)
    if rotate:
        C = np.zeros((p, p))
        for _, Xc in view._centered():
            C += (Xc.T @ Xc).astype(np.float64)
            del Xc
        s, V = np.linalg.eigh((C + C.T) / 2)
        V = V[:, np.argsort(s)[::-1]]
        s_diag = np.einsum("pr,pq,qr->r", V, C, V)
        del C
    else:
        V = None
        s_diag = np.zeros(p)
        for _, Xc in view._centered():
            s_diag += np.einsum("ij,ij->j", Xc, Xc, dtype=np.float64)
            del Xc
    return StreamedProblem(Xh=StreamedX(rows, select, mean, V, dt, cache), V=V, mean=mean.astype(np.float64),
                           s=np.maximum(s_diag, 0.0), xp=np, dtype=dt,
                           stats={"rotated": bool(rotate), "streamed": True,
                                  "cached_rows": 0 if cache is None else cache.n_rows})


def _filled(view: StreamedX, cache: CenteredCache) -> StreamedX:
    """``view`` with ``cache`` filled from one pass over its rows (positions beyond the cache are
    left to the passes)."""
    m = cache.n_rows
    sizes = [min(cache.block_rows, m - a) for a in range(0, m, cache.block_rows)]
    cache.blocks = [np.empty((b, view.rows.p), dtype=view.dtype) for b in sizes]
    for pos, Xc in StreamedX(view.rows, view.select[:m], view.mean, None, view.dtype)._centered():
        # pos: positions in [0, m) (any order within a store chunk): scatter them into the blocks
        pos = np.arange(m)[pos] if isinstance(pos, slice) else pos
        j = pos // cache.block_rows
        for jj in np.unique(j):
            sel = j == jj
            cache.blocks[jj][pos[sel] - jj * cache.block_rows] = Xc[sel]
        del Xc
    for b in cache.blocks:
        b.flags.writeable = False
    return StreamedX(view.rows, view.select, view.mean, None, view.dtype, cache, 0)
