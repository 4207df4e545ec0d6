"""Forward hooks that copy layer outputs into host buffers as the forward pass runs.

A hook fires when its module returns; it reduces the output spatially (``flatten`` keeps
``(N, C, H, W)``, ``mean`` averages over space to ``(N, C)``, ``pool<k>`` is a k×k adaptive average
pool to ``(N, C, k, k)``; ``pool`` and ``logits`` are flattened to ``(N, M)``), casts it to the store
dtype and copies it into the destination slice at once. Copying inside the hook matters: a later
in-place op (torchvision's ``ReLU(inplace=True)``, ``out += identity``) may overwrite the tensor a
module returned before ``forward`` ends. On CUDA the copy is a non-blocking device-to-pinned-host
copy, ordered on the stream before any later kernel can touch the source.

Every hook also records ``max |y|`` of the un-cast value (a device scalar, no synchronisation); the
writer checks it before writing, so that NaN/inf, and in float16 layers values at or beyond
float16's range (|y| ≥ 65520 rounds to inf), are refused with the layer named instead of stored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FLOAT16_OVERFLOW = 65520.0  # smallest magnitude that rounds to inf in float16 (max finite: 65504)
_FLAT_LAYERS = ("pool", "logits")


@dataclass(frozen=True)
class Spatial:
    """Spatial reduction of 4-D conv outputs: ``flatten`` | ``mean`` | ``pool<k>``."""

    kind: str
    k: int = 0

    @classmethod
    def parse(cls, spec: "str | Spatial") -> "Spatial":
        if isinstance(spec, Spatial):
            return spec
        if spec in ("flatten", "mean"):
            return cls(spec)
        m = re.fullmatch(r"pool(\d+)", spec or "")
        if m and int(m.group(1)) >= 1:
            return cls("pool", int(m.group(1)))
        raise ValueError(f"extract: --spatial must be flatten, mean or pool<k> (k >= 1), got {spec!r}")

    def __str__(self) -> str:
        return f"pool{self.k}" if self.kind == "pool" else self.kind

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        if y.ndim != 4 or self.kind == "flatten":
            return y
        if self.kind == "mean":
            return y.mean(dim=(2, 3))
        return F.adaptive_avg_pool2d(y, self.k)


def _output_tensor(name: str, out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    # torchvision's Inception3 returns a namedtuple (logits, aux_logits) in training mode
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"extract: layer {name!r} returned {type(out).__name__}, not a tensor")


class Capture:
    """Hooks on ``modules`` ({store name: qualname}) of ``model``.

    Use ``with Capture(...) as cap:``; before each forward set ``cap.target = (buffers, lo, hi)``
    where ``buffers[name]`` is a host tensor and rows ``lo:hi`` receive this batch. In ``probe``
    mode (``cap.target = None``) the processed outputs are kept in ``cap.probe`` instead.
    """

    def __init__(self, model: nn.Module, modules: dict[str, str], spatial: Spatial, dtype: torch.dtype):
        self.model = model
        self.modules = modules
        self.spatial = spatial
        self.dtype = dtype
        self.target: tuple[dict[str, torch.Tensor], int, int] | None = None
        self.probe: dict[str, torch.Tensor] = {}
        self.amax: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self.fired: set[str] = set()
        self._handles: list = []

    def __enter__(self) -> "Capture":
        named = dict(self.model.named_modules())
        for name, qual in self.modules.items():
            self._handles.append(named[qual].register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def process(self, name: str, out) -> torch.Tensor:
        """The value stored for layer ``name`` given its module output (before the cast)."""
        y = _output_tensor(name, out)
        if name in _FLAT_LAYERS:
            return y.reshape(y.shape[0], -1)
        return self.spatial.apply(y)

    def _hook(self, name: str):
        def hook(module, inputs, out):
            if name in self.fired:
                raise RuntimeError(
                    f"extract: module {self.modules[name]!r} (layer {name!r}) ran twice in one forward "
                    "pass; a shared module cannot be captured by a hook, declare other layers"
                )
            self.fired.add(name)
            y = self.process(name, out).detach()
            if self.target is None:
                self.probe[name] = y.clone()
                return
            buffers, lo, hi = self.target
            dest = buffers[name][lo:hi]
            lo_hi = torch.aminmax(y)  # one pass, NaN propagates; max |y| = max(-min, max)
            self.amax[name].append(torch.maximum(-lo_hi.min, lo_hi.max).float())
            if dest.device == y.device:
                dest.copy_(y)  # CPU: the cast happens inside the copy, no temporary
            else:  # GPU: cast on the device (half the transfer), then a non-blocking copy to pinned host
                dest.copy_(y.to(dest.dtype), non_blocking=dest.is_pinned())

        return hook

    def begin_batch(self) -> None:
        self.fired.clear()

    def end_batch(self) -> None:
        missing = set(self.modules) - self.fired
        if missing:
            raise RuntimeError(f"extract: layers {sorted(missing)} were not computed by model.forward")

    def take_amax(self) -> dict[str, torch.Tensor]:
        """Per layer, max |y| over the batches since the last call (device scalars, no sync)."""
        out = {name: torch.stack(vals).amax() for name, vals in self.amax.items() if vals}
        for vals in self.amax.values():
            vals.clear()
        return out
