"""Top-k and mean per-class accuracy of a classifier's logits, streamed (Table C.1: training-set top-1 and
top-5 of each objective's own final layer).

An example counts as correct at k when its label is among the first k classes of the logits sorted in
descending order, ties broken towards the lower class index (so top-1 is ``argmax``'s prediction).
Mean per-class accuracy averages the top-1 accuracy of every class present (App. A.2's measure for
Pets and Flowers). Counts are int64, so streaming and merging are exact in any order.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.array_api import to_numpy

__all__ = ["TopKAccuracy", "topk_ranks"]


def topk_ranks(logits: Any, labels: Any) -> np.ndarray:
    """Position (0-based) of each example's label in its logits sorted descending, ties to the lower index:
    #{j: z_j > z_y} + #{j < y: z_j = z_y}."""
    z = np.asarray(to_numpy(logits), dtype=np.float64)  # host bookkeeping: one copy of a device array
    y = np.asarray(to_numpy(labels), dtype=np.int64)
    if z.ndim != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"logits must be (N, K) and labels (N,), got {z.shape} and {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= z.shape[1]):
        raise ValueError(f"labels must be in [0, {z.shape[1]}), got {y.min()}..{y.max()}")
    if not np.isfinite(z).all():
        raise ValueError("logits contain NaN or Inf")
    zy = z[np.arange(len(y)), y][:, None]
    lower = np.arange(z.shape[1])[None, :] < y[:, None]
    return ((z > zy) | ((z == zy) & lower)).sum(1)


class TopKAccuracy:
    """Streaming top-k / mean per-class accuracy (protocol: update / merge / result)."""

    def __init__(self, num_classes: int, ks: tuple[int, ...] = (1, 5)) -> None:
        if num_classes < 1 or not ks or min(ks) < 1:
            raise ValueError(f"need num_classes >= 1 and ks >= 1, got {num_classes}, {ks}")
        self.num_classes, self.ks = int(num_classes), tuple(int(k) for k in ks)
        self.hits = np.zeros(len(self.ks), dtype=np.int64)
        self.class_hits = np.zeros(self.num_classes, dtype=np.int64)
        self.class_count = np.zeros(self.num_classes, dtype=np.int64)

    @property
    def n(self) -> int:
        return int(self.class_count.sum())

    def update(self, logits: Any, labels: Any) -> "TopKAccuracy":
        z = to_numpy(logits)  # CuPy/device arrays refuse np.asarray
        if z.ndim != 2 or z.shape[1] != self.num_classes:
            raise ValueError(f"logits must be (N, {self.num_classes}), got {z.shape}")
        y = np.asarray(to_numpy(labels), dtype=np.int64)
        rank = topk_ranks(z, y)
        self.hits += np.array([(rank < k).sum() for k in self.ks], dtype=np.int64)
        self.class_hits += np.bincount(y[rank == 0], minlength=self.num_classes)
        self.class_count += np.bincount(y, minlength=self.num_classes)
        return self

    def merge(self, other: "TopKAccuracy") -> "TopKAccuracy":
        if (other.num_classes, other.ks) != (self.num_classes, self.ks):
            raise ValueError("cannot merge accumulators of different classes or ks")
        self.hits += other.hits
        self.class_hits += other.class_hits
        self.class_count += other.class_count
        return self

    def result(self) -> dict[str, float]:
        """{"top<k>": fraction for each k, "mean_per_class": fraction}; NaN when nothing was seen."""
        if self.n == 0:
            return {**{f"top{k}": float("nan") for k in self.ks}, "mean_per_class": float("nan")}
        out = {f"top{k}": float(h) / self.n for k, h in zip(self.ks, self.hits)}
        present = self.class_count > 0
        out["mean_per_class"] = float(np.mean(self.class_hits[present] / self.class_count[present]))
        return out
