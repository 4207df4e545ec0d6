"""One batch of model inputs: an image tensor ``(N, C, H, W)`` or a dict of token tensors (text).

The pipeline moves, probes and feeds both kinds through these helpers, so everything else handles a
batch without knowing which it is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

def is_text(x: Any) -> bool:
    """True for a dict of token tensors (``input_ids``, ``attention_mask``, ...)."""
    return isinstance(x, dict)


def check_example(x: Any) -> None:
    """Refuse an example that is neither a tensor nor a dict of tensors (naming what it was)."""
    ok = isinstance(x, torch.Tensor) or (isinstance(x, dict) and x and all(isinstance(v, torch.Tensor) for v in x.values()))
    if not ok:
        raise ValueError(f"extract: the dataset must yield (tensor or dict of tensors, label), got {type(x).__name__}")


def batch_of_one(x: Any) -> Any:
    """A single example as a batch of one."""
    return {k: v.unsqueeze(0) for k, v in x.items()} if is_text(x) else x.unsqueeze(0)


def to_device(x: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if is_text(x):
        return {k: v.to(device, non_blocking=non_blocking) for k, v in x.items()}
    return x.to(device, non_blocking=non_blocking)


def in_memory_format(x: Any, channels_last: bool) -> Any:
    """An image batch ``(N, C, H, W)`` in channels-last memory (NHWC strides, same shape and values)
    when ``channels_last``; anything else unchanged."""
    if channels_last and isinstance(x, torch.Tensor) and x.ndim == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def forward(model: nn.Module, x: Any) -> Any:
    """``model(**x)`` for token dicts, ``model(x)`` for images."""
    return model(**x) if is_text(x) else model(x)


def attention_mask(x: Any) -> torch.Tensor | None:
    """The batch's attention mask (text), or None."""
    return x.get("attention_mask") if is_text(x) else None


def shape_of(x: Any) -> str:
    """A batch's shape for messages: ``(1, 3, 224, 224)`` or ``input_ids (1, 128)``."""
    if is_text(x):
        return ", ".join(f"{k} {tuple(v.shape)}" for k, v in x.items())
    return str(tuple(x.shape))


def default_tokens(x: Any) -> str:
    """The token reduction when none is asked for: ``mean`` over real tokens for text (sentence
    embeddings, Reimers & Gurevych 2019), ``flatten`` for images (every token kept, as conv maps keep
    every position under ``--spatial flatten``, the convention of Kornblith et al. 2019)."""
    return "mean" if is_text(x) else "flatten"
