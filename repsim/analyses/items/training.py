"""Training-curve items from training.csv: Figs. C.1 (validation), C.2 (training), C.3 (validation vs. training)."""
from __future__ import annotations

import pandas as pd

from repsim.analyses.data import EVAL_SPLITS, Inputs, Missing, describe_rows, display
from repsim.analyses.items.common import labels_in_order, legend_outside
from repsim.analyses.item import Figure, item
from repsim.analyses.style import color
from repsim.analyses.summary import as_percent

ENDS = ("Each curve ends at the network's analysed checkpoint — the epoch of best.pt (best holdout top-1, "
        "App. A.1's early stopping) where the run saved one, else its last epoch — so curves of one run "
        "length can stop at different epochs.")


def _curves(inputs: Inputs, split: str | None) -> tuple[pd.DataFrame, str]:
    tr = inputs.csv("training")
    if split is None:
        split = next((s for s in EVAL_SPLITS if (tr["split"] == s).any()), None)
        if split is None:
            raise Missing(f"training.csv has no evaluation split ({', '.join(EVAL_SPLITS)})")
    tr = tr[tr["split"] == split].copy()
    if tr.empty or tr.groupby(["label", "seed"], dropna=False)["epoch"].nunique().max() < 2:
        raise Missing(f"training.csv has no {split}-split curve with ≥ 2 epochs")
    tr["top1"] = as_percent(tr["top1"])
    return tr, split


def _curve_figure(tr: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    for label in labels_in_order(tr["label"]):
        first = True
        for _, run in tr[tr["label"] == label].groupby("seed", dropna=False):
            run = run.sort_values("epoch")
            ax.plot(run[x], run["top1_y" if "top1_y" in run else "top1"], color=color(label), lw=1.2,
                    label=display(label) if first else None)
            first = False
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    legend_outside(ax)
    return fig


@item("figC1", "Fig. C.1: evaluation accuracy over training", "figure", ("training.csv",))
def figC1(inputs: Inputs) -> Figure:
    tr, split = _curves(inputs, None)
    fig = _curve_figure(tr, "epoch", "Epoch", f"Top-1 accuracy, {split} split (%)", "Evaluation accuracy")
    return Figure(fig, f"One curve per network. {ENDS} {describe_rows(tr)}.")


@item("figC2", "Fig. C.2: training accuracy over training", "figure", ("training.csv",))
def figC2(inputs: Inputs) -> Figure:
    tr, _ = _curves(inputs, "train")
    fig = _curve_figure(tr, "epoch", "Epoch", "Top-1 accuracy, train split (%)", "Training accuracy")
    return Figure(fig, f"One curve per network (accuracy on the training split, as logged). {ENDS} {describe_rows(tr)}.")


@item("figC3", "Fig. C.3: evaluation vs. training accuracy", "figure", ("training.csv",))
def figC3(inputs: Inputs) -> Figure:
    ev, split = _curves(inputs, None)
    trn, _ = _curves(inputs, "train")
    keys = ["label", "seed", "epoch"]
    both = trn[keys + ["top1"]].merge(ev[keys + ["top1"]], on=keys, suffixes=("_x", "_y"))
    if both.empty:
        raise Missing("no epoch logged on both the train and the evaluation split")
    fig = _curve_figure(both, "top1_x", "Training top-1 accuracy (%)", f"{split} top-1 accuracy (%)",
                        "Evaluation vs. training accuracy")
    return Figure(fig, f"Each curve follows one network over its epochs. {ENDS} {describe_rows(both)}.")
