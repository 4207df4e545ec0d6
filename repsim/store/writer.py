"""Writing activation stores: :class:`StoreWriter` (chunk by chunk, resumable) and :func:`save_store`.

Chunk ``i`` of every per-example array is one storage object, written data first and its
``written`` flag last; ``complete`` is set last of all (:meth:`StoreWriter.finalize`), so an
interrupted writer leaves a store that :func:`repsim.store.reader.open_store` refuses until it is
resumed. The layout is in :mod:`repsim.store.format`.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import math
import os
import shutil
import uuid
import warnings
from typing import Any, Mapping

import numpy as np

from repsim.fileio import naming
from repsim.store.format import (STORE_VERSION, StoreError, _cast, _codecs, _float_dtype, _Members, _open_group,
                                 _validate, default_chunk_rows, dimension_names, full_path, interrupted_creation,
                                 store_name)
from repsim.store.lock import lock_store
from repsim.store.manifest import HEAD_ATTR, MANIFEST, manifest_columns, manifest_row
from repsim.store.reader import ActivationStore, open_store


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _is_repsim_store(path: str) -> bool:
    """True when ``path`` is a directory whose root ``zarr.json`` carries ``repsim_store_version``."""
    try:
        with open(os.path.join(path, "zarr.json"), encoding="utf-8") as fh:
            return "repsim_store_version" in (json.load(fh).get("attributes") or {})
    except (OSError, ValueError, AttributeError):
        return False


def _prepare_path(path: str, overwrite: bool) -> None:
    """Make room for a new store at ``path``: refuse an existing one unless ``overwrite``, and never
    delete anything that is not a repsim store (a file, another Zarr group, a non-empty directory)
    or what an interrupted creation left (:func:`repsim.store.format.interrupted_creation`)."""
    if "://" in path or not os.path.lexists(path):
        return
    name, shown = store_name(path), full_path(path)
    if not overwrite:
        what = "holds an interrupted creation of a store" if interrupted_creation(path) else "already exists"
        raise StoreError(f"store {name}: {shown} {what} (pass --overwrite / overwrite=True to replace it)")
    if not os.path.isdir(path) or os.path.islink(path):
        raise StoreError(f"store {name}: refusing to overwrite {shown}: it is not a directory, so not "
                         "an activation store; remove it yourself or choose another path")
    if os.listdir(path) and not (_is_repsim_store(path) or interrupted_creation(path)):
        raise StoreError(f"store {name}: refusing to overwrite {shown}: it is a non-empty directory that "
                         "is not a repsim activation store; remove it yourself or choose another path")
    shutil.rmtree(path)


STAGING = ".creating-"  # a store is built at ``.<name>.creating-<pid>-<hex>`` beside its path, then renamed


def _staging_path(path: str) -> str:
    """Where a new store is built before it is renamed to ``path`` (so that ``path`` is either absent
    or a whole store); leftovers of killed creators (their process is gone) are removed first."""
    parent, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}{STAGING}"
    try:
        for entry in os.listdir(parent):
            pid = entry[len(prefix):].split("-", 1)[0] if entry.startswith(prefix) else ""
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    except OSError:
        pass  # the parent is missing: zarr creates it
    return os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def _publish(staging: str, path: str) -> None:
    """Rename the finished ``staging`` store to ``path``; refuses when another process put a store
    there meanwhile (two writers creating one store at once)."""
    try:
        os.rename(staging, path)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise
        raise StoreError(f"store {store_name(path)}: another process created {full_path(path)} while this one "
                         "was creating it (is another `repsim extract` or save_store writing it?); let that "
                         "one finish, or choose another path") from exc


def _build(path: str, attrs: dict[str, Any], n: int, chunk_rows: int, n_chunks: int,
           spec: Mapping[str, tuple[tuple[int, ...], np.dtype]], kinds: Mapping[str, str],
           layer_codecs: dict[str, Any], label_dim: int | None, logits_dim: int | None,
           token_counts: bool = False) -> tuple[Any, dict[str, Any]]:
    """Create the group and every array of a new store at ``path`` (the staging path of a local
    store, see :meth:`StoreWriter.create`); returns the group and its nodes by path."""
    import zarr

    from repsim import __version__

    group = zarr.open_group(path, mode="w-", zarr_format=3)
    codecs = _codecs()
    nodes: dict[str, Any] = {}  # what was created, by path: the writer needs no listing of the group
    nodes["example_ids"] = group.create_array("example_ids", shape=(n,), chunks=(chunk_rows,), dtype="int64", fill_value=0, dimension_names=["example"], **codecs)
    if label_dim is None:
        nodes["labels"] = group.create_array("labels", shape=(n,), chunks=(chunk_rows,), dtype="int32", fill_value=0, dimension_names=["example"], **codecs)
    else:
        kl = int(label_dim)
        nodes["labels"] = group.create_array("labels", shape=(n, kl), chunks=(chunk_rows, kl), dtype="bool", fill_value=False, dimension_names=["example", "class"], **codecs)
    if logits_dim is not None:
        k = int(logits_dim)
        nodes["logits"] = group.create_array("logits", shape=(n, k), chunks=(chunk_rows, k), dtype="float32", fill_value=0.0, dimension_names=list(dimension_names(2, "logits")), **codecs)
    if token_counts:
        nodes["token_counts"] = group.create_array("token_counts", shape=(n,), chunks=(chunk_rows,), dtype="int32", fill_value=0, dimension_names=["example"], **codecs)
    lg = group.create_group("layers")
    for name, (tail, dtype) in spec.items():
        nodes[f"layers/{name}"] = lg.create_array(name, shape=(n, *tail), chunks=(chunk_rows, *tail), dtype=dtype, fill_value=0.0, dimension_names=list(dimension_names(1 + len(tail), kinds[name])), **layer_codecs)
    nodes["written"] = group.create_array("written", shape=(n_chunks,), chunks=(1,), dtype="bool", fill_value=False, dimension_names=["chunk"], **codecs)
    columns = manifest_columns(list(spec), logits_dim is not None, token_counts)
    nodes[MANIFEST] = group.create_array(MANIFEST, shape=(n_chunks, 1 + len(columns)), chunks=(1, 1 + len(columns)), dtype="uint32", fill_value=0, dimension_names=["chunk", "entry"], attributes={"arrays": columns, HEAD_ATTR: None}, **codecs)
    group.update_attributes(  # one metadata write (attrs.update writes once per key)
        {
            "repsim_store_version": STORE_VERSION,
            **attrs,
            "created": _now(),
            "store_uuid": uuid.uuid4().hex,  # this store's identity (a resumed cka checks it)
            "repsim_version": __version__,
            "complete": False,
        }
    )
    return group, nodes


class StoreWriter:
    """Incremental writer of an activation store (used by ``repsim/extract/`` and by :func:`save_store`).

    Chunk ``i`` holds rows ``[i*chunk_rows, min(n, (i+1)*chunk_rows))`` of every per-example array.
    :meth:`write_chunk` writes the data first and sets ``written[i]`` last; :meth:`finalize` checks
    every flag and sets the ``complete`` attribute last. Different processes may write disjoint
    chunks concurrently (each chunk is its own object in every array, flags included).
    """

    def __init__(self, path: str, group: Any, members: Any = None):
        self.path = str(path)
        self.name = store_name(self.path)
        self._group = group
        attrs = dict(group.attrs)
        nodes = _Members(group) if members is None else members  # one concurrent metadata fetch
        self.layer_names: list[str] = list(attrs["layers"])
        self.n: int = int(nodes["example_ids"].shape[0])
        self.chunk_rows: int = int(nodes["example_ids"].chunks[0])
        # multi-label stores: labels (N, K) bool; otherwise (N,) int32
        self.label_dim: int | None = int(nodes["labels"].shape[1]) if nodes["labels"].ndim == 2 else None
        self.n_chunks: int = -(-self.n // self.chunk_rows)
        # every chunk becomes an object, even an all-zero one, so a missing object means data loss
        full = lambda key: nodes[key].with_config({"write_empty_chunks": True})  # noqa: E731
        self._layers = {name: full(f"layers/{name}") for name in self.layer_names}
        self._logits = full("logits") if "logits" in nodes else None
        self._counts = full("token_counts") if "token_counts" in nodes else None
        self._ids, self._labels, self._written = full("example_ids"), full("labels"), full("written")
        # version 2: chunk i's checksums are recorded before its flag (repsim.store.manifest)
        self._manifest = full(MANIFEST) if int(attrs.get("repsim_store_version", 1)) >= 2 else None
        self._columns: list[str] = list(self._manifest.attrs.get("arrays", [])) if self._manifest is not None else []
        # data chunks bypass zarr's codec pipeline on local disks (repsim.store._chunkio; byte-identical)
        from repsim.store._chunkio import fast_chunks

        self._fast = {id(a): fast_chunks(self.path, a.path, a)
                      for a in [*self._layers.values(), self._ids, self._labels, self._written]
                      + ([self._logits] if self._logits is not None else [])
                      + ([self._counts] if self._counts is not None else [])
                      + ([self._manifest] if self._manifest is not None else [])}

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
        label_dim: int | None = None,
        token_counts: bool = False,
    ) -> "StoreWriter":
        """Create an empty store for ``n`` examples.

        ``layers`` maps each layer name (in registry order) to ``(tail_shape, dtype)``, the per-example
        shape and the stored dtype (float16/float32/float64), or ``(tail_shape, dtype, kind)`` with
        ``kind="tokens"`` for a ``(token, feature)`` sequence (its dimension names). ``chunk_rows=None`` picks
        :func:`default_chunk_rows`. ``meta`` may carry ``model``/``dataset`` dicts and extra attributes.
        ``compression``: ``"zstd"`` (default, level 1) or ``"none"`` for the layer arrays (the
        attribute ``compression`` records it); every chunk keeps its crc32c either way.
        ``label_dim=K`` makes a multi-label store: ``labels`` is ``(N, K)`` bool (dims example, class),
        one column per target (e.g. CheXpert's findings), instead of one int32 class per example.
        ``token_counts=True`` adds ``token_counts`` ``(N,)`` int32, each example's number of real
        (unpadded) tokens, which every :meth:`write_chunk` must then give (a text store whose token
        layers keep zeros at the padded positions: an average over tokens divides by this count).

        A local store is built under a temporary name beside ``path`` (``.<name>.creating-<pid>-…``)
        and renamed into place once its arrays and attributes exist, so ``path`` is either absent or
        a whole (empty, incomplete) store: a creation interrupted by a full disk leaves nothing there
        (the temporary folder is removed; a killed creator's is removed by the next creation), and two
        processes creating one store at once cannot both succeed (the second is told so).
        """
        path = str(path)
        n = int(n)
        if n <= 0:
            raise ValueError(f"store {store_name(path)}: n must be positive, got {n}")
        layer_codecs = _codecs(compression)  # (validates ``compression`` before anything is written)
        if not layers:
            raise ValueError(f"store {store_name(path)}: at least one layer is required")
        spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        kinds: dict[str, str] = {}
        for name, (tail, dtype, *kind) in layers.items():
            kinds[name] = kind[0] if kind else "layer"
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
        reserved = {"repsim_store_version", "layers", "created", "complete", "repsim_version", "compression",
                    "store_uuid"} & set(meta)
        if reserved:
            raise ValueError(f"store {store_name(path)}: meta may not set reserved attributes {sorted(reserved)}")

        try:
            json.dumps({"model": model, "dataset": dataset, **meta})
        except TypeError as exc:
            raise ValueError(f"store {store_name(path)}: meta must be JSON-serialisable: {exc}") from exc
        for what, k in (("label_dim", label_dim), ("logits_dim", logits_dim)):
            if k is not None and int(k) <= 0:
                raise ValueError(f"store {store_name(path)}: {what} must be positive, got {k}")
        _prepare_path(path, overwrite)
        attrs = {"model": model, "dataset": dataset, "layers": list(spec), "compression": compression, **meta}
        local = "://" not in path
        build = _staging_path(path) if local else path
        try:
            with naming(full_path(path)):  # an OSError that names no file (disk full) names the store
                group, nodes = _build(build, attrs, n, chunk_rows, n_chunks, spec, kinds, layer_codecs, label_dim,
                                      logits_dim, bool(token_counts))
            if local:
                _publish(build, path)
        except BaseException:
            if local:
                shutil.rmtree(build, ignore_errors=True)
            raise
        if local:  # the nodes were opened at the staging path: open them again where they now are
            group = _open_group(path, "r+")
            nodes = None
        return cls(path, group, nodes)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "StoreWriter":
        """Reopen an existing store to resume writing (its pending chunks) and finalize it."""
        path = str(path)
        if not os.path.exists(path) and "://" not in path:
            raise StoreError(f"store {store_name(path)}: {path} does not exist")
        group = _open_group(path, "r+")
        return cls(path, group, _validate(path, group))

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
        token_counts: Any = None,
    ) -> None:
        """Write chunk ``i`` of every array (all layers required), then set ``written[i] = True``.
        ``token_counts``: the chunk's real-token counts, required exactly when the store has them.

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
        want = (m,) if self.label_dim is None else (m, self.label_dim)
        if ids.shape != (m,) or lab.shape != want:
            raise ValueError(f"store {self.name}: chunk {i}: example_ids {ids.shape} / labels {lab.shape}, expected ({m},) / {want}")
        if ids.dtype.kind not in "iu" or lab.dtype.kind not in "iub":
            raise ValueError(f"store {self.name}: chunk {i}: example_ids and labels must be integers (got {ids.dtype}, {lab.dtype})")
        if self.label_dim is not None and lab.dtype.kind != "b" and not np.isin(lab, (0, 1)).all():
            raise ValueError(f"store {self.name}: chunk {i}: multi-label targets must be bool or 0/1")
        prepared.append((self._ids, ids.astype(np.int64)))
        prepared.append((self._labels, lab.astype(np.int32) if self.label_dim is None else lab.astype(bool)))
        if self._logits is not None:
            if logits is None:
                raise ValueError(f"store {self.name}: chunk {i}: this store has logits; pass logits=")
            lg = np.asarray(logits)
            if lg.shape != (m, self._logits.shape[1]):
                raise ValueError(f"store {self.name}: logits chunk {i}: shape {lg.shape}, expected {(m, self._logits.shape[1])}")
            prepared.append((self._logits, _cast(lg, np.dtype(np.float32), f"store {self.name}: logits chunk {i}")))
        elif logits is not None:
            raise ValueError(f"store {self.name}: chunk {i}: logits given but the store was created without logits_dim")
        if self._counts is not None:
            if token_counts is None:
                raise ValueError(f"store {self.name}: chunk {i}: this store has token_counts; pass token_counts=")
            tc = np.asarray(token_counts)
            if tc.shape != (m,) or tc.dtype.kind not in "iu" or (tc < 0).any():
                raise ValueError(f"store {self.name}: chunk {i}: token_counts must be ({m},) non-negative integers, "
                                 f"got shape {tc.shape} dtype {tc.dtype}")
            prepared.append((self._counts, tc.astype(np.int32)))
        elif token_counts is not None:
            raise ValueError(f"store {self.name}: chunk {i}: token_counts given but the store was created without them")
        crcs = {arr.path: self._put(arr, data, (i,) + (0,) * (data.ndim - 1), sel) for arr, data in prepared}
        if self._manifest is not None:
            self._put(self._manifest, manifest_row(i, self._columns, crcs), (i, 0), slice(i, i + 1))
        fast = self._fast.get(id(self._written))
        if fast is not None:
            fast.write(np.ones(1, dtype=bool), (i,))
        else:
            self._written[i] = True

    def _put(self, arr: Any, data: np.ndarray, index: tuple[int, ...], sel: slice) -> int:
        """Write chunk ``index`` (rows ``sel``) of ``arr``; returns the crc32c of its object."""
        from repsim.store._chunkio import object_crc

        fast = self._fast.get(id(arr))
        if fast is not None:
            return fast.write(data, index)
        arr[sel] = data
        crc = object_crc(arr, index)
        assert crc is not None  # just written (write_empty_chunks)
        return crc

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
        if self._manifest is not None:  # the head's two chunks are bound too (repsim.store.manifest)
            from repsim.store._chunkio import object_crc

            crcs = {"weight": object_crc(w, (0, 0)), "bias": object_crc(bb, (0,))}
            hg.attrs[HEAD_ATTR] = crcs  # (what repsim before issue 43 reads)
            # recorded at the root too, where a head group copied from another store cannot bring its own
            self._manifest.attrs[HEAD_ATTR] = crcs

    def finalize(self) -> ActivationStore:
        """Check that every chunk was written, then set ``complete = True`` (the last write)."""
        pending = self.pending()
        if pending:
            shown = ", ".join(map(str, pending[:10])) + (", ..." if len(pending) > 10 else "")
            raise StoreError(f"store {self.name} ({self.path}) is incomplete: {len(pending)} of {self.n_chunks} chunks not written (chunks {shown})")
        if os.path.isdir(self.path):  # temporary chunk files of a writer killed mid-write
            from repsim.store._chunkio import remove_stale_parts

            remove_stale_parts(self.path)
        with naming(full_path(self.path)):
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
    streamed (:func:`_stream_chunks`): every chunk of every Dask input is computed exactly once,
    whatever its chunking relative to the store's, inputs that need new rows at the same store
    chunk are computed together (so upstream work they share is done once), and the next inputs'
    chunks are computed while the current ones' store chunks are written; peak memory is about one
    input chunk (two while overlapping) plus one store chunk, independent of N. ``dtype=None`` keeps
    float16/float32/float64 as given (integer inputs are refused); a dtype applies to every layer (a
    dict maps layer -> dtype). ``labels``: ``(N,)`` integer classes, or ``(N, K)`` bool / 0-1
    multi-label targets (a multi-label store). ``example_ids`` defaults
    to ``arange(N)``, with a warning when ``meta`` names no dataset: such rows align with those of
    any other N-row store; with ``meta={"dataset": {"name": ..., "split": ...}}`` stores of
    different datasets are refused when combined (``cka_matrix``, ``repsim check``). ``head=(W, b)`` stores the final layer. ``logits`` are stored as float32.
    ``compression``: ``"zstd"`` (default) or ``"none"`` for the layers (see ``StoreWriter.create``).
    While it writes, it holds the store's writer lock (:mod:`repsim.store.lock`): another writer of
    ``path`` at the same time (``save_store``, ``repsim extract``) is refused, and so is this call
    while another holds it (:class:`repsim.store.lock.StoreLocked`).
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
    if example_ids is None:
        _warn_unverifiable_rows(sname, labels, n, ((meta or {}).get("dataset") or {}).get("name"))
        if not ((meta or {}).get("dataset") or {}).get("name"):
            warnings.warn(
                f"store {sname}: example_ids default to 0..{n - 1} and no dataset is named, so its rows align "
                f"with those of any other {n}-row store; pass example_ids= (dataset indices) or "
                "meta={'dataset': {'name': ..., 'split': ...}} so that repsim can refuse stores of other data",
                UserWarning, stacklevel=2)
        example_ids = np.arange(n, dtype=np.int64)
    example_ids = _rowwise(example_ids, f"store {sname}: example_ids", n)
    for what, x in (("labels", labels), ("example_ids", example_ids)):
        multi = what == "labels" and x.ndim == 2
        if (x.ndim != 1 and not multi) or np.dtype(x.dtype).kind not in "iu" + ("b" if what == "labels" else ""):
            raise ValueError(f"store {sname}: {what} must be a 1-D integer array" + (" or (N, K) multi-label targets" if what == "labels" else "")
                             + f", got shape {x.shape} dtype {x.dtype}")
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

    # one writer per store: another save_store or `repsim extract` writing this path is refused
    with lock_store(path):
        writer = StoreWriter.create(
            path, n=n, layers=spec, chunk_rows=chunk_rows,
            logits_dim=None if logits is None else logits.shape[1], meta=meta, overwrite=overwrite,
            compression=compression, label_dim=labels.shape[1] if labels.ndim == 2 else None,
        )
        try:
            _fill(writer, arrays, labels, example_ids, logits, head, progress)
        except BaseException:
            # save_store cannot be resumed: leave nothing half-written behind (a SIGKILL still leaves an
            # incomplete store, which open_store refuses)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return writer.finalize()


def _warn_unverifiable_rows(sname: str, labels: Any, n: int, dataset: str | None) -> None:
    """Warn when default ``example_ids`` (rows taken to be in the dataset's order) leave nothing that
    could catch rows in another order: combining stores compares ids, then labels row by row, so with
    a dataset named the labels are the only check, and labels that are all equal check nothing."""
    if not dataset or n < 2:
        return
    y = np.asarray(labels.compute() if _is_dask(labels) else labels)
    if (y == y[:1]).all():
        warnings.warn(
            f"store {sname}: no example_ids given, so rows are taken to be in the order of dataset {dataset!r}, and "
            f"all {n} rows have the same label, so nothing can tell whether they are: rows in another order would "
            "be paired with other stores' rows silently. Pass example_ids= (each row's dataset index)",
            UserWarning, stacklevel=3)


def _fill(writer: StoreWriter, arrays: dict[str, Any], labels: Any, example_ids: Any, logits: Any,
          head: tuple[Any, Any] | None, progress: bool | None) -> None:
    """Write every chunk of ``save_store``'s inputs (Dask inputs through :func:`_stream_chunks`)."""
    import sys

    from tqdm.auto import tqdm

    sources: dict[tuple[str, str], Any] = {("layer", name): x for name, x in arrays.items()}
    sources[("labels", "")], sources[("ids", "")] = labels, example_ids
    if logits is not None:
        sources[("logits", "")] = logits
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = tqdm(total=writer.n_chunks, desc=f"save {writer.name}", unit="chunk", disable=not show)
    try:
        for i, block in _stream_chunks(sources, [writer.rows(i) for i in range(writer.n_chunks)]):
            writer.write_chunk(
                i,
                layers={name: block[("layer", name)] for name in arrays},
                labels=block[("labels", "")],
                example_ids=block[("ids", "")],
                logits=block.get(("logits", "")),
            )
            del block
            bar.update(1)
    finally:
        bar.close()
    if head is not None:
        writer.set_head(*head)


def _row_blocks(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Dask array as (one Delayed per block of rows, the blocks' end rows): chunks along the
    other axes are merged first (each of their pieces feeds exactly one row block)."""
    if x.ndim > 1 and any(len(c) > 1 for c in x.chunks[1:]):
        x = x.rechunk({ax: -1 for ax in range(1, x.ndim)})
    # unoptimised: keys shared with other sources stay shared, so one ``dask.compute`` runs them once
    return x.to_delayed(optimize_graph=False).reshape(-1), np.cumsum(x.chunks[0])


def _stream_chunks(sources: Mapping[Any, Any], chunk_rows: list[tuple[int, int]]) -> Any:
    """Yield ``(i, {key: rows of chunk i})`` for the chunks ``chunk_rows[i] = (start, stop)`` (in
    order, covering the rows), computing every block of every Dask source exactly once, whatever
    its chunking; NumPy sources are sliced.

    A *step* starts at each chunk that needs rows no computed block holds yet: it computes, in one
    ``dask.compute`` (so work shared by sources with the same row chunking runs once), the blocks
    of every source up to the end of that chunk, and it serves the chunks from there until the
    next step.  A chunk that straddles blocks is assembled from them (its rows from the older block
    are copied out and that block released before the new ones are computed).  Memory: the blocks
    of one step plus one chunk — about one source chunk plus one store chunk.  When a step serves
    two or more chunks, the next step is computed on a background thread while they are written
    (compute and compression then overlap, at the cost of one more step's blocks in memory).
    """
    import dask

    lazy = {k: _row_blocks(v) for k, v in sources.items() if _is_dask(v)}
    # the plan: steps (first chunk, last chunk, {key: (first block, last block)}) from the chunkings alone
    steps: list[list[Any]] = []
    nxt = {k: 0 for k in lazy}
    for i, (_, stop) in enumerate(chunk_rows):
        need = {}
        for k, (_, ends) in lazy.items():
            last = int(np.searchsorted(ends, stop, side="left"))  # first block ending at or after ``stop``
            if last >= nxt[k]:
                need[k] = (nxt[k], last)
                nxt[k] = last + 1
        if need or not steps:
            steps.append([i, i, need])
        else:
            steps[-1][1] = i

    def compute(step: list[Any]) -> dict[Any, list[tuple[int, np.ndarray]]]:
        want = [(k, j) for k, (j0, j1) in step[2].items() for j in range(j0, j1 + 1)]
        values = dask.compute(*[lazy[k][0][j] for k, j in want]) if want else ()
        out: dict[Any, list[tuple[int, np.ndarray]]] = {}
        for (k, j), v in zip(want, values):
            ends = lazy[k][1]
            out.setdefault(k, []).append((int(ends[j - 1]) if j else 0, np.asarray(v)))
        return out

    held: dict[Any, list[tuple[int, np.ndarray]]] = {k: [] for k in lazy}  # (first row, block) alive
    partial: dict[Any, np.ndarray] = {}

    def take(k: Any, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of source k from its held blocks (a view when one block holds them)."""
        parts = [(r0, b) for r0, b in held[k] if r0 < stop and r0 + b.shape[0] > start]
        if len(parts) == 1 and k not in partial:
            r0, b = parts[0]
            return b[start - r0:stop - r0]
        out = partial.pop(k, None)
        for r0, b in parts:
            lo, hi = max(start, r0), min(stop, r0 + b.shape[0])
            if out is None:
                out = np.empty((stop - start,) + b.shape[1:], dtype=b.dtype)
            out[lo - start:hi - start] = b[lo - r0:hi - r0]
        return out

    pool = None
    ahead = None
    try:
        for s, step in enumerate(steps):
            first, last, need = step
            a, b = chunk_rows[first]
            if ahead is not None:
                got = ahead.result()
                ahead = None
            else:
                # the chunk's rows from blocks computed earlier are copied out first, so those
                # blocks are released before the new ones exist
                for k in need:
                    old = [(r0, blk) for r0, blk in held[k] if r0 + blk.shape[0] > a]
                    if old:
                        r0, blk = old[-1]
                        hi = r0 + blk.shape[0]
                        buf = np.empty((b - a,) + blk.shape[1:], dtype=blk.dtype)
                        buf[:hi - a] = blk[a - r0:]
                        partial[k] = buf
                        del blk, buf
                    held[k] = []
                    del old
                got = compute(step)
            for k in got:
                held[k] = [(r0, blk) for r0, blk in held[k] if r0 + blk.shape[0] > a] + got[k]
            del got  # (no loop variable may keep a block alive: memory is the point here)
            if last > first and s + 1 < len(steps):  # overlap the next step's compute with these writes
                if pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="repsim-save")
                ahead = pool.submit(compute, steps[s + 1])
            for i in range(first, last + 1):
                a, b = chunk_rows[i]
                block = {k: (take(k, a, b) if k in lazy else v[a:b]) for k, v in sources.items()}
                for k in lazy:  # release the blocks that later chunks do not need (views stay valid)
                    held[k] = [(r0, blk) for r0, blk in held[k] if r0 + blk.shape[0] > b]
                yield i, block
                del block
    finally:
        if ahead is not None:
            ahead.cancel()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
