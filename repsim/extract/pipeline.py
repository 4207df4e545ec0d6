"""Run a model over a dataset once and write its activation store (docs/architecture.md "The activation store").

Pipeline, per rank::

    in-memory images (repsim/extract/memory.py): gather thread -> pinned staging -> side stream: copy to
        the GPU + normalise, one batch ahead          | other datasets: DataLoader (workers, pinned)
    ->  forward under inference_mode (+ AMP on GPU), fixed row order
        hooks reduce and cast each layer's output on the device; a copy stream moves it into a
        pinned host chunk buffer (the compute stream never waits for a copy)
    a full chunk  ->  writer thread: wait for its copies' event, check range, compress + write it,
                      mark written[i]                    (a bounded pool of buffers bounds memory)

Nothing on the main thread synchronises with the GPU per batch: the range maxima stay on the device
until the writer thread checks them, once per chunk.

On GPU (or with CPU cores that torch's intra-op pool leaves free) the writer threads overlap the
forward passes. On a CPU whose cores the forward pass already uses, overlapping would stall every
OpenMP barrier of the forward pass behind a busy writer thread, so chunks are written in bursts
instead: the forward pass fills every buffer set, all are compressed at once on all cores, then
computing resumes (bench/extract_throughput.py measures both).

Determinism and resume: batches never straddle chunks and start at fixed offsets inside a chunk
(``chunk*rows + j*batch_size``), so a chunk's bytes do not depend on which other chunks are
pending, on how many ranks share the work, or on whether the run was interrupted. A rerun of the
same command opens the incomplete store, checks that the settings match and computes only the
chunks whose ``written`` flag is false; ``complete`` is set last by ``StoreWriter.finalize``.
One writer per store: the run holds the store's writer lock (``repsim.store.lock``) from before the
store is prepared until it is finalised (or the run fails), so a second run on the same ``out`` — a
resume, an ``--overwrite`` — is refused at once, naming the first; a killed run's lock dies with it.

Sharding (``torchrun --nproc_per_node=N -m repsim.extract ...``, or any initialised ``torch.distributed``
group): rank 0 takes the lock, creates or opens the store and lists the pending chunks, broadcasts them
(or why it could not), then every rank computes ``pending[rank::N]`` into the same store (disjoint
chunks, and ``written`` has one object per chunk, so no two ranks touch the same file); after a
barrier rank 0 writes the head and finalises.
"""
from __future__ import annotations

import math
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

import numpy as np
import torch
from torch import nn

from repsim.store.finite import ConstantLayers

from .adapt import adapt_dataset
from .capture import FLOAT16_OVERFLOW, Capture, Spatial, Tokens
from .errors import ExtractError
from .inputs import (attention_mask, batch_of_one, check_example, default_tokens, forward, in_memory_format, shape_of,
                     to_device)
from .jpeg import ROUTE_NOTE as JPEG_ROUTE
from .jpeg import choose as choose_jpeg
from .layers import (describe_pool, head_mismatch, head_module, is_classic, is_network, layer_modules, model_layout,
                     select_layers)
from .sources import example_ids, head_weights, load_dataset, load_source, weights_sha256

DTYPES = {"float16": torch.float16, "float32": torch.float32}
AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
MIN_CHUNKS = 8  # default chunking keeps at least this many chunks (pipelining, sharding, resume)
INFLIGHT_BYTES = 2 << 30  # host memory for chunk buffers (filled + queued for writing), soft cap
_CPUS: int | None = None  # cores this process may use (None: all); `repsim extract --jobs` sets it per job
PENDING_DIGEST = "(computing)"  # model.weights_sha256 until the hashing thread has it (never stored)
LOADER_SPAWN = threading.Event()  # set while extractions run as threads: DataLoader workers are spawned


def cpu_share() -> int:
    """CPU cores this extraction may use: all of them, or its share when several run side by side."""
    return _CPUS or os.cpu_count() or 1


# ----------------------------------------------------------------------------- helpers


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_distributed_from_env(device: str | None) -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1). True if we did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return False
    use_cuda = torch.cuda.is_available() and (device in (None, "auto") or str(device).startswith("cuda"))
    torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    return True


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def _resolve_amp(amp: str | None, device: torch.device) -> torch.dtype | None:
    amp = "auto" if amp is None else str(amp)
    if amp == "auto":
        return torch.float16 if device.type == "cuda" else None
    if amp in ("off", "none", "float32"):
        return None
    if amp not in AMP_DTYPES:
        raise ExtractError(f"extract: --amp must be auto, off, float16 or bfloat16, got {amp!r}")
    return AMP_DTYPES[amp]


MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


def _resolve_memory_format(requested: str | None, net: nn.Module, x0: Any) -> str:
    """``channels_last`` or ``contiguous``: the memory layout of the model's 4-D weights and of the
    image batches during extraction.  ``auto``: channels-last for image models with 2-D convolutions
    (NHWC is the layout oneDNN's and cuDNN's fast convolution kernels use: torchvision ResNets run
    1.1-1.75x faster forwards on 2 CPU cores: bench/RESULTS.md "extract_throughput"), contiguous otherwise.  Values
    are the same up to float rounding (other summation orders), so it is a resume setting."""
    requested = "auto" if requested is None else str(requested)
    if requested not in MEMORY_FORMATS:
        raise ExtractError(f"extract: --memory-format must be one of {', '.join(MEMORY_FORMATS)}, got {requested!r}")
    images = isinstance(x0, torch.Tensor) and x0.ndim == 3
    if requested == "channels_last" and not images:
        raise ExtractError("extract: --memory-format channels_last needs image inputs (C, H, W); this dataset "
                           f"yields {shape_of(x0)}")
    if requested == "auto":
        has_conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
        return "channels_last" if images and has_conv else "contiguous"
    return requested


