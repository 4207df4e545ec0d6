"""Layer-wise items: Fig. 2a/2b (CKA, and the same panels under every other similarity measure in the
results), consecutive-block CKA (``blocks``, not in the paper), Fig. 3 (sparsity), Table 3 / Fig. 4 (R²),
Tables E.1, E.2, Fig. E.4."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from repsim.analyses.data import Inputs, Missing, describe_rows, display, natural_key
from repsim.analyses.items.common import (labels_in_order, legend_outside, one_r2_per_run, one_split, panel_grid,
                                   penultimate_r2, pyplot)
from repsim.analyses.item import Figure, Table, item
from repsim.analyses.style import color
from repsim.analyses.summary import as_percent, seed_summary


def cka_groups(inputs: Inputs, measure: str = "linear_cka") -> tuple[object, dict[str, list[str]], list[str]]:
    """The measure's matrices (:class:`repsim.analyses.data.MeasureMatrices`; linear CKA by default), stores
    grouped by label, and the layers every store shares.

    Only final checkpoints of networks that were not fine-tuned enter, on one dataset split (the one
    with most such stores): the stores of Fig. D.3 (before/after fine-tuning, on a transfer dataset) and
    of earlier checkpoints may share the results directory."""
    cka = inputs.similarity(measure)
    runs = inputs.runs.drop_duplicates("store").set_index("store")
    ok = [s for s in cka.stores if s not in runs.index
          or (bool(runs.loc[s, "final"]) and not runs.loc[s, "finetuned_from"])]
    data = {s: (runs.loc[s, "dataset"], runs.loc[s, "split"]) if s in runs.index else ("", "") for s in ok}
    counts: dict[tuple, int] = {}
    for d in data.values():
        counts[d] = counts.get(d, 0) + 1
    main = max(counts, key=lambda d: (counts[d], d[1] == "test", d)) if counts else None
    groups: dict[str, list[str]] = {}
    for s in [s for s in ok if data[s] == main]:
        try:
            groups.setdefault(inputs.label_of(s), []).append(s)
        except Missing:
            continue
    if not groups:
        where = ("their attrs name none: random-init or own models; the heatmap items draw them"
                 if inputs.stores_dir is not None else "pass --stores, or results CSVs naming them")
        raise Missing(f"the objective of no {cka.display} store is known ({where})")
    layers = sorted(set.intersection(*(set(cka.layers(s)) for ss in groups.values() for s in ss)), key=natural_key)
    layers = [l for l in layers if l != "logits"]
    if len(layers) < 2:
        raise Missing(f"{cka.display} stores share fewer than 2 layers")
    return cka, groups, layers


def _mean_block(cka, a_stores, b_stores, layers_a, layers_b) -> tuple[np.ndarray | None, int]:
    """The mean block over every ordered pair of distinct networks (one from each group), and how many
    pairs of networks that is: within one group (the control), (s0, s1) and (s1, s0) are one pair."""
    got = [(frozenset((a, b)), m) for a, b in itertools.product(a_stores, b_stores) if a != b
           for m in [cka.block(a, b, layers_a, layers_b)] if m is not None]
    if not got:
        return None, 0
    return np.mean([m for _, m in got], axis=0), len({pair for pair, _ in got})


def _short(layer: str) -> str:
    return layer.replace("block", "")


def colour_limits(mm, values: list[np.ndarray]) -> tuple[float, float]:
    """(vmin, vmax) of a measure's heatmaps: its declared range (MeasureInfo.range); an unbounded end
    (ridge R²'s −∞) is the data's, rounded out to a tenth."""
    lo, hi = mm.range
    finite = [v[np.isfinite(v)] for v in values]
    data = np.concatenate(finite) if finite else np.array([])
    if not np.isfinite(lo):
        lo = min(0.0, np.floor(10 * data.min()) / 10) if data.size else 0.0
    if not np.isfinite(hi):
        hi = max(1.0, np.ceil(10 * data.max()) / 10) if data.size else 1.0
    return float(lo), float(hi)


def _measure_text(mm, lo: float, hi: float) -> str:
    """Caption fragment: colour scale, and for an asymmetric measure which argument the rows are."""
    rows = ("" if mm.symmetric else f" {mm.display} is asymmetric: entry (row, column) = {mm.display}(row layer, "
            "column layer), row = first argument.")
    return f"Colour scale: {lo:g} to {hi:g} (the declared range of {mm.display}).{rows}"


def _fig2a_pairs(inputs: Inputs, measure: str):
    """(measure matrices, groups, layers, [(objective, [(softmax store, objective store), ...])]): Fig. 2a's
    panels, each with its ordered pairs of distinct networks."""
    cka, groups, layers = cka_groups(inputs, measure)
    if "softmax" not in groups:
        raise Missing(f"no softmax network among the {cka.display} stores (the reference of Fig. 2a)")
    panels = [(label, [(a, b) for a in groups["softmax"] for b in groups[label] if a != b])
              for label in labels_in_order(groups)]
    return cka, groups, layers, [(label, pairs) for label, pairs in panels if pairs]


def _draw_fig2a(cka, layers: list[str], panels: list, vmin: float, vmax: float, colour_label: str,
                marks: list | None = None):
    """Fig. 2a's panels [(title, block, pairs of networks)], one colour scale; ``marks``: per panel the cells
    to dot (not significant). Returns (figure, dots drawn)."""
    from repsim.engine.heatmap import mark_cells

    fig, shown_axes, axes = panel_grid(len(panels), 5, (2.7, 2.8), 0.9)
    ticks = np.arange(len(layers))
    step = max(1, len(layers) // 6)
    first = "" if cka.symmetric else ", 1st argument"
    dots = 0
    for k, (ax, (title, m, n)) in enumerate(zip(shown_axes, panels)):
        im = ax.imshow(m, vmin=vmin, vmax=vmax, cmap="magma", origin="lower")
        if marks is not None:
            dots += mark_cells(ax, marks[k], size=max(2.0, min(16.0, (72 * 2.2 / len(layers) / 3) ** 2)))
        ax.set_title(f"{title}\n(mean of {n} pair{'s' if n > 1 else ''})", fontsize=9)
        ax.set_xticks(ticks[::step], [_short(l) for l in layers][::step], fontsize=8)
        ax.set_yticks(ticks[::step], [_short(l) for l in layers][::step], fontsize=8)
        ax.set_xlabel("Layer (objective net)", fontsize=8)
        if k % axes.shape[1] == 0:
            ax.set_ylabel(f"Layer (softmax net{first})", fontsize=8)
    fig.tight_layout()
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label=colour_label)
    return fig, dots


def _networks(pairs) -> int:
    """Pairs of networks behind ordered pairs of stores: (s0, s1) and (s1, s0) are one."""
    return len({frozenset(p) for p in pairs})


def _ignored(inputs: Inputs, cka, groups) -> tuple[list[str], str]:
    used = [x for v in groups.values() for x in v]
    other = len(cka.stores) - len(used)
    return used, ((f"{other} other store(s) in the {cka.display} files ignored (unknown objective, another dataset "
                   "split, earlier checkpoints or fine-tuned networks). ") if other else "")


@item("fig2a", "Fig. 2a: block × block {measure} between softmax networks and networks of each objective",
      "figure", ("results of repsim cka/similarity (.npz)", "stores or results CSVs naming objectives"), per_measure=True)
def fig2a(inputs: Inputs, measure: str = "linear_cka") -> Figure:
    cka, groups, layers, pairs = _fig2a_pairs(inputs, measure)
    panels = []
    for label, _ in pairs:
        m, n = _mean_block(cka, groups["softmax"], groups[label], layers, layers)
        if m is not None:
            panels.append((f"Softmax vs. {display(label)}", m, n))
    if not panels:
        raise Missing(f"no softmax-vs-objective pair of stores with {cka.display} values (softmax needs ≥ 2 seeds "
                      "for its control)")
    vmin, vmax = colour_limits(cka, [m for _, m, _ in panels])  # one colour scale for every panel
    fig, _ = _draw_fig2a(cka, layers, panels, vmin, vmax, cka.display)
    used, ignored = _ignored(inputs, cka, groups)
    cap = (f"{cka.display} between layers. Rows: layers of softmax networks; columns: the same layers of a network "
           f"trained with the objective in the panel title, averaged over all pairs of distinct networks (the "
           f"Softmax vs. Softmax panel is the seed-to-seed control; stores with objective init give the untrained "
           f"control). {_measure_text(cka, vmin, vmax)} {ignored}{inputs.describe(used)}. {cka.meta_text()}.")
    return Figure(fig, cap)


@item("fig2a_calibrated", "Fig. 2a, calibrated: {measure} above chance, block × block, softmax vs. each objective",
      "figure", ("results of repsim similarity --permutations K (.npz)", "stores or results CSVs naming objectives"),
      per_measure=True)
def fig2a_calibrated(inputs: Inputs, measure: str = "linear_cka") -> Figure:
    """Fig. 2a on the calibrated scores of the permutation null (:mod:`repsim.analyses.nulls`): each cell the
    mean of its pairs of networks' calibrated scores, dotted unless every pair is significant."""
    from repsim.analyses.nulls import calibrate_pairs, null_text, require_null

    cka, groups, layers, pairs = _fig2a_pairs(inputs, measure)
    require_null(cka)
    panels, marks, counts = [], [], []
    for label, ps in pairs:
        c = calibrate_pairs(cka, ps, layers, layers)
        if c is None:
            continue
        panels.append((f"Softmax vs. {display(label)}", c.calibrated, _networks(ps)))
        marks.append(c.not_significant)
        counts.append(f"{display(label)} {int(c.not_significant.sum())}")
    if not panels:
        raise Missing(f"no softmax-vs-objective pair of stores with a {cka.display} null")
    hi = 1.0 if np.isfinite(cka.range[1]) else max(1.0, float(np.nanmax([m for _, m, _ in panels])))
    fig, dots = _draw_fig2a(cka, layers, panels, 0.0, hi, f"calibrated {cka.display} (0 = not above chance)", marks)
    used, ignored = _ignored(inputs, cka, groups)
    cap = (f"Fig. 2a on calibrated scores: {cka.display} above what the same networks give with their examples "
           f"shuffled. Rows: layers of softmax networks; columns: the same layers of a network trained with the "
           f"objective in the panel title; each cell over all pairs of distinct networks. "
           f"{null_text(cka)}. Cells not significant, of {len(layers) ** 2} per panel: {'; '.join(counts)} "
           f"({dots} dots in all). {ignored}{inputs.describe(used)}. {cka.meta_text()}.")
    return Figure(fig, cap)


def _fig2b_layout(inputs: Inputs, measure: str):
    cka, groups, layers = cka_groups(inputs, measure)
    labels = labels_in_order(groups)
    if len(labels) < 2:
        raise Missing(f"{cka.display} stores of ≥ 2 objectives are needed")
    chosen = sorted(set(np.linspace(0, len(layers) - 1, min(6, len(layers))).round().astype(int)))
    return cka, groups, labels, [layers[i] for i in chosen]


def _draw_fig2b(cka, labels: list[str], chosen: list[str], mats: list, vmin: float, vmax: float, colour_label: str,
                marks: list | None = None):
    from repsim.engine.heatmap import mark_cells

    fig, shown_axes, axes = panel_grid(len(chosen), 3, (3.9, 3.7), 0.8)
    names = [display(l) for l in labels]
    dots = 0
    for k, (ax, layer, m) in enumerate(zip(shown_axes, chosen, mats)):
        im = ax.imshow(m, vmin=vmin, vmax=vmax, cmap="viridis")
        if marks is not None:
            dots += mark_cells(ax, marks[k], size=max(4.0, min(25.0, (72 * 3.0 / len(labels) / 3) ** 2)))
        ax.set_title(layer)
        ax.set_xticks(range(len(labels)), names, rotation=90, fontsize=7.5)
        ax.set_yticks(range(len(labels)), names, fontsize=7.5)
        if not cka.symmetric:
            ax.set_ylabel("1st argument", fontsize=7.5)
    fig.tight_layout()
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.7, label=colour_label)
    return fig, dots


