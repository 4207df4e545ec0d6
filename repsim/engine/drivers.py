"""Streaming drivers: per-layer metrics of activation stores in one pass over each store.

For every store, the requested layers are read block by block (a block = whole chunks; reads run
ahead on a thread pool) and every block feeds all accumulators of all layers at once — or, when
their state would exceed the memory budget (:class:`~repsim.engine.options.StreamOptions`, default 4 GiB; class means are K × P floats per layer: 6.4 GB for a
flattened ResNet-50 block1 with 1000 classes), all accumulators of each group of layers that fits,
one pass per group.  The metrics are the per-layer metric registry's
(:mod:`repsim.kernels.layer_metrics`: each declares its accumulators, what they are fed, their state
size, extra passes and how they finish into a layer's result); the driver loops over the requested
ones and names none of them:

- class separation R² (paper Eq. 11, Fig. 4, Table 3; Table E.1 distances) — :class:`repsim.ClassSeparation`;
- fraction of non-zero activations (Fig. 3) — :class:`repsim.Sparsity`;
- neural-collapse statistics (Table E.2) on the penultimate layer with the store's final-layer
  weights ``store.head`` — :class:`repsim.CollapseStats`;
- singular-value spectra (Fig. E.2) of the centred activations, of the centred class centroids and
  of the final-layer weights — :class:`repsim.kernels.spectra.ActivationSpectrum`, ``CollapseStats``.

``distance="cosine_centered"`` needs the mean over *all* examples before any cosine can be taken
(it is not a function of per-class sums), so those layers get a second pass: pass 1 collects the
global mean together with every other statistic, pass 2 re-reads only those layers.  Everything
else is exactly one read of each store.

On a ``dask.distributed`` cluster (:func:`repsim.set_scheduler`, :mod:`repsim.engine.scheduler`) work
is cut into tasks of ``blocks_per_task`` blocks; each returns its accumulators' ``to_state()``, merged
in block order, and the tasks of consecutive stores and layer groups whose merged state fits
``memory_budget`` on the client are submitted together (:func:`waves`), so that a store of a few tasks
does not leave the other workers idle.  Locally, where tasks would run one after the other, one task
reads every block (one set of accumulators, nothing to merge: peak memory does not step up with the
number of tasks).  Conv layers are flattened across space (Fig. 4 caption: "we compute cosine distances
by flattening"); ``spatial="mean"`` pools them first.
Sparsity always counts every activation (channels × positions).
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any, Iterable, Sequence

import numpy as np

from repsim.array_api import asarray_like
from repsim.results import conform
from repsim.engine.blocks import (BlockReader, Column, channels_first, progress_bar, resolve_columns, to_device,
                                  token_counts_for, transform)
from repsim.engine.options import StreamOptions
from repsim.engine.scheduler import (array_module, capped_budget, device_name, get_client, run_tasks, scheduled,
                                     spec_threads, task_threads)
from repsim.kernels.layer_metrics import DISTANCES, LAYER_METRICS, LayerMetric, Stat

__all__ = ["layer_metrics", "separation_rows", "sparsity_rows", "collapse_rows", "spectra_arrays", "DISTANCES"]

MAX_MATRIX_FEATURES = 16384  # collapse/spectra keep a P × P scatter: refuse P beyond this (8 × 2 GiB)


def requested(distances: Iterable[str] = (), sparsity: bool = False, collapse: bool = False,
              spectra: bool = False) -> list[LayerMetric]:
    """The registered per-layer metrics (:data:`repsim.kernels.layer_metrics.LAYER_METRICS`) that
    :func:`layer_metrics`' arguments ask for, in the registry's order."""
    options = {"separation": tuple(distances), "sparsity": bool(sparsity), "collapse": bool(collapse),
               "spectra": bool(spectra)}
    return [cls(options[name]) for name, cls in LAYER_METRICS.items() if options.get(name)]


def layer_stats(metrics: Sequence[LayerMetric]) -> dict[str, Stat]:
    """The accumulators of ``metrics`` by key, each once (metrics that read the same statistic share it)."""
    return {st.key: st for m in metrics for st in m.stats()}


def _accumulators(metrics: Sequence[LayerMetric], num_classes: int, what: str) -> dict[str, Any]:
    """Fresh accumulators for one layer, keyed as :func:`layer_stats`."""
    return {key: st.make(num_classes, what) for key, st in layer_stats(metrics).items()}


def _from_state(stats: dict[str, Stat], key: str, state: dict[str, Any]) -> Any:
    return stats[key].kind.from_state(state)


def _scan_task(spec: dict[str, Any], templates: dict[str, dict[str, dict[str, Any]]], start: int, stop: int, *,
               xp: Any = None, progress: Any = None) -> dict[str, dict[str, dict[str, Any]]]:
    """One task: blocks ``start:stop`` of one store into copies of ``templates``
    (``{layer: {key: empty accumulator state}}``); returns the filled states.  ``spec["metrics"]``
    names the requested metrics (``{name: option}``), whose :class:`Stat` says what each key is fed."""
    from repsim.store.reader import open_store

    columns = [Column(**c) for c in spec["columns"]]
    xp = array_module(spec["device"]) if xp is None else xp
    block_rows = spec["block_rows"]
    first = start * block_rows  # this task's rows only (a store-wide read per task was O(n²) small reads)
    store = open_store(columns[0].path)
    labels = store.label_rows(first, min(spec["n"], stop * block_rows))
    stats = layer_stats([LAYER_METRICS[name](option) for name, option in spec["metrics"].items()])
    accs = {layer: {k: _from_state(stats, k, s) for k, s in per.items()} for layer, per in templates.items()}
    host = getattr(xp, "__name__", "") == "numpy"
    # a padded text layer's real-token counts (a token mean divides by them), looked up once per column
    token_counts = {col.layer: token_counts_for(store, col, spec["spatial"]) for col in columns}
    with BlockReader(columns, spec["n"], block_rows, spatial="raw", prefetch=spec["prefetch"],
                     threads=task_threads(spec, xp)) as reader:
        for k, arrays in reader.iter_blocks(range(start, stop)):
            rows = slice(k * block_rows, k * block_rows + arrays[0].shape[0])
            y = labels[rows.start - first:rows.stop - first]
            for col, raw in zip(columns, arrays):
                per = accs.get(col.layer)
                if not per:
                    continue
                feeds = {stats[key].feed for key in per}
                counts = token_counts[col.layer]
                counts = None if counts is None else counts[rows]
                if host:
                    x_raw = channels_first(raw, col) if "raw" in feeds else None
                    x_mat = (transform(raw, spec["spatial"], tokens=col.tokens, counts=counts)
                             if feeds - {"raw"} else None)
                elif "raw" in feeds:  # the block as stored, uploaded once; the features made from it there
                    x_dev = to_device(raw, xp)
                    x_raw = channels_first(x_dev, col, xp)
                    x_mat = (transform(x_dev, spec["spatial"], xp, tokens=col.tokens,
                                       counts=None if counts is None else asarray_like(counts, x_dev, xp))
                             if feeds - {"raw"} else None)
                    del x_dev
                else:  # only the features: uploaded as such (a spatial mean is taken on the host, smaller)
                    x_raw = None
                    x_mat = to_device(transform(raw, spec["spatial"], tokens=col.tokens, counts=counts), xp)
                for key, acc in per.items():
                    feed = stats[key].feed
                    if feed == "raw":
                        acc.update(x_raw)
                    elif feed == "rows":
                        acc.update(x_mat)
                    else:
                        acc.update(x_mat, y)
            if progress is not None:
                progress(1)
    return {layer: {m: a.to_state() for m, a in per.items()} for layer, per in accs.items()}


class _Scan:
    """One pass of one store's group of layers: the task spec, the empty accumulator states each task
    starts from, and the block ranges of its tasks (one range over every block in this process)."""

    def __init__(self, columns: list[Column], n: int, block_rows: int, accs: dict[str, dict[str, Any]], *,
                 spatial: str, metrics: Sequence[LayerMetric], stream: StreamOptions, blocks_per_task: int,
                 distributed: bool) -> None:
        xp = array_module(stream.device)
        self.spec = {"columns": [asdict(c) for c in columns if c.layer in accs], "device": device_name(xp), "n": n,
                     "block_rows": block_rows, "spatial": spatial, "prefetch": int(stream.read_ahead),
                     "threads": spec_threads(stream.threads, xp), "metrics": {m.name: m.option for m in metrics}}
        self.xp = xp
        self.stats = layer_stats(metrics)
        self.templates = {layer: {m: a.to_state() for m, a in per.items()} for layer, per in accs.items()}
        n_blocks = -(-n // block_rows)
        step = blocks_per_task if distributed else n_blocks
        self.ranges = [(a, min(n_blocks, a + step)) for a in range(0, n_blocks, step)] if accs else []
        self.merged: dict[str, dict[str, Any]] = {}

    def merge(self, states: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Merge one task's states into :attr:`merged` (tasks arrive in block order)."""
        for layer, per in states.items():
            for key, state in per.items():
                part = _from_state(self.stats, key, state)
                slot = self.merged.setdefault(layer, {})
                slot[key] = part if key not in slot else slot[key].merge(part)