def module_memory_format(net: nn.Module) -> str:
    """``"channels_last"`` when the module's first 4-D parameter that tells the two layouts apart
    (spatial kernel > 1, or more than one input channel) is channels-last, else ``"contiguous"``."""
    for p in net.parameters():
        if p.ndim == 4 and p.is_contiguous(memory_format=torch.channels_last) != p.is_contiguous():
            return "channels_last" if p.is_contiguous(memory_format=torch.channels_last) else "contiguous"
    return "contiguous"


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def _free_bytes(path: Path) -> int:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _msg(text: str, rank: int = 0) -> None:
    if rank == 0:
        print(f"extract: {text}", file=sys.stderr, flush=True)


@dataclass
class _Buffers:
    layers: dict[str, torch.Tensor]
    labels: np.ndarray
    amax: torch.Tensor  # (L,) host float32, pinned on CUDA
    counts: torch.Tensor | None = None  # (rows,) int32 real tokens per example (Plan.token_counts), pinned on CUDA
    event: Any = None
    chunk: int = -1


@dataclass
class Plan:
    """What one extraction will do (shapes from one probe forward pass)."""

    layers: dict[str, tuple[tuple[int, ...], str, str]]  # store layer -> (tail shape, dtype, kind)
    logits_dim: int | None  # None: the model has no classification head (no logits stored)
    n: int
    chunk_rows: int
    row_bytes: int
    head: str | None = None  # qualname of the final layer whose weights are stored (verified by the probe)
    settings: dict[str, Any] = field(default_factory=dict)
    label_dim: int | None = None  # K for multi-label targets (the dataset yields (K,) vectors), else None
    # the store records each example's count of real tokens (``token_counts``): padded text and a layer
    # stored as a token sequence (--tokens flatten), whose padded positions hold zeros
    token_counts: bool = False
    tap_layouts: dict[str, str] = field(default_factory=dict)  # 4-D layers laid out unlike the model (capture.tap_layout)

    @property
    def n_chunks(self) -> int:
        return math.ceil(self.n / self.chunk_rows)

    @property
    def estimated_bytes(self) -> int:
        return self.n * self.row_bytes


# ----------------------------------------------------------------------------- main entry


