"""Where training processes run: GPUs, shared GPUs or the CPU (``repsim train``, ``tune``, ``finetune``).

Pure functions of the request and of the number of visible GPUs, so every rule is tested without a GPU
(``tests/test_placement.py``); the commands call them before anything starts.

Rules, for ``jobs`` runs at a time of ``nproc`` processes each, ``g`` visible GPUs and ``device`` one of
``auto`` (default), ``cuda``, ``cpu``:

- ``cpu``: every process on the CPU (DDP over gloo); the GPUs are hidden from the runs
  (``CUDA_VISIBLE_DEVICES=""``).
- ``g = 0``: the CPU; ``cuda`` is refused.
- ``nproc > g``: NCCL, the GPU backend of DDP, needs one GPU per process (two ranks on one GPU are
  refused by NCCL), so one run cannot be placed on the GPUs: ``auto`` falls back to the CPU with one
  line saying so, ``cuda`` is refused.
- otherwise the GPUs form ``g // nproc`` disjoint groups of ``nproc``; job slot s gets group
  ``s mod (g // nproc)``: with more jobs than groups, several runs share a GPU (one line says so).

A refusal is a :class:`PlacementError` (a ``ValueError``: ``repsim`` prints it on one line, exit 2).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

DEVICES = ("auto", "cuda", "cpu")


class PlacementError(ValueError):
    """A request that cannot be placed on this machine."""


def device_arg(text: str) -> str:
    """An argparse ``type`` for the ``--device`` of commands that run one process on one device
    (``repsim extract``, ``robustness``): ``auto`` (cuda when PyTorch sees a GPU, else cpu), or a device
    torch knows and this machine has — checked before any model is loaded, so a typo or a missing GPU
    is one line naming the option, not a crash in the middle of the run."""
    import argparse

    if text == "auto":
        return text
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is usable on this machine "
                                             "(torch.cuda.is_available() is False); use --device cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    return text


device_arg.__name__ = "device"


@dataclass(frozen=True)
class Placement:
    """``device``: where the processes run (``"cuda"`` or ``"cpu"``); ``slots``: the environment of each
    job slot (``CUDA_VISIBLE_DEVICES``), ``jobs`` of them; ``note``: one line when the plan is not the
    plain one (a CPU fallback, shared GPUs), else None."""

    device: str
    slots: list[dict[str, str]] = field(default_factory=list)
    note: str | None = None


def _check(jobs: int, nproc: int, device: str) -> None:
    if jobs < 1 or nproc < 1:
        raise PlacementError(f"--jobs and --nproc-per-node must be >= 1, got {jobs} and {nproc}")
    if device not in DEVICES:
        raise PlacementError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")


def plan_placement(jobs: int, nproc: int, gpus: list[str], device: str = "auto") -> Placement:
    """The placement of ``jobs`` runs of ``nproc`` processes on the GPUs ``gpus`` (their ids as
    ``CUDA_VISIBLE_DEVICES`` names them); see the module docstring for the rules."""
    _check(jobs, nproc, device)
    g = len(gpus)
    hidden = [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(jobs)]
    if device == "cpu":
        return Placement("cpu", hidden)
    if g == 0:
        if device == "cuda":
            raise PlacementError("--device cuda: no GPU is visible (torch.cuda / CUDA_VISIBLE_DEVICES)")
        return Placement("cpu", [{} for _ in range(jobs)])
    if nproc > g:
        why = (f"--nproc-per-node {nproc} needs {nproc} GPUs (NCCL runs one process per GPU); "
               f"{g} visible")
        if device == "cuda":
            raise PlacementError(f"{why}: pass --nproc-per-node {g} or fewer, or --device cpu")
        return Placement("cpu", hidden, f"{why}: the runs train on the CPU (gloo); "
                                        f"--nproc-per-node {g} would use the GPU")
    groups = [",".join(gpus[k * nproc:(k + 1) * nproc]) for k in range(g // nproc)]
    slots = [{"CUDA_VISIBLE_DEVICES": groups[s % len(groups)]} for s in range(jobs)]
    note = None
    if jobs > len(groups):
        per = -(-jobs // len(groups))
        note = (f"--jobs {jobs} x --nproc-per-node {nproc} on {g} GPU(s): up to {per} runs share each "
                f"{'GPU' if nproc == 1 else 'group of GPUs'}")
    return Placement("cuda", slots, note)


def plan_process(local_rank: int, local_world: int, n_gpus: int, device: str = "auto") -> tuple[str, str | None]:
    """The torch device of one training process (``"cuda:<i>"`` or ``"cpu"``) among ``local_world``
    processes on this node with ``n_gpus`` visible GPUs, and one line when it falls back to the CPU
    (the rules of the module docstring, for one run: DDP over NCCL needs one GPU per process)."""
    _check(1, local_world, device)
    placed = plan_placement(1, local_world, [str(i) for i in range(n_gpus)], device)
    if placed.device == "cpu":
        return "cpu", placed.note
    return f"cuda:{local_rank}", None


def visible_gpus() -> list[str]:
    """The GPUs a child process would see: ``CUDA_VISIBLE_DEVICES``'s entries when it is set, else
    ``0 .. torch.cuda.device_count() - 1`` (none without torch's CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
