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
  ``dask.distributed`` cluster, so both give the same floating-point result (with the same BLAS
  thread count per process: it sets how :func:`~repsim.kernels._gram.row_products` splits its sums).
- With a checkpoint path, the merged state and the number of finished segments are written
  atomically (temp file + ``os.replace``) after every segment; rerunning the same call resumes after
  the last finished segment and reproduces the uninterrupted result exactly (a checkpoint also stays
  valid when only ``epochs`` is raised).

Reading is column-major within a group of batches (see :func:`_cka_segment`): memory is
``prefetch + 1`` reads of one column's group (a shuffle window, in the stores' dtype) plus, per
batch of the group, b × min(p, b) numbers per column (a column with p ≥ 4b enters the accumulator
as its b × b centred Gram, :func:`centered_gram`), and the accumulator's at most ``max_records``
per-batch records (L(L+1)/2 float64 each, :class:`~repsim.kernels.minibatch_cka.MinibatchCKA`); never
proportional to n.
``method="exact"`` (full-data linear CKA) lives in :mod:`repsim.engine.exact`.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from dataclasses import asdict, replace
from typing import Any, Sequence

import numpy as np

from repsim.heap import release_free_memory
from repsim.engine.blocks import (PLAN_VERSION, BatchPlan, BlockReader, Column, block_rows_for, ids_digest,
                                  progress_bar, resolve_columns, store_location)
from repsim.engine.checkpoint import Checkpoint
from repsim.engine.grams import REDUCE_FACTOR, centered_gram, gram_dtype
from repsim.engine.options import StreamOptions, read_ahead_bytes
from repsim.engine.result import CKAResult, SimilarityResult, _json_default
from repsim.engine.similarity import report_undefined as _report_undefined
from repsim.engine.scheduler import (array_module, device_name, get_client, reader_threads, run_tasks, scheduled,
                                     spec_threads, task_threads)
from repsim.engine.device_decode import decode_spans, device_decoder
from repsim.engine.upload import DeviceUploader, HeldUploads

__all__ = ["CKAResult", "SimilarityResult", "cka_matrix", "similarity_matrix"]


