"""Layer registry: which modules' outputs become which store layers, per architecture.

``layer_modules(model)`` returns ``{store layer name: tap}`` in network order, where a tap is a module
qualname (the module's output) or ``"<qualname>:input"`` (the module's first input); ``""`` is the
model itself, i.e. its output. The store layer's value for an example is that tensor in
``model.forward``:

* **ResNet-style** (torchvision ResNet, the small ResNets and WRNs of ``repsim.train.models``: any
  backbone with ``layer1``, ``layer2``, ... each an ``nn.Sequential`` of blocks): ``block1`` ...
  ``blockB`` number every residual block in order over ``layer1..layerL``; a block's output is
  taken after the residual add and the final ReLU, which is the block module's forward output
  (paper Fig. 3/C.2 "after the residual connection and subsequent nonlinearity"). ResNet-50 gives
  ``block1`` ... ``block16``.
* **Inception v3** (App. B): the eleven Mixed blocks, named as TF-slim's end points
  (``Mixed_5b, Mixed_5c, Mixed_5d, Mixed_6a, ..., Mixed_6e, Mixed_7a, Mixed_7b, Mixed_7c``), which
  are the Inception v3 blocks of the Google implementation the paper used.
* **Sequential-style** backbones (e.g. All-CNN-C): a backbone that names its own blocks with an
  attribute ``blocks`` (``nn.Sequential``/``nn.ModuleList``) gets ``block1..blockB`` for its
  children; a backbone with ``extract_layers`` (``{store name: qualname relative to the
  backbone}``) declares its list itself and wins over every rule here.
* **Any other model** (torchvision ViT/Swin/ConvNeXt/EfficientNet/MobileNet/RegNet/..., timm, Hugging
  Face, your own): ``block1..blockB`` are its *repeated blocks* (:func:`repeated_blocks`): the
  modules of one class that make up most of a ``Sequential``/``ModuleList`` (or most of a module's
  sub-modules, at least two), found from the root down; a stage found this way (a module holding one
  such container of blocks, like timm's ``ConvNeXtStage`` or Hugging Face's ``SwinStage``) is
  replaced by its blocks. This gives each residual block (ResNet, RegNet, MobileNet's inverted
  residuals, EfficientNet's MBConvs, ConvNeXt's CNBlocks), each transformer block (ViT, Swin, BERT,
  GPT-2, LLaMA), each dense block (DenseNet) and each Inception module (GoogLeNet). A model with none
  (VGG, AlexNet) gets every activation module's output instead (post-ReLU conv and fc layers).
* Always, last: ``pool`` and ``logits``. For ``train`` Networks and torchvision classifiers
  (``avgpool`` + ``fc``) ``pool`` is the global-average-pooled penultimate layer flattened to
  ``(N, M)`` and ``logits`` the final layer's output (other models with such attribute names take the
  generic rule). For any other model ``pool`` is the input of
  its final linear layer (:func:`head_module`: timm's ``get_classifier()``, a Hugging Face
  ``classifier``/``score``, else the last ``nn.Linear``) and ``logits`` the model's output (a tuple's
  first tensor; a dict/``ModelOutput``'s ``logits``). A model without a classification head
  (``AutoModel``, timm with ``num_classes=0``) has no ``logits``, and ``pool`` is its output
  (``last_hidden_state`` for a ``ModelOutput``). A model with several classifier heads on different
  inputs (timm's distilled DeiT: ``get_classifier()`` is a pair) has ``logits`` (its output) and no
  ``pool``: no one layer is its penultimate one (``--layers`` names the one wanted).

Models are either ``repsim.train.models.Network`` (``.backbone`` with ``fc`` replaced by ``Identity`` so
that ``backbone(x)`` is the penultimate ``(N, M)``, and ``.head``), torchvision classifiers
(``avgpool`` + ``fc``), or anything else by the generic rules. ``--layers`` also takes
module qualnames or globs over them (``encoder.layers.*``) for any module the registry does not list;
``repsim extract --list-layers`` prints both with their shapes.
"""
from __future__ import annotations

import collections
import fnmatch
from typing import Callable, Iterable

from torch import nn

INCEPTION_V3_BLOCKS = (
    "Mixed_5b", "Mixed_5c", "Mixed_5d",
    "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e",
    "Mixed_7a", "Mixed_7b", "Mixed_7c",
)

# Resolvers: backbone -> {store name: qualname relative to the backbone} for the blocks, or None.
_BlockResolver = Callable[[nn.Module], "dict[str, str] | None"]
_RESOLVERS: list[_BlockResolver] = []


