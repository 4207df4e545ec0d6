"""Training under the nine objectives of Kornblith et al. (2021). Uses torch.

Public names (imported lazily so that ``repsim --help`` never imports torch):
``load_model`` (checkpoint → :class:`repsim.train.models.Network` in eval mode, EMA weights),
``build_network``, ``Network``, ``make_objective``, ``OBJECTIVES``, ``build_dataset``,
``load_config``, ``list_presets``, ``train_run`` (the training loop).
"""
from __future__ import annotations

from repsim.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "load_model": "checkpoint",
    "load_checkpoint": "checkpoint",
    "build_network": "models",
    "Network": "models",
    "make_objective": "objectives",
    "OBJECTIVES": "objectives",
    "build_dataset": "data",
    "dataset_from_config": "data",
    "load_config": "config",
    "list_presets": "config",
    "train_run": "loop",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
