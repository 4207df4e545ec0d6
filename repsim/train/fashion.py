"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) from its idx files, and the study's class splits.

Where the files are found, first that works (:func:`locate`):

1. an explicit root (``--data-root`` / ``data.root``): the four idx files, gzipped or raw, in ROOT,
   ROOT/fashion-mnist or ROOT/FashionMNIST/raw (torchvision's layout);
2. ``/usr/share/datasets/fashion-mnist`` — the Debian package ``dataset-fashion-mnist``
   (``apt-get install -y dataset-fashion-mnist``);
3. torchvision's ``FashionMNIST`` downloader into ROOT (or ``~/.cache/repsim``), only when downloading
   is allowed (``--download`` / ``data.download = true``).

Otherwise :class:`FashionMNISTNotFound` names all three ways in one line.

idx format (LeCun's MNIST page): big-endian; bytes 0–1 zero, byte 2 the element type (0x08 unsigned
byte), byte 3 the number of dimensions d, then d uint32 sizes, then the data in C order.

Specs (``repsim.train.data.build_dataset``): ``fashion`` (all 10 classes), ``fashion-source`` and
``fashion-target`` (:data:`SOURCE_CLASSES` / :data:`TARGET_CLASSES`, labels renumbered 0..K−1 in that
order), or ``fashion:C,C,...`` for any class list; a suffix ``@N`` (``fashion-target@2000``) sets the
training images per class of that spec to N (or all not held out, when a class has fewer), whatever the
run's ``train_per_class`` (e.g. a transfer task fit on more images than the pretraining run used). Splits are class-balanced and fixed (seed 0,
independent of the run seed): per class, a permutation of that class's official training images
gives ``holdout`` (the first ``holdout_per_class``) and ``train`` (the next ``train_per_class``, or
all the rest); ``test`` is the first ``test_per_class`` of a permutation of the official test images
of the class (or all of them). Example ids: the official training index, or 60,000 + the official
test index — stable across processes, unique across splits.
"""
from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path

import numpy as np

CLASSES: tuple[str, ...] = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                            "Sneaker", "Bag", "Ankle boot")
# Pretraining task: the five upper-body garments and bags (confusable: headroom for the objectives to
# differ); transfer task: the other five (trousers, dresses and three kinds of shoe), classes the
# network never saw. Chosen by measurement (repsim/analyses/README.md, search record).
SOURCE_CLASSES: tuple[int, ...] = (0, 2, 4, 6, 8)
TARGET_CLASSES: tuple[int, ...] = (1, 3, 5, 7, 9)
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_PACKAGE = "dataset-fashion-mnist"
FILES = {("train", "images"): "train-images-idx3-ubyte", ("train", "labels"): "train-labels-idx1-ubyte",
         ("test", "images"): "t10k-images-idx3-ubyte", ("test", "labels"): "t10k-labels-idx1-ubyte"}
N_TRAIN_OFFICIAL = 60_000  # example ids of test images start here
MEAN, STD = 0.2860, 0.3530  # pixel mean and std (values in [0, 1]) of the official training set
DEFAULT_HOLDOUT_PER_CLASS = 500
_SPLIT_SEED = 0
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class FashionMNISTNotFound(FileNotFoundError):
    """None of the three ways found the idx files; the message names all three."""


# -- idx files -------------------------------------------------------------------------------------
def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array in an idx file (``.gz`` is decompressed); raises ValueError on a malformed file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an idx file (bad magic number {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(data[4:header], dtype=">u4"))
    dtype = np.dtype(_IDX_TYPES[data[2]])
    count = int(np.prod(shape)) if shape else 1
    if len(data) - header != count * dtype.itemsize:
        raise ValueError(f"{path}: {len(data) - header} data bytes, expected {count * dtype.itemsize} for shape {shape}")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an idx file, gzipped when ``path`` ends in ``.gz`` (for tests)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _find_in(directory: Path) -> dict[tuple[str, str], Path] | None:
    """The four idx files (gz preferred) in ``directory`` or its usual subfolders, or None."""
    for d in (directory, directory / "fashion-mnist", directory / "FashionMNIST" / "raw"):
        found = {}
        for key, stem in FILES.items():
            hit = next((d / (stem + ext) for ext in (".gz", "") if (d / (stem + ext)).is_file()), None)
            if hit is None:
                break
            found[key] = hit
        if len(found) == len(FILES):
            return found
    return None


def _download_root(root: str | os.PathLike | None) -> Path:
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "repsim"


def not_found_message(root: str | os.PathLike | None, download_error: str | None = None) -> str:
    """One line naming the three ways to get the data: the flag, the Debian package, the downloader."""
    tried = f"--data-root {root} has no idx files, nor has {DEBIAN_DIR}; " if root else f"{DEBIAN_DIR} has no idx files; "
    dl = f" (download failed: {download_error})" if download_error else ""
    return (f"Fashion-MNIST not found: {tried}pass --data-root DIR holding the four *-idx?-ubyte[.gz] files, "
            f"or install the Debian package {DEBIAN_PACKAGE} (apt-get install -y {DEBIAN_PACKAGE}; files in "
            f"{DEBIAN_DIR}), or pass --download to fetch it with torchvision.datasets.FashionMNIST{dl}")


def locate(root: str | os.PathLike | None = None, download: bool = False,
           debian_dir: str | os.PathLike | None = None) -> dict[tuple[str, str], Path]:
    """Paths of the four idx files, by the order of the module docstring (``debian_dir``: default
    :data:`DEBIAN_DIR`)."""
    if root:
        found = _find_in(Path(root))
        if found:
            return found
    found = _find_in(Path(debian_dir) if debian_dir else DEBIAN_DIR)
    if found:
        return found
    error = None
    if download:
        target = _download_root(root)
        try:
            from torchvision.datasets import FashionMNIST

            for train in (True, False):
                FashionMNIST(str(target), train=train, download=True)
        except Exception as exc:  # network, disk, missing torchvision: all end in the same message
            error = f"{type(exc).__name__}: {exc}"
        else:
            found = _find_in(target)
            if found:
                return found
    raise FashionMNISTNotFound(not_found_message(root, error))


@functools.lru_cache(maxsize=2)
def load_arrays(root: str | None = None, download: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (images (N, 28, 28) uint8, labels (N,) int64), "test": (...)} of the located files."""
    files = locate(root, download)
    out = {}
    for split in ("train", "test"):
        x, y = read_idx(files[split, "images"]), read_idx(files[split, "labels"]).astype(np.int64)
        if x.ndim != 3 or y.shape != (x.shape[0],):
            raise ValueError(f"Fashion-MNIST {split}: images {x.shape} and labels {y.shape} do not match")
        if y.size and (y.min() < 0 or y.max() >= len(CLASSES)):
            raise ValueError(f"Fashion-MNIST {split}: labels outside 0..9")
        out[split] = (x, y)
    return out


