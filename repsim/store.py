"""Activation stores: Zarr v3 groups holding one network's activations on one dataset split.

Layout (DESIGN.md "Activation store"; CONTRACTS.md "Store")::

    <store>.zarr/            attrs: repsim_store_version, model{...}, dataset{...}, layers[...],
                                    created, complete, repsim_version
      example_ids   (N,)         int64    dims (example,)
      labels        (N,)         int32    dims (example,)
      logits        (N, K)       float32  dims (example, class)             optional
      layers/<name> (N, ...)     float16/float32/float64, dims (example, channel, y, x) for 4-D,
                                          (example, feature) for 2-D
      head/weight   (K, M)       float32  dims (class, feature)             optional
      head/bias     (K,)         float32  dims (class,)                     optional
      written       (n_chunks,)  bool     dims (chunk,), one flag per storage object

Every per-example array is chunked along examples only, with the same ``chunk_rows``, so the
writer of chunk ``i`` touches exactly one object per array and ranks writing disjoint chunks never
race. ``chunk_rows`` defaults to :func:`default_chunk_rows` (every layer chunk >= 1 MiB, the widest
<= 128 MiB). Chunks are compressed with zstd and followed by a crc32c checksum codec, so a corrupted
chunk fails loudly on read; every chunk is stored as an object even when it is all zeros, so a
deleted chunk is an error too, never silently read as zeros. Every read through
:class:`ActivationStore` names the store, the array and the chunk when it fails. ``complete`` is set
last, after every ``written`` flag is true; an interrupted writer leaves ``complete = False`` and
:func:`open_store` refuses the store until it is resumed (:meth:`StoreWriter.open`) and finalized,
which gives the same bytes as an uninterrupted run. float16 layers refuse finite values beyond the
float16 range (|x| > 65504) instead of storing inf.

Plain ``zarr`` and ``xarray`` read a store without repsim, e.g. one layer::

    xr.open_zarr(path, group="layers", consolidated=False, drop_variables=[other layers])

(layers of different widths reuse the dimension name ``channel``/``feature`` with different sizes,
so xarray needs them opened one at a time, or the root group for ids, labels and logits).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
from typing import Any, Iterable, Mapping

import numpy as np

STORE_VERSION = 1
DEFAULT_CHUNK_BYTES = 1 << 20  # smallest layer chunk, default (>= 1 MB per chunk)
MAX_CHUNK_BYTES = 128 << 20  # largest layer chunk, default cap (wide conv layers)
ZSTD_LEVEL = 1  # level 1 compresses post-ReLU float16 ~2x faster than 3 (323 vs 163 MB/s/core) for ~1% larger chunks (extract bench)

__all__ = [
    "StoreError",
    "ActivationStore",
    "StoreWriter",
    "save_store",
    "open_store",
    "default_chunk_rows",
    "store_name",
    "dimension_names",
]


class StoreError(ValueError):
    """An activation store is missing, invalid, incomplete or corrupted; the message names the store."""


# ----------------------------------------------------------------------------------------------
# helpers


def store_name(path: str | os.PathLike) -> str:
    """A store's display name: the basename of its path without ``.zarr``."""
    base = os.path.basename(os.path.normpath(str(path)))
    return base[:-5] if base.endswith(".zarr") else base


def dimension_names(ndim: int, kind: str = "layer") -> tuple[str, ...]:
    """Dimension names of an array with ``ndim`` dimensions whose first axis is examples.

    Layers: 2-D ``(example, feature)``, 3-D ``(example, channel, x)``, 4-D ``(example, channel, y,
    x)``, otherwise ``(example, dim1, ...)``. Logits: ``(example, class)``.
    """
    if kind == "logits":
        return ("example", "class")
    tails = {1: (), 2: ("feature",), 3: ("channel", "x"), 4: ("channel", "y", "x")}
    tail = tails.get(ndim, tuple(f"dim{k}" for k in range(1, ndim)))
    return ("example", *tail)


COMPRESSIONS = ("zstd", "none")