@item("fig2b", "Fig. 2b: {measure} between objectives at corresponding layers", "figure",
      ("results of repsim cka/similarity (.npz)", "stores or results CSVs naming objectives"), per_measure=True)
def fig2b(inputs: Inputs, measure: str = "linear_cka") -> Figure:
    cka, groups, labels, chosen = _fig2b_layout(inputs, measure)
    mats = []
    for layer in chosen:
        m = np.full((len(labels), len(labels)), np.nan)
        for i, a in enumerate(labels):
            for j, b in enumerate(labels):
                v, _ = _mean_block(cka, groups[a], groups[b], [layer], [layer])
                m[i, j] = np.nan if v is None else v[0, 0]
        mats.append(m)
    vmin, vmax = colour_limits(cka, mats)
    fig, _ = _draw_fig2b(cka, labels, chosen, mats, vmin, vmax, cka.display)
    cap = (f"Entry (i, j): {cka.display} between the named layer of networks trained with objectives i and j, "
           f"averaged over pairs of distinct networks; the diagonal compares different seeds of one objective "
           f"(blank when an objective has one seed). Layers shown: {', '.join(chosen)}. {_measure_text(cka, vmin, vmax)} "
           f"{inputs.describe([x for v in groups.values() for x in v])}. {cka.meta_text()}.")
    return Figure(fig, cap)