def extract_store(
    model: nn.Module | str | os.PathLike,
    data,
    out: str | os.PathLike,
    *,
    split: str | None = None,
    layers: str | list[str] | None = None,
    spatial: str = "flatten",
    dtype: str = "float16",
    batch_size: int = 128,
    workers: int | None = None,
    device: str | torch.device | None = None,
    amp: str | None = "auto",
    chunk_rows: int | None = None,
    write_threads: int | None = None,
    overlap: bool | None = None,
    overwrite: bool = False,
    check_space: bool = True,
    progress: bool | None = None,
    data_root: str | None = None,
    meta: dict[str, Any] | None = None,
    order: str = "shuffled",
    order_seed: int = 0,
    compression: str = "zstd",
    tokens: str | None = None,
    image_size: int | None = None,
    max_length: int | None = None,
    memory_format: str = "auto",
    seed: int = 0,
):
    """Extract ``model``'s layers over ``data`` into the Zarr store ``out``; returns the opened store.

    ``model``: a ``train`` checkpoint path, a model source (``torchvision:<name>[:weights]``,
    ``timm:<name>[:pretrained]``, ``hf:<id or dir>``, ``module:<module>:<factory>[:<state dict>]``;
    repsim/extract/models) or an ``nn.Module``.
    ``data``: a ``repsim.train.data.build_dataset`` spec (with ``split``; built with the run's evaluation
    transform when the model carries its run config; None = the run's own dataset), a text file/CSV
    for a text model (repsim/extract/text.py; ``max_length`` tokens, default 128) or a ``Dataset`` yielding
    ``(image, label)`` or ``(dict of token tensors, label)``; images are adapted to the model
    (repsim/extract/adapt.py: its own preprocessing, channel repeat, resize; ``image_size`` forces a size).
    ``layers``: names or fnmatch patterns of ``layer_modules(model)``, or module qualnames/globs
    (default all registry layers). ``spatial``: ``flatten`` (keep ``(C, H, W)``), ``mean`` or
    ``pool<k>``. ``tokens``: ``cls``, ``mean``, ``last`` or ``flatten`` for ``(N, T, D)`` outputs
    (default: ``mean`` for text, ``flatten`` for images; repsim/extract/capture.py). ``dtype``: store
    dtype of the layers (``float16`` default, ``float32``); logits are always float32. ``amp``:
    ``auto`` (float16 autocast on CUDA, off on CPU), ``off``, ``float16``, ``bfloat16``.
    ``write_threads``/``overlap``: compression/writing threads and whether they run during the
    forward passes (None: automatic, see the module docstring); 0 threads writes inline.
    ``compression``: ``zstd`` (default, level 1) or ``none`` for the layer arrays: uncompressed
    chunks take no CPU to write (or read), at 1.5-2x the disk space of post-ReLU float16 — the
    choice for full conv maps on a machine with few cores and a fast disk (bench/RESULTS.md).
    ``memory_format``: ``auto`` (default: channels-last for image models with 2-D convolutions, the
    layout of the fast CPU and GPU convolution kernels), ``channels_last`` or ``contiguous``; the
    stored values are the same up to float rounding, so a store resumes only with its own setting.
    ``order``: ``shuffled`` (default) writes rows in the fixed pseudo-random permutation
    ``default_rng(order_seed).permutation(n)`` of the dataset (``example_ids`` record each row's
    dataset index); ``dataset`` keeps dataset order. Every store of one dataset written with the same
    order and seed aligns row by row. Shuffled rows make every run of consecutive chunks an unbiased
    sample of the dataset, which the streaming CKA engine's chunk-window shuffling relies on: ImageNet's
    folder order is sorted by class, and windows of class-sorted rows would bias minibatch CKA.
    ``seed``: of the random weights of a model source named without weights (recorded as ``model.seed``).
    Resumes an incomplete store written with the same settings; a complete one is returned as is
    (``overwrite=True`` recomputes). Under ``torch.distributed`` the chunks are shared across ranks.
    """
    from repsim.store.lock import StoreLocked, lock_store
    from repsim.store.writer import StoreWriter
    from repsim.store.reader import open_store

    if batch_size < 1:
        raise ExtractError(f"extract: --batch-size must be >= 1, got {batch_size}")
    if compression not in ("zstd", "none"):
        raise ExtractError(f"extract: --compression must be zstd or none, got {compression!r}")
    if dtype not in DTYPES:
        raise ExtractError(f"extract: --dtype must be float16 or float32, got {dtype!r}")
    spatial_ = Spatial.parse(spatial)
    rank, world = _dist()
    dev = _resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    amp_dtype = _resolve_amp(amp, dev)
    store_dtype = DTYPES[dtype]

    given = model if isinstance(model, nn.Module) else None  # a caller's module is handed back as it came:
    given_format = module_memory_format(given) if given is not None else None  # memory format,
    given_modes = {m: m.training for m in given.modules()} if given is not None else {}  # training flags
    given_device = _module_device(given) if given is not None else None  # and device
    fmt = "contiguous"
    # a module's weights_sha256 (the store's record of which model wrote it) on a thread of its own,
    # beside the dataset, the probe and the plan; it is needed first when the store is prepared
    setup = {"start": time.perf_counter()}  # when each step before the forward passes ended (the "wrote" line)
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-hash") if given is not None else None
    digest = hashing.submit(weights_sha256, given) if hashing is not None else None
    lock = refused = None
    try:
        # one writer per store (repsim.store.lock): rank 0 holds the lock from here, before the store is
        # prepared, until it is finalised or the run fails; a second writer of ``out`` (a resume, an
        # --overwrite) is refused now, before any model is loaded. The other ranks only write chunks.
        if rank == 0:
            try:
                lock = lock_store(out, instead="choose another --out")
            except StoreLocked as exc:
                if world == 1:
                    raise
                refused = exc  # raised where rank 0 prepares the store: the other ranks hear of it there
        loaded = load_source(model, digest=PENDING_DIGEST if digest is not None else None, seed=seed)
        setup["model"] = time.perf_counter()
        net, mmeta = loaded.model, loaded.meta
        dataset, dmeta = load_dataset(data, split, data_root, net, loaded.tokenizer, max_length)
        n = len(dataset)
        if n < 1:
            raise ExtractError("extract: the dataset is empty")
        dataset, dmeta = adapt_dataset(dataset, dmeta, loaded, image_size)
        setup["data"] = time.perf_counter()
        dmeta["n"] = n
        jpeg, why = choose_jpeg(dataset, dev)  # a JPEG folder on a GPU: decoded there (extract/jpeg.py)
        if jpeg is not None:
            dmeta["transform"] = f"{dmeta.get('transform') or 'none'}; {JPEG_ROUTE}"
            _msg(why, rank)
        if order not in ("shuffled", "dataset"):
            raise ExtractError(f"extract: --order must be 'shuffled' or 'dataset', got {order!r}")
        dmeta["order"] = f"shuffled(seed={order_seed})" if order == "shuffled" else "dataset"
        net = net.to(dev).eval()
        registry = layer_modules(net)
        chosen = select_layers(registry, layers, (q for q, _ in net.named_modules()))
        if layers is not None:
            _refuse_duplicates(chosen)
        hooked = {**chosen, **({"logits": registry["logits"]} if "logits" in registry else {})}
        x0, y0 = dataset[0]
        check_example(x0)
        if np.ndim(y0) > 1:
            raise ExtractError("extract: labels must be ints or (K,) multi-label vectors, got shape "
                               f"{tuple(np.shape(y0))}")
        label_dim = None if np.ndim(y0) == 0 else int(np.shape(y0)[0])  # (K,) targets: a multi-label store
        tokens_ = Tokens.parse(tokens or default_tokens(x0))
        layout = model_layout(net)
        fmt = _resolve_memory_format(memory_format, net, x0)

        def plan_in(fmt: str) -> Plan:
            nonlocal net
            net = net.to(memory_format=torch.channels_last if fmt == "channels_last" else torch.contiguous_format)
            return _plan(net, x0, registry, chosen, hooked, spatial_, tokens_, layout, dtype, dev, amp_dtype,
                         batch_size, chunk_rows, n, label_dim, channels_last=fmt == "channels_last")

        try:
            plan = plan_in(fmt)
        except ExtractError:
            if fmt == "contiguous" or memory_format not in (None, "auto"):
                raise
            # a model that reshapes its activations with .view() fails on NHWC strides: run it as it was written
            fmt = "contiguous"
            plan = plan_in(fmt)
        setup["plan"] = time.perf_counter()
        plan.settings = {
            "layers": list(chosen), "spatial": str(spatial_), "tokens": str(tokens_), "dtype": dtype,
            "amp": str(amp_dtype).removeprefix("torch.") if amp_dtype else "off",
            "batch_size": batch_size, "chunk_rows": plan.chunk_rows, "device_type": dev.type,
            "order": dmeta["order"], "memory_format": fmt, "reductions": REDUCTIONS,
            "token_counts": plan.token_counts, "tap_layouts": plan.tap_layouts,
        }
        # a fresh store of a lone process (not a resume, not torchrun: the other ranks write into it) is
        # created on a thread of its own while the first chunks compute: the weights' sha256 it records
        # and its arrays' creation overlap the forward passes (the first chunk's write waits for it)
        later = world == 1 and (overwrite or not Path(out).exists())
        if digest is not None and not later:
            mmeta["weights_sha256"] = digest.result()
        full_meta = {
            **(meta or {}),
            "model": {**mmeta, **(meta or {}).get("model", {})},
            "dataset": {**dmeta, **(meta or {}).get("dataset", {})},
            "extraction": {
                **plan.settings, "module_names": hooked, "layout": layout, "world_size": world,
                "torch": torch.__version__, "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                "compression": compression,
            },
        }
        out = Path(out)

        def row_ids() -> np.ndarray:  # the example id of every store row, in this run's order
            return example_ids(reorder_rows(dataset, n, order, order_seed), n)

        # rank 0 prepares the store; the others learn the pending chunks (or the error) from it
        status: list[Any] = [None, None]
        created = None  # the writer rank 0 created the store with (reused: no second open)
        error: Exception | None = None
        if rank == 0:
            try:
                if refused is not None:
                    raise refused
                status, created = _prepare(out, plan, full_meta, overwrite, check_space, StoreWriter, open_store,
                                           row_ids, later=digest if later and digest is not None else later)
            except Exception as exc:  # noqa: BLE001 - forwarded to the other ranks, then re-raised
                if world == 1:
                    raise
                status, error = ["error", f"{type(exc).__name__}: {exc}"], exc
        if world > 1:
            torch.distributed.broadcast_object_list(status, src=0)
        kind, payload = status
        if error is not None:
            raise error
        if kind == "error":
            raise ExtractError(f"extract: rank 0 could not prepare {out}: {payload}")
        if kind == "complete":
            return open_store(str(out))
        pending: list[int] = payload
        mine = pending[rank::world]

        writer = created if created is not None else StoreWriter.open(str(out))
        dataset = reorder_rows(dataset, n, order, order_seed)
        ids = example_ids(dataset, n)
        t0 = setup["store"] = time.perf_counter()
        # the head's weights are written beside the forward passes (a thread of its own), not after them
        head = head_weights(net, plan.head) if plan.head and rank == 0 else None
        head_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-head") if head else None
        head_done = head_writer.submit(lambda: writer.set_head(*head)) if head_writer else None
        try:
            _run(net, dataset, writer, mine, plan, hooked, chosen, spatial_, tokens_, layout, store_dtype, dev,
                 amp_dtype, batch_size, workers, write_threads, overlap, ids, progress, rank,
                 channels_last=fmt == "channels_last", jpeg=jpeg)
        finally:
            if head_writer is not None:
                head_writer.shutdown(wait=True)
            if isinstance(writer, _PendingWriter):
                writer.wait(quiet=True)  # a creation still running when the forward passes failed: never left running
        if head_done is not None:
            head_done.result()
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            store = writer.finalize()
            dt = time.perf_counter() - t0
            _msg(f"wrote {out} ({len(pending)} chunks, {n} examples) in {dt:.1f} s, after {setup_line(setup)}")
        if world > 1:
            torch.distributed.barrier()
        return store if rank == 0 else open_store(str(out))
    finally:
        if lock is not None:
            lock.release()
        if hashing is not None:
            hashing.shutdown(wait=True)
        if given is not None and fmt != given_format:
            given.to(memory_format=torch.channels_last if given_format == "channels_last" else torch.contiguous_format)
        if given_device is not None:
            given.to(given_device)
        for m, mode in given_modes.items():
            m.training = mode


