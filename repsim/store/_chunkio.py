"""Direct chunk I/O for local stores in repsim's own encoding (bytes → zstd → crc32c).

Zarr's generic codec pipeline spends, per chunk, about as much CPU on buffer wrapping and copies
(``np.append`` for the checksum, a decode into a fresh buffer, a copy into the selection) as zstd
itself takes: 71 ms to read a 33.6 MB float16 chunk through ``zarr.Array`` against 45 ms for the
same file read, checksummed and decompressed straight into its output array (2-core CI box).
Extraction writes and every analysis pass are bound by exactly that on a CPU, so repsim reads and
writes whole chunks of its *own* arrays directly, byte-compatible with zarr:

* the chunk object is ``zstd(raw little-endian bytes of the full chunk) + crc32c`` (4 bytes,
  little endian) — what zarr writes for ``codecs = [bytes(little), zstd(level, checksum=false),
  crc32c]``, the encoding :func:`repsim.save_store` uses — or, for stores created with
  ``compression="none"``, the raw bytes + crc32c (``[bytes(little), crc32c]``); edge chunks hold
  the full chunk shape, padded with the fill value, as in zarr;
* the key comes from the array's own ``chunk_key_encoding``; the file is written to a temporary
  name in the array's folder and renamed into place, so a crash never leaves a torn chunk behind
  (``StoreWriter.finalize``, which runs once every writer is done, deletes the leftovers of a
  killed one: :func:`remove_stale_parts`).

:class:`FastChunks` is built only for arrays on a local file system whose metadata match that
encoding exactly (:func:`fast_chunks`); anything else (another codec, a remote store, a big-endian
host) returns ``None`` and the caller goes through zarr.  Tests check both directions against
zarr byte for byte.

A chunk's own crc32c proves only that its bytes are intact, not that they belong where they lie: a
chunk file moved or swapped within an array, or copied from another store, checks out.  The store's
checksum manifest (:mod:`repsim.store.manifest`) records, per array and chunk index, the crc32c
written there; :meth:`FastChunks.read` compares the object's trailer with it (``expect``) and
:func:`object_crc` reads the trailer of a chunk that goes through zarr instead.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Any

import numpy as np

from repsim.fileio import give_usual_mode, naming

__all__ = ["FastChunks", "fast_chunks", "object_crc", "remove_stale_parts"]

TMP_PREFIX = ".repsim-tmp-"


# zarr's own temporary of a metadata write (``zarr.json.<32 hex>.partial``-like: a name, a uuid, .partial)
_ZARR_PARTIAL = re.compile(r".*\.[0-9a-f]{32}\.partial$")


def remove_stale_parts(root: str) -> int:
    """Delete temporary files that a killed writer left under ``root`` — repsim's chunk temporaries and
    zarr's ``*.<uuid>.partial`` of an interrupted metadata write (which every later open warned about);
    returns how many."""
    removed = 0
    for folder, _, files in os.walk(root):
        for f in files:
            if (f.startswith(TMP_PREFIX) and f.endswith(".part")) or _ZARR_PARTIAL.match(f):
                try:
                    os.unlink(os.path.join(folder, f))
                    removed += 1
                except OSError:
                    pass
    return removed


RAW = "raw"


def _codec_spec(arr: Any) -> int | str | None:
    """zstd level when ``arr``'s codecs are exactly bytes(little) → zstd(no checksum) → crc32c,
    :data:`RAW` for bytes(little) → crc32c, else ``None``."""
    meta = arr.metadata
    if getattr(meta, "zarr_format", None) != 3 or sys.byteorder != "little":
        return None
    codecs = [c.to_dict() for c in meta.codecs]
    names = [c.get("name") for c in codecs]
    if names not in (["bytes", "zstd", "crc32c"], ["bytes", "crc32c"]):
        return None
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if endian not in ("little", None) or getattr(meta, "storage_transformers", ()):
        return None
    if names[1] == "crc32c":
        return RAW
    zconf = codecs[1].get("configuration") or {}
    if zconf.get("checksum", False):
        return None
    return int(zconf.get("level", 0))


class FastChunks:
    """Whole-chunk reads and writes of one local zarr v3 array in repsim's encoding."""

    def __init__(self, root: str, array_path: str, arr: Any, level: int | str):
        from numcodecs import Zstd

        self.dir = os.path.join(os.path.abspath(root), *array_path.split("/"))  # errors name full paths
        self.shape = tuple(int(s) for s in arr.shape)
        self.chunks = tuple(int(c) for c in arr.metadata.chunk_grid.chunk_shape)
        self.dtype = np.dtype(arr.dtype)
        self.fill = arr.metadata.fill_value
        self._key = arr.metadata.encode_chunk_key
        self._zstd = None if level == RAW else Zstd(level=level)
        self._nbytes = int(np.prod(self.chunks)) * self.dtype.itemsize

    def _check_grid(self, index: tuple[int, ...]) -> None:
        if len(index) != len(self.shape) or any(i < 0 or i * c >= max(s, 1) for i, c, s in
                                                zip(index, self.chunks, self.shape)):
            raise IndexError(f"chunk {index} is outside the grid of an array of shape {self.shape}")

    def path(self, index: tuple[int, ...]) -> str:
        return os.path.join(self.dir, *self._key(tuple(index)).split("/"))

    def extent(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        """The part of the full chunk ``index`` that lies inside the array."""
        return tuple(slice(0, min(c, s - i * c)) for i, c, s in zip(index, self.chunks, self.shape))

    @property
    def compressed(self) -> bool:
        """True when chunk objects are zstd frames (+ crc32c), False for raw bytes (+ crc32c)."""
        return self._zstd is not None

    def read_object(self, index: tuple[int, ...], expect: int | None = None) -> np.ndarray | None:
        """The verified body of chunk ``index``'s object — its zstd frame (or raw bytes), the crc32c
        trailer (and ``expect``: the manifest's entry) checked and cut off — as a uint8 array, decoded by
        :meth:`read` or elsewhere (on a GPU: :mod:`repsim.engine.device_decode`); ``None`` when the
        object does not exist.  A raw object is read straight into a writable buffer (the chunk's array
        is then a view of it).  The same checks and errors as :meth:`read`."""
        import google_crc32c

        self._check_grid(index)
        try:
            with open(self.path(index), "rb") as fh:
                if self._zstd is None:  # raw: read straight into the (writable) output buffer
                    buf = np.empty(self._nbytes + 4, dtype=np.uint8)
                    got = fh.readinto(buf)
                    if got != buf.size or fh.read(1):
                        raise ValueError(f"chunk object is not {buf.size} bytes long (raw chunk + crc32c)")
                else:
                    buf = np.frombuffer(fh.read(), dtype=np.uint8)
        except FileNotFoundError:
            return None
        if buf.size < 4:
            raise ValueError(f"chunk object of {buf.size} bytes is truncated")
        body = buf[:-4]
        if np.uint32(google_crc32c.value(body)).tobytes() != buf[-4:].tobytes():
            raise ValueError("Stored and computed checksum do not match (crc32c)")
        if expect is not None:
            misplaced(int.from_bytes(buf[-4:].tobytes(), "little"), expect)
        return body

    def read(self, index: tuple[int, ...], expect: int | None = None) -> np.ndarray | None:
        """Chunk ``index`` cut to the array's extent; ``None`` when its object does not exist.

        Raises ``ValueError`` on a checksum mismatch, an object that does not decode to the chunk's
        size, or (``expect``: the crc32c the store's manifest recorded for this array and index) an
        intact object whose crc32c is not the one written at this position (the caller names store,
        array and chunk).
        """
        body = self.read_object(index, expect)
        if body is None:
            return None
        if self._zstd is None:
            out = body.view(self.dtype).reshape(self.chunks)
        else:
            out = np.empty(self.chunks, dtype=self.dtype)
            try:
                self._zstd.decode(body, out=out)
            except Exception as exc:  # wrong size or corrupt frame
                raise ValueError(f"chunk object does not decode to {self._nbytes} bytes: {exc}") from exc
        ext = self.extent(index)
        return out if all(e.stop == c for e, c in zip(ext, self.chunks)) else out[ext]

    def encode(self, data: np.ndarray, index: tuple[int, ...]) -> tuple[Any, bytes]:
        """The chunk object for ``data`` (the chunk's in-array extent, already in the array's dtype)
        as two parts, ``(body, crc32c)``, to be written one after the other (no concatenated copy)."""
        import google_crc32c

        ext = self.extent(index)
        want = tuple(e.stop for e in ext)
        if data.shape != want or data.dtype != self.dtype:
            raise ValueError(f"chunk {index}: got {data.shape} {data.dtype}, expected {want} {self.dtype}")
        if want != self.chunks:  # edge chunk: zarr stores the full chunk shape, padded with fill
            full = np.full(self.chunks, self.fill, dtype=self.dtype)
            full[ext] = data
            data = full
        data = np.ascontiguousarray(data)
        body = data.reshape(-1).view(np.uint8) if self._zstd is None else np.frombuffer(
            self._zstd.encode(data), dtype=np.uint8)
        return body, np.uint32(google_crc32c.value(body)).tobytes()

    def write(self, data: np.ndarray, index: tuple[int, ...]) -> int:
        """Encode and write chunk ``index`` atomically (temporary file + rename); returns its crc32c
        (what the store's checksum manifest records for this array and index)."""
        self._check_grid(index)
        body, crc = self.encode(data, index)
        path = self.path(index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # the temporary file sits in the array's folder, outside its chunk tree ``c/``
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=TMP_PREFIX, suffix=".part")
        try:
            give_usual_mode(fd)
            with naming(path), os.fdopen(fd, "wb") as fh:
                fh.write(memoryview(body))
                fh.write(crc)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return int.from_bytes(crc, "little")


def misplaced(found: int, expect: int) -> None:
    """Raise ``ValueError`` when an intact chunk object's crc32c ``found`` is not ``expect``, the one
    the manifest recorded for its array and index: it was written elsewhere (moved or swapped within
    the array, taken from another array, or copied from another store)."""
    if expect == 1 << 32:  # repsim.store.manifest.FOREIGN: no such object was written with this store
        raise ValueError("this store was written without it, so the object was copied from another store (its "
                         f"crc32c {found:08x} is recorded nowhere in this store's manifest)")
    if found != expect:
        raise ValueError(f"the chunk object is intact but is not the one written here: its crc32c {found:08x} "
                         f"differs from {expect:08x}, recorded for this array and chunk index (moved, swapped or "
                         "copied from elsewhere)")


def object_crc(arr: Any, index: tuple[int, ...]) -> int | None:
    """The crc32c trailer (the last 4 bytes, little endian) of chunk ``index``'s object of the zarr
    array ``arr``, through zarr's store (any store); ``None`` when the object does not exist."""
    from zarr.abc.store import SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    sp = arr.store_path
    key = "/".join(p for p in (sp.path, arr.metadata.encode_chunk_key(tuple(index))) if p)
    buf = sync(sp.store.get(key, prototype=default_buffer_prototype(), byte_range=SuffixByteRequest(4)))
    return None if buf is None else int.from_bytes(buf.to_bytes(), "little")


def fast_chunks(root: str, array_path: str, arr: Any) -> FastChunks | None:
    """A :class:`FastChunks` for ``arr`` (at ``root/array_path`` on a local disk), or ``None`` when
    its encoding or storage is not the one this fast path implements."""
    if not os.path.isdir(os.path.join(root, *array_path.split("/"))):
        return None
    try:
        level = _codec_spec(arr)
    except Exception:  # unexpected metadata layout: let zarr handle it
        return None
    if level is None:
        return None
    return FastChunks(root, array_path, arr, level)