@item("fig2b_calibrated", "Fig. 2b, calibrated: {measure} above chance between objectives at corresponding layers",
      "figure", ("results of repsim similarity --permutations K (.npz)", "stores or results CSVs naming objectives"),
      per_measure=True)
def fig2b_calibrated(inputs: Inputs, measure: str = "linear_cka") -> Figure:
    """Fig. 2b on calibrated scores (:mod:`repsim.analyses.nulls`), non-significant entries dotted."""
    from repsim.analyses.nulls import calibrate_pairs, null_text, require_null

    cka, groups, labels, chosen = _fig2b_layout(inputs, measure)
    require_null(cka)
    mats, marks, counts = [], [], []
    for layer in chosen:
        m = np.full((len(labels), len(labels)), np.nan)
        ns = np.zeros(m.shape, bool)
        for i, a in enumerate(labels):
            for j, b in enumerate(labels):
                c = calibrate_pairs(cka, [(x, y) for x in groups[a] for y in groups[b] if x != y], [layer], [layer])
                if c is not None:
                    m[i, j], ns[i, j] = c.calibrated[0, 0], c.not_significant[0, 0]
        mats.append(m)
        marks.append(ns)
        counts.append(f"{layer} {int(ns.sum())}")
    hi = 1.0 if np.isfinite(cka.range[1]) else max(1.0, float(np.nanmax(mats)))
    fig, dots = _draw_fig2b(cka, labels, chosen, mats, 0.0, hi, f"calibrated {cka.display} (0 = not above chance)",
                            marks)
    cap = (f"Fig. 2b on calibrated scores. Entry (i, j): {cka.display} above chance between the named layer of "
           f"networks trained with objectives i and j, over pairs of distinct networks; the diagonal compares different seeds of one objective (blank when an "
           f"objective has one seed). {null_text(cka)}. Entries not significant, of {len(labels) ** 2} per layer: "
           f"{'; '.join(counts)}. Layers shown: {', '.join(chosen)}. "
           f"{inputs.describe([x for v in groups.values() for x in v])}. {cka.meta_text()}.")
    return Figure(fig, cap)


