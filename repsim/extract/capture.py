"""Forward hooks that copy layer outputs into host buffers as the forward pass runs.

A hook fires when its module returns (or, for a ``<qualname>:input`` tap, when it is called, with its
first input); it picks the tensor (:func:`output_tensor`), reduces it, casts it to the store dtype
and copies it into the destination slice at once. Reductions by shape:

* ``(N, C, H, W)`` maps: ``--spatial`` (``flatten`` keeps ``(N, C, H, W)``, ``mean`` averages over
  space to ``(N, C)``, ``pool<k>`` is a k×k adaptive average pool to ``(N, C, k, k)``). The layout of
  a 4-D output is decided per tap (:func:`tap_layout`): ``(N, C, H, W)`` for a module whose outputs
  are so by definition (:data:`NCHW_MODULES`: convolutions, norms over channels, pooling; a
  ``Permute`` to ``(0, 3, 1, 2)``), ``(N, H, W, C)`` for one that works on the last axis (``nn.Linear``,
  a ``nn.LayerNorm`` over one axis, a ``Permute`` to ``(0, 2, 3, 1)``: ConvNeXt's inner block
  modules in any model), an activation, dropout or identity takes the layout of what feeds it in its
  ``nn.Sequential``, and any other module the model's (``layout="NHWC"``: torchvision Swin, timm
  models with ``output_fmt`` NHWC; else ``NCHW``). An ``(N, H, W, C)`` output is permuted to
  ``(N, C, H, W)`` first.
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ExtractError

FLOAT16_OVERFLOW = 65520.0  # smallest magnitude that rounds to inf in float16 (max finite: 65504)
_FLAT_LAYERS = ("pool", "logits")
# modules whose 4-D outputs are (N, C, H, W) whatever the model's layout (PyTorch's convention for them)
NCHW_MODULES = (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm, nn.AvgPool2d,
                nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LPPool2d, nn.Upsample)
# modules whose 4-D output has the layout of their input
_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Tanh,
                nn.Sigmoid, nn.Mish, nn.Dropout, nn.Identity)
# ... and leaf modules of other libraries by class name (timm's own GELU, DropPath, ...)
_ELEMENTWISE_NAMES = {"gelu", "geglu", "gelutanh", "quickgelu", "silu", "swish", "mish", "relu", "relu6", "hardswish",
                      "hardsigmoid", "sigmoid", "tanh", "droppath", "dropout", "identity", "stochasticdepth"}


def _elementwise(m: nn.Module) -> bool:
    return isinstance(m, _ELEMENTWISE) or (next(m.children(), None) is None
                                          and type(m).__name__.lower() in _ELEMENTWISE_NAMES)


def _plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _permute_dims(m: nn.Module) -> tuple[int, ...] | None:
    """The ``dims`` of a permutation module (torchvision's ``Permute``) of 4-D tensors, else None."""
    dims = getattr(m, "dims", None)
    if isinstance(dims, (list, tuple)) and sorted(int(d) for d in dims) == [0, 1, 2, 3]:
        return tuple(int(d) for d in dims)
    return None


def _last_axis(m: nn.Module) -> str | None:
    """``"NHWC"`` for a module that works on the last axis of what it takes and returns (``nn.Linear``,
    an ``nn.LayerNorm`` over one axis; not a ``LayerNorm2d``, which normalises channels of NCHW maps),
    ``"NCHW"`` for one that works on axis 1 (:data:`NCHW_MODULES`), else None."""
    if isinstance(m, nn.Linear):
        return "NHWC"
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        return "NCHW" if type(m).__name__.lower().endswith("2d") else "NHWC"
    if isinstance(m, NCHW_MODULES):
        return "NCHW"
    return None


def _output_layout(named: dict[str, nn.Module], qual: str, depth: int = 0) -> str | None:
    """The layout of ``qual``'s 4-D outputs where its type tells it, else None (see :func:`tap_layout`)."""
    m = named.get(qual)
    if m is None or depth > 64:
        return None
    dims = _permute_dims(m)
    if dims is not None:
        return {(0, 2, 3, 1): "NHWC", (0, 3, 1, 2): "NCHW"}.get(dims)
    if _last_axis(m) is not None:
        return _last_axis(m)
    if _plain_sequential(m) and len(m):
        last = list(m.named_children())[-1][0]
        return _output_layout(named, f"{qual}.{last}" if qual else last, depth + 1)
    if _elementwise(m):
        return _input_layout(named, qual, depth + 1, own=False)
    return None


def _input_layout(named: dict[str, nn.Module], qual: str, depth: int = 0, own: bool = True) -> str | None:
    """The layout of ``qual``'s 4-D first input: what the module works on (``own``), else the output of
    its predecessor in a plain ``nn.Sequential`` (or that Sequential's own input), else None."""
    m = named.get(qual)
    if m is None or depth > 64:
        return None
    if own and _permute_dims(m) is None and _last_axis(m) is not None:
        return _last_axis(m)
    if not qual:
        return None
    parent, _, child = qual.rpartition(".")
    box = named.get(parent)
    if box is None or not _plain_sequential(box):
        return None
    names = [k for k, _ in box.named_children()]
    k = names.index(child)
    if k > 0:
        return _output_layout(named, f"{parent}.{names[k - 1]}" if parent else names[k - 1], depth + 1)
    return _input_layout(named, parent, depth + 1, own=False)


def tap_layout(named: dict[str, nn.Module], tap: str, model_layout: str | None) -> str | None:
    """``"NCHW"`` or ``"NHWC"``: the layout of a tap's 4-D values (``named``: the model's modules by
    qualname). Decided by the module where its type tells it — (N, C, H, W) for :data:`NCHW_MODULES`
    and a permutation to (0, 3, 1, 2); (N, H, W, C) for a ``nn.Linear``, a one-axis ``nn.LayerNorm``
    and a permutation to (0, 2, 3, 1) (ConvNeXt's block internals); an activation, dropout or identity
    (and a plain ``nn.Sequential``) by what feeds it (returns) in its ``nn.Sequential`` — and by the
    model's ``model_layout`` otherwise (None: leave it undecided). A ``<qual>:input`` tap: the layout
    its module works on, else that of its predecessor. An output tap still undecided is decided as its
    module runs (:class:`Capture`): when its output is the very tensor one of its sub-modules of known
    layout returned (a custom MLP ending in a ``Linear``, followed by dropout), that sub-module's."""
    from .layers import tap_module

    qual, where = tap_module(tap)
    got = _input_layout(named, qual) if where == "input" else _output_layout(named, qual)
    return got or model_layout


def _old_layout(named: dict[str, nn.Module], tap: str, model_layout: str) -> str:
    """The layout the per-model rule gave a tap before layouts were decided per tap (stores record
    the taps where :func:`tap_layout` differs: ``extraction.tap_layouts``)."""
    from .layers import tap_module

    if model_layout == "NHWC" and not isinstance(named.get(tap_module(tap)[0]), NCHW_MODULES):
        return "NHWC"
    return "NCHW"


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
        values = tuple(out.values())
        if values and isinstance(values[0], torch.Tensor):
            return values[0]
        first = type(values[0]).__name__ if values else "nothing"
        raise TypeError(f"extract: layer {name!r} returned a {type(out).__name__} whose first value is {first}, "
                        "not a tensor")
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
    """Hooks on ``modules`` ({store name: tap}, see :func:`repsim.extract.layers.tap_module`) of ``model``.

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
        self.layouts: dict[str, str] = {}  # layer -> layout of its 4-D values (tap_layout)
        self.relaid: dict[str, str] = {}  # 4-D layers whose layout the per-model rule got wrong (_old_layout)
        self._old: dict[str, str] = {}
        self._last: dict[str, tuple[torch.Tensor, str | None]] = {}  # (_track_inside)
        self.rows: int | None = None  # examples in the current batch (begin_batch), checked against every output
        self.batch_shape: str | None = None

    def __enter__(self) -> "Capture":
        from .layers import tap_module

        named = dict(self.model.named_modules())
        self.layouts = {name: tap_layout(named, tap, None) for name, tap in self.modules.items()}
        self._old = {name: _old_layout(named, tap, self.layout) for name, tap in self.modules.items()}
        for name, tap in self.modules.items():
            qual, where = tap_module(tap)
            if where == "output" and self.layouts[name] is None:
                # an activation/dropout/identity: the layout of what feeds it, among its siblings
                inside = qual.rpartition(".")[0] if _elementwise(named[qual]) and qual else qual
                self._track_inside(name, named[inside])
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
        if self.rows is not None and (y.ndim == 0 or y.shape[0] != self.rows):
            raise ExtractError(
                f"extract: layer {name!r} (module {self.modules[name] or '(model output)'!r}) gives shape "
                f"{tuple(y.shape)} for a batch of shape {self.batch_shape}: its first dimension is not one row per "
                "example (e.g. position embeddings shared by every example), so it cannot be stored; choose other "
                "layers (repsim extract --list-layers)")
        last = self._last.pop(name, None)
        if y.ndim == 4 and name != "logits":
            layout = self.layouts.get(name) or (last[1] if last is not None and last[0] is y and last[1] else None)
            layout = layout or self.layout
            if layout != self._old.get(name, layout):
                self.relaid[name] = layout
            if layout == "NHWC":
                y = y.permute(0, 3, 1, 2)
        if y.ndim == 3 and name != "logits":
            if self.mask is not None and tuple(self.mask.shape) != tuple(y.shape[:2]):
                raise ExtractError(f"extract: layer {name!r} gives shape {tuple(y.shape)} but the batch's attention "
                                   f"mask is {tuple(self.mask.shape)} (examples, tokens): it is not one token "
                                   "sequence per example; choose other layers")
            if self.tokens.kind == "flatten":
                self.token_layers.add(name)
            return self.tokens.apply(y, self.mask)
        if name in _FLAT_LAYERS:
            return y.reshape(y.shape[0], -1)
        return self.spatial.apply(y)

    def _track_inside(self, name: str, module: nn.Module) -> None:
        """For a tap whose layout its type does not tell: hooks on its sub-modules of known layout
        (and on the activations, dropouts and identities they feed) remember the last tensor one of
        them returned, with its layout; the tap's output is laid out so when it is that tensor."""
        subs = [m for q, m in module.named_modules() if q and (
            _permute_dims(m) is not None or _last_axis(m) is not None or _elementwise(m))]
        if not any(isinstance(m, (nn.Linear, nn.LayerNorm)) or _permute_dims(m) is not None for m in subs):
            return  # nothing inside can lay out a map otherwise than the model does

        def seen(sub, inputs, out):
            if not isinstance(out, torch.Tensor):
                return
            if _elementwise(sub):
                last = self._last.get(name)
                fed = last is not None and bool(inputs) and inputs[0] is last[0]
                self._last[name] = (out, last[1] if fed else None)
            else:
                dims = _permute_dims(sub)
                self._last[name] = (out, {(0, 2, 3, 1): "NHWC", (0, 3, 1, 2): "NCHW"}.get(dims) if dims else _last_axis(sub))

        for m in subs:
            self._handles.append(m.register_forward_hook(seen))

    def _hook(self, name: str):
        def hook(module, inputs, out):
            if name in self.fired:
                raise ExtractError(
                    f"extract: module {self.modules[name]!r} (layer {name!r}) ran twice in one forward "
                    "pass; a shared module cannot be captured by a hook, declare other layers"
                )
            self.fired.add(name)
            y = self.process(name, out).detach()
            if self.target is None:
                self.probe[name] = y.clone()
                return
            buffers, lo, hi = self.target
            self.amax[name].append(torch.linalg.vector_norm(y, math.inf, dtype=torch.float32))
            self.copy_out(buffers[name][lo:hi], y)

        return hook

    def copy_out(self, dest: torch.Tensor, y: torch.Tensor) -> None:
        """Copy ``y`` (on the compute device) into the host slice ``dest``, cast to its dtype."""
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

    def begin_batch(self, x: Any = None) -> None:
        """Before each forward pass; ``x``: the batch (image tensor or dict of token tensors), whose
        rows every layer's output must have (None: not checked)."""
        self.fired.clear()
        self._last.clear()
        if x is None:
            self.rows, self.batch_shape = None, None
        else:
            first = next(iter(x.values())) if isinstance(x, dict) else x
            self.rows = int(first.shape[0])
            self.batch_shape = (", ".join(f"{k} {tuple(v.shape)}" for k, v in x.items()) if isinstance(x, dict)
                                else str(tuple(x.shape)))

    def end_batch(self) -> None:
        missing = [name for name in self.modules if name not in self.fired]
        if missing:
            taps = sorted({self.modules[name] or "(model output)" for name in missing})
            raise ExtractError(
                f"extract: layers {missing} (modules {taps}) were not computed by model.forward: it never "
                "calls them on this input; choose layers that run (repsim extract --list-layers lists them)")

    def take_amax(self) -> dict[str, torch.Tensor]:
        """Per layer, max |y| over the batches since the last call (device scalars on the compute
        stream, no sync)."""
        out = {name: torch.stack(vals).amax() for name, vals in self.amax.items() if vals}
        for vals in self.amax.values():
            vals.clear()
        return out