def _codecs(compression: str = "zstd") -> dict[str, Any]:
    """Codecs of every store array: zstd then a crc32c of the compressed bytes (a flipped bit is
    caught before decoding); ``compression="none"`` keeps only the crc32c (layer arrays, on request:
    uncompressed chunks cost no CPU to write or read, at 1.5-2x the disk space of post-ReLU float16)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "none":
        return {"compressors": [Crc32cCodec()]}
    return {"compressors": [ZstdCodec(level=ZSTD_LEVEL, checksum=False), Crc32cCodec()]}


def default_chunk_rows(
    row_bytes: Iterable[int],
    n: int,
    *,
    min_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> int:
    """Rows per chunk so that every layer chunk holds >= ``min_chunk_bytes`` (1 MiB).

    ``rows = ceil(min_chunk_bytes / smallest row)``, then capped so the widest layer's chunk stays
    <= ``max_chunk_bytes`` (128 MiB; a wide early conv layer can be > 1 MB per row), at least 1 and
    at most ``n``. When the cap binds, the smallest layer's chunks fall below 1 MiB: one chunk
    size is shared by all arrays so that chunk ``i`` is one storage object in each.
    """
    sizes = [int(b) for b in row_bytes if int(b) > 0]
    if not sizes:
        return max(1, min(n, 1024))
    rows = math.ceil(min_chunk_bytes / min(sizes))
    rows = min(rows, max(1, max_chunk_bytes // max(sizes)))
    return int(max(1, min(rows, max(n, 1))))


def _float_dtype(dtype: Any, what: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"{what}: dtype {dt} is not supported; use float16, float32 or float64")
    return dt


def _cast(x: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Cast to ``dtype``; refuse finite values that would overflow to inf (float16: |x| > 65504)."""
    x = np.asarray(x)
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if x.dtype.kind not in "fiub":
        raise ValueError(f"{what}: values of dtype {x.dtype} cannot be stored as {dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        out = x.astype(dtype)
    if dtype.kind == "f":
        overflow = np.isinf(out)
        if x.dtype.kind == "f":
            overflow &= ~np.isinf(x)  # inf in the input stays inf (reported by `repsim check`)
        if overflow.any():
            first = tuple(int(j) for j in np.unravel_index(int(np.argmax(overflow)), x.shape))
            big = float(np.max(np.abs(x[overflow].astype(np.float64))))
            raise ValueError(
                f"{what}: {int(overflow.sum())} finite value(s) exceed the {dtype} range "
                f"(max |x| = {big:.6g} > {float(np.finfo(dtype).max):.6g}, first at index {first}); "
                f"they would be stored as inf. Store float32 instead (dtype=np.float32)."
            )
    return out


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
            from repsim._chunkio import fast_chunks

            self._fast = fast_chunks(self.path, self.array, arr) if self._local else None
        return self._fast

    def _read_fast(self, arr, key: tuple, start: int, stop: int):
        """Rows ``start:stop`` (inside one chunk, other axes whole) straight from the chunk object;
        ``None`` when the fast path does not apply (see :mod:`repsim._chunkio`)."""
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

    def __init__(self, path: str | os.PathLike, group: Any):
        self.path = str(path)
        self.name = store_name(self.path)
        self._group = group
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
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_rows)

    def written(self) -> np.ndarray:
        """Per-chunk ``written`` flags (bool, ``(n_chunks,)``)."""
        return self._read_all("written").astype(bool)

    # arrays ------------------------------------------------------------------------------------
    def _reader(self, array: str) -> _ChunkReader:
        arr = self._group[array]
        if "written" not in self._cache:  # complete: every chunk must exist; else only written ones
            self._cache["written"] = None if self.complete else self.written()
        return _ChunkReader(self.path, array, arr.shape, arr.dtype, self.chunk_rows, self._cache["written"])

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
    def labels(self) -> np.ndarray:
        if "labels" not in self._cache:
            labels = self._read_all("labels").astype(np.int32, copy=False)
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

    def _dask(self, array: str):
        import dask.array as da
        from dask.base import tokenize

        arr = self._group[array]
        reader = self._reader(array)
        token = tokenize(os.path.abspath(self.path), array, arr.shape, str(arr.dtype), self.chunk_rows, self.attrs.get("created"))
        return da.from_array(
            reader,
            chunks=(self.chunk_rows,) + tuple(arr.shape[1:]),
            name=f"repsim-{self.name}-{array.replace('/', '-')}-{token}",
            asarray=False,
            fancy=False,
            meta=np.empty((0,) * arr.ndim, dtype=arr.dtype),
        )


