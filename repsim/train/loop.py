"""The training loop (App. A.1 recipe), single process or DDP under ``torchrun``.

``train_run(config, out)`` trains ``config`` (see :mod:`repsim.train.config`) and writes to ``out``:
``checkpoint.pt`` (every epoch, atomic), ``best.pt`` (best holdout top-1, when ``save_best``),
``epoch-EEEE.pt`` (every ``keep_every`` epochs, for training dynamics, Figs. D.2, E.4),
``metrics.jsonl`` / ``metrics.csv`` (one row per epoch) and ``config.json`` (the resolved config).
Each epoch writes the metrics, best.pt and epoch-EEEE.pt before checkpoint.pt, the file ``--resume``
continues from, so a run killed anywhere resumes into the uninterrupted run's files.

The loop, as torchvision's reference (references/classification/train.py): ``_run`` sets up the data
(``_datasets``), the network, optimizer and loader (:class:`TrainParts`) and resumes (``_resume``); then
each epoch is :func:`train_one_epoch`, :func:`evaluate_splits` (:func:`evaluate` on holdout and test)
and ``_save_epoch`` (rank 0's files).

Random streams: training augmentations are seeded per example from (seed, epoch, index)
(:func:`sample_seed`), whatever the process, worker or worker count; Mixup and dropout draw from each
process's generator (seeded from (seed, rank), checkpointed). ``--resume`` is therefore exact (with
``deterministic``) for any ``data.workers``.

Options beyond the App. A.1 recipe: AutoAugment (``data.autoaugment``) and Mixup (``mixup.alpha``),
App. C.4 (:mod:`repsim.train.augment`); ``data.train_split = "train+holdout"`` retrains on the training and
holdout splits together once hyperparameters are chosen (A.1, A.3; the holdout is then not evaluated).

Distributed: launched by ``torchrun`` (``WORLD_SIZE`` > 1) the process group is initialised from
``env://`` with NCCL on CUDA and gloo on CPU (one GPU per process; with fewer GPUs than processes on
a node the run falls back to the CPU, saying so: :mod:`repsim.train.placement`); ``batch_size`` is the global
batch, split evenly over processes; the DistributedSampler permutation depends on (seed, epoch) only,
so the union of the per-rank batches at a step is the single-process batch (augmentations included).
BatchNorm statistics are per process (as on the paper's TPU cores) unless ``sync_bn`` (CUDA only) or
``freeze_bn``; rank 0's EMA buffers are broadcast before evaluating, so every rank evaluates the saved
network. A checkpoint resumes only with the number of processes that wrote it (unless ``freeze_bn``).
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from repsim.fileio import atomic_write
from repsim.study.runs import best_epoch, holdout_curve

from .augment import mixup_batch, variant_of
from .checkpoint import (CheckpointError, load_checkpoint, load_state_strict, rng_state, save_checkpoint,
                         set_rng_state)
from .config import validate
from .data import TRAIN_ALL, dataset_from_config
from .models import Network, build_network
from .placement import plan_process

_NORM = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
# config keys that may change on --resume: they do not change what the finished epochs computed
# (more epochs or steps, evaluation and I/O settings); any other difference is refused
RESUMABLE_KEYS = ("epochs", "max_steps", "threads", "eval_every", "eval_batch_size", "save_best", "compile",
                  "data.root", "data.workers", "data.download", "data.eval_holdout", "data.eval_test",
                  "keep_every", "stop_epoch", "tune_grid")
_RUN_FILLED = ("finetune.source",)  # written by the run itself (copied from the checkpoint on resume)


class TrainError(ValueError):
    """Bad run configuration or output directory."""


# -- schedule and EMA -----------------------------------------------------------------------------------
def lr_at(step: int, *, peak: float, steps_per_epoch: int, total_steps: int, name: str,
          warmup_epochs: float, decay: float) -> float:
    """Learning rate before optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_epochs`` to ``peak`` (step t gets peak·(t+1)/W), then
    ``exponential``: peak·decay^((t−W)/steps_per_epoch) (×0.975 per epoch, App. A.1, applied
    continuously) or ``cosine``: peak·½(1 + cos(π (t−W)/(T−W))) (A.3 and CIFAR, no restarts).
    """
    warm = int(round(warmup_epochs * steps_per_epoch))
    if step < warm:
        return peak * (step + 1) / warm
    if name == "exponential":
        return peak * decay ** ((step - warm) / steps_per_epoch)
    if name == "cosine":
        span = max(1, total_steps - warm)
        return peak * 0.5 * (1.0 + math.cos(math.pi * min(step - warm, span) / span))
    raise TrainError(f"unknown schedule {name!r} (exponential or cosine)")


class EMA:
    """Exponential moving average of parameters and floating buffers (BN statistics):
    θ̄ ← d θ̄ + (1 − d) θ with d = min(decay, (1 + t)/(10 + t)) when ``warmup`` (TensorFlow's
    ExponentialMovingAverage with num_updates, as in Szegedy et al.), else d = decay."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.warmup = float(decay), bool(warmup)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        d = min(self.decay, (1.0 + step) / (10.0 + step)) if self.warmup else self.decay
        src = list(model.parameters()) + list(model.buffers())
        dst = list(self.module.parameters()) + list(self.module.buffers())
        fl = [(e, s) for e, s in zip(dst, src) if e.dtype.is_floating_point]
        if fl:
            torch._foreach_lerp_([e for e, _ in fl], [s.detach() for _, s in fl], 1.0 - d)
        for e, s in zip(dst, src):
            if not e.dtype.is_floating_point:
                e.copy_(s)


