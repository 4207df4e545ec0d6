"""Array-namespace helpers shared by the kernels (standard array API only).

Every kernel infers its array module from its inputs (``x.__array_namespace__()`` for NumPy >= 2
and array-api-strict; CuPy arrays, which do not have that method, by type) or takes it as
``xp=...``, and from then on uses only functions of the array API standard, so the same code runs
on CPU (NumPy), GPU (CuPy) and under the strict reference namespace used in the tests. CuPy <= 13
lacks a few of those names in its main namespace; :func:`array_namespace` then hands out
``array_api_compat.cupy`` if installed, else :class:`CupyCompat`. Host-side bookkeeping (labels,
indices, the accumulators' float64 sums) is plain NumPy.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "array_namespace",
    "as_array",
    "to_numpy",
    "asarray_like",
    "on_device",
    "is_gpu_namespace",
    "is_cupy_namespace",
    "compute_dtype",
    "gram_dtype",
    "fast_float64_products",
    "flatten_examples",
    "check_finite",
    "to_host_checked",
    "host_labels",
    "unit_rows",
    "row_sq_norms",
    "astype",
    "diagonal",
]


# Names the kernels call that CuPy's main namespace lacked before it mirrored NumPy 2 (CuPy <= 13;
# its ndarray has no ``__array_namespace__`` either, so CuPy arrays are recognised by type).
_CUPY_GAPS = ("astype", "isdtype", "matrix_transpose", "acos", "concat")
_NAMESPACE_CACHE: dict[int, Any] = {}


def is_cupy_namespace(xp: Any) -> bool:
    """True for the namespaces :func:`array_namespace` gives CuPy arrays: ``cupy`` itself,
    ``array_api_compat.cupy`` and repsim's own filler ``repsim.array_api.cupy``."""
    return getattr(xp, "__name__", None) in ("cupy", "array_api_compat.cupy", "repsim.array_api.cupy")


def cupy_array_module(a: Any) -> Any:
    """The ``cupy`` module if ``a`` is a CuPy array (or subclass), else None. Never imports CuPy:
    a CuPy array can only exist once ``cupy`` is in ``sys.modules``."""
    cp = sys.modules.get("cupy")
    nd = getattr(cp, "ndarray", None)
    return cp if isinstance(nd, type) and isinstance(a, nd) else None


def _cupy_namespace(cp: Any) -> Any:
    """The one namespace used for CuPy arrays (and for ``xp=cupy``): CuPy itself when it has every
    name the kernels use (CuPy >= 14 mirrors NumPy 2), else ``array_api_compat.cupy`` when that is
    installed, else CuPy with those few names filled in (:class:`CupyCompat`)."""
    ns = _NAMESPACE_CACHE.get(id(cp))
    if ns is None:
        if all(hasattr(cp, n) for n in _CUPY_GAPS):
            ns = cp
        else:
            try:
                import array_api_compat.cupy as ns  # type: ignore[import-not-found,no-redef]
            except ImportError:
                ns = CupyCompat(cp)
        _NAMESPACE_CACHE[id(cp)] = ns
    return ns


class CupyCompat(types.ModuleType):
    """CuPy's namespace plus the array-API names the kernels use and CuPy <= 13 lacks
    (``astype``, ``isdtype``, ``matrix_transpose``, ``acos``, ``concat``); everything else is forwarded. It
    only relies on NumPy-style methods, so the tests check it wrapped around NumPy."""

    def __init__(self, cp: Any) -> None:
        super().__init__("repsim.array_api.cupy")
        self._cp = cp
        if not hasattr(cp, "acos"):
            self.acos = cp.arccos
        if not hasattr(cp, "bool"):
            self.bool = cp.bool_
        if not hasattr(cp, "concat"):
            self.concat = cp.concatenate

    def __getattr__(self, name: str) -> Any:  # only called for names not set on the instance
        return getattr(self._cp, name)

    @staticmethod
    def astype(x: Any, dtype: Any, /, *, copy: bool = True) -> Any:
        return x.astype(dtype, copy=copy)

    @staticmethod
    def matrix_transpose(x: Any, /) -> Any:
        return x.swapaxes(-1, -2)

    @staticmethod
    def isdtype(dtype: Any, kind: Any) -> bool:
        return bool(np.isdtype(np.dtype(dtype), kind))  # CuPy dtypes are NumPy dtypes


