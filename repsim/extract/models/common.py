"""What every model source returns (:class:`LoadedModel`), and the helpers they share."""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

RANDOM_INIT_SEED = 0  # random-init models are built under this seed, so a rerun builds the same weights
_SEEDED = threading.RLock()  # one seeded build at a time: torch's CPU generator is one per process


@dataclass(frozen=True)
class Preprocess:
    """A model's own image preprocessing (its weights' transform): ``transform(PIL image) -> (C, H, W)``.

    ``mode`` is the PIL mode the transform expects (``"RGB"`` or ``"L"``); ``desc`` goes into the
    store's ``dataset.transform``.
    """

    transform: Callable[[Any], torch.Tensor]
    desc: str
    mode: str = "RGB"


@dataclass
class LoadedModel:
    """A model in eval mode with what the store records about it and what its inputs must look like.

    ``meta``: the store's ``attrs["model"]``. ``preprocess``: the weights' own transform for raw
    images, or None. ``channels``: input channels (None: unknown). ``input_size``: the image size the
    weights/config are made for, the resize target when one is needed; ``fixed_size``: the model
    takes no other size (ViT); ``min_size``: the smallest side it accepts (torchvision's weight
    metadata). ``tokenizer``: a text model's tokenizer (Hugging Face), else None.
    """

    model: nn.Module
    meta: dict[str, Any]
    preprocess: Preprocess | None = None
    channels: int | None = None
    input_size: int | None = None
    fixed_size: bool = False
    min_size: int | None = None
    tokenizer: Any = None


def clean(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without its None values (attrs keep only what is known)."""
    return {k: v for k, v in d.items() if v is not None}


def weights_sha256(model: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, raw bytes): the identity of an in-memory
    model, so that a resumed store never mixes two models' rows."""
    h = hashlib.sha256()
    state = [(name, t.detach()) for name, t in model.state_dict().items()]
    on_device = [t for _, t in state if t.device.type != "cpu" and t.numel()]
    # one copy to pinned host memory for the device tensors (not one synchronised pageable copy per
    # tensor: 55 ms for ResNet-50's 100 MB on an H100, against the hash's own 70 ms)
    flat = None
    if on_device:
        packed = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in on_device])
        flat = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=packed.device.type == "cuda")
        flat.copy_(packed)
    off = 0
    for name, t in state:
        h.update(f"{name}|{t.dtype}|{t.numel()}|".encode())
        if t.device.type != "cpu" and t.numel():
            nbytes = t.numel() * t.element_size()
            h.update(flat[off:off + nbytes].numpy())
            off += nbytes
        else:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no bytes copy
    return h.hexdigest()


@contextmanager
def seeded(seed: int = RANDOM_INIT_SEED) -> Iterator[None]:
    """Build random-init weights under a fixed seed without touching the caller's RNG state. Builds
    in several threads (``repsim extract --job-mode threads``) take turns: torch's CPU generator is
    shared by the process, and two interleaved builds would draw each other's numbers."""
    with _SEEDED, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def first_conv_channels(model: nn.Module) -> int | None:
    """Input channels of the first ``Conv2d`` in definition order (the stem), or None."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return int(m.in_channels)
    return None


def side(size: Any) -> int | None:
    """One image side from an int, an (h, w) pair or a (c, h, w) triple (the larger side), or None."""
    if size is None:
        return None
    if isinstance(size, (int, float)):
        return int(size)
    vals = [int(s) for s in size]
    return max(vals[-2:]) if vals else None


def infer_input(model: nn.Module) -> dict[str, Any]:
    """What a module says about its input, for models built outside a source (``module:``, Python):
    ``channels`` (the stem conv), ``input_size`` and ``fixed_size`` from torchvision's
    ``VisionTransformer.image_size``, timm's ``pretrained_cfg`` or a Hugging Face vision config."""
    out: dict[str, Any] = {"channels": first_conv_channels(model), "input_size": None, "fixed_size": False}
    cfg = getattr(model, "pretrained_cfg", None)  # timm
    config = getattr(model, "config", None)  # transformers (train's Network has a dict config)
    if isinstance(getattr(model, "image_size", None), int):  # torchvision VisionTransformer
        out.update(input_size=model.image_size, fixed_size=True)
    elif isinstance(cfg, dict) and cfg.get("input_size"):
        out.update(input_size=side(cfg["input_size"]), fixed_size=bool(cfg.get("fixed_input_size")))
    elif config is not None and not isinstance(config, dict) and getattr(config, "image_size", None):
        out.update(input_size=side(config.image_size), fixed_size=True)
    return out