class _ShardSampler(Sampler[int]):
    """Rank r of w evaluates indices r, r+w, r+2w, … (no padding, so every example counts once)."""

    def __init__(self, n: int, rank: int, world: int):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self) -> int:
        return len(self.idx)


_M64 = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of example ``index``'s training augmentation in ``epoch`` (0-based): a splitmix64 hash of
    (run seed, epoch, index), so it depends on nothing else (not the process, worker, worker count or
    what ran before), and a resumed run, a run with other ``data.workers`` and a DDP run draw the
    augmentations of the uninterrupted single-process run."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xD1B54A32D192ED03 + int(index) * 0xABC98388FB8FAC03) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) >> 1  # < 2**63


class _EpochIndices(Sampler):
    """The indices of a DistributedSampler as (epoch, index) pairs, for :class:`_SeededExamples`."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler = sampler

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _SeededExamples(torch.utils.data.Dataset):
    """``dataset[index]`` with torch's CPU generator seeded by :func:`sample_seed` while the example's
    transform runs (the augmentations here draw from it), and restored afterwards (with
    ``data.workers = 0`` the transform runs in the training process, whose generator also drives
    Mixup and dropout). Before, the augmentations drew from each worker's generator, seeded once per
    worker from the training process's; persistent workers carried that state across epochs, and it
    was never checkpointed: ``--resume`` with workers was not the uninterrupted run."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        gen = torch.default_generator  # CPU only: torch.manual_seed would also reseed CUDA's generators
        state = gen.get_state()
        gen.manual_seed(sample_seed(self.seed, epoch, index))
        try:
            return self.dataset[index]
        finally:
            gen.set_state(state)


class _TrainStep(nn.Module):
    """What DDP wraps: features → objective head → (batch-mean loss, logits)."""

    def __init__(self, net: Network):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor, y_b: torch.Tensor | None = None, lam: float = 1.0):
        mix = None if y_b is None else (y_b, lam)
        return self.net.head.loss_and_logits(self.net.backbone(x), y, mix)