def _namespace_of(a: Any) -> Any:
    cp = cupy_array_module(a)
    if cp is not None:
        return _cupy_namespace(cp)
    get = getattr(a, "__array_namespace__", None)
    return get() if get is not None else np


def _normalize(xp: Any) -> Any:
    """A namespace passed by the caller: the bare ``cupy`` module gets the same treatment as its arrays."""
    if getattr(xp, "__name__", None) == "cupy" and sys.modules.get("cupy") is xp:
        return _cupy_namespace(xp)
    return xp


def array_namespace(*arrays: Any, xp: Any = None) -> Any:
    """The array API namespace shared by ``arrays`` (``xp`` wins when given).

    ``x.__array_namespace__()`` where the array has it (NumPy >= 2, array-api-strict); CuPy arrays
    are recognised by type (see :func:`_cupy_namespace`). Plain Python sequences and scalars fall
    back to NumPy. Mixing namespaces raises ``TypeError`` (e.g. a CuPy array with a NumPy array),
    because silently copying between devices hides real cost.
    """
    if xp is not None:
        return _normalize(xp)
    found = None
    for a in arrays:
        if a is None:
            continue
        ns = _namespace_of(a)
        if found is None:
            found = ns
        elif ns is not found:
            raise TypeError(
                f"inputs come from different array namespaces ({found.__name__} and {ns.__name__}); "
                "convert them to one namespace first"
            )
    return np if found is None else found


