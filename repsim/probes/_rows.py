"""Row blocks of a 2-D matrix that may not fit in memory: a store's layer or logits read chunk by chunk,
or a NumPy array read in blocks (the same code path, so tests can force it on small data).

The out-of-core probes and calibration (issue 31) make passes over :class:`Rows`; each pass holds one
block (one store chunk: ~8 MiB for the widest layer by ``repsim.store.format.default_chunk_rows``)
plus what the caller derives from it. Values are checked finite on the first pass, chunk by chunk,
with the rule every analysis applies (:func:`repsim.store.finite.require_finite`).
"""
from __future__ import annotations

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
    _checked: set = field(default_factory=set, repr=False)

    @classmethod
    def from_array(cls, X: Any, block_rows: int | None = None) -> "Rows":
        """Blocks of an in-memory array (N, ...) (flattened to (N, P), never copied whole)."""
        X = np.asarray(X)
        X2 = X.reshape(X.shape[0], -1)
        p = int(X2.shape[1])
        rows = block_rows or max(1, BLOCK_BYTES // max(1, p * X2.dtype.itemsize))
        return cls(n=int(X2.shape[0]), p=p, dtype=X2.dtype, block_rows=int(rows), _read=lambda a, b: X2[a:b])

    @classmethod
    def from_store(cls, store: Any, name: str) -> "Rows":
        """Layer ``name`` of ``store`` (``"/logits"``: the logits), one store chunk per block."""
        arr = store.zarr_array(name)
        p = int(np.prod(arr.shape[1:], dtype=np.int64))
        what = "logits" if name == "/logits" else f"layer {name.removeprefix('layers/')!r}"

        def read(a: int, b: int) -> np.ndarray:
            x = store.read_chunk(name, a // store.chunk_rows)
            return x.reshape(x.shape[0], p)

        return cls(n=int(arr.shape[0]), p=p, dtype=np.dtype(arr.dtype), block_rows=int(store.chunk_rows),
                   _read=read, store=store, array=what)

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.block_rows)

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.block_rows, min(self.n, (i + 1) * self.block_rows)

    def block(self, i: int) -> np.ndarray:
        """Rows ``bounds(i)`` (N_b, P); refused (one line naming the store) if not finite."""
        a, b = self.bounds(i)
        x = self._read(a, b)
        if i not in self._checked:
            if self.store is not None:
                from repsim.store.finite import require_finite

                require_finite(x, self.store, self.array, first_row=a)
            elif not np.all(np.isfinite(x)):
                raise ValueError("features contain NaN or inf")
            self._checked.add(i)
        return x

    def blocks(self, select: np.ndarray | None = None) -> Iterator[tuple[np.ndarray | slice, np.ndarray]]:
        """Yield ``(positions, X)`` per block: ``X`` holds rows ``select[positions]`` (all rows, in
        order, when ``select`` is None: positions is then a slice). ``select`` may be in any order;
        blocks holding none of its rows are not read."""
        if select is None:
            for i in range(self.n_blocks):
                a, b = self.bounds(i)
                yield slice(a, b), self.block(i)
            return
        select = np.asarray(select, dtype=np.int64)
        perm = np.argsort(select, kind="stable")
        srt = select[perm]
        for i in range(self.n_blocks):
            a, b = self.bounds(i)
            lo, hi = np.searchsorted(srt, [a, b])
            if hi > lo:
                yield perm[lo:hi], self.block(i)[srt[lo:hi] - a]


def nbytes_in_memory(n: int, p: int, itemsize: int = 4, copies: int = 4) -> int:
    """What an in-memory probe holds for an (n, p) layer: ``copies`` float32 copies (features, their
    centred/rotated or normalised copy, a products' block): the route choice's estimate."""
    return int(n) * int(p) * int(itemsize) * int(copies)
