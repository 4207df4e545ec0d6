"""Shared look of the figures: readable fonts, one fixed colour per objective, number formatting."""
from __future__ import annotations

import math

from repsim.analyses.data import OBJECTIVES, objective_key, split_label

_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def apply_style() -> None:
    import matplotlib as mpl

    mpl.rcParams.update({
        "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5,
        "xtick.labelsize": 9, "ytick.labelsize": 9, "figure.dpi": 100, "axes.spines.top": False,
        "axes.spines.right": False, "pdf.fonttype": 42, "savefig.facecolor": "white",
    })


_VARIANTS: dict[str, str] = {}


def set_palette(labels) -> None:
    """Give parameter settings and training variants of one objective (``"cosine_softmax (tau=0.05)"``,
    ``"softmax [autoaugment]"``, ...) distinct shades of the objective's colour, darkest first in sorted order."""
    from matplotlib.colors import to_rgb

    _VARIANTS.clear()
    by_objective: dict[str, list[str]] = {}
    for label in sorted(set(labels), key=objective_key):
        objective, params, variant = split_label(label)
        if params or variant:
            by_objective.setdefault(objective, []).append(label)
    for objective, variants in by_objective.items():
        base = to_rgb(_base(objective))
        for i, label in enumerate(variants):
            t = (i / (len(variants) - 1) if len(variants) > 1 else 0.5) * 1.2 - 0.6  # -0.6 dark .. 0.6 light
            mix = (0, 0, 0) if t < 0 else (1, 1, 1)
            rgb = [c + abs(t) * (m - c) for c, m in zip(base, mix)]
            _VARIANTS[label] = "#" + "".join(f"{round(255 * c):02x}" for c in rgb)


def _base(objective: str) -> str:
    if objective in OBJECTIVES:
        return _TAB10[OBJECTIVES.index(objective)]
    return _TAB10[9 - (sum(map(ord, objective)) % 3)]


def color(label: str) -> str:
    """Fixed colour of an objective; parameter variants get shades of it (see :func:`set_palette`)."""
    return _VARIANTS.get(label) or _base(split_label(label)[0])


def fmt(mean: float, sd: float | None = None, digits: int = 3) -> str:
    """``mean ± spread`` (the spread omitted when unavailable)."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    text = f"{mean:.{digits}f}"
    if sd is not None and not (isinstance(sd, float) and math.isnan(sd)):
        text += f" ± {sd:.{digits}f}"
    return text