def register_blocks(resolver: _BlockResolver) -> _BlockResolver:
    """Add a block resolver (tried before the built-in ones, most recently registered first)."""
    _RESOLVERS.insert(0, resolver)
    return resolver


def _declared(backbone: nn.Module) -> dict[str, str] | None:
    declared = getattr(backbone, "extract_layers", None)
    if declared is None:
        return None
    return dict(declared() if callable(declared) else declared)


def _resnet_blocks(backbone: nn.Module) -> dict[str, str] | None:
    stages = []
    i = 1
    while isinstance(getattr(backbone, f"layer{i}", None), nn.Sequential):
        stages.append(f"layer{i}")
        i += 1
    if not stages:
        return None
    out: dict[str, str] = {}
    for stage in stages:
        for child, _ in getattr(backbone, stage).named_children():
            out[f"block{len(out) + 1}"] = f"{stage}.{child}"
    return out


def _inception_blocks(backbone: nn.Module) -> dict[str, str] | None:
    if not all(isinstance(getattr(backbone, name, None), nn.Module) for name in INCEPTION_V3_BLOCKS):
        return None
    return {name: name for name in INCEPTION_V3_BLOCKS}


def _sequential_blocks(backbone: nn.Module) -> dict[str, str] | None:
    blocks = getattr(backbone, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        return None
    return {f"block{i + 1}": f"blocks.{name}" for i, (name, _) in enumerate(blocks.named_children())}


_CONTAINER_FORWARDS = (nn.Module.forward, nn.Sequential.forward, nn.ModuleList.forward, nn.ModuleDict.forward)


def _is_container(m: nn.Module) -> bool:
    """A plain Sequential/ModuleList/ModuleDict (a subclass with its own ``forward``, e.g. DenseNet's
    ``_DenseBlock``, is a block, not a container)."""
    return isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and type(m).forward in _CONTAINER_FORWARDS


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


def _majority_class(children: list[tuple[str, nn.Module]]) -> type | None:
    """The non-container class of more than half of the non-leaf ``children``, or None."""
    inner = [c for _, c in children if not _is_leaf(c)]
    if not inner:
        return None
    cls, count = collections.Counter(type(c) for c in inner).most_common(1)[0]
    first = next(c for c in inner if type(c) is cls)
    if _is_container(first) or 2 * count <= len(inner):
        return None
    return cls


def _stage_blocks(stage: nn.Module, prefix: str) -> list[str]:
    """The blocks of a stage: the children of its one container whose children are blocks, or []."""
    inner = [(n, c) for n, c in stage.named_children()
             if _is_container(c) and _majority_class(list(c.named_children())) is not None]
    if len(inner) != 1:
        return []
    name, box = inner[0]
    cls = _majority_class(list(box.named_children()))
    return [f"{prefix}{name}.{k}" for k, c in box.named_children() if type(c) is cls]


def repeated_blocks(module: nn.Module, prefix: str = "") -> list[str]:
    """Qualnames of the repeated blocks of ``module`` in definition order (see the module docstring)."""
    children = list(module.named_children())
    cls = _majority_class(children)
    if cls is not None and (_is_container(module) or sum(type(c) is cls for _, c in children) >= 2):
        out: list[str] = []
        for name, child in children:
            if type(child) is cls:
                out += _stage_blocks(child, f"{prefix}{name}.") or [prefix + name]
            else:
                out += repeated_blocks(child, f"{prefix}{name}.")
        return out
    return [q for name, child in children for q in repeated_blocks(child, f"{prefix}{name}.")]


_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.LeakyReLU, nn.ELU, nn.Tanh, nn.Sigmoid, nn.Mish)


def _generic_blocks(backbone: nn.Module) -> dict[str, str] | None:
    quals = repeated_blocks(backbone) or [q for q, m in backbone.named_modules() if isinstance(m, _ACTIVATIONS)]
    return {f"block{i + 1}": q for i, q in enumerate(quals)} if quals else None


_BUILTIN: tuple[_BlockResolver, ...] = (_declared, _inception_blocks, _resnet_blocks, _sequential_blocks, _generic_blocks)
# a model outside the classic split: its ``blocks`` may hold stages (timm EfficientNet, torchvision
# MaxViT), which the generic rule opens up
_BUILTIN_GENERIC: tuple[_BlockResolver, ...] = (_declared, _inception_blocks, _resnet_blocks, _generic_blocks)


