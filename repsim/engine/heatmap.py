"""Heatmaps of a :class:`~repsim.engine.result.SimilarityResult` (``result.plot()``, ``repsim plot``).

Two kinds, both returning a :class:`matplotlib.figure.Figure`:

- ``"matrix"``: the (store, layer) × (store, layer) matrix of every column, one panel per measure, the
  stores in blocks separated by lines, each block labelled with its store, layer ticks thinned to
  at most :data:`MAX_TICKS` per axis;
- ``"grid"``: one panel per (store A, store B) pair, layers of A (rows, the first argument) against
  layers of B (columns) — the paper's Fig. 2a for any stores — for one measure.

The colour scale is the measure's declared range (:class:`~repsim.kernels.measures.MeasureInfo`
``range``; an unbounded end is taken from the data), values beyond it in the end colours with an
extended colour bar; NaN (a column or pair the measure cannot define) is drawn in :data:`NAN_COLOUR`
with a legend entry saying so.

``calibrated=True`` draws the calibrated scores of the result's permutation (or analytic) null instead
(``SimilarityResult.calibrated``: Gröger et al. 2026, 0 = not above chance) on [0, 1] ([0, max] for a
measure without an upper bound) and dots every cell whose p-value exceeds the null's α
(:func:`mark_cells`); a result without a null for the measure is refused in one line.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from repsim.engine.result_views import measure_range

SimilarityResult = Any  # repsim.engine.result.SimilarityResult (not imported: result imports this module)

KINDS = ("matrix", "grid")
MAX_TICKS = 24  # layer ticks per axis of a matrix panel (per store-pair panel: 8)
NAN_COLOUR = "#d0d0d0"  # light grey: not a colour of the viridis map
CMAP = "viridis"


def select(result: SimilarityResult, stores: Sequence[str] | None = None,
           layers: Sequence[str] | Mapping[str, Sequence[str]] | None = None) -> list[int]:
    """Positions in ``result.index`` of the chosen columns: ``stores`` (names, in the order given; default
    all, in the result's order) and ``layers`` (names kept in every store, or {store: names}; default all).
    ``KeyError`` naming the known ones for an unknown store, or for a layer no chosen store has."""
    known = list(dict.fromkeys(s for s, _ in result.index))
    chosen = list(dict.fromkeys(stores)) if stores else known
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise KeyError(f"unknown store(s) {', '.join(unknown)}; this result's stores: {', '.join(known)}")
    if layers is None:
        want: Mapping[str, Any] = {}
    elif isinstance(layers, Mapping):
        want = {s: set(v) for s, v in layers.items()}
    else:
        want = {s: set(layers) for s in chosen}
    if want:
        have = {layer for s, layer in result.index if s in chosen}
        missing = sorted(set().union(*want.values()) - have)
        if missing:
            raise KeyError(f"unknown layer(s) {', '.join(missing)}; the chosen stores' layers: "
                           f"{', '.join(dict.fromkeys(l for s, l in result.index if s in chosen))}")
    picked = [k for s in chosen for k, (t, layer) in enumerate(result.index)
              if t == s and (s not in want or layer in want[s])]
    if not picked:
        raise KeyError("no column left: the chosen stores have none of the chosen layers")
    return picked


def colour_limits(result: SimilarityResult, measure: str, values: np.ndarray) -> tuple[float, float, str]:
    """(vmin, vmax, colour-bar extend) from the measure's declared range; an unbounded or undeclared
    end is the data's (0 when the data give none); ``extend`` marks values beyond a declared end."""
    lo, hi = measure_range(result, measure)
    finite = values[np.isfinite(values)]
    dmin = float(finite.min()) if finite.size else 0.0
    dmax = float(finite.max()) if finite.size else 1.0
    vmin = lo if math.isfinite(lo) else min(dmin, 0.0)
    vmax = hi if math.isfinite(hi) else max(dmax, vmin + 1.0)
    if vmax <= vmin:
        vmax = vmin + 1.0
    below, above = finite.size and dmin < vmin - 1e-12, finite.size and dmax > vmax + 1e-12
    return vmin, vmax, {(False, False): "neither", (True, False): "min", (False, True): "max"}.get(
        (bool(below), bool(above)), "both")


def thin(n: int, max_ticks: int) -> list[int]:
    """Tick positions 0, k, 2k, ... (k = ceil(n / max_ticks)): at most ``max_ticks``."""
    return list(range(0, n, max(1, math.ceil(n / max_ticks))))


def _label(measure: str) -> str:
    from repsim.kernels.measures import measure_label

    return measure_label(measure)


def _cmap() -> Any:
    import matplotlib

    return matplotlib.colormaps[CMAP].with_extremes(bad=NAN_COLOUR)


def _nan_note(fig: Any, count: int) -> None:
    """A legend entry under the panels: the NaN colour and what it means."""
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor=NAN_COLOUR, edgecolor="0.4", hatch="///",
                              label=f"NaN: undefined for this measure ({count} cell{'s' if count != 1 else ''}; "
                                    "e.g. a constant column)")],
               loc="outside lower center", frameon=False, fontsize=8, ncol=1)


