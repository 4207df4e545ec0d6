"""Datasets: ``build_dataset(spec, split, *, augment=False, root=None, ...)``.

Specs
  ``digits``          scikit-learn's 8×8 handwritten digits (1,797 images, 10 classes; no network)
  ``digits-source``   digits 0–4 (pretraining task of the demo), labels 0–4
  ``digits-target``   digits 5–9 (transfer task of the demo), labels 5–9 mapped to 0–4
  ``fashion``, ``fashion-source``, ``fashion-target``, ``fashion:C,C,...``
                      Fashion-MNIST (all classes, the study's source/target classes, any classes) from
                      its idx files: ``root``, the Debian package, or torchvision's downloader
                      (``download=True``); see :mod:`repsim.train.fashion`
  a directory         ImageFolder tree; ``DIR/train`` + ``DIR/test`` (``test``: ``DIR/test``), or
                      ``DIR/train`` + ``DIR/val`` without ``DIR/test`` (ImageNet layout: ``val/`` is
                      the test split), or a flat tree. With both ``val/`` and ``test/``, ``test/``
                      is the test split and ``val/`` is not read: merge an official validation split
                      into ``train/`` to train on train + val (Table A.2's sizes, e.g. Flowers' 2,040)
  a CSV, or a dir     multi-label images labelled by a CSV in CheXpert's layout (``repsim.train.csvdata``):
  with train.csv      targets (N, K) bool, uncertain/unmentioned findings negative (App. D.3)
  ``synthetic``       deterministic random images, for benchmarks
  a torchvision name  ``cifar10``, ``cifar100``, ``mnist``, ``fashionmnist``, ``svhn`` (``root``
                      required; downloaded only with ``download=True``)

Splits ``train``, ``holdout``, ``test``, and ``train+holdout`` (both, with the training transform: the
retraining set after hyperparameters are chosen on the holdout, App. A.1, A.3). The holdout is a deterministic subset of the training set
(a fixed-seed permutation, independent of the run seed): ``holdout_size`` images (ImageNet, App. A.1:
50,046), and ``train`` is the rest. Digits: per class, a fixed permutation (seed 0) puts 25 % of each
class in ``test``, 10 % in ``holdout``, the rest in ``train``; rows are in increasing original index.

Every dataset yields ``(image tensor, int label)`` and has ``.targets`` (np.int64), ``.example_ids``
(np.int64, stable ids: index into the underlying dataset), ``.num_classes``, ``.classes``, ``.name``,
``.split`` and ``.transform_desc``.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .imaging import SPLIT_SEED, holdout_split, image_transforms

SPLITS = ("train", "holdout", "test")
TRAIN_ALL = "train+holdout"
IMAGENET_HOLDOUT = 50_046
TORCHVISION_DATASETS = {"cifar10": "CIFAR10", "cifar100": "CIFAR100", "mnist": "MNIST",
                        "fashionmnist": "FashionMNIST", "svhn": "SVHN"}
TORCHVISION_NATIVE_SIZE = {"cifar10": 32, "cifar100": 32, "mnist": 28, "fashionmnist": 28, "svhn": 32}


IN_MEMORY_BYTES = 2 << 30  # the largest split SplitDataset.image_tensor materialises
_STACKING = threading.Lock()  # one SplitDataset.image_tensor build at a time (threads share the result)


class SplitDataset(Dataset):
    """A view of ``base`` restricted to ``indices`` with a per-item ``transform`` and label map."""

    def __init__(self, base: Any, indices: np.ndarray, targets: np.ndarray, *, classes: Sequence[str],
                 name: str, split: str, transform: Callable | None, transform_desc: str,
                 loader: Callable[[Any, int], Any], example_ids: np.ndarray | None = None):
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)
        self.targets = np.asarray(targets, dtype=np.int64)
        self.example_ids = self.indices if example_ids is None else np.asarray(example_ids, dtype=np.int64)
        self.classes, self.num_classes = list(classes), len(classes)
        self.name, self.split, self.transform, self.transform_desc = name, split, transform, transform_desc
        self._loader = loader

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def loader(self) -> Callable[[Any, int], Any]:
        """``loader(base, index)``: how an example is read from ``base`` before the transform."""
        return self._loader

    def __getitem__(self, i: int):
        x = self._loader(self.base, int(self.indices[i]))
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.targets[i])

    def image_tensor(self, max_bytes: int = IN_MEMORY_BYTES) -> tuple[torch.Tensor, np.ndarray] | None:
        """Every image of the split as one ``(N, C, H, W)`` tensor with the labels — exactly the values
        ``self[i]`` gives — when an image is a plain lookup in an in-memory base (no per-item
        transform: digits, synthetic) and all of them fit ``max_bytes``; else None.  Extraction then
        slices batches from it without DataLoader workers (repsim/extract/memory.py).  Built once per dataset
        object (extraction reuses a dataset across the checkpoints of one command: 18 networks, one
        stack; its threads, ``repsim extract --job-mode threads``, wait for one build instead of each making
        its own)."""
        cached = self.__dict__.get("_image_tensor")
        if cached is not None and cached[0].nbytes <= max_bytes:
            return cached
        if self.transform is not None or not len(self) or not (
                isinstance(self.base, torch.Tensor) or getattr(self.base, "in_memory", False)):
            return None
        with _STACKING:
            cached = self.__dict__.get("_image_tensor")  # (built by another thread meanwhile)
            if cached is not None and cached[0].nbytes <= max_bytes:
                return cached
            first = self._loader(self.base, int(self.indices[0]))
            if not isinstance(first, torch.Tensor) or first.ndim != 3 or len(self) * first.nbytes > max_bytes:
                return None
            self._image_tensor = (torch.stack([self._loader(self.base, int(i)) for i in self.indices]), self.targets)
            return self._image_tensor


# -- digits ---------------------------------------------------------------------------------------
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 8, 8) float32 in [0, 16] and (1797,) int64 labels: scikit-learn's digits data.

    Reads the CSV that ships with scikit-learn directly (saves ~1 s of ``import sklearn.datasets``
    per training process); falls back to ``sklearn.datasets.load_digits``.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.exists():
        with gzip.open(path, "rt") as f:
            data = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # pragma: no cover

    d = load_digits()  # pragma: no cover
    return d.images.astype(np.float32), d.target.astype(np.int64)  # pragma: no cover


class FixedHoldoutError(ValueError):
    """A ``holdout_size`` asked of a dataset whose holdout split is fixed (digits, Fashion-MNIST, synthetic)."""


def digits_split_indices(labels: np.ndarray, split: str) -> np.ndarray:
    """Per class: fixed permutation; first 25 % test, next 10 % holdout, rest train (sorted)."""
    rng = np.random.default_rng(SPLIT_SEED)
    out = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test, n_hold = int(round(0.25 * len(idx))), int(round(0.10 * len(idx)))
        part = {"test": idx[:n_test], "holdout": idx[n_test:n_test + n_hold], "train": idx[n_test + n_hold:]}
        out.append(part[split])
    return np.sort(np.concatenate(out))


class _Shift:
    """Random translation by up to ``pad`` pixels (zero fill) — the digits augmentation."""

    def __init__(self, pad: int = 1):
        self.pad = pad

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pad
        dy, dx = torch.randint(0, 2 * p + 1, (2,)).tolist()
        h, w = x.shape[-2:]
        return torch.nn.functional.pad(x, (p, p, p, p))[..., dy:dy + h, dx:dx + w]


DIGITS_RANGE = ((0.0 - 4.884) / 6.017, (16.0 - 4.884) / 6.017)  # standardised pixel range


def _digits(spec: str, split: str, augment: bool, autoaugment: bool = False) -> SplitDataset:
    images, labels = load_digits_arrays()
    # standardise with the fixed constants of the whole set (mean 4.88, std 6.02 of pixel values)
    x = torch.from_numpy((images - 4.884) / 6.017).unsqueeze(1)
    idx = digits_split_indices(labels, split)
    keep = {"digits": range(10), "digits-source": range(5), "digits-target": range(5, 10)}[spec]
    idx = idx[np.isin(labels[idx], list(keep))]
    offset = keep[0]
    transform, desc = (_Shift(1), "standardise; random shift ±1 px") if augment else (None, "standardise")
    if augment and autoaugment:
        from torchvision import transforms as T

        from .augment import FloatAutoAugment

        transform, desc = T.Compose([_Shift(1), FloatAutoAugment(*DIGITS_RANGE)]), desc + " + AutoAugment (ImageNet policy)"
    return SplitDataset(x, idx, labels[idx] - offset, classes=[str(c) for c in keep], name=spec,
                        split=split, transform=transform, transform_desc=desc, loader=lambda base, i: base[i])


# -- synthetic -------------------------------------------------------------------------------------
class _SyntheticBase:
    in_memory = True  # images are generated on demand, cheaply: SplitDataset.image_tensor may stack them

    def __init__(self, n: int, size: int, channels: int, seed: int):
        self.n, self.size, self.channels, self.seed = n, size, channels, seed

    def image(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randn(self.channels, self.size, self.size, generator=g)


def _synthetic(split: str, image_size: int, num_classes: int, n: int, channels: int) -> SplitDataset:
    seed = SPLITS.index(split) + 1
    base = _SyntheticBase(n, image_size, channels, seed)
    idx = np.arange(n)
    return SplitDataset(base, idx, idx % num_classes, classes=[str(c) for c in range(num_classes)],
                        name="synthetic", split=split, transform=None,
                        transform_desc=f"N(0,1) {channels}x{image_size}x{image_size}",
                        loader=lambda b, i: b.image(i))


# -- images ----------------------------------------------------------------------------------------
def pil_loader(base: Any, i: int):
    """An image of a torchvision dataset (ImageFolder, CIFAR, ...) as its base gives it: a PIL image
    (repsim.extract.jpeg reads the files of an ImageFolder split with this loader itself)."""
    return base[i][0]


def _image_folder(path: Path, split: str, augment: Any, image_size: int, eval_resize: int | None,
                  holdout_size: int | None, autoaugment: bool = False) -> SplitDataset:
    from torchvision.datasets import ImageFolder

    train_dir = path / "train" if (path / "train").is_dir() else path
    if split == "test":
        # test/ when there is one (a dataset's official test set, App. A.3: "tested on the provided test
        # sets"); val/ only in the ImageNet layout (train/ + val/, no test/), where val/ is the test set
        test_dir = next((path / d for d in ("test", "val") if (path / d).is_dir()), None)
        if test_dir is None:
            raise ValueError(f"{path} has no val/ or test/ folder for the test split")
        base, idx = ImageFolder(str(test_dir)), None
    else:
        base = ImageFolder(str(train_dir))
        n = len(base)
        hold = holdout_size if holdout_size is not None else (IMAGENET_HOLDOUT if len(base.classes) == 1000 else 0)
        if split == "holdout" and hold == 0:
            raise ValueError("holdout split requested but holdout_size is 0")
        idx = holdout_split(n, hold, split)
    if idx is None:
        idx = np.arange(len(base))
    targets = np.asarray(base.targets, dtype=np.int64)[idx]
    tf, desc = image_transforms(augment if split == "train" else False, image_size, eval_resize,
                                autoaugment=autoaugment)
    return SplitDataset(base, idx, targets, classes=base.classes, name=path.name, split=split,
                        transform=tf, transform_desc=desc, loader=pil_loader)


def _torchvision(name: str, split: str, root: str | None, download: bool, augment: Any, image_size: int | None,
                 eval_resize: int | None, holdout_size: int | None, autoaugment: bool = False) -> SplitDataset:
    import torchvision.datasets as tvd

    if not root:
        raise ValueError(f"dataset {name!r} needs --data ROOT (a folder to find or download it in)")
    cls = getattr(tvd, TORCHVISION_DATASETS[name])
    kwargs = {"split": "test" if split == "test" else "train"} if name == "svhn" else {"train": split != "test"}
    try:
        base = cls(root, download=download, **kwargs)
    except RuntimeError as e:
        raise ValueError(f"{name} not found under {root} ({e}); pass --set data.download=true to fetch it") from None
    raw_targets = np.asarray(getattr(base, "targets", getattr(base, "labels", None)), dtype=np.int64)
    classes = list(getattr(base, "classes", [str(c) for c in range(int(raw_targets.max()) + 1)]))
    if split == "test":
        idx = np.arange(len(base))
    else:
        idx = holdout_split(len(base), 5000 if holdout_size is None else holdout_size, split)
    gray = name in ("mnist", "fashionmnist")
    native = TORCHVISION_NATIVE_SIZE[name]
    if image_size is None or int(image_size) == native:
        # the dataset's own resolution (a CIFAR recipe run): no resize, the dataset's own normalisation
        mean, std = ((0.5,), (0.5,)) if gray else ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
        aug = ("cifar" if augment is True else augment) if split == "train" else False
        tf, desc = image_transforms(aug, native, None, mean, std, autoaugment=autoaugment)
    else:
        # a network of another input size (an ImageNet network probed or fine-tuned on CIFAR, App. A.2/A.3):
        # every split is resized to image_size -- evaluation Resize(eval_resize or image_size) +
        # CenterCrop(image_size), training ImageNet-style RandomResizedCrop(image_size) -- with the
        # ImageNet normalisation the network was trained with
        if split == "train" and augment == "cifar":
            raise ValueError(f"{name}: the cifar augmentation (pad-4 random crop) is for {native}x{native} "
                             f"images, not image_size {image_size}; use data.augment = \"imagenet\"")
        aug = ("imagenet" if augment is True else augment) if split == "train" else False
        size = int(image_size)
        tf, desc = image_transforms(aug, size, eval_resize or size, autoaugment=autoaugment)
        if gray:  # one-channel images: the network's channels are adapted downstream (repsim/extract/adapt.py)
            from torchvision import transforms as T

            tf = T.Compose([T.Grayscale(3)] + list(tf.transforms))
            desc = "grayscale to 3 channels + " + desc
    return SplitDataset(base, idx, raw_targets[idx], classes=classes, name=name, split=split,
                        transform=tf, transform_desc=desc, loader=pil_loader)


# -- Fashion-MNIST ---------------------------------------------------------------------------------------
class _Flip:
    """Random horizontal flip with probability ½."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if torch.rand(()) < 0.5 else x