def _cka_segment(spec: dict[str, Any], epoch: int, start: int, stop: int, *, reader: BlockReader | None = None,
                 progress: Any = None, xp: Any = None) -> dict[str, Any]:
    """One task: batch groups ``start:stop`` of ``epoch`` -> the merged state of every minibatch
    measure in ``spec["measures"]`` (:func:`join_states`; default linear CKA alone).

    Column-major inside a group: each column's rows for all of the group's batches are read in one
    go (its blocks once), and each batch keeps only what the measures need from that column — the
    rows themselves, or its b × b centred Gram (:func:`centered_gram`, formed on the reader threads on
    the CPU) for a column wider than ``REDUCE_FACTOR × b`` or when a measure starts from the Gram
    (statistic ``"gram"``: RBF CKA; linear CKA then takes the same Gram, formed once).  Once every
    column is in, each batch is one ``update`` over all L columns of every measure's accumulator.
    Peak memory: ``prefetch + 1`` (group, column) reads (on the CPU: ``threads`` reads in progress,
    each finished one reduced) plus Σ_columns b·min(p, 4b) per batch of the queued groups (b·b with
    a Gram measure).

    ``spec`` holds plain data only (column list, plan parameters, options) so the task can be
    shipped to a ``dask.distributed`` worker, which opens the stores itself.
    """
    plan = BatchPlan(**spec["plan"])
    columns = [Column(**c) for c in spec["columns"]]
    L = len(columns)
    xp = array_module(spec["device"]) if xp is None else xp
    spec = {**spec, "threads": task_threads(spec, xp)}  # (None on a cluster: this worker's own)
    groups = plan.groups(epoch)[start:stop]
    own = reader is None
    if own:
        reader = BlockReader(columns, plan.n, plan.block_rows, spatial=spec["spatial"], prefetch=spec["prefetch"],
                             threads=spec["threads"])
    names = [f"{c.store}/{c.layer}" for c in columns]
    measures = segment_measures(spec)
    accs = [m.accumulator(names) for m in measures]
    # the null sees the first epoch only: one pass over disjoint batches, where permutations within
    # batches act on the data set itself (an exact test); later epochs re-pair the same examples, and
    # fresh permutations there would shrink the null's spread below the statistic's (anti-conservative)
    nulls = null_accumulators(spec, measures, names) if epoch == 0 else []
    want_gram = any(m.info.statistic == "gram" for m in measures)
    dtypes = [gram_dtype(c.dtype, xp, spec.get("compute_dtype")) for c in columns]

    def reduce(x: Any, c: int) -> Any:
        """What the accumulators keep of column c's batch: its b × b centred Gram when the column is
        wide (p >= REDUCE_FACTOR × b) or a measure starts from the Gram, else the rows themselves."""
        wide = want_gram or int(np.prod(x.shape[1:])) >= REDUCE_FACTOR * x.shape[0]
        return centered_gram(x, xp, names[c], dtypes[c]) if wide else x

    host = getattr(xp, "__name__", "") == "numpy"
    upload = None if host else DeviceUploader(xp)
    decoder = None if host else device_decoder(xp)  # chunks decoded on the GPU (engine/device_decode.py)
    held = HeldUploads()

    # a load is one column of a group, or with the chunks decoded on the device a span of columns
    # decoded in one call (engine/device_decode.py: a call per column cost more than it saved)
    spans = (_decode_spans(columns, groups, plan.block_rows) if decoder is not None
             else [range(c, c + 1) for c in range(L)])

    def load(unit: tuple[int, int]) -> list[list[Any]]:
        g, s = unit
        cols = spans[s]
        decoded = ([None] * len(cols) if decoder is None
                   else reader.gather_decoded_span(cols, groups[g], decoder, xp))
        out = []
        for c, got in zip(cols, decoded):
            if got is None:
                arrays = reader.gather(c, groups[g])
                # NumPy: reduce on the reader thread as well, so that decoding, casting and the Gram
                # GEMMs of different columns run in parallel (each releases the GIL); other namespaces
                # (GPU) are copied to the device here (pinned, on this thread's stream: engine/upload.py)
                # and reduced on the consumer thread, which computes on the device's default stream.
                got = [reduce(a, c) for a in arrays] if host else [upload(a) for a in arrays]
            out.append(got)
        return out

    # On the host the reader threads are the parallelism (decoding and the wide columns' Grams run on
    # them, and MinibatchCKA.update spreads its columns over the BLAS budget): BLAS itself runs one
    # thread meanwhile (repsim.blas), so no thread spin-waits on a busy core at a BLAS barrier.
    from contextlib import nullcontext

    from repsim.blas import blas_thread_split

    try:
        with blas_thread_split() if host else nullcontext():
            parts: list[list[Any]] = []
            # On the host a finished load holds only what the accumulator keeps (b × b Grams or
            # narrow rows), so it may run further ahead: a slow wide column at the head of the queue
            # then no longer idles the other reader threads (about 8 % faster on 2 cores,
            # bench/ooc.py).  Memory per load in progress is unchanged; at most ``threads`` run at once.
            # On a device every reader thread may hold one upload ahead (decoding is the bound there).
            ahead = _read_ahead(columns, groups, spec) if host else max(int(spec["prefetch"]), int(spec["threads"]))
            units = [(g, s) for g in range(len(groups)) for s in range(len(spans))]
            for (g, s), per_column in reader.prefetched(units, load, ahead):
                for c, arrays in zip(spans[s], per_column):
                    if c == 0:
                        parts = [[None] * L for _ in arrays]
                    for i, a in enumerate(arrays):
                        parts[i][c] = a if host else reduce(held.hold(a), c)
                if spans[s][-1] == L - 1:
                    for i, batch in enumerate(parts):
                        for acc in accs:
                            acc.update(batch)  # ends with the batch's device-to-host copy (a sync)
                        for nacc in nulls:  # the batch's permutations are keyed by its place in the plan
                            nacc.update(batch, key=(epoch, start + g, i))
                        if host:
                            release_free_memory()  # peak RSS flat in n (repsim/heap.py)
                    held.release()  # ... so the group's uploads are no longer read by the device
                    if progress is not None:
                        progress(len(parts))
                    parts = []
    finally:
        if own:
            reader.close()
        if decoder is not None and hasattr(decoder, "close"):
            decoder.close()  # (after the reader's threads: no decode is in flight)
    if spec.get("null") and not nulls:  # a later epoch's segment: empty nulls (merging adds nothing)
        nulls = null_accumulators(spec, measures, names)
    return dict(join_states(measures, accs), **join_null_states(measures, nulls))