def _run_scans(scans: Sequence[_Scan], bar: Any) -> None:
    """Run every task of ``scans`` and merge each one's states into its scan. In this process the tasks
    run one after the other, each scan's one task over all its blocks: one set of accumulators, no
    per-task states to restore and merge, so peak memory does not step up when a store grows from one
    task's worth of blocks to several (bench/memory.py). On a ``dask.distributed`` cluster the tasks of
    all ``scans`` (several stores, or groups of layers) are submitted as one list, so that workers are not
    left idle while a small store's few tasks finish (dist audit, finding 5)."""
    owner = [(scan, a, b) for scan in scans for a, b in scan.ranges]
    if not owner:
        return
    if get_client() is None:
        for scan, a, b in owner:
            scan.merge(_scan_task(scan.spec, scan.templates, a, b, xp=scan.xp, progress=bar.update))
        return
    if any(scan.spec["device"] not in ("cpu", "cuda") for scan in scans):
        raise ValueError("a distributed run needs device='cpu' or 'cuda' (not a namespace object)")
    for i, states in run_tasks(_scan_task, [(scan.spec, scan.templates, a, b) for scan, a, b in owner],
                               on_done=lambda i, _: bar.update(owner[i][2] - owner[i][1])):
        owner[i][0].merge(states)