class _Compose:
    def __init__(self, *fns: Callable):
        self.fns = fns

    def __call__(self, x):
        for f in self.fns:
            x = f(x)
        return x


def _fashion(spec: str, classes: tuple[int, ...], split: str, augment: Any, root: str | None, download: bool,
             image_size: int | None, per_class: dict[str, int]) -> SplitDataset:
    """Fashion-MNIST ``classes`` (labels renumbered 0..K−1 in the spec's order), resized to
    ``image_size`` (default 28) by area averaging, standardised with the training set's pixel mean/std.
    ``augment``: True or ``"shift"`` — random shift by up to size/14 px (zero fill); ``"shift+flip"``
    adds a random horizontal flip; train split only."""
    from . import fashion as fm

    arrays = fm.load_arrays(str(root) if root else None, bool(download))
    images, labels = arrays["test" if split == "test" else "train"]
    n_train = fm.spec_train_per_class(spec)
    if n_train is not None:  # at most N per class (every image not held out, when a class has fewer)
        hold = per_class.get("holdout_per_class", fm.DEFAULT_HOLDOUT_PER_CLASS)
        fewest = min(int((labels == c).sum()) for c in classes) - hold
        per_class = {**per_class, "train_per_class": max(1, min(n_train, fewest))}
    idx = fm.split_indices(labels, classes, split, **per_class)
    size = int(image_size or 28)
    x = torch.from_numpy((fm.resize(images[idx], size) - fm.MEAN) / fm.STD).unsqueeze(1)
    remap = np.full(len(fm.CLASSES), -1, np.int64)
    remap[list(classes)] = np.arange(len(classes))
    ids = idx + (fm.N_TRAIN_OFFICIAL if split == "test" else 0)
    parts = str(augment).split("+") if augment and augment is not True else (["shift"] if augment else [])
    unknown = set(parts) - {"shift", "flip"}
    if unknown:
        raise ValueError(f"Fashion-MNIST augmentation {augment!r}: use shift, flip or shift+flip")
    pad = max(1, round(size / 14))
    fns = ([_Shift(pad)] if "shift" in parts else []) + ([_Flip()] if "flip" in parts else [])
    desc = "; ".join(["area resize to %d px, standardise" % size]
                     + (["random shift ±%d px" % pad] if "shift" in parts else [])
                     + (["horizontal flip"] if "flip" in parts else []))
    return SplitDataset(x, np.arange(len(idx)), remap[labels[idx]], classes=[fm.CLASSES[c] for c in classes],
                        name=spec, split=split, transform=_Compose(*fns) if fns else None, transform_desc=desc,
                        loader=lambda base, i: base[i], example_ids=ids)


