"""`repsim extract`: run checkpoints over a dataset once and write their activation stores.

One store::

    repsim extract --checkpoint CKPT --data NAME_OR_PATH --split SPLIT --out STORE.zarr [options]

``--data`` defaults to the run's own dataset; any spec is built through the run's config
(``repsim.train.data.dataset_from_config``), so e.g. a digits-source network sees digits-target the same way:
the run's own dataset with the run's evaluation transform, another (a transfer task) with App. A.2's
Resize(image_size) + CenterCrop(image_size) and, for a torchvision-name dataset, its whole training set.

Several checkpoints (repeat ``--checkpoint``, or give a quoted glob) into one directory, one store
each, named by ``--name`` (default ``{stem}``: the checkpoint file name without its suffix;
``{parent}`` is its directory's name)::

    repsim extract --checkpoint 'runs/*/last.pt' --name '{parent}' --data digits --split test --out-dir stores/

On the CPU the checkpoints are extracted side by side, one forked process per core (``--jobs``),
each store exactly as a lone run writes it; on one GPU up to four at once share the device (small
networks leave it idle between their kernels, and every checkpoint has fixed host costs) as threads
of one process, each on a CUDA stream of its own (one import, one CUDA start, one cuDNN cache;
``--job-mode processes`` spawns a process per job instead); under torchrun one at a time, each
store's chunks shared by the ranks. A job that fails leaves the others running; every failed store
is named (each is written atomically chunk by chunk: a rerun resumes it).

Sharded over processes (GPUs): ``torchrun --nproc_per_node=N -m repsim.extract --checkpoint ...``.
A rerun of the same command resumes an interrupted store; a complete store is left as it is.

Any PyTorch model (repsim/extract/models): ``--checkpoint torchvision:vit_b_16[:DEFAULT]``, ``timm:<name>``,
``hf:<model id or dir>``, ``module:<package.module>:<factory>[:<state dict>]``;
``--list-layers`` prints the layers a model offers, with shapes, and exits.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from repsim.commands.args import add_device_option, add_progress_option, non_negative, positive
from repsim.train.placement import device_arg

from .specs import is_model_spec

HELP = "extract per-block activations into a Zarr store"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", action="append", required=True, metavar="CKPT",
                        help="train checkpoint (repeatable; globs expanded) or a model source: "
                        "torchvision:<name>[:weights], timm:<name>[:pretrained], hf:<model id or dir>, "
                        "module:<package.module>:<factory>[:<state dict>]")
    parser.add_argument("--data", default=None, metavar="NAME_OR_PATH",
                        help="dataset spec (digits, an ImageFolder path, a torchvision dataset name, ...), "
                        "built with the run's evaluation transform; default: the run's own dataset")
    parser.add_argument("--split", default="test", help="dataset split (train, holdout, test; default test)")
    parser.add_argument("--data-root", default=None, help="where dataset files live (for named datasets)")
    dest = parser.add_mutually_exclusive_group()
    dest.add_argument("--out", metavar="STORE", help="store path (one checkpoint)")
    dest.add_argument("--out-dir", metavar="DIR", help="directory of stores, one per checkpoint")
    parser.add_argument("--name", default="{stem}",
                        help="store name template with --out-dir: {stem}, {parent} (default {stem})")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer names, module qualnames or globs (default: the registry's, "
                        "e.g. block1..block16,pool,logits; see --list-layers)")
    parser.add_argument("--list-layers", action="store_true",
                        help="print the layers and modules the model offers, with shapes, and exit")
    parser.add_argument("--spatial", default="flatten",
                        help="conv maps: flatten (keep C,H,W; default), mean (global average) or pool<k> "
                             "(k x k average)")
    parser.add_argument("--tokens", default=None, choices=("cls", "mean", "last", "flatten"),
                        help="token outputs (N, T, D): first token, mean over (real) tokens, last (real) token, "
                        "or keep all (default: mean for text, flatten for images)")
    parser.add_argument("--image-size", type=positive, default=None, metavar="PX",
                        help="resize images to PX x PX for the model (default: only when the model needs it)")
    parser.add_argument("--max-length", type=positive, default=None, metavar="TOKENS",
                        help="text datasets: tokens per example, truncated/padded (default 128)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                        help="layer dtype (logits are always float32); default float16")
    parser.add_argument("--compression", default="zstd", choices=("zstd", "none"),
                        help="layer chunk compression: zstd (level 1, default) or none (no CPU spent on "
                             "compression, 1.5-2x the disk space; every chunk keeps its crc32c)")
    parser.add_argument("--batch-size", type=positive, default=128, help="examples per forward pass (default 128)")
    parser.add_argument("--order", default="shuffled", choices=("shuffled", "dataset"),
                        help="row order: a fixed seeded permutation of the dataset (default; example_ids "
                        "keep dataset indices, and consecutive chunks are unbiased samples for "
                        "minibatch CKA) or dataset order")
    parser.add_argument("--order-seed", type=non_negative, default=0, help="seed of the row permutation (default 0)")
    parser.add_argument("--seed", type=non_negative, default=0,
                        help="seed of the random weights of a model source named without weights (torchvision:<name>, "
                             "timm:<name>, module:..., hf:<config dir>): one seed, one network; recorded as the "
                             "store's model.seed (default 0)")
    parser.add_argument("--chunk-rows", type=positive, default=None,
                        help="examples per store chunk (default: automatic, sized by bytes)")
    parser.add_argument("--workers", type=non_negative, default=None,
                        help="DataLoader worker processes (default min(4, cpus-1))")
    parser.add_argument("--write-threads", type=non_negative, default=None, help="compression/writing threads (0: write each chunk inline; default: up to 4, overlapping "
                        "the forward passes on GPU or spare CPU cores, else in bursts between them)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="checkpoints extracted at once (--job-mode), each with its share of the cores (default: on "
                        "the CPU, as many as there are cores and checkpoints; on one GPU up to 4, sharing it, at "
                        "most one per two cores; 1 under torchrun)")
    parser.add_argument("--job-mode", default="auto", choices=JOB_MODES,
                        help="how --jobs > 1 checkpoints run at once: threads of this process (one import and one "
                        "CUDA start for all; default on a GPU) or processes (forked on the CPU, spawned on a GPU; "
                        "default on the CPU, each with its share of the cores)")
    add_device_option(parser, package="PyTorch", type=device_arg, metavar="DEVICE",
                      cuda="cuda or cuda:N: that GPU, refused when there is none")
    parser.add_argument("--amp", default="auto", choices=("auto", "off", "float16", "bfloat16"),
                        help="autocast dtype for the forward pass (auto: float16 on CUDA, off on CPU)")
    parser.add_argument("--memory-format", default="auto", choices=("auto", "channels_last", "contiguous"),
                        help="memory layout of the weights and image batches (auto: channels_last for conv nets, "
                             "the layout of the fast CPU/GPU convolution kernels; a store resumes only with its own)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing stores instead of resuming")
    parser.add_argument("--no-space-check", action="store_true",
                        help="do not refuse when the uncompressed size estimate exceeds the free disk space")
    add_progress_option(parser)


def expand_checkpoints(patterns: list[str], what: str = "extract: --checkpoint") -> list[str]:
    """Checkpoint paths in the order given; glob patterns expand sorted; a pattern matching nothing is
    an error naming ``what`` (the command and option the patterns came from)."""
    from repsim.paths import expand_paths

    out: list[str] = []
    for pattern in patterns:  # a model source is never a path (the rule: repsim.paths)
        out.extend([pattern] if is_model_spec(pattern) else expand_paths([pattern], "file", what))
    return out


def store_paths(checkpoints: list[str], out_dir: str, template: str) -> list[Path]:
    """``out_dir/<template>.zarr`` per checkpoint; refuses two checkpoints mapping to one store."""
    paths: list[Path] = []
    seen: dict[Path, str] = {}
    for ckpt in checkpoints:
        p = Path(re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt)) if is_model_spec(ckpt) else Path(ckpt)
        try:
            name = template.format(stem=p.stem, parent=p.resolve().parent.name)
        except (KeyError, IndexError) as exc:
            raise ValueError(f"extract: --name {template!r}: unknown field {exc}; use {{stem}} and {{parent}}") from None
        path = Path(out_dir) / (name if name.endswith(".zarr") else name + ".zarr")
        if path in seen:
            raise ValueError(
                f"extract: checkpoints {seen[path]!r} and {ckpt!r} both map to store {path}; "
                "choose a --name template that tells them apart, e.g. '{parent}-{stem}'"
            )
        seen[path] = ckpt
        paths.append(path)
    return paths


def run(args) -> int:
    """Extract every checkpoint; failures raise (``repsim.commands.main`` reports them, exit 2 or 3)."""
    from .pipeline import extract_store, init_distributed_from_env

    import torch

    if args.list_layers:
        return _list_layers(args)
    checkpoints = expand_checkpoints(args.checkpoint)
    if args.out is None and args.out_dir is None:
        raise ValueError("extract: one of --out or --out-dir is required (or --list-layers)")
    if args.out is not None:
        if len(checkpoints) != 1:
            raise ValueError(f"extract: {len(checkpoints)} checkpoints need --out-dir, not --out")
        outs = [Path(args.out)]
    else:
        outs = store_paths(checkpoints, args.out_dir, args.name)
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    started = init_distributed_from_env(args.device)
    options = dict(
        split=args.split, data_root=args.data_root, layers=args.layers, spatial=args.spatial,
        dtype=args.dtype, batch_size=args.batch_size, workers=args.workers, device=args.device,
        amp=args.amp, chunk_rows=args.chunk_rows, write_threads=args.write_threads,
        overwrite=args.overwrite, check_space=not args.no_space_check, progress=args.progress,
        order=args.order, order_seed=args.order_seed, compression=args.compression,
        tokens=args.tokens, image_size=args.image_size, max_length=args.max_length,
        memory_format=args.memory_format, seed=args.seed,
    )
    try:
        jobs = _jobs(getattr(args, "jobs", None), len(checkpoints), args.device, started)
        mode = job_mode(getattr(args, "job_mode", "auto"), args.device)
        if jobs > 1 and mode == "threads":
            _extract_in_threads(checkpoints, outs, args.data, options, jobs)
        elif jobs > 1:
            _extract_side_by_side(checkpoints, outs, args.data, options, jobs)
        else:
            for ckpt, out in zip(checkpoints, outs):
                extract_store(ckpt, args.data, out, **options)
    finally:
        if started:
            torch.distributed.destroy_process_group()
    return 0


def _list_layers(args) -> int:
    """``--list-layers``: print what each model offers (repsim/extract/listing.py); failures raise."""
    from .listing import list_layers

    for ckpt in expand_checkpoints(args.checkpoint):
        print(list_layers(ckpt, args.data, split=args.split, data_root=args.data_root, spatial=args.spatial,
                          tokens=args.tokens, layers=args.layers, image_size=args.image_size,
                          max_length=args.max_length))
    return 0


def _jobs(requested: int | None, n_checkpoints: int, device: str | None, distributed: bool) -> int:
    """Checkpoints extracted at once: ``--jobs``, else one per core (at most one per checkpoint) on
    the CPU; on one GPU up to ``GPU_JOBS`` processes (at most one per two cores), which share the
    device: a small network leaves it idle between its small kernels and each checkpoint has
    fixed host costs (start, loading, store creation and finalisation, compression); 1 under
    torch.distributed (ranks share each store's chunks instead)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"extract: --jobs must be >= 1, got {requested}")
        return min(requested, max(1, n_checkpoints))
    if distributed or n_checkpoints < 2:
        return 1
    if _on_gpu(device):
        return max(1, min(n_checkpoints, GPU_JOBS, (os.cpu_count() or 1) // 2))
    return min(n_checkpoints, os.cpu_count() or 1)


GPU_JOBS = 4  # checkpoints extracted at once on one GPU (bench/heatmap18.py --device cuda)
JOB_MODES = ("auto", "threads", "processes")


def job_mode(requested: str | None, device: str | None) -> str:
    """``threads`` or ``processes``: how several checkpoints run at once. ``auto``: threads of this
    process on a GPU (one import of torch, one CUDA context and one cuDNN autotuning cache for every
    job, each on a CUDA stream of its own, where spawned processes each pay their own ~4-5 s: bench/RESULTS.md
    "gpu"), processes on the CPU (forked, each with ``torch.set_num_threads`` of its share of the
    cores: torch's intra-op thread count is one per process, which threads could not divide)."""
    requested = "auto" if requested is None else str(requested)
    if requested not in JOB_MODES:
        raise ValueError(f"extract: --job-mode must be one of {', '.join(JOB_MODES)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "threads" if _on_gpu(device) else "processes"


def _cuda_device(device: str | None):
    """The CUDA device that ``device`` ("auto", "cpu", "cuda", "cuda:N") resolves to, or None."""
    import torch

    name = str(device or "auto")
    if name.startswith("cuda"):
        return torch.device(name)
    return torch.device("cuda") if name == "auto" and torch.cuda.is_available() else None


def _on_gpu(device: str | None) -> bool:
    return _cuda_device(device) is not None


def _job_init(cpus: int) -> None:
    """A forked job: its share of the cores for torch's intra-op threads, the DataLoader default
    and the chunk-buffer budget (repsim.extract.pipeline.cpu_share)."""
    import torch

    from . import pipeline

    pipeline._CPUS = cpus
    torch.set_num_threads(cpus)


def _extract_one(ckpt: str, data, out: Path, options: dict) -> str:
    from .pipeline import extract_store

    extract_store(ckpt, data, out, **options)
    return str(out)


def _wait_all(futures: list, outs: list[Path]) -> list[tuple[Path, BaseException]]:
    """Wait for every job (none is cancelled: a failing store never stops the others, and each one
    is written atomically chunk by chunk, so a failed one is left resumable); the failures, in
    checkpoint order, as (store, exception)."""
    failed = []
    for f, out in zip(futures, outs):
        try:
            f.result()
        except Exception as exc:  # noqa: BLE001 - each is reported by raise_failures
            failed.append((out, exc))
    return failed


def raise_failures(failed: list[tuple[Path, BaseException]], total: int) -> None:
    """Report the failed stores of a run of ``total`` jobs. One failure is raised as the lone run
    would raise it; several are named one line each on stderr, then one error says how many of the
    stores failed (a failure that is a bug, not a refusal, is re-raised with its traceback)."""
    import sys

    from repsim.commands.main import classify

    if not failed:
        return
    if len(failed) == 1:
        raise failed[0][1]
    for out, exc in failed:
        print(f"extract: {out} failed: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr,
              flush=True)
    bug = next((exc for _, exc in failed if classify(exc) is None), None)
    if bug is not None:
        raise bug
    from .errors import ExtractError

    raise ExtractError(
        f"extract: {len(failed)} of {total} stores failed ({', '.join(str(o) for o, _ in failed)}; each one's "
        f"reason above); the other {total - len(failed)} are complete. Rerun the same command to resume the "
        "failed ones") from failed[0][1]


def _extract_in_threads(checkpoints: list[str], outs: list[Path], data, options: dict, jobs: int) -> None:
    """Extract several checkpoints at once as threads of this process, each on a CUDA stream of its
    own (on a GPU): one import of torch, one CUDA context and one cuDNN autotuning cache for all of
    them, where spawned processes would each pay their own (~4-5 s at the start of the 18-network
    heatmap on an H100, bench/RESULTS.md "gpu").  A DataLoader (datasets not held in memory) spawns
    its workers instead of forking this multi-threaded process.  Each store is written exactly as a
    lone run writes it (byte-identical: tests/test_extract_jobs.py); a failing job leaves the others
    running, and the failures are reported per store once all have finished (:func:`raise_failures`)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from . import pipeline
    from .pipeline import extract_store

    dev = _cuda_device(options.get("device"))

    def one(ckpt: str, out: Path) -> None:
        if dev is None:
            extract_store(ckpt, data, out, **options)
            return
        # set_device needs an index ("cuda" alone raises): the current device's, as torch.cuda.device takes it
        torch.cuda.set_device(dev.index if dev.index is not None else torch.cuda.current_device())
        with torch.cuda.stream(torch.cuda.Stream(dev)):  # the jobs' kernels overlap on the device
            extract_store(ckpt, data, out, **options)
        torch.cuda.synchronize(dev)

    before = pipeline._CPUS
    pipeline._CPUS = max(1, (os.cpu_count() or 1) // jobs)
    pipeline.LOADER_SPAWN.set()
    try:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="extract-job") as pool:
            failed = _wait_all([pool.submit(one, c, o) for c, o in zip(checkpoints, outs)], outs)
    finally:
        pipeline._CPUS = before
        pipeline.LOADER_SPAWN.clear()
    raise_failures(failed, len(outs))


def _extract_side_by_side(checkpoints: list[str], outs: list[Path], data, options: dict, jobs: int) -> None:
    """Extract several checkpoints at once, each store by one forked process (small networks leave
    most of a core idle between their small ops, and each checkpoint has its own fixed costs:
    loading, store creation, the probe pass).  Each store is written exactly as a lone
    ``extract_store`` would write it (resume and checksums unchanged); a failing job leaves the
    others running, and the failures are reported per store once all have finished."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor

    # fork shares the imported torch with the jobs (no re-import); it is safe while this process
    # runs no other thread (no OpenMP pool or zarr I/O loop started yet), else spawn; CUDA does not
    # survive a fork, so jobs on a GPU are spawned
    method = ("fork" if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
              and not _on_gpu(options.get("device")) else "spawn")
    cpus = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method),
                             initializer=_job_init, initargs=(cpus,)) as pool:
        failed = _wait_all([pool.submit(_extract_one, ckpt, data, out, options)
                            for ckpt, out in zip(checkpoints, outs)], outs)
    raise_failures(failed, len(outs))
