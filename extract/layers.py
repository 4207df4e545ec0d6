"""Layer registry: which modules' outputs become which store layers, per architecture.

``layer_modules(model)`` returns ``{store layer name: module qualname}`` in network order. The
store layer's value for an example is the output of that module in ``model.forward``:

* **ResNet-style** (torchvision ResNet, the small ResNets and WRNs of ``train.models``: any
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
* Always, last: ``pool`` (penultimate features after global average pooling, flattened to
  ``(N, M)``) and ``logits`` (``(N, K)``, the model's output).

Models are either ``train.models.Network`` (``.backbone`` with ``fc`` replaced by ``Identity`` so
that ``backbone(x)`` is the penultimate ``(N, M)``, and ``.head``) or plain torchvision
classifiers (``avgpool`` + ``fc``).
"""
from __future__ import annotations

import fnmatch
from typing import Callable

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


_BUILTIN: tuple[_BlockResolver, ...] = (_declared, _inception_blocks, _resnet_blocks, _sequential_blocks)


def _split(model: nn.Module) -> tuple[nn.Module, str, str, str]:
    """(backbone, prefix of backbone qualnames, pool qualname, logits qualname)."""
    backbone = getattr(model, "backbone", None)
    head = getattr(model, "head", None)
    if isinstance(backbone, nn.Module) and isinstance(head, nn.Module):
        # train.models.Network: backbone(x) is already the pooled, flattened penultimate layer.
        return backbone, "backbone.", "backbone", "head"
    if isinstance(getattr(model, "avgpool", None), nn.Module) and isinstance(getattr(model, "fc", None), nn.Module):
        return model, "", "avgpool", "fc"
    raise ValueError(
        f"extract: cannot find the penultimate and final layers of {type(model).__name__}: expected a "
        "train.models.Network (.backbone, .head) or a torchvision-style classifier (.avgpool, .fc)"
    )


def layer_modules(model: nn.Module) -> dict[str, str]:
    """``{store layer name: module qualname}`` for ``model``, in network order.

    Block names follow the registry described in this module's docstring; ``pool`` and ``logits``
    always come last. Raises ``ValueError`` when the architecture is not recognised.
    """
    backbone, prefix, pool, logits = _split(model)
    blocks = None
    for resolver in (*_RESOLVERS, *_BUILTIN):
        blocks = resolver(backbone)
        if blocks is not None:
            break
    if blocks is None:
        raise ValueError(
            f"extract: no layer registry entry for backbone {type(backbone).__name__}; give it "
            "layer1..layerN stages, a `blocks` Sequential, or an `extract_layers` mapping, or call "
            "extract.layers.register_blocks"
        )
    out = {name: prefix + qual for name, qual in blocks.items()}
    if "pool" in out or "logits" in out:
        raise ValueError("extract: block names 'pool' and 'logits' are reserved")
    out["pool"] = pool
    out["logits"] = logits
    names = dict(model.named_modules())
    missing = [q for q in out.values() if q not in names]
    if missing:
        raise ValueError(f"extract: registry names modules that {type(model).__name__} lacks: {missing}")
    return out


def select_layers(available: dict[str, str], requested: str | list[str] | None) -> dict[str, str]:
    """Subset of ``available`` in registry order. ``requested``: names or fnmatch patterns
    (``"block1,block16,pool"``, ``"block*"``), a comma-separated string or a list; None = all."""
    if requested is None:
        return dict(available)
    if isinstance(requested, str):
        requested = [r for r in requested.split(",")]
    patterns = [r.strip() for r in requested if r.strip()]
    if not patterns:
        raise ValueError("extract: --layers is empty")
    chosen = set()
    for pattern in patterns:
        hits = fnmatch.filter(available, pattern)
        if not hits:
            raise ValueError(
                f"extract: unknown layer {pattern!r}; available layers: {', '.join(available)}"
            )
        chosen.update(hits)
    return {name: qual for name, qual in available.items() if name in chosen}
