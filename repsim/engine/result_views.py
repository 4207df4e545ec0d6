"""A :class:`~repsim.engine.result.SimilarityResult` handed on: as a pandas frame (:func:`to_pandas`), an
xarray DataArray (:func:`to_xarray`) and a few lines of text (:func:`describe`).

The result holds, per measure, an (L, L) matrix over the columns ``index`` = [(store, layer)]; row i,
column j is m(column i, column j) (row = first argument for asymmetric measures).  Both views keep
that: ``store_a``/``layer_a`` name the row (first argument), ``store_b``/``layer_b`` the column.
"""
from __future__ import annotations

from typing import Any

import numpy as np

SimilarityResult = Any  # repsim.engine.result.SimilarityResult (not imported: result imports this module)

# the estimator settings a view carries along (xarray attrs, the repr's estimator line)
SETTINGS = ("method", "n", "batch_size", "epochs", "debiased", "spatial", "seed", "shuffle")


def to_pandas(result: SimilarityResult, *, wide: bool = False) -> Any:
    """A :class:`pandas.DataFrame` of every pair of columns and every measure.

    Tidy (default): one row per (store_a, layer_a, store_b, layer_b, measure), columns ``store_a``,
    ``layer_a``, ``store_b``, ``layer_b``, ``measure``, ``value`` (L² rows per measure, the diagonal
    and both orders included; NaN where a measure is undefined).  ``wide=True``: one row per pair,
    indexed by (store_a, layer_a, store_b, layer_b), one column per measure.
    """
    import pandas as pd

    stores = np.array([s for s, _ in result.index], dtype=object)
    layers = np.array([layer for _, layer in result.index], dtype=object)
    L = len(result.index)
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    i, j = i.ravel(), j.ravel()
    pairs = {"store_a": stores[i], "layer_a": layers[i], "store_b": stores[j], "layer_b": layers[j]}
    if wide:
        frame = pd.DataFrame({**pairs, **{m: np.asarray(result.matrix(m), dtype=np.float64).ravel()
                                          for m in result.measures}})
        return frame.set_index(["store_a", "layer_a", "store_b", "layer_b"])
    parts = [pd.DataFrame({**pairs, "measure": m, "value": np.asarray(result.matrix(m), dtype=np.float64).ravel()})
             for m in result.measures]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*pairs, "measure", "value"])


def to_xarray(result: SimilarityResult) -> Any:
    """An :class:`xarray.DataArray` of dims (``measure``, ``a``, ``b``): ``a`` the rows (first argument),
    indexed by the levels ``store_a`` and ``layer_a``, ``b`` the columns (``store_b``, ``layer_b``), so that
    ``da.sel(measure="linear_cka", store_a="resnet18", store_b="vit")`` is one store pair's block.  Attrs:
    the estimator settings and each measure's declared range (``range_<measure>``).

    Needs the ``xarray`` extra: ``pip install 'repsim-toolkit[xarray]'``."""
    from repsim.extras import require

    require("xarray", "SimilarityResult.to_xarray()")
    import xarray as xr

    stores = [s for s, _ in result.index]
    layers = [layer for _, layer in result.index]
    data = np.stack([np.asarray(result.matrix(m), dtype=np.float64) for m in result.measures])
    coords = {"measure": list(result.measures), "store_a": ("a", stores), "layer_a": ("a", layers),
              "store_b": ("b", stores), "layer_b": ("b", layers)}
    attrs: dict[str, Any] = {k: _attr(result.meta[k]) for k in SETTINGS if k in result.meta}
    for m in result.measures:
        lo, hi = measure_range(result, m)
        attrs[f"range_{m}"] = [lo, hi]
    da = xr.DataArray(data, dims=("measure", "a", "b"), coords=coords, name="similarity", attrs=attrs)
    return da.set_index(a=["store_a", "layer_a"], b=["store_b", "layer_b"])


def _attr(value: Any) -> Any:
    """A netCDF-friendly attribute (bools and None as text)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    return value if isinstance(value, (int, float, str)) else str(value)


def measure_info(result: SimilarityResult, measure: str) -> dict[str, Any]:
    """The measure's declared metadata: as recorded in the result, else the registry's (a ``repsim cka``
    file records none), else {}."""
    recorded = result.meta.get("measure_info", {}).get(measure)
    if recorded:
        return dict(recorded)
    from repsim.kernels.measures import measure_class

    try:
        return measure_class(measure).info.as_dict()
    except ValueError:
        return {}


def measure_range(result: SimilarityResult, measure: str) -> tuple[float, float]:
    """The measure's declared (min, max) (±inf where unbounded, NaN when nothing declares it)."""
    lo, hi = measure_info(result, measure).get("range", (np.nan, np.nan))
    return float(lo), float(hi)


def describe(result: SimilarityResult, kind: str = SimilarityResult) -> str:
    """What the result holds, in a few lines: measures and their estimators, stores and their layer
    counts, the estimator settings, undefined columns, and how to look at it."""
    stores = list(dict.fromkeys(s for s, _ in result.index))
    per_store = {s: sum(1 for t, _ in result.index if t == s) for s in stores}
    L = len(result.index)
    est = result.meta.get("estimators", {})
    measures = ", ".join(f"{m} ({est[m]})" if m in est else m for m in result.measures)
    shown = ", ".join(f"{s} ({k} layer{'s' if k != 1 else ''})" for s, k in list(per_store.items())[:6])
    if len(stores) > 6:
        shown += f", ... ({len(stores) - 6} more)"
    settings = ", ".join(f"{k}={result.meta[k]}" for k in SETTINGS if k in result.meta) or "not recorded"
    lines = [f"{kind}: {len(result.measures)} measure(s) over {L} columns (L × L = {L}×{L}) of {len(stores)} store(s)",
             f"  measures: {measures}",
             f"  stores:   {shown}",
             f"  settings: {settings}"]
    undefined = {m: len(v.get("columns", [])) + len(v.get("pairs", []))
                 for m, v in result.meta.get("undefined", {}).items() if isinstance(v, dict)}
    if any(undefined.values()):
        lines.append("  undefined (NaN): " + ", ".join(f"{m}: {k} column(s)/pair(s)" for m, k in undefined.items() if k))
    calibrated = list(getattr(result, "calibration", None) or {})
    if calibrated:
        lines.append(f"  permutation-calibrated: {', '.join(calibrated)}")
    lines.append("  look: .matrix(measure), .to_pandas(), .to_xarray(), .plot(kind='matrix'|'grid')")
    return "\n".join(lines)
