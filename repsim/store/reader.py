"""Reading activation stores: :func:`open_store` and :class:`ActivationStore` (NumPy chunks, Dask arrays).

Every read names the store, the array and the chunk when it fails (a checksum mismatch, an
undecodable or missing object); :func:`open_store` refuses incomplete stores. The layout is in
:mod:`repsim.store.format`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import numpy as np

from repsim.store.format import StoreError, _open_group, _validate, store_name


def _wrap_read_error(exc: BaseException, store: str, array: str, start: int, stop: int, chunk_rows: int) -> "StoreError":
    c0, c1 = start // chunk_rows, max(start, stop - 1) // chunk_rows
    which = f"chunk {c0}" if c0 == c1 else f"chunks {c0}..{c1}"
    return StoreError(
        f"store {store}: {array}: {which} (rows {start}:{stop}) could not be read "
        f"(corrupted or missing data): {type(exc).__name__}: {exc}"
    )


def _as_labels(raw: np.ndarray) -> np.ndarray:
    """Stored labels as read: ``(N,)`` int32 classes, or ``(N, K)`` bool multi-label targets."""
    return raw.astype(bool if raw.ndim == 2 else np.int32, copy=False)


_TOP_LEVEL = ("example_ids", "labels", "logits", "token_counts", "written")


class _ChunkReader:
    """Array-like over one zarr array chunked along its first axis whose reads raise
    :class:`StoreError` naming the store, the array and the chunk: on a checksum mismatch or
    undecodable object, on an intact object that the store's checksum manifest says belongs
    elsewhere (``manifest``; :mod:`repsim.store.manifest`), and (local stores, ``required``) on a
    chunk object that is missing from disk, which zarr would otherwise read as zeros.

    Used as the source of the dask arrays returned by :meth:`ActivationStore.layer`; picklable
    (the zarr array is reopened lazily), so it travels to ``dask.distributed`` workers.
    """

    def __init__(self, path: str, array: str, shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int,
                 written: np.ndarray | None = None, manifest: Any = None, required: bool = True):
        self.path, self.array = path, array
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.chunk_rows = chunk_rows
        self.written = written  # chunks that must exist (None: all); unwritten ones read as fill
        self.manifest = manifest  # recorded crc32c per chunk (None: a version-1 store, not recorded)
        self.required = required  # False: a missing object reads as the fill value (``written``)
        self._local = os.path.isdir(path)
        self._arr = None
        self._fast: Any = False  # False: not looked up yet; None: no fast path for this array

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arr"] = None
        state["_fast"] = False
        return state

    def _fast_chunks(self, arr):
        if self._fast is False:
            from repsim.store._chunkio import fast_chunks

            self._fast = fast_chunks(self.path, self.array, arr) if self._local else None
        return self._fast

    def _expect(self, c: int) -> int | None:
        return None if self.manifest is None else self.manifest.expected(self.array, c)

    def _error(self, exc: BaseException, start: int, stop: int) -> StoreError:
        return _wrap_read_error(exc, store_name(self.path), self.array, start, stop, self.chunk_rows)

    def _read_fast(self, arr, key: tuple, start: int, stop: int):
        """Rows ``start:stop`` (other axes whole) straight from the chunk objects, one chunk at a
        time (a failure names its chunk); ``None`` when the fast path does not apply (see
        :mod:`repsim.store._chunkio`) or an object is missing (zarr then gives the fill value)."""
        fast = self._fast_chunks(arr)
        if fast is None or stop <= start:
            return None
        if any(not (isinstance(k, slice) and k.indices(n) == (0, n, 1)) for k, n in zip(key[1:], self.shape[1:])):
            return None  # not whole along the other axes
        parts = []
        for c in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            a, b = max(start, c * self.chunk_rows), min(stop, (c + 1) * self.chunk_rows)
            try:
                data = fast.read((c,) + (0,) * (self.ndim - 1), expect=self._expect(c))
            except ValueError as exc:
                raise self._error(exc, a, b) from exc
            if data is None:
                return None
            off = c * self.chunk_rows
            parts.append(data[a - off:b - off])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunk_object(self, c: int) -> np.ndarray | None:
        """Chunk ``c``'s verified object body (:meth:`repsim.store._chunkio.FastChunks.read_object`:
        a zstd frame of the full chunk's little-endian bytes), or ``None`` when this array has no
        fast path or the object is missing (read it through ``[...]`` then)."""
        fast = self._fast_chunks(self._zarr())
        if fast is None or not fast.compressed:
            return None
        a, b = c * self.chunk_rows, min(self.shape[0], (c + 1) * self.chunk_rows)
        try:
            return fast.read_object((c,) + (0,) * (self.ndim - 1), expect=self._expect(c))
        except ValueError as exc:
            raise self._error(exc, a, b) from exc

    def _zarr(self):
        if self._arr is None:
            import zarr

            self._arr = zarr.open_array(self.path, path=self.array, mode="r")
        return self._arr

    def _check_present(self, arr, start: int, stop: int) -> None:
        if not self._local or stop <= start or not self.required:
            return
        for c in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            if self.written is not None and not self.written[c]:
                continue
            key = arr.metadata.encode_chunk_key((c,) + (0,) * (self.ndim - 1))
            if not os.path.exists(os.path.join(self.path, self.array, key)):
                a, b = c * self.chunk_rows, min(self.shape[0], (c + 1) * self.chunk_rows)
                raise StoreError(
                    f"store {store_name(self.path)}: {self.array}: chunk {c} (rows {a}:{b}) is missing "
                    f"from disk ({key!r} not found: never written, or deleted)"
                )

    def _read_zarr(self, arr, key: tuple, start: int, stop: int):
        """``arr[key]`` through zarr; every chunk it touches is checked against the manifest, and a
        failure is named by the first chunk that fails on its own."""
        from repsim.store._chunkio import misplaced, object_crc

        chunks = range(start // self.chunk_rows, max(start, stop - 1) // self.chunk_rows + 1)
        try:
            out = arr[key]
        except Exception as exc:  # zarr / numcodecs / OS errors -> named StoreError
            for c in chunks if len(chunks) > 1 else ():
                a, b = c * self.chunk_rows, min(self.shape[0], (c + 1) * self.chunk_rows)
                try:
                    arr[a:b]
                except Exception as one:  # noqa: BLE001 - this chunk is the one to name
                    raise self._error(one, a, b) from exc
            raise self._error(exc, start, stop) from exc
        for c in chunks if stop > start else ():
            a, b = c * self.chunk_rows, min(self.shape[0], (c + 1) * self.chunk_rows)
            try:
                expect = self._expect(c)
                found = None if expect is None else object_crc(arr, (c,) + (0,) * (self.ndim - 1))
                if found is not None:
                    misplaced(found, expect)
            except (ValueError, OSError) as exc:
                raise self._error(exc, a, b) from exc
        return out

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        first = key[0] if key else slice(None)
        if isinstance(first, slice):
            start, stop, step = first.indices(self.shape[0])
            start, stop = (start, stop) if step > 0 else (stop + 1, start + 1)
        else:
            start = int(np.min(first)) if np.size(first) else 0
            stop = int(np.max(first)) + 1 if np.size(first) else 0
        arr = self._zarr()
        self._check_present(arr, start, stop)
        if isinstance(first, slice) and first.indices(self.shape[0])[2] == 1 and len(key) <= self.ndim:
            out = self._read_fast(arr, key, start, stop)
            if out is not None:
                return out
        return self._read_zarr(arr, key, start, stop)


# ----------------------------------------------------------------------------------------------
# reading


class ActivationStore:
    """A read-only view of an activation store (see module docstring for the layout)."""

    def __init__(self, path: str | os.PathLike, group: Any, members: Any = None):
        self.path = str(path)
        self.name = store_name(self.path)
        # nodes by path, fetched once (format._Members); a store is read-only, so they stay valid
        self._group = group if members is None else members
        self._readers: dict[str, _ChunkReader] = {}
        self.attrs: dict[str, Any] = dict(group.attrs)
        self.layers: list[str] = list(self.attrs.get("layers", []))
        ids = group["example_ids"]
        self.n: int = int(ids.shape[0])
        self.chunk_rows: int = int(ids.chunks[0])
        self.complete: bool = bool(self.attrs.get("complete", False))
        self._cache: dict[str, Any] = {}

    def __repr__(self) -> str:
        state = "complete" if self.complete else "INCOMPLETE"
        return f"ActivationStore({self.path!r}, n={self.n}, layers={len(self.layers)}, {state})"

    # metadata ----------------------------------------------------------------------------------
    @property
    def model(self) -> dict[str, Any]:
        return dict(self.attrs.get("model") or {})

    @property
    def dataset(self) -> dict[str, Any]:
        return dict(self.attrs.get("dataset") or {})

    @property
    def identity(self) -> str:
        """What tells this store from any other written at the same path: its ``store_uuid`` (a random
        id written at creation), or for a store written before repsim recorded one, a digest of its
        attributes and of the modification time of its metadata (``zarr.json``, local stores)."""
        uid = self.attrs.get("store_uuid")
        if uid:
            return str(uid)
        h = hashlib.sha256(json.dumps(self.attrs, sort_keys=True, default=str).encode())
        meta = os.path.join(self.path, "zarr.json")
        if os.path.isfile(meta):
            h.update(str(os.stat(meta).st_mtime_ns).encode())
        return "attrs-" + h.hexdigest()[:32]

    def content_digest(self, arrays: Sequence[str]) -> str:
        """A digest of the bytes of ``arrays`` (paths such as ``layers/conv``, ``example_ids``) that
        costs one 4-byte read per chunk: every chunk object ends in the crc32c of its bytes, so the
        digest of all the trailers changes when any chunk is rewritten — in a version-1 store too,
        which has no manifest, and in a store rewritten in place under the same ``store_uuid``.
        What binds a checkpoint to the content it was computed from (:attr:`identity` binds it to
        the store only). A missing chunk object counts as "absent"."""
        from repsim.store._chunkio import object_crc

        h = hashlib.sha256()
        for name in sorted(dict.fromkeys(arrays)):
            arr = self._group[name]
            tail = (0,) * (arr.ndim - 1)
            h.update(f"{name}:{arr.shape}:{arr.dtype}".encode())
            for c in range(-(-arr.shape[0] // arr.chunks[0])):
                crc = object_crc(arr, (c,) + tail)
                h.update(b"-" if crc is None else crc.to_bytes(4, "little"))
        return "crc-" + h.hexdigest()[:32]

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_rows)

    def written(self) -> np.ndarray:
        """Per-chunk ``written`` flags (bool, ``(n_chunks,)``)."""
        return self._read_all("written").astype(bool)

    # arrays ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The store format version (``repsim_store_version``): 1 for stores written before the
        checksum manifest (:mod:`repsim.store.manifest`), whose chunk positions are not verified."""
        return int(self.attrs.get("repsim_store_version", 1))

    def _flags(self) -> np.ndarray | None:
        """The ``written`` flags of an incomplete store (chunks that must exist), None when complete."""
        if "written" not in self._cache:
            self._cache["written"] = None if self.complete else self.written()
        return self._cache["written"]

    def _manifest(self) -> Any:
        """The checksum manifest of a version-2 store (read on demand), None for version 1."""
        if "manifest" not in self._cache:
            from repsim.store.manifest import FOREIGN, HEAD_ATTR, MANIFEST, Manifest

            manifest = None
            if self.version >= 2:
                arr = self._group[MANIFEST]
                rows = _ChunkReader(self.path, MANIFEST, arr.shape, arr.dtype, 1, self._flags())
                rows._arr = arr
                attrs = dict(arr.attrs)
                own = dict(self._group["head"].attrs).get(HEAD_ATTR) if "head" in self._group else None
                if HEAD_ATTR in attrs:  # the root's record binds the head to this store (a copied group has
                    head = attrs[HEAD_ATTR]  # its own store's record in its attributes)
                    if head is None and own is not None:  # a head group this store never wrote
                        head = {k: FOREIGN for k in own}
                else:  # stores written before the root recorded it: the head group's own record
                    head = own
                manifest = Manifest(rows, list(attrs.get("arrays", [])), head, self._flags())
            self._cache["manifest"] = manifest
        return self._cache["manifest"]

    def _reader(self, array: str) -> _ChunkReader:
        """The (cached) chunk reader of ``array``: its zarr array and fast-path lookup are made once
        per store, not once per chunk read. ``written`` (one flag per chunk; a flag never set has no
        object) and the head (one chunk) are read through one too, so their failures are named."""
        reader = self._readers.get(array)
        if reader is None:
            arr = self._group[array]
            if array == "written":
                reader = _ChunkReader(self.path, array, arr.shape, arr.dtype, 1, required=False)
            else:
                rows = arr.chunks[0] if array.startswith("head/") else self.chunk_rows
                reader = _ChunkReader(self.path, array, arr.shape, arr.dtype, rows,
                                      None if array.startswith("head/") else self._flags(), self._manifest())
            reader._arr = arr
            self._readers[array] = reader
        return reader

    def _read_all(self, name: str) -> np.ndarray:
        return self._reader(name)[:]

    @property
    def example_ids(self) -> np.ndarray:
        if "example_ids" not in self._cache:
            ids = self._read_all("example_ids").astype(np.int64, copy=False)
            ids.flags.writeable = False  # cached and shared: callers copy before modifying
            self._cache["example_ids"] = ids
        return self._cache["example_ids"]

    @property
    def multilabel(self) -> bool:
        """True when ``labels`` holds multi-label targets ``(N, K)`` bool rather than one class per example."""
        return self._group["labels"].ndim == 2

    @property
    def labels(self) -> np.ndarray:
        """``(N,)`` int32 classes, or ``(N, K)`` bool targets of a multi-label store (:attr:`multilabel`)."""
        if "labels" not in self._cache:
            labels = _as_labels(self._read_all("labels"))
            labels.flags.writeable = False
            self._cache["labels"] = labels
        return self._cache["labels"]

    def label_rows(self, start: int, stop: int) -> np.ndarray:
        """``labels[start:stop]`` read from the chunks holding those rows only (a task of a few blocks
        needs its own rows, not every chunk of the store: :attr:`labels` reads and caches all)."""
        if "labels" in self._cache:
            return self._cache["labels"][start:stop]
        return _as_labels(self._reader("labels")[start:stop])

    @property
    def token_counts(self) -> np.ndarray | None:
        """``(N,)`` int32: each example's number of real (unpadded) tokens, recorded in a text store
        whose token layers are kept whole (``extract --tokens flatten``: padded positions hold zeros,
        so an average over tokens must divide by this count, not by the token axis); None when the
        store has none (image stores, reduced tokens, stores written before the array existed)."""
        if "token_counts" not in self._group:
            return None
        if "token_counts" not in self._cache:
            counts = self._read_all("token_counts").astype(np.int32, copy=False)
            counts.flags.writeable = False
            self._cache["token_counts"] = counts
        return self._cache["token_counts"]

    @property
    def has_logits(self) -> bool:
        return "logits" in self._group

    @property
    def logits(self):
        """Logits as a dask array ``(N, K)`` chunked like the store, or None."""
        return self._dask("logits") if self.has_logits else None

    @property
    def head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Final-layer ``(W (K, M), b (K,))`` as float32, or None when not stored."""
        if "head" not in self._group:
            return None
        W = self._read_all("head/weight").astype(np.float32, copy=False)
        b = self._read_all("head/bias").astype(np.float32, copy=False)
        return W, b

    def _check_layer(self, name: str) -> None:
        if name not in self.layers:
            raise KeyError(f"layer {name!r} is not in store {self.name} ({self.path}); available layers: {', '.join(self.layers) or '(none)'}")

    def zarr_array(self, name: str):
        """The raw ``zarr.Array`` of layer ``name``; also ``example_ids``, ``labels``, ``logits``,
        ``written`` (a layer of the same name wins; ``/logits`` always means the top-level array)
        or a group path such as ``layers/pool``."""
        if name.startswith("/") and name[1:] in _TOP_LEVEL and name[1:] in self._group:
            return self._group[name[1:]]
        if name in self.layers:
            return self._group[f"layers/{name}"]
        if name in _TOP_LEVEL and name in self._group:
            return self._group[name]
        if name.startswith("layers/") and name[len("layers/"):] in self.layers:
            return self._group[name]
        self._check_layer(name)
        raise AssertionError  # pragma: no cover (_check_layer raised)

    def read_chunk(self, name: str, i: int) -> np.ndarray:
        """Chunk ``i`` (rows ``[i*chunk_rows, min(n, (i+1)*chunk_rows))``) of ``name`` (resolved as
        in :meth:`zarr_array`) as a NumPy array; :class:`StoreError` names the store, the array and
        the chunk when it cannot be read (checksum mismatch, truncated object)."""
        arr = self.zarr_array(name)
        if not 0 <= int(i) < self.n_chunks:
            raise IndexError(f"store {self.name}: chunk {i} out of range (0..{self.n_chunks - 1})")
        start, stop = int(i) * self.chunk_rows, min(self.n, (int(i) + 1) * self.chunk_rows)
        return self._reader(arr.path)[start:stop]

    def chunk_object(self, name: str, i: int) -> tuple[np.ndarray, tuple[int, ...], np.dtype] | None:
        """Chunk ``i`` of ``name`` still encoded: ``(zstd frame (uint8), full chunk shape, dtype)``,
        its crc32c and manifest entry checked, for a decoder elsewhere (a GPU's: engine/device_decode.py);
        ``None`` when the array is not zstd in repsim's own encoding on a local disk, or the object
        is missing.  The frame decodes to the full chunk (an edge chunk is padded with the fill value)."""
        arr = self.zarr_array(name)
        if not 0 <= int(i) < self.n_chunks:
            raise IndexError(f"store {self.name}: chunk {i} out of range (0..{self.n_chunks - 1})")
        reader = self._reader(arr.path)
        body = reader.chunk_object(int(i))
        if body is None:
            return None
        return body, (self.chunk_rows, *arr.shape[1:]), np.dtype(arr.dtype)

    def layer(self, name: str):
        """Layer ``name`` as a dask array ``(N, ...)`` chunked like the store (along examples only).

        A chunk that fails to read (checksum mismatch, missing object) raises :class:`StoreError`
        naming the store, the layer and the chunk index.
        """
        self._check_layer(name)
        return self._dask(f"layers/{name}")

    def to_xarray(self, name: str):
        """Layer ``name`` as a lazy ``xarray.DataArray`` (the same checked dask array as
        :meth:`layer`): dimensions from the store's ``dimension_names`` (``example``, ``channel``,
        ``y``, ``x``, or ``feature``), the ``example`` axis labelled with ``example_ids`` and
        carrying ``label`` (single-label stores) — the one-liner README.md gives.  Needs
        ``pip install 'repsim-toolkit[xarray]'``."""
        try:
            import xarray as xr
        except ImportError as exc:
            raise ImportError("to_xarray needs xarray: pip install 'repsim-toolkit[xarray]'") from exc
        data = self.layer(name)
        dims = tuple(self.zarr_array(name).metadata.dimension_names or ()) or (
            ("example",) + tuple(f"dim_{i}" for i in range(1, data.ndim)))
        coords: dict[str, Any] = {dims[0]: self.example_ids}
        if not self.multilabel:
            coords["label"] = (dims[0], self.labels)
        return xr.DataArray(data, dims=dims, coords=coords, name=name,
                            attrs={"store": self.name, "path": str(self.path)})

    def _dask(self, array: str):
        import dask.array as da
        from dask.base import tokenize

        arr = self._group[array]
        reader = self._reader(array)
        token = tokenize(os.path.abspath(self.path), array, arr.shape, str(arr.dtype), self.chunk_rows, self.identity)
        return da.from_array(
            reader,
            chunks=(self.chunk_rows,) + tuple(arr.shape[1:]),
            name=f"repsim-{self.name}-{array.replace('/', '-')}-{token}",
            asarray=False,
            fancy=False,
            meta=np.empty((0,) * arr.ndim, dtype=arr.dtype),
        )



def open_store(path: str | os.PathLike, *, allow_incomplete: bool = False) -> ActivationStore:
    """Open an activation store read-only.

    Raises :class:`StoreError` (naming the store) when the path is not a repsim store, its schema is
    inconsistent, or it is incomplete (an interrupted writer) unless ``allow_incomplete=True``.
    """
    path = str(path)
    if not os.path.exists(path) and "://" not in path:
        raise StoreError(f"store {store_name(path)}: {path} does not exist")
    group = _open_group(path, "r")
    members = _validate(path, group)
    store = ActivationStore(path, group, members)
    if not store.complete and not allow_incomplete:
        flags = store.written()
        raise StoreError(
            f"store {store.name} ({path}) is incomplete: {int(flags.sum())} of {flags.size} chunks written "
            f"and never finalized (interrupted writer?); resume it with StoreWriter.open(path) or pass "
            f"allow_incomplete=True"
        )
    return store


def store_names(stores: Sequence[Any]) -> list[str]:
    """Display names: the store's basename, or its path where two stores share a basename."""
    names = [s.name for s in stores]
    dup = {n for n in names if names.count(n) > 1}
    return [s.path if s.name in dup else s.name for s in stores]


# ----------------------------------------------------------------------------------------------
# writing
