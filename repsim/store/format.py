"""Activation stores: Zarr v3 groups holding one network's activations on one dataset split.

Layout (docs/architecture.md "The activation store")::

    <store>.zarr/            attrs: repsim_store_version, model{...}, dataset{...}, layers[...],
                                    created, complete, repsim_version
      example_ids   (N,)         int64    dims (example,)
      labels        (N,)         int32    dims (example,)             one class per example, or
                    (N, K)       bool     dims (example, class)       multi-label targets (CheXpert)
      logits        (N, K)       float32  dims (example, class)             optional
      token_counts  (N,)         int32    dims (example,)                   optional: real (unpadded) tokens
                                          per example of a text store with token layers (extract
                                          --tokens flatten), whose padded positions hold zeros
      layers/<name> (N, ...)     float16/float32/float64, dims (example, channel, y, x) for 4-D,
                                          (example, feature) for 2-D
      head/weight   (K, M)       float32  dims (class, feature)             optional
      head/bias     (K,)         float32  dims (class,)                     optional
      written       (n_chunks,)  bool     dims (chunk,), one flag per storage object
      checksums     (n_chunks, 1 + A) uint32  dims (chunk, entry): chunk i's index, then the crc32c of
                                          chunk i of each array listed in its attribute ``arrays``
                                          (version 2; repsim.store.manifest)

Every per-example array is chunked along examples only, with the same ``chunk_rows``, so the
writer of chunk ``i`` touches exactly one object per array and ranks writing disjoint chunks never
race. ``chunk_rows`` defaults to :func:`default_chunk_rows` (the widest layer's chunk ~8 MiB, whatever
the number of examples). Chunks are compressed with zstd and followed by a crc32c checksum codec, so a corrupted
chunk fails loudly on read; every chunk is stored as an object even when it is all zeros, so a
deleted chunk is an error too, never silently read as zeros. The crc32c of every chunk is also
recorded, per array and chunk index, in the ``checksums`` manifest, so a valid chunk file moved,
swapped or copied in from elsewhere is refused too (:mod:`repsim.store.manifest`; stores of version
1, written before it, are read and verified as before, by each chunk's own checksum). Every read through
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

import os
from typing import Any, Iterable

import numpy as np

STORE_VERSION = 2  # 2: the checksum manifest binds each chunk to its array and index
READABLE_VERSIONS = (1, 2)  # version 1 stores (no manifest) are read and verified as before
TARGET_CHUNK_BYTES = 8 << 20  # the widest layer's chunk, default (chunk size never follows n)
MAX_CHUNK_ROWS = 1 << 16  # rows per chunk, default cap (stores of narrow layers only: bounds per-row temporaries)
ZSTD_LEVEL = 1  # level 1 compresses post-ReLU float16 ~2x faster than 3 (323 vs 163 MB/s/core) for ~1% larger chunks (extract bench)


class StoreError(ValueError):
    """An activation store is missing, invalid, incomplete or corrupted; the message names the store."""


# ----------------------------------------------------------------------------------------------
# helpers


def store_name(path: str | os.PathLike) -> str:
    """A store's display name: the basename of its path without ``.zarr``."""
    base = os.path.basename(os.path.normpath(str(path)))
    return base[:-5] if base.endswith(".zarr") else base


TOKEN_DIMS = ("example", "token", "feature")  # a token sequence kept whole (extract --tokens flatten)


def dimension_names(ndim: int, kind: str = "layer") -> tuple[str, ...]:
    """Dimension names of an array with ``ndim`` dimensions whose first axis is examples.

    Layers: 2-D ``(example, feature)``, 3-D ``(example, channel, x)``, 4-D ``(example, channel, y,
    x)``, otherwise ``(example, dim1, ...)``; ``kind="tokens"``: ``(example, token, feature)``.
    Logits: ``(example, class)``.
    """
    if kind == "logits":
        return ("example", "class")
    if kind == "tokens":
        if ndim != 3:
            raise ValueError(f"a token layer is (example, token, feature), not {ndim}-D")
        return TOKEN_DIMS
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


MIN_CHUNK_ROWS = 64  # the fewest rows a default chunk holds (file count and reads per pass of wide layers)


