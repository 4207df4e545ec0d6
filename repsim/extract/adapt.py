"""Data meets the model: a dataset's images made into what the model takes, recorded in provenance.

Rules, in order (the result goes into the store's ``dataset.transform``, so a resume with other
adaptation is refused):

1. Text rows (token dicts) and a model that takes the images as they are: nothing changes.
2. **The model's own preprocessing** (torchvision weights' ``transforms()``, timm's data config with
   ``:pretrained``, a Hugging Face image processor) replaces the dataset's transform when weights are
   loaded and the dataset can give raw images (``ImageFolder``/torchvision datasets built by
   ``repsim.train.data``, or any dataset whose ``transform`` can be unset to yield PIL images): each image
   is converted to the model's PIL mode (``RGB`` for 3 channels: a grayscale image is repeated) and
   then goes through the model's transform (resize, crop, normalisation).
3. **Otherwise** the dataset's tensors (already normalised by the dataset, e.g. digits) are adapted by
   the documented default: a 1-channel image is repeated to 3 channels (a 3-channel image averaged
   to 1 for a 1-channel model); the image is resized (bilinear, antialiased) to ``image_size`` when
   given (``--image-size``), else to the model's input size when the model takes only that size
   (ViT, timm models with ``fixed_input_size``, Hugging Face vision configs) or when the image is
   smaller than the smallest input the weights' metadata allows (torchvision ``min_size``, e.g.
   Inception's 75 px). A model that accepts any size (ResNet, ConvNeXt, ...) sees the dataset's size.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from .models import LoadedModel


class ChannelRepeat:
    """(1, H, W) -> (C, H, W) by repetition."""

    def __init__(self, channels: int):
        self.channels = channels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(self.channels, *x.shape[1:]).contiguous()


class ChannelMean:
    """(C, H, W) -> (1, H, W) by averaging the channels."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=0, keepdim=True)


class Resize:
    """(C, h, w) -> (C, size, size), bilinear with antialiasing (a no-op at that size)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) == (self.size, self.size):
            return x
        return F.interpolate(x[None].float(), size=(self.size, self.size), mode="bilinear",
                             align_corners=False, antialias=True)[0].to(x.dtype)


class PILMode:
    """A PIL image in ``mode`` (``RGB`` repeats a grayscale image), for a model's own transform."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, image: Any) -> Any:
        return image if image.mode == self.mode else image.convert(self.mode)


class Chain:
    """Callables applied in order (picklable, unlike a lambda, for DataLoader workers)."""

    def __init__(self, *steps: Any):
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class AdaptedDataset(torch.utils.data.Dataset):
    """``dataset`` with ``fn`` applied to each input; every other attribute is the dataset's."""

    def __init__(self, dataset: Any, fn: Chain, desc: str):
        self.dataset, self.fn, self.transform_desc = dataset, fn, desc

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        x, y = self.dataset[i]
        return self.fn(x), y

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "fn", "transform_desc"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _raw_images(dataset: Any) -> Any | None:
    """A shallow copy of ``dataset`` without its transform when that yields PIL images, else None."""
    if not hasattr(dataset, "transform") or len(dataset) == 0:
        return None
    try:
        from PIL import Image
    except ModuleNotFoundError:  # pragma: no cover - torchvision depends on Pillow
        return None
    raw = copy.copy(dataset)
    try:
        raw.transform = None
        item = raw[0][0]
    except Exception:  # noqa: BLE001 - a dataset that cannot run without its transform keeps it
        return None
    return raw if isinstance(item, Image.Image) else None


def adapt_dataset(dataset: Any, dmeta: dict[str, Any], loaded: LoadedModel,
                  image_size: int | None = None) -> tuple[Any, dict[str, Any]]:
    """(dataset as the model takes it, ``dmeta`` with the adaptation added to ``transform``)."""
    if image_size is not None and image_size < 1:
        raise ValueError(f"extract: --image-size must be >= 1, got {image_size}")
    if len(dataset) == 0:
        return dataset, dmeta
    x0 = dataset[0][0]
    if isinstance(x0, dict):
        if loaded.tokenizer is None and loaded.channels is not None:
            raise ValueError("extract: the dataset yields token dicts but the model takes images")
        return dataset, dmeta
    if loaded.tokenizer is not None:
        raise ValueError("extract: the model is a text model; --data must be a .txt, .csv or .tsv file")
    old = dmeta.get("transform") or "none"
    if loaded.preprocess is not None:
        raw = _raw_images(dataset)
        if raw is not None:  # the model's own preprocessing (normalisation included); --image-size rescales its output
            steps = [PILMode(loaded.preprocess.mode), loaded.preprocess.transform]
            desc = f"model preprocessing: {loaded.preprocess.mode}; {loaded.preprocess.desc}"
            if image_size is not None:
                steps.append(Resize(int(image_size)))
                desc += f"; then resize to {image_size}x{image_size} (--image-size; bilinear, antialias)"
            raw.transform = Chain(*steps)
            desc += f" (replaces the dataset's: {old})"
            raw.transform_desc = desc
            return raw, {**dmeta, "transform": desc}
    if not isinstance(x0, torch.Tensor) or x0.ndim != 3:
        return dataset, dmeta  # extraction names what it needs (a (C, H, W) tensor per example)
    steps: list[Any] = []
    notes: list[str] = []
    c, (h, w) = int(x0.shape[0]), tuple(int(s) for s in x0.shape[-2:])
    want = loaded.channels
    if want is not None and c != want:
        if c == 1:
            steps.append(ChannelRepeat(want))
            notes.append(f"{c} -> {want} channels (repeat)")
        elif want == 1 and c == 3:
            steps.append(ChannelMean())
            notes.append("3 -> 1 channel (mean)")
        else:
            raise ValueError(f"extract: the dataset's images have {c} channels and the model takes {want}")
    target = image_size
    if target is None and loaded.fixed_size and loaded.input_size:
        target = loaded.input_size
    if target is None and loaded.min_size and min(h, w) < loaded.min_size:
        target = loaded.input_size or loaded.min_size
    if target is not None and (h, w) != (target, target):
        steps.append(Resize(int(target)))
        notes.append(f"resize {h}x{w} -> {target}x{target} (bilinear, antialias)")
    if not steps:
        return dataset, dmeta
    desc = f"{old}; adapt: {', '.join(notes)}"
    return AdaptedDataset(dataset, Chain(*steps), desc), {**dmeta, "transform": desc}
