"""The finiteness rule every analysis applies to the values it reads (activations, logits).

A NaN or Inf in a store's layer or logits has no meaning an analysis could recover: argmax over a
NaN row picks an arbitrary class, a probe cannot be fit on it, a calibration NLL becomes NaN. So
every command that reads values refuses them with one message, naming the store, the array, how
many values and rows are affected and the first such row (``repsim check`` counts them per array),
instead of computing over some rows and skipping others.
"""
from __future__ import annotations

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
