"""In-memory image sources: batches sliced from one host tensor, without DataLoader workers.

A DataLoader ships every batch from worker processes through shared memory and a pinning thread
(~150 MB per batch of 256 float32 224 px images), which on a GPU caps extraction far below the
model's forward. When the images already sit in one tensor, none of that is needed:

* :class:`ImageTensor` — a dataset of images held as one ``(N, C, H, W)`` or ``(N, H, W, C)``
  tensor, ``uint8`` (scaled to [0, 1] and normalised with ``mean``/``std`` *on the device*, so a
  quarter of the bytes cross the bus) or floating (normalised when ``mean``/``std`` are given).
  ``extract`` builds one for ``--data images.npy`` / ``.npz``, recognises a
  ``torch.utils.data.TensorDataset`` of float images (:func:`as_image_tensor`), and
  :meth:`ImageTensor.from_dataset` materialises any dataset of ``(C, H, W)`` tensors.
* :class:`MemoryFeed` — the batches of one extraction from such a source. On CUDA a gather thread
  copies each batch's rows (a slice, or the store's shuffled row order) into one of ``depth`` pinned
  staging buffers; the main thread then issues the host-to-device copy, the uint8 -> float
  normalisation and the channels-last layout on a side stream **one batch ahead** of the forward,
  so the copy (copy engine) and the normalisation overlap the previous batch's forward pass (compute
  stream), and the gather (host memory bandwidth) overlaps both. On the CPU batches are sliced and
  normalised in place, no thread.

Every value equals what ``dataset[i]`` yields (the same elementwise operations on a batch as on one
example), so a store written through this path is bit-identical to one written through a DataLoader.
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generator, Sequence

import numpy as np
import torch

from repsim.fileio import sha256_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("NCHW", "NHWC")


class ImageTensor(torch.utils.data.Dataset):
    """Images in one host tensor (``layout`` ``NCHW`` or ``NHWC``) with their labels.

    ``dataset[i]`` (and :meth:`prepare` on a batch) gives a float ``(C, H, W)`` image: ``uint8``
    pixels become ``(x / 255 - mean) / std`` (mean/std default to ImageNet's for uint8), floating
    pixels ``(x - mean) / std`` when ``mean``/``std`` are given, else as stored. ``labels``: ``(N,)``
    integers or ``(N, K)`` multi-label booleans (default: zeros).
    """

    def __init__(self, images: torch.Tensor | np.ndarray, labels: Any = None, *, layout: str = "NCHW",
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 name: str = "images", split: str | None = None):
        images = torch.as_tensor(images)
        if images.ndim != 4:
            raise ValueError(f"extract: in-memory images must be 4-D (N, C, H, W) or (N, H, W, C), got "
                             f"{tuple(images.shape)}")
        if layout not in LAYOUTS:
            raise ValueError(f"extract: image layout must be NCHW or NHWC, got {layout!r}")
        if not (images.dtype == torch.uint8 or images.is_floating_point()):
            raise ValueError(f"extract: in-memory images must be uint8 or floating, got {images.dtype}")
        self.images, self.layout, self.name, self.split = images.contiguous(), layout, name, split
        n, channels = images.shape[0], images.shape[1 if layout == "NCHW" else 3]
        if images.dtype == torch.uint8 and mean is None and std is None:
            mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)
        if (mean is None) != (std is None):
            raise ValueError("extract: give both mean and std, or neither")
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        # mean/std per device, copied once: a copy from pageable memory per batch would synchronise
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.mean is not None and self.mean.numel() != channels:
            raise ValueError(f"extract: mean/std have {self.mean.numel()} values for {channels} channels")
        labels = np.zeros(n, np.int64) if labels is None else np.asarray(labels)
        if labels.shape[:1] != (n,) or labels.ndim > 2:
            raise ValueError(f"extract: {n} images but labels of shape {labels.shape}")
        self.labels = labels
        self.multilabel = labels.ndim == 2
        norm = "" if self.mean is None else (
            f"; normalise mean {tuple(round(float(v), 4) for v in self.mean.flatten())} "
            f"std {tuple(round(float(v), 4) for v in self.std.flatten())}")
        scale = " / 255" if images.dtype == torch.uint8 else ""
        self.transform_desc = f"in-memory {str(images.dtype).replace('torch.', '')} {layout}{scale}{norm}"

    @classmethod
    def from_dataset(cls, dataset: Any, threads: int = 8) -> "ImageTensor":
        """``dataset``'s ``(C, H, W)`` images and labels gathered into one float tensor (``threads``
        read examples in parallel); name, split and transform description are kept."""
        first = dataset[0][0]
        images = torch.empty((len(dataset), *first.shape), dtype=first.dtype)
        labels: list[Any] = [None] * len(dataset)

        def read(i: int) -> None:
            x, labels[i] = dataset[i]
            images[i] = x

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(read, range(len(dataset))))
        out = cls(images, np.asarray([np.asarray(y) for y in labels]), name=getattr(dataset, "name", "images"),
                  split=getattr(dataset, "split", None))
        desc = getattr(dataset, "transform_desc", None)
        out.transform_desc = f"{desc}; in memory" if desc else out.transform_desc
        return out

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        label = self.labels[i]
        return self.prepare(self.images[i:i + 1])[0], (label if self.multilabel else int(label))

    def prepare(self, raw: torch.Tensor) -> torch.Tensor:
        """A raw batch (rows of ``images``, on any device) as the model takes it: ``(N, C, H, W)``
        float (an NHWC batch becomes a permuted view: channels-last strides, no copy)."""
        x = raw.permute(0, 3, 1, 2) if self.layout == "NHWC" else raw
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        if self.mean is not None:
            if x.device not in self._stats:
                self._stats[x.device] = (self.mean.to(x.device), self.std.to(x.device))
            mean, std = self._stats[x.device]
            x = (x - mean).div_(std)
        return x


IN_MEMORY_SPECS = ("digits", "digits-source", "digits-target", "synthetic")


def in_memory_spec(data: Any) -> bool:
    """True when ``data`` (a ``--data`` value) names a dataset whose images are held in memory (the
    digits, Fashion-MNIST and synthetic specs, an ``.npy``/``.npz`` file): read without DataLoader
    worker processes (:func:`as_image_tensor`, or a spawned loader when it is too large)."""
    if not isinstance(data, (str, os.PathLike)):
        return False
    text = str(data)
    if text in IN_MEMORY_SPECS or text.lower().endswith((".npy", ".npz")):
        return True
    try:
        from repsim.train.fashion import parse_spec
    except ImportError:  # pragma: no cover - train is part of this repository
        return False
    return parse_spec(text) is not None


def as_image_tensor(dataset: Any) -> ImageTensor | None:
    """``dataset`` as an :class:`ImageTensor` when its images are one in-memory tensor (an
    ``ImageTensor``, a ``TensorDataset`` of float ``(N, C, H, W)`` images and labels, or a dataset
    whose ``image_tensor()`` gives its images and labels — repsim.train.data's digits and synthetic
    splits), else None."""
    if isinstance(dataset, ImageTensor):
        return dataset
    # the dataset's own method, not one a wrapper forwards by __getattr__ (an adapted dataset —
    # channel repeat, resize — must go through its per-item adaptation)
    got = dataset.image_tensor() if callable(getattr(type(dataset), "image_tensor", None)) else None
    if got is not None:
        images, labels = got
        return ImageTensor(images, np.asarray(labels), name=str(getattr(dataset, "name", "images")),
                           split=getattr(dataset, "split", None))
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        if x.ndim == 4 and x.is_floating_point() and y.ndim in (1, 2):
            return ImageTensor(x, y.numpy(), name="TensorDataset")
    return None


def load_array(path: str) -> ImageTensor:
    """An :class:`ImageTensor` from ``images.npy`` (labels zero) or ``.npz`` (arrays ``images`` and,
    optionally, ``labels``); NHWC when the last axis has 1 or 3 channels and the second does not. Its
    ``fingerprint`` is the file's sha256 (``dataset.fingerprint``, a resume key)."""
    if str(path).endswith(".npz"):
        with np.load(path) as z:
            if "images" not in z:
                raise ValueError(f"extract: {path} has no 'images' array (it has {', '.join(z.files)})")
            images, labels = z["images"], (z["labels"] if "labels" in z else None)
    else:
        images, labels = np.load(path), None
    layout = "NHWC" if images.ndim == 4 and images.shape[3] in (1, 3) and images.shape[1] not in (1, 3) else "NCHW"
    out = ImageTensor(torch.from_numpy(np.ascontiguousarray(images)), labels, layout=layout, name=Path(path).name)
    # the file's content (a resume after the file changed would mix two datasets; text files: repsim/extract/text.py)
    out.fingerprint = f"file sha256 {sha256_file(Path(path))}"
    return out