def default_chunk_rows(
    row_bytes: Iterable[int],
    n: int,
    *,
    target_chunk_bytes: int = TARGET_CHUNK_BYTES,
    max_rows: int = MAX_CHUNK_ROWS,
) -> int:
    """Rows per chunk from a byte target for the *widest* layer (issue 31):

        rows = clamp(floor(target_chunk_bytes / max_layer row_bytes), MIN_CHUNK_ROWS, min(max_rows, n))

    so the widest layer's chunk is ~8 MiB and every narrower array's chunk is smaller — except that a
    chunk holds at least ``MIN_CHUNK_ROWS`` (64) rows: a flattened early conv block (ResNet-50's
    256 × 56 × 56, 1.6 MB a row in float16) would otherwise get 5-row chunks, 10,000 files per layer
    for ImageNet's validation set and as many reads per pass; its chunks are ~100 MB instead, which
    still does not grow with ``n``. Streaming analyses hold a few chunks at a time, so their peak
    memory follows this byte size; it does not grow with ``n`` (the rule before, ``>= 1 MiB`` for the
    *narrowest* layer, gave 32,768-row chunks — 64 MiB of a 2,048-wide float16 layer — when a store
    also held 10-wide logits). Stores written under any rule stay readable: ``chunk_rows`` is read
    from the store.
    """
    sizes = [int(b) for b in row_bytes if int(b) > 0]
    cap = max(1, min(int(max_rows), int(n)))
    if not sizes:
        return max(1, min(n, 1024))
    return int(min(max(MIN_CHUNK_ROWS, int(target_chunk_bytes) // max(sizes)), cap))


def dataset_difference(store: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """How a store's ``dataset`` attributes say it holds other data than the reference store's: the
    ``name`` or ``split`` differ where both record one (``"name 'imagenet' vs 'cifar10'"``, the
    store's value first); None otherwise."""
    diffs = [f"{key} {store.get(key)!r} vs {ref.get(key)!r}" for key in ("name", "split")
             if store.get(key) is not None and ref.get(key) is not None and store.get(key) != ref.get(key)]
    return "; ".join(diffs) or None


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



def _open_group(path: str, mode: str):
    import zarr

    try:
        return zarr.open_group(path, mode=mode, zarr_format=3)
    except Exception as exc:
        raise StoreError(f"store {store_name(path)} ({path}): not a Zarr v3 group{_what_it_is(path)}: "
                         f"{type(exc).__name__}: {exc}") from exc


def _what_it_is(path: str) -> str:
    """What a local directory that is not a store holds, when that says what was meant: stores (a
    directory of them) or a training run (its checkpoints); else ''."""
    import os

    if "://" in str(path) or not os.path.isdir(path):
        return ""
    names = os.listdir(path)
    stores = sorted(n for n in names if n.endswith(".zarr"))
    if stores:
        shown = ", ".join(stores[:3]) + (", ..." if len(stores) > 3 else "")
        return f" but a directory of {len(stores)} store(s) ({shown}): pass them, e.g. {os.path.join(str(path), '*.zarr')}"
    ckpts = [n for n in ("best.pt", "checkpoint.pt") if n in names]
    if ckpts:
        return (f" but a training run ({', '.join(ckpts)}): extract its activations first, "
                f"repsim extract --checkpoint {os.path.join(str(path), ckpts[0])} --out STORE.zarr")
    return ""


class _Members(dict):
    """A store's nodes by path (``"labels"``, ``"layers/block1"``, ...), fetched together
    (``group.members``: one concurrent metadata read instead of one round trip per ``group[key]``,
    ~12 ms against ~60 ms for a store of 20 layers); ``group`` answers what is not in it."""

    def __init__(self, group: Any):
        super().__init__(group.members(max_depth=None))
        self.group = group

    def __missing__(self, key: str) -> Any:
        node = self.group[key]  # raises KeyError like the group would
        self[key] = node
        return node

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self.group


def _validate(path: str, group: Any) -> "_Members":
    """Schema checks shared by readers and the resuming writer; raises StoreError naming the store.
    Returns the store's nodes by path (:class:`_Members`)."""
    name = store_name(path)
    attrs = dict(group.attrs)
    members = _Members(group)
    group = members  # every lookup below goes through the fetched nodes
    version = attrs.get("repsim_store_version")
    shown = full_path(path)
    if version is None:
        if interrupted_creation(path):
            raise StoreError(f"store {name} ({shown}): not a repsim activation store but what an interrupted "
                             "creation leaves (a Zarr group without attributes and without data); replace it "
                             "with --overwrite (overwrite=True)")
        raise StoreError(f"store {name} ({shown}): not a repsim activation store (no repsim_store_version attribute)")
    if version not in READABLE_VERSIONS:
        raise StoreError(f"store {name} ({shown}): store version {version} is not supported (expected one of "
                         f"{READABLE_VERSIONS}; a newer repsim wrote it?)")
    for req in ("example_ids", "labels", "written"):
        if req not in group:
            raise StoreError(f"store {name} ({path}): missing array {req!r}")
    n, rows = group["example_ids"].shape[0], group["example_ids"].chunks[0]
    for req in ("labels", "logits", "token_counts"):
        if req in group and (group[req].shape[0] != n or group[req].chunks[0] != rows):
            raise StoreError(f"store {name} ({path}): {req} has shape {group[req].shape} / chunks {group[req].chunks}, expected {n} rows in chunks of {rows}")
    labels = group["labels"]
    if labels.ndim > 2 or tuple(labels.chunks[1:]) != tuple(labels.shape[1:]):
        raise StoreError(f"store {name} ({path}): labels has shape {labels.shape} / chunks {labels.chunks}, expected (N,) or multi-label (N, K) chunked along examples only")
    if "token_counts" in group and group["token_counts"].ndim != 1:
        raise StoreError(f"store {name} ({path}): token_counts has shape {group['token_counts'].shape}, expected (N,)")
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
    if version >= 2:
        _validate_manifest(name, path, members, layers, n_chunks=-(-n // rows))
    return members


def _validate_manifest(name: str, path: str, group: Any, layers: list[str], n_chunks: int) -> None:
    """A version-2 store's ``checksums`` manifest lists every per-example array, one row per chunk."""
    from repsim.store.manifest import MANIFEST, manifest_columns

    if MANIFEST not in group:
        raise StoreError(f"store {name} ({path}): missing array {MANIFEST!r} (the chunk checksum manifest of a "
                         "version-2 store)")
    arr = group[MANIFEST]
    want = manifest_columns(layers, "logits" in group, "token_counts" in group)
    cols = list(arr.attrs.get("arrays") or [])
    if sorted(cols) != sorted(want) or arr.shape != (n_chunks, 1 + len(cols)) or arr.chunks != (1, 1 + len(cols)):
        raise StoreError(f"store {name} ({path}): {MANIFEST} has shape {arr.shape} / chunks {arr.chunks} for arrays "
                         f"{cols}; expected ({n_chunks}, {1 + len(want)}) / (1, {1 + len(want)}) for {want}")


def full_path(path: str) -> str:
    """``path`` as messages show it: absolute for a local path, a URL as given."""
    return path if "://" in str(path) else os.path.abspath(path)


_LAYOUT = {"zarr.json", "example_ids", "labels", "logits", "token_counts", "layers", "written", "checksums", "head"}


def interrupted_creation(path: str) -> bool:
    """True when ``path`` is what an interrupted creation by an older repsim leaves behind (disk full
    before the root attributes were written): a Zarr v3 group without attributes whose entries are
    only the store layout's array and group names, none holding a chunk object. (A creation now
    builds the store under a temporary name and renames it into place, so it leaves no such thing.)"""
    import json

    try:
        with open(os.path.join(path, "zarr.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        entries = set(os.listdir(path))
    except (OSError, ValueError):
        return False
    if meta.get("node_type") != "group" or meta.get("attributes") or not entries <= _LAYOUT:
        return False
    for folder, dirs, _ in os.walk(path):
        if "c" in dirs and os.listdir(os.path.join(folder, "c")):
            return False  # a chunk object: data someone wrote
    return True