def _decode_spans(columns: Sequence[Column], groups: Sequence[Any], block_rows: int) -> list[range]:
    """The runs of columns whose chunks one device decoding call covers (:func:`decode_spans`), sized
    by the most rows a group reads (its blocks); single columns where no group reads by blocks (the
    "examples" scheme: no chunk is decoded on the device, and one column per load keeps the reader
    threads' parallelism)."""
    rows = max((len(g.blocks) for g in groups if g.blocks is not None), default=0) * int(block_rows)
    if rows == 0:
        return [range(c, c + 1) for c in range(len(columns))]
    return decode_spans([rows * c.features * np.dtype(c.dtype).itemsize for c in columns])


SEP = "__"
DEFAULT_EPOCHS = 10  # passes over the data when none is asked (the paper's; one when every pass cuts the same batches)
NULL_PREFIX = "null~"  # state keys of a measure's permutation null: "null~<measure>__<key>"


def null_accumulators(spec: dict[str, Any], measures: Sequence[Any], names: Sequence[str]) -> list[Any]:
    """The within-batch null accumulators of a segment (:mod:`repsim.kernels.minibatch_null`; none
    without ``spec["null"]``), one per minibatch measure, in its order."""
    null = spec.get("null")
    if not null:
        return []
    if null["kind"] == "analytic":
        from repsim.kernels.analytic_null import MinibatchAnalytic

        return [MinibatchAnalytic(len(names), debiased=bool(m.options.get("debiased", True)), names=names,
                                  compute_dtype=spec.get("compute_dtype")) for m in measures]
    from repsim.kernels.minibatch_null import MinibatchNull

    return [MinibatchNull(len(names), null["groups"], int(null["permutations"]), int(null["seed"]),
                          debiased=bool(m.options.get("debiased", True)), names=names, kernel=m.null_kernel(),
                          compute_dtype=spec.get("compute_dtype"))
            for m in measures]


def join_null_states(measures: Sequence[Any], nulls: Sequence[Any]) -> dict[str, Any]:
    return {f"{NULL_PREFIX}{m.name}{SEP}{k}": v for m, acc in zip(measures, nulls) for k, v in acc.to_state().items()}


def split_null_states(measures: Sequence[Any], state: dict[str, Any]) -> list[Any]:
    """The null accumulators back from :func:`join_null_states`'s keys (none when it has none)."""
    out = []
    for m in measures:
        prefix = f"{NULL_PREFIX}{m.name}{SEP}"
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not part:
            return []
        if str(part.get("kind")) == "MinibatchAnalytic":
            from repsim.kernels.analytic_null import MinibatchAnalytic

            out.append(MinibatchAnalytic.from_state(part))
        else:
            from repsim.kernels.minibatch_null import MinibatchNull

            out.append(MinibatchNull.from_state(part, kernel=m.null_kernel()))
    return out  # state keys of several measures: "<measure>__<key>"


def segment_measures(spec: dict[str, Any]) -> list[Any]:
    """The measures of a segment spec (``spec["measures"]``: [name, options] pairs; default linear
    CKA with the spec's ``debiased`` and ``compute_dtype``)."""
    from repsim.kernels.measures import get_measure

    pairs = spec.get("measures") or [["linear_cka", {"debiased": spec["debiased"],
                                                      "compute_dtype": spec.get("compute_dtype")}]]
    return [get_measure(name, **opts) for name, opts in pairs]


def join_states(measures: Sequence[Any], accs: Sequence[Any]) -> dict[str, Any]:
    """One flat state dict (checkpoints, task results) from each measure's accumulator state."""
    return {f"{m.name}{SEP}{k}": v for m, acc in zip(measures, accs) for k, v in acc.to_state().items()}


