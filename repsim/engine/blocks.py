"""Out-of-core I/O for the engine: store validation, batch plans, and a prefetching block reader.

Every multi-store computation goes through three steps, all in this module:

1. :func:`resolve_columns` opens the stores, checks them *before any compute* (complete, same
   ``example_ids``, every requested layer present) and returns the list of *columns*: one
   ``(store, layer)`` pair per row/column of the result.
2. :class:`BatchPlan` decides which example rows form each minibatch of each epoch, as *groups*
   of batches that read the same blocks.  It is a pure function of
   ``(n, batch_size, shuffle, seed, epoch, block_rows, window)``, so a resumed run or a remote
   worker rebuilds exactly the same batches from a handful of integers.
3. :class:`BlockReader` reads one column of one group at a time straight from the Zarr arrays
   (each block once), on a thread pool that runs ahead of the consumer (prefetch), so reading and
   decompression overlap with compute.

A *block* is ``block_rows`` rows: the least common multiple of the stores' chunk sizes, so a
block is whole chunks in every store.

Shuffling schemes and their I/O cost (n rows, batch b, L columns):

``"none"`` (``shuffle=False``)
    Consecutive batches ``[0:b], [b:2b], ...``; a trailing partial batch of fewer than 4 rows is
    dropped (HSIC₁ needs n ≥ 4).  Each batch is its own group, so a block that straddles two
    batches is read by both: ≤ (1 + block_rows / b) reads of each store per epoch.

``"window"`` (``shuffle=True``, the default)
    Each epoch draws, from ``numpy.random.default_rng([seed, epoch])``, a permutation of the
    blocks, cut into ``round(n_blocks / w)`` *windows* of consecutive permuted blocks whose block
    counts differ by at most one (w: ``window_rows`` rows, default ``4 * batch_size``, in whole
    blocks; one window when that is n or more; never more windows than batches), so no window is a
    leftover of a few blocks. The epoch's K = ``round(n / b)`` batches (at least 1, at most n / 4) are
    shared out among the windows in proportion to their rows, and the rows of each window are
    permuted and cut into its share of batches of near-equal size. Every batch holds within a
    quarter of n / K rows (``BATCH_TOLERANCE``), never a runt, for every n, chunk, batch and window
    size: where whole blocks do not allow it (a runt last chunk: n = 300 in 139-row chunks made a
    22-row and a 278-row batch; windows of about one batch) neighbouring windows are merged, down to
    one window whose batches differ by at most one row. The minibatch estimate averages its batches
    with equal weight, and one 64-row batch beside 1,600-row ones made its seed-to-seed spread ~45×
    larger.
    Batches never straddle windows, so every chunk is read **exactly once per epoch** and the reader
    holds one window of one column at a time (plus prefetch).  Batches are uniform
    samples of their window, not of the whole dataset.  ``repsim extract`` writes rows in a fixed
    seeded permutation of the dataset by default (``--order shuffled``), so a window of blocks is
    itself a uniform sample and window batches are as good as uniform ones.  For stores written in
    class order (``--order dataset`` on ImageFolder data, or your own ``save_store``), a batch sees
    only the classes of ``window_rows / block_rows`` blocks: raise ``shuffle_window`` (up to n: a
    full uniform permutation) or use ``"examples"`` then.

``"examples"``
    A uniform permutation of all rows each epoch, cut into ``round(n / b)`` batches whose sizes
    differ by at most one (n = 5,000, b = 1,500: 1,667 + 1,667 + 1,666, not 1,500 × 3 + 500).  Every batch reads
    the chunks that hold any of its rows, i.e. for b ≫ n / chunk_rows essentially every chunk:
    about ``n / b`` reads of each store per epoch (33× for ImageNet val with b = 1500).
"""
from __future__ import annotations

import hashlib
import math
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from repsim.paths import expand_paths
from repsim.array_api import asarray_like, astype, is_cupy_namespace

MIN_BATCH = 4  # HSIC_1 (U-centering) needs at least 4 examples
SHUFFLE_SCHEMES = ("none", "window", "examples")
# which rows a BatchPlan puts in which batch: 3 shares round(n/b) batches out among the windows, each
# within a quarter of n/b (2 cut each window on its own: 22 + 278 rows for n = 300 in 139-row chunks);
# 2 cut windows and "examples" batches near-equal (1 left a window of the leftover blocks and a
# trailing short batch); a checkpoint of another version is another computation's
PLAN_VERSION = 3


