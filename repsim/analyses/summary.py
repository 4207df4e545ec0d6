"""Per-objective summaries over seeds and the significance rule of the paper's tables.

Bold rule (Tables 1, 2, B.1, C.5): a cell is bold when its mean is the best of its column or is not
significantly different from the best by a two-sided Student's (pooled-variance) two-sample t-test over
seeds at p < 0.05 (:func:`repsim.not_significantly_worse`). As in the paper's rule, the best is chosen
from the same data and every other cell is compared with it at 0.05 with no multiplicity correction, so a
row that does not differ from the best is un-bolded more often than 5 % of the time (stated in the
caption). With fewer than two seeds in either group no test is possible, and only the best mean is bold
(stated in the caption by :func:`bold_rule_text`).
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import pandas as pd

from repsim.analyses.data import objective_key
from repsim.analyses.style import fmt

ALPHA = 0.05


def as_percent(values: pd.Series) -> pd.Series:
    """Accuracies as percentages: values all within [0, 1] are taken as fractions."""
    v = pd.to_numeric(values, errors="coerce")
    return v * 100.0 if v.dropna().between(0, 1).all() else v


def bold_set(groups: dict[str, np.ndarray], higher_is_better: bool = True, alpha: float = ALPHA) -> set[str]:
    """The best group and every group not significantly different from it (:func:`repsim.not_significantly_worse`:
    two-sided Student's pooled two-sample t-test over seeds, p ≥ alpha, against the best chosen from the same
    data, with no multiplicity correction; one-value groups only when equal to the best)."""
    from repsim import not_significantly_worse

    groups = {k: v for k, v in groups.items() if len(v)}
    with warnings.catch_warnings():  # near-identical seeds: scipy warns about precision; p is still usable
        warnings.simplefilter("ignore", RuntimeWarning)
        return not_significantly_worse(groups, alpha=alpha, higher_is_better=higher_is_better) if groups else set()


def bold_rule_text(n_seeds: int, numeric: pd.DataFrame | None = None, columns: Sequence[str] = ()) -> str:
    """The caption's bold rule for tables of ``n_seeds`` seeds per row; with ``numeric`` (from
    :func:`seed_summary`), the ``columns`` in which some cells rest on one seed (the others blank) are named,
    since no t-test compares such a cell: it is bold only when best, and a best cell of one seed stands alone."""
    if n_seeds < 2:
        return "Bold: best mean only (one seed per objective, so no significance test is possible)."
    text = (f"Bold: best, or not significantly different from the best (two-sided Student's pooled two-sample "
            f"t-test over seeds, p ≥ {ALPHA}). As in the paper's rule, the best is chosen from the same data and "
            f"each other row is compared with it at {ALPHA} with no correction for multiple comparisons, so a row "
            "that does not differ from the best is un-bolded more often than 5 % of the time.")
    single = [c for c in columns if numeric is not None and f"{c} n" in numeric
              and (numeric[f"{c} n"] == 1).any() and (numeric[f"{c} n"] >= 2).any()]
    if single:
        text += (f" In {', '.join(single)} some cells rest on one seed, which no t-test can compare: such a cell is "
                 "bold only when it is the best, and when the best cell is one of them, it alone is bold.")
    return text


def seed_summary(long: pd.DataFrame, columns: list[str], *, digits: dict[str, int] | None = None,
                 lower_is_better: set[str] = frozenset(), bold: bool = True, unbolded: set[str] = frozenset(),
                 row_key: str = "label", row_order=None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Summarise ``long`` (columns row_key, seed, column, value) as mean ± s.e. per row and column
    (the paper's tables report the standard error of the mean over seeds, sd(ddof=1)/√n).

    Returns (numeric, shown, bold): numeric has ``<col>``, ``<col> sd``, ``<col> se``, ``<col> n``; shown
    has one string per cell; bold marks cells by :func:`not_worse_than_best`.
    """
    digits = digits or {}
    rows = sorted(long[row_key].unique(), key=row_order or objective_key)
    numeric = pd.DataFrame({row_key: rows})
    shown = pd.DataFrame({row_key: rows})
    marks = pd.DataFrame({row_key: False}, index=range(len(rows)))
    for col in columns:
        sub = long[long["column"] == col]
        groups = {r: sub.loc[sub[row_key] == r, "value"].dropna().to_numpy(float) for r in rows}
        mean = [float(np.mean(g)) if len(g) else np.nan for g in groups.values()]
        sd = [float(np.std(g, ddof=1)) if len(g) > 1 else np.nan for g in groups.values()]
        n = [len(g) for g in groups.values()]
        se = [s / np.sqrt(k) if k > 1 else np.nan for s, k in zip(sd, n)]
        numeric[col], numeric[f"{col} sd"], numeric[f"{col} se"], numeric[f"{col} n"] = mean, sd, se, n
        shown[col] = [fmt(m, e, digits.get(col, 1)) for m, e in zip(mean, se)]
        if bold and col not in unbolded:
            ok = bold_set(groups, higher_is_better=col not in lower_is_better)
            marks[col] = [r in ok for r in rows]
        else:
            marks[col] = False
    return numeric, shown, marks
