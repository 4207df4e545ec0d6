"""Array-namespace helpers shared by the kernels (standard array API only).

Every kernel infers its array module from its inputs (``x.__array_namespace__()``: NumPy >= 2,
CuPy >= 13 and array-api-strict all provide it) or takes it as ``xp=...``, and from then on uses
only functions of the array API standard, so the same code runs on CPU (NumPy), GPU (CuPy) and under
the strict reference namespace used in the tests. Host-side bookkeeping (labels, indices, the
accumulators' float64 sums) is plain NumPy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "array_namespace",
    "to_numpy",
    "asarray_like",
    "is_gpu_namespace",
    "compute_dtype",
    "flatten_examples",
    "check_finite",
    "host_labels",
    "unit_rows",
    "row_sq_norms",
]


def array_namespace(*arrays: Any, xp: Any = None) -> Any:
    """The array API namespace shared by ``arrays`` (``xp`` wins when given).

    Plain Python sequences and NumPy < 2 arrays fall back to NumPy. Mixing namespaces raises
    ``TypeError`` (e.g. a CuPy array with a NumPy array), because silently copying between devices
    hides real cost.
    """
    if xp is not None:
        return xp
    found = None
    for a in arrays:
        if a is None:
            continue
        get = getattr(a, "__array_namespace__", None)
        ns = get() if get is not None else np
        if found is None:
            found = ns
        elif ns is not found:
            raise TypeError(
                f"inputs come from different array namespaces ({found.__name__} and {ns.__name__}); "
                "convert them to one namespace first"
            )
    return np if found is None else found


def to_numpy(x: Any) -> np.ndarray:
    """Copy any array (NumPy, CuPy, array-api-strict, scalars) to a NumPy array on the host."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)  # CuPy
    if get is not None and type(x).__module__.startswith("cupy"):
        return get()
    try:
        return np.from_dlpack(x)
    except Exception:  # noqa: BLE001 - fall back to the buffer/array protocol
        return np.asarray(x)


def asarray_like(a: Any, ref: Any, xp: Any, dtype: Any = None) -> Any:
    """``a`` (host data) as an array of namespace ``xp`` on the device of ``ref``."""
    device = getattr(ref, "device", None)
    try:
        return xp.asarray(a, dtype=dtype, device=device)
    except TypeError:  # namespaces without the device keyword
        return xp.asarray(a, dtype=dtype)


def is_gpu_namespace(xp: Any, x: Any = None) -> bool:
    """True for namespaces/arrays that live on an accelerator (CuPy, or a non-CPU device)."""
    if xp.__name__.split(".")[0] in ("cupy", "cupyx"):
        return True
    dev = getattr(x, "device", None)
    if dev is None or isinstance(dev, str) and dev == "cpu":
        return False
    name = str(dev).lower()
    return "cuda" in name or "gpu" in name


def compute_dtype(xp: Any, x: Any, requested: Any = None) -> Any:
    """Working floating dtype for Gram-type kernels (DESIGN.md "Numerics").

    ``requested`` ("float32"/"float64"/an xp dtype) wins. Otherwise float64 on the CPU, and on a
    GPU float32 unless the input already is float64.
    """
    if requested is not None:
        if isinstance(requested, str):
            if requested not in ("float32", "float64"):
                raise ValueError(f"compute_dtype must be 'float32' or 'float64', got {requested!r}")
            return getattr(xp, requested)
        return requested
    if is_gpu_namespace(xp, x) and x.dtype != xp.float64:
        return xp.float32
    return xp.float64


def flatten_examples(x: Any, xp: Any, dtype: Any = None, what: str = "X") -> Any:
    """(n, ...) -> (n, prod(...)) in ``dtype``; 1-D input is one feature per example."""
    if x.ndim == 0:
        raise ValueError(f"{what} must have an example axis, got a scalar")
    if x.ndim == 1:
        x = xp.reshape(x, (x.shape[0], 1))
    elif x.ndim > 2:
        x = xp.reshape(x, (x.shape[0], -1))
    if dtype is not None and x.dtype != dtype:
        x = xp.astype(x, dtype)
    return x


def check_finite(x: Any, xp: Any, what: str = "X") -> None:
    """Raise ``ValueError`` when ``x`` holds NaN or infinity (never return a silent NaN)."""
    if not bool(xp.all(xp.isfinite(x))):
        raise ValueError(f"{what} contains NaN or infinite values")


def host_labels(labels: Any, n: int, num_classes: int | None, what: str = "labels") -> np.ndarray:
    """Labels as a host int64 vector of length ``n``, checked against ``num_classes``."""
    y = to_numpy(labels)
    if y.ndim != 1 or y.shape[0] != n:
        raise ValueError(f"{what} must be a vector of length {n}, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError(f"{what} must be integers")
    y = y.astype(np.int64, copy=False)
    if num_classes is not None and y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{what} must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return y


def row_sq_norms(X: Any, xp: Any) -> Any:
    """Squared L2 norm of every row of a 2-D array (``vecdot`` when the namespace has it: no temporary)."""
    vecdot = getattr(xp, "vecdot", None)
    return vecdot(X, X) if vecdot is not None else xp.sum(X * X, axis=1)


def unit_rows(X: Any, xp: Any, what: str = "X") -> Any:
    """Rows of X scaled to unit L2 norm; ``ValueError`` if a row is all zero (cosine undefined)."""
    norms = xp.sqrt(row_sq_norms(X, xp))
    zero = int(xp.sum(xp.astype(norms == 0, xp.int32)))
    if zero:
        raise ValueError(f"{what}: {zero} row(s) are all zero; cosine similarity is undefined")
    return X / norms[:, None]
