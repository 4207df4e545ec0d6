"""Row blocks of a 2-D matrix that may not fit in memory: a store's layer or logits read chunk by chunk,
or a NumPy array read in blocks (the same code path, so tests can force it on small data).

The out-of-core probes and calibration (issue 31) make passes over :class:`Rows`; each pass holds one
block (one store chunk: ~8 MiB for the widest layer by ``repsim.store.format.default_chunk_rows``)
plus what the caller derives from it. Values are checked finite on the first pass, chunk by chunk,
with the rule every analysis applies (:func:`repsim.store.finite.require_finite`).

A pass that decodes every chunk again costs more than its arithmetic (the linear probe's products
are n·P·K flops, K ≪ P), so passes are sped up by a **bounded cache** (``cache_bytes``): blocks are
kept, converted to the compute dtype (float32, or float64 for float64 sources; float16 → float32 is
exact, so a cached block is the same numbers), until they would exceed ``cache_bytes``; later passes
take those from memory and read only the rest (the first blocks are kept, never evicted: the passes
are sequential, so any eviction would miss on every block of the next pass). ``cache_bytes`` is a
constant the caller takes from ``--memory-budget``, never from n, so memory stays bounded; 0
(``--memory-budget 0``) keeps nothing. The linear probe keeps its own cache of centred rows instead
(``_streamed.CenteredCache``). A read-ahead thread (decode block i+1 while block i is used) was
measured too and left out: on the 2-core box it made the streamed linear probe 1.3x slower
(72 → 95 s and 89 → 118 s on 20,000 × 512 float16), the decode not overlapping the caller's work.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

BLOCK_BYTES = 8 << 20  # rows per block of an in-memory array: this many bytes (store sources: the store's chunks)


@dataclass
class Rows:
    """``n`` rows of ``p`` features (flattened), read by :meth:`block`; ``store`` / ``array`` name the
    source in error messages (finiteness)."""

    n: int
    p: int
    dtype: np.dtype
    block_rows: int
    _read: Any = field(repr=False)
    store: Any = None
    array: str = ""
    cache_bytes: int = 0
    _checked: set = field(default_factory=set, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)
    _cached_bytes: int = field(default=0, repr=False)
    _scratch: dict = field(default_factory=dict, repr=False)   # dtype -> [array, in use]

    @classmethod
    def from_array(cls, X: Any, block_rows: int | None = None, *, cache_bytes: int = 0) -> "Rows":
        """Blocks of an in-memory array (N, ...) (flattened to (N, P), never copied whole unless
        ``cache_bytes`` asks for it: the tests' stand-in for a store)."""
        X = np.asarray(X)
        X2 = X.reshape(X.shape[0], -1)
        p = int(X2.shape[1])
        rows = block_rows or max(1, BLOCK_BYTES // max(1, p * X2.dtype.itemsize))
        return cls(n=int(X2.shape[0]), p=p, dtype=X2.dtype, block_rows=int(rows), _read=lambda a, b: X2[a:b],
                   cache_bytes=int(cache_bytes))

    @classmethod
    def from_store(cls, store: Any, name: str, *, cache_bytes: int = 0) -> "Rows":
        """Layer ``name`` of ``store`` (``"/logits"``: the logits), one store chunk per block, up to
        ``cache_bytes`` of them kept (module doc)."""
        arr = store.zarr_array(name)
        p = int(np.prod(arr.shape[1:], dtype=np.int64))
        what = "logits" if name == "/logits" else f"layer {name.removeprefix('layers/')!r}"

        def read(a: int, b: int) -> np.ndarray:
            x = store.read_chunk(name, a // store.chunk_rows)
            return x.reshape(x.shape[0], p)

        return cls(n=int(arr.shape[0]), p=p, dtype=np.dtype(arr.dtype), block_rows=int(store.chunk_rows),
                   _read=read, store=store, array=what, cache_bytes=int(cache_bytes))

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.block_rows)

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.block_rows, min(self.n, (i + 1) * self.block_rows)

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype cached blocks are kept in: float64 for float64 sources, else float32."""
        return np.dtype(np.float64 if self.dtype == np.float64 else np.float32)

    def block(self, i: int) -> np.ndarray:
        """Rows ``bounds(i)`` (N_b, P), in the source dtype or (a cached block, to be treated as
        read-only) the compute dtype; refused (one line naming the store) if not finite."""
        x = self._cache.get(i)
        if x is None:
            x = self._keep(i, self._load(i, self.cache_bytes > 0))
        return x

    def _load(self, i: int, convert: bool) -> np.ndarray:
        """Read and check block ``i``; ``convert``: in the compute dtype."""
        a, b = self.bounds(i)
        x = self._read(a, b)
        if i not in self._checked:
            if self.store is not None:
                from repsim.store.finite import require_finite

                require_finite(x, self.store, self.array, first_row=a)
            elif not np.all(np.isfinite(x)):
                raise ValueError("features contain NaN or inf")
            self._checked.add(i)
        if convert and x.dtype != self.compute_dtype:
            x = x.astype(self.compute_dtype)
        return x

    def _keep(self, i: int, x: np.ndarray) -> np.ndarray:
        """Cache block ``i`` if it still fits ``cache_bytes`` (a private copy of an array's block)."""
        if self.cache_bytes > 0 and self._cached_bytes + x.nbytes <= self.cache_bytes:
            if x.dtype != self.compute_dtype or not x.flags.owndata:
                x = np.array(x, dtype=self.compute_dtype)
            x.flags.writeable = False
            self._cache[i] = x
            self._cached_bytes += x.nbytes
        return x

    def _iter_blocks(self, indices: list[int], keep: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        """``(i, block(i))`` for ``indices`` in order; blocks read now are cached only with ``keep``."""
        keep = keep and self.cache_bytes > 0
        for i in indices:
            x = self._cache.get(i)
            yield i, (x if x is not None else self._keep(i, self._load(i, True)) if keep else self._load(i, False))

    @contextmanager
    def scratch(self, dtype: Any) -> Iterator[np.ndarray]:
        """A (block_rows, p) array of ``dtype`` for one pass's per-block temporaries, kept on this
        object and handed to the next pass again (a fresh one while another pass holds it).

        A pass that allocated and freed its block-sized temporaries block after block left glibc's
        heap holding freed blocks of several sizes (its mmap threshold rises to the largest block
        freed, so later blocks come from the heap, not mmap): the streamed linear probe's peak RSS
        at ``--memory-budget 8`` grew 111 -> 160 MiB for 10k -> 40k rows of a 512-wide float16 layer
        (8,192-row chunks) while its traced allocations grew 50 -> 72 MiB (issue 43 item 12).
        Reused buffers leave nothing to strand, and save the page faults of fresh ones."""
        key = np.dtype(dtype)
        slot = self._scratch.get(key)
        if slot is None or slot[1]:
            buf = np.empty((self.block_rows, self.p), dtype=key)
            if slot is None:
                slot = self._scratch[key] = [buf, False]
            else:                                   # nested passes: this one gets its own
                yield buf
                return
        slot[1] = True
        try:
            yield slot[0]
        finally:
            slot[1] = False

    def blocks(self, select: np.ndarray | None = None, *, keep: bool = True, into: np.ndarray | None = None
               ) -> Iterator[tuple[np.ndarray | slice, np.ndarray]]:
        """Yield ``(positions, X)`` per block: ``X`` holds rows ``select[positions]`` (all rows, in
        order, when ``select`` is None: positions is then a slice). ``select`` may be in any order;
        blocks holding none of its rows are not read. ``keep=False``: blocks read now are not added
        to the cache (a caller that keeps its own copy); cached ones are still used. ``X`` may be a
        cached block (select None): not to be written. ``into`` (a (block_rows, p) array of the
        source dtype, :meth:`scratch`): the selected rows are gathered into it, and ``X`` is a view
        of it, overwritten by the next block. Each block is dropped before the next is read."""
        if select is None:
            for i, x in self._iter_blocks(list(range(self.n_blocks)), keep):
                a, b = self.bounds(i)
                yield slice(a, b), x
                del x
            return
        select = np.asarray(select, dtype=np.int64)
        perm = np.argsort(select, kind="stable")
        srt = select[perm]
        spans = {}
        for i in range(self.n_blocks):
            a, b = self.bounds(i)
            lo, hi = np.searchsorted(srt, [a, b])
            if hi > lo:
                spans[i] = (a, int(lo), int(hi))
        for i, x in self._iter_blocks(list(spans), keep):
            a, lo, hi = spans[i]
            idx = srt[lo:hi] - a
            if into is not None and into.dtype == x.dtype:
                rows = np.take(x, idx, axis=0, out=into[:idx.size], mode="clip")  # ("raise" buffers out)
            else:
                rows = x[idx]
            del x
            yield perm[lo:hi], rows
            del rows


def nbytes_in_memory(n: int, p: int, itemsize: int = 4, copies: int = 4) -> int:
    """What an in-memory probe holds for an (n, p) layer: ``copies`` float32 copies (features, their
    centred/rotated or normalised copy, a products' block): the route choice's estimate."""
    return int(n) * int(p) * int(itemsize) * int(copies)
