"""Forward hooks that copy layer outputs into host buffers as the forward pass runs.

A hook fires when its module returns (or, for a ``<qualname>:input`` tap, when it is called, with its
first input); it picks the tensor (:func:`output_tensor`), reduces it, casts it to the store dtype
and copies it into the destination slice at once. Reductions by shape:

* ``(N, C, H, W)`` maps: ``--spatial`` (``flatten`` keeps ``(N, C, H, W)``, ``mean`` averages over
  space to ``(N, C)``, ``pool<k>`` is a k×k adaptive average pool to ``(N, C, k, k)``). In a
  channels-last model (``layout="NHWC"``: torchvision Swin, timm models with ``output_fmt`` NHWC) a
  4-D output is ``(N, H, W, C)`` and is permuted to ``(N, C, H, W)`` first, except that of a module
  whose outputs are ``(N, C, H, W)`` by definition (:data:`NCHW_MODULES`: a Swin's patch-embedding
  convolution, a pooling layer after its final permute).
* ``(N, T, D)`` token sequences: ``--tokens`` (:class:`Tokens`: ``cls`` the first token, ``mean``
  over tokens, ``last`` the last token, ``flatten`` keeps ``(N, T, D)``); with an attention mask
  (text), padding is left out of ``mean``, ``cls``/``last`` take the first/last real token, and
  ``flatten`` zeroes padded positions.
* ``pool`` and ``logits`` of a classifier are flattened to ``(N, M)`` (a token ``pool`` of a
  headless model is reduced as tokens); other shapes are stored as they are.

Copying inside the hook matters: a later in-place op (torchvision's ``ReLU(inplace=True)``, ``out +=
identity``) may overwrite the tensor a module returned before ``forward`` ends. On CUDA the hook
casts (or copies) the value into a private device tensor on the compute stream, and the
non-blocking device-to-pinned-host copy runs on a side stream (``Capture.copy_stream``) that waits
only for that cast: the copy engine drains a layer while the compute stream runs the next layers
(and the next batch), instead of stalling the forward pass for every copy. ``record_stream`` keeps
the private tensor's memory from reuse until its copy has run.

Every hook also records ``max |y|`` of the un-cast value (``vector_norm(y, inf)``: one reduction
kernel, a device scalar, NaN propagates, no synchronisation); the writer thread checks a chunk's
maxima once the chunk's copies are done (one check per chunk of several batches, never on the main
thread), so that NaN/inf, and in float16 layers values at or beyond float16's range (|y| ≥ 65520
rounds to inf), are refused with the layer and the chunk's rows named instead of stored.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FLOAT16_OVERFLOW = 65520.0  # smallest magnitude that rounds to inf in float16 (max finite: 65504)
_FLAT_LAYERS = ("pool", "logits")
# modules whose 4-D outputs are (N, C, H, W) whatever the model's layout (PyTorch's convention for them)
NCHW_MODULES = (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm, nn.AvgPool2d,
                nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LPPool2d, nn.Upsample)


def reduction_dtype(y: torch.Tensor) -> torch.dtype | None:
    """float32 for a float16/bfloat16 tensor (an autocast activation), else None (its own dtype).

    Averages (``--spatial mean``/``pool<k>``, ``--tokens mean``) are accumulated *and returned* in
    float32: returned in bfloat16 they would round to 8 bits of mantissa before a float32 (or float16)
    store ever saw them (0.26 % on a ResNet block under ``--amp bfloat16``)."""
    return torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else None


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
        """``y`` reduced over space; a float16/bfloat16 map (autocast) is averaged in float32 and the
        average kept in float32, so that the reduction adds no rounding of its own before the cast to
        the store dtype."""
        if y.ndim != 4 or self.kind == "flatten":
            return y
        if self.kind == "mean":
            return y.mean(dim=(2, 3), dtype=reduction_dtype(y))
        return F.adaptive_avg_pool2d(y.to(reduction_dtype(y) or y.dtype), self.k)


TOKEN_REDUCTIONS = ("cls", "mean", "last", "flatten")


@dataclass(frozen=True)
class Tokens:
    """Reduction of ``(N, T, D)`` token outputs: ``cls`` | ``mean`` | ``last`` | ``flatten``."""

    kind: str

    @classmethod
    def parse(cls, spec: "str | Tokens") -> "Tokens":
        if isinstance(spec, Tokens):
            return spec
        if spec not in TOKEN_REDUCTIONS:
            raise ValueError(f"extract: --tokens must be one of {', '.join(TOKEN_REDUCTIONS)}, got {spec!r}")
        return cls(spec)

    def __str__(self) -> str:
        return self.kind

    def apply(self, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``y`` (N, T, D) reduced; ``mask`` (N, T), 1 for real tokens, 0 for padding, or None."""
        if mask is None:
            if self.kind == "cls":
                return y[:, 0]
            if self.kind == "last":
                return y[:, -1]
            return y.mean(dim=1, dtype=reduction_dtype(y)) if self.kind == "mean" else y
        m = mask.to(device=y.device)
        if self.kind == "mean":
            w = m.to(torch.float32).unsqueeze(-1)
            return (y.float() * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
        if self.kind == "flatten":
            return y * m.to(y.dtype).unsqueeze(-1)
        pos = torch.arange(m.shape[1], device=m.device)
        real = m > 0
        # first / last real token (tokenizers pad on the right or, for some decoders, the left)
        idx = torch.where(real, pos, m.shape[1]).amin(dim=1) if self.kind == "cls" else torch.where(real, pos, -1).amax(dim=1)
        return y[torch.arange(y.shape[0], device=y.device), idx.clamp(0, m.shape[1] - 1)]


def output_tensor(name: str, out) -> torch.Tensor:
    """The tensor a layer stores from its module's output: a tensor as is; a tuple/list's first
    element (Hugging Face layers return ``(hidden_states, ...)``; torchvision's Inception returns
    ``(logits, aux)`` in training mode); a dict/``ModelOutput``'s ``logits`` if it has them, else its
    ``last_hidden_state``, else its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        out = tuple(out.values())
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"extract: layer {name!r} returned {type(out).__name__}, not a tensor")


def _input_hook(hook):
    """A forward pre-hook handing the module's first input (positional, else keyword) to ``hook``."""

    def pre_hook(module, args, kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        hook(module, args, first)

    return pre_hook


class Capture:
    """Hooks on ``modules`` ({store name: tap}, see :func:`extract.layers.tap_module`) of ``model``.

    Use ``with Capture(...) as cap:``; before each forward set ``cap.target = (buffers, lo, hi)``
    where ``buffers[name]`` is a host tensor and rows ``lo:hi`` receive this batch, and ``cap.mask``
    to the batch's attention mask (or None). In ``probe`` mode (``cap.target = None``) the processed
    outputs are kept in ``cap.probe`` instead.
    """

    def __init__(self, model: nn.Module, modules: dict[str, str], spatial: Spatial, dtype: torch.dtype,
                 tokens: "Tokens | str" = "flatten", layout: str = "NCHW"):
        self.model = model
        self.modules = modules
        self.spatial = spatial
        self.tokens = Tokens.parse(tokens)
        self.layout = layout
        self.dtype = dtype
        self.target: tuple[dict[str, torch.Tensor], int, int] | None = None
        self.mask: torch.Tensor | None = None
        self.probe: dict[str, torch.Tensor] = {}
        self.token_layers: set[str] = set()  # layers stored as whole token sequences (T, D)
        self.amax: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
        self.fired: set[str] = set()
        self.copy_stream: torch.cuda.Stream | None = None  # device-to-host copies (CUDA), made on first use
        self._handles: list = []
        self.nchw: set[str] = set()  # layers whose module's 4-D outputs are (N, C, H, W) in any model

    def __enter__(self) -> "Capture":
        from .layers import tap_module

        named = dict(self.model.named_modules())
        self.nchw = {name for name, tap in self.modules.items() if isinstance(named.get(tap_module(tap)[0]), NCHW_MODULES)}
        for name, tap in self.modules.items():
            qual, where = tap_module(tap)
            hook = self._hook(name)
            if where == "input":
                self._handles.append(named[qual].register_forward_pre_hook(_input_hook(hook), with_kwargs=True))
            else:
                self._handles.append(named[qual].register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def process(self, name: str, out) -> torch.Tensor:
        """The value stored for layer ``name`` given its module output (before the cast)."""
        y = output_tensor(name, out)
        if y.ndim == 4 and self.layout == "NHWC" and name != "logits" and name not in self.nchw:
            y = y.permute(0, 3, 1, 2)
        if y.ndim == 3 and name != "logits":
            if self.mask is not None and tuple(self.mask.shape) != tuple(y.shape[:2]):
                raise RuntimeError(f"extract: layer {name!r} has {y.shape[1]} tokens but the attention mask has "
                                   f"{self.mask.shape[1]}; choose other layers")
            if self.tokens.kind == "flatten":
                self.token_layers.add(name)
            return self.tokens.apply(y, self.mask)
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
            self.amax[name].append(torch.linalg.vector_norm(y, math.inf, dtype=torch.float32))
            if dest.device == y.device:
                dest.copy_(y)  # CPU: the cast happens inside the copy, no temporary
                return
            # GPU: cast on the device (half the transfer) into a tensor no later op can touch, then
            # copy it to pinned host memory on the side stream, after the cast and nothing else
            private = y.to(dest.dtype, copy=True)
            compute = torch.cuda.current_stream(y.device)
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(y.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                dest.copy_(private, non_blocking=True)
            private.record_stream(self.copy_stream)

        return hook

    def begin_batch(self) -> None:
        self.fired.clear()

    def end_batch(self) -> None:
        missing = set(self.modules) - self.fired
        if missing:
            raise RuntimeError(f"extract: layers {sorted(missing)} were not computed by model.forward")

    def take_amax(self) -> dict[str, torch.Tensor]:
        """Per layer, max |y| over the batches since the last call (device scalars on the compute
        stream, no sync)."""
        out = {name: torch.stack(vals).amax() for name, vals in self.amax.items() if vals}
        for vals in self.amax.values():
            vals.clear()
        return out
