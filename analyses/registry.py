"""The figure/table registry: each item declares its inputs and renders one figure or one table.

An item function takes :class:`analyses.data.Inputs` and returns a :class:`Figure` or a
:class:`Table`; it raises :class:`analyses.data.Missing` when its inputs are absent. Items register
with :func:`item` in paper order; :func:`render_all` writes PNG + PDF per figure, CSV + Markdown per
table, and returns one :class:`Outcome` per item for the report.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from analyses.data import Inputs, Missing


@dataclass
class Figure:
    """A rendered matplotlib figure and its caption (data, n, seeds, estimator settings)."""

    fig: Any
    caption: str


@dataclass
class Table:
    """A table: ``numeric`` goes to CSV, ``shown`` (strings) to Markdown/HTML, ``bold`` marks cells."""

    numeric: pd.DataFrame
    shown: pd.DataFrame
    caption: str
    bold: pd.DataFrame | None = None


@dataclass
class Item:
    id: str
    title: str
    kind: str  # "figure" | "table"
    needs: tuple[str, ...]
    fn: Callable[[Inputs], Figure | Table]


@dataclass
class Outcome:
    item: Item
    status: str  # "done" | "skipped" | "failed"
    files: list[str] = field(default_factory=list)
    caption: str = ""
    note: str = ""
    table: Table | None = None


REGISTRY: list[Item] = []


def item(id: str, title: str, kind: str, needs: tuple[str, ...]):
    """Register an item function under ``id`` (also its file stem)."""
    if kind not in ("figure", "table"):
        raise ValueError(f"kind must be 'figure' or 'table', got {kind!r}")

    def deco(fn):
        if any(it.id == id for it in REGISTRY):
            raise ValueError(f"duplicate item id {id!r}")
        REGISTRY.append(Item(id, title, kind, tuple(needs), fn))
        return fn

    return deco


def markdown(table: Table) -> str:
    shown = table.shown.astype(str)
    if table.bold is not None:
        shown = shown.where(~table.bold.reindex_like(shown).fillna(False).astype(bool), "**" + shown + "**")
    cols = [str(c) for c in shown.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in shown.itertuples(index=False, name=None)]
    return "\n".join(lines) + "\n"


def render_one(it: Item, inputs: Inputs, out: Path) -> Outcome:
    import matplotlib.pyplot as plt

    try:
        result = it.fn(inputs)
    except Missing as exc:
        return Outcome(it, "skipped", note=str(exc))
    except Exception as exc:  # one broken item must not hide the others; reported as failed
        plt.close("all")
        tb = traceback.format_exc(limit=-3)
        return Outcome(it, "failed", note=f"{type(exc).__name__}: {exc}\n{tb}")
    if isinstance(result, Figure):
        files = []
        for ext in ("png", "pdf"):
            path = out / f"{it.id}.{ext}"
            result.fig.savefig(path, dpi=150 if ext == "png" else None, bbox_inches="tight")
            files.append(path.name)
        plt.close(result.fig)
        return Outcome(it, "done", files, result.caption)
    result.numeric.to_csv(out / f"{it.id}.csv", index=False)
    (out / f"{it.id}.md").write_text(f"**{it.title}.** {result.caption}\n\n{markdown(result)}")
    return Outcome(it, "done", [f"{it.id}.csv", f"{it.id}.md"], result.caption, table=result)


def render_all(inputs: Inputs, out: Path, *, only: set[str] | None = None,
               progress: bool = True) -> list[Outcome]:
    """Render every registered item (or those in ``only``) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    from analyses.items import ORDER  # importing registers the items
    from analyses.style import apply_style, set_palette

    apply_style()
    set_palette(inputs.runs["label"])
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for it in sorted(REGISTRY, key=lambda it: ORDER.index(it.id) if it.id in ORDER else len(ORDER)):
        if only is not None and it.id not in only:
            continue
        oc = render_one(it, inputs, out)
        if progress:
            print(f"[figures] {it.id:8s} {oc.status}" + (f": {oc.note.splitlines()[0]}" if oc.note else ""),
                  flush=True)
        outcomes.append(oc)
    return outcomes
