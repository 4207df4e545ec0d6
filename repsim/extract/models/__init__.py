"""Model sources: where a model comes from, what its inputs must look like, and its provenance.

A source is a string (``repsim extract --checkpoint SPEC``, ``extract_store(SPEC, ...)``) or an
``nn.Module`` passed from Python:

==========================================================  ===========================================
``path/to/checkpoint.pt``                                   a ``train`` checkpoint (repsim/extract/sources.py)
``torchvision:<name>[:<weights>]``                          torchvision classifiers (torchvision_source)
``timm:<name>[:pretrained]``                                timm models, ``repsim-toolkit[timm]`` (timm_source)
``hf:<model id or local dir>``                              Hugging Face vision/text encoders,
                                                            ``repsim-toolkit[hf]`` (hf_source)
``module:<package.module>:<factory>[:<state dict path>]``   any ``nn.Module`` (module_source)
==========================================================  ===========================================

Without weights named, torchvision/timm/module/hf models get seeded random weights (the same on every
run with one ``seed``, ``repsim extract --seed``); nothing is downloaded unless weights are asked for, and then only by the library's own loader.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from ..specs import SOURCES, is_model_spec
from .common import LoadedModel, Preprocess, clean, infer_input

__all__ = ["LoadedModel", "Preprocess", "SOURCES", "is_model_spec", "load_spec", "from_module"]


def load_spec(spec: str, *, seed: int = 0) -> LoadedModel:
    """Build the model a ``prefix:...`` spec names; random weights (no weights named) are drawn under
    ``seed`` (recorded as the model's ``seed`` and in its ``init``)."""
    for prefix, module in SOURCES.items():
        if spec.startswith(prefix):
            return import_module(f"{__name__}.{module}").load(spec, seed=seed)
    raise ValueError(f"extract: unknown model source {spec!r}; use one of {', '.join(SOURCES)} or a checkpoint path")


def from_module(model, meta: dict[str, Any]) -> LoadedModel:
    """A ``LoadedModel`` for an ``nn.Module`` built elsewhere (Python, a ``train`` checkpoint)."""
    return LoadedModel(model.eval(), clean(meta), **infer_input(model))