def waves(sizes: Sequence[int], budget: int, distributed: bool) -> list[list[int]]:
    """Indices of consecutive (store, layer group) scans run together: one each in this process; on a
    cluster as many as fit ``budget`` bytes of merged state on the client (a scan over it alone), so
    that the client holds about what one group held before, while the workers get every scan's tasks."""
    if not distributed:
        return [[i] for i in range(len(sizes))]
    return pack(list(range(len(sizes))), sizes, budget)


def _check_matrix_width(col: Column, spatial: str, what: str) -> None:
    p = col.features_after(spatial)
    if p > MAX_MATRIX_FEATURES:
        raise ValueError(f"{what} of {col.store}/{col.layer} keeps a {p}×{p} scatter matrix (> {MAX_MATRIX_FEATURES} "
                         f"features); use spatial='mean' or a narrower layer (e.g. 'pool')")


def layer_metrics(stores: Any, layers: Any = None, *, distances: Iterable[str] = (), sparsity: bool = False,
                  collapse: bool = False, spectra: bool = False, spatial: str = "flatten", blocks_per_task: int = 16,
                  stream: StreamOptions | None = None, device: Any = None, progress: bool | None = None,
                  prefetch: int | None = None, threads: int | None = None, memory_budget: int | None = None
                  ) -> dict[tuple[str, str], dict[str, Any]]:
    """Every requested metric for every (store, layer), one streaming pass per store (two for layers
    with ``cosine_centered``).  Returns ``{(store, layer): {...}}`` with keys
    ``"separation"`` ``{distance: R²}``, ``"sparsity"`` (fraction), ``"sparsity_per_channel"``,
    ``"collapse"`` (Table E.2 dict; weight keys when the store has a head whose shape matches the
    layer), ``"spectra"`` ``{"activations", "centroids"[, "weights"]: singular values}``.
    Stores are validated first (complete, layers present); they need not share examples.
    ``stream``: how the run streams (:class:`repsim.engine.options.StreamOptions`); ``device``,
    ``progress``, ``prefetch`` (its ``read_ahead``), ``threads`` and ``memory_budget`` fill the same object.
    The memory budget (bytes, default 4 GiB) bounds the accumulators' state (class means are K × P per
    layer and distance): layers are packed into groups within it, one pass over the store per group
    (:func:`state_bytes`, :func:`group_layers`); on a ``dask.distributed`` cluster it is capped at a
    quarter of the smallest memory limit per worker thread (:func:`~repsim.engine.scheduler.capped_budget`)."""
    return _run(stores, layers, distances=distances, sparsity=sparsity, collapse=collapse, spectra=spectra,
                spatial=spatial, blocks_per_task=blocks_per_task, stream=stream, device=device, progress=progress,
                prefetch=prefetch, threads=threads, memory_budget=memory_budget)[0]


