"""Per-block activation extraction into Zarr v3 stores (the torch side of repsim).

Public names (imported lazily, so ``import extract`` does not import torch):

- ``extract_store(model_or_checkpoint, data, out, *, split=None, layers=None, spatial="flatten",
  dtype="float16", batch_size=128, ...) -> repsim.ActivationStore``
- ``layer_modules(model) -> {store layer name: module qualname}``
- ``select_layers``, ``register_blocks``, ``ExtractError``
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "extract_store": "pipeline",
    "ExtractError": "pipeline",
    "layer_modules": "layers",
    "select_layers": "layers",
    "register_blocks": "layers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'extract' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
