"""Shared look of the figures: readable fonts, one fixed colour per objective, number formatting."""
from __future__ import annotations

import math

from analyses.data import OBJECTIVES

_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def apply_style() -> None:
    import matplotlib as mpl

    mpl.rcParams.update({
        "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8.5,
        "xtick.labelsize": 9, "ytick.labelsize": 9, "figure.dpi": 100, "axes.spines.top": False,
        "axes.spines.right": False, "pdf.fonttype": 42, "savefig.facecolor": "white",
    })


def color(label: str) -> str:
    """Fixed colour of an objective (parameter variants share their objective's colour)."""
    objective = label.split(" (")[0]
    if objective in OBJECTIVES:
        return _TAB10[OBJECTIVES.index(objective)]
    return _TAB10[9 - (sum(map(ord, objective)) % 3)]


def fmt(mean: float, sd: float | None = None, digits: int = 3) -> str:
    """``mean ± sd`` (sd omitted when unavailable)."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    text = f"{mean:.{digits}f}"
    if sd is not None and not (isinstance(sd, float) and math.isnan(sd)):
        text += f" ± {sd:.{digits}f}"
    return text
