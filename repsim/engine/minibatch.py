"""Out-of-core CKA between every (store, layer) pair: :func:`cka_matrix` and :class:`CKAResult`.

Minibatch CKA (paper §3.2; Nguyen, Raghu & Kornblith 2021), for columns i, j over batches B:

    CKA(i, j) = Σ_B HSIC₁(K_iB, K_jB) / sqrt(Σ_B HSIC₁(K_iB, K_iB) · Σ_B HSIC₁(K_jB, K_jB)),

accumulated by :class:`repsim.MinibatchCKA`; this module only decides which rows form each batch,
reads them from every store at once (one ``update`` sees all L columns), and schedules the work:

- Each epoch is cut into *segments* of ``checkpoint_every`` consecutive batches.  A segment is an
  independent task (:func:`_cka_segment`): it rebuilds the epoch's batch plan from
  ``(seed, epoch)``, reads its rows with a prefetching :class:`~repsim.engine.blocks.BlockReader`, feeds
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
``method="exact"`` (full-data linear CKA) lives in :mod:`repsim.engine.exact`.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np

from repsim.engine.blocks import (BatchPlan, BlockReader, Column, block_rows_for, ids_digest, progress_bar,
                                  resolve_columns, store_location)
from repsim.engine.checkpoint import Checkpoint
from repsim.engine.grams import REDUCE_FACTOR, centred_gram, gram_dtype
from repsim.engine.result import CKAResult, _json_default
from repsim.engine.scheduler import array_module, device_name, get_client, reader_threads, run_tasks
from repsim.engine.upload import DeviceUploader, HeldUploads

__all__ = ["CKAResult", "cka_matrix"]


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
    from repsim.kernels.cka import MinibatchCKA

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
    acc = MinibatchCKA(L, debiased=spec["debiased"], keep_batches=True, names=names,
                       compute_dtype=spec.get("compute_dtype"))
    dtypes = [gram_dtype(c.dtype, xp, spec.get("compute_dtype")) for c in columns]

    def reduce(x: Any, c: int) -> Any:
        """What the accumulator keeps of column c's batch: its b × b centred Gram when the column is
        wide (p >= REDUCE_FACTOR × b), else the rows themselves."""
        wide = int(np.prod(x.shape[1:])) >= REDUCE_FACTOR * x.shape[0]
        return centred_gram(x, xp, names[c], dtypes[c]) if wide else x

    host = getattr(xp, "__name__", "") == "numpy"
    upload = None if host else DeviceUploader(xp)
    held = HeldUploads()

    def load(unit: tuple[int, int]) -> list[Any]:
        g, c = unit
        arrays = reader.gather(c, groups[g])
        # NumPy: reduce on the reader thread as well, so that decoding, casting and the Gram GEMMs
        # of different columns run in parallel (each releases the GIL); other namespaces (GPU)
        # are copied to the device here (pinned, on this thread's stream: engine/upload.py) and
        # reduced on the consumer thread, which computes on the device's default stream.
        return [reduce(a, c) for a in arrays] if host else [upload(a) for a in arrays]

    # On the host the reader threads are the parallelism (decoding and the wide columns' Grams run on
    # them, and MinibatchCKA.update spreads its columns over the BLAS budget): BLAS itself runs one
    # thread meanwhile (repsim._blas), so no thread spin-waits on a busy core at a BLAS barrier.
    from contextlib import nullcontext

    from repsim._blas import blas_thread_split

    try:
        with blas_thread_split() if host else nullcontext():
            parts: list[list[Any]] = []
            # On the host a finished load holds only what the accumulator keeps (b × b Grams or
            # narrow rows), so it may run further ahead: a slow wide column at the head of the queue
            # then no longer idles the other reader threads (about 8 % faster on 2 cores,
            # bench/ooc.py).  Memory per load in progress is unchanged; at most ``threads`` run at once.
            # On a device every reader thread may hold one upload ahead (decoding is the bound there).
            ahead = _read_ahead(columns, groups, spec) if host else max(int(spec["prefetch"]), int(spec["threads"]))
            units = [(g, c) for g in range(len(groups)) for c in range(L)]
            for (g, c), arrays in reader.prefetched(units, load, ahead):
                if c == 0:
                    parts = [[None] * L for _ in arrays]
                for i, a in enumerate(arrays):
                    parts[i][c] = a if host else reduce(held.hold(a), c)
                if c == L - 1:
                    for batch in parts:
                        acc.update(batch)  # ends with the batch's device-to-host copy (a sync)
                    held.release()  # ... so the group's uploads are no longer read by the device
                    if progress is not None:
                        progress(len(parts))
                    parts = []
    finally:
        if own:
            reader.close()
    return acc.to_state()


def _report_undefined(values: np.ndarray, columns: Sequence[Column], meta: dict[str, Any]) -> None:
    """Columns constant over the examples have no CKA (NaN row and column; every other pair is
    computed): one line on stderr naming them, and ``meta["undefined_columns"]``."""
    bad = [f"{c.store}/{c.layer}" for k, c in enumerate(columns) if np.isnan(values[k, k])]
    if not bad:
        return
    meta["undefined_columns"] = bad
    print(f"repsim: CKA is undefined (NaN, blank in figures) for {len(bad)} column(s) constant over the "
          f"examples: {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''} — e.g. a zero-initialised head, "
          "or float16 storage that rounded a tiny variance to zero (re-extract with --dtype float32)",
          file=sys.stderr)


AHEAD_BYTES = 512 << 20  # reduced columns the host readers may hold ahead of the batch being updated


def _read_ahead(columns: Sequence[Column], groups: Sequence[Any], spec: dict[str, Any]) -> int:
    """(group, column) loads queued ahead of the consumer on the host: at least ``4 × threads`` (and
    ``prefetch``), and as many more as fit :data:`AHEAD_BYTES` of reduced columns (b·min(p, 4b)
    float64 per batch, an upper bound) — so that the reader threads go on with the next group's
    columns while ``MinibatchCKA.update`` runs on the last one's, instead of idling once a few
    loads are queued (a third of ``repsim cka``'s time on the 18-network digits heatmap,
    bench/heatmap18.py).  Peak memory grows by at most that budget."""
    floor = max(int(spec["prefetch"]), 4 * int(spec["threads"]))
    if not groups:
        return floor
    rows = max(sum(len(r) for r in g.batches) for g in groups)
    b = max(len(r) for g in groups for r in g.batches)
    unit = max(rows * min(c.features_after(spec["spatial"]), REDUCE_FACTOR * b) * 8 for c in columns)
    return max(floor, int(AHEAD_BYTES // max(unit, 1)))


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
            "path": store_location(s),
            "attrs": json.loads(json.dumps(dict(s.attrs), default=_json_default)),
            "layers": [c.layer for c in columns if c.store == name],
        }
    return out


def cka_matrix(stores: Any, layers: Any = None, batch_size: int = 1500, epochs: int = 10, seed: int = 0,
               shuffle: bool | str = True, spatial: str = "flatten", debiased: bool = True, *,
               method: str = "minibatch", shuffle_window: int | None = None, device: Any = "cpu",
               checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 8,
               progress: bool | None = None, prefetch: int = 2, threads: int | None = None,
               memory_budget: int = 512 * 2**20, compute_dtype: str | None = None,
               allow_mixed_datasets: bool = False) -> CKAResult:
    """CKA between every (store, layer) column and every other, streamed from activation stores.

    ``stores``: paths, globs or ``ActivationStore``s (aligned on ``example_ids``; checked first;
    stores whose dataset name/split or labels differ are refused unless ``allow_mixed_datasets``).
    ``layers``: ``None`` (all), a list for every store, or ``{store: [layers]}``.
    ``shuffle``: ``False``/"none" (consecutive batches ``[0:b], [b:2b], ...``), ``True``/"window"
    (default: blocks of whole chunks permuted per epoch, rows permuted within windows of about
    ``shuffle_window`` rows — default 4 × batch_size — and cut into near-equal batches of about
    ``batch_size``; each chunk read once per epoch) or "examples" (a uniform permutation; about
    n / batch_size reads of each store per epoch).  Permutations come from
    ``default_rng([seed, epoch])`` — see :mod:`repsim.engine.blocks`.
    ``spatial``: "flatten" (paper) or "mean" (pool conv maps first).
    ``method``: "minibatch" (paper §3.2) or "exact" (full-data linear CKA, biased or debiased, in
    float64 NumPy in this process; :mod:`repsim.engine.exact`; ``batch_size``/``epochs``/
    ``shuffle`` unused, ``memory_budget`` sizes its Gram panels).
    ``device``: "cpu" (NumPy) or "cuda" (CuPy: blocks are copied to the GPU in the stored dtype and
    the kernels run there, float32 Grams with float64 sums) — or an array-API namespace.
    ``checkpoint``: path of a resumable checkpoint, written atomically after each segment of
    ``checkpoint_every`` batches (the last one included, so a rerun returns at once; the CLI
    deletes it once the output is written).  A checkpoint whose stores were replaced since it was
    written (same paths, other :attr:`~repsim.store.reader.ActivationStore.identity`) raises
    :class:`~repsim.engine.checkpoint.StaleCheckpointError` rather than mix their data.
    ``prefetch``/``threads``: reads in flight / reader threads (on the CPU the reader threads also
    cast and reduce wide columns to centred Grams, so ``threads`` is the compute parallelism as well;
    on a device they decode and upload, :mod:`repsim.engine.upload`).  ``threads=None``: 2 on the
    CPU, one per core (at most 16) on a device (:func:`~repsim.engine.scheduler.reader_threads`).
    ``compute_dtype``: precision of the batch Grams, wide and narrow columns alike; ``None``
    (default) picks float32 for float16/float32 columns and float64 for float64 ones on every
    device (:func:`repsim._xp.gram_dtype`, the error bound of ``repsim.kernels.cka``); centring
    means, slab sums, U-centring and HSIC sums are float64 either way.
    Tasks run here, or on the ``dask.distributed`` cluster set by :func:`repsim.set_scheduler`.
    """
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten' or 'mean', got {spatial!r}")
    if method not in ("minibatch", "exact"):
        raise ValueError(f"method must be 'minibatch' or 'exact', got {method!r}")
    if compute_dtype not in (None, "float32", "float64"):
        raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {compute_dtype!r}")
    opened, columns, example_ids = resolve_columns(stores, layers, allow_mixed_datasets=allow_mixed_datasets)
    names = list(dict.fromkeys(c.store for c in columns))
    xp = array_module(device)
    threads = reader_threads(threads, xp)
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
        from repsim.engine.exact import exact_cka

        values, plan_info = exact_cka(columns, n, block_rows, debiased=debiased, spatial=spatial, xp=xp,
                                      memory_budget=memory_budget, prefetch=prefetch, threads=threads,
                                      progress=progress)
        meta.update(plan_info)
        meta["device"] = "cpu"  # exact CKA always runs in float64 NumPy, whatever ``device`` asked for
        _report_undefined(values, columns, meta)
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

    from repsim.kernels.cka import MinibatchCKA

    ckpt = None
    done, state = 0, None
    if checkpoint is not None:
        fingerprint = {k: meta[k] for k in ("debiased", "spatial", "n", "device", "example_ids_sha1")}
        fingerprint.update(plan=asdict(plan), columns=[(c.path, c.layer) for c in columns],
                           segment_batches=seg, compute_dtype=compute_dtype)
        ckpt = Checkpoint(checkpoint, fingerprint, {store_location(s): s.identity for s in opened})
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
            reader = BlockReader(columns, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads,
                                 opened=opened)
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
    with warnings.catch_warnings():  # constant columns: reported once below, with advice
        warnings.simplefilter("ignore", RuntimeWarning)
        values = np.asarray(acc.result(), dtype=np.float64)
    _report_undefined(values, columns, meta)
    result = CKAResult(values=values,
                       index=[(c.store, c.layer) for c in columns], meta=meta, state=acc.to_state())
    return result