def as_array(x: Any, xp: Any = None) -> Any:
    """``x`` itself when it is an array (has ``shape`` and ``dtype``), else ``xp.asarray(x)``
    (NumPy by default): the kernels accept nested lists and tuples like NumPy does."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    return (np if xp is None else xp).asarray(x)


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


def on_device(make: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
    """``make(*args, device=device, **kwargs)`` — ``xp.zeros``, ``xp.empty``, ``xp.ones``,
    ``xp.asarray``, ... — on ``device`` (an input array's ``x.device``): the array API's keyword
    (NumPy >= 2, array-api-strict); a CuPy ``Device`` is entered instead (CuPy's allocations follow
    the current device, and its main namespace may not take the keyword); a namespace without
    the keyword allocates where it allocates.  ``device=None``: ``make``'s default."""
    if device is None:
        return make(*args, **kwargs)
    if hasattr(device, "__enter__"):  # cupy.cuda.Device
        with device:
            return make(*args, **kwargs)
    try:
        return make(*args, device=device, **kwargs)
    except TypeError:  # namespaces without the device keyword
        return make(*args, **kwargs)


def asarray_like(a: Any, ref: Any, xp: Any, dtype: Any = None) -> Any:
    """``a`` (host data) as an array of namespace ``xp`` on the device of ``ref``."""
    return on_device(xp.asarray, a, dtype=dtype, device=getattr(ref, "device", None))


def is_gpu_namespace(xp: Any, x: Any = None) -> bool:
    """True for namespaces/arrays that live on an accelerator (CuPy, or a non-CPU device)."""
    if is_cupy_namespace(xp):
        return True
    dev = getattr(x, "device", None)
    if dev is None or isinstance(dev, str) and dev == "cpu":
        return False
    name = str(dev).lower()
    return "cuda" in name or "gpu" in name


def compute_dtype(xp: Any, x: Any, requested: Any = None) -> Any:
    """Working floating dtype of the moment-type kernels (separation, collapse, spectra).

    ``requested`` ("float32"/"float64"/an xp dtype) wins. Otherwise float64 on the CPU, and on a
    GPU float32 unless the input already is float64.  (CKA's Grams follow :func:`gram_dtype`.)
    """
    if requested is not None:
        return _requested_dtype(xp, requested)
    if is_gpu_namespace(xp, x) and x.dtype != xp.float64:
        return xp.float32
    return xp.float64


def _requested_dtype(xp: Any, requested: Any) -> Any:
    if isinstance(requested, str):
        if requested not in ("float32", "float64"):
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {requested!r}")
        return getattr(xp, requested)
    return requested


def gram_dtype(dtype: Any, xp: Any, requested: Any = None) -> Any:
    """Precision of a column's centred batch Gram in linear CKA: the one rule of the in-memory
    kernels (``repsim.kernels.hsic``) and the out-of-core engine (docs/architecture.md "Numerics").

    ``requested`` ("float32" | "float64" | an xp dtype) wins.  Otherwise float32 for columns
    given or stored in a floating dtype of at most 4 bytes (float16, bfloat16, float32) and float64
    for everything else (float64, integers) — except on a GPU whose float64 products are about as
    fast as its float32 ones (:func:`fast_float64_products`: A100/H100/H200), where every Gram is
    float64 (faster there than float32 slabs, and exact to float64).  float32 Grams keep the error bound of
    ``repsim.kernels.hsic`` (module docstring, "Error bound"): features are centred in float64 and
    rounded once, products are summed in float32 over feature slabs of at most
    ``GRAM_SLAB`` (2048) and the slabs in float64, and every later sum (U-centring, the L × L
    HSIC product, the sums over batches) is float64.  ``dtype`` is the column's dtype (or its
    name, as stores record it).
    """
    if requested is not None:
        return _requested_dtype(xp, requested)
    try:
        small_float = xp.isdtype(dtype, "real floating") and xp.finfo(dtype).bits <= 32
    except (TypeError, ValueError, AttributeError):  # a name, or a dtype of another namespace
        nd = np.dtype(dtype)
        small_float = nd.kind == "f" and nd.itemsize <= 4
    if small_float and fast_float64_products(xp):
        return xp.float64
    return xp.float32 if small_float else xp.float64


FAST64_RATIO = 1.25  # float64 Grams on a GPU whose float64 products take at most this multiple of float32's time
_FAST64: dict[int, bool] = {}


def fast_float64_products(xp: Any) -> bool:
    """True on a CuPy device whose float64 matrix products run about as fast as its float32 ones
    (data-centre GPUs with float64 matrix units: A100, H100, H200 — on an H100, 64 float64 Grams of
    1,500 × 4,096 ran at 54 TFLOP/s against 44 for float32, bench/RESULTS.md "gpu"), where
    :func:`gram_dtype` then forms the Grams of float16/32 columns in float64: faster than float32
    slabs summed in float64, and exact to float64 rounding.  Measured once per device: the best of
    three (1,024 × 4,096) · (4,096 × 1,024) products in each dtype after a warm-up; float64 counts
    as fast when it takes at most ``FAST64_RATIO`` × float32's time (consumer GPUs run float64 at
    1/32-1/64 of float32).  False for every other namespace."""
    cp = sys.modules.get("cupy")
    if not is_cupy_namespace(xp) or cp is None or not hasattr(cp, "cuda"):
        return False
    dev = int(cp.cuda.Device().id)
    if dev not in _FAST64:
        _FAST64[dev] = _time_product(cp, cp.float64) <= FAST64_RATIO * _time_product(cp, cp.float32)
    return _FAST64[dev]


def _time_product(cp: Any, dtype: Any) -> float:
    a = cp.random.default_rng(0).standard_normal((1024, 4096)).astype(dtype)
    a @ a.T  # warm-up (library handles, kernel choice)
    best = float("inf")
    for _ in range(3):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        a @ a.T
        stop.record()
        stop.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, stop))
    return best


_HALF_TABLES: dict[str, np.ndarray] = {}