def consecutive_similarity(cka, groups: dict[str, list[str]], layers: list[str]) -> pd.DataFrame:
    """Long table (label, seed-store, transition, value): the measure between each layer and the next one
    within one network (``cka.block(s, s, ...)``'s first off-diagonal), for every store of ``groups``."""
    rows = []
    for label, stores in groups.items():
        for s in stores:
            m = cka.block(s, s, layers, layers)
            if m is None:
                continue
            for i in range(len(layers) - 1):
                rows.append(dict(label=label, store=s, transition=f"{_short(layers[i])}→{_short(layers[i + 1])}",
                                 position=i, value=float(m[i, i + 1])))
    return pd.DataFrame(rows, columns=["label", "store", "transition", "position", "value"])


@item("blocks", "Consecutive-block linear CKA within one network", "table",
      ("results of repsim cka/similarity (.npz) with each store against itself",))
def blocks(inputs: Inputs) -> Table:
    """Not a paper item (issue 28): linear CKA between each block's output and the next one's within one
    network. Values near 1 within a stage mean the blocks there add nearly nothing (a zero-γ residual branch
    that stayed small), which leaves finding 2's "only the last few blocks" little to resolve."""
    cka, groups, layers = cka_groups(inputs)
    long = consecutive_similarity(cka, groups, layers)
    if long.empty:
        raise Missing(f"no store's {cka.display} against itself (the within-network matrix)")
    bounds = set(_stage_boundaries(inputs, layers))
    within = long[[(p + 0.5) not in bounds and "pool" not in t for p, t in zip(long["position"], long["transition"])]]
    summary = within.groupby(["label", "store"])["value"].agg(
        median="median", identical=lambda v: int((v >= 0.999).sum())).reset_index()
    order = long.drop_duplicates("transition").sort_values("position")["transition"].tolist()
    keep = ["label", "store", "column", "value"]
    parts = [long.rename(columns={"transition": "column"})[keep],
             summary.assign(column="median within stages", value=summary["median"])[keep],
             summary.assign(column="≥ 0.999", value=summary["identical"])[keep]]
    # one row per network: seed_summary's "seed" is the store here (mean ± s.e. over the seeds' stores)
    parts = [p.rename(columns={"store": "seed"}) for p in parts]
    cols = order + ["median within stages", "≥ 0.999"]
    numeric, shown, _ = seed_summary(pd.concat(parts, ignore_index=True), cols,
                                     digits={**{c: 3 for c in cols}, "≥ 0.999": 1}, bold=False)
    shown["label"] = shown["label"].map(display)
    n_within = within.groupby("store").size().max()
    stage = (f"'median within stages' and '≥ 0.999' (transitions with CKA ≥ 0.999, of {n_within}) are over the "
             f"block → block transitions inside a stage (stage boundaries: where the activation shape changes)"
             if bounds else f"'median within stages' and '≥ 0.999' (of {n_within}) are over every block → block "
             f"transition (no store to read stage boundaries from)")
    cap = (f"Linear CKA between the output of each layer and the next one's, within one network; mean ± s.e. over "
           f"seeds. Values near 1 mean the later block changed the representation little; {stage}. "
           f"{inputs.describe([x for v in groups.values() for x in v])}. {cka.meta_text()}.")
    return Table(numeric.rename(columns={"label": "objective"}), shown.rename(columns={"label": "Objective"}), cap)