# -- helpers -------------------------------------------------------------------------------------------
def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (0, 1, 0 without it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def param_groups(net: nn.Module, weight_decay: float, wd_norm: bool) -> list[dict[str, Any]]:
    """Weight decay on every parameter except those of normalisation layers (App. A.1), unless
    ``wd_norm`` (ICLR A.1: the CIFAR-100 WRN decays BN parameters too)."""
    norm_ids = {id(p) for m in net.modules() if isinstance(m, _NORM) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for p in net.parameters():
        if p.requires_grad:
            (no_decay if id(p) in norm_ids and not wd_norm else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _topk_correct(logits: torch.Tensor, y: torch.Tensor, ks: tuple[int, ...]) -> list[torch.Tensor]:
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hit = top == y[:, None]
    return [hit[:, :min(k, kmax)].any(1).sum() for k in ks]


@torch.no_grad()
def evaluate(net: nn.Module, dataset, *, batch_size: int, device: torch.device, rank: int, world: int,
             autocast: Callable[[], Any], channels_last: bool, workers: int = 0) -> dict[str, float]:
    """Top-1 / top-5 and mean per-class top-1 accuracy (%) of ``net`` on ``dataset``, sharded over
    processes. Mean per-class: the average over classes present of each class's top-1 accuracy (the
    measure App. A.2 uses for Pets and Flowers)."""
    was = net.training
    net.eval()
    # a generator of its own: a DataLoader iterator otherwise draws its workers' base seed from the
    # training process's generator, so whether an epoch evaluated would shift Mixup/dropout after it
    loader = DataLoader(dataset, batch_size=batch_size, sampler=_ShardSampler(len(dataset), rank, world),
                        num_workers=workers, pin_memory=device.type == "cuda", generator=torch.Generator())
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    K = int(getattr(getattr(net, "head", None), "num_classes", 0) or getattr(dataset, "num_classes", 0))
    per_class = torch.zeros(2, max(K, 1), dtype=torch.float64, device=device)  # correct, count
    n_local = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast():
            logits = net(x)
        c1, c5 = _topk_correct(logits.float(), y, (1, 5))
        stats[0] += c1
        stats[1] += c5
        n_local += len(y)
        if K:
            hit = logits.float().argmax(1) == y
            per_class[0] += torch.bincount(y[hit], minlength=K).double()
            per_class[1] += torch.bincount(y, minlength=K).double()
    stats[2] = n_local
    if world > 1:
        dist.all_reduce(stats)
        dist.all_reduce(per_class)
    net.train(was)
    n = max(stats[2].item(), 1.0)
    present = per_class[1] > 0
    mpc = (per_class[0][present] / per_class[1][present]).mean().item() if K and present.any() else float("nan")
    return {"top1": 100.0 * stats[0].item() / n, "top5": 100.0 * stats[1].item() / n, "mean_per_class": 100.0 * mpc}


def _write_metrics(out: Path, metrics: list[dict[str, Any]]) -> None:
    with atomic_write(out / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(m) + "\n" for m in metrics))
    keys: list[str] = []
    for m in metrics:
        keys += [k for k in m if k not in keys]
    with atomic_write(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(metrics)


def _flat(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict[str, Any], cfg: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, value in ``saved``, value in ``cfg``) for every dotted key that differs, except
    :data:`RESUMABLE_KEYS`; a key the saved config lacks (an older repsim) counts at its default."""
    from .config import DEFAULTS

    a, b, defaults = _flat(saved), _flat(cfg), _flat(DEFAULTS)
    missing = object()
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS + _RUN_FILLED):  # tables: every key below
            continue
        x, y = a.get(key, defaults.get(key, missing)), b.get(key, defaults.get(key, missing))
        if x != y:
            out.append((key, None if x is missing else x, None if y is missing else y))
    return out


def _check_same_run(saved: dict[str, Any], cfg: dict[str, Any], path: Path) -> None:
    """Refuse to resume a checkpoint trained with other settings, naming every differing key."""
    diff = config_differences(saved, cfg)
    if diff:
        shown = "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in diff[:6])
        more = f" (+{len(diff) - 6} more: {', '.join(k for k, _, _ in diff[6:])})" if len(diff) > 6 else ""
        raise CheckpointError(
            f"checkpoint {path} was trained with other settings: {shown}{more}; resume with the run's settings "
            f"(its config.json) or choose another --out; only {', '.join(RESUMABLE_KEYS)} may change on --resume")


def _init_from(net: Network, path: str) -> dict[str, Any]:
    """Fine-tuning (A.3): load the (EMA) backbone of another run's checkpoint; the head stays new."""
    ckpt = load_checkpoint(path)
    src = ckpt["config"]
    if src.get("arch") != net.arch or src.get("arch_params", {}) != net.config.get("arch_params", {}) \
            or int(src.get("in_channels", 3)) != int(net.config.get("in_channels", 3)):
        raise CheckpointError(f"checkpoint {path} holds a {src.get('arch')} {src.get('arch_params', {})} network; "
                              f"this run builds {net.arch} {net.config.get('arch_params', {})}")
    state = ckpt.get("ema") or ckpt["model"]
    backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    load_state_strict(net.backbone, backbone, f"checkpoint {path}")
    from repsim.fileio import sha256_file  # the identity extract records as model.checkpoint_sha256

    # what the analyses need to pair the fine-tuned network with its source (Table 2, Fig. D.3)
    return {"checkpoint": str(Path(path).resolve()), "sha256": sha256_file(path), "epoch": ckpt.get("epoch"),
            "objective": src.get("objective"), "objective_params": src.get("objective_params", {}),
            "seed": src.get("seed"), "variant": src.get("variant", ""), "preset": src.get("preset", "")}


def _keep(ckpt: Path, dest: Path) -> None:
    """Keep the checkpoint just written as ``dest`` (``--keep-every``): a hard link when the file system
    allows (checkpoint.pt is later replaced by rename, so the link keeps this epoch's file), else a copy."""
    import shutil

    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(ckpt, tmp)
    except OSError:
        shutil.copyfile(ckpt, tmp)
    os.replace(tmp, dest)


def _save_or_link(state: dict[str, Any], dest: Path, written: Path | None) -> Path:
    """Write ``state`` to ``dest`` atomically, as a hard link to ``written`` (the same state, already
    written and synced this epoch) where the file system allows; returns ``dest``."""
    if written is not None:
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(written, tmp)
        except OSError:
            pass
        else:
            os.replace(tmp, dest)
            return dest
    save_checkpoint(state, dest)
    return dest


_TEMPORARIES = (".checkpoint.pt.*tmp", ".best.pt.*tmp", ".epoch-*.pt.*tmp", "metrics.jsonl.tmp-*",
                "metrics.csv.tmp-*", "config.json.tmp-*")


def _remove_stale_temporaries(out: Path) -> None:
    """Remove the half-written files a run killed inside a save leaves (its temporaries: save_checkpoint's
    ``.NAME.XXXX.tmp``, atomic_write's ``NAME.tmp-PID``); rank 0, before this run writes any. At ResNet-50
    scale each is hundreds of MB, hidden by the leading dot."""
    if not out.is_dir():
        return
    for pattern in _TEMPORARIES:
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)


def _repair_after(ck: dict[str, Any], ckpt_path: Path, out: Path, keep_every: int, save_best: bool) -> None:
    """On --resume: the files the checkpoint's epoch should have left beside it, from the checkpoint
    (a repsim that wrote checkpoint.pt first could be killed, or run out of disk, before the rest):
    metrics.jsonl/.csv with its rows, best.pt when its epoch is the best one, epoch-EEEE.pt."""
    epoch, metrics = int(ck["epoch"]), list(ck["metrics"])
    _write_metrics(out, metrics)
    if save_best and metrics and best_epoch(holdout_curve(metrics)) == epoch:
        best = out / "best.pt"
        try:
            stale = load_checkpoint(best, mmap=True).get("epoch") != epoch if best.exists() else True
        except CheckpointError:
            stale = True
        if stale:
            _keep(ckpt_path, best)
    if keep_every and epoch % keep_every == 0 and not (out / f"epoch-{epoch:04d}.pt").exists():
        _keep(ckpt_path, out / f"epoch-{epoch:04d}.pt")


def _check_same_schedule(ck: dict[str, Any], sched: dict[str, Any], cfg: dict[str, Any], path: Path) -> None:
    """Refuse to resume a cosine schedule over another number of steps (``epochs``/``max_steps`` may change
    on --resume only where the schedule does not depend on them: under cosine the steps to come would
    follow another curve, a warm restart nobody asked for)."""
    was = ck.get("scheduler", {})
    if sched["name"] != "cosine" or "total_steps" not in was or int(was["total_steps"]) == sched["total_steps"]:
        return
    raise CheckpointError(
        f"checkpoint {path} anneals a cosine schedule over {int(was['total_steps'])} steps, this run over "
        f"{sched['total_steps']} (epochs={cfg['epochs']}, max_steps={cfg['max_steps']}): the remaining steps would "
        "follow another schedule; resume with the run's epochs and max_steps (its config.json; stop_epoch stops "
        "earlier with the schedule unchanged) or train the longer run into another --out")


def _broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics) on every rank. Each rank's EMA averages its own rank's
    BN statistics, which DDP does not synchronise, so ranks > 0 evaluated their shard with a network that
    was never saved (and that a resumed run, which loads rank 0's EMA everywhere, would not have)."""
    for b in module.buffers():
        dist.broadcast(b.data, 0)


# -- the run -------------------------------------------------------------------------------------------
def train_run(config: dict[str, Any], out: str | os.PathLike, *, resume: bool = False, progress: bool = True,
              stop_after_epoch: int | None = None, log: Callable[[str], None] | None = None,
              device: str = "auto") -> list[dict[str, Any]]:
    """Train ``config`` into ``out``; returns the per-epoch metrics. See the module docstring. ``device``
    (``auto``, ``cuda``, ``cpu``): where this process trains, by :func:`repsim.train.placement.plan_process`
    (``auto``: its own GPU when every process on the node has one, else the CPU with one line saying so)."""
    cfg = validate(copy.deepcopy(config))
    out = Path(out)
    rank, world, local_rank = dist_info()
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    where, note = plan_process(local_rank, local_world, n_gpus, device)  # PlacementError: one line
    say = (log or (lambda s: print(s, file=sys.stderr, flush=True))) if rank == 0 else (lambda s: None)
    if note:
        say(f"[train] {note}")
    own_pg = False
    if world > 1 and not dist.is_initialized():
        if where.startswith("cuda"):
            torch.cuda.set_device(torch.device(where))
        dist.init_process_group(backend="nccl" if where.startswith("cuda") else "gloo", init_method="env://")
        own_pg = True
    if cfg.get("stop_epoch") and stop_after_epoch is None:
        stop_after_epoch = int(cfg["stop_epoch"])
    try:
        return _run(cfg, out, rank, world, torch.device(where), resume, progress, stop_after_epoch, say)
    finally:
        if own_pg:
            dist.destroy_process_group()


def _run(cfg, out: Path, rank: int, world: int, device: torch.device, resume: bool, progress: bool,
         stop_after_epoch: int | None, say: Callable[[str], None]) -> list[dict[str, Any]]:
    if cfg["threads"]:
        torch.set_num_threads(int(cfg["threads"]))
    if cfg["deterministic"]:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists() and not resume:
        raise TrainError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    if cfg["batch_size"] % world:
        raise TrainError(f"batch_size {cfg['batch_size']} is not divisible by the {world} processes")
    per_rank = cfg["batch_size"] // world
    train_set, eval_sets = _datasets(cfg, say)
    d = cfg["data"]
    alpha = float(cfg.get("mixup", {}).get("alpha", 0.0))  # >= 0 (config.BOUNDS)
    keep_every = int(cfg.get("keep_every", 0) or 0)

    # model, optimizer -------------------------------------------------------------------------------
    torch.manual_seed(cfg["seed"])
    net = build_network(cfg).to(device)
    ft = cfg["finetune"]
    if ft["init_from"] and not (resume and ckpt_path.exists()):
        cfg["finetune"]["source"] = _init_from(net, ft["init_from"])
    if ft["freeze_backbone"]:
        net.backbone.requires_grad_(False)
    on_cuda = device.type == "cuda"
    # auto: NHWC for conv nets, the layout of cuDNN's and oneDNN's fast kernels (on the CPU a digits
    # mini-ResNet step takes ~0.7x the contiguous time at one thread; a whole digits run ~0.95x)
    has_conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
    channels_last = (on_cuda or has_conv) if cfg["channels_last"] == "auto" else bool(cfg["channels_last"])
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    if cfg.get("sync_bn") and world > 1 and on_cuda:
        net.backbone = nn.SyncBatchNorm.convert_sync_batchnorm(net.backbone)
    amp = cfg["amp"]
    amp_dtype = {"auto": torch.bfloat16 if on_cuda else None, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "off": None}.get(amp, "bad")
    if amp_dtype == "bad":
        raise TrainError(f"amp must be auto, bf16, fp16 or off, not {amp!r}")
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    o = cfg["optim"]
    peak = o["lr"] * cfg["batch_size"] / o["ref_batch"]
    wd = o["weight_decay"] / o["lr"] if o["wd_over_lr"] else o["weight_decay"]
    opt = torch.optim.SGD(param_groups(net, wd, o["wd_norm"]), lr=peak, momentum=o["momentum"],
                          nesterov=o["nesterov"] and o["momentum"] > 0)
    ema = EMA(net, cfg["ema"]["decay"], cfg["ema"]["warmup"]) if cfg["ema"]["enabled"] else None

    step_module: nn.Module = _TrainStep(net)
    if world > 1:
        step_module = nn.parallel.DistributedDataParallel(step_module, device_ids=[device.index] if on_cuda else None)
    if cfg["compile"]:
        step_module = torch.compile(step_module)

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"],
                                 drop_last=True)
    # augmentations seeded per example from (seed, epoch, index) (_SeededExamples); the loader's own
    # generator keeps its iterators' worker-seed draws off the training process's generator (with
    # persistent workers a resumed run made that draw in another epoch than the uninterrupted run)
    loader = DataLoader(_SeededExamples(train_set, cfg["seed"]), batch_size=per_rank, sampler=_EpochIndices(sampler),
                        num_workers=d["workers"], pin_memory=on_cuda, drop_last=True,
                        persistent_workers=d["workers"] > 0, generator=torch.Generator().manual_seed(cfg["seed"]))
    spe = len(loader)
    total = cfg["max_steps"] or cfg["epochs"] * spe
    if total <= 0:
        raise TrainError("nothing to train: set epochs > 0 or max_steps > 0")
    epochs = math.ceil(total / spe)
    s = cfg["schedule"]
    sched = dict(peak=peak, steps_per_epoch=spe, total_steps=total, name=s["name"],
                 warmup_epochs=s["warmup_epochs"], decay=s["decay"])
    parts = TrainParts(net=net, step_module=step_module, opt=opt, scaler=scaler, ema=ema, loader=loader,
                       sampler=sampler, sched=sched, total=total, alpha=alpha, channels_last=channels_last,
                       autocast=autocast, device=device, freeze_bn=bool(cfg.get("freeze_bn")))

    # resume ----------------------------------------------------------------------------------------
    if rank == 0:
        _remove_stale_temporaries(out)
    start_epoch, step, metrics = 0, 0, []
    if resume and ckpt_path.exists():
        start_epoch, step, metrics = _resume(parts, cfg, ckpt_path, rank=rank, world=world, keep_every=keep_every,
                                             say=say)
    else:
        if resume:
            say(f"--resume: no checkpoint in {out}; starting from scratch")
        # Mixup / dropout streams per rank (augmentations: sample_seed); with or without --resume, a
        # fresh start is the same run
        torch.manual_seed(cfg["seed"] * 1000 + rank + 1)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_write(out / "config.json", "w") as f:
            f.write(json.dumps(cfg, indent=2, default=str) + "\n")

    # epochs ----------------------------------------------------------------------------------------
    use_bar = progress and rank == 0 and sys.stderr.isatty()
    eval_bs = cfg["eval_batch_size"] or per_rank
    eval_net = ema.module if ema is not None else net
    for epoch in range(start_epoch, epochs):
        if step >= total:
            break
        step, trained = train_one_epoch(parts, epoch, step, epochs=epochs, world=world, bar=use_bar)
        rec: dict[str, Any] = {"epoch": epoch + 1, "step": step, "lr": lr_at(max(step - 1, 0), **sched),
                               "train_loss": trained["loss"], "train_top1": trained["top1"]}
        last = epoch + 1 == epochs or step >= total or epoch + 1 == stop_after_epoch
        if world > 1:  # every rank evaluates (and later resumes from) the network rank 0 saves
            _broadcast_buffers(eval_net)
        if (epoch + 1) % cfg["eval_every"] == 0 or last:
            rec.update(evaluate_splits(eval_net, eval_sets, batch_size=eval_bs, device=device, rank=rank, world=world,
                                       autocast=autocast, channels_last=channels_last, workers=d["workers"]))
        train_s = trained["seconds"]
        rec["train_seconds"] = train_s
        rec["images_per_second"] = trained["examples"] * world / train_s if train_s > 0 else 0.0
        metrics.append(rec)
        rngs = [rng_state()]
        if world > 1:
            rngs = [None] * world
            dist.all_gather_object(rngs, rng_state())
        if rank == 0:
            state = {"config": cfg, "model": net.state_dict(), "ema": ema.module.state_dict() if ema else {},
                     "optimizer": opt.state_dict(), "scheduler": {"step": step, **sched},
                     "scaler": scaler.state_dict() if scaler.is_enabled() else {}, "rng": rngs,
                     "world_size": world, "epoch": epoch + 1, "metrics": metrics}
            _save_epoch(state, out, save_best=cfg["save_best"], keep_every=keep_every)
            say(" ".join([f"epoch {epoch + 1}/{epochs}", f"loss {rec['train_loss']:.4f}",
                          f"train {rec['train_top1']:.1f}%"]
                         + [f"{k.split('_')[0]} {rec[k]:.1f}%" for k in ("holdout_top1", "test_top1") if k in rec]
                         + [f"({train_s:.1f} s, {rec['images_per_second']:.0f} img/s)"]))
        if stop_after_epoch is not None and epoch + 1 >= stop_after_epoch:
            break
    return metrics


def _datasets(cfg: dict[str, Any], say: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """The training set and the evaluated splits (``holdout``, ``test``) of ``cfg``'s data, checked
    against the network (classes, input channels, batch size); fills ``cfg``'s ``variant``,
    ``num_classes`` and ``dataset`` (what config.json and the checkpoint record)."""
    d = cfg["data"]
    if not d["spec"]:
        raise TrainError("no dataset: pass --data (a directory, 'digits', a torchvision name, 'synthetic')")
    aug = {"none": False, "digits": True}.get(d["augment"], d["augment"])
    train_split = d.get("train_split", "train")
    if train_split not in ("train", TRAIN_ALL):
        raise TrainError(f"data.train_split must be 'train' or '{TRAIN_ALL}', not {train_split!r}")
    if d.get("autoaugment") and not aug:
        raise TrainError("data.autoaugment needs a training augmentation (data.augment is 'none')")
    cfg["variant"] = variant_of(cfg)
    train_set = dataset_from_config(cfg, train_split, augment=aug)
    eval_sets = {}
    if d["eval_holdout"] and d["holdout_size"] != 0 and train_split == "train":
        eval_sets["holdout"] = dataset_from_config(cfg, "holdout")
    if d["eval_test"]:
        try:
            eval_sets["test"] = dataset_from_config(cfg, "test")
        except ValueError as e:
            say(f"no test split evaluated: {e}")
    if cfg["num_classes"] and cfg["num_classes"] != train_set.num_classes:
        raise TrainError(f"num_classes {cfg['num_classes']} but {d['spec']} has {train_set.num_classes} classes")
    cfg["num_classes"] = train_set.num_classes
    x0 = train_set[0][0]
    if isinstance(x0, torch.Tensor) and x0.ndim == 3 and x0.shape[0] != int(cfg.get("in_channels", 3)):
        raise TrainError(f"{d['spec']} has {x0.shape[0]}-channel images but the network ({cfg['arch']}) takes "
                         f"in_channels = {cfg.get('in_channels', 3)}: start from a preset for this data "
                         "(repsim train --list-presets) or --set in_channels=" + str(x0.shape[0]))
    cfg["dataset"] = {"spec": d["spec"], "name": train_set.name, "n_train": len(train_set), "train_split": train_split,
                      "classes": list(train_set.classes), "transform": train_set.transform_desc}
    if len(train_set) < cfg["batch_size"]:
        raise TrainError(f"training set of {len(train_set)} examples is smaller than batch_size {cfg['batch_size']}")
    return train_set, eval_sets


@dataclass
class TrainParts:
    """What :func:`train_one_epoch` trains with, built once per run by :func:`train_run`."""

    net: nn.Module  # the network: its parameters, its BatchNorm modules, the EMA's source
    step_module: nn.Module  # the loss step, _TrainStep(net) (DDP-wrapped, compiled)
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: EMA | None
    loader: DataLoader  # the training batches of this process
    sampler: DistributedSampler  # the (seed, epoch) permutation behind the loader
    sched: dict[str, Any]  # lr_at's schedule
    total: int  # the run's last step
    alpha: float  # Mixup α (0: no Mixup)
    channels_last: bool
    autocast: Callable[[], Any]
    device: torch.device
    freeze_bn: bool


def train_one_epoch(parts: TrainParts, epoch: int, step: int, *, epochs: int, world: int = 1,
                    bar: bool = False) -> tuple[int, dict[str, float]]:
    """One epoch of SGD from global step ``step`` (stopping at ``parts.total``), as torchvision's reference
    ``train_one_epoch``: each batch sets the learning rate :func:`lr_at` its step, is mixed (Mixup, one λ
    per batch) when ``parts.alpha`` > 0, and takes one optimizer step (through the gradient scaler), then
    the EMA's update. Returns the step reached and the epoch's ``loss`` (mean over its examples), ``top1``
    (%; both summed over the ``world`` processes), ``examples`` (this process's) and ``seconds`` (the
    epoch's wall time, a CUDA device's queued work included). ``bar``: a tqdm bar of its steps."""
    t0 = time.perf_counter()
    parts.sampler.set_epoch(epoch)
    parts.step_module.train()
    if parts.freeze_bn:
        for m in parts.net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    sched, total, device, opt = parts.sched, parts.total, parts.device, parts.opt
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    progress = None
    if bar:
        from tqdm import tqdm

        progress = tqdm(total=min(sched["steps_per_epoch"], total - step), desc=f"epoch {epoch + 1}/{epochs}",
                        leave=False, unit="step")
    seen = 0
    for x, y in parts.loader:
        if step >= total:
            break
        lr = lr_at(step, **sched)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        mix: tuple = ()
        if parts.alpha > 0:  # Mixup (repsim.train.augment): one λ per batch, the loss at the mixed target
            x, y_b, lam = mixup_batch(x, y, parts.alpha)
            mix = (y_b, lam)
        if parts.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with parts.autocast():
            loss, logits = parts.step_module(x, y, *mix)
        opt.zero_grad(set_to_none=True)
        parts.scaler.scale(loss).backward()
        parts.scaler.step(opt)
        parts.scaler.update()
        step += 1
        if parts.ema is not None:
            parts.ema.update(parts.net, step - 1)
        with torch.no_grad():  # stays on the device: no host sync per step
            c1 = _topk_correct(logits.detach().float(), y, (1,))[0]
            sums[0] += loss.detach().double() * len(y)
            sums[1] += c1
        seen += len(y)
        if progress is not None:
            progress.update(1)
            if step % 25 == 0:
                progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.3g}")
    if progress is not None:
        progress.close()
    sums[2] = seen
    if world > 1:
        dist.all_reduce(sums)
    if device.type == "cuda":  # the queued kernels belong to this epoch's time (as the reference loop times it)
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return step, {"loss": sums[0].item() / max(sums[2].item(), 1),
                  "top1": 100.0 * sums[1].item() / max(sums[2].item(), 1), "examples": seen, "seconds": seconds}


def evaluate_splits(net: nn.Module, eval_sets: dict[str, Any], **kw: Any) -> dict[str, float]:
    """:func:`evaluate` on each split: ``{split}_top1``, ``{split}_top5``, ``{split}_mean_per_class``
    (metrics.csv's columns), in the order of ``eval_sets``; ``kw``: :func:`evaluate`'s options."""
    rec: dict[str, float] = {}
    for split, ds in eval_sets.items():
        r = evaluate(net, ds, **kw)
        rec[f"{split}_top1"], rec[f"{split}_top5"] = r["top1"], r["top5"]
        rec[f"{split}_mean_per_class"] = r["mean_per_class"]
    return rec


def _resume(parts: TrainParts, cfg: dict[str, Any], ckpt_path: Path, *, rank: int, world: int, keep_every: int,
            say: Callable[[str], None]) -> tuple[int, int, list[dict[str, Any]]]:
    """Restore the network, EMA, optimizer, scaler and this process's random streams from ``ckpt_path``
    (refusing another run's or schedule's checkpoint, or another process count unless ``freeze_bn``);
    returns (epochs done, step, metrics so far)."""
    out = ckpt_path.parent
    ck = load_checkpoint(ckpt_path)
    _check_same_run(ck["config"], cfg, ckpt_path)
    _check_same_schedule(ck, parts.sched, cfg, ckpt_path)
    ck_world = int(ck.get("world_size") or len(ck["rng"]))  # older checkpoints: one RNG state per process
    if ck_world != world:
        if not cfg.get("freeze_bn"):
            raise CheckpointError(
                f"checkpoint {ckpt_path} was trained by {ck_world} process(es), this run has {world}: each "
                f"process's BatchNorm statistics (over batch_size/{ck_world} examples) and random streams would "
                f"change mid-run; resume with {ck_world} process(es) (torchrun --nproc_per_node={ck_world}) "
                "or choose another --out")
        say(f"resuming a {ck_world}-process run with {world} (freeze_bn: BatchNorm statistics are fixed; "
            "Mixup and dropout draw other random numbers from here on)")
    load_state_strict(parts.net, ck["model"], f"checkpoint {ckpt_path}")
    if parts.ema is not None and ck.get("ema"):
        load_state_strict(parts.ema.module, ck["ema"], f"checkpoint {ckpt_path} (EMA)")
    parts.opt.load_state_dict(ck["optimizer"])
    if ck.get("scaler"):
        parts.scaler.load_state_dict(ck["scaler"])
    start_epoch, step, metrics = int(ck["epoch"]), int(ck["scheduler"]["step"]), list(ck["metrics"])
    rngs = ck["rng"]
    set_rng_state(rngs[rank % len(rngs)])
    if rank >= len(rngs):  # more processes than the checkpoint's (freeze_bn only): a stream of its own
        torch.manual_seed(cfg["seed"] * 1000 + rank + 1 + 7919 * start_epoch)
    if "source" in ck["config"].get("finetune", {}):
        cfg["finetune"]["source"] = ck["config"]["finetune"]["source"]
    say(f"resuming {out} after epoch {start_epoch} (step {step})")
    if rank == 0:  # a run killed (or out of disk) after checkpoint.pt by a repsim that wrote it first
        _repair_after(ck, ckpt_path, out, keep_every, cfg["save_best"])
    return start_epoch, step, metrics


def _save_epoch(state: dict[str, Any], out: Path, *, save_best: bool, keep_every: int) -> None:
    """An epoch's files (rank 0): metrics.jsonl/.csv, best.pt (a new best holdout epoch, ``save_best``),
    epoch-EEEE.pt (every ``keep_every`` epochs), then checkpoint.pt."""
    epoch, metrics = state["epoch"], state["metrics"]
    # checkpoint.pt last: --resume trusts it, so a run killed (or out of disk) anywhere before it
    # redoes this epoch, and one killed after it has every other file of this epoch in place
    _write_metrics(out, metrics)
    written = None
    if save_best and best_epoch(holdout_curve(metrics)) == epoch:
        written = _save_or_link(state, out / "best.pt", written)
    if keep_every and epoch % keep_every == 0:
        written = _save_or_link(state, out / f"epoch-{epoch:04d}.pt", written)
    _save_or_link(state, out / "checkpoint.pt", written)