def is_network(model: nn.Module) -> bool:
    """A ``train`` Network (its ``backbone(x)`` is the pooled, flattened penultimate layer; its ``head``
    the objective's final layer, which need not be linear: cosine softmax, logit normalisation)."""
    from repsim.train.models import Network

    return isinstance(model, Network)


def _classic_split(model: nn.Module) -> tuple[nn.Module, str, str, str] | None:
    """(backbone, prefix of backbone qualnames, pool qualname, logits qualname) for a ``train`` Network
    or a torchvision classifier with ``avgpool`` + ``fc`` (ResNet, Inception, GoogLeNet, ...), else
    None. Another model with such attribute names takes the generic rule: its ``backbone`` may return
    a map, and layers may sit between its ``avgpool`` and ``fc`` (an embedding), so neither need be its
    penultimate layer."""
    if is_network(model):
        return model.backbone, "backbone.", "backbone", "head"
    if (type(model).__module__.startswith("torchvision.models.")
            and isinstance(getattr(model, "avgpool", None), nn.Module) and isinstance(getattr(model, "fc", None), nn.Module)):
        return model, "", "avgpool", "fc"
    return None


def is_classic(model: nn.Module) -> bool:
    """True for a ``train`` Network or a torchvision classifier with ``avgpool`` + ``fc``."""
    return _classic_split(model) is not None


def model_layout(model: nn.Module) -> str:
    """``"NHWC"`` when the model's 4-D outputs are channels-last (timm's ``output_fmt``, which a
    ``module:`` model may set too; torchvision's Swin), else ``"NCHW"``."""
    fmt = getattr(model, "output_fmt", None)
    if isinstance(fmt, str) and fmt.upper() == "NHWC":
        return "NHWC"
    if type(model).__module__.startswith("torchvision.models.swin_transformer"):
        return "NHWC"
    return "NCHW"


def _qualname(model: nn.Module, module: nn.Module) -> str | None:
    return next((q for q, m in model.named_modules() if m is module), None)


def head_module(model: nn.Module) -> str | None:
    """Qualname of the final linear layer (the classifier), or None for a model without one.

    ``train`` Network: ``head``; ``avgpool`` + ``fc``: ``fc``; timm: ``get_classifier()`` (None when it
    is an ``Identity``); Hugging Face: its ``classifier``/``score`` (the last ``Linear`` inside), None
    for a base model; otherwise the last ``nn.Linear`` (or, without one, the last 1x1 ``Conv2d``, as
    in SqueezeNet) in definition order.
    """
    classic = _classic_split(model)
    if classic is not None:
        return classic[3]
    if callable(getattr(model, "get_classifier", None)) and hasattr(model, "pretrained_cfg"):  # timm
        head = model.get_classifier()
        return None if not isinstance(head, nn.Module) or isinstance(head, nn.Identity) else _qualname(model, head)
    if type(model).__module__.startswith("transformers."):
        head = next((getattr(model, a) for a in ("classifier", "score") if isinstance(getattr(model, a, None), nn.Module)), None)
        if head is None:
            return None
        linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
        return _qualname(model, linears[-1] if linears else head)
    linear = [q for q, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linear:
        return linear[-1]
    conv = [q for q, m in model.named_modules() if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1)]
    return conv[-1] if conv else None


def several_heads(model: nn.Module) -> bool:
    """A timm model whose ``get_classifier()`` is a tuple of heads on different inputs (distilled DeiT:
    the class token's and the distillation token's): its output is logits, and no one layer is its
    penultimate one."""
    if not (callable(getattr(model, "get_classifier", None)) and hasattr(model, "pretrained_cfg")):
        return False
    heads = model.get_classifier()
    return isinstance(heads, (tuple, list)) and sum(isinstance(h, nn.Linear) for h in heads) > 1


def _linear_text(model: nn.Module, qual: str) -> str:
    m = dict(model.named_modules()).get(qual)
    if isinstance(m, nn.Linear):
        return f"{qual!r} (Linear {m.in_features}->{m.out_features})"
    return repr(qual)


