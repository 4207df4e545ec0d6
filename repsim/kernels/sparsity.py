"""Fraction of non-zero activations (paper Fig. 3), overall and per channel, with exact integer counts.

For activations X of shape (n, C[, H, W]) the overall fraction is #{X ≠ 0} / X.size (the paper's
"average % non-zero activations" of a block after the residual add and ReLU); the per-channel
fraction of channel c counts over examples and spatial positions. Counts are int64, so streaming
and merging are exact in any order.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.array_api import array_namespace, as_array, astype, check_finite, to_host_checked

__all__ = ["Sparsity", "channel_nonzero", "nonzero_fraction", "nonzero_fraction_per_channel"]


def channel_nonzero(X: Any, xp: Any) -> Any:
    """(C,) int64 count of the non-zero entries of each channel of X (b, C, ...), on X's device.

    ``xp.count_nonzero`` (array API 2023.12): no copy of X wider than its boolean mask (an int64
    copy would be 8 bytes per activation, 4× a float16 block's size on the GPU); a namespace
    without it sums the mask cast to int8, accumulated in int64."""
    Y = xp.reshape(X, (X.shape[0], X.shape[1], -1)) if X.ndim > 2 else X
    axis = (0, 2) if X.ndim > 2 else 0
    count = getattr(xp, "count_nonzero", None)
    if count is not None:
        n = count(Y, axis=axis)
        return n if n.dtype == xp.int64 else astype(n, xp.int64, xp)
    return xp.sum(xp.astype(Y != 0, xp.int8), axis=axis, dtype=xp.int64)


class Sparsity:
    """Streaming non-zero counter (protocol: update / merge / result / to_state / from_state)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.nonzero: np.ndarray | None = None  # (C,) int64
        self.per_channel_total = 0  # entries per channel seen so far (examples × spatial)

    def update(self, X: Any, *, xp: Any = None) -> "Sparsity":
        """Add a batch X (b, C, ...) or (b, C); 1-D input is one channel."""
        X = as_array(X)
        xp = array_namespace(X, xp=xp)
        what = self.name or "X"
        if X.ndim == 1:
            X = xp.reshape(X, (X.shape[0], 1))
        if X.ndim < 2:
            raise ValueError(f"{what} must have an example axis")
        deferred: list = []  # on an accelerator: checked with the counts' one copy to the host
        if xp.isdtype(X.dtype, "real floating"):
            check_finite(X, xp, what, deferred)
        b, c = X.shape[0], X.shape[1]
        (counts,) = to_host_checked([channel_nonzero(X, xp)], xp, deferred)
        counts = counts.astype(np.int64)
        if self.nonzero is None:
            self.nonzero = counts
        elif counts.shape != self.nonzero.shape:
            raise ValueError(f"{what}: channel count changed from {self.nonzero.shape[0]} to {c}")
        else:
            self.nonzero = self.nonzero + counts
        self.per_channel_total += b * (int(np.prod(X.shape[2:])) if X.ndim > 2 else 1)
        return self

    def merge(self, other: "Sparsity") -> "Sparsity":
        if not isinstance(other, Sparsity):
            raise TypeError(f"cannot merge {type(other).__name__} into Sparsity")
        if other.nonzero is not None:
            if self.nonzero is None:
                self.nonzero = other.nonzero.copy()
            elif self.nonzero.shape != other.nonzero.shape:
                raise ValueError("cannot merge Sparsity accumulators with different channel counts")
            else:
                self.nonzero = self.nonzero + other.nonzero
        self.per_channel_total += other.per_channel_total
        return self

    def _check(self) -> None:
        if self.nonzero is None or self.per_channel_total == 0:
            raise ValueError(f"{self.name or 'Sparsity'}: result() called before any update")

    def result(self) -> float:
        """Fraction of all activations that are non-zero."""
        self._check()
        return float(self.nonzero.sum() / (self.per_channel_total * self.nonzero.shape[0]))

    def result_per_channel(self) -> np.ndarray:
        """(C,) float64 fraction of non-zero activations per channel."""
        self._check()
        return self.nonzero / self.per_channel_total

    def to_state(self) -> dict[str, Any]:
        return {
            "kind": "Sparsity",
            "name": self.name,
            "has_counts": self.nonzero is not None,
            "nonzero": np.zeros(0, dtype=np.int64) if self.nonzero is None else self.nonzero.copy(),
            "per_channel_total": self.per_channel_total,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Sparsity":
        if str(state.get("kind")) != "Sparsity":
            raise ValueError(f"not a Sparsity state (kind={state.get('kind')!r})")
        acc = cls(str(state["name"]))
        if bool(state["has_counts"]):
            acc.nonzero = np.array(state["nonzero"], dtype=np.int64)
        acc.per_channel_total = int(state["per_channel_total"])
        return acc


def nonzero_fraction(X: Any, *, xp: Any = None) -> float:
    """Fraction of non-zero entries of X (n, ...) (paper Fig. 3)."""
    return Sparsity().update(X, xp=xp).result()


def nonzero_fraction_per_channel(X: Any, *, xp: Any = None) -> np.ndarray:
    """Per-channel fraction of non-zero entries of X (n, C[, H, W]) over examples and positions."""
    return Sparsity().update(X, xp=xp).result_per_channel()
