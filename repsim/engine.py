"""Out-of-core CKA between every (store, layer) pair: :func:`cka_matrix` and :class:`CKAResult`.

Minibatch CKA (paper §3.2; Nguyen, Raghu & Kornblith 2021), for columns i, j over batches B:

    CKA(i, j) = Σ_B HSIC₁(K_iB, K_jB) / sqrt(Σ_B HSIC₁(K_iB, K_iB) · Σ_B HSIC₁(K_jB, K_jB)),

accumulated by :class:`repsim.MinibatchCKA`; this module only decides which rows form each batch,
reads them from every store at once (one ``update`` sees all L columns), and schedules the work:

- Each epoch is cut into *segments* of ``checkpoint_every`` consecutive batches.  A segment is an
  independent task (:func:`_cka_segment`): it rebuilds the epoch's batch plan from
  ``(seed, epoch)``, reads its rows with a prefetching :class:`~repsim.engine_io.BlockReader`, feeds
  a fresh ``MinibatchCKA`` and returns ``to_state()``.
- Segment states are merged **in segment order** (epoch-major), whether segments ran here or on a
  ``dask.distributed`` cluster, so both give the same floating-point result.
- With a checkpoint path, the merged state and the number of finished segments are written
  atomically (temp file + ``os.replace``) after every segment; rerunning the same call resumes after
  the last finished segment and reproduces the uninterrupted result exactly (a checkpoint also stays
  valid when only ``epochs`` is raised).

Reading is column-major within a group of batches (see :func:`_cka_segment`): memory is
``prefetch + 1`` reads of one column's group (a shuffle window, in the stores' dtype) plus, per
batch of the group, b × min(p, b) numbers per column (a column with p ≥ 4b enters the accumulator
as its b × b centred Gram, :func:`centred_gram`); never proportional to n.
``method="exact"`` (full-data linear CKA) lives in :mod:`repsim.engine_exact`.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from repsim.cka import CentredGram
from repsim._xp import astype as fast_astype
from repsim._xp import diagonal, is_gpu_namespace
from repsim.engine_io import (BatchPlan, BlockReader, Column, block_rows_for, ids_digest, progress_bar,
                              resolve_columns, to_device)
from repsim.scheduler import array_module, device_name, get_client, run_tasks

__all__ = ["CKAResult", "cka_matrix"]

_STATE_PREFIX = "state__"


# --------------------------------------------------------------------------------------------------
# result


@dataclass
class CKAResult:
    """CKA between every pair of columns.

    ``values`` (L, L) float64; ``index`` [(store, layer)] labels rows and columns; ``meta`` the
    estimator settings (method, debiased, batch_size, epochs, seed, shuffle scheme, n, spatial,
    device) and ``meta["stores"]``, the provenance of every store (path, attrs, example-id digest);
    ``state`` the ``MinibatchCKA.to_state()`` dict with the per-batch HSIC statistics used for
    bootstrap confidence intervals (``None`` for ``method="exact"``).
    """

    values: np.ndarray
    index: list[tuple[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] | None = None

    @property
    def stores(self) -> list[str]:
        """Store names in index order, each once."""
        return list(dict.fromkeys(s for s, _ in self.index))

    def layers(self, store: str | None = None) -> list[str]:
        """Layer names of ``store`` (default: the first store) in index order."""
        store = self.stores[0] if store is None else store
        return [layer for s, layer in self.index if s == store]

    def position(self, store: str, layer: str) -> int:
        try:
            return self.index.index((store, layer))
        except ValueError:
            raise KeyError(f"({store!r}, {layer!r}) is not in this result; stores: {self.stores}") from None

    def get(self, store_a: str, layer_a: str, store_b: str, layer_b: str) -> float:
        return float(self.values[self.position(store_a, layer_a), self.position(store_b, layer_b)])

    def block(self, store_a: str, store_b: str | None = None) -> np.ndarray:
        """The (layers of a) × (layers of b) sub-matrix: one panel of paper Fig. 2a."""
        store_b = store_a if store_b is None else store_b
        rows = [i for i, (s, _) in enumerate(self.index) if s == store_a]
        cols = [i for i, (s, _) in enumerate(self.index) if s == store_b]
        if not rows or not cols:
            raise KeyError(f"unknown store {store_a if not rows else store_b!r}; stores: {self.stores}")
        return self.values[np.ix_(rows, cols)]

    def ci(self, level: float = 0.95, *, n_boot: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Bootstrap confidence interval (lower, upper), each (L, L), from the per-batch statistics.

        Resamples have the size of one epoch (``meta["batches_per_epoch"][0]`` batches, drawn
        from the records of all epochs): every epoch re-reads the same n examples, so E epochs do
        not make the estimate E times more certain about the data; see ``MinibatchCKA.result``.
        """
        if self.state is None:
            raise ValueError("this result has no per-batch statistics (method='exact' or saved without them)")
        from repsim.cka import MinibatchCKA

        acc = MinibatchCKA.from_state(self.state)
        per_epoch = self.meta.get("batches_per_epoch")
        draws = min(int(per_epoch[0]), acc.n_batches) if per_epoch else None
        out = acc.result(ci=level, n_boot=n_boot, seed=seed, draws=draws)
        if isinstance(out, tuple) and len(out) == 3:
            return out[1], out[2]
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple):
            return out[1]
        raise TypeError(f"unexpected MinibatchCKA.result(ci=...) return value: {type(out)}")

    def save(self, path: str | os.PathLike) -> str:
        """Write ``.npz`` (CONTRACTS "Results files"): ``values``, ``stores``, ``layers``, ``meta``
        (JSON string) and ``state__<key>`` for every per-batch statistic.  Atomic."""
        arrays: dict[str, Any] = {
            "values": np.asarray(self.values, dtype=np.float64),
            "stores": np.array([s for s, _ in self.index], dtype=str),
            "layers": np.array([layer for _, layer in self.index], dtype=str),
            "meta": np.array(json.dumps(self.meta, sort_keys=True, default=_json_default)),
        }
        for key, value in (self.state or {}).items():
            arrays[_STATE_PREFIX + key] = np.asarray(value)
        return _atomic_savez(path, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CKAResult":
        with np.load(os.fspath(path), allow_pickle=False) as z:
            state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
            return cls(values=np.array(z["values"]), index=list(zip(z["stores"].tolist(), z["layers"].tolist())),
                       meta=json.loads(str(z["meta"])), state=state or None)

    def __repr__(self) -> str:
        m = self.meta
        return (f"CKAResult({len(self.index)}×{len(self.index)}, stores={len(self.stores)}, "
                f"method={m.get('method')}, debiased={m.get('debiased')}, n={m.get('n')})")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _unwrap(value: np.ndarray) -> Any:
    """0-d arrays back to Python scalars (state dicts hold ints, bools, floats and arrays)."""
    return value.item() if value.ndim == 0 else np.array(value)


def _atomic_savez(path: str | os.PathLike, arrays: dict[str, Any]) -> str:
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------
# checkpoints


class Checkpoint:
    """Accumulator state + number of finished segments, keyed by a fingerprint of the computation."""

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
        self.path = os.fspath(path)
        if not self.path.endswith(".npz"):
            self.path += ".npz"
        self.fingerprint = json.dumps(fingerprint, sort_keys=True, default=_json_default)

    def load(self) -> tuple[int, dict[str, Any] | None]:
        """``(segments done, state)``; ``(0, None)`` when absent or made by a different computation."""
        if not os.path.exists(self.path):
            return 0, None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["fingerprint"]) != self.fingerprint:
                    print(f"repsim: checkpoint {self.path} belongs to a different computation; starting over",
                          file=sys.stderr)
                    return 0, None
                state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
                return int(z["done"]), state
        except (OSError, ValueError, KeyError) as exc:  # truncated/corrupt: cannot happen with os.replace, but be safe
            print(f"repsim: ignoring unreadable checkpoint {self.path}: {exc}", file=sys.stderr)
            return 0, None

    def save(self, done: int, state: dict[str, Any]) -> None:
        arrays = {"fingerprint": np.array(self.fingerprint), "done": np.array(done)}
        arrays.update({_STATE_PREFIX + k: np.asarray(v) for k, v in state.items()})
        _atomic_savez(self.path, arrays)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


