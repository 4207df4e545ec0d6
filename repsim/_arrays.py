"""Array-module helpers for the probes (NumPy, CuPy, array-api-strict).

Small on purpose: ``array_namespace`` infers the module from ``__array_namespace__`` (NumPy ≥ 2, CuPy ≥ 13
and array-api-strict all provide it) and ``to_numpy`` brings a (small) result to the host.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def array_namespace(*arrays: Any) -> Any:
    """The array module shared by ``arrays`` (NumPy for plain sequences and NumPy scalars)."""
    spaces = []
    for a in arrays:
        ns = a.__array_namespace__() if hasattr(a, "__array_namespace__") else np
        if ns not in spaces:
            spaces.append(ns)
    if len(spaces) > 1:
        raise ValueError(f"arrays come from different array modules: {[s.__name__ for s in spaces]}")
    return spaces[0] if spaces else np


def to_numpy(x: Any) -> np.ndarray:
    """Copy ``x`` to a NumPy array (``.get()`` for CuPy, DLPack for array-api-strict)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    try:
        return np.from_dlpack(x)
    except (TypeError, RuntimeError, BufferError, AttributeError):
        return np.asarray(x)