# --------------------------------------------------------------------------------------------------
# stores and columns


@dataclass(frozen=True)
class Column:
    """One (store, layer) row/column of a result; ``shape`` is the per-example tail shape; ``tokens``:
    the layer is a token sequence ``(token, feature)`` (dimension names ``example, token, feature``),
    whose features are its last axis, where a conv map's ``(channel, y, x)`` has them first."""

    store: str  # display name of the store (its basename, or its path when names collide)
    path: str
    layer: str
    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int
    tokens: bool = False

    @property
    def features(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def channels(self) -> int:
        """Channels (a conv map's first axis, a token sequence's features), what ``mean`` keeps."""
        if not self.shape:
            return 1
        return int(self.shape[-1] if self.tokens else self.shape[0])

    def features_after(self, spatial: str) -> int:
        """Width of the 2-D matrix this column becomes under ``spatial`` ("flatten" | "mean")."""
        if spatial == "mean" and len(self.shape) > 1:
            return self.channels
        return self.features


def expand_store_paths(patterns: Iterable[str]) -> list[str]:
    """Store arguments as paths: an existing one as given, a missing one with glob characters
    expanded (``runs/*.zarr``, sorted); a missing literal path is kept (so that opening it produces
    the store's own error message). The rule is :func:`repsim.paths.expand_paths`."""
    return expand_paths(patterns, "store")


def open_stores(stores: Any) -> list[Any]:
    """Open paths/globs/ActivationStores (one or a sequence); incomplete stores are opened anyway so
    that :func:`resolve_columns` can name *all* problems at once."""
    from repsim.store.reader import ActivationStore, open_store

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
    return _once_each(opened)


def _once_each(opened: list[Any]) -> list[Any]:
    """The stores without repeats (the same directory named twice, e.g. by a path and an overlapping
    glob): a repeat would add a copy of every column; it is dropped with a warning naming it."""
    seen: dict[str, Any] = {}
    for store in opened:
        path = os.fspath(store.path)
        key = path if "://" in path else os.path.realpath(path)
        if key in seen:
            also = "" if os.fspath(seen[key].path) == path else f" (also as {seen[key].path})"
            warnings.warn(f"store {path} is named more than once{also}: it is used once", stacklevel=3)
            continue
        seen[key] = store
    return list(seen.values())


def store_location(store: Any) -> str:
    """A store's path as the engine records it: absolute (workers may run elsewhere), URLs as given."""
    path = os.fspath(store.path)
    return path if "://" in path else os.path.abspath(path)


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


def resolve_columns(stores: Any, layers: Any = None, *, allow_mixed_datasets: bool = False
                    ) -> tuple[list[Any], list[Column], np.ndarray]:
    """Open and validate stores; return ``(stores, columns, example_ids)``.

    ``layers``: ``None`` (every layer of every store), a list applied to every store, or a dict
    ``{store name: [layers]}``.  Raises one ``ValueError`` naming every offending store for:
    incomplete stores, missing layers, different ``n`` or ``example_ids`` (compared with the
    first store) and, unless ``allow_mixed_datasets``, a different dataset name or split (where
    both stores record one) or different labels on the same rows: ids that match across datasets
    match by coincidence.  Nothing is computed before these checks pass.
    """
    from repsim.store.reader import store_names

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
    mixed_names = _other_data(names, opened, labels=False) if misaligned else []
    if mixed_names:  # say why the ids differ: another dataset or split (a swapped store), not a corrupt one
        problems.append("different datasets: " + "; ".join(mixed_names) + ", so their example_ids differ too ("
                        + "; ".join(misaligned) + "): give stores of one dataset split")
    elif misaligned:
        problems.append("misaligned example_ids: " + "; ".join(misaligned))
    elif not allow_mixed_datasets and len(opened) > 1:
        mixed = _other_data(names, opened)
        if mixed:
            problems.append("different datasets: " + "; ".join(mixed) + " (if they hold the same examples in the "
                            "same order, pass allow_mixed_datasets=True / --allow-mixed-datasets)")
    if problems:
        raise ValueError("cannot combine these stores: " + " | ".join(problems))
    from repsim.store.format import TOKEN_DIMS

    columns = []
    for nm, s, want in zip(names, opened, chosen):
        for layer in want:
            arr = s.zarr_array(layer)
            columns.append(Column(store=nm, path=store_location(s), layer=layer,
                                  shape=tuple(int(d) for d in arr.shape[1:]), dtype=str(arr.dtype),
                                  chunk_rows=int(arr.chunks[0]),
                                  tokens=tuple(arr.metadata.dimension_names or ()) == TOKEN_DIMS))
    return opened, columns, ref_ids


def _other_data(names: Sequence[str], opened: Sequence[Any], labels: bool = True) -> list[str]:
    """Stores whose dataset name/split (or, with ``labels``, labels) differ from the first store's (one
    entry each)."""
    from repsim.store.format import dataset_difference

    out = []
    ref_labels = opened[0].labels if labels else None
    for nm, s in zip(names[1:], opened[1:]):
        diff = dataset_difference(s.dataset, opened[0].dataset)
        if diff:
            out.append(f"{nm!r} vs {names[0]!r}: {diff}")
        elif labels and not np.array_equal(s.labels, ref_labels):
            first = int(np.flatnonzero(s.labels != ref_labels)[0])
            out.append(f"{nm!r} has other labels than {names[0]!r} on the same example_ids (first at row {first})")
    return out


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
class Group:
    """Batches that are read together: ``blocks`` (sorted block ids whose rows cover every batch
    of the group; ``None`` for the "examples" scheme, read by selection) and the batches' rows."""

    blocks: np.ndarray | None
    batches: list[np.ndarray]


def _split(rows: np.ndarray, k: int) -> list[np.ndarray]:
    """``rows`` cut into ``k`` consecutive parts whose sizes differ by at most one."""
    bounds = np.linspace(0, rows.size, k + 1).round().astype(np.int64)
    return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# every window batch holds between (1 - t) and (1 + t) times n / K rows (K batches per epoch)
BATCH_TOLERANCE = 0.25


def _apportion(rows: np.ndarray, total: int) -> list[int]:
    """``total`` batches shared out in proportion to ``rows`` (Hamilton's largest remainders)."""
    quota = rows * total / rows.sum()
    shares = np.floor(quota).astype(np.int64)
    for k in np.argsort(-(quota - shares), kind="stable")[:total - int(shares.sum())]:
        shares[k] += 1
    return shares.tolist()


def _near(rows: np.ndarray, shares: Sequence[int], target: float) -> bool:
    """Whether windows of ``rows`` rows cut into ``shares`` batches each give batches within
    :data:`BATCH_TOLERANCE` of ``target`` rows and of at least 4 rows."""
    for r, k in zip(rows.tolist(), shares):
        if k < 1:
            return False
        small, big = r // k, -(-r // k)
        if small < MIN_BATCH or small < (1 - BATCH_TOLERANCE) * target or big > (1 + BATCH_TOLERANCE) * target:
            return False
    return True


@dataclass(frozen=True)
class BatchPlan:
    """Which rows form each batch of each epoch, grouped by the blocks they read (module docstring)."""

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
        """Rows per shuffle window (a whole number of blocks, about ``window_rows``)."""
        rows = min(self.n, self.window_rows or 4 * self.batch_size)
        return max(1, round(rows / self.block_rows)) * self.block_rows

    def _consecutive(self, order: np.ndarray) -> list[np.ndarray]:
        """``shuffle="none"``: [0:b], [b:2b], ... as a DataLoader cuts them (the peers' convention:
        pytorch-cka, ckatorch), a trailing batch of fewer than 4 rows dropped."""
        b = min(self.batch_size, self.n)
        out = [order[s:s + b] for s in range(0, self.n, b)]
        return [np.sort(r) for r in out if r.size >= MIN_BATCH]

    def batch_count(self) -> int:
        """Batches per epoch of the shuffled schemes: ``round(n / b)``, at least one, at most ``n // 4``
        (each batch needs 4 rows)."""
        return max(1, min(round(self.n / self.batch_size), self.n // MIN_BATCH))

    def _near_equal(self, rows: np.ndarray) -> list[np.ndarray]:
        """``rows`` cut into :meth:`batch_count` consecutive batches whose sizes differ by at most one,
        each sorted."""
        return [np.sort(r) for r in _split(rows, self.batch_count())]

    def _windows(self, order: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
        """The permuted blocks ``order`` cut into windows, and each window's number of batches.

        The epoch's :meth:`batch_count` K batches are shared out among the windows in proportion to
        their rows (largest remainders), so every batch holds within a quarter of n / K rows
        (:data:`BATCH_TOLERANCE`) whatever the chunk, batch and window sizes: where the windows'
        whole blocks do not allow it (a runt last chunk, windows of about one batch), neighbouring
        windows are merged — down to one window, whose batches differ by at most one row."""
        rows_of = np.full(order.size, self.block_rows, dtype=np.int64)  # by block number
        rows_of[-1] = self.n - (order.size - 1) * self.block_rows  # the last block may be short
        total = self.batch_count()
        target = self.n / total
        count = max(1, min(round(order.size / (self.window // self.block_rows)), total))
        while True:
            parts = _split(order, count)
            rows = np.array([int(rows_of[p].sum()) for p in parts])
            shares = _apportion(rows, total)
            if count == 1 or _near(rows, shares, target):
                return parts, shares
            count -= 1

    def groups(self, epoch: int) -> list[Group]:
        """The epoch's batches in order, as groups that share reads."""
        if self.shuffle == "none":
            return [Group(np.unique(r // self.block_rows), [r]) for r in self._consecutive(np.arange(self.n))]
        rng = _rng(self.seed, epoch)
        if self.shuffle == "examples":
            return [Group(None, [r]) for r in self._near_equal(rng.permutation(self.n))]
        n_blocks = -(-self.n // self.block_rows)
        order = rng.permutation(n_blocks)
        out = []
        for blocks, batches in zip(*self._windows(order)):
            blocks = np.sort(blocks)
            rows = np.concatenate([np.arange(k * self.block_rows, min(self.n, (k + 1) * self.block_rows))
                                   for k in blocks])
            out.append(Group(blocks, [np.sort(r) for r in _split(rng.permutation(rows), batches)]))
        return out

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Row indices of every batch of ``epoch`` in order, each sorted ascending (the order of
        rows inside a batch changes no HSIC, and sorted rows read contiguously)."""
        return [r for g in self.groups(epoch) for r in g.batches]

    def same_every_epoch(self) -> str | None:
        """Why every epoch cuts the rows into the same batches (as sets of rows), or None when epochs
        differ: ``shuffle="none"`` (consecutive rows, the same each epoch), or one batch of all n rows
        (``batch_size`` about n or more). An unbiased HSIC is the same for any order of a batch's rows, so
        further epochs would repeat the first one's computation."""
        if self.shuffle == "none":
            return "shuffle 'none' cuts the same consecutive batches every epoch"
        only = self.batches(0)
        if len(only) == 1 and only[0].size == self.n:
            return f"one batch holds all {self.n} examples (batch size {self.batch_size})"
        return None

    def describe(self) -> str:
        if self.shuffle == "none":
            return "none: consecutive rows [0:b], [b:2b], ...; trailing batch < 4 rows dropped"
        if self.shuffle == "examples":
            return ("examples: uniform permutation of rows per epoch, rng=default_rng([seed, epoch]), cut into "
                    "round(n/batch_size) near-equal batches")
        return (f"window: per epoch (rng=default_rng([seed, epoch])) permute blocks of {self.block_rows} rows, "
                f"cut them into near-equal windows of about {self.window} rows, permute rows within each window "
                f"and cut it into round(rows/batch_size) near-equal batches; each chunk read once per epoch")


# --------------------------------------------------------------------------------------------------
# reading


def magnitude_limit(rows: int) -> float:
    """The largest |x| a stored value may have for CKA over ``rows`` rows: its square alone must not
    exceed :func:`repsim.kernels.hsic.max_trace` (the trace whose HSIC products float64 can
    hold; ~4e76 for 300 rows, ~2e75 for a million). Only float64 stores can exceed it."""
    from repsim.kernels.hsic import max_trace

    return math.sqrt(max_trace(rows))


def check_magnitude(x: np.ndarray, store: str, layer: str, chunk: int, rows: int) -> np.ndarray:
    """``x`` (chunk ``chunk`` of a layer read for CKA over ``rows`` rows) unchanged; a ``ValueError``
    naming store, layer, chunk and the overflow when a value exceeds :func:`magnitude_limit`. The
    kernels check each batch's sum of squares by the same rule (``_precision.check_products``);
    this names the chunk, where the values are read."""
    if x.dtype.kind == "f" and x.size and float(np.finfo(x.dtype).max) > (limit := magnitude_limit(rows)):
        big = float(max(np.max(x), -np.min(x)))
        if limit < big < math.inf:
            from repsim.kernels.hsic import ProductOverflow

            raise ProductOverflow(f"store {store}: layer {layer!r}: chunk {chunk} holds values up to {big:.3g} in "
                                  f"magnitude, which overflow float64 in CKA's HSIC products over {rows} rows (they hold "
                                  f"|x| <= {limit:.2g}); rescale the layer (CKA does not change)")
    return x


def progress_bar(total: int, desc: str, progress: bool | None, unit: str = "batch") -> Any:
    """A tqdm bar on stderr; ``progress=None`` shows it only when stderr is a terminal."""
    import sys

    from tqdm.auto import tqdm

    disable = (not sys.stderr.isatty()) if progress is None else not progress
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, leave=False)


def transform(x: Any, spatial: str, xp: Any = None, tokens: bool = False, counts: Any = None) -> Any:
    """(rows, C[, H, W]) -> (rows, features): ``flatten`` keeps every value (paper §3.2), ``mean``
    averages conv maps over space first (in float64), ``raw`` returns the block as stored. A token
    sequence (rows, T, D) (``tokens``, :attr:`Column.tokens`) is averaged over its tokens under ``mean``
    (rows, D), as ``extract --tokens mean`` would have stored it: with ``counts`` (the rows' real-token
    counts, ``ActivationStore.token_counts`` of a padded text store, whose padded positions hold zeros)
    the sum over tokens is divided by each row's count, not by T. ``xp``: the array namespace of a
    device block (the GPU-decoding route; ``counts`` then in it too), None for a NumPy block."""
    if spatial == "raw":
        return x
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten', 'mean' or 'raw', got {spatial!r}")
    if x.ndim > 2 and spatial == "mean":
        axes = (1,) if tokens else tuple(range(2, x.ndim))
        if tokens and counts is not None:
            if xp is None:
                return x.sum(axis=1, dtype=np.float64) / np.maximum(np.asarray(counts, np.float64), 1.0)[:, None]
            real = xp.maximum(astype(counts, xp.float64, xp), 1.0)
            return xp.sum(astype(x, xp.float64, xp), axis=1) / real[:, None]
        return x.mean(axis=axes, dtype=np.float64) if xp is None else xp.mean(astype(x, xp.float64, xp), axis=axes)
    return x.reshape(x.shape[0], -1) if xp is None else xp.reshape(x, (x.shape[0], -1))


def token_counts_for(store: Any, column: Column, spatial: str) -> np.ndarray | None:
    """The store's per-example real-token counts where ``mean`` averages this column over its tokens
    (:func:`transform`), else None."""
    if spatial != "mean" or not column.tokens:
        return None
    return store.token_counts


def channels_first(x: Any, column: Column, xp: Any = None) -> Any:
    """A block as stored, its features on axis 1 (what a per-channel statistic counts over): a token
    sequence (rows, T, D) becomes (rows, D, T); any other layer is returned as it is."""
    if not column.tokens or x.ndim != 3:
        return x
    return np.swapaxes(x, 1, 2) if xp is None else xp.permute_dims(x, (0, 2, 1))


def to_device(x: np.ndarray, xp: Any) -> Any:
    """Hand a host block to the kernels' namespace: NumPy as is (the kernels cast to float64),
    CuPy by copying the *stored* bytes (e.g. float16) and casting on the GPU (float32 compute),
    any other array-API namespace via float64 on the host (array-api-strict has no float16)."""
    name = getattr(xp, "__name__", "")
    if name == "numpy":
        return x
    if is_cupy_namespace(xp):  # cupy, array_api_compat.cupy, repsim.array_api.cupy
        y = xp.asarray(x)
        return y.astype(xp.float32, copy=False) if y.dtype.kind == "f" and y.dtype.itemsize < 4 else y
    return xp.asarray(np.asarray(x, dtype=np.float64))


class BlockReader:
    """Reads rows of many (store, layer) columns from their Zarr arrays with read-ahead.

    ``iter_blocks`` yields whole blocks (every column) in a given order (drivers, exact CKA);
    ``gather`` reads one column of one batch group; ``prefetched`` runs any such loads on
    ``threads`` threads, up to ``prefetch`` loads ahead of the consumer.
    """

    def __init__(self, columns: Sequence[Column], n: int, block_rows: int, *, spatial: str = "flatten",
                 prefetch: int = 2, threads: int = 2, opened: Sequence[Any] = ()) -> None:
        from repsim.store.reader import open_store

        self.columns = list(columns)
        self.n = int(n)
        self.block_rows = int(block_rows)
        self.spatial = spatial
        self.prefetch = max(0, int(prefetch))
        # stores this process opened already (``resolve_columns``) are reused: no second metadata pass
        known = {store_location(s): s for s in opened}
        stores = {p: known.get(p) or open_store(p) for p in dict.fromkeys(c.path for c in self.columns)}
        self._stores = [stores[c.path] for c in self.columns]
        self._counts = [token_counts_for(s, c, spatial) for s, c in zip(self._stores, self.columns)]
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="repsim-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # one unit of I/O ----------------------------------------------------------------------------
    def _chunks(self, c: int, first: int, last: int) -> np.ndarray:
        """Chunks ``first..last`` of column ``c`` through ``ActivationStore.read_chunk``, which
        raises a ``StoreError`` naming store, layer and chunk for a missing or corrupt object."""
        store, layer = self._stores[c], self.columns[c].layer
        parts = [check_magnitude(np.asarray(store.read_chunk(layer, k)), store.name, layer, k, self.n)
                 for k in range(first, last + 1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _read(self, c: int, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of column ``c``, transformed."""
        cr = self.columns[c].chunk_rows
        first = a // cr
        data = self._chunks(c, first, (b - 1) // cr)
        return transform(data[a - first * cr:b - first * cr], self.spatial, tokens=self.columns[c].tokens,
                         counts=self._rows_counts(c, slice(a, b)))

    def _rows_counts(self, c: int, rows: Any) -> np.ndarray | None:
        """Column ``c``'s real-token counts of ``rows`` (None: a plain mean, :func:`token_counts_for`)."""
        counts = self._counts[c]
        return None if counts is None else counts[rows]

    def read_block(self, k: int) -> list[np.ndarray]:
        a, b = k * self.block_rows, min(self.n, (k + 1) * self.block_rows)
        return [self._read(c, a, b) for c in range(len(self.columns))]

    def _read_sel(self, c: int, rows: np.ndarray) -> np.ndarray:
        """Sorted ``rows`` of column ``c``: every chunk holding one of them is read once, one at a
        time, and only the selected rows are kept."""
        cr = self.columns[c].chunk_rows
        which = rows // cr
        out = None
        for k in np.unique(which).tolist():
            chunk = self._chunks(c, k, k)
            if out is None:
                out = np.empty((rows.size,) + chunk.shape[1:], dtype=chunk.dtype)
            mask = which == k
            out[mask] = chunk[rows[mask] - k * cr]
        return out

    # streams ------------------------------------------------------------------------------------
    def _ahead(self, keys: Sequence[Any], load: Any, ahead: int | None = None) -> Iterator[tuple[Any, list[np.ndarray]]]:
        ahead = self.prefetch if ahead is None else max(0, int(ahead))
        pending: dict[int, Future] = {}
        for i, key in enumerate(keys):
            for j in range(i, min(len(keys), i + ahead + 1)):
                if j not in pending:
                    pending[j] = self._pool.submit(load, keys[j])
            yield key, pending.pop(i).result()

    def iter_blocks(self, blocks: Sequence[int]) -> Iterator[tuple[int, list[np.ndarray]]]:
        """Yield ``(k, arrays)`` for each block ``k`` in order, reading ahead."""
        return self._ahead(list(blocks), self.read_block)

    def read_span(self, c: int, blocks: np.ndarray) -> np.ndarray:
        """Column ``c``'s rows of ``blocks`` (sorted), concatenated in block order."""
        parts = [self._read(c, k * self.block_rows, min(self.n, (k + 1) * self.block_rows)) for k in blocks.tolist()]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def gather(self, c: int, group: "Group") -> list[np.ndarray]:
        """Column ``c`` of every batch of ``group`` (each ``(rows, features)``), reading each of the
        group's blocks once (or, for the "examples" scheme, each batch's rows by selection)."""
        if group.blocks is None:
            return [transform(self._read_sel(c, rows), self.spatial, tokens=self.columns[c].tokens,
                              counts=self._rows_counts(c, rows)) for rows in group.batches]
        span = self.read_span(c, group.blocks)
        starts = np.minimum(group.blocks * self.block_rows, self.n)
        sizes = np.minimum((group.blocks + 1) * self.block_rows, self.n) - starts
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = []
        for rows in group.batches:
            pos = np.searchsorted(group.blocks, rows // self.block_rows)
            out.append(span[offsets[pos] + rows - starts[pos]])
        return out

    def gather_decoded_span(self, cols: Sequence[int], group: "Group", decoder: Any, xp: Any) -> list[list[Any] | None]:
        """:meth:`gather` of every column of ``cols``, with all their chunks decoded in one ``decoder``
        call (:mod:`repsim.engine.device_decode`: on a GPU, nvCOMP; ``decode_spans`` chooses the
        columns), the rows picked and ``spatial`` applied in ``xp``. A column the route does not apply
        to is ``None``, read as usual: the "examples" scheme, a float64 layer (its magnitude check is
        the host's), an array not in repsim's zstd encoding on a local disk, a missing object."""
        if group.blocks is None or self.spatial not in ("flatten", "mean"):
            return [None] * len(cols)
        starts = np.minimum(group.blocks * self.block_rows, self.n)
        stops = np.minimum((group.blocks + 1) * self.block_rows, self.n)
        plans: list[tuple[list[int], list[tuple]] | None] = []
        for c in cols:
            cr = self.columns[c].chunk_rows
            wanted = sorted({k for a, b in zip(starts.tolist(), stops.tolist())
                             for k in range(a // cr, (b - 1) // cr + 1)})
            objects = []
            for k in wanted:
                got = self._stores[c].chunk_object(self.columns[c].layer, k)
                if got is None or got[2] == np.float64:
                    objects = None
                    break
                objects.append(got)
            plans.append(None if objects is None else (wanted, objects))
        bodies = [o[0] for plan in plans if plan is not None for o in plan[1]]
        sizes = [int(np.prod(o[1])) * o[2].itemsize for plan in plans if plan is not None for o in plan[1]]
        raw = iter(decoder.decode(bodies, sizes) if bodies else ())
        out: list[list[Any] | None] = []
        for c, plan in zip(cols, plans):
            if plan is None:
                out.append(None)
                continue
            wanted, objects = plan
            cr, shape, dtype = self.columns[c].chunk_rows, objects[0][1], objects[0][2]
            parts = [decoder.view(next(raw), dtype, shape) for _ in objects]
            full = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
            slot = np.empty(max(wanted) + 1, dtype=np.int64)
            slot[wanted] = np.arange(len(wanted)) * cr
            picked_batches = []
            for rows in group.batches:
                picked = xp.take(full, asarray_like(slot[rows // cr] + rows % cr, full, xp), axis=0)
                counts = self._rows_counts(c, rows)
                picked_batches.append(transform(picked, self.spatial, xp, tokens=self.columns[c].tokens,
                                                counts=None if counts is None else asarray_like(counts, full, xp)))
            out.append(picked_batches)
        return out

    def prefetched(self, keys: Sequence[Any], load: Any, ahead: int | None = None) -> Iterator[tuple[Any, Any]]:
        """Yield ``(key, load(key))`` in order while up to ``ahead`` (default ``prefetch``) later
        loads are queued on the pool (at most ``threads`` of them run at once)."""
        return self._ahead(list(keys), load, ahead)
