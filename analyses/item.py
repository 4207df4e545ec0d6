"""What a figure or table item is: :class:`Figure`, :class:`Table`, :class:`Item`, and the
:func:`item` decorator that adds an item function to :data:`REGISTRY`.

An item function takes :class:`analyses.data.Inputs` and returns a :class:`Figure` or a
:class:`Table`; it raises :class:`analyses.data.Missing` when its inputs are absent. The items
themselves live in :mod:`analyses.items` (registered on import); :mod:`analyses.render` renders them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from analyses.data import Inputs


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


REGISTRY: list[Item] = []

# Paper tables and figures that are not items, and why (`repsim figures --list` shows them).
NOT_PRODUCED: dict[str, tuple[str, str]] = {
    "tableA1": ("Table A.1: ResNet-50 hyperparameters and epochs per objective",
                "a hyperparameter table, shipped as presets: train/presets/resnet50-imagenet-<objective>.toml"),
    "tableA2": ("Table A.2: the transfer datasets",
                "a list of datasets (classes, sizes, accuracy measure); give each to repsim probe / repsim finetune "
                "with --metric top1 or mean_per_class"),
    "tableB1": ("Table B.1: Table 1 for Inception v3",
                "the table1 item, rendered from Inception v3 runs (presets inception_v3-imagenet-<objective>)"),
    "figB1": ("Fig. B.1: Fig. 2 for Inception v3",
              "the fig2a/fig2b items, rendered from Inception v3 stores (presets inception_v3-imagenet-<objective>)"),
}


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