def split_states(measures: Sequence[Any], state: dict[str, Any]) -> list[Any]:
    """The accumulators back from :func:`join_states`'s dict."""
    out = []
    for m in measures:
        prefix = m.name + SEP
        out.append(m.accumulator_from_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}))
    return out


AHEAD_BYTES = 512 << 20  # reduced columns the host readers may hold ahead (default; spec["ahead_bytes"]:
# engine.options.read_ahead_bytes of the run's memory budget, which is this at the default budget)


def _read_ahead(columns: Sequence[Column], groups: Sequence[Any], spec: dict[str, Any]) -> int:
    """(group, column) loads queued ahead of the consumer on the host: at least ``4 × threads`` (and
    ``prefetch``), and as many more as fit :data:`AHEAD_BYTES` of reduced columns (b·min(p, 4b)
    float64 per batch, an upper bound) — so that the reader threads go on with the next group's
    columns while ``MinibatchCKA.update`` runs on the last one's, instead of idling once a few
    loads are queued (a third of ``repsim cka``'s time on the 18-network digits heatmap,
    bench/heatmap18.py).  Peak memory grows by at most that budget (``spec["ahead_bytes"]``, from the run's
    ``memory_budget``: :func:`repsim.engine.options.read_ahead_bytes`)."""
    floor = max(int(spec["prefetch"]), 4 * int(spec["threads"]))
    if not groups:
        return floor
    rows = max(sum(len(r) for r in g.batches) for g in groups)
    b = max(len(r) for g in groups for r in g.batches)
    unit = max(rows * min(c.features_after(spec["spatial"]), REDUCE_FACTOR * b) * 8 for c in columns)
    return max(floor, int(spec.get("ahead_bytes", AHEAD_BYTES) // max(unit, 1)))


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


def cka_matrix(stores: Any, layers: Any = None, batch_size: int = 1500, epochs: int | None = None, seed: int = 0,
               shuffle: bool | str = True, spatial: str = "flatten", debiased: bool = True, *,
               method: str = "minibatch", shuffle_window: int | None = None,
               checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 8,
               allow_mixed_datasets: bool = False, stream: StreamOptions | None = None,
               device: Any = None, progress: bool | None = None, prefetch: int | None = None,
               threads: int | None = None, memory_budget: int | None = None, max_memory: int | None = None,
               compute_dtype: str | None = None) -> CKAResult:
    """CKA between every (store, layer) column and every other, streamed from activation stores.

    Default ``debiased=True``: the paper's debiased linear CKA (unbiased HSIC₁), as every linear-CKA
    entry point at its defaults (:func:`repsim.linear_cka`, ``repsim.similarity(X, Y, "linear_cka")``,
    :class:`~repsim.kernels.minibatch_cka.MinibatchCKA`, ``repsim cka``/``repsim similarity``).

    ``epochs``: passes over the data; default (None) 10, the paper's, or one where every pass would cut
    the same batches (one batch of all n rows, or ``shuffle="none"``); asked for explicitly in that case,
    the run warns that it computes one.
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
    ``shuffle`` unused; its n × n Grams and cross-covariances are held within the memory budget:
    beyond it the run is refused before anything is read).
    ``checkpoint``: path of a resumable checkpoint, written atomically after each segment of
    ``checkpoint_every`` batches (the last one included, so a rerun returns at once; the CLI
    deletes it once the output is written).  A checkpoint whose stores were replaced since it was
    written (same paths, other :attr:`~repsim.store.reader.ActivationStore.identity`) raises
    :class:`~repsim.engine.checkpoint.StaleCheckpointError` rather than mix their data.

    ``stream``: how the run streams (:class:`repsim.engine.options.StreamOptions`: device, reader
    threads, read-ahead, memory budget, Gram precision, progress, scheduler); the keyword arguments
    after it fill the same object, over ``stream``'s fields:
    ``device``: "cpu" (NumPy, default), "cuda" (CuPy: blocks are copied to the GPU in the stored dtype
    and the kernels run there, float32 Grams with float64 sums), "auto" (cuda when a GPU and CuPy are
    usable, else cpu) — or an array-API namespace.
    ``prefetch``/``threads``: reads in flight / reader threads (on the CPU the reader threads also
    cast and reduce wide columns to centred Grams, so ``threads`` is the compute parallelism as well;
    on a device they decode and upload, :mod:`repsim.engine.upload`).  ``threads=None``: 2 on the
    CPU, one per core (at most 16) on a device (:func:`~repsim.engine.scheduler.reader_threads`).
    ``compute_dtype``: precision of the batch Grams, wide and narrow columns alike; ``None``
    (default) picks float32 for float16/float32 columns and float64 for float64 ones on every
    device (:func:`repsim.array_api.gram_dtype`, the error bound of ``repsim.kernels.hsic``); centring
    means, slab sums, U-centring and HSIC sums are float64 either way.
    ``max_memory``: the memory budget in bytes (``StreamOptions.memory_budget``; default 8 GiB);
    ``memory_budget``: its former spelling here, the exact estimators' read panel in bytes
    (``StreamOptions.panel_bytes``; default 1/16 of the budget, at most 512 MiB).
    Tasks run here, or on the ``dask.distributed`` cluster set by :func:`repsim.set_scheduler` (or
    ``stream.scheduler``).
    """
    return similarity_matrix(
        stores, ["linear_cka"], layers, batch_size, epochs, seed, shuffle, spatial, debiased, method=method,
        shuffle_window=shuffle_window, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
        allow_mixed_datasets=allow_mixed_datasets, stream=stream, device=device, progress=progress,
        prefetch=prefetch, threads=threads, memory_budget=memory_budget, max_memory=max_memory,
        compute_dtype=compute_dtype).as_cka()


def content_identities(opened: Sequence[Any], columns: Sequence[Column]) -> dict[str, str]:
    """Each store's identity for a checkpoint: :attr:`ActivationStore.identity` (which store) and the
    :meth:`~ActivationStore.content_digest` of the arrays the pass reads (what it held), so that a
    store rewritten in place since — a version-1 store keeps its identity and has no manifest — is
    not resumed from the old content's sums."""
    read: dict[str, list[str]] = {}
    for c in columns:
        read.setdefault(c.path, ["example_ids"]).append(f"layers/{c.layer}")
    return {store_location(s): f"{s.identity}+{s.content_digest(read.get(store_location(s), ['example_ids']))}"
            for s in opened}


def similarity_matrix(stores: Any, measures: Sequence[str] | str = ("linear_cka",), layers: Any = None,
                      batch_size: int = 1500, epochs: int | None = None, seed: int = 0, shuffle: bool | str = True,
                      spatial: str = "flatten", debiased: bool = True, *, method: str = "minibatch",
                      options: dict[str, Any] | None = None, shuffle_window: int | None = None,
                      checkpoint: str | os.PathLike | None = None, checkpoint_every: int = 8,
                      allow_mixed_datasets: bool = False, permutations: int | None = None, alpha: float = 0.05,
                      null: str = "permutation", jackknife: int | None = None, stream: StreamOptions | None = None,
                      device: Any = None, progress: bool | None = None, prefetch: int | None = None,
                      threads: int | None = None, memory_budget: int | None = None, max_memory: int | None = None,
                      compute_dtype: str | None = None) -> SimilarityResult:
    """Every measure of ``measures`` (names of :mod:`repsim.kernels.measures`, or ``"a,b"``) between
    every (store, layer) column and every other, streamed from activation stores.

    Arguments as :func:`cka_matrix` (linear and RBF CKA debiased by default, ``debiased=True``), plus
    ``options`` (measure options, e.g. ``{"rbf_threshold": 1.0, "knn_k": 10}``; ``debiased`` and
    ``compute_dtype`` are passed to every measure that takes them). The memory budget
    (``stream.memory_budget`` or ``max_memory``; default 8 GiB) also bounds the exact measures' held
    columns (:mod:`repsim.engine.full`).

    ``method="minibatch"``: the measures with a minibatch estimator (linear and RBF CKA) share one
    pass per epoch — each chunk read once, each batch's centred Gram formed once per column when a
    measure starts from it — checkpointed and resumable, local or distributed, exactly as
    :func:`cka_matrix` (which is this function with ``["linear_cka"]``); the other measures use their
    exact estimator on the full data (one further pass, :mod:`repsim.engine.full`).
    ``method="exact"``: every measure on the full data (linear CKA through :mod:`repsim.engine.exact`).
    The estimator each measure used is ``result.meta["estimators"]``.  A column or pair a measure
    cannot define is NaN, reported once per measure on stderr and in ``meta["undefined"]``.

    Calibration (Gröger et al. 2026; :mod:`repsim.kernels.permutation`): ``permutations=K`` computes,
    in the same pass, K permutation nulls of every measure and pair — within each batch on the
    minibatch route (:mod:`repsim.kernels.minibatch_null`), from the prepared columns on the exact
    route — with one permutation per store and draw (layer-aggregate calibration) drawn from ``seed``
    (the minibatch null and its observed values use the first epoch: one pass over disjoint batches,
    where the within-batch test is exact);
    ``null="analytic"`` (CKA only, no K) uses the exact permutation moments instead
    (:mod:`repsim.kernels.analytic_null`).  ``alpha`` sets the threshold τ.  The result's
    :meth:`~SimilarityResult.pvalues`, :meth:`~SimilarityResult.threshold` and
    :meth:`~SimilarityResult.calibrated` give them, shaped like :meth:`~SimilarityResult.matrix`.

    Intervals (:meth:`SimilarityResult.ci`): the minibatch measures keep per-batch statistics (a
    percentile bootstrap over batches, always); ``jackknife=G`` adds, for every measure that runs its
    exact estimator, the delete-a-group jackknife over examples (G random groups drawn from ``seed``;
    G further exact passes over the held columns: :mod:`repsim.kernels.jackknife`).
    """
    opts = (stream or StreamOptions()).merged(device=device, progress=progress, read_ahead=prefetch, threads=threads,
                                               panel_bytes=memory_budget, memory_budget=max_memory, dtype=compute_dtype)
    with scheduled(opts):
        return _similarity_matrix(stores, measures, layers, batch_size, epochs, seed, shuffle, spatial, debiased,
                                  method=method, options=options, shuffle_window=shuffle_window,
                                  checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                                  allow_mixed_datasets=allow_mixed_datasets, permutations=permutations, alpha=alpha,
                                  null=null, jackknife=jackknife, stream=opts)


def _similarity_matrix(stores: Any, measures: Sequence[str] | str, layers: Any, batch_size: int, epochs: int | None,
                       seed: int, shuffle: bool | str, spatial: str, debiased: bool, *, method: str,
                       options: dict[str, Any] | None, shuffle_window: int | None,
                       checkpoint: str | os.PathLike | None, checkpoint_every: int, allow_mixed_datasets: bool,
                       permutations: int | None, alpha: float, null: str, stream: StreamOptions,
                       jackknife: int | None = None) -> SimilarityResult:
    device, progress, compute_dtype = stream.device, stream.progress, stream.dtype
    from repsim.kernels.measures import check_options, get_measure, parse_measures

    names_m = parse_measures(measures)
    check_options(names_m, dict(options or {}))
    opts = {"debiased": bool(debiased), "compute_dtype": compute_dtype, **(options or {})}
    chosen = [get_measure(m, **opts) for m in names_m]
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten' or 'mean', got {spatial!r}")
    if method not in ("minibatch", "exact"):
        raise ValueError(f"method must be 'minibatch' or 'exact', got {method!r}")
    if jackknife is not None:
        from repsim.kernels.jackknife import MIN_GROUPS

        if isinstance(jackknife, bool) or int(jackknife) != jackknife or int(jackknife) < MIN_GROUPS:
            raise ValueError(f"jackknife must be a number of groups >= {MIN_GROUPS}, got {jackknife!r}")
    opened, columns, example_ids = resolve_columns(stores, layers, allow_mixed_datasets=allow_mixed_datasets)
    names = list(dict.fromkeys(c.store for c in columns))
    xp = array_module(device)
    asked, threads = stream.threads, reader_threads(stream.threads, xp)
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
    index = [(c.store, c.layer) for c in columns]
    from repsim.engine.calibration import SCHEME, null_request

    null_req = null_request(permutations, alpha, null, seed, chosen, [names.index(c.store) for c in columns])
    calibration: dict[str, Any] = {}
    if null_req is not None:
        meta["calibration"] = {k: v for k, v in null_req.items() if k != "groups"}
        meta["calibration"]["scheme"] = SCHEME
    mini = [m for m in chosen if method == "minibatch" and m.has("minibatch")]
    exact = [m for m in chosen if m not in mini]
    jack = None
    replicates: dict[str, np.ndarray] = {}
    if jackknife is not None and exact:
        if int(jackknife) > n:
            raise ValueError(f"jackknife asks for {int(jackknife)} groups of examples, but the stores hold n = {n}")
        jack = {"groups": int(jackknife), "seed": int(seed)}
        meta["jackknife"] = dict(jack, measures=[m.name for m in exact])
    meta["measures"] = names_m
    meta["estimators"] = {m.name: "minibatch" if m in mini else "exact" for m in chosen}
    meta["measure_info"] = {m.name: dict(m.info.as_dict(), options=m.options) for m in chosen}
    values: dict[str, np.ndarray] = {}
    client = get_client()
    where = "threads" if client is None else f"distributed:{getattr(client.scheduler, 'address', '?')}"
    # where each estimator ran: the exact ones always in this process (engine.exact / engine.full
    # read every column here), the minibatch pass on the cluster when one is set
    meta["estimator_schedulers"] = {e: where if e == "minibatch" else "threads"
                                    for e in dict.fromkeys(meta["estimators"].values())}
    meta["scheduler"] = where if mini else "threads"
    if client is not None and exact:
        warnings.warn(f"the exact estimator of {', '.join(m.name for m in exact)} runs in this process, not on the "
                      "dask cluster: it reads every column here (--scheduler distributes only the minibatch pass "
                      "of linear and RBF CKA)", UserWarning, stacklevel=2)

    def run_exact() -> None:  # after the (resumable) minibatch pass, so a resume does not redo it
        if exact:
            from repsim.engine.similarity import exact_measures

            values.update(exact_measures(exact, columns, n, block_rows, spatial=spatial, xp=xp,
                                         stream=replace(stream, threads=threads), meta=meta, null=null_req,
                                         calibration=calibration, jackknife=jack, replicates=replicates))

    if not mini:
        run_exact()
        meta["device"] = "cpu"  # the exact estimators run in float64 NumPy, whatever ``device`` asked for
        return with_calibration(SimilarityResult(values={m: values[m] for m in names_m}, index=index, meta=meta),
                                calibration, replicates)

    epochs_asked = epochs is not None  # None: the default, DEFAULT_EPOCHS (the paper's), cut to one silently
    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    plan = BatchPlan(n=n, batch_size=int(batch_size), shuffle=_shuffle_scheme(shuffle), seed=int(seed),
                     block_rows=block_rows, window_rows=int(shuffle_window or 0))
    repeats = plan.same_every_epoch() if int(epochs) > 1 else None
    if repeats and not epochs_asked:
        epochs = 1
    elif repeats:  # every epoch would compute the first one's HSICs again, in another row order
        warnings.warn(f"{repeats}, so each of the {int(epochs)} epochs asked for would repeat the same computation: "
                      "it runs once (the same estimate to rounding); for epochs that differ, give a batch size "
                      "well below n and a shuffle", UserWarning, stacklevel=2)
        meta["epochs_requested"] = int(epochs)
        epochs = 1
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
        "spatial": spatial, "debiased": bool(debiased), "prefetch": int(stream.read_ahead),
        "threads": spec_threads(asked, xp), "compute_dtype": compute_dtype,
        "measures": [[m.name, m.options] for m in mini], "null": null_req,
        "ahead_bytes": read_ahead_bytes(stream.budget("similarity")),
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

    ckpt = None
    done, state = 0, None
    if checkpoint is not None:
        fingerprint = {k: meta[k] for k in ("debiased", "spatial", "n", "device", "example_ids_sha1")}
        # a token column's "mean" changed meaning (features -> tokens averaged): those old checkpoints are stale
        fingerprint.update(plan=asdict(plan), plan_version=PLAN_VERSION,
                           columns=[(c.path, c.layer, "tokens") if c.tokens and spatial == "mean"
                                    else (c.path, c.layer) for c in columns],
                           segment_batches=seg, compute_dtype=compute_dtype, measures=spec["measures"])
        if null_req is not None:  # (absent without a null: the checkpoints of earlier runs stay valid)
            fingerprint["null"] = null_req
        ckpt = Checkpoint(checkpoint, fingerprint, content_identities(opened, columns))
        done, state = ckpt.load()
        if done > len(tasks):  # made by a run with more epochs: cannot be cut back
            done, state = 0, None
        if done:
            print(f"repsim: resuming from {ckpt.path}: {done}/{len(tasks)} segments done", file=sys.stderr)
    accs = split_states(mini, state) if state is not None else None
    naccs = split_null_states(mini, state) if state is not None else None

    bar = progress_bar(sum(t[3] for t in tasks), "cka" if names_m == ["linear_cka"] else "similarity", progress)
    bar.update(sum(t[3] for t in tasks[:done]))
    remaining = [t[:3] for t in tasks[done:]]
    counts = [t[3] for t in tasks[done:]]
    reader = None
    try:
        if client is None:
            reader = BlockReader(columns, n, block_rows, spatial=spatial, prefetch=int(stream.read_ahead),
                                 threads=threads, opened=opened)
            results = run_tasks(lambda e, a, b: _cka_segment(spec, e, a, b, reader=reader, progress=bar.update, xp=xp),
                                remaining)
        else:
            if spec["device"] not in ("cpu", "cuda"):
                raise ValueError("a distributed run needs device='cpu' or 'cuda' (not a namespace object)")
            results = run_tasks(_cka_segment, [(spec, e, a, b) for e, a, b in remaining],
                                on_done=lambda i, _: bar.update(counts[i]))
        for _, seg_state in results:
            seg_accs = split_states(mini, seg_state)
            accs = seg_accs if accs is None else [a.merge(b) for a, b in zip(accs, seg_accs)]
            seg_nulls = split_null_states(mini, seg_state)
            naccs = seg_nulls if not naccs else [a.merge(b) for a, b in zip(naccs, seg_nulls)]
            done += 1
            if ckpt is not None:
                ckpt.save(done, dict(join_states(mini, accs), **join_null_states(mini, naccs or [])))
    finally:
        bar.close()
        if reader is not None:
            reader.close()
    if accs is None:
        raise RuntimeError("no batches were computed")  # unreachable: plans have >= 1 batch
    meta["n_batches"] = int(accs[0].n_batches)
    states = {}
    for m, acc in zip(mini, accs):
        with warnings.catch_warnings():  # constant columns: reported once below, with advice
            warnings.simplefilter("ignore", RuntimeWarning)
            values[m.name] = np.asarray(acc.result(), dtype=np.float64)
        _report_undefined(values[m.name], columns, meta, m)
        states[m.name] = acc.to_state()
    for m, nacc in zip(mini, naccs or []):
        calibration[m.name] = minibatch_calibration(m, nacc, null_req)
    if naccs:
        meta["calibration"]["minibatch_batches"] = int(naccs[0].n_batches)  # the first epoch's: the test's data
    run_exact()
    return with_calibration(SimilarityResult(values={m: values[m] for m in names_m}, index=index, meta=meta,
                                             states=states), calibration, replicates)


def minibatch_calibration(measure: Any, nacc: Any, request: dict[str, Any]) -> dict[str, np.ndarray]:
    """A minibatch measure's calibration arrays from its null accumulator (observed and null CKA from
    the same float64 products of the batches' Grams)."""
    from repsim.engine.calibration import analytic_arrays, calibration_arrays

    if request["kind"] == "analytic":
        obs, mean, var, mu3 = nacc.result()
        return analytic_arrays(measure, obs, mean, var, mu3, request["alpha"])
    obs, nulls = nacc.result()
    return calibration_arrays(measure, obs, nulls, request["alpha"])


def with_calibration(result: SimilarityResult, calibration: dict[str, Any],
                     replicates: dict[str, np.ndarray] | None = None) -> SimilarityResult:
    """The result with each measure's calibration arrays and jackknife replicates (in measure order)."""
    result.calibration = {m: calibration[m] for m in result.measures if m in calibration}
    result.jackknife = {m: replicates[m] for m in result.measures if replicates and m in replicates}
    return result