class MemoryFeed:
    """The ``(inputs on device, labels)`` of each row span ``(lo, hi)`` of an extraction.

    ``rows``: the source index of every store row (the store's shuffled order), or None for rows
    in source order. On CUDA (see the module docstring) at most ``depth`` pinned staging batches
    and two device batches exist at a time; the batch yielded last is ready on the compute stream
    (it waited on the side stream's event) and the next one's copy is already queued.
    """

    def __init__(self, source: ImageTensor, rows: np.ndarray | None, spans: list[tuple[int, int]],
                 device: torch.device, channels_last: bool, depth: int = 3):
        self.source, self.spans, self.device, self.channels_last = source, spans, device, channels_last
        self.rows = None if rows is None else torch.as_tensor(np.asarray(rows, dtype=np.int64))
        self.depth = depth

    def _index(self, lo: int, hi: int) -> torch.Tensor | slice:
        return slice(lo, hi) if self.rows is None else self.rows[lo:hi]

    def _labels(self, index: torch.Tensor | slice) -> np.ndarray:
        return self.source.labels[index if isinstance(index, slice) else index.numpy()]

    def _ready(self, raw: torch.Tensor) -> torch.Tensor:
        x = self.source.prepare(raw)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def __iter__(self) -> Generator[tuple[torch.Tensor, np.ndarray], None, None]:
        if self.device.type != "cuda":
            images = self.source.images
            for lo, hi in self.spans:
                index = self._index(lo, hi)
                raw = images[index] if isinstance(index, slice) else images.index_select(0, index)
                yield self._ready(raw), self._labels(index)
            return
        yield from self._cuda()

    def _cuda(self) -> Generator[tuple[torch.Tensor, np.ndarray], None, None]:
        images = self.source.images
        size = max(hi - lo for lo, hi in self.spans)
        slots = [torch.empty((size, *images.shape[1:]), dtype=images.dtype, pin_memory=True)
                 for _ in range(self.depth)]
        copied: list[torch.cuda.Event | None] = [None] * self.depth  # the last copy out of each slot
        free: queue.Queue[int | None] = queue.Queue()
        filled: queue.Queue[tuple[int, int, int] | BaseException] = queue.Queue()
        for s in range(self.depth):
            free.put(s)

        def gather() -> None:  # host side: rows -> a pinned slot whose previous copy has finished
            try:
                with torch.inference_mode():  # thread-local, as the caller's: the slots may be inference tensors
                    for lo, hi in self.spans:
                        s = free.get()
                        if s is None:
                            return
                        if copied[s] is not None:
                            copied[s].synchronize()
                        index = self._index(lo, hi)
                        if isinstance(index, slice):
                            slots[s][: hi - lo].copy_(images[index])
                        else:
                            torch.index_select(images, 0, index, out=slots[s][: hi - lo])
                        filled.put((s, lo, hi))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                filled.put(exc)

        thread = threading.Thread(target=gather, name="extract-gather", daemon=True)
        thread.start()
        stream = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)

        def issue() -> tuple[torch.Tensor, torch.cuda.Event, np.ndarray]:
            got = filled.get()
            if isinstance(got, BaseException):
                raise got
            s, lo, hi = got
            with torch.cuda.stream(stream):
                raw = slots[s][: hi - lo].to(self.device, non_blocking=True)
                copied[s] = torch.cuda.Event()
                copied[s].record(stream)
                free.put(s)
                x = self._ready(raw)
                ready = torch.cuda.Event()
                ready.record(stream)
            return x, ready, self._labels(self._index(lo, hi))

        try:
            ahead = issue() if self.spans else None
            for k in range(len(self.spans)):
                x, ready, labels = ahead
                ahead = issue() if k + 1 < len(self.spans) else None  # queued before this batch's forward
                compute.wait_event(ready)
                x.record_stream(compute)  # allocated on the side stream, freed after the compute stream's use
                yield x, labels
        finally:
            for _ in range(self.depth):
                free.put(None)
            thread.join()