def mark_cells(ax: Any, mask: np.ndarray, size: float = 9.0) -> int:
    """Dot the cells of an ``imshow`` panel where ``mask`` is True (not significant) with a white dot with a
    black rim, readable on every colour and in print; the dots are one collection with gid
    ``"not-significant"`` whose offsets are the (column, row) of the marked cells. Returns how many."""
    rows, cols = np.nonzero(np.asarray(mask, bool))
    if len(rows):
        coll = ax.scatter(cols, rows, s=size, marker="o", facecolors="white", edgecolors="black", linewidths=0.5,
                          zorder=3)
        coll.set_gid("not-significant")
    return int(len(rows))


def not_significant(result: SimilarityResult, measure: str) -> np.ndarray:
    """(L, L) bool: the cells whose p-value exceeds the null's α (:func:`above_alpha`)."""
    return above_alpha(result.pvalues(measure), null_alpha(result))


def above_alpha(pvalues: Any, alpha: float) -> np.ndarray:
    """Where a p-value exceeds ``alpha`` (the cells to dot); undefined, NaN cells are not."""
    p = np.asarray(pvalues, dtype=np.float64)
    return np.isfinite(p) & (np.nan_to_num(p) > alpha)


def null_alpha(result: SimilarityResult) -> float:
    """The α the result's null was computed at (its thresholds τ and calibrated scores use it)."""
    return float(result.meta.get("calibration", {}).get("alpha", 0.05))


def _check_null(result: SimilarityResult, measures: Sequence[str]) -> None:
    missing = [m for m in measures if m not in getattr(result, "calibration", {})]
    if missing:
        raise ValueError(f"calibrated=True: this result has no null for {', '.join(missing)}; compute one with "
                         "`repsim similarity ... --permutations K` (or --null analytic)")


def _panel_values(result: SimilarityResult, measure: str, picked: list[int], calibrated: bool) -> np.ndarray:
    full = result.calibrated(measure) if calibrated else result.matrix(measure)
    return np.asarray(full, dtype=np.float64)[np.ix_(picked, picked)]


def _limits(result: SimilarityResult, measure: str, values: np.ndarray, calibrated: bool) -> tuple[float, float, str]:
    if not calibrated:
        return colour_limits(result, measure, values)
    finite = values[np.isfinite(values)]
    top = measure_range(result, measure)[1]
    hi = 1.0 if math.isfinite(top) else max(1.0, float(finite.max()) if finite.size else 1.0)
    return 0.0, hi, "neither"


def _colour_label(result: SimilarityResult, measure: str, calibrated: bool) -> str:
    if calibrated:
        return (f"calibrated {_label(measure)} (0 = not above chance at α = {null_alpha(result):g}; "
                "dot: p > α)")
    return f"{_label(measure)} (declared range {_range_text(*measure_range(result, measure))})"