def _open_group(path: str, mode: str):
    import zarr

    try:
        return zarr.open_group(path, mode=mode, zarr_format=3)
    except Exception as exc:
        raise StoreError(f"store {store_name(path)} ({path}): not a Zarr v3 group: {type(exc).__name__}: {exc}") from exc


def _validate(path: str, group: Any) -> None:
    """Schema checks shared by readers and the resuming writer; raises StoreError naming the store."""
    name = store_name(path)
    attrs = dict(group.attrs)
    version = attrs.get("repsim_store_version")
    if version is None:
        raise StoreError(f"store {name} ({path}): not a repsim activation store (no repsim_store_version attribute)")
    if version != STORE_VERSION:
        raise StoreError(f"store {name} ({path}): store version {version} is not supported (expected {STORE_VERSION})")
    for req in ("example_ids", "labels", "written"):
        if req not in group:
            raise StoreError(f"store {name} ({path}): missing array {req!r}")
    n, rows = group["example_ids"].shape[0], group["example_ids"].chunks[0]
    for req in ("labels", "logits"):
        if req in group and (group[req].shape[0] != n or group[req].chunks[0] != rows):
            raise StoreError(f"store {name} ({path}): {req} has shape {group[req].shape} / chunks {group[req].chunks}, expected {n} rows in chunks of {rows}")
    if group["written"].shape != (-(-n // rows),) or group["written"].chunks != (1,):
        raise StoreError(f"store {name} ({path}): written has shape {group['written'].shape} / chunks {group['written'].chunks}, expected ({-(-n // rows)},) / (1,)")
    layers = attrs.get("layers")
    if not isinstance(layers, list):
        raise StoreError(f"store {name} ({path}): attribute 'layers' is missing or not a list")
    for layer in layers:
        key = f"layers/{layer}"
        if key not in group:
            raise StoreError(f"store {name} ({path}): layer {layer!r} is listed in attrs but has no array {key!r}")
        arr = group[key]
        if arr.shape[0] != n or arr.chunks[0] != rows or tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
            raise StoreError(f"store {name} ({path}): layer {layer!r} has shape {arr.shape} / chunks {arr.chunks}; expected {n} rows chunked by {rows} along examples only")


def open_store(path: str | os.PathLike, *, allow_incomplete: bool = False) -> ActivationStore:
    """Open an activation store read-only.

    Raises :class:`StoreError` (naming the store) when the path is not a repsim store, its schema is
    inconsistent, or it is incomplete (an interrupted writer) unless ``allow_incomplete=True``.
    """
    path = str(path)
    if not os.path.exists(path) and "://" not in path:
        raise StoreError(f"store {store_name(path)}: {path} does not exist")
    group = _open_group(path, "r")
    _validate(path, group)
    store = ActivationStore(path, group)
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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _prepare_path(path: str, overwrite: bool) -> None:
    if not os.path.exists(path):
        return
    if not overwrite:
        raise StoreError(f"store {store_name(path)}: {path} already exists (pass overwrite=True to replace it)")
    is_zarr = os.path.isfile(os.path.join(path, "zarr.json"))
    if os.path.isdir(path) and not is_zarr and os.listdir(path):
        raise StoreError(f"store {store_name(path)}: refusing to overwrite {path}: it is a non-empty directory that is not a Zarr store")
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


class StoreWriter:
    """Incremental writer of an activation store (used by ``extract/`` and by :func:`save_store`).

    Chunk ``i`` holds rows ``[i*chunk_rows, min(n, (i+1)*chunk_rows))`` of every per-example array.
    :meth:`write_chunk` writes the data first and sets ``written[i]`` last; :meth:`finalize` checks
    every flag and sets the ``complete`` attribute last. Different processes may write disjoint
    chunks concurrently (each chunk is its own object in every array, flags included).
    """

    def __init__(self, path: str, group: Any):
        self.path = str(path)
        self.name = store_name(self.path)
        self._group = group
        attrs = dict(group.attrs)
        self.layer_names: list[str] = list(attrs["layers"])
        self.n: int = int(group["example_ids"].shape[0])
        self.chunk_rows: int = int(group["example_ids"].chunks[0])
        self.n_chunks: int = -(-self.n // self.chunk_rows)
        # every chunk becomes an object, even an all-zero one, so a missing object means data loss
        full = lambda key: group[key].with_config({"write_empty_chunks": True})  # noqa: E731
        self._layers = {name: full(f"layers/{name}") for name in self.layer_names}
        self._logits = full("logits") if "logits" in group else None
        self._ids, self._labels, self._written = full("example_ids"), full("labels"), full("written")
        # data chunks bypass zarr's codec pipeline on local disks (repsim._chunkio; byte-identical)
        from repsim._chunkio import fast_chunks

        self._fast = {id(a): fast_chunks(self.path, a.path, a)
                      for a in [*self._layers.values(), self._ids, self._labels]
                      + ([self._logits] if self._logits is not None else [])}

    # construction --------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        n: int,
        layers: Mapping[str, tuple[tuple[int, ...], Any]],
        chunk_rows: int | None = None,
        logits_dim: int | None = None,
        meta: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        compression: str = "zstd",
    ) -> "StoreWriter":
        """Create an empty store for ``n`` examples.

        ``layers`` maps each layer name (in registry order) to ``(tail_shape, dtype)``, the per-example
        shape and the stored dtype (float16/float32/float64). ``chunk_rows=None`` picks
        :func:`default_chunk_rows`. ``meta`` may carry ``model``/``dataset`` dicts and extra attributes.
        ``compression``: ``"zstd"`` (default, level 1) or ``"none"`` for the layer arrays (the
        attribute ``compression`` records it); every chunk keeps its crc32c either way.
        """
        import zarr

        path = str(path)
        n = int(n)
        if n <= 0:
            raise ValueError(f"store {store_name(path)}: n must be positive, got {n}")
        layer_codecs = _codecs(compression)  # (validates ``compression`` before anything is written)
        if not layers:
            raise ValueError(f"store {store_name(path)}: at least one layer is required")
        spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for name, (tail, dtype) in layers.items():
            if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
                raise ValueError(f"store {store_name(path)}: invalid layer name {name!r}")
            tail = tuple(int(s) for s in tail)
            if any(s <= 0 for s in tail):
                raise ValueError(f"store {store_name(path)}: layer {name!r} has invalid per-example shape {tail}")
            spec[name] = (tail, _float_dtype(dtype, f"store {store_name(path)}: layer {name!r}"))
        if chunk_rows is None:
            row_bytes = [int(np.prod(t, dtype=np.int64)) * d.itemsize for t, d in spec.values()]
            chunk_rows = default_chunk_rows(row_bytes, n)
        chunk_rows = int(chunk_rows)
        if chunk_rows <= 0:
            raise ValueError(f"store {store_name(path)}: chunk_rows must be positive, got {chunk_rows}")
        chunk_rows = min(chunk_rows, n)
        n_chunks = -(-n // chunk_rows)

        meta = dict(meta or {})
        model = dict(meta.pop("model", None) or {})
        dataset = dict(meta.pop("dataset", None) or {})
        dataset.setdefault("n", n)
        if dataset["n"] != n:
            raise ValueError(f"store {store_name(path)}: meta dataset.n = {dataset['n']} but n = {n}")
        reserved = {"repsim_store_version", "layers", "created", "complete", "repsim_version", "compression"} & set(meta)
        if reserved:
            raise ValueError(f"store {store_name(path)}: meta may not set reserved attributes {sorted(reserved)}")

        try:
            json.dumps({"model": model, "dataset": dataset, **meta})
        except TypeError as exc:
            raise ValueError(f"store {store_name(path)}: meta must be JSON-serialisable: {exc}") from exc
        _prepare_path(path, overwrite)
        from repsim import __version__

        group = zarr.open_group(path, mode="w-", zarr_format=3)
        codecs = _codecs()
        group.create_array("example_ids", shape=(n,), chunks=(chunk_rows,), dtype="int64", fill_value=0, dimension_names=["example"], **codecs)
        group.create_array("labels", shape=(n,), chunks=(chunk_rows,), dtype="int32", fill_value=0, dimension_names=["example"], **codecs)
        if logits_dim is not None:
            k = int(logits_dim)
            if k <= 0:
                raise ValueError(f"store {store_name(path)}: logits_dim must be positive, got {logits_dim}")
            group.create_array("logits", shape=(n, k), chunks=(chunk_rows, k), dtype="float32", fill_value=0.0, dimension_names=list(dimension_names(2, "logits")), **codecs)
        lg = group.create_group("layers")
        for name, (tail, dtype) in spec.items():
            lg.create_array(name, shape=(n, *tail), chunks=(chunk_rows, *tail), dtype=dtype, fill_value=0.0, dimension_names=list(dimension_names(1 + len(tail))), **layer_codecs)
        group.create_array("written", shape=(n_chunks,), chunks=(1,), dtype="bool", fill_value=False, dimension_names=["chunk"], **codecs)
        group.attrs.update(
            {
                "repsim_store_version": STORE_VERSION,
                "model": model,
                "dataset": dataset,
                "layers": list(spec),
                "compression": compression,
                "created": _now(),
                "repsim_version": __version__,
                **meta,
                "complete": False,
            }
        )
        return cls(path, group)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "StoreWriter":
        """Reopen an existing store to resume writing (its pending chunks) and finalize it."""
        path = str(path)
        if not os.path.exists(path) and "://" not in path:
            raise StoreError(f"store {store_name(path)}: {path} does not exist")
        group = _open_group(path, "r+")
        _validate(path, group)
        return cls(path, group)

    # state --------------------------------------------------------------------------------------
    def written(self) -> np.ndarray:
        """Per-chunk flags: True where :meth:`write_chunk` completed."""
        return np.asarray(self._written[...], dtype=bool)

    def pending(self) -> list[int]:
        """Indices of chunks not yet written, ascending."""
        return [int(i) for i in np.flatnonzero(~self.written())]

    def rows(self, i: int) -> tuple[int, int]:
        """Row range ``[start, stop)`` of chunk ``i``."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"store {self.name}: chunk {i} out of range (0..{self.n_chunks - 1})")
        return i * self.chunk_rows, min(self.n, (i + 1) * self.chunk_rows)

    # writing ------------------------------------------------------------------------------------
    def write_chunk(
        self,
        i: int,
        *,
        layers: Mapping[str, Any],
        labels: Any,
        example_ids: Any,
        logits: Any = None,
    ) -> None:
        """Write chunk ``i`` of every array (all layers required), then set ``written[i] = True``.

        Values are cast to each layer's stored dtype; finite values beyond float16 range raise
        ``ValueError`` naming the layer (never stored as inf).
        """
        i = int(i)
        start, stop = self.rows(i)
        m = stop - start
        sel = slice(start, stop)
        missing = [k for k in self.layer_names if k not in layers]
        extra = [k for k in layers if k not in self._layers]
        if missing or extra:
            raise ValueError(f"store {self.name}: chunk {i}: layers missing {missing} / unknown {extra}; expected {self.layer_names}")
        prepared: list[tuple[Any, np.ndarray]] = []
        for name in self.layer_names:
            arr = self._layers[name]
            x = np.asarray(layers[name])
            if x.shape != (m, *arr.shape[1:]):
                raise ValueError(f"store {self.name}: layer {name!r} chunk {i}: shape {x.shape}, expected {(m, *arr.shape[1:])}")
            prepared.append((arr, _cast(x, arr.dtype, f"store {self.name}: layer {name!r} chunk {i} (rows {start}:{stop})")))
        ids = np.asarray(example_ids)
        lab = np.asarray(labels)
        if ids.shape != (m,) or lab.shape != (m,):
            raise ValueError(f"store {self.name}: chunk {i}: example_ids {ids.shape} / labels {lab.shape}, expected ({m},)")
        if ids.dtype.kind not in "iu" or lab.dtype.kind not in "iub":
            raise ValueError(f"store {self.name}: chunk {i}: example_ids and labels must be integers (got {ids.dtype}, {lab.dtype})")
        prepared.append((self._ids, ids.astype(np.int64)))
        prepared.append((self._labels, lab.astype(np.int32)))
        if self._logits is not None:
            if logits is None:
                raise ValueError(f"store {self.name}: chunk {i}: this store has logits; pass logits=")
            lg = np.asarray(logits)
            if lg.shape != (m, self._logits.shape[1]):
                raise ValueError(f"store {self.name}: logits chunk {i}: shape {lg.shape}, expected {(m, self._logits.shape[1])}")
            prepared.append((self._logits, _cast(lg, np.dtype(np.float32), f"store {self.name}: logits chunk {i}")))
        elif logits is not None:
            raise ValueError(f"store {self.name}: chunk {i}: logits given but the store was created without logits_dim")
        for arr, data in prepared:
            fast = self._fast.get(id(arr))
            if fast is not None:
                fast.write(data, (i,) + (0,) * (data.ndim - 1))
            else:
                arr[sel] = data
        self._written[i] = True

    def set_head(self, W: Any, b: Any) -> None:
        """Store the final layer ``W (K, M)``, ``b (K,)`` as float32 under ``head/``."""
        W = np.asarray(W)
        b = np.asarray(b)
        if W.ndim != 2 or b.shape != (W.shape[0],):
            raise ValueError(f"store {self.name}: head must be W (K, M) and b (K,), got {W.shape} and {b.shape}")
        if self._logits is not None and W.shape[0] != self._logits.shape[1]:
            raise ValueError(f"store {self.name}: head has {W.shape[0]} classes but the logits have {self._logits.shape[1]}")
        W32 = _cast(W, np.dtype(np.float32), f"store {self.name}: head/weight")
        b32 = _cast(b, np.dtype(np.float32), f"store {self.name}: head/bias")
        codecs = _codecs()
        hg = self._group.require_group("head")
        w = hg.create_array("weight", shape=W.shape, chunks=W.shape, dtype="float32", fill_value=0.0, dimension_names=["class", "feature"], overwrite=True, **codecs)
        bb = hg.create_array("bias", shape=b.shape, chunks=b.shape, dtype="float32", fill_value=0.0, dimension_names=["class"], overwrite=True, **codecs)
        w.with_config({"write_empty_chunks": True})[...] = W32
        bb.with_config({"write_empty_chunks": True})[...] = b32

    def finalize(self) -> ActivationStore:
        """Check that every chunk was written, then set ``complete = True`` (the last write)."""
        pending = self.pending()
        if pending:
            shown = ", ".join(map(str, pending[:10])) + (", ..." if len(pending) > 10 else "")
            raise StoreError(f"store {self.name} ({self.path}) is incomplete: {len(pending)} of {self.n_chunks} chunks not written (chunks {shown})")
        if os.path.isdir(self.path):  # temporary chunk files of a writer killed mid-write
            from repsim._chunkio import remove_stale_parts

            remove_stale_parts(self.path)
        self._group.attrs["complete"] = True
        return open_store(self.path)


# ----------------------------------------------------------------------------------------------
# one-call save


def _is_dask(x: Any) -> bool:
    return type(x).__module__.startswith("dask.") and hasattr(x, "dask") and hasattr(x, "chunks")


def _rowwise(x: Any, what: str, n: int | None) -> Any:
    if not _is_dask(x):
        x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{what}: expected an array with examples along axis 0, got a scalar")
    if any(isinstance(s, float) and math.isnan(s) for s in x.shape):
        raise ValueError(f"{what}: dask array with unknown chunk sizes; call .compute_chunk_sizes() first")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{what}: {x.shape[0]} rows, expected {n} (rows of the first layer)")
    return x


def save_store(
    path: str | os.PathLike,
    layers: Mapping[str, Any],
    labels: Any,
    example_ids: Any = None,
    logits: Any = None,
    meta: Mapping[str, Any] | None = None,
    *,
    head: tuple[Any, Any] | None = None,
    dtype: Any = None,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    compression: str = "zstd",
) -> ActivationStore:
    """Write activations to a new store ("bring your own activations") and return it opened.

    ``layers`` maps names (kept in order) to NumPy or Dask arrays ``(N, ...)``. Dask inputs are
    streamed: chunk ``i`` of every input is computed together (so shared upstream work is done once)
    and written before the next, so peak memory is about one chunk of rows across layers,
    independent of N. ``dtype=None`` keeps float16/float32/float64 as given (integer inputs are
    refused); a dtype applies to every layer (a dict maps layer -> dtype). ``example_ids`` defaults
    to ``arange(N)``. ``head=(W, b)`` stores the final layer. ``logits`` are stored as float32.
    ``compression``: ``"zstd"`` (default) or ``"none"`` for the layers (see ``StoreWriter.create``).
    """
    path = str(path)
    sname = store_name(path)
    if not layers:
        raise ValueError(f"store {sname}: at least one layer is required")
    arrays: dict[str, Any] = {}
    n = None
    for name, x in layers.items():
        x = _rowwise(x, f"store {sname}: layer {name!r}", n)
        n = x.shape[0] if n is None else n
        arrays[name] = x
    assert n is not None
    if isinstance(dtype, Mapping) and set(dtype) - set(arrays):
        raise ValueError(f"store {sname}: dtype given for unknown layers {sorted(set(dtype) - set(arrays))}; layers: {list(arrays)}")
    spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, x in arrays.items():
        want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        if want is None:
            if np.dtype(x.dtype).kind != "f":
                raise ValueError(f"store {sname}: layer {name!r} has dtype {x.dtype}; activations must be floating point (or pass dtype=)")
            want = x.dtype
        spec[name] = (tuple(x.shape[1:]), _float_dtype(want, f"store {sname}: layer {name!r}"))
    labels = _rowwise(labels, f"store {sname}: labels", n)
    example_ids = _rowwise(np.arange(n, dtype=np.int64) if example_ids is None else example_ids, f"store {sname}: example_ids", n)
    for what, x in (("labels", labels), ("example_ids", example_ids)):
        if x.ndim != 1 or np.dtype(x.dtype).kind not in "iu" + ("b" if what == "labels" else ""):
            raise ValueError(f"store {sname}: {what} must be a 1-D integer array, got shape {x.shape} dtype {x.dtype}")
    if logits is not None:
        logits = _rowwise(logits, f"store {sname}: logits", n)
        if logits.ndim != 2:
            raise ValueError(f"store {sname}: logits must be (N, K), got shape {logits.shape}")
    if head is not None:
        if not isinstance(head, (tuple, list)) or len(head) != 2:
            raise ValueError(f"store {sname}: head must be a tuple (W, b)")
        W, b = np.shape(head[0]), np.shape(head[1])
        if len(W) != 2 or b != (W[0],):
            raise ValueError(f"store {sname}: head must be W (K, M) and b (K,), got {W} and {b}")
        if logits is not None and W[0] != logits.shape[1]:
            raise ValueError(f"store {sname}: head has {W[0]} classes but the logits have {logits.shape[1]}")
    if not _is_dask(example_ids) and np.unique(example_ids).size != n:
        raise ValueError(f"store {sname}: example_ids are not unique ({n - np.unique(example_ids).size} duplicates)")

    writer = StoreWriter.create(
        path, n=n, layers=spec, chunk_rows=chunk_rows,
        logits_dim=None if logits is None else logits.shape[1], meta=meta, overwrite=overwrite,
        compression=compression,
    )
    try:
        _fill(writer, arrays, labels, example_ids, logits, head, progress)
    except BaseException:
        # save_store cannot be resumed: leave nothing half-written behind (a SIGKILL still leaves an
        # incomplete store, which open_store refuses)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return writer.finalize()


def _fill(writer: StoreWriter, arrays: dict[str, Any], labels: Any, example_ids: Any, logits: Any,
          head: tuple[Any, Any] | None, progress: bool | None) -> None:
    """Write every chunk of ``save_store``'s inputs, computing dask chunks one at a time."""
    import sys

    import dask
    from tqdm.auto import tqdm

    rows = writer.chunk_rows
    sources: dict[tuple[str, str], Any] = {("layer", name): x for name, x in arrays.items()}
    sources[("labels", "")], sources[("ids", "")] = labels, example_ids
    if logits is not None:
        sources[("logits", "")] = logits
    lazy = {k: v for k, v in sources.items() if _is_dask(v)}
    # one Delayed per chunk: computing it returns the block itself (no finalize/concatenate copy)
    lazy = {k: v.rechunk((rows,) + v.shape[1:]).to_delayed().ravel() for k, v in lazy.items()}
    show = sys.stderr.isatty() if progress is None else bool(progress)
    for i in tqdm(range(writer.n_chunks), desc=f"save {writer.name}", unit="chunk", disable=not show):
        start, stop = writer.rows(i)
        keys = list(lazy)
        computed = dask.compute(*[lazy[k][i] for k in keys]) if keys else ()
        block = {k: v[start:stop] for k, v in sources.items() if k not in lazy}
        block.update(zip(keys, computed))
        writer.write_chunk(
            i,
            layers={name: block[("layer", name)] for name in arrays},
            labels=block[("labels", "")],
            example_ids=block[("ids", "")],
            logits=block.get(("logits", "")),
        )
        del block, computed
    if head is not None:
        writer.set_head(*head)