# -- specs and splits ----------------------------------------------------------------------------------
def parse_spec(spec: str) -> tuple[int, ...] | None:
    """The classes of a Fashion-MNIST spec, or None when ``spec`` is not one (an ``@N`` suffix is
    ignored here; see :func:`spec_train_per_class`)."""
    spec = spec.split("@", 1)[0]
    if spec == "fashion":
        return tuple(range(len(CLASSES)))
    if spec == "fashion-source":
        return SOURCE_CLASSES
    if spec == "fashion-target":
        return TARGET_CLASSES
    if spec.startswith("fashion:"):
        try:
            classes = tuple(int(c) for c in spec.split(":", 1)[1].split(","))
        except ValueError:
            raise ValueError(f"bad Fashion-MNIST spec {spec!r}: expected fashion:C,C,... with C in 0..9") from None
        if len(classes) < 2 or len(set(classes)) != len(classes) or not all(0 <= c < 10 for c in classes):
            raise ValueError(f"bad Fashion-MNIST spec {spec!r}: need >= 2 distinct classes in 0..9")
        return classes
    return None


def spec_train_per_class(spec: str) -> int | None:
    """N of a spec's ``@N`` suffix (training images per class), or None without one."""
    if "@" not in spec:
        return None
    n = spec.split("@", 1)[1]
    if not n.isdigit():
        raise ValueError(f"bad Fashion-MNIST spec {spec!r}: the suffix must be @N, N images per class")
    return int(n)


def split_indices(labels: np.ndarray, classes: tuple[int, ...], split: str, *, train_per_class: int = 0,
                  holdout_per_class: int = DEFAULT_HOLDOUT_PER_CLASS, test_per_class: int = 0) -> np.ndarray:
    """Sorted indices into the official arrays (``labels``: the official training labels for the
    ``train``/``holdout`` splits, the test labels for ``test``); see the module docstring.

    Each class's permutation depends only on the class (seed (0, class)), so a class's holdout and
    train images are the same whichever other classes a spec holds. 0 per class means all (train:
    all not held out). Raises ValueError when a class has too few images.
    """
    if split not in ("train", "holdout", "test"):
        raise ValueError(f"unknown split {split!r}")
    out = []
    for c in classes:
        idx = np.random.default_rng((_SPLIT_SEED, c)).permutation(np.flatnonzero(labels == c))
        if split == "test":
            n = test_per_class or len(idx)
            part = idx[:n]
        else:
            hold = holdout_per_class
            n = hold if split == "holdout" else (train_per_class or len(idx) - hold)
            part = idx[:hold] if split == "holdout" else idx[hold:hold + n]
            n_need = hold + (train_per_class if split == "train" else 0)
            if len(idx) < n_need:
                raise ValueError(f"Fashion-MNIST class {c} has {len(idx)} training images; "
                                 f"{hold} holdout + {train_per_class} train per class were asked for")
        if len(part) < n:
            raise ValueError(f"Fashion-MNIST class {c} has {len(part)} {split} images; {n} per class were asked for")
        out.append(part)
    return np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)


def resize(images: np.ndarray, size: int) -> np.ndarray:
    """(N, 28, 28) uint8 → (N, size, size) float32 in [0, 1]: exact k×k means when 28 = k·size,
    else antialiased bilinear (torch), i.e. area averaging in both cases."""
    x = images.astype(np.float32) / 255.0
    n, h, w = x.shape
    if size == h == w:
        return x
    if h % size == 0 and w % size == 0:
        kh, kw = h // size, w // size
        return x.reshape(n, size, kh, size, kw).mean(axis=(2, 4))
    import torch
    import torch.nn.functional as F

    t = F.interpolate(torch.from_numpy(x)[:, None], size=(size, size), mode="bilinear", antialias=True,
                      align_corners=False)
    return t[:, 0].numpy()