def _half_table(name: str) -> np.ndarray:
    """All 65,536 float16 bit patterns converted once to float32/float64 (256/512 KiB, cached)."""
    t = _HALF_TABLES.get(name)
    if t is None:
        t = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(name)
        t.setflags(write=False)
        _HALF_TABLES[name] = t
    return t


_TWO_112 = np.float32(2.0 ** 112)
_SMALLEST_HALF = np.array([1], dtype=np.uint32) << 13  # float16's smallest subnormal, float32 bits


def _subnormals_kept() -> bool:
    """False when this thread's FPU flushes subnormal inputs to zero (DAZ), which would break the
    exponent-rebias conversion below for float16 subnormals."""
    return float(_SMALLEST_HALF.view(np.float32)[0] * _TWO_112) == 2.0 ** -24


def _half_upcast(h: np.ndarray, name: str) -> np.ndarray:
    """Exact float16 -> ``name`` ("float32" | "float64") for NumPy arrays.

    When every value is non-negative and finite (the bit patterns are all below 0x7c00: post-ReLU
    activations), the float16 bits shifted left by 13 are a float32 whose exponent is short by
    127 − 15 = 112, subnormals included (they land on float32 subnormals), so one multiplication by
    2¹¹² finishes the conversion exactly: four vector passes (max, widen, shift, scale), ~0.5 ns
    per element against ~1.4 for a table lookup and 5.6 for NumPy's own loop, which branches per
    element on zero/subnormal/normal and mispredicts on post-ReLU data (2-core CI box); float64 is
    then one exact widening.  Anything else (negative values, inf, NaN — whose payloads NumPy's
    conversion keeps — or a thread that flushes subnormals) goes through a table of all 65,536
    half values built by NumPy's own conversion (``np.take``, bit-exact).
    """
    u = h.view(np.uint16)
    if u.size and int(u.max()) < 0x7C00 and _subnormals_kept():
        w = u.astype(np.uint32)
        w <<= 13
        f = w.view(np.float32)
        f *= _TWO_112
        return f if name == "float32" else f.astype(np.float64)
    return np.take(_half_table(name), u)


def astype(x: Any, dtype: Any, xp: Any) -> Any:
    """``xp.astype(x, dtype)``, with an exact fast path for NumPy float16 -> float32/float64
    (:func:`_half_upcast`); the array's own ``astype`` method where ``xp`` has no such function
    (CuPy <= 13 handed in as the module itself)."""
    if (isinstance(x, np.ndarray) and x.dtype == np.float16
            and np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))):
        return _half_upcast(x, np.dtype(dtype).name)
    fn = getattr(xp, "astype", None)
    return fn(x, dtype) if fn is not None else x.astype(dtype)


def flatten_examples(x: Any, xp: Any, dtype: Any = None, what: str = "X") -> Any:
    """(n, ...) -> (n, prod(...)) in ``dtype``; 1-D input is one feature per example."""
    x = as_array(x, xp)
    if x.ndim == 0:
        raise ValueError(f"{what} must have an example axis, got a scalar")
    if x.ndim == 1:
        x = xp.reshape(x, (x.shape[0], 1))
    elif x.ndim > 2:
        x = xp.reshape(x, (x.shape[0], -1))
    if dtype is not None and x.dtype != dtype:
        x = astype(x, dtype, xp)
    return x


class UndefinedMetric(ValueError):
    """A metric that has no value on this data — a layer constant over the examples (zero total
    distance for R², coinciding class means for collapse) — as opposed to bad data (NaN/inf), which
    is a plain ``ValueError``.  Direct calls raise it; the streaming drivers report the layer's
    metric as NaN, name the layer once, and compute every other layer."""


def _defers(xp: Any, deferred: list | None) -> bool:
    """A check is deferred (kept on the device as a 0-d array) when the caller collects them and
    the namespace is not NumPy (where reading the answer costs nothing)."""
    return deferred is not None and getattr(xp, "__name__", "") != "numpy"


