"""Data shaping shared by several items (transfer accuracies, penultimate R², legends)."""
from __future__ import annotations

import pandas as pd

from repsim.analyses.data import EVAL_SPLITS, SOURCE_TASK, Inputs, Missing, objective_key
from repsim.analyses.summary import as_percent


def penultimate_rows(inputs: Inputs, df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` (probes.csv, multilabel.csv) of the penultimate layer, where its ``layer``
    column names several (rows without a layer are kept only when no row names one)."""
    if "layer" not in df or not df["layer"].fillna("").astype(str).ne("").any():
        return df
    layers = df["layer"].fillna("").astype(str)
    return df[layers == inputs.penultimate(layers[layers != ""])]


def probe_rows(inputs: Inputs, probe: str, *, source: bool = False, all_epochs: bool = False) -> pd.DataFrame:
    """probes.csv rows of one probe kind: transfer tasks (default) or source-relearning tasks; of the
    penultimate layer (:meth:`Inputs.penultimate`) and, per task, of one evaluation split (test, else val,
    else holdout, else the one present), where probes.csv holds several (`repsim probe` keeps a probe of
    each layer and split: repsim.results.KEYS)."""
    df = inputs.csv("probes", all_epochs=all_epochs)
    df = df[df["probe"].astype(str) == probe].copy()
    is_source = df["task"].astype(str).str.match(SOURCE_TASK)
    df = df[is_source] if source else df[~is_source]
    if df.empty:
        what = "source-relearning (task source*/relearn*)" if source else "transfer"
        raise Missing(f"probes.csv has no {probe} rows for {what} tasks")
    df = penultimate_rows(inputs, df)
    if "split" in df:
        splits = df["split"].fillna("").astype(str)

        def chosen(task_splits: pd.Series) -> str:
            present = set(task_splits)
            return next((s for s in EVAL_SPLITS if s in present), sorted(present)[0])

        keep = splits.groupby(df["task"].astype(str)).transform(chosen)
        df = df[splits == keep]
    df["accuracy"] = as_percent(df["accuracy"])
    return df


def mean_transfer(df: pd.DataFrame) -> pd.DataFrame:
    """Mean accuracy across tasks per (label, seed), only for runs evaluated on every task."""
    tasks = df["task"].nunique()
    g = df.groupby(["label", "seed"], dropna=False)["accuracy"]
    out = g.mean().to_frame("transfer")
    out["tasks"] = g.size()
    return out[out["tasks"] == tasks].reset_index()


def probe_settings(df: pd.DataFrame) -> str:
    """Caption fragment: probe estimator and the selected hyperparameters' range."""
    texts = []
    for probe, sub in df.groupby("probe"):
        metric = ", ".join(sorted(sub["metric"].astype(str).unique())) if "metric" in sub else "top1"
        est = ("L²-regularised multinomial logistic regression on fixed features, λ chosen on a held-out "
               "validation split" if probe == "linear" else
               "cosine k-nearest neighbours, k chosen by leave-one-out" if probe == "knn" else probe)
        best = pd.to_numeric(sub.get("best_param"), errors="coerce").dropna() if "best_param" in sub else []
        rng = f" (selected {'λ' if probe == 'linear' else 'k'} {best.min():.3g}–{best.max():.3g})" if len(best) else ""
        texts.append(f"{probe}: {est}{rng}; metric {metric}")
    return "; ".join(texts)


def penultimate_r2(inputs: Inputs, distance: str = "cosine", *, all_epochs: bool = False) -> pd.DataFrame:
    """R² (Eq. 11) of the penultimate layer per (label, seed, dataset split)."""
    sep = inputs.csv("separation", all_epochs=all_epochs)
    sep = sep[sep["distance"].astype(str) == distance]
    if sep.empty:
        raise Missing(f"separation.csv has no rows with distance={distance}")
    layer = inputs.penultimate(sep["layer"].astype(str))
    return sep[sep["layer"].astype(str) == layer].copy()


def one_split(df: pd.DataFrame, prefer: str = "train") -> pd.DataFrame:
    """Rows of one (dataset, split) of the stores behind ``df``, so that seeds are never mixed with splits.

    ``prefer="train"``: the training split when present (the paper measures class separation and
    collapse on the training set), else the split with most rows; ``prefer="layers"``: the split with
    the most distinct layers (per-layer plots), ties to the training split.
    """
    if "split" not in df or not df["split"].fillna("").ne("").any():
        return df
    keyed = df.assign(_d=df["dataset"].fillna(""), _s=df["split"].fillna(""))
    g = keyed.groupby(["_d", "_s"])
    score = pd.DataFrame({"layers": g["layer"].nunique() if "layer" in df else g.size(), "rows": g.size()})
    score["train"] = [s == "train" for _, s in score.index]
    order = ["train", "rows"] if prefer == "train" else ["layers", "train", "rows"]
    d, s = score.sort_values(order, ascending=False).index[0]
    return df[(keyed["_d"] == d) & (keyed["_s"] == s)]


def one_r2_per_run(sep: pd.DataFrame) -> pd.DataFrame:
    """One R² per (label, seed), from one dataset split (the training split when present)."""
    return one_split(sep).groupby(["label", "seed"], dropna=False)["r2"].mean().reset_index()


def pyplot():
    """matplotlib.pyplot, imported on first use (repsim.analyses.render selects the Agg backend before)."""
    import matplotlib.pyplot as plt

    return plt


def panel_grid(n: int, max_cols: int, panel: tuple[float, float], extra_width: float = 0.0):
    """A figure with ``n`` panels in rows of at most ``max_cols``; returns (fig, the n axes, all axes)
    with the unused axes hidden."""
    ncol = min(max_cols, n)
    nrow = -(-n // ncol)
    fig, axes = pyplot().subplots(nrow, ncol, figsize=(panel[0] * ncol + extra_width, panel[1] * nrow),
                                  squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n]), axes


def legend_outside(ax, **kw) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, **kw)


# offsets (points) tried in turn for a point's label: right-above, right-below, left-above, left-below,
# then further up and down on either side
_LABEL_SPOTS = [(4, 3, "left", "bottom"), (4, -3, "left", "top"), (-4, 3, "right", "bottom"),
                (-4, -3, "right", "top")] + [(sx * 4, sy * k, "left" if sx > 0 else "right", "center")
                                            for k in (10, 18, 26, 34) for sy in (1, -1) for sx in (1, -1)]


def label_points(ax, points, texts, fontsize: float = 7.5) -> None:
    """Label each (x, y) of ``points`` with its text where it stays inside the axes and overlaps no label
    placed before it and no other point, trying the offsets of ``_LABEL_SPOTS`` in turn (the first one
    when none is free): objectives with nearly equal values get readable labels instead of one overprinted
    block, and a point at the right edge is labelled on its left, not under a legend beside the axes."""
    fig = ax.figure
    fig.canvas.draw()  # settle the data limits (autoscaling is lazy) so that display boxes are final
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    dots = [ax.transData.transform(p) for p in points]
    placed = []
    for (x, y), text in zip(points, texts):
        chosen = None
        for dx, dy, ha, va in _LABEL_SPOTS:
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                              fontsize=fontsize)
            ann.update_positions(renderer)
            box = ann.get_window_extent(renderer).expanded(1.04, 1.15)
            hits_dot = any(box.x0 <= dx_ <= box.x1 and box.y0 <= dy_ <= box.y1 for dx_, dy_ in dots)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed) and not hits_dot:
                chosen = (ann, box)
                break
            ann.remove()
        if chosen is None:
            dx, dy, ha, va = _LABEL_SPOTS[0]
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                              fontsize=fontsize)
            ann.update_positions(renderer)
            chosen = (ann, ann.get_window_extent(renderer))
        placed.append(chosen[1])


def labels_in_order(labels) -> list[str]:
    return sorted(set(labels), key=objective_key)



def pixel_baseline(inputs: Inputs, tasks) -> dict[str, float]:
    """{task: pixel-baseline accuracy (%)} for the transfer ``tasks`` that have one ({} without pixels.csv)."""
    try:
        px = inputs.pixel_baseline()
    except Missing:
        return {}
    return {str(t): px[str(t)] for t in tasks if str(t) in px}


def pixel_line(ax, inputs: Inputs, tasks) -> str:
    """A dashed line at the mean pixel-baseline accuracy over ``tasks`` (the linear probe on raw pixels);
    returns a caption sentence ('' without one)."""
    px = pixel_baseline(inputs, tasks)
    if not px:
        return ""
    v = sum(px.values()) / len(px)
    ax.axhline(v, ls="--", color="0.4", lw=1, label="raw pixels (linear probe)", zorder=1)
    ax.annotate(f"raw pixels, linear probe: {v:.1f}%", xy=(0.01, v), xycoords=("axes fraction", "data"),
                xytext=(0, 2), textcoords="offset points", va="bottom", fontsize=8, color="0.35")
    return f" Dashed: the linear probe on raw pixels of the transfer task ({v:.1f}%)."
