"""Rendering the registered items: PNG + PDF per figure (or the formats asked:
:mod:`repsim.analyses.formats`), CSV + Markdown per table, one :class:`Outcome` per item for the report
(:mod:`repsim.analyses.report`). The items are defined in :mod:`repsim.analyses.items.catalog` (importing
it registers them in :data:`repsim.analyses.item.REGISTRY`).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from repsim.analyses.data import Inputs, Missing
from repsim.analyses.formats import DEFAULT_FORMATS
from repsim.analyses.item import REGISTRY, Figure, Item, Table
from repsim.analyses.items.catalog import ORDER


@dataclass
class Outcome:
    item: Item
    status: str  # "done" | "skipped" | "failed"
    files: list[str] = field(default_factory=list)
    caption: str = ""
    note: str = ""
    table: Table | None = None


def ordered_items() -> list[Item]:
    """Every registered item in the paper's order (:data:`repsim.analyses.items.catalog.ORDER`)."""
    return sorted(REGISTRY, key=lambda it: ORDER.index(it.id) if it.id in ORDER else len(ORDER))


def markdown(table: Table) -> str:
    shown = table.shown.astype(str)
    if table.bold is not None:
        shown = shown.where(~table.bold.reindex_like(shown).fillna(False).astype(bool), "**" + shown + "**")
    cols = [str(c) for c in shown.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in shown.itertuples(index=False, name=None)]
    return "\n".join(lines) + "\n"


def render_one(it: Item, inputs: Inputs, out: Path, formats: Sequence[str] = DEFAULT_FORMATS) -> Outcome:
    """Render ``it`` into ``out``: a figure as each of ``formats`` (PNG at 150 dpi; the report shows the
    PNG, else the SVG), a table as CSV + Markdown."""
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
        for ext in formats:
            path = out / f"{it.id}.{ext}"
            result.fig.savefig(path, dpi=150 if ext == "png" else None, bbox_inches="tight")
            files.append(path.name)
        plt.close(result.fig)
        return Outcome(it, "done", files, result.caption)
    result.numeric.to_csv(out / f"{it.id}.csv", index=False)
    (out / f"{it.id}.md").write_text(f"**{it.title}.** {result.caption}\n\n{markdown(result)}")
    return Outcome(it, "done", [f"{it.id}.csv", f"{it.id}.md"], result.caption, table=result)


def render_all(inputs: Inputs, out: Path, *, only: set[str] | None = None,
               progress: bool = True, formats: Sequence[str] = DEFAULT_FORMATS) -> list[Outcome]:
    """Render every registered item (or those in ``only``: an id, or a per-measure item's id for all
    its variants) into ``out``, figures as each of ``formats`` (checked by ``make_figures``)."""
    import matplotlib

    matplotlib.use("Agg")
    from repsim.analyses.style import apply_style, set_palette

    apply_style()
    set_palette(inputs.runs["label"])
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for it in [v for it in ordered_items() for v in it.variants(inputs)]:
        if only is not None and it.id not in only and it.base not in only:
            continue
        oc = render_one(it, inputs, out, formats)
        if progress:
            print(f"[figures] {it.id:8s} {oc.status}" + (f": {oc.note.splitlines()[0]}" if oc.note else ""),
                  flush=True)
        outcomes.append(oc)
    return outcomes