def setup_line(setup: dict[str, float]) -> str:
    """``0.3 s of setup (model 0.2, data 0.0, probe and plan 0.1, store 0.0)``: the time from the call to the
    first forward pass and its steps, from the step-end times ``setup`` ("start", "model", "data",
    "plan", "store"; bench/heatmap18.py reads the line to split a heatmap's extraction time)."""
    names = {"model": "model", "data": "data", "plan": "probe and plan", "store": "store"}
    keys = [k for k in ("start", "model", "data", "plan", "store") if k in setup]
    steps = ", ".join(f"{names[b]} {setup[b] - setup[a]:.1f}" for a, b in zip(keys, keys[1:]))
    return f"{setup[keys[-1]] - setup['start']:.1f} s of setup ({steps})"


def _module_device(net: nn.Module) -> torch.device | None:
    """The device of a module's parameters and buffers when they share one, else None (left as is)."""
    devices = {t.device for t in (*net.parameters(), *net.buffers())}
    return next(iter(devices)) if len(devices) == 1 else None


def _refuse_duplicates(chosen: dict[str, str]) -> None:
    """Refuse two requested layers that tap one module (``block1`` and its qualname ``blocks.0``):
    the store would hold two identical copies."""
    by_tap: dict[str, list[str]] = {}
    for name, tap in chosen.items():
        by_tap.setdefault(tap, []).append(name)
    same = [(tap, names) for tap, names in by_tap.items() if len(names) > 1]
    if same:
        tap, names = same[0]
        raise ExtractError(f"extract: --layers {' and '.join(map(repr, names))} name the same module "
                           f"({tap or '(model output)'!r}); the store would hold identical copies: name it once")


class _Reordered(torch.utils.data.Dataset):
    """``dataset`` read in the row order ``perm``; ``example_ids`` follow the rows."""

    def __init__(self, dataset, perm: np.ndarray, ids: np.ndarray):
        self.dataset, self.perm, self.example_ids = dataset, perm, ids

    def __len__(self) -> int:
        return len(self.perm)

    def __getitem__(self, i: int):
        return self.dataset[int(self.perm[i])]


def reorder_rows(dataset, n: int, order: str, seed: int):
    """The dataset in store row order: itself (``dataset``) or a seeded permutation (``shuffled``)."""
    if order == "dataset":
        return dataset
    perm = np.random.default_rng(seed).permutation(n)
    return _Reordered(dataset, perm, example_ids(dataset, n)[perm])


# ----------------------------------------------------------------------------- planning


