"""What a figure or table item is: :class:`Figure`, :class:`Table`, :class:`Item`, and the
:func:`item` decorator that adds an item function to :data:`REGISTRY`.

An item function takes :class:`repsim.analyses.data.Inputs` and returns a :class:`Figure` or a
:class:`Table`; it raises :class:`repsim.analyses.data.Missing` when its inputs are absent. The items
themselves live in :mod:`repsim.analyses.items` (registered on import); :mod:`repsim.analyses.render` renders them.

A *per-measure* item (``item(..., per_measure=True)``, e.g. Fig. 2a) takes ``(inputs, measure)`` and is
rendered once for every similarity measure in the results files (:meth:`Item.variants`): under its own
id for linear CKA (the paper's measure) and as ``<id>_<measure>`` for each other one, its title's
``{measure}`` filled with the measure's display name.

A *per-result* item (``item(..., per_result=True)``: the generic heatmap of own models' results) takes
``(inputs, file, measure)`` and is rendered once for every measure of every results file that holds a
store of unknown objective (:meth:`Item.result_variants`), as ``<id>_<file stem>_<measure>``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from repsim.analyses.data import Inputs, Missing, measure_display


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
    fn: Callable[..., Figure | Table]
    per_measure: bool = False
    base: str = ""  # a per-measure variant: the id it was made from
    per_result: bool = False  # one variant per (results file, measure): module docstring

    def variants(self, inputs: Inputs) -> list["Item"]:
        """This item, or for a per-measure item one variant per measure in the results (linear CKA's
        under the item's id, always listed so that its absence is reported), or for a per-result item
        one variant per (results file, measure) of the files it draws (:meth:`result_variants`)."""
        if self.per_result:
            return self.result_variants(inputs)
        if not self.per_measure:
            return [self]
        try:
            present = inputs.similarities.measures
        except Missing:
            present = []
        return [self.for_measure(m) for m in ["linear_cka"] + [m for m in present if m != "linear_cka"]]

    def for_measure(self, measure: str) -> "Item":
        return replace(self, id=self.id if measure == "linear_cka" else f"{self.id}_{measure}",
                       title=self.title.format(measure=measure_display(measure)),
                       fn=functools.partial(self.fn, measure=measure), per_measure=False, base=self.id)


    def result_variants(self, inputs: Inputs) -> list["Item"]:
        """``<id>_<file stem>_<measure>`` for every measure of every results file holding a store whose
        objective is unknown (own models: the paper's items cannot group them), or this item alone,
        whose function then says why there is nothing to draw."""
        try:
            parts = inputs.similarities.parts
        except Missing:
            return [self]
        known = set(inputs.runs.loc[inputs.runs["label"] != "", "store"])
        out = []
        for fname, result, _ in parts:
            if {s for s, _ in result.index} <= known:
                continue
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(fname).stem)
            out += [replace(self, id=f"{self.id}_{stem}_{m}", title=self.title.format(measure=measure_display(m),
                                                                                    file=fname),
                            fn=functools.partial(self.fn, file=fname, measure=m), per_result=False, base=self.id)
                    for m in result.measures]
        return out or [self]


REGISTRY: list[Item] = []

# Paper tables and figures that are not items, and why (`repsim figures --list` shows them).
NOT_PRODUCED: dict[str, tuple[str, str]] = {
    "tableA1": ("Table A.1: ResNet-50 hyperparameters and epochs per objective",
                "a hyperparameter table, shipped as presets: repsim/train/presets/resnet50-imagenet-<objective>.toml"),
    "tableA2": ("Table A.2: the transfer datasets",
                "a list of datasets (classes, sizes, accuracy measure); give each to repsim probe / repsim finetune "
                "with --metric top1 or mean_per_class"),
    "tableB1": ("Table B.1: Table 1 for Inception v3",
                "the table1 item, rendered from Inception v3 runs (presets inception_v3-imagenet-<objective>)"),
    "figB1": ("Fig. B.1: Fig. 2 for Inception v3",
              "the fig2a/fig2b items, rendered from Inception v3 stores (presets inception_v3-imagenet-<objective>)"),
}


def item(id: str, title: str, kind: str, needs: tuple[str, ...], *, per_measure: bool = False,
         per_result: bool = False):
    """Register an item function under ``id`` (also its file stem); ``per_measure``, ``per_result``: module
    docstring."""
    if kind not in ("figure", "table"):
        raise ValueError(f"kind must be 'figure' or 'table', got {kind!r}")

    def deco(fn):
        if any(it.id == id for it in REGISTRY):
            raise ValueError(f"duplicate item id {id!r}")
        REGISTRY.append(Item(id, title, kind, tuple(needs), fn, per_measure, per_result=per_result))
        return fn

    return deco