def _hatch_nan(ax: Any, values: np.ndarray) -> None:
    """Hatch the NaN cells (on top of their grey), one rectangle per run of NaN cells in a row."""
    from matplotlib.patches import Rectangle

    for i, row in enumerate(np.isnan(values)):
        j = 0
        while j < len(row):
            if row[j]:
                k = j
                while k < len(row) and row[k]:
                    k += 1
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), k - j, 1, fill=False, hatch="///",
                                       edgecolor="0.45", linewidth=0))
                j = k
            else:
                j += 1


def plot(result: SimilarityResult, measure: str | Sequence[str] | None = None, *,
         stores: Sequence[str] | None = None, layers: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
         kind: str = "matrix", title: str | None = None, calibrated: bool = False) -> Any:
    """The heatmap figure of ``result`` (module docstring): ``measure`` one name or several (default: every
    measure for ``"matrix"``, the first — linear CKA when present — for ``"grid"``, which draws one);
    ``stores``/``layers`` choose the columns (:func:`select`); ``title`` above the panels (default: the
    result's stores and n); ``calibrated``: calibrated scores, non-significant cells dotted (module
    docstring).  Returns a matplotlib Figure (not shown; ``fig.savefig(path)``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if measure is None:
        measures = list(result.measures) if kind == "matrix" else list(result.measures[:1])
    else:
        measures = [measure] if isinstance(measure, str) else list(dict.fromkeys(measure))
    for m in measures:
        if m not in result.measures:
            raise KeyError(f"unknown measure {m!r}; this result holds: {', '.join(result.measures)}")
    if kind == "grid" and len(measures) != 1:
        raise ValueError(f"kind='grid' draws one measure; got {', '.join(measures)}")
    if not measures:
        raise ValueError("this result holds no measure")
    if calibrated:
        _check_null(result, measures)
    picked = select(result, stores, layers)
    index = [result.index[k] for k in picked]
    n = result.meta.get("n")
    default_title = (f"{len(dict.fromkeys(s for s, _ in index))} store(s), {len(index)} columns"
                     + (f", n = {n}" if n is not None else ""))
    if kind == "matrix":
        return _matrix(result, measures, picked, index, title or default_title, calibrated)
    return _grid(result, measures[0], picked, index, title or default_title, calibrated)


def _blocks(index: Sequence[tuple[str, str]]) -> list[tuple[str, int, int]]:
    """[(store, start, stop)] of the contiguous runs of one store in ``index``."""
    out: list[tuple[str, int, int]] = []
    for k, (s, _) in enumerate(index):
        if out and out[-1][0] == s:
            out[-1] = (s, out[-1][1], k + 1)
        else:
            out.append((s, k, k + 1))
    return out


def _matrix(result: SimilarityResult, measures: list[str], picked: list[int],
            index: list[tuple[str, str]], title: str, calibrated: bool = False) -> Any:
    from matplotlib.figure import Figure

    L = len(index)
    side = float(np.clip(3.2 + 0.16 * L, 5.0, 13.0))
    fig = Figure(figsize=(side * len(measures) + 1.2 * len(measures), side + 0.7), layout="constrained")
    axes = fig.subplots(1, len(measures), squeeze=False)[0]
    blocks = _blocks(index)
    ticks = thin(L, MAX_TICKS)
    nan_cells = 0
    for ax, m in zip(axes, measures):
        values = _panel_values(result, m, picked, calibrated)
        vmin, vmax, extend = _limits(result, m, values, calibrated)
        im = ax.imshow(np.ma.masked_invalid(values), cmap=_cmap(), vmin=vmin, vmax=vmax, interpolation="nearest")
        if np.isnan(values).any():
            nan_cells += int(np.isnan(values).sum())
            _hatch_nan(ax, values)
        if calibrated:
            mark_cells(ax, not_significant(result, m)[np.ix_(picked, picked)], size=_dot(side, L))
        for _, start, _ in blocks[1:]:
            ax.axhline(start - 0.5, color="white", lw=1.6)
            ax.axvline(start - 0.5, color="white", lw=1.6)
        ax.set_xticks(ticks, [index[k][1] for k in ticks], rotation=90, fontsize=7)
        ax.set_yticks(ticks, [index[k][1] for k in ticks], fontsize=7)
        centers = [(a + b - 1) / 2 for _, a, b in blocks]
        top = ax.secondary_xaxis("top")
        top.set_xticks(centers, [s for s, _, _ in blocks], rotation=30 if len(blocks) > 3 else 0, fontsize=8,
                       ha="left" if len(blocks) > 3 else "center")
        top.tick_params(length=0)
        ax.set_ylabel("layer (row: first argument)" if not _symmetric(result, m) else "layer", fontsize=8)
        ax.set_xlabel("layer", fontsize=8)
        right = ax.secondary_yaxis("right")
        right.set_yticks(centers, [s for s, _, _ in blocks], rotation=90, fontsize=8, va="center")
        right.tick_params(length=0)
        ax.set_title(("calibrated " if calibrated else "") + _label(m), fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8, extend=extend, label=_colour_label(result, m, calibrated))
    fig.suptitle(title, fontsize=10)
    if nan_cells:
        _nan_note(fig, nan_cells)
    return fig


def _grid(result: SimilarityResult, measure: str, picked: list[int], index: list[tuple[str, str]],
          title: str, calibrated: bool = False) -> Any:
    from matplotlib.figure import Figure

    values = _panel_values(result, measure, picked, calibrated)
    marks = not_significant(result, measure)[np.ix_(picked, picked)] if calibrated else None
    blocks = _blocks(index)
    S = len(blocks)
    vmin, vmax, extend = _limits(result, measure, values, calibrated)
    panel = float(np.clip(9.0 / S, 1.6, 3.0))
    fig = Figure(figsize=(panel * S + 1.6, panel * S + 1.2), layout="constrained")
    axes = fig.subplots(S, S, squeeze=False)
    im = None
    nan_cells = 0
    for r, (sa, a0, a1) in enumerate(blocks):
        for c, (sb, b0, b1) in enumerate(blocks):
            ax = axes[r, c]
            block = values[a0:a1, b0:b1]
            im = ax.imshow(np.ma.masked_invalid(block), cmap=_cmap(), vmin=vmin, vmax=vmax, aspect="auto",
                           interpolation="nearest")
            if np.isnan(block).any():
                nan_cells += int(np.isnan(block).sum())
                _hatch_nan(ax, block)
            if marks is not None:
                mark_cells(ax, marks[a0:a1, b0:b1], size=_dot(panel, max(a1 - a0, b1 - b0)))
            xt, yt = thin(b1 - b0, 8), thin(a1 - a0, 8)
            ax.set_xticks(xt, [index[b0 + k][1] for k in xt] if r == S - 1 else [], rotation=90, fontsize=6)
            ax.set_yticks(yt, [index[a0 + k][1] for k in yt] if c == 0 else [], fontsize=6)
            if r == 0:
                ax.set_title(sb, fontsize=8)
            if c == 0:
                ax.set_ylabel(sa, fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6, extend=extend, label=_colour_label(result, measure, calibrated))
    fig.suptitle(f"{'calibrated ' if calibrated else ''}{_label(measure)}: rows = layers of the store on the left (first argument), columns = "
                 f"layers of the store above; {title}", fontsize=9)
    if nan_cells:
        _nan_note(fig, nan_cells)
    return fig


def _dot(inches: float, cells: int) -> float:
    """Marker area (points²) of a dot about a third of a cell wide, 2-5 points across."""
    across = float(np.clip(72.0 * inches / max(cells, 1) / 3.0, 2.0, 5.0))
    return across * across


def _symmetric(result: SimilarityResult, measure: str) -> bool:
    from repsim.engine.result_views import measure_info

    return bool(measure_info(result, measure).get("symmetric", True))


def _range_text(lo: float, hi: float) -> str:
    if not (math.isfinite(lo) or math.isfinite(hi)) and (math.isnan(lo) or math.isnan(hi)):
        return "not declared"
    return (f"[{lo:g}" if math.isfinite(lo) else "(−∞") + ", " + (f"{hi:g}]" if math.isfinite(hi) else "∞)")
