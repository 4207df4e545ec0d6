"""Out-of-core I/O for the engine: store validation, batch plans, and a prefetching block reader.

Every multi-store computation goes through three steps, all in this module:

1. :func:`resolve_columns` opens the stores, checks them *before any compute* (complete, same
   ``example_ids``, every requested layer present) and returns the list of *columns*: one
   ``(store, layer)`` pair per row/column of the result.
2. :class:`BatchPlan` decides which example rows form each minibatch of each epoch.  It is a pure
   function of ``(n, batch_size, shuffle, seed, epoch, block_rows, window)``, so a resumed run or a
   remote worker rebuilds exactly the same batches from a handful of integers.
3. :class:`BlockReader` reads the rows of every column for those batches straight from the Zarr
   arrays, *block by block*, on a thread pool that runs ahead of the consumer (prefetch), so reading
   and decompression overlap with compute.

Shuffling schemes and their I/O cost (n rows, chunks of ``c`` rows, batch ``b``):

``"none"`` (``shuffle=False``)
    Consecutive batches ``[0:b], [b:2b], ...``; a trailing partial batch of fewer than 4 rows is
    dropped (HSIC₁ needs n ≥ 4).  Each chunk is read once per epoch.

``"window"`` (``shuffle=True``, the default)
    Rows are grouped into *blocks* of ``block_rows`` rows (the least common multiple of the stores'
    chunk sizes, so a block is a whole number of chunks in every store).  Each epoch draws, from
    ``numpy.random.default_rng([seed, epoch])``, a permutation of the blocks; consecutive permuted
    blocks are grouped into *windows* of at least ``window_rows`` rows (default ``4 * batch_size``),
    the rows inside each window are permuted, and the resulting sequence is cut into batches as
    above.  Each chunk is read **once per epoch**; the reader holds at most about one window plus one
    batch of rows (plus prefetch).  Batches are uniform samples of their window, not of the whole
    dataset: when stores are written in class order (ImageFolder), each batch sees the classes of
    ``window_rows / c`` chunks.  Raise ``shuffle_window`` (up to ``n``: a full uniform permutation
    held in memory) or use ``"examples"`` when that matters.

``"examples"``
    A uniform permutation of all rows each epoch.  Every batch reads the chunks that hold any of its
    rows, i.e. for ``b ≫ n / c`` essentially every chunk: about ``n / b`` reads of each store per
    epoch (33× for ImageNet val with b = 1500).  Memory is one batch (plus prefetch).
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

MIN_BATCH = 4  # HSIC_1 (U-centering) needs at least 4 examples
SHUFFLE_SCHEMES = ("none", "window", "examples")


# --------------------------------------------------------------------------------------------------
# stores and columns


@dataclass(frozen=True)
class Column:
    """One (store, layer) row/column of a result; ``shape`` is the per-example tail shape."""

    store: str  # display name of the store (its basename, or its path when names collide)
    path: str
    layer: str
    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int

    @property
    def features(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def features_after(self, spatial: str) -> int:
        """Width of the 2-D matrix this column becomes under ``spatial`` ("flatten" | "mean")."""
        if spatial == "mean" and len(self.shape) > 1:
            return int(self.shape[0])
        return self.features


def expand_store_paths(patterns: Iterable[str]) -> list[str]:
    """Expand shell globs (``runs/*.zarr``) in order; a literal path is kept even if it is missing
    (so that opening it produces the store's own error message)."""
    out: list[str] = []
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if any(ch in pattern for ch in "*?["):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise ValueError(f"no store matches {pattern!r}")
            out.extend(matches)
        else:
            out.append(pattern)
    return out


def open_stores(stores: Any) -> list[Any]:
    """Open paths/globs/ActivationStores (one or a sequence); incomplete stores are opened anyway so
    that :func:`resolve_columns` can name *all* problems at once."""
    from repsim.store import ActivationStore, open_store

    if isinstance(stores, (str, os.PathLike, ActivationStore)):
        stores = [stores]
    opened = []
    for item in stores:
        if isinstance(item, ActivationStore):
            opened.append(item)
        else:
            for path in expand_store_paths([os.fspath(item)]):
                opened.append(open_store(path, allow_incomplete=True))
    if not opened:
        raise ValueError("no stores given")
    return opened


def store_names(stores: Sequence[Any]) -> list[str]:
    """Display names: the store's basename, or its path where two stores share a basename."""
    names = [s.name for s in stores]
    dup = {n for n in names if names.count(n) > 1}
    return [s.path if s.name in dup else s.name for s in stores]


def _layers_for(store: Any, layers: Any) -> list[str]:
    if layers is None:
        return list(store.layers)
    if isinstance(layers, str):
        return [layers]
    if isinstance(layers, dict):
        chosen = layers.get(store.name, layers.get(store.path))
        if chosen is None:
            raise ValueError(f"layers: no entry for store {store.name!r}; keys: {sorted(layers)}")
        return [chosen] if isinstance(chosen, str) else list(chosen)
    return list(layers)


def ids_digest(example_ids: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(example_ids, dtype=np.int64).tobytes()).hexdigest()


def resolve_columns(stores: Any, layers: Any = None) -> tuple[list[Any], list[Column], np.ndarray]:
    """Open and validate stores; return ``(stores, columns, example_ids)``.

    ``layers``: ``None`` (every layer of every store), a list applied to every store, or a dict
    ``{store name: [layers]}``.  Raises one ``ValueError`` naming every offending store for:
    incomplete stores, missing layers, different ``n`` or ``example_ids`` (compared with the
    first store).  Nothing is computed before these checks pass.
    """
    opened = open_stores(stores)
    names = store_names(opened)
    problems: list[str] = []
    incomplete = [nm for nm, s in zip(names, opened) if not s.complete]
    if incomplete:
        problems.append(f"incomplete store(s) (extraction did not finish): {', '.join(incomplete)}")
    missing = []
    chosen: list[list[str]] = []
    for nm, s in zip(names, opened):
        want = _layers_for(s, layers)
        if not want:
            problems.append(f"store {nm!r}: empty layer list")
        lost = [layer for layer in want if layer not in s.layers]
        if lost:
            missing.append(f"{nm!r} lacks {lost} (has {list(s.layers)})")
        chosen.append(want)
    if missing:
        problems.append("missing layer(s): " + "; ".join(missing))
    ref_ids = opened[0].example_ids
    misaligned = []
    for nm, s in zip(names[1:], opened[1:]):
        ids = s.example_ids
        if ids.shape != ref_ids.shape:
            misaligned.append(f"{nm!r} has n={ids.shape[0]} vs n={ref_ids.shape[0]} in {names[0]!r}")
        elif not np.array_equal(ids, ref_ids):
            first = int(np.flatnonzero(ids != ref_ids)[0])
            misaligned.append(f"{nm!r} differs from {names[0]!r} first at row {first} "
                              f"(id {int(ids[first])} vs {int(ref_ids[first])})")
    if misaligned:
        problems.append("misaligned example_ids: " + "; ".join(misaligned))
    if problems:
        raise ValueError("cannot combine these stores: " + " | ".join(problems))
    columns = []
    for nm, s, want in zip(names, opened, chosen):
        for layer in want:
            arr = s.zarr_array(layer)
            columns.append(Column(store=nm, path=os.fspath(s.path), layer=layer, shape=tuple(int(d) for d in arr.shape[1:]),
                                  dtype=str(arr.dtype), chunk_rows=int(arr.chunks[0])))
    return opened, columns, ref_ids


def block_rows_for(columns: Sequence[Column], n: int) -> int:
    """Read granularity: lcm of the columns' chunk sizes (a block is whole chunks in every store),
    or the largest chunk size when the lcm would exceed 8× it (then a chunk straddling two blocks is
    decompressed twice: ≤ 2× read amplification)."""
    sizes = sorted({c.chunk_rows for c in columns})
    lcm = math.lcm(*sizes)
    rows = lcm if lcm <= 8 * sizes[-1] else sizes[-1]
    return max(1, min(rows, n))


# --------------------------------------------------------------------------------------------------
# batch plans


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(epoch)])


@dataclass(frozen=True)
class BatchPlan:
    """Which rows form each batch of each epoch (see the module docstring for the schemes)."""

    n: int
    batch_size: int
    shuffle: str = "window"
    seed: int = 0
    block_rows: int = 1
    window_rows: int = 0  # 0: 4 * batch_size

    def __post_init__(self) -> None:
        if self.shuffle not in SHUFFLE_SCHEMES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_SCHEMES}, got {self.shuffle!r}")
        if self.batch_size < MIN_BATCH:
            raise ValueError(f"batch_size must be >= {MIN_BATCH}, got {self.batch_size}")
        if self.n < MIN_BATCH:
            raise ValueError(f"need at least {MIN_BATCH} examples, stores have {self.n}")

    @property
    def window(self) -> int:
        return min(self.n, self.window_rows or 4 * self.batch_size)

    @property
    def sizes(self) -> list[int]:
        """Batch sizes of one epoch (the same every epoch)."""
        b = min(self.batch_size, self.n)
        full, rem = divmod(self.n, b)
        return [b] * full + ([rem] if rem >= MIN_BATCH else [])

    @property
    def n_batches(self) -> int:
        return len(self.sizes)

    @property
    def dropped(self) -> int:
        return self.n - sum(self.sizes)

    def order(self, epoch: int) -> np.ndarray:
        """The row sequence of one epoch; batches are consecutive slices of it."""
        if self.shuffle == "none":
            return np.arange(self.n, dtype=np.int64)
        rng = _rng(self.seed, epoch)
        if self.shuffle == "examples":
            return rng.permutation(self.n).astype(np.int64)
        n_blocks = -(-self.n // self.block_rows)
        blocks = rng.permutation(n_blocks)
        per_window = max(1, -(-self.window // self.block_rows))
        parts = []
        for start in range(0, n_blocks, per_window):
            rows = np.concatenate([np.arange(k * self.block_rows, min(self.n, (k + 1) * self.block_rows))
                                   for k in blocks[start:start + per_window]])
            parts.append(rng.permutation(rows))
        return np.concatenate(parts).astype(np.int64)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Row indices of every batch of ``epoch``, each sorted ascending (the order of rows inside
        a batch does not change any HSIC, and sorted rows make contiguous reads)."""
        order = self.order(epoch)
        out, start = [], 0
        for size in self.sizes:
            out.append(np.sort(order[start:start + size]))
            start += size
        return out

    def describe(self) -> str:
        if self.shuffle == "none":
            return "none: consecutive rows [0:b], [b:2b], ...; trailing batch < 4 rows dropped"
        if self.shuffle == "examples":
            return "examples: uniform permutation of rows per epoch, rng=default_rng([seed, epoch])"
        return (f"window: per epoch (rng=default_rng([seed, epoch])) permute blocks of {self.block_rows} rows, "
                f"permute rows within windows of >= {self.window} rows; each chunk read once per epoch")


# --------------------------------------------------------------------------------------------------
# reading


def transform(x: np.ndarray, spatial: str) -> np.ndarray:
    """(rows, C[, H, W]) -> (rows, features): ``flatten`` keeps every value (paper §3.2), ``mean``
    averages conv maps over space first (in float64), ``raw`` returns the block as stored."""
    if spatial == "raw":
        return x
    if x.ndim > 2 and spatial == "mean":
        return x.mean(axis=tuple(range(2, x.ndim)), dtype=np.float64)
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten', 'mean' or 'raw', got {spatial!r}")
    return x.reshape(x.shape[0], -1)


def to_device(x: np.ndarray, xp: Any) -> Any:
    """Hand a host block to the kernels' namespace: NumPy as is (the kernels cast to float64),
    CuPy by copying the *stored* bytes (e.g. float16) and casting on the GPU (float32 compute),
    any other array-API namespace via float64 on the host (array-api-strict has no float16)."""
    name = getattr(xp, "__name__", "")
    if name == "numpy":
        return x
    if name == "cupy":
        y = xp.asarray(x)
        return y.astype(xp.float32, copy=False) if y.dtype.kind == "f" and y.dtype.itemsize < 4 else y
    return xp.asarray(np.asarray(x, dtype=np.float64))


class BlockReader:
    """Reads rows of many (store, layer) columns from their Zarr arrays with read-ahead.

    ``iter_blocks`` yields whole blocks in a given order; ``iter_batches`` yields, for each batch of
    row indices, one 2-D array per column, gathered from cached blocks (``block`` mode: each block is
    read once and dropped after the last batch that needs it) or read by orthogonal selection
    (``select`` mode, for the ``"examples"`` shuffle).  Reads run on ``threads`` threads and stay up
    to ``prefetch`` batches (or blocks) ahead of the consumer.
    """

    def __init__(self, columns: Sequence[Column], n: int, block_rows: int, *, spatial: str = "flatten",
                 prefetch: int = 2, threads: int = 2) -> None:
        from repsim.store import open_store

        self.columns = list(columns)
        self.n = int(n)
        self.block_rows = int(block_rows)
        self.spatial = spatial
        self.prefetch = max(0, int(prefetch))
        stores = {p: open_store(p) for p in dict.fromkeys(c.path for c in self.columns)}
        self._arrays = [stores[c.path].zarr_array(c.layer) for c in self.columns]
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="repsim-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # one unit of I/O ----------------------------------------------------------------------------
    def _read(self, c: int, key: Any, what: str) -> np.ndarray:
        try:
            return transform(np.asarray(self._arrays[c][key]), self.spatial)
        except Exception as exc:  # zarr/codec/OS errors -> name the store, layer and rows
            col = self.columns[c]
            raise ValueError(f"cannot read {what} of layer {col.layer!r} in store {col.store!r} ({col.path}): "
                             f"{type(exc).__name__}: {exc}") from exc

    def read_block(self, k: int) -> list[np.ndarray]:
        a, b = k * self.block_rows, min(self.n, (k + 1) * self.block_rows)
        return [self._read(c, slice(a, b), f"rows {a}:{b}") for c in range(len(self.columns))]

    def read_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        return [transform(self._read_sel(c, rows), self.spatial) for c in range(len(self.columns))]

    def _read_sel(self, c: int, rows: np.ndarray) -> np.ndarray:
        try:
            return np.asarray(self._arrays[c].get_orthogonal_selection((rows,)))
        except Exception as exc:
            col = self.columns[c]
            raise ValueError(f"cannot read {rows.size} selected rows of layer {col.layer!r} in store "
                             f"{col.store!r} ({col.path}): {type(exc).__name__}: {exc}") from exc

    # streams ------------------------------------------------------------------------------------
    def _ahead(self, keys: Sequence[Any], load: Any) -> Iterator[tuple[Any, list[np.ndarray]]]:
        pending: dict[int, Future] = {}
        for i, key in enumerate(keys):
            for j in range(i, min(len(keys), i + self.prefetch + 1)):
                if j not in pending:
                    pending[j] = self._pool.submit(load, keys[j])
            yield key, pending.pop(i).result()

    def iter_blocks(self, blocks: Sequence[int]) -> Iterator[tuple[int, list[np.ndarray]]]:
        """Yield ``(k, arrays)`` for each block ``k`` in order, reading ahead."""
        return self._ahead(list(blocks), self.read_block)

    def iter_batches(self, batches: Sequence[np.ndarray], mode: str = "block") -> Iterator[list[np.ndarray]]:
        """Yield, for each batch of (sorted) row indices, one ``(len(rows), features)`` array per column."""
        if mode == "select":
            for _, arrays in self._ahead(list(batches), self.read_rows):
                yield arrays
            return
        need = [np.unique(rows // self.block_rows) for rows in batches]
        last_use: dict[int, int] = {}
        order: list[int] = []
        for i, blocks in enumerate(need):
            for k in blocks.tolist():
                if k not in last_use:
                    order.append(k)
                last_use[k] = i
        first_batch = {}
        for i, blocks in enumerate(need):
            for k in blocks.tolist():
                first_batch.setdefault(k, i)
        futures: dict[int, Future] = {}
        cursor = 0  # next block in `order` to submit
        for i, rows in enumerate(batches):
            # submit every block needed up to `prefetch` batches ahead
            while cursor < len(order) and first_batch[order[cursor]] <= i + self.prefetch:
                futures[order[cursor]] = self._pool.submit(self.read_block, order[cursor])
                cursor += 1
            blocks = need[i]
            data = {k: futures[k].result() for k in blocks.tolist()}
            cuts = np.searchsorted(rows, (blocks + 1) * self.block_rows)
            parts, start = [], 0
            for k, stop in zip(blocks.tolist(), cuts.tolist()):
                parts.append((k, rows[start:stop] - k * self.block_rows))
                start = stop
            out = []
            for c in range(len(self.columns)):
                pieces = [data[k][c][local] for k, local in parts]
                out.append(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
            yield out
            for k in blocks.tolist():
                if last_use[k] == i:
                    del futures[k]