# --------------------------------------------------------------------------------------------------
# tasks


REDUCE_FACTOR = 4  # columns wider than this many times the batch are reduced to their b × b Gram


def centred_gram(x: Any, xp: Any, what: str = "X", dtype: Any = None) -> CentredGram:
    """The batch's centred Gram ``K_c = X_c X_cᵀ`` (b × b, float64), which is all that linear HSIC
    sees of a layer: b² numbers instead of b·p, handed to ``MinibatchCKA.update`` as a
    :class:`~repsim.cka.CentredGram`.

    X_c (the batch, column-centred) and the product are formed in ``dtype`` (default: float64 on
    the CPU, float32 on a GPU; the engine passes :func:`gram_dtype` of the column); K_c is kept in
    float64.  NaN or infinite values make tr(K_c) non-finite: ``ValueError`` naming ``what``; so
    does a layer that is constant over the batch (tr(K_c) within the rounding of the mean, the
    rule of ``repsim.cka``'s feature path).
    """
    if dtype is None:
        dtype = xp.float32 if is_gpu_namespace(xp) else xp.float64
    X = xp.reshape(x, (x.shape[0], -1))
    if isinstance(X, np.ndarray) and X.shape[1] > 2 * GRAM_COLUMN_BLOCK:
        K, mean_sq = _centred_gram_blocked(X, np.dtype(dtype))
    else:
        X = fast_astype(X, dtype, xp) if X.dtype != dtype else X - 0  # a fresh array: centred in place
        mean = xp.mean(X, axis=0, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported below, by name
            X -= mean
        K = fast_astype(X @ X.T, xp.float64, xp)  # (X.T: CuPy <= 13 lacks matrix_transpose)
        mean_sq = float(xp.sum(mean * mean))
        del X
    b = K.shape[0]
    tr = float(xp.sum(diagonal(K, xp)))
    if not math.isfinite(tr):
        raise ValueError(f"{what} contains NaN or infinite values")
    tol = (4 * b * float(xp.finfo(dtype).eps)) ** 2 * b * mean_sq
    if tr <= tol:
        raise ValueError(f"{what} is constant over the examples (zero variance): CKA is undefined")
    return CentredGram(K)


GRAM_COLUMN_BLOCK = 2048  # features per slab of the blocked host Gram


def _centred_gram_blocked(X: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, float]:
    """K_c = Σ_slabs X_c[:, s] X_c[:, s]ᵀ over slabs of ``GRAM_COLUMN_BLOCK`` features (NumPy).

    Centring is per feature, so each slab is cast, centred and multiplied while it sits in cache
    (b × 2048 float32 = 2 MiB at b = 256) instead of three passes over the whole b × p batch in
    memory: ~20 % less CPU per wide column on the CI box.  Returns (K_c in float64, ‖mean‖²).
    """
    b, p = X.shape
    K = np.zeros((b, b), dtype=dtype)
    mean_sq = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported by the caller
        for s in range(0, p, GRAM_COLUMN_BLOCK):
            slab = X[:, s:s + GRAM_COLUMN_BLOCK]
            S = fast_astype(slab, dtype, np) if slab.dtype != dtype else np.array(slab, dtype=dtype)
            m = S.mean(axis=0, keepdims=True)
            S -= m
            K += S @ S.T
            mean_sq += float(np.sum(m * m, dtype=np.float64))
    return K.astype(np.float64), mean_sq


def gram_dtype(stored: str, xp: Any, requested: str | None = None) -> Any:
    """Precision of a wide column's batch Gram (DESIGN.md "Numerics", refined).

    ``requested`` ("float32" | "float64") wins.  Otherwise float32 for columns stored in float16
    (every product of two float16 values is exact in float32; only the sums round, ~√p·2⁻²⁴
    relative, far below the 2⁻¹¹ of the stored values, and float32 GEMMs run at twice the rate
    and half the memory traffic of float64), and on a GPU for every column not stored in float64;
    float64 for float32/float64 columns on the CPU.  The b × b Grams are then kept and summed in
    float64 either way.
    """
    if requested is not None:
        if requested not in ("float32", "float64"):
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {requested!r}")
        return getattr(xp, requested)
    size = np.dtype(stored).itemsize
    if size <= 2 or (is_gpu_namespace(xp) and size < 8):
        return xp.float32
    return xp.float64


def _cka_segment(spec: dict[str, Any], epoch: int, start: int, stop: int, *, reader: BlockReader | None = None,
                 progress: Any = None, xp: Any = None) -> dict[str, Any]:
    """One task: batch groups ``start:stop`` of ``epoch`` -> ``MinibatchCKA.to_state()``.

    Column-major inside a group: each column's rows for all of the group's batches are read in one
    go (its blocks once), and each batch keeps only what the kernel needs from that column — the
    rows themselves, or for a column wider than ``REDUCE_FACTOR × b`` its b × b centred Gram
    (:func:`centred_gram`, formed on the reader threads on the CPU).  Once every column is in, each
    batch is one ``MinibatchCKA.update`` over all L columns.  Peak memory: ``prefetch + 1``
    (group, column) reads (on the CPU: ``threads`` reads in progress, each finished one reduced)
    plus Σ_columns b·min(p, 4b) per batch of the queued groups.

    ``spec`` holds plain data only (column list, plan parameters, options) so the task can be
    shipped to a ``dask.distributed`` worker, which opens the stores itself.
    """
    from repsim.cka import MinibatchCKA

    plan = BatchPlan(**spec["plan"])
    columns = [Column(**c) for c in spec["columns"]]
    L = len(columns)
    xp = array_module(spec["device"]) if xp is None else xp
    groups = plan.groups(epoch)[start:stop]
    own = reader is None
    if own:
        reader = BlockReader(columns, plan.n, plan.block_rows, spatial=spec["spatial"], prefetch=spec["prefetch"],
                             threads=spec["threads"])
    names = [f"{c.store}/{c.layer}" for c in columns]
    acc = MinibatchCKA(L, debiased=spec["debiased"], keep_batches=True, names=names)
    dtypes = [gram_dtype(c.dtype, xp, spec.get("compute_dtype")) for c in columns]

    def reduce(x: Any, c: int) -> Any:
        """What the accumulator keeps of column c's batch: its b × b centred Gram when the column is
        wide (p >= REDUCE_FACTOR × b), else the rows themselves."""
        wide = int(np.prod(x.shape[1:])) >= REDUCE_FACTOR * x.shape[0]
        return centred_gram(x, xp, names[c], dtypes[c]) if wide else x

    host = getattr(xp, "__name__", "") == "numpy"

    def load(unit: tuple[int, int]) -> list[Any]:
        g, c = unit
        arrays = reader.gather(c, groups[g])
        # NumPy: reduce on the reader thread as well, so that decoding, casting and the Gram GEMMs
        # of different columns run in parallel (each releases the GIL); other namespaces (GPU)
        # reduce on the consumer thread, which owns the device.
        return [reduce(a, c) for a in arrays] if host else arrays

    try:
        parts: list[list[Any]] = []
        # On the host a finished load holds only what the accumulator keeps (b × b Grams or narrow
        # rows), so it may run further ahead: a slow wide column at the head of the queue then no
        # longer idles the other reader threads (about 8 % faster on 2 cores, bench/ooc.py).
        # Memory per load in progress is unchanged; at most ``threads`` run at once.
        ahead = max(reader.prefetch, 4 * spec["threads"]) if host else None
        units = [(g, c) for g in range(len(groups)) for c in range(L)]
        for (g, c), arrays in reader.prefetched(units, load, ahead):
            if c == 0:
                parts = [[None] * L for _ in arrays]
            for i, a in enumerate(arrays):
                parts[i][c] = a if host else reduce(to_device(a, xp), c)
            if c == L - 1:
                for batch in parts:
                    acc.update(batch)
                if progress is not None:
                    progress(len(parts))
                parts = []
    finally:
        if own:
            reader.close()
    return acc.to_state()


# --------------------------------------------------------------------------------------------------
# public entry point


def _shuffle_scheme(shuffle: bool | str) -> str:
    if shuffle is True:
        return "window"
    if shuffle is False or shuffle is None:
        return "none"
    return str(shuffle)


def _provenance(stores: Sequence[Any], names: Sequence[str], columns: Sequence[Column]) -> dict[str, Any]:
    out = {}
    for s, name in zip(stores, names):
        out[name] = {
            "path": os.path.abspath(os.fspath(s.path)),
            "attrs": json.loads(json.dumps(dict(s.attrs), default=_json_default)),
            "layers": [c.layer for c in columns if c.store == name],
        }
    return out


def cka_matrix(stores: Any, layers: Any = None, batch_size: int = 1500, epochs: int = 10, seed: int = 0,
               shuffle: bool | str = True, spatial: str = "flatten", debiased: bool = True, *,
               method: str = "minibatch", shuffle_window: int | None = None, device: Any = "cpu",
               checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 8,
               progress: bool | None = None, prefetch: int = 2, threads: int = 2,
               memory_budget: int = 512 * 2**20, compute_dtype: str | None = None) -> CKAResult:
    """CKA between every (store, layer) column and every other, streamed from activation stores.

    ``stores``: paths, globs or ``ActivationStore``s (aligned on ``example_ids``; checked first).
    ``layers``: ``None`` (all), a list for every store, or ``{store: [layers]}``.
    ``shuffle``: ``False``/"none" (consecutive batches ``[0:b], [b:2b], ...``), ``True``/"window"
    (default: blocks of whole chunks permuted per epoch, rows permuted within windows of about
    ``shuffle_window`` rows — default 4 × batch_size — and cut into near-equal batches of about
    ``batch_size``; each chunk read once per epoch) or "examples" (a uniform permutation; about
    n / batch_size reads of each store per epoch).  Permutations come from
    ``default_rng([seed, epoch])`` — see :mod:`repsim.engine_io`.
    ``spatial``: "flatten" (paper) or "mean" (pool conv maps first).
    ``method``: "minibatch" (paper §3.2) or "exact" (full-data linear CKA, biased or debiased, in
    float64 NumPy in this process; :mod:`repsim.engine_exact`; ``batch_size``/``epochs``/
    ``shuffle`` unused, ``memory_budget`` sizes its Gram panels).
    ``device``: "cpu" (NumPy) or "cuda" (CuPy: blocks are copied to the GPU in the stored dtype and
    the kernels run there, float32 Grams with float64 sums) — or an array-API namespace.
    ``checkpoint``: path of a resumable checkpoint, written atomically after each segment of
    ``checkpoint_every`` batches (the last one included, so a rerun returns at once; the CLI
    deletes it once the output is written).  ``prefetch``/``threads``: reads in flight / reader
    threads (on the CPU the reader threads also cast and reduce wide columns to centred Grams, so
    ``threads`` is the compute parallelism as well).
    ``compute_dtype``: precision of the wide columns' batch Grams; ``None`` (default) picks float32
    for float16 columns (and on a GPU for all but float64 ones), float64 otherwise — see
    :func:`gram_dtype`; per-batch HSIC values are always summed in float64.
    Tasks run here, or on the ``dask.distributed`` cluster set by :func:`repsim.set_scheduler`.
    """
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten' or 'mean', got {spatial!r}")
    if method not in ("minibatch", "exact"):
        raise ValueError(f"method must be 'minibatch' or 'exact', got {method!r}")
    if compute_dtype not in (None, "float32", "float64"):
        raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {compute_dtype!r}")
    opened, columns, example_ids = resolve_columns(stores, layers)
    names = list(dict.fromkeys(c.store for c in columns))
    xp = array_module(device)
    n = int(example_ids.shape[0])
    block_rows = block_rows_for(columns, n)
    meta: dict[str, Any] = {
        "method": method, "debiased": bool(debiased), "spatial": spatial, "n": n,
        "device": device_name(xp), "example_ids_sha1": ids_digest(example_ids),
        "stores": _provenance(opened, [s for s in names], columns),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        from repsim import __version__

        meta["repsim_version"] = __version__
    except ImportError:  # pragma: no cover
        pass
    if method == "exact":
        from repsim.engine_exact import exact_cka

        values, plan_info = exact_cka(columns, n, block_rows, debiased=debiased, spatial=spatial, xp=xp,
                                      memory_budget=memory_budget, prefetch=prefetch, threads=threads,
                                      progress=progress)
        meta.update(plan_info)
        meta["device"] = "cpu"  # exact CKA always runs in float64 NumPy, whatever ``device`` asked for
        return CKAResult(values=values, index=[(c.store, c.layer) for c in columns], meta=meta)

    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    plan = BatchPlan(n=n, batch_size=int(batch_size), shuffle=_shuffle_scheme(shuffle), seed=int(seed),
                     block_rows=block_rows, window_rows=int(shuffle_window or 0))
    seg = max(1, int(checkpoint_every))
    tasks: list[tuple[int, int, int, int]] = []  # (epoch, first group, end group, batches)
    epoch_sizes = []
    for e in range(int(epochs)):
        sizes = [len(g.batches) for g in plan.groups(e)]
        epoch_sizes.append(sizes)
        start = count = 0
        for g, k in enumerate(sizes):  # segments: whole groups, >= checkpoint_every batches each
            count += k
            if count >= seg or g == len(sizes) - 1:
                tasks.append((e, start, g + 1, count))
                start, count = g + 1, 0
    first = plan.batches(0)
    spec = {
        "plan": asdict(plan), "columns": [asdict(c) for c in columns], "device": device_name(xp),
        "spatial": spatial, "debiased": bool(debiased), "prefetch": int(prefetch), "threads": int(threads),
        "compute_dtype": compute_dtype,
    }
    meta.update({
        "batch_size": int(batch_size), "epochs": int(epochs), "seed": int(seed), "shuffle": plan.shuffle,
        "shuffle_scheme": plan.describe(), "shuffle_window": plan.window if plan.shuffle == "window" else None,
        "block_rows": block_rows, "batches_per_epoch": [sum(s) for s in epoch_sizes],
        "batch_size_range": [int(min(r.size for r in first)), int(max(r.size for r in first))],
        "rows_dropped_per_epoch": n - sum(r.size for r in first), "segment_batches": seg,
        "reduce_rule": f"columns with p >= {REDUCE_FACTOR} x rows enter MinibatchCKA as their b x b centred Gram",
        "gram_dtypes": {c.dtype: "float32" if gram_dtype(c.dtype, xp, compute_dtype) == xp.float32 else "float64"
                        for c in columns},
    })

    from repsim.cka import MinibatchCKA

    ckpt = None
    done, state = 0, None
    if checkpoint is not None:
        fingerprint = {k: meta[k] for k in ("debiased", "spatial", "n", "device", "example_ids_sha1")}
        fingerprint.update(plan=asdict(plan), columns=[(c.path, c.layer) for c in columns],
                           segment_batches=seg, compute_dtype=compute_dtype)
        ckpt = Checkpoint(checkpoint, fingerprint)
        done, state = ckpt.load()
        if done > len(tasks):  # made by a run with more epochs: cannot be cut back
            done, state = 0, None
        if done:
            print(f"repsim: resuming from {ckpt.path}: {done}/{len(tasks)} segments done", file=sys.stderr)
    acc = MinibatchCKA.from_state(state) if state is not None else None

    bar = progress_bar(sum(t[3] for t in tasks), "cka", progress)
    bar.update(sum(t[3] for t in tasks[:done]))
    remaining = [t[:3] for t in tasks[done:]]
    counts = [t[3] for t in tasks[done:]]
    client = get_client()
    meta["scheduler"] = "threads" if client is None else f"distributed:{getattr(client.scheduler, 'address', '?')}"
    reader = None
    try:
        if client is None:
            reader = BlockReader(columns, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads)
            results = run_tasks(lambda e, a, b: _cka_segment(spec, e, a, b, reader=reader, progress=bar.update, xp=xp),
                                remaining)
        else:
            if spec["device"] not in ("cpu", "cuda"):
                raise ValueError("a distributed run needs device='cpu' or 'cuda' (not a namespace object)")
            results = run_tasks(_cka_segment, [(spec, e, a, b) for e, a, b in remaining],
                                on_done=lambda i, _: bar.update(counts[i]))
        for _, seg_state in results:
            seg_acc = MinibatchCKA.from_state(seg_state)
            acc = seg_acc if acc is None else acc.merge(seg_acc)
            done += 1
            if ckpt is not None:
                ckpt.save(done, acc.to_state())
    finally:
        bar.close()
        if reader is not None:
            reader.close()
    if acc is None:
        raise RuntimeError("no batches were computed")  # unreachable: plans have >= 1 batch
    meta["n_batches"] = int(acc.n_batches)
    result = CKAResult(values=np.asarray(acc.result(), dtype=np.float64),
                       index=[(c.store, c.layer) for c in columns], meta=meta, state=acc.to_state())
    return result