def state_bytes(col: Column, metrics: Sequence[LayerMetric], num_classes: int, spatial: str) -> int:
    """Float64 bytes the accumulators of one layer hold (kernels' sufficient statistics), each shared
    accumulator once (:attr:`Stat.nbytes`): K·P per separation distance (class means), K·P + P² for
    collapse and spectra (means, within-class scatter), P² for the activation spectrum, C for sparsity
    (int64 counts per channel)."""
    P = col.features_after(spatial)
    C = col.channels
    return sum(st.nbytes(num_classes, P, C) for st in layer_stats(metrics).values())


def pack(items: Sequence[Any], sizes: Sequence[int], budget: int) -> list[list[Any]]:
    """Consecutive ``items`` packed into lists whose ``sizes`` total at most ``budget`` (an item larger
    than the budget forms its own list)."""
    out: list[list[Any]] = []
    used = 0
    for item, size in zip(items, sizes):
        if out and used + size <= budget:
            out[-1].append(item)
            used += size
        else:
            out.append([item])
            used = size
    return out


def group_layers(columns: Sequence[Column], sizes: Sequence[int], budget: int) -> list[list[Column]]:
    """Consecutive layers packed into groups whose accumulator states total at most ``budget``
    bytes (a layer larger than the budget forms its own group, :func:`pack`); one pass over the store
    per group."""
    return pack(columns, sizes, budget)


def _run(stores: Any, layers: Any, *, distances: Iterable[str], sparsity: bool, collapse: bool, spectra: bool,
         spatial: str = "flatten", blocks_per_task: int = 16, stream: StreamOptions | None = None,
         device: Any = None, progress: bool | None = None, prefetch: int | None = None, threads: int | None = None,
         memory_budget: int | None = None) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, Any]]:
    opts = (stream or StreamOptions()).merged(device=device, progress=progress, read_ahead=prefetch, threads=threads,
                                               memory_budget=memory_budget)
    with scheduled(opts):
        return _scan_stores(stores, layers, distances=distances, sparsity=sparsity, collapse=collapse,
                            spectra=spectra, spatial=spatial, blocks_per_task=blocks_per_task, stream=opts)