def _raise_nonfinite(what: str) -> Callable[[float], None]:
    def test(bad: float) -> None:
        if bad != 0:
            raise ValueError(f"{what} contains NaN or infinite values")
    return test


def check_finite(x: Any, xp: Any, what: str = "X", deferred: list | None = None) -> None:
    """Raise ``ValueError`` when ``x`` holds NaN or infinity (never return a silent NaN).

    ``deferred`` (a list): on an accelerator the test is appended there as ``(flag, test)`` — a
    0-d device array and the host function that raises on its value — instead of synchronising
    here; :func:`to_host_checked` runs it with the batch's one copy to the host."""
    if _defers(xp, deferred):
        deferred.append((xp.any(xp.logical_not(xp.isfinite(x))), _raise_nonfinite(what)))
        return
    if not bool(xp.all(xp.isfinite(x))):
        raise ValueError(f"{what} contains NaN or infinite values")


def to_host_checked(parts: Sequence[Any], xp: Any, deferred: Sequence[tuple[Any, Callable[[float], None]]] = ()
                    ) -> list[np.ndarray]:
    """``parts`` (arrays of ``xp``) as float64 host arrays of the same shapes, after the deferred
    checks (:func:`check_finite`, :func:`unit_rows` with ``deferred=``) have run in order on their
    values — all in one device-to-host copy (one synchronisation) on an accelerator."""
    if getattr(xp, "__name__", "") == "numpy" or not (deferred or len(parts) > 1):
        for flag, test in deferred:
            test(float(to_numpy(flag)))
        return [np.asarray(to_numpy(p), dtype=np.float64) for p in parts]
    dt = parts[0].dtype if parts else xp.float64
    flat = [xp.reshape(p if p.dtype == dt else astype(p, dt, xp), (-1,)) for p in parts]
    flat += [xp.reshape(astype(flag, dt, xp), (1,)) for flag, _ in deferred]
    host = np.asarray(to_numpy(xp.concat(flat)), dtype=np.float64)
    sizes = [int(np.prod(p.shape)) for p in parts]
    end = sum(sizes)
    for (_, test), value in zip(deferred, host[end:].tolist()):
        test(value)
    out, at = [], 0
    for p, k in zip(parts, sizes):
        out.append(host[at:at + k].reshape(tuple(p.shape)))
        at += k
    return out


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


def diagonal(K: Any, xp: Any) -> Any:
    """Main diagonal of a matrix (``xp.linalg.diagonal`` in the array API; CuPy's ``xp.diagonal``)."""
    fn = getattr(getattr(xp, "linalg", None), "diagonal", None)
    return fn(K) if fn is not None else xp.diagonal(K)


def row_sq_norms(X: Any, xp: Any) -> Any:
    """Squared L2 norm of every row of a 2-D array (``vecdot`` when the namespace has it: no temporary)."""
    vecdot = getattr(xp, "vecdot", None)
    return vecdot(X, X) if vecdot is not None else xp.sum(X * X, axis=1)


def _raise_zero_rows(what: str) -> Callable[[float], None]:
    def test(zero: float) -> None:
        if zero:
            raise ValueError(f"{what}: {int(zero)} row(s) are all zero; cosine similarity is undefined")
    return test


def unit_rows(X: Any, xp: Any, what: str = "X", deferred: list | None = None) -> Any:
    """Rows of X scaled to unit L2 norm; ``ValueError`` if a row is all zero (cosine undefined).
    ``deferred``: the count of zero rows is checked later, with the batch's copy to the host
    (:func:`check_finite`)."""
    norms = xp.sqrt(row_sq_norms(X, xp))
    if _defers(xp, deferred):
        zero = norms == 0
        deferred.append((xp.sum(xp.astype(zero, xp.int32)), _raise_zero_rows(what)))
        return X / xp.where(zero, xp.ones_like(norms), norms)[:, None]  # (refused before it is used)
    _raise_zero_rows(what)(int(xp.sum(xp.astype(norms == 0, xp.int32))))
    return X / norms[:, None]
