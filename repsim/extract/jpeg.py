"""JPEG image folders decoded on the GPU (nvJPEG, through ``torchvision.io.decode_jpeg(device="cuda")``).

An ImageFolder split (``repsim.train.data``) decodes and resizes every image with PIL in DataLoader
workers: on a GPU that is the whole cost of extraction (bench/RESULTS.md "extract_throughput_gpu":
the DataLoader row runs at 0.19x the forward; nvJPEG decodes 31,168 img/s where 8 CPU threads
decode 15,013). On this route the workers only read each file's bytes; each batch is decoded by one
batched nvJPEG call on the device, and the split's evaluation transform runs there on tensors:
``Resize(s)`` (bilinear, antialiased, on the short side, as ``torchvision.transforms.Resize``),
``CenterCrop(c)``, scale to [0, 1] and ``Normalize(mean, std)``.

:func:`choose` decides, for a dataset and a device, whether the route applies (every reason it does
not is a line, tested without a GPU): the device is CUDA; the dataset (possibly in the store's
shuffled row order) is an ImageFolder split whose loader is the plain PIL one and whose transform
is the evaluation one (resize, centre crop, ``ToTensor``, ``Normalize``: nothing random, no
model-specific preprocessing); every file is named ``.jpg``/``.jpeg``; torchvision's
``decode_jpeg`` takes a device; and ``REPSIM_NVJPEG=1`` is set. Otherwise the DataLoader decodes on
the CPU as before. The route is opt-in: on its first GPU run (H200, 2026-11-28) the workers' tensor
hand-off failed ("Bad file descriptor"; they now hand NumPy bytes on) and nvJPEG differed from
libjpeg-turbo by 5.3 levels of 255 on average on bench/gpu.py's generated noise JPEGs (at most 35),
more than this module assumed; it becomes the default once a GPU run measures it end to end.

The values differ from PIL's by the decoders' rounding (nvJPEG's IDCT and chroma upsampling against
libjpeg-turbo's: a few levels of 255 on some pixels) and the resize's (PIL's antialiased bilinear
against torch's), so the store records the route in ``dataset.transform`` (a resume never mixes
the two); :func:`decode_batch` runs the same tensor steps on the CPU (``device="cpu"``), which the
tests hold against the PIL route, and bench/gpu.py holds the GPU's against the CPU's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

JPEG_SUFFIXES = (".jpg", ".jpeg")
ROUTE_NOTE = "JPEG decoded on the GPU (nvJPEG), resize/crop/normalise on tensors"


@dataclass(frozen=True)
class TensorTransform:
    """The evaluation transform of an ImageFolder split, as tensor steps: ``resize`` (short side,
    None: none), ``crop`` (centre, None: none), then ``/255`` and ``(x - mean) / std``; then
    ``adapt``, extraction's adaptation of the images to the model (repsim/extract/adapt.py's channel
    repeat/mean and resize, tensor steps on each image), if any."""

    resize: int | None
    crop: int | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    adapt: Any = None

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        """``(3, h_i, w_i)`` uint8 images (one device) -> one ``(N, 3, H, W)`` float32 batch."""
        from torchvision.transforms.v2 import functional as TF

        out = []
        for x in images:
            if self.resize is not None:
                x = TF.resize(x, [self.resize], antialias=True)
            if self.crop is not None:
                x = TF.center_crop(x, [self.crop, self.crop])
            out.append(x)
        batch = torch.stack(out).float().div_(255.0)
        mean = torch.tensor(self.mean, device=batch.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=batch.device).view(1, -1, 1, 1)
        batch = batch.sub_(mean).div_(std)
        return batch if self.adapt is None else torch.stack([self.adapt(x) for x in batch])


def tensor_transform(transform: Any) -> TensorTransform | str:
    """The :class:`TensorTransform` of a ``torchvision.transforms.Compose`` made of ``Resize(int)``,
    ``CenterCrop``, ``ToTensor`` and ``Normalize`` (repsim.train.imaging's evaluation transform), else why not."""
    from torchvision import transforms as T

    steps = list(getattr(transform, "transforms", []))
    kinds = [type(s) for s in steps]
    if not steps or kinds[-2:] != [T.ToTensor, T.Normalize]:
        return "its transform does not end in ToTensor + Normalize"
    resize = crop = None
    for s in steps[:-2]:
        if isinstance(s, T.Resize) and resize is None and crop is None:
            size = s.size if isinstance(s.size, int) else (s.size[0] if len(s.size) == 1 else None)
            if size is None or s.interpolation != T.InterpolationMode.BILINEAR or s.max_size is not None:
                return "its Resize is not a bilinear short-side resize"
            resize = int(size)
        elif isinstance(s, T.CenterCrop) and crop is None:
            h, w = s.size
            if h != w:
                return "its CenterCrop is not square"
            crop = int(h)
        else:
            return f"its transform has a {type(s).__name__} step (only Resize, CenterCrop, ToTensor, Normalize)"
    norm = steps[-1]
    return TensorTransform(resize, crop, tuple(float(v) for v in norm.mean), tuple(float(v) for v in norm.std))


def _image_folder_split(dataset: Any) -> tuple[Any, np.ndarray | None, Any] | None:
    """(the ImageFolder split, the row permutation or None, the adaptation to the model or None)
    under the store's row order and extraction's adaptation (repsim/extract/adapt.py), else None."""
    from repsim.train.data import SplitDataset, pil_loader

    from .adapt import AdaptedDataset

    perm = adapt = None
    if hasattr(dataset, "perm") and hasattr(dataset, "dataset"):  # repsim.extract.pipeline's reordered rows
        dataset, perm = dataset.dataset, np.asarray(dataset.perm)
    if isinstance(dataset, AdaptedDataset):  # tensor steps on each (C, H, W) image: they run on the device too
        dataset, adapt = dataset.dataset, dataset.fn
    if not isinstance(dataset, SplitDataset) or dataset.loader is not pil_loader:
        return None
    from torchvision.datasets import ImageFolder

    if not isinstance(dataset.base, ImageFolder):
        return None
    return dataset, perm, adapt


def decode_on_device_available() -> bool:
    """Whether this torchvision's ``decode_jpeg`` takes a list and a device (0.19 and later)."""
    import inspect

    from torchvision.io import decode_jpeg

    return "device" in inspect.signature(decode_jpeg).parameters


def choose(dataset: Any, device: torch.device | str, *, available: bool | None = None) -> tuple[TensorTransform | None, str]:
    """(the tensor transform, a line saying so) when ``dataset`` is decoded on the GPU on ``device``,
    else (None, why not). ``available``: whether decoding on a device is possible here (default: this
    torchvision's ``decode_jpeg`` takes one)."""
    dev = torch.device(device)
    if os.environ.get("REPSIM_NVJPEG", "0") != "1":  # opt-in until measured end to end (module doc)
        return None, "the nvJPEG route is opt-in (REPSIM_NVJPEG=1)"
    if dev.type != "cuda":
        return None, f"the device is {dev.type}, not cuda"
    found = _image_folder_split(dataset)
    if found is None:
        return None, "the dataset is not an ImageFolder split with its plain image loader"
    split, _, adapt = found
    tf = tensor_transform(split.transform)
    if isinstance(tf, str):
        return None, tf
    tf = TensorTransform(tf.resize, tf.crop, tf.mean, tf.std, adapt)
    bad = next((p for p, _ in split.base.samples if not p.lower().endswith(JPEG_SUFFIXES)), None)
    if bad is not None:
        return None, f"not every file is a JPEG ({os.path.basename(bad)})"
    if not (decode_on_device_available() if available is None else available):
        return None, "this torchvision's decode_jpeg takes no device (0.19 or later does)"
    return tf, f"{ROUTE_NOTE}: {len(split)} images"


class JpegBytes(torch.utils.data.Dataset):
    """Row ``i``'s file bytes (a uint8 NumPy array) and label, in the store's row order: what DataLoader
    workers read for the GPU decoder (no decoding, no transform on the CPU). NumPy, not a tensor: a
    worker's tensors reach the main process through shared-memory file descriptors, which ran out
    ("Bad file descriptor", H200 2026-11-28) with one small tensor per image; arrays are pickled whole."""

    def __init__(self, dataset: Any):
        found = _image_folder_split(dataset)
        if found is None:
            raise ValueError("extract: the JPEG route needs an ImageFolder split")
        self.split, self.perm, _ = found

    def __len__(self) -> int:
        return len(self.split) if self.perm is None else len(self.perm)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        j = int(i if self.perm is None else self.perm[i])
        path, _ = self.split.base.samples[int(self.split.indices[j])]
        return np.fromfile(path, dtype=np.uint8), int(self.split.targets[j])


def _collate(items: list[tuple[np.ndarray, int]]) -> tuple[list[np.ndarray], np.ndarray]:
    return [b for b, _ in items], np.asarray([y for _, y in items])


def decode_batch(blobs: list[Any], transform: TensorTransform, device: torch.device | str) -> torch.Tensor:
    """One batch of JPEG files' bytes (uint8 arrays or tensors) decoded (RGB, as ImageFolder's loader
    converts every image) on ``device`` (CUDA: one batched nvJPEG call) and transformed there:
    ``(N, 3, H, W)`` float32."""
    from torchvision.io import ImageReadMode, decode_jpeg

    blobs = [b if isinstance(b, torch.Tensor) else torch.from_numpy(b) for b in blobs]
    dev = torch.device(device)
    if dev.type == "cuda":
        images = decode_jpeg(blobs, mode=ImageReadMode.RGB, device=dev)
    else:
        images = [decode_jpeg(b, mode=ImageReadMode.RGB) for b in blobs]
    return transform(images)


def feed(dataset: Any, transform: TensorTransform, spans: list[tuple[int, int]], device: torch.device,
         workers: int, channels_last: bool, spawn: bool = False) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """``(inputs on device, labels)`` per row span: workers read the files, the device decodes them
    (``spawn``: the workers are spawned, not forked — extractions running as threads of one process)."""
    from torch.utils.data import DataLoader

    from .inputs import in_memory_format

    loader = DataLoader(JpegBytes(dataset), batch_sampler=[list(range(lo, hi)) for lo, hi in spans],
                        num_workers=workers, collate_fn=_collate, generator=torch.Generator(),
                        multiprocessing_context="spawn" if workers and spawn else None)
    for blobs, labels in loader:
        yield in_memory_format(decode_batch(blobs, transform, device), channels_last), labels