def _stage_boundaries(inputs: Inputs, layers: list[str]) -> list[float]:
    """Positions between consecutive layers whose activation shape changes (a new ResNet stage)."""
    shapes = inputs.layer_shapes()
    if not shapes:
        return []
    return [i - 0.5 for i in range(1, len(layers))
            if layers[i] in shapes and layers[i - 1] in shapes and shapes[layers[i]] != shapes[layers[i - 1]]
            and not {layers[i], layers[i - 1]} & {"pool", "logits"}]


def _per_layer_plot(inputs: Inputs, df: pd.DataFrame, value: str, ylabel: str, title: str):
    layers = sorted(df["layer"].astype(str).unique(), key=natural_key)
    layers = [l for l in layers if l != "logits"] or layers
    pos = {l: i for i, l in enumerate(layers)}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.38 * len(layers) + 3), 4.2))
    for label in labels_in_order(df["label"]):
        g = df[(df["label"] == label) & df["layer"].isin(layers)].groupby("layer")[value]
        mean, sd = g.mean(), g.std()
        x = [pos[l] for l in mean.index]
        order = np.argsort(x)
        xs, ms = np.asarray(x)[order], mean.to_numpy()[order]
        ax.plot(xs, ms, marker="o", ms=3.5, color=color(label), label=display(label))
        if sd.notna().any():
            ax.fill_between(xs, ms - sd.to_numpy()[order], ms + sd.to_numpy()[order], color=color(label), alpha=0.15)
    bounds = _stage_boundaries(inputs, layers)
    for b in bounds:
        ax.axvline(b, color="0.4", ls="--", lw=0.9)
    ax.set_xticks(range(len(layers)), [_short(l) for l in layers], rotation=45 if len(layers) > 10 else 0)
    ax.set_xlabel("Layer (block number, then penultimate pool)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    legend_outside(ax)
    return fig, bounds


@item("fig3", "Fig. 3: fraction of non-zero activations per block", "figure", ("sparsity.csv",))
def fig3(inputs: Inputs) -> Figure:
    df = one_split(inputs.csv("sparsity"), prefer="layers").copy()
    df["pct"] = 100.0 * pd.to_numeric(df["nonzero_fraction"])
    fig, bounds = _per_layer_plot(inputs, df, "pct", "Non-zero activations (%)",
                                  "Sparsity of activations after each block")
    stage = ("Dashed lines: stage boundaries (activation shape changes)." if bounds else
             "Stage boundaries not drawn (no store to read layer shapes from).")
    return Figure(fig, f"Mean over seeds (band: ± sd). {stage} {describe_rows(df)}.")


@item("fig4", "Fig. 4: class separation R² per layer", "figure", ("separation.csv",))
def fig4(inputs: Inputs) -> Figure:
    df = inputs.csv("separation")
    df = df[df["distance"].astype(str) == "cosine"]
    if df.empty:
        raise Missing("separation.csv has no cosine-distance rows")
    split = one_split(df, prefer="layers")
    fig, bounds = _per_layer_plot(inputs, split, "r2", "Class separation R² (cosine)", "Class separation per layer")
    note = ""
    shown = split["split"].fillna("").astype(str).iloc[0] if "split" in split else ""
    if shown and shown != "train":  # the paper's Fig. 4 is on the training set, as Table 3 is
        has_train = "split" in df and (df["split"].fillna("").astype(str) == "train").any()
        note = (f" Drawn on the {shown} split, not the training set of the paper's Fig. 4 (the training split's "
                "blocks are not in separation.csv)" + (": its last point is not Table 3's R², which is of the "
                                                       "training split" if has_train else "") + ".")
    return Figure(fig, "R² = 1 − d̄_within / d̄_total (Eq. 11), convolutional layers flattened across space; "
                       f"mean over seeds (band: ± sd).{note} {describe_rows(split)}.")


@item("table3", "Table 3: source accuracy and penultimate-layer class separation", "table", ("separation.csv",))
def table3(inputs: Inputs) -> Table:
    sep = one_split(penultimate_r2(inputs))
    parts = [one_r2_per_run(sep).rename(columns={"r2": "value"}).assign(column="R²")]
    note = ""
    try:
        src = inputs.source_accuracy()
        parts.insert(0, src.assign(column="Source top-1", value=as_percent(src["top1"])))
    except Missing as exc:
        note = f" Source accuracy omitted ({exc})."
    long = pd.concat([p[["label", "seed", "column", "value"]] for p in parts], ignore_index=True)
    cols = [c for c in ("Source top-1", "R²") if (long["column"] == c).any()]
    numeric, shown, _ = seed_summary(long, cols, digits={"R²": 3}, bold=False)
    shown["label"] = shown["label"].map(display)
    cap = (f"Mean ± s.e. over seeds; R² (Eq. 11, cosine) of layer {sep['layer'].iloc[0]}. {describe_rows(sep)}.{note}")
    return Table(numeric.rename(columns={"label": "objective"}), shown.rename(columns={"label": "Objective"}), cap)


@item("tableE1", "Table E.1: class separation under different distances", "table", ("separation.csv",))
def tableE1(inputs: Inputs) -> Table:
    sep = inputs.csv("separation")
    layer = inputs.penultimate(sep["layer"].astype(str))
    sep = one_split(sep[sep["layer"].astype(str) == layer])
    names = {"cosine": "Cosine", "cosine_centered": "Cosine (mean-subtracted)", "sqeuclidean": "Euclidean"}
    present = [d for d in names if (sep["distance"] == d).any()]
    if len(present) < 2:
        raise Missing("separation.csv has fewer than 2 distances at the penultimate layer")
    long = pd.concat([one_r2_per_run(sep[sep["distance"] == d]).assign(column=names[d]) for d in present])
    numeric, shown, _ = seed_summary(long.rename(columns={"r2": "value"}), [names[d] for d in present],
                                     digits={names[d]: 4 for d in present}, bold=False)
    shown["label"] = shown["label"].map(display)
    cap = (f"R² of layer {layer}, mean ± s.e. over seeds. Mean-subtracted cosine centres activations on the mean "
           f"over all examples; Euclidean uses squared Euclidean distance on raw embeddings. {describe_rows(sep)}.")
    return Table(numeric.rename(columns={"label": "objective"}), shown.rename(columns={"label": "Objective"}), cap)


COLLAPSE_KEYS = {
    "norm_cv_means": "Std‖μ̃‖/Avg‖μ̃‖", "norm_cv_weights": "Std‖w‖/Avg‖w‖",
    "cos_std_means": "Std sim(μ̃,μ̃′)", "cos_std_weights": "Std sim(w,w′)",
    "equiangular_means": "Avg|sim(μ̃,μ̃′)+1/(C−1)|", "equiangular_weights": "Avg|sim(w,w′)+1/(C−1)|",
    "self_duality": "‖W/‖W‖−M/‖M‖‖²", "nc1": "Tr(Σ_W Σ_B⁺)/C",
}


@item("tableE2", "Table E.2: neural-collapse (simplex ETF) measurements", "table", ("collapse.csv",))
def tableE2(inputs: Inputs) -> Table:
    df = inputs.csv("collapse")
    layer = inputs.penultimate(df["layer"].astype(str))
    df = one_split(df[df["layer"].astype(str) == layer])
    keys = [k for k in COLLAPSE_KEYS if k in df and pd.to_numeric(df[k], errors="coerce").notna().any()]
    if not keys:
        raise Missing("collapse.csv has none of the collapse keys")
    long = pd.concat([df[["label", "seed"]].assign(column=k, value=pd.to_numeric(df[k], errors="coerce"))
                      for k in keys])
    numeric, shown, _ = seed_summary(long, keys, digits={k: 3 for k in keys}, bold=False)
    shown = shown.rename(columns=COLLAPSE_KEYS)
    shown["label"] = shown["label"].map(display)
    cap = (f"Layer {layer}; mean ± s.e. over seeds. μ̃_c: class means minus the mean of class means; w_c: "
           f"final-layer rows; population sd; pairs over c ≠ c′. {describe_rows(df)}.")
    return Table(numeric.rename(columns={"label": "objective"}), shown.rename(columns={"label": "Objective"}), cap)


@item("figE4", "Fig. E.4: class separation over training", "figure",
      ("separation.csv for ≥ 2 checkpoints (epochs)",))
def figE4(inputs: Inputs) -> Figure:
    sep = penultimate_r2(inputs, all_epochs=True)
    if "epoch" not in sep or sep.groupby(["label", "seed"])["epoch"].nunique().max() < 2:
        raise Missing("separation.csv results for ≥ 2 checkpoints (epochs) of one run are needed")
    sep = sep[sep.groupby(["label", "seed"])["epoch"].transform("nunique") >= 2]  # runs followed over training
    # the training split left, the evaluation splits right (App. E.4: "training set (left) and validation
    # set (right)"), on one y scale so that the panels compare at a glance
    splits = sorted(sep["split"].fillna("").unique(), key=lambda s: (s != "train", s)) if "split" in sep else [""]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(splits), figsize=(4.6 * len(splits) + 2, 3.8), squeeze=False, sharey=True)
    for ax, split in zip(axes.flat, splits):
        sub = sep[sep["split"].fillna("") == split] if "split" in sep else sep
        for label in labels_in_order(sub["label"]):
            g = sub[sub["label"] == label].groupby("epoch")["r2"].mean()
            ax.plot(g.index, g.values, marker="o", ms=3, color=color(label), label=display(label))
        ax.set_title(f"{split or 'all'} split")
        ax.set_xlabel("Epoch")
        ax.tick_params(labelleft=True)  # each panel keeps its own tick labels on the shared scale
    axes.flat[0].set_ylabel("Class separation R²")
    legend_outside(axes.flat[-1])
    fig.tight_layout()
    return Figure(fig, f"R² (cosine) of layer {sep['layer'].iloc[0]} at each checkpoint, mean over seeds; "
                       f"panels: {', '.join((s or 'all') + ' split' for s in splits)}, left to right, one y scale. "
                       f"{describe_rows(sep)}.")