def describe_pool(model: nn.Module) -> str:
    """One line saying what ``pool`` and ``logits`` tap and by which rule (printed by extraction, so
    that a generic model's choice is never silent)."""
    classic = _classic_split(model)
    if classic is not None:
        return f"pool = output of {classic[2]!r} (flattened), logits = output of {classic[3]!r}"
    if several_heads(model):
        return ("no pool: the model has several classifier heads on different inputs (get_classifier() is "
                "a tuple), so no one layer is its penultimate one (name the one you want with --layers); "
                "logits = the model's output")
    head = head_module(model)
    if head is None:
        return "pool = the model's output (no classifier found), no logits"
    linears = [q for q, m in model.named_modules() if isinstance(m, nn.Linear)]
    rule = "the last nn.Linear in definition order" if linears and head == linears[-1] else "the model's classifier"
    return f"pool = input of {_linear_text(model, head)}, {rule}; logits = the model's output"


def head_mismatch(model: nn.Module, head: str, pool_dim: int | None, logits_dim: int | None) -> str:
    """The warning when ``head``'s weights do not map ``pool`` (its input) to the model's output: the
    layer taken for the classifier probably is not it, so ``pool`` is not the penultimate layer
    either. Names the layer and any Linear whose output width is the logits' (the likely classifier)."""
    others = [q for q, m in model.named_modules()
              if isinstance(m, nn.Linear) and q != head and logits_dim is not None and m.out_features == logits_dim]
    hint = (f"; {', '.join(_linear_text(model, q) for q in others)} has the logits' width: if it is the classifier, "
            f"extract its input with --layers and leave pool aside" if others else "")
    return (f"warning: the head check failed: {_linear_text(model, head)} does not map pool "
            f"({pool_dim}-d, its input) to the model's {logits_dim} outputs, so no head is stored and pool may "
            f"not be the penultimate layer{hint}")


def tap_module(tap: str) -> tuple[str, str]:
    """(module qualname, ``"output"`` | ``"input"``) of a registry tap."""
    qual, sep, where = tap.rpartition(":")
    return (qual, "input") if sep and where == "input" else (tap, "output")


def layer_modules(model: nn.Module) -> dict[str, str]:
    """``{store layer name: tap}`` for ``model``, in network order.

    Block names follow the registry described in this module's docstring; ``pool`` and ``logits``
    (when the model has a head) always come last.
    """
    classic = _classic_split(model)
    backbone, prefix = (classic[0], classic[1]) if classic else (model, "")
    blocks = None
    for resolver in (*_RESOLVERS, *(_BUILTIN if classic else _BUILTIN_GENERIC)):
        blocks = resolver(backbone)
        if blocks is not None:
            break
    out = {name: prefix + qual for name, qual in (blocks or {}).items()}
    if "pool" in out or "logits" in out:
        raise ValueError("extract: block names 'pool' and 'logits' are reserved")
    if classic is not None:
        out["pool"], out["logits"] = classic[2], classic[3]
    elif several_heads(model):
        out["logits"] = ""
    else:
        head = head_module(model)
        if head is None:
            out["pool"] = ""
        else:
            out["pool"], out["logits"] = f"{head}:input", ""
    names = dict(model.named_modules())
    missing = [t for t in out.values() if tap_module(t)[0] not in names]
    if missing:
        raise ValueError(f"extract: registry names modules that {type(model).__name__} lacks: {missing}")
    return out


def select_layers(available: dict[str, str], requested: str | list[str] | None,
                  modules: Iterable[str] = ()) -> dict[str, str]:
    """Subset of ``available`` in registry order, plus module qualnames. ``requested``: names or fnmatch
    patterns (``"block1,block16,pool"``, ``"block*"``), a comma-separated string or a list; None =
    all. A pattern that matches no store layer name is matched against ``modules`` (the model's
    module qualnames): each hit becomes a store layer named by its qualname (its output)."""
    if requested is None:
        return dict(available)
    if isinstance(requested, str):
        requested = [r for r in requested.split(",")]
    patterns = [r.strip() for r in requested if r.strip()]
    if not patterns:
        raise ValueError("extract: --layers is empty")
    modules = [q for q in modules if q]
    chosen: set[str] = set()
    extra: set[str] = set()
    for pattern in patterns:
        hits = fnmatch.filter(available, pattern)
        if hits:
            chosen.update(hits)
            continue
        quals = fnmatch.filter(modules, pattern)
        if not quals:
            raise ValueError(
                f"extract: unknown layer {pattern!r}; available layers: {', '.join(available)}"
                + (" (or module qualnames and globs over them: repsim extract --list-layers)" if modules else "")
            )
        extra.update(quals)
    out = {name: tap for name, tap in available.items() if name in chosen}
    out.update({q: q for q in modules if q in extra and q not in out})
    return out
