"""Checkpoints: one ``torch.save`` dict per file, written atomically (temp file + ``os.replace``).

Keys: ``config`` (arch, arch_params, in_channels, objective, objective_params,
num_classes, dataset, seed, preset, ...), ``model`` and ``ema`` (state_dicts of
:class:`repsim.train.models.Network`), ``optimizer``, ``scheduler`` ({"step": optimizer steps taken}),
``scaler`` (GradScaler state, {} when unused), ``rng`` (one dict per process: torch, cuda, numpy,
python states), ``world_size`` (the number of processes that trained it; absent before, when it is
``len(rng)``), ``epoch`` (last completed, 1-based), ``metrics`` (list of per-epoch dicts), ``format`` (=1).
``scheduler`` also holds the schedule (``total_steps``, ``steps_per_epoch``, ``name``, ...). Only tensors and Python primitives are stored, so ``torch.load(weights_only=True)``
reads it.
"""
from __future__ import annotations

import os
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repsim.fileio import give_usual_mode, naming

from .models import Network, build_network

FORMAT = 1


class CheckpointError(ValueError):
    """An unreadable checkpoint or one that does not match the requested run."""


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves either the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        give_usual_mode(fd)
        with naming(path), os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = _os_error(exc)
        if cause is not None and cause is not exc:  # torch.save turns a failed write into a RuntimeError
            raise OSError(cause.errno, cause.strerror, str(path)) from exc
        raise


def _os_error(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` (disk full, read-only, ...) behind ``exc``, following its context chain."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__context__
    return exc


def _why_unreadable(exc: Exception) -> str:
    """A short reason why ``torch.load`` failed, without torch's advice to load untrusted pickles or
    to file an issue with PyTorch (neither applies to a file that is not a repsim checkpoint)."""
    text = str(exc)
    if "Weights only load failed" in text:
        found = re.search(r"Unsupported (?:global: GLOBAL \S+|[^\n.]*)", text)
        detail = found.group(0).strip().rstrip(".") if found else "objects other than tensors and plain values"
        return f"not a torch.save file of tensors and plain values: {detail}"
    return f"{type(exc).__name__}: {' '.join(text.split())[:200]}"


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", *, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dict at ``path`` (tensors and plain values only: ``weights_only``).

    ``mmap``: map the file instead of reading it (``torch.load(mmap=True)``): a tensor's bytes are
    read when first touched, so a reader that wants only the (EMA) weights never reads the optimizer
    state (a ResNet-50 checkpoint: 130-170 -> 55 ms on 2 cores). The tensors stay backed by the
    file's pages (copy-on-write), which `repsim train` only ever replaces by renaming a new file
    over it. Files of torch's legacy format are read instead."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        with warnings.catch_warnings():  # torch's pickle-protocol warning on foreign files
            warnings.simplefilter("ignore")
            try:
                ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if not mmap or "mmap" not in str(exc):
                    raise
                ckpt = torch.load(path, map_location=map_location, weights_only=True)  # a legacy-format file
    except Exception as e:  # noqa: BLE001 - any unpickling failure is "not a checkpoint"
        raise CheckpointError(f"{path} is not a readable repsim checkpoint ({_why_unreadable(e)}); give a "
                              "checkpoint.pt or best.pt written by `repsim train`") from None
    if not isinstance(ckpt, dict) or "config" not in ckpt or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a repsim training checkpoint (no config/model keys)")
    return ckpt


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, *,
                      assign: bool = False) -> None:
    """``load_state_dict(strict=True)`` with a one-line error naming the first mismatches."""
    try:
        module.load_state_dict(state, strict=True, assign=assign)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{what} does not fit this architecture: {first}") from None


def load_model(checkpoint: str | os.PathLike, *, ema: bool = True, map_location: Any = "cpu") -> Network:
    """The :class:`~repsim.train.models.Network` of ``checkpoint`` in eval mode, with the EMA weights (the
    ones the paper evaluates, App. A.1) unless ``ema=False`` or the run kept no EMA."""
    return network_from_checkpoint(load_checkpoint(checkpoint, map_location), checkpoint, ema=ema)


def network_from_checkpoint(ckpt: dict[str, Any], name: Any = "checkpoint", *, ema: bool = True) -> Network:
    """:func:`load_model` for a checkpoint dict already read by :func:`load_checkpoint` (so a caller
    that also wants its metadata reads the file once).

    The network is built on the meta device and takes the checkpoint's tensors as its own
    (``load_state_dict(assign=True)``): its initialisers, whose random weights the checkpoint would
    overwrite, never run (ResNet-50: 195 -> 52 ms on 2 cores; once per store in ``repsim extract``).
    A network that the checkpoint would not fill entirely (a tensor missing, a non-persistent
    buffer, another dtype) is built and loaded the ordinary way, which also words the mismatch."""
    state = ckpt.get("ema") if ema and ckpt.get("ema") else ckpt["model"]
    net = _built_without_init(ckpt["config"], state)
    if net is not None:
        load_state_strict(net, state, f"checkpoint {name}", assign=True)
        return net.eval()
    net = build_network(ckpt["config"])
    load_state_strict(net, state, f"checkpoint {name}")
    return net.eval()


class _NoValuesOnMeta(torch.overrides.TorchFunctionMode):
    """Inside it (this thread only, as every torch function mode), the in-place ops that only set a
    tensor's values (``normal_``, ``uniform_``, ``fill_``, ... : what ``torch.nn.init`` calls) return a
    meta tensor untouched: it has no values. On the meta device they dispatch to Python reference
    implementations, whose first call imports ``torch._dynamo`` (2 s on 2 cores, once per process) and
    which cost half of a ResNet-50's build (61 -> 32 ms; digits' mini ResNet 86 -> 35 ms)."""

    VALUE_OPS = frozenset(getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "log_normal_",
        "cauchy_", "geometric_", "erfinv_", "clamp_", "mul_", "add_", "sub_", "div_", "copy_"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.VALUE_OPS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


def _built_without_init(config: dict[str, Any], state: dict[str, torch.Tensor]) -> Network | None:
    """``build_network(config)`` on the meta device, its initialisers skipped (:class:`_NoValuesOnMeta`),
    when ``state`` holds a CPU tensor of the right dtype and shape for every parameter and buffer, else
    None (the ordinary route then decides)."""
    try:
        with torch.device("meta"), _NoValuesOnMeta():
            net = build_network(config)
    except Exception:  # noqa: BLE001 - e.g. an architecture that reads a tensor's value while built
        return None
    for key, t in (*net.named_parameters(), *net.named_buffers()):
        got = state.get(key)
        if (not isinstance(got, torch.Tensor) or got.device.type != "cpu" or got.dtype != t.dtype
                or got.shape != t.shape):
            return None
    return net


# -- RNG state ---------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors/primitives (weights_only-loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64), "gauss": py[2]},
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
