"""Reading activation stores: :func:`open_store` and :class:`ActivationStore` (NumPy chunks, Dask arrays).

Every read names the store, the array and the chunk when it fails (a checksum mismatch, an
undecodable or missing object); :func:`open_store` refuses incomplete stores. The layout is in
:mod:`repsim.store.format`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from repsim.store.format import StoreError, _open_group, _validate, store_name


def _wrap_read_error(exc: BaseException, store: str, array: str, start: int, stop: int, chunk_rows: int) -> "StoreError":
    c0, c1 = start // chunk_rows, max(start, stop - 1) // chunk_rows
    which = f"chunk {c0}" if c0 == c1 else f"chunks {c0}..{c1}"
    return StoreError(
        f"store {store}: {array}: {which} (rows {start}:{stop}) could not be read "
        f"(corrupted or missing data): {type(exc).__name__}: {exc}"
    )


_TOP_LEVEL = ("example_ids", "labels", "logits", "written")


class _ChunkReader:
    """Array-like over one per-example zarr array whose reads raise :class:`StoreError` naming the
    store, the array and the chunk: on a checksum mismatch or undecodable object, and (local stores)
    on a chunk object that is missing from disk, which zarr would otherwise read as zeros.

    Used as the source of the dask arrays returned by :meth:`ActivationStore.layer`; picklable
    (the zarr array is reopened lazily), so it travels to ``dask.distributed`` workers.
    """

    def __init__(self, path: str, array: str, shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int,
                 written: np.ndarray | None = None):
        self.path, self.array = path, array
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.chunk_rows = chunk_rows
        self.written = written  # chunks that must exist (None: all); unwritten ones read as fill
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

    def _read_fast(self, arr, key: tuple, start: int, stop: int):
        """Rows ``start:stop`` (inside one chunk, other axes whole) straight from the chunk object;
        ``None`` when the fast path does not apply (see :mod:`repsim.store._chunkio`)."""
        fast = self._fast_chunks(arr)
        if fast is None or stop <= start:
            return None
        if any(not (isinstance(k, slice) and k.indices(n) == (0, n, 1)) for k, n in zip(key[1:], self.shape[1:])):
            return None  # not whole along the other axes
        c = start // self.chunk_rows
        if (stop - 1) // self.chunk_rows != c:
            return None
        try:
            data = fast.read((c,) + (0,) * (self.ndim - 1))
        except ValueError as exc:
            raise _wrap_read_error(exc, store_name(self.path), self.array, start, stop, self.chunk_rows) from exc
        if data is None:
            return None  # no object: zarr gives the fill value (or _check_present raised already)
        off = c * self.chunk_rows
        return data[start - off:stop - off]

    def _zarr(self):
        if self._arr is None:
            import zarr

            self._arr = zarr.open_array(self.path, path=self.array, mode="r")
        return self._arr

    def _check_present(self, arr, start: int, stop: int) -> None:
        if not self._local or stop <= start:
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
        try:
            return arr[key]
        except Exception as exc:  # zarr / numcodecs / OS errors -> named StoreError
            raise _wrap_read_error(exc, store_name(self.path), self.array, start, stop, self.chunk_rows) from exc


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

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_rows)

    def written(self) -> np.ndarray:
        """Per-chunk ``written`` flags (bool, ``(n_chunks,)``)."""
        return self._read_all("written").astype(bool)

    # arrays ------------------------------------------------------------------------------------
    def _reader(self, array: str) -> _ChunkReader:
        """The (cached) chunk reader of ``array``: its zarr array and fast-path lookup are made once
        per store, not once per chunk read."""
        reader = self._readers.get(array)
        if reader is None:
            arr = self._group[array]
            if "written" not in self._cache:  # complete: every chunk must exist; else only written ones
                self._cache["written"] = None if self.complete else self.written()
            reader = _ChunkReader(self.path, array, arr.shape, arr.dtype, self.chunk_rows, self._cache["written"])
            reader._arr = arr
            self._readers[array] = reader
        return reader

    def _read_all(self, name: str) -> np.ndarray:
        if name in ("example_ids", "labels"):
            return self._reader(name)[:]
        arr = self._group[name]
        try:
            return arr[...]
        except Exception as exc:
            raise _wrap_read_error(exc, self.name, name, 0, arr.shape[0], arr.chunks[0]) from exc

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
            labels = self._read_all("labels")
            labels = labels.astype(bool if labels.ndim == 2 else np.int32, copy=False)
            labels.flags.writeable = False
            self._cache["labels"] = labels
        return self._cache["labels"]

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
        ``pip install 'repsim[xarray]'``."""
        try:
            import xarray as xr
        except ImportError as exc:
            raise ImportError("to_xarray needs xarray: pip install 'repsim[xarray]'") from exc
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


# ----------------------------------------------------------------------------------------------
# writing
