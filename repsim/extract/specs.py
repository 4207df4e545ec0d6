"""Model source prefixes (torch-free, so the ``repsim`` command line can tell a source from a path
without importing torch). repsim/extract/models builds the models."""
from __future__ import annotations

from typing import Any

# prefix -> module of repsim.extract.models whose ``load(spec)`` builds the model
SOURCES: dict[str, str] = {
    "torchvision:": "torchvision_source",
    "timm:": "timm_source",
    "hf:": "hf_source",
    "module:": "module_source",
}


def is_model_spec(spec: Any) -> bool:
    """True for a ``prefix:...`` model source (not a checkpoint path)."""
    return isinstance(spec, str) and spec.startswith(tuple(SOURCES))