def _plan(net, x0, registry, chosen, hooked, spatial, tokens, layout, dtype, dev, amp_dtype, batch_size,
          chunk_rows, n, label_dim=None, channels_last: bool = False) -> Plan:
    """Shapes of every layer from one forward pass on the first example ``x0`` (``label_dim``: K for
    multi-label targets, None for one class per example; ``channels_last``: the example is fed in
    NHWC memory, as the batches will be).

    ``logits`` are stored float32 at the root (always, when the model has a head) and, when
    selected, also as the float32 layer ``layers/logits`` so that layer-wise analyses (CKA across
    all layers) can name it. The head's weights are stored when its final layer maps ``pool`` to
    the logits (checked on this example for models outside the classic registry).
    """
    from repsim.store.format import default_chunk_rows as store_chunk_rows

    probe_taps = {**hooked, **({"pool": registry["pool"]} if "pool" in registry else {})}
    # two rows (the first example twice): an output that is not one row per example (shape (1, ...) for
    # any batch, like BERT's position embeddings) is refused here, not broadcast or failed on mid-run
    cap = _probe(net, _batch_of_two(x0), probe_taps, spatial, tokens, layout, dev, amp_dtype, channels_last)
    logits_dim = None
    if "logits" in hooked:
        logits_shape = tuple(cap.probe["logits"].shape[1:])
        if len(logits_shape) != 1:
            raise ExtractError(f"extract: logits must be (N, K), got (N, {logits_shape})")
        logits_dim = logits_shape[0]
    layers = {
        name: (tuple(cap.probe[name].shape[1:]), "float32" if name == "logits" else dtype,
               "tokens" if name in cap.token_layers else "layer")
        for name in chosen
    }
    itemsize = {"float16": 2, "float32": 4}
    layer_bytes = [math.prod(tail) * itemsize[dt] for tail, dt, _ in layers.values()]
    row = sum(layer_bytes) + 4 * (logits_dim or 0) + 8 + 4
    if chunk_rows is not None and chunk_rows < 1:
        raise ExtractError(f"extract: --chunk-rows must be >= 1, got {chunk_rows}")
    if chunk_rows is None:
        # the store's rule (the widest layer's chunk ~8 MiB, never sized by n),
        # rounded to whole batches so that every batch of a chunk is full but the last chunk's;
        chunk_rows = store_chunk_rows(layer_bytes, n)
        # ... and at least MIN_CHUNKS chunks when the data allows, so that writing overlaps computing
        chunk_rows = min(chunk_rows, math.ceil(n / MIN_CHUNKS))
        chunk_rows = max(batch_size, chunk_rows - chunk_rows % batch_size)
    counts = any(kind == "tokens" for _, _, kind in layers.values()) and attention_mask(batch_of_one(x0)) is not None
    return Plan(layers=layers, logits_dim=logits_dim, n=n, chunk_rows=min(chunk_rows, n), row_bytes=row + 4 * counts,
                head=_verified_head(net, registry, cap.probe), label_dim=label_dim, token_counts=counts,
                tap_layouts={k: v for k, v in cap.relaid.items() if k in chosen})


def _batch_of_two(x: Any) -> Any:
    """A single example twice, as a batch of two."""
    if isinstance(x, dict):
        return {k: torch.stack([v, v]) for k, v in x.items()}
    return torch.stack([x, x])


def _verified_head(net, registry, probe: dict[str, torch.Tensor]) -> str | None:
    """The final layer to store as ``head/``: a ``train`` Network's (its head may be nonlinear: cosine
    softmax), or another model's when its weights map the probed ``pool`` to the probed logits (not so
    for, e.g., a distilled two-head model, a classifier applied per token, or a layer between a
    torchvision-style ``avgpool`` and ``fc``); None otherwise, with a line saying why."""
    head = head_module(net)
    if not is_classic(net):  # a generic model's taps come from a rule of thumb: say which
        _msg(describe_pool(net))
    if head is None or "logits" not in registry:
        return None
    if is_network(net):
        return head
    hw = head_weights(net, head)
    if hw is None or "pool" not in probe:
        return None
    W, b = (torch.from_numpy(a).double() for a in hw)
    pool, logits = probe["pool"].double().cpu(), probe["logits"].double().cpu()
    if (pool.ndim != 2 or logits.ndim != 2 or pool.shape[1] != W.shape[1] or logits.shape[1] != W.shape[0]
            or not torch.allclose(pool @ W.T + b, logits, rtol=1e-2, atol=1e-2 * (float(logits.abs().max()) + 1.0))):
        _msg(head_mismatch(net, head, pool.shape[-1], logits.shape[-1]))  # never silent (repsim.extract.layers)
        return None
    return head


def _probe(net, x, hooked, spatial, tokens, layout, dev, amp_dtype, channels_last: bool = False) -> Capture:
    """Layer outputs for one example (a real forward pass: meta-device shape inference would import
    torch's compiler stack, ~2 s, and not every head runs on the meta device)."""
    with Capture(net, hooked, spatial, torch.float32, tokens, layout) as cap, torch.inference_mode(), \
            _autocast(dev, amp_dtype):
        xb = in_memory_format(to_device(x, dev), channels_last)
        cap.begin_batch(xb)
        cap.mask = attention_mask(xb)
        forward_first(net, xb, rows=2)
        cap.end_batch()
    return cap


def _one_row(shape: str, rows: int) -> str:
    """A batch's shape as that of one example (``(2, 3, 8, 8)`` -> ``(1, 3, 8, 8)``)."""
    return shape.replace(f"({rows},", "(1,") if rows != 1 else shape


def forward_first(net, xb, rows: int = 1) -> Any:
    """The forward pass on the first example (probing, ``--list-layers``; ``rows``: times it is in the
    batch ``xb``): a model that fails on it, or a hook that refuses it (a shared module), is an
    :class:`ExtractError` (one line), not a crash."""
    try:
        return forward(net, xb)
    except (RuntimeError, ValueError, TypeError, AssertionError, IndexError, KeyError) as exc:
        msg = " ".join(str(exc).split())
        if msg.startswith("extract:"):
            raise ExtractError(msg) from None
        raise ExtractError(
            f"extract: the model failed on the first example (input {_one_row(shape_of(xb), rows)}): {msg[:500]}; "
            "give the images another size with --image-size, or check --data"
        ) from None