def _scan_stores(stores: Any, layers: Any, *, distances: Iterable[str], sparsity: bool, collapse: bool,
                 spectra: bool, spatial: str, blocks_per_task: int, stream: StreamOptions
                 ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, Any]]:
    from repsim.engine.blocks import open_stores
    from repsim.store.reader import store_names

    metrics = requested(distances, sparsity, collapse, spectra)  # refuses unknown distances
    if spatial not in ("flatten", "mean"):
        raise ValueError(f"spatial must be 'flatten' or 'mean', got {spatial!r}")
    opened = open_stores(stores)
    names = store_names(opened)
    memory_budget = capped_budget(stream.budget("layers"))  # on a cluster: within the workers' memory limit
    plans = []  # per store: (store, name, num_classes, layer groups, each group's state bytes)
    for store, name in zip(opened, names):
        _, columns, _ = resolve_columns([store], layers)  # validates: complete, layers present
        columns = [Column(**{**asdict(c), "store": name}) for c in columns]
        for col in columns:
            for m in metrics:
                if m.keeps_scatter:
                    _check_matrix_width(col, spatial, m.name)
        labels = store.labels
        if labels.size == 0:
            raise ValueError(f"store {name!r} has no examples")
        if labels.ndim != 1 and any(m.needs_labels for m in metrics):
            raise ValueError(f"store {name!r} holds multi-label targets {labels.shape}; class separation, "
                             "collapse and spectra need one class per example")
        if labels.ndim == 1 and int(labels.min()) < 0 and any(m.needs_labels for m in metrics):
            bad = int(np.count_nonzero(labels < 0))
            raise ValueError(f"store {name!r}: {bad} of its {labels.size} labels are negative (-1 marks an unlabelled "
                             "example); class separation and collapse need a class for every example: give a store "
                             "of labelled examples")
        num_classes = int(labels.max()) + 1
        size_of = {c.layer: state_bytes(c, metrics, num_classes, spatial) for c in columns}
        groups = group_layers(columns, [size_of[c.layer] for c in columns], int(memory_budget))
        plans.append((store, name, num_classes, groups, [sum(size_of[c.layer] for c in g) for g in groups]))
    passes_per_group = max([m.passes() for m in metrics], default=1)
    total = sum(-(-s.n // max(1, s.chunk_rows)) * len(g) * passes_per_group for s, _, _, g, _ in plans)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    undefined: list[str] = []
    bar = progress_bar(total, "scan", stream.progress, unit="block")
    distributed = get_client() is not None
    jobs = []  # (store, name, num_classes, head, columns of one group), in order; their state bytes
    sizes = []
    for store, name, num_classes, groups, group_sizes in plans:
        head = _effective_head(store) if any(m.reads_head for m in metrics) else None
        jobs += [(store, name, num_classes, head, columns) for columns in groups]
        sizes += group_sizes

    def scan(store: Any, columns: list[Column], accs: dict[str, dict[str, Any]]) -> _Scan:
        return _Scan(columns, store.n, max(1, min(store.n, store.chunk_rows)), accs, spatial=spatial,
                     metrics=metrics, stream=stream, blocks_per_task=max(1, int(blocks_per_task)),
                     distributed=distributed)

    try:
        for wave in waves(sizes, int(memory_budget), distributed):
            first = [scan(store, columns, {c.layer: _accumulators(metrics, num_classes, f"{name}/{c.layer}")
                                           for c in columns})
                     for store, name, num_classes, _, columns in (jobs[j] for j in wave)]
            _run_scans(first, bar)
            second = [scan(jobs[j][0], jobs[j][4], {layer: again for layer, per in f.merged.items()
                                                   if (again := {k: a for m in metrics
                                                                 for k, a in m.next_pass(per).items()})})
                      for j, f in zip(wave, first)]
            _run_scans(second, bar)  # (cosine_centered: the layers that need the global mean first)
            for j, f, g in zip(wave, first, second):
                _, name, _, head, columns = jobs[j]
                for layer, per in g.merged.items():
                    f.merged[layer].update(per)
                for col in columns:
                    out[(name, col.layer)] = _finish(f.merged.pop(col.layer), metrics, head, col, undefined)
    finally:
        bar.close()
    if undefined:
        print(f"repsim: {len(undefined)} metric(s) undefined (NaN) on layers constant over the examples: "
              f"{'; '.join(undefined[:10])}{' ...' if len(undefined) > 10 else ''} — e.g. float16 storage that "
              "rounded a tiny variance to zero (re-extract with --dtype float32)", file=sys.stderr)
    return out, dict(zip(names, opened))


def _effective_head(store: Any) -> Any:
    """The store's head (W, b) with W as the network's logits see it
    (:func:`repsim.study.objectives.classifier_weights`: a cosine head's rows normalised)."""
    from repsim.study.objectives import classifier_weights

    head = store.head
    if head is None:
        return None
    return classifier_weights((store.model or {}).get("objective"), head[0]), head[1]


def _finish(accs: dict[str, Any], metrics: Sequence[LayerMetric], head: Any, col: Column,
            undefined: list[str] | None = None) -> dict[str, Any]:
    """A layer's metrics from its merged accumulators (each metric's :meth:`LayerMetric.finish`, in
    registry order).  One with no value on this layer (a constant layer's R² or collapse metrics) is
    NaN, and ``"<metric> of <store>/<layer>"`` goes to ``undefined`` (reported once by :func:`_run`);
    NaN/inf data and other errors still raise."""
    undefined = [] if undefined is None else undefined
    where = f"{col.store}/{col.layer}"
    res: dict[str, Any] = {}
    for m in metrics:
        res.update(m.finish(accs, head, where, undefined))
    return res


# --------------------------------------------------------------------------------------------------
# tables (docs/architecture.md "Results files")


def _model_columns(store: Any) -> dict[str, Any]:
    model = getattr(store, "model", None) or store.attrs.get("model") or {}
    seed = model.get("seed", "")
    return {"objective": model.get("objective", "") or "", "seed": "" if seed is None else seed}


def estimator_columns(store: Any, spatial: str = "flatten") -> dict[str, Any]:
    """The estimator metadata every row of separation/sparsity/collapse.csv ends with: the store's
    ``dataset``, ``split``, ``n`` and extraction-time ``spatial`` reduction (attrs), ``method`` (``exact``:
    statistics accumulated over all n examples in one streamed pass, so no batch size, epochs or seed)
    and ``engine_spatial``, how the command reduced conv maps (``flatten``/``mean``)."""
    attrs = getattr(store, "attrs", {}) or {}
    dataset = attrs.get("dataset") or {}
    return {"dataset": dataset.get("name") or "", "split": dataset.get("split") or "", "n": store.n,
            "spatial": (attrs.get("extraction") or {}).get("spatial") or "", "method": "exact",
            "engine_spatial": spatial}


def separation_rows(stores: Any, layers: Any = None, distances: Iterable[str] = ("cosine",), **kw: Any) -> list[dict]:
    """Rows ``store, objective, seed, layer, distance, r2`` + :func:`estimator_columns` (separation.csv)."""
    res, lookup = _run(stores, layers, distances=distances, sparsity=False, collapse=False, spectra=False, **kw)
    sp = kw.get("spatial", "flatten")
    return conform("separation", [{"store": s, **_model_columns(lookup[s]), "layer": layer, "distance": d, "r2": r2,
                                   **estimator_columns(lookup[s], sp)}
                                  for (s, layer), m in res.items() for d, r2 in m["separation"].items()])


def sparsity_rows(stores: Any, layers: Any = None, **kw: Any) -> list[dict]:
    """Rows ``store, objective, seed, layer, nonzero_fraction`` + :func:`estimator_columns` (sparsity.csv)."""
    res, lookup = _run(stores, layers, distances=(), sparsity=True, collapse=False, spectra=False, **kw)
    sp = kw.get("spatial", "flatten")
    return conform("sparsity", [{"store": s, **_model_columns(lookup[s]), "layer": layer,
                                 "nonzero_fraction": m["sparsity"], **estimator_columns(lookup[s], sp)}
                                for (s, layer), m in res.items()])


def collapse_rows(stores: Any, layers: Any = ("pool",), *, spectra: bool = False, **kw: Any
                  ) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Rows ``store, objective, seed, layer, <collapse keys>`` + :func:`estimator_columns` (collapse.csv)
    and, with ``spectra``, the ``{"<store>/<layer>/<kind>": singular values}`` dict of spectra.npz."""
    res, lookup = _run(stores, layers, distances=(), sparsity=False, collapse=True, spectra=spectra, **kw)
    sp = kw.get("spatial", "flatten")
    rows = conform("collapse", [{"store": s, **_model_columns(lookup[s]), "layer": layer, **m["collapse"],
                                 **estimator_columns(lookup[s], sp)} for (s, layer), m in res.items()])
    arrays = {f"{s}/{layer}/{kind}": sv for (s, layer), m in res.items() for kind, sv in m.get("spectra", {}).items()}
    return rows, arrays


def spectra_arrays(stores: Any, layers: Any = ("pool",), **kw: Any) -> dict[str, np.ndarray]:
    """``{"<store>/<layer>/<kind>": singular values}`` (spectra.npz), kinds activations, centroids, weights."""
    res = layer_metrics(stores, layers, spectra=True, **kw)
    return {f"{s}/{layer}/{kind}": sv for (s, layer), m in res.items() for kind, sv in m["spectra"].items()}
