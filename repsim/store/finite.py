"""The finiteness rule every analysis applies to the values it reads (activations, logits).

A NaN or Inf in a store's layer or logits has no meaning an analysis could recover: argmax over a
NaN row picks an arbitrary class, a probe cannot be fit on it, a calibration NLL becomes NaN. So
every command that reads values refuses them with one message, naming the store, the array, how
many values and rows are affected and the first such row (``repsim check`` counts them per array),
instead of computing over some rows and skipping others.  :class:`ConstantLayers` is the other value
rule: a layer holding the same value in every example is no error, but no similarity or separation
metric is defined for it, so `extract` and `check` name such layers.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np


def require_finite(x: Any, store: Any, array: str, first_row: int = 0) -> np.ndarray:
    """``x`` (rows of ``array`` of ``store``, starting at row ``first_row``) as an array; raises
    ``ValueError`` when it holds NaN or Inf."""
    x = np.asarray(x)
    bad = ~np.isfinite(x)
    if not bad.any():
        return x
    rows = np.flatnonzero(bad.reshape(x.shape[0], -1).any(axis=1)) + first_row
    raise ValueError(f"store {store.name}: {array} holds {int(bad.sum())} NaN/Inf value(s) in {rows.size} row(s) "
                     f"(first: row {int(rows[0])}); no analysis uses them (`repsim check {store.path}` counts "
                     "them per array)")


class ConstantLayers:
    """Which of ``layers`` hold the same value in every example, seen chunk by chunk: each chunk is
    compared with the first row seen of its layer until a difference shows (usually in the first
    chunk; a layer costs nothing more after that).  Thread-safe, so writer threads may feed it chunks
    in any order.  ``constant()``: the layers seen and never seen to vary."""

    def __init__(self, layers: list[str]) -> None:
        self._layers = list(layers)
        self._first: dict[str, np.ndarray] = {}
        self._varies: set[str] = set()
        self._lock = threading.Lock()

    def undecided(self) -> list[str]:
        """The layers not yet seen to vary (the ones a new chunk still has to be compared for)."""
        return [k for k in self._layers if k not in self._varies]

    def see(self, chunk: dict[str, Any]) -> None:
        for k, x in chunk.items():
            x = np.asarray(x)
            if k in self._varies or not len(x):
                continue
            with self._lock:
                first = self._first.setdefault(k, x[:1].copy())
            if np.any(x != first):
                self._varies.add(k)

    def constant(self) -> list[str]:
        return [k for k in self.undecided() if k in self._first]