# Every setting that changes a store's bytes, by attrs group: a store is resumed only when all of
# them match (a rerun with any other value would write its remaining chunks differently).
RESUME_KEYS: dict[str, tuple[str, ...]] = {
    "extraction": ("layers", "spatial", "tokens", "dtype", "amp", "batch_size", "chunk_rows", "device_type",
                   "compression", "order", "memory_format", "reductions", "token_counts", "tap_layouts",
                   "module_names"),  # (which module each stored layer taps: an edited extract_layers changes it)
    "model": ("arch", "checkpoint_sha256", "weights_sha256"),
    "dataset": ("name", "split", "n", "transform", "order", "fingerprint"),
}
# what a store written before a key existed recorded implicitly: no token_counts array (so a text store
# with token layers written before it existed is refused, not resumed without one), every 4-D layer
# in the model's layout (a store whose taps are now laid out otherwise is refused), and no dataset
# fingerprint (an .npz/.npy store written before the file's sha256 was recorded is refused: its
# file cannot be shown to be the same)
_IMPLIED = {"compression": "zstd", "order": "dataset", "tokens": "flatten", "memory_format": "contiguous",
            "token_counts": False, "tap_layouts": {}}
# averages over space or tokens are taken in float32 (repsim.extract.capture.reduction_dtype); before that, under
# autocast they were taken and rounded in the autocast dtype: such a store's chunks differ from this run's
REDUCTIONS = "float32"


def _implied(group: str, key: str, settings: dict):
    """A setting that a store written before the key existed recorded implicitly (None: unknown)."""
    if group == "extraction" and key == "reductions":
        return REDUCTIONS if settings.get("amp", "off") == "off" else "autocast dtype"
    return _IMPLIED.get(key)


def _compatible(attrs: dict, meta: dict) -> list[str]:
    """Settings of an existing store that differ from this run's (empty: safe to resume)."""
    diffs = []
    for group, keys in RESUME_KEYS.items():
        old, new = attrs.get(group) or {}, meta.get(group) or {}
        for key in keys:
            a, b = old.get(key, _implied(group, key, old)), new.get(key, _implied(group, key, new))
            if a != b:
                diffs.append(f"{key if group == 'extraction' else f'{group}.{key}'}: store {a!r} vs now {b!r}")
    return diffs


def _same_rows(store, ids: np.ndarray) -> str | None:
    """Where the rows already written to ``store`` hold other examples than this run would write there."""
    written = np.repeat(store.written(), store.chunk_rows)[: store.n]
    stored = np.asarray(store.example_ids)
    bad = np.flatnonzero(written & (stored != ids))
    if not bad.size:
        return None
    r = int(bad[0])
    return f"row {r} holds example {int(stored[r])} but this run puts example {int(ids[r])} there"


class _PendingWriter:
    """The ``StoreWriter`` of a store being created on a thread of its own (:func:`_prepare`'s
    ``later``): every use waits for the creation (and raises its error, if it failed)."""

    def __init__(self, future: Future, pool: ThreadPoolExecutor):
        self._future, self._pool = future, pool

    def wait(self, quiet: bool = False) -> Any:
        """The writer once created; ``quiet``: only wait (an error is raised by the next use)."""
        self._pool.shutdown(wait=True)
        if quiet:
            return None
        return self._future.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wait(), name)


def _prepare(out: Path, plan: Plan, meta: dict, overwrite: bool, check_space: bool, StoreWriter, open_store,
             row_ids: Callable[[], np.ndarray], later: bool | Future = False) -> tuple[list, Any]:
    """Create, resume or skip the store; print the size estimate; refuse when the disk is short.
    ``row_ids()``: the example ids this run writes, row by row (compared with a resumed store's).
    Returns (status, writer): status ``["complete", None]`` or ``["pending", chunks]`` (what rank 0
    broadcasts), and the ``StoreWriter`` it created or opened (None when complete). ``later``: a new
    store is created on a thread of its own, beside the first forward passes (the writer returned is
    a :class:`_PendingWriter`), after the future ``later`` (the weights' sha256, recorded as
    ``model.weights_sha256``) if it is one; the creation is atomic as ever (``StoreWriter.create``
    builds the store beside ``out`` and renames it into place)."""
    pending: range | list[int] = range(plan.n_chunks)
    created = None
    if out.exists() and not overwrite:
        store = open_store(str(out), allow_incomplete=True)
        diffs = _compatible(store.attrs, meta)
        if diffs:
            raise ExtractError(
                f"extract: {out} exists with other settings ({'; '.join(diffs)}); rerun with the store's settings "
                "to resume it, pass --overwrite to replace it, or choose another --out"
            )
        moved = None if store.complete else _same_rows(store, row_ids())
        if moved:
            raise ExtractError(
                f"extract: {out} was written in another row order ({moved}); rerun with the store's dataset and "
                "--order/--order-seed to resume it, pass --overwrite to replace it, or choose another --out"
            )
        if store.complete:
            _msg(f"{out} is already complete; nothing to do (--overwrite recomputes it)")
            return ["complete", None], None
        created = StoreWriter.open(str(out))
        pending = created.pending()
        _msg(f"resuming {out}: {plan.n_chunks - len(pending)} of {plan.n_chunks} chunks already written")
    rows = plan.n if isinstance(pending, range) else sum(min(plan.n, (c + 1) * plan.chunk_rows) - c * plan.chunk_rows for c in pending)
    need = plan.row_bytes * rows
    free = _free_bytes(out.parent if not out.exists() else out)
    _msg(
        f"estimated store size {_human(plan.estimated_bytes)} uncompressed (upper bound; compressed size "
        f"unknown until written): {plan.n} examples x {_human(plan.row_bytes)}, {len(plan.layers)} layers, "
        f"{plan.n_chunks} chunks of {plan.chunk_rows}; {_human(free)} free"
    )
    if check_space and need > free:
        smaller = "--spatial mean|pool<k>, --layers" + (  # (a float16 store is as small as dtypes go)
            " or --dtype float16" if meta["extraction"].get("dtype") != "float16" else " or fewer examples")
        raise ExtractError(
            f"extract: not enough disk space for {out}: it needs up to {_human(need)} (uncompressed) and "
            f"only {_human(free)} is free; reduce it with {smaller}, or pass --no-space-check to rely on "
            "compression"
        )
    if not out.exists() or overwrite:
        def create():
            if isinstance(later, Future) and meta["model"].get("weights_sha256") == PENDING_DIGEST:
                meta["model"]["weights_sha256"] = later.result()
            return StoreWriter.create(
                str(out), n=plan.n, layers=plan.layers, chunk_rows=plan.chunk_rows,
                logits_dim=plan.logits_dim, meta=meta, overwrite=overwrite,
                compression=meta["extraction"].get("compression", "zstd"), label_dim=plan.label_dim,
                token_counts=plan.token_counts,
            )

        if later is False:
            created = create()
        else:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-create")
            created = _PendingWriter(pool.submit(create), pool)
    return ["pending", list(pending)], created


