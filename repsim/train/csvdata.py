"""Multi-label image datasets labelled by a CSV file, in CheXpert's layout (paper App. D.3, Table D.1).

The CSV has one row per image: a path column (``Path``, or the first column) and one column per
finding whose cells are ``1`` (positive), ``0`` (negative), ``-1`` (uncertain) or blank
(unmentioned). App. D.3: "We treat both uncertain and unmentioned observations as negative", so a
target is positive exactly when its cell is ``1``. Other columns (``Sex``, ``Age``,
``Frontal/Lateral``, ``AP/PA``) are ignored: a column is a finding when every non-blank cell is one of
1, 0, -1 (CheXpert writes ``1.0``, ``0.0``, ``-1.0``). When CheXpert's five competition findings are
all present they are the targets (Table D.1's columns); otherwise every finding column is.

Specs (``repsim.train.data.build_dataset``):

- a directory with ``train.csv`` and ``valid.csv`` (or ``test.csv``), e.g. ``CheXpert-v1.0-small/``:
  split ``test`` is ``valid.csv`` (CheXpert's official validation set, 234 images); ``train`` and
  ``holdout`` partition ``train.csv`` with a fixed seed, ``holdout_size`` rows held out. The default
  holdout is the size of the paper's second setting, an i.i.d. split of 22,431 training images
  (:data:`CHEXPERT_IID_HOLDOUT`), when the CSV has more than twice that many rows, else 10 % of them;
- a CSV file: ``test`` is every row, ``train``/``holdout`` partition it the same way.

Image paths are resolved relative to the CSV's directory, or its parent (CheXpert's CSVs name
``CheXpert-v1.0-small/train/...``, relative to the folder that holds the dataset). Images are read
with PIL and converted to RGB (CheXpert's are grayscale) for ImageNet-pretrained networks.

Every dataset yields ``(image tensor, (K,) bool tensor)`` and has ``.targets`` ((N, K) bool),
``.example_ids`` (row numbers in its CSV), ``.classes`` (finding names), ``.num_classes`` (K),
``.multilabel`` (True), ``.name``, ``.split`` and ``.transform_desc``.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .imaging import holdout_split, image_transforms

CHEXPERT_COMPETITION = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion")
CHEXPERT_IID_HOLDOUT = 22_431  # App. D.3: "we split 22,431 images from the training set and evaluate on these"
_FINDING_VALUES = {"1", "0", "-1", "1.0", "0.0", "-1.0"}


def is_csv_spec(path: Path) -> bool:
    """True for a ``.csv`` file or a directory holding ``train.csv`` (CheXpert's folder also holds the
    ``train/`` and ``valid/`` image trees its CSVs point into, so ``train.csv`` decides)."""
    if path.is_file():
        return path.suffix.lower() == ".csv"
    return path.is_dir() and (path / "train.csv").is_file()


def read_label_csv(path: str | os.PathLike, findings: Sequence[str] | None = None
                   ) -> tuple[list[str], np.ndarray, list[str]]:
    """(image paths as written, targets (N, K) bool, finding names) of a CheXpert-layout CSV.

    ``findings``: the target columns (default: CheXpert's five competition findings when all are
    present, else every column whose non-blank cells are all 1, 0 or -1). A cell is positive iff it is
    1; 0, -1 (uncertain) and blank (unmentioned) are negative (App. D.3).
    """
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise ValueError(f"{path}: no data rows (a header and one row per image are expected)")
    header, body = [h.strip() for h in rows[0]], rows[1:]
    bad = [i + 2 for i, r in enumerate(body) if len(r) != len(header)]
    if bad:
        raise ValueError(f"{path}: row(s) {bad[:5]} have a different number of cells than the header ({len(header)})")
    path_col = header.index("Path") if "Path" in header else 0
    if findings is None:
        candidates = [j for j, h in enumerate(header) if j != path_col
                      and all(r[j].strip() in _FINDING_VALUES or not r[j].strip() for r in body)]
        names = [header[j] for j in candidates]
        findings = list(CHEXPERT_COMPETITION) if set(CHEXPERT_COMPETITION) <= set(names) else names
        if not findings:
            raise ValueError(f"{path}: no finding columns (cells 1, 0, -1 or blank) besides the path column")
    missing = [f for f in findings if f not in header]
    if missing:
        raise ValueError(f"{path}: finding column(s) {missing} not in the header {header}")
    cols = [header.index(f) for f in findings]
    targets = np.zeros((len(body), len(cols)), dtype=bool)
    for i, r in enumerate(body):
        for k, j in enumerate(cols):
            cell = r[j].strip()
            if cell and cell not in _FINDING_VALUES:
                raise ValueError(f"{path}: row {i + 2}, column {header[j]!r}: {cell!r} is not 1, 0, -1 or blank")
            targets[i, k] = cell in ("1", "1.0")
    return [r[path_col].strip() for r in body], targets, list(findings)


def _image_root(csv_path: Path, first: str) -> Path:
    for root in (csv_path.parent, csv_path.parent.parent):
        if (root / first).is_file():
            return root
    raise ValueError(f"{csv_path}: image {first!r} not found relative to {csv_path.parent} or {csv_path.parent.parent}")


class MultiLabelCSV(Dataset):
    """Rows ``indices`` of a CheXpert-layout CSV: ``(transform(RGB image), (K,) bool targets)``."""

    multilabel = True

    def __init__(self, csv_path: str | os.PathLike, indices: np.ndarray | None = None, *, split: str,
                 name: str, transform: Callable | None, transform_desc: str,
                 findings: Sequence[str] | None = None):
        csv_path = Path(csv_path)
        paths, targets, names = read_label_csv(csv_path, findings)
        self.root = _image_root(csv_path, paths[0])
        self.indices = np.arange(len(paths), dtype=np.int64) if indices is None else np.asarray(indices, np.int64)
        self.paths = [paths[i] for i in self.indices]
        self.targets = targets[self.indices]
        self.example_ids = self.indices
        self.classes, self.num_classes = names, len(names)
        self.name, self.split, self.transform, self.transform_desc = name, split, transform, transform_desc

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.root / self.paths[i]) as im:
            x = im.convert("RGB")
        if self.transform is not None:
            x = self.transform(x)
        return x, torch.from_numpy(self.targets[i].copy())


def csv_dataset(path: Path, split: str, augment, image_size: int, eval_resize: int | None,
                holdout_size: int | None, autoaugment: bool = False) -> MultiLabelCSV:
    """The ``split`` of a CSV spec (see the module docstring); ``autoaugment`` as for image folders."""
    if path.is_dir():
        train_csv = path / "train.csv"
        test_csv = next((path / f for f in ("valid.csv", "test.csv") if (path / f).is_file()), None)
        name = path.name
    else:
        train_csv = test_csv = path
        name = path.parent.name or path.stem
    tf, desc = image_transforms(augment if split == "train" else False, image_size, eval_resize,
                                autoaugment=autoaugment)
    if split == "test":
        if test_csv is None:
            raise ValueError(f"{path} has no valid.csv or test.csv for the test split")
        return MultiLabelCSV(test_csv, None, split=split, name=name, transform=tf, transform_desc=desc)
    n = len(read_label_csv(train_csv)[0])
    if holdout_size is None:
        holdout_size = CHEXPERT_IID_HOLDOUT if n > 2 * CHEXPERT_IID_HOLDOUT else round(0.1 * n)
    hold = holdout_size
    if split == "holdout" and hold == 0:
        raise ValueError(f"holdout split requested but holdout_size is 0 ({train_csv} has {n} rows)")
    return MultiLabelCSV(train_csv, holdout_split(n, hold, split), split=split, name=name, transform=tf,
                         transform_desc=desc)
