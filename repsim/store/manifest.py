"""The checksum manifest: which chunk object belongs at which array and chunk index.

Every chunk object ends in the crc32c of its bytes, which proves them intact but not in place: two
valid chunk files of one array swapped on disk, a chunk moved to another index, or copied from
another array or another store all pass their own checksum and would be read as data of the wrong
examples.  A store of version 2 (:data:`repsim.store.format.STORE_VERSION`) therefore records, when
chunk ``i`` is written, the crc32c of every per-example array's chunk ``i`` in one row of the array
``checksums`` (``(n_chunks, 1 + arrays)`` uint32, chunked one row per chunk index so that writers of
disjoint chunks never share an object): column 0 holds ``i`` itself (so a moved row is caught too),
the other columns follow the array paths listed in its attribute ``arrays``.  The head's two
single-chunk arrays record theirs in the ``checksums`` array's attribute ``chunk_crc32c`` (null
while the store has no head), so that a ``head`` group copied from another store is refused like a
copied layer (stores written before issue 43 record them in the ``head`` group's own attribute of
that name, which a copied group brings along: read as before).  Every read
compares the object's trailer with the recorded value (:class:`Manifest`), and so does
``repsim check``.

Stores of version 1 (written before the manifest existed) have no such record: their chunks are
verified by their own crc32c only, as before, and ``repsim check`` says so.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

MANIFEST = "checksums"
HEAD_ATTR = "chunk_crc32c"
FOREIGN = 1 << 32  # the expected crc32c of a head group the store never wrote: no chunk's crc32c equals it


def manifest_columns(layers: Sequence[str], has_logits: bool, has_token_counts: bool = False) -> list[str]:
    """The per-example arrays whose chunk checksums the manifest records, in column order."""
    return ["example_ids", "labels", *(["logits"] if has_logits else []),
            *(["token_counts"] if has_token_counts else []), *(f"layers/{name}" for name in layers)]


def manifest_row(i: int, columns: Sequence[str], crcs: dict[str, int]) -> np.ndarray:
    """Row ``i`` of the manifest: ``[i, crc of columns[0], ...]`` (uint32)."""
    missing = [c for c in columns if c not in crcs]
    if missing:
        raise ValueError(f"chunk {i}: no checksum for {missing}")
    return np.array([[i, *(crcs[c] for c in columns)]], dtype=np.uint32)


class Manifest:
    """Recorded crc32c per (array path, chunk index) of one store; rows are read once, on demand.

    ``rows`` reads rows of the ``checksums`` array (a picklable reader that verifies each row's own
    crc32c), ``columns`` its ``arrays`` attribute, ``head`` the head group's ``chunk_crc32c``, and
    ``written`` the per-chunk flags of an incomplete store (None when complete): an unwritten chunk
    has no record yet and is not checked.
    """

    def __init__(self, rows: Any, columns: Sequence[str], head: dict[str, int] | None,
                 written: np.ndarray | None = None):
        self.rows = rows
        self.columns = {name: k + 1 for k, name in enumerate(columns)}
        self.head = {f"head/{k}": int(v) for k, v in (head or {}).items()}
        self.written = written
        self._cache: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def expected(self, array: str, c: int) -> int | None:
        """The crc32c recorded for chunk ``c`` of ``array``; None where nothing is recorded (an array
        outside the manifest such as ``written``, or a chunk an incomplete store has not written).
        Raises ``ValueError`` when chunk ``c``'s record is itself misplaced."""
        if array in self.head:
            return self.head[array]
        col = self.columns.get(array)
        if col is None or (self.written is not None and not self.written[c]):
            return None
        row = self._cache.get(c)
        if row is None:
            row = np.asarray(self.rows[c:c + 1]).reshape(-1)
            if int(row[0]) != c:
                raise ValueError(f"the checksum record at chunk index {c} is the one written for chunk "
                                 f"{int(row[0])} (a manifest chunk moved or swapped)")
            self._cache[c] = row
        return int(row[col])