# ----------------------------------------------------------------------------- the loop


def _autocast(dev: torch.device, amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=dev.type, dtype=amp_dtype)


def _batches(chunks: list[int], rows: int, batch_size: int, n: int) -> list[tuple[int, int, int]]:
    """(chunk, lo, hi) batches in order: never across a chunk edge, at fixed offsets within one."""
    plan = []
    for c in chunks:
        start, stop = c * rows, min(n, (c + 1) * rows)
        plan.extend((c, lo, min(lo + batch_size, stop)) for lo in range(start, stop, batch_size))
    return plan


def _inputs(dataset, batches: list[tuple[int, int, int]], dev: torch.device, workers: int,
            channels_last: bool, jpeg: Any = None) -> Generator[tuple[Any, Any], None, None]:
    """(model inputs on ``dev``, labels) for each batch. An in-memory image tensor (repsim/extract/memory.py,
    possibly in the store's shuffled row order) is sliced directly, its host-to-device copies one
    batch ahead on a side stream; a JPEG folder with ``jpeg`` (its tensor transform, extract/jpeg.py)
    is read by the workers as bytes and decoded on ``dev``; anything else goes through a DataLoader
    (``workers`` processes, pinned memory, non-blocking copies)."""
    from torch.utils.data import DataLoader

    from .jpeg import feed as jpeg_feed
    from .memory import MemoryFeed, as_image_tensor

    if jpeg is not None:
        return jpeg_feed(dataset, jpeg, [(lo, hi) for _, lo, hi in batches], dev, workers, channels_last,
                         spawn=LOADER_SPAWN.is_set())

    perm = dataset.perm if isinstance(dataset, _Reordered) else None
    source = as_image_tensor(dataset.dataset if isinstance(dataset, _Reordered) else dataset)
    if source is not None:
        return iter(MemoryFeed(source, perm, [(lo, hi) for _, lo, hi in batches], dev, channels_last))
    loader = DataLoader(
        dataset, batch_sampler=[list(range(lo, hi)) for _, lo, hi in batches], num_workers=workers,
        pin_memory=dev.type == "cuda", persistent_workers=False,
        # its own generator for the workers' base seed: not torch's global one, which a random-init
        # model built in another extraction thread draws its weights from (repsim.extract.models.common.seeded)
        generator=torch.Generator(),
        # several extractions as threads of one process (repsim/extract/cli.py): never fork it
        multiprocessing_context="spawn" if workers and LOADER_SPAWN.is_set() else None,
    )
    return ((in_memory_format(to_device(x, dev, non_blocking=dev.type == "cuda"), channels_last), y) for x, y in loader)


def _warn_constant(layers: list[str], float16: bool) -> None:
    """One warning line for layers that hold the same value in every example (no CKA, R² or collapse:
    NaN downstream); in float16 storage that is often variation below float16's resolution rounded
    away (a random network's late blocks: std ~1e-9), which ``--dtype float32`` keeps."""
    if layers:
        print(f"extract: warning: {len(layers)} layer(s) hold the same value in every example: {', '.join(layers)}; "
              "CKA, R² and collapse are undefined for them (NaN)"
              + (" — float16 storage rounds variation below its resolution to zero: rerun with --dtype float32"
                 " if they should vary" if float16 else ""), file=sys.stderr)