def build_dataset(spec: str, split: str, *, augment: Any = False, root: str | os.PathLike | None = None,
                  image_size: int | None = None, eval_resize: int | None = None,
                  holdout_size: int | None = None, download: bool = False,
                  num_classes: int = 10, n: int = 512, channels: int = 3, autoaugment: bool = False,
                  per_class: dict[str, int] | None = None) -> SplitDataset:
    """Dataset ``spec`` (see module docstring), split ``train``/``holdout``/``test``/``train+holdout``.

    ``augment``: False, True (the dataset's standard training augmentation), ``"imagenet"`` or
    ``"cifar"``; applied to the train split only. ``root``: the directory for ImageFolder/torchvision
    specs (a spec that is itself a directory needs none). ``num_classes``, ``n``, ``channels`` apply to
    ``synthetic`` only; ``per_class`` (train_per_class, holdout_per_class, test_per_class) to the
    Fashion-MNIST specs only. ``autoaugment``: add AutoAugment (ImageNet policy) to the training augmentation.
    """
    if split == TRAIN_ALL:
        return _train_and_holdout(spec, augment=augment, root=root, image_size=image_size, eval_resize=eval_resize,
                                  holdout_size=holdout_size, download=download, autoaugment=autoaugment,
                                  per_class=per_class)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS + (TRAIN_ALL,))}")
    spec = str(spec)
    from .fashion import parse_spec

    fashion_classes = parse_spec(spec)
    if per_class and fashion_classes is None:  # a subsample the run would silently not take
        raise ValueError(f"data.{', data.'.join(sorted(per_class))} apply to the Fashion-MNIST specs only "
                         f"(fashion, fashion-source, fashion-target, fashion:C,...), not to {spec!r}")
    digits = spec in ("digits", "digits-source", "digits-target")
    # a holdout size these specs would silently not take: their holdout splits are fixed
    if holdout_size and (digits or spec == "synthetic" or fashion_classes is not None):
        how = ("10 % of each class" if digits else "a generated set of data.synthetic_n images"
               if spec == "synthetic" else "data.holdout_per_class images of each class (repsim.train.fashion)")
        raise FixedHoldoutError(f"data.holdout_size = {holdout_size} (finetune: --holdout-size) applies to image "
                                f"folders, CSV files and torchvision datasets; the holdout split of {spec!r} is "
                                f"fixed: {how}")
    if digits:
        return _digits(spec, split, bool(augment) and split == "train", autoaugment)
    if fashion_classes is not None:
        if autoaugment:
            raise ValueError(f"{spec}: AutoAugment is not available for Fashion-MNIST (use data.augment = "
                             "\"shift\", \"flip\" or \"shift+flip\")")
        return _fashion(spec, fashion_classes, split, augment if split == "train" else False, root, download,
                        image_size, per_class or {})
    if spec == "synthetic":
        return _synthetic(split, image_size or 32, num_classes, n, channels)
    if spec.lower() in TORCHVISION_DATASETS:
        return _torchvision(spec.lower(), split, str(root) if root else None, download, augment,
                            image_size, eval_resize, holdout_size, autoaugment)
    path = Path(root) / spec if root and not Path(spec).is_absolute() and (Path(root) / spec).exists() else Path(spec)
    if not path.is_dir() and not (path.is_file() and path.suffix.lower() == ".csv"):
        raise ValueError(f"data directory {str(path)!r} does not exist (and {spec!r} is not a known dataset name)")
    size = image_size or 224
    resize = eval_resize if eval_resize is not None else round(size * 256 / 224)
    from .csvdata import csv_dataset, is_csv_spec

    if is_csv_spec(path):
        return csv_dataset(path, split, augment, size, resize, holdout_size, autoaugment)
    return _image_folder(path, split, augment, size, resize, holdout_size, autoaugment)


