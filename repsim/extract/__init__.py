"""Per-block activation extraction into Zarr v3 stores (the torch side of repsim).

Public names (imported lazily, so ``import extract`` does not import torch):

- ``extract_store(model_or_checkpoint, data, out, *, split=None, layers=None, spatial="flatten",
  dtype="float16", batch_size=128, ...) -> repsim.ActivationStore``
- ``layer_modules(model) -> {store layer name: module qualname}``
- ``select_layers``, ``register_blocks``, ``ExtractError``
"""
from __future__ import annotations

from repsim.lazy import lazy_exports

_EXPORTS = {
    "extract_store": "pipeline",
    "ExtractError": "pipeline",
    "layer_modules": "layers",
    "select_layers": "layers",
    "register_blocks": "layers",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