def _run(net, dataset, writer, chunks, plan, hooked, chosen, spatial, tokens, layout, store_dtype, dev, amp_dtype,
         batch_size, workers, write_threads, overlap, ids, progress, rank, channels_last: bool = False,
         jpeg: Any = None) -> None:
    if not chunks:
        return
    cuda = dev.type == "cuda"
    cpus = cpu_share()
    workers = min(4, max(0, cpus - 1)) if workers is None else workers
    # overlap: chunks are compressed/written while later batches compute (GPU, or spare CPU cores);
    # burst (CPU without spare cores): the forward pass fills every buffer set, then all of them are
    # written at once on all cores, then computing resumes, so the two never fight for cores
    if overlap is None:
        overlap = cuda or cpus > torch.get_num_threads()
    if write_threads is None:
        write_threads = max(1, min(4, cpus if cuda or not overlap else cpus - torch.get_num_threads()))
    write_threads = max(0, write_threads)
    rows, n = plan.chunk_rows, plan.n
    batches = _batches(chunks, rows, batch_size, n)
    inputs = _inputs(dataset, batches, dev, workers, channels_last, jpeg)

    def new_buffers() -> _Buffers:
        layers = {
            name: torch.empty((rows, *plan.layers[name][0]), dtype=DTYPES[plan.layers[name][1]], pin_memory=cuda)
            for name in hooked if name != "logits"
        }
        if plan.logits_dim is not None:
            layers["logits"] = torch.empty((rows, plan.logits_dim), dtype=torch.float32, pin_memory=cuda)
        labels = np.empty(rows, np.int32) if plan.label_dim is None else np.empty((rows, plan.label_dim), bool)
        counts = torch.empty(rows, dtype=torch.int32, pin_memory=cuda) if plan.token_counts else None
        return _Buffers(layers, labels, torch.empty(len(hooked), pin_memory=cuda), counts)

    # buffer sets: one being filled plus one per writer thread (GPU: 4 threads, so up to 4 chunks of
    # whole batches queued or being written), fewer when chunks are huge; a
    # forward pass waits for a free set, so host memory stays bounded whatever the dataset size
    inflight = INFLIGHT_BYTES * cpus // max(cpus, os.cpu_count() or 1)  # this process's share
    budget = max(1, inflight // max(1, rows * plan.row_bytes))
    if write_threads == 0:  # inline: each chunk written as soon as it is full
        n_sets = 1
    elif overlap:
        n_sets = max(2, min(write_threads + 1, budget))
        write_threads = n_sets - 1 if n_sets - 1 < write_threads else write_threads
    else:
        n_sets = max(1, min(write_threads, budget))
    free: queue.Queue[_Buffers] = queue.Queue()
    for _ in range(n_sets):
        free.put(new_buffers())
    names = list(hooked)
    f16_limit = FLOAT16_OVERFLOW if store_dtype == torch.float16 else math.inf
    flat = ConstantLayers([k for k in chosen if k != "logits"])

    def write(buf: _Buffers) -> None:
        try:
            if buf.event is not None:
                buf.event.synchronize()
            c = buf.chunk
            lo, hi = c * rows, min(n, (c + 1) * rows)
            for name, m in zip(names, buf.amax.tolist()):
                limit = math.inf if name == "logits" else f16_limit
                if not math.isfinite(m):
                    raise ExtractError(
                        f"extract: layer {name!r} has non-finite values (NaN/inf) in examples {lo}..{hi - 1}"
                        + ("; AMP float16 may overflow inside the network, try --amp off" if amp_dtype == torch.float16 else "")
                    )
                if m >= limit:
                    raise ExtractError(
                        f"extract: layer {name!r} overflows float16 (max |value| {m:.6g} > 65504) in examples "
                        f"{lo}..{hi - 1}; refusing to store inf. Rerun with --dtype float32"
                    )
            flat.see({k: buf.layers[k][: hi - lo].numpy() for k in flat.undecided()})
            writer.write_chunk(
                c, layers={k: buf.layers[k][: hi - lo].numpy() for k in chosen},
                labels=buf.labels[: hi - lo], example_ids=ids[lo:hi],
                logits=buf.layers["logits"][: hi - lo].numpy() if plan.logits_dim is not None else None,
                token_counts=buf.counts[: hi - lo].numpy() if buf.counts is not None else None,
            )
        finally:
            free.put(buf)

    futures: list[Future] = []
    held: list[_Buffers] = []  # burst mode: full buffer sets waiting for the next burst

    def check_done() -> None:
        while futures and futures[0].done():
            futures.pop(0).result()

    from tqdm.auto import tqdm

    show = (sys.stderr.isatty() if progress is None else progress) and rank == 0
    bar = tqdm(total=len(chunks), unit="chunk", desc="extract", disable=not show)
    pool = ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="extract-write") if write_threads else None
    try:
        with Capture(net, hooked, spatial, store_dtype, tokens, layout) as cap, torch.inference_mode(), \
                _autocast(dev, amp_dtype):
            buf: _Buffers | None = None

            def flush() -> None:
                amax = cap.take_amax()
                stacked = torch.stack([amax[k] for k in names])
                if cap.copy_stream is None:  # CPU: everything already ran
                    buf.amax.copy_(stacked)
                else:  # the chunk's last copy: its event marks all of the chunk's copies done
                    cap.copy_stream.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(cap.copy_stream):
                        buf.amax.copy_(stacked, non_blocking=True)
                        buf.event = torch.cuda.Event()
                        buf.event.record(cap.copy_stream)
                    stacked.record_stream(cap.copy_stream)
                if pool is None:
                    write(buf)
                elif overlap:
                    futures.append(pool.submit(write, buf))
                else:
                    held.append(buf)
                    if len(held) == n_sets:
                        drain()
                bar.update(1)

            def drain() -> None:
                futures.extend(pool.submit(write, b) for b in held)
                held.clear()
                while futures:
                    futures.pop(0).result()

            for (c, lo, hi), (xb, y) in zip(batches, inputs):
                if buf is None or buf.chunk != c:
                    if buf is not None:
                        flush()
                    check_done()
                    buf = free.get()
                    buf.chunk, buf.event = c, None
                off = lo - c * rows
                if len(y) != hi - lo:
                    raise ExtractError(f"extract: loader returned {len(y)} rows for batch {lo}..{hi - 1}")
                buf.labels[off: off + hi - lo] = np.asarray(y, dtype=buf.labels.dtype)
                cap.target = (buf.layers, off, off + hi - lo)
                cap.begin_batch(xb)
                cap.mask = attention_mask(xb)
                forward(net, xb)
                cap.end_batch()
                if buf.counts is not None:  # real tokens per example (the mask's ones), copied like a layer
                    if cap.mask is None:
                        raise ExtractError(f"extract: batch {lo}..{hi - 1} has no attention_mask; the store records "
                                           "real tokens per example (token_counts) for token layers of padded text")
                    cap.copy_out(buf.counts[off: off + hi - lo], (cap.mask != 0).sum(dim=1, dtype=torch.int32))
            flush()
            if held:
                drain()
        for f in futures:
            f.result()
        if len(chunks) == -(-n // rows):  # this run wrote every chunk (not a resume, not one rank of several)
            _warn_constant(flat.constant(), store_dtype == torch.float16)
    finally:
        inputs.close()  # stops an in-memory feed's gather thread
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