def _train_and_holdout(spec: str, **kw: Any) -> SplitDataset:
    """The ``train`` and ``holdout`` splits as one training set (the training transform on every row):
    after tuning on the holdout, the paper retrains on both (App. A.1, A.3). A dataset without a
    holdout (size 0) gives its training split."""
    if str(spec) == "synthetic":
        raise ValueError("the synthetic dataset has no train+holdout split")
    train = build_dataset(spec, "train", **kw)
    if not isinstance(train, SplitDataset):
        raise ValueError(f"{spec}: the {TRAIN_ALL} split is for single-label datasets, not {type(train).__name__}")
    try:
        hold = build_dataset(spec, "holdout", **{**kw, "augment": False, "autoaugment": False})
    except ValueError as e:
        if "holdout_size is 0" in str(e):
            return train
        raise
    if len(hold) == 0:
        return train
    idx = np.concatenate([train.indices, hold.indices])
    targets = np.concatenate([train.targets, hold.targets])
    order = np.argsort(idx, kind="stable")
    return SplitDataset(train.base, idx[order], targets[order], classes=train.classes, name=train.name,
                        split=TRAIN_ALL, transform=train.transform, transform_desc=train.transform_desc,
                        loader=train._loader)


def dataset_from_config(config: dict[str, Any], split: str, *, spec: str | None = None,
                        augment: Any = False) -> SplitDataset:
    """The dataset of a run config (``config["data"]``: root, image_size, eval_resize, holdout_size,
    ...) — e.g. ``load_model(ckpt).config`` — for ``split``; ``spec`` replaces the run's dataset
    (repsim/extract/ uses this to push another dataset through a trained network). The run's own dataset gets
    the run's evaluation transform (``eval_resize``, e.g. Resize(256) + CenterCrop(224)); another ``spec``
    (a transfer task) gets App. A.2's probe transform, Resize(image_size) + CenterCrop(image_size). The
    run's ``holdout_size`` belongs to its own dataset: another ``spec`` gets that dataset's default
    holdout (e.g. CheXpert's 22,431-image i.i.d. split, ``repsim.train.csvdata``; an ImageFolder of other than
    1,000 classes: none), except a torchvision-name dataset (``cifar10``, ...), whose ``train`` split is
    then its whole training set (50,000 CIFAR images, Table A.2), not the 45,000 left by the 5,000-image
    holdout a run on it uses."""
    d = config["data"]
    own = spec in (None, d["spec"])
    hold = d.get("holdout_size", -1) if own else -1
    eval_resize = d.get("eval_resize") or None
    if not own:
        # a transfer task (linear probes, App. A.2): "resizing them to 224 pixels on the shortest side and
        # taking a 224x224 pixel center crop", i.e. Resize(image_size) + CenterCrop(image_size), not the
        # run's own evaluation resize (256 for 224); and a torchvision-name dataset keeps all its training
        # images in `train` (A.2's probe holds out its own validation split of them, then refits on all)
        eval_resize = d.get("image_size") or None
        if str(spec).lower() in TORCHVISION_DATASETS:
            hold = 0
    return build_dataset(spec or d["spec"], split, augment=augment, root=d.get("root") or None,
                         autoaugment=bool(augment) and bool(d.get("autoaugment", False)),
                         image_size=d.get("image_size"), eval_resize=eval_resize,
                         holdout_size=None if hold is None or hold < 0 else hold,
                         download=d.get("download", False), num_classes=d.get("synthetic_classes", 10),
                         n=d.get("synthetic_n", 512), channels=int(config.get("in_channels", 3)),
                         per_class=fashion_sizes(d))


def fashion_sizes(data: dict[str, Any]) -> dict[str, int]:
    """The Fashion-MNIST per-class sizes of a run config's ``data`` table (absent or < 0: defaults)."""
    out = {}
    for key in ("train_per_class", "holdout_per_class", "test_per_class"):
        v = data.get(key, -1)
        if v is not None and v >= 0:
            out[key] = int(v)
    return out
