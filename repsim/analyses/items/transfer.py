"""Transfer items: Fig. 1, Table 1, Fig. D.1, Fig. 5, Table 4 / Fig. 5b, Fig. 6, Table F.1, Fig. D.2."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from repsim.analyses.data import Inputs, Missing, describe_rows, display, split_label
from repsim.analyses.items.common import (label_points, labels_in_order, legend_outside, mean_transfer, one_r2_per_run, one_split, panel_grid,
                                   penultimate_r2, pixel_baseline, pixel_line, probe_rows, probe_settings, pyplot)
from repsim.analyses.item import Figure, Table, item
from repsim.analyses.style import color
from repsim import assignment_accuracy, spearman

from repsim.analyses.summary import as_percent, bold_rule_text, seed_summary


def _scatter_runs(ax, df: pd.DataFrame, x: str, y: str) -> None:
    for label in labels_in_order(df["label"]):
        sub = df[df["label"] == label]
        ax.scatter(sub[x], sub[y], s=36, color=color(label), label=display(label),
                   edgecolor="black", linewidth=0.4, zorder=3)


@item("fig1", "Fig. 1: source accuracy vs. mean linear transfer accuracy", "figure",
      ("training.csv", "probes.csv"))
def fig1(inputs: Inputs) -> Figure:
    src = inputs.source_accuracy()
    lin = probe_rows(inputs, "linear")
    df = src.merge(mean_transfer(lin), on=["label", "seed"])
    if df.empty:
        raise Missing("no (objective, seed) present in both training.csv and probes.csv")
    df["top1"] = as_percent(df["top1"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    _scatter_runs(ax, df, "top1", "transfer")
    px = pixel_line(ax, inputs, lin["task"].unique())
    ax.set_xlabel(f"Source top-1 accuracy (%), {src['split'].iloc[0]} split")
    ax.set_ylabel(f"Mean linear transfer accuracy (%)\n over {lin['task'].nunique()} task(s)")
    ax.set_title("Higher source accuracy vs. linear transfer")
    legend_outside(ax)
    cap = (f"Points are individual training runs ({len(df)}); transfer tasks: "
           f"{', '.join(sorted(lin['task'].astype(str).unique()))}. {describe_rows(lin)}. "
           f"{probe_settings(lin)}." + px)
    return Figure(fig, cap)


@item("figD1", "Fig. D.1: source vs. linear transfer accuracy, per task", "figure",
      ("training.csv", "probes.csv"))
def figD1(inputs: Inputs) -> Figure:
    src = inputs.source_accuracy()
    lin = probe_rows(inputs, "linear")
    df = src.merge(lin[["label", "seed", "task", "accuracy"]], on=["label", "seed"])
    if df.empty:
        raise Missing("no (objective, seed) present in both training.csv and probes.csv")
    df["top1"] = as_percent(df["top1"])
    tasks = sorted(df["task"].astype(str).unique())
    fig, shown_axes, axes = panel_grid(len(tasks), 4, (3.2, 2.9), 2.2)
    for ax, task in zip(shown_axes, tasks):
        _scatter_runs(ax, df[df["task"] == task], "top1", "accuracy")
        ax.set_title(task)
        ax.set_xlabel("Source top-1 (%)")
        ax.set_ylabel("Linear transfer acc. (%)")
    legend_outside(axes[0, -1])
    fig.tight_layout()
    return Figure(fig, f"One panel per transfer task; points are runs. {describe_rows(lin)}. "
                       f"{probe_settings(lin)}.")


@item("table1", "Table 1: source accuracy and linear / kNN transfer accuracy", "table", ("probes.csv",))
def table1(inputs: Inputs) -> Table:
    probes = inputs.csv("probes")
    blocks, notes = [], []
    try:
        src = inputs.source_accuracy()
        keys = [k for k in ("top1", "top5") if k in src and as_percent(src[k]).notna().any()]
        if "top5" in keys and (as_percent(src["top5"]) >= 100).all():
            keys.remove("top5")
            notes.append("source top-5 omitted (100% for every network)")
        src_long = pd.concat([src.assign(column=f"Source {k[:3]}-{k[3:]}", value=as_percent(src[k])) for k in keys])
        notes.append(f"source accuracy on the {src['split'].iloc[0]} split (training.csv: the epoch of the run's best.pt, "
                     "App. A.1's early-stopping checkpoint, else its last epoch)")
    except Missing as exc:
        src_long, _ = None, notes.append(f"source accuracy omitted ({exc})")
    try:
        sep = one_split(penultimate_r2(inputs))
        r2_long = one_r2_per_run(sep).assign(column="R²").rename(columns={"r2": "value"})
        notes.append(f"R² (Eq. 11, cosine) of layer {sep['layer'].iloc[0]} on {describe_rows(sep).split('data: ')[-1]}")
    except Missing as exc:
        r2_long, _ = None, notes.append(f"R² omitted ({exc})")
    kinds = [p for p in ("linear", "knn") if (probes["probe"].astype(str) == p).any()]
    if not kinds:
        raise Missing("probes.csv has no linear or knn rows")
    n_seeds, used = 0, []
    for probe in kinds:
        try:
            rows = probe_rows(inputs, probe)
        except Missing:
            continue
        used.append(rows)
        n_seeds = max(n_seeds, int(rows.groupby("label")["seed"].nunique().min()))
        tasks = sorted(rows["task"].astype(str).unique())
        long = rows.rename(columns={"task": "column", "accuracy": "value"})[["label", "seed", "column", "value"]]
        parts = [p for p in (src_long, r2_long) if p is not None] + [long]
        if len(tasks) > 1:
            parts.append(mean_transfer(rows).rename(columns={"transfer": "value"}).assign(column="Avg."))
        cols = ([c for c in ("Source top-1", "Source top-5") if src_long is not None and c in set(src_long["column"])]
                + (["R²"] if r2_long is not None else []) + tasks + (["Avg."] if len(tasks) > 1 else []))
        parts = [p[["label", "seed", "column", "value"]] for p in parts]
        numeric, shown, bold = seed_summary(pd.concat(parts, ignore_index=True), cols, digits={"R²": 3}, unbolded={"R²"})
        for frame in (numeric, shown, bold):
            frame.insert(0, "probe", probe)
        shown["label"] = shown["label"].map(display)
        px = pixel_baseline(inputs, tasks) if probe == "linear" else {}
        if px:  # the baseline features must beat: a linear probe on raw pixels of the transfer task
            numeric, shown, bold = _with_pixel_row(numeric, shown, bold, px, tasks)
        blocks.append((numeric, shown, bold))
    numeric = pd.concat([b[0] for b in blocks], ignore_index=True).rename(columns={"label": "objective"})
    shown = pd.concat([b[1] for b in blocks], ignore_index=True).rename(columns={"label": "Objective", "probe": "Probe"})
    bold = pd.concat([b[2] for b in blocks], ignore_index=True)
    bold.columns = shown.columns
    bold[["Probe", "Objective"]] = False
    cap = (f"Mean ± s.e. over seeds, accuracies in %. {bold_rule_text(n_seeds)} Transfer (stores named in probes.csv): "
           f"{describe_rows(pd.concat(used))}. {probe_settings(pd.concat(used))}." + (" " + "; ".join(notes) + "." if notes else ""))
    return Table(numeric, shown.fillna("–"), cap, bold.fillna(False))


def _with_pixel_row(numeric: pd.DataFrame, shown: pd.DataFrame, bold: pd.DataFrame, px: dict[str, float],
                    tasks: list[str]):
    """(numeric, shown, bold) with a last row 'Raw pixels': the pixel baseline in the task columns (and
    their average), '–' elsewhere."""
    vals = {t: px[t] for t in tasks if t in px}
    if len(tasks) > 1 and len(vals) == len(tasks):
        vals["Avg."] = sum(vals.values()) / len(vals)
    num = {c: np.nan for c in numeric.columns}
    num.update({"probe": numeric["probe"].iloc[0], "label": "pixels"}, **{c: v for c, v in vals.items() if c in num})
    text = {c: "–" for c in shown.columns}
    text.update({"probe": shown["probe"].iloc[0], "label": "Raw pixels (linear probe)"},
                **{c: f"{v:.1f}" for c, v in vals.items() if c in text})
    return (pd.concat([numeric, pd.DataFrame([num])], ignore_index=True),
            pd.concat([shown, pd.DataFrame([text])], ignore_index=True),
            pd.concat([bold, pd.DataFrame([{c: False for c in bold.columns}])], ignore_index=True))


@item("fig5", "Fig. 5a: class separation vs. mean linear transfer accuracy", "figure",
      ("separation.csv", "probes.csv"))
def fig5(inputs: Inputs) -> Figure:
    sep = one_split(penultimate_r2(inputs))
    r2 = one_r2_per_run(sep)
    lin = probe_rows(inputs, "linear")
    df = r2.merge(mean_transfer(lin), on=["label", "seed"])
    if df["label"].nunique() < 3:
        raise Missing("fewer than 3 objectives with both R² and linear transfer (Spearman needs ≥ 3)")
    g = df.groupby("label").agg(r2=("r2", "mean"), r2_sd=("r2", "std"),
                                t=("transfer", "mean"), t_sd=("transfer", "std"))
    rho, p = spearman(g["r2"], g["t"])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label in labels_in_order(g.index):
        r = g.loc[label]
        ax.errorbar(r["r2"], r["t"], xerr=r["r2_sd"] if np.isfinite(r["r2_sd"]) else None,
                    yerr=r["t_sd"] if np.isfinite(r["t_sd"]) else None, fmt="o", ms=7, capsize=2,
                    color=color(label), label=display(label), mec="black", mew=0.4)
    px = pixel_line(ax, inputs, lin["task"].unique())
    ax.set_xlabel(f"Class separation R² ({sep['layer'].iloc[0]}, cosine)")
    ax.set_ylabel("Mean linear transfer accuracy (%)")
    ax.set_title(f"Spearman ρ = {rho:.2f}, p = {p:.3g} (n = {len(g)} objectives)")
    legend_outside(ax)
    cap = (f"One point per objective: mean over seeds (bars: sd). Spearman rank correlation across "
           f"objectives ρ = {rho:.3f}, two-sided p = {p:.3g}. R² from {describe_rows(sep)}; transfer "
           f"from {lin['task'].nunique()} task(s). {probe_settings(lin)}." + px)
    return Figure(fig, cap)


def swept_runs(inputs: Inputs) -> tuple[str, pd.DataFrame]:
    """The swept objective (cosine softmax preferred) and its runs, with a numeric ``value`` column."""
    runs = inputs.runs
    swept = runs.groupby("objective")["params"].nunique()
    swept = swept[swept > 1]
    if swept.empty:
        raise Missing("no objective trained with ≥ 2 parameter settings (e.g. cosine softmax temperatures)")
    objective = "cosine_softmax" if "cosine_softmax" in swept.index else swept.index[0]
    sub = runs[runs["objective"] == objective].copy()

    def first_number(text: str) -> float:
        m = re.search(r"(?:tau|temperature)=([-+0-9.eE]+)", text) or re.search(r"=([-+0-9.eE]+)", text)
        return float(m.group(1)) if m else np.nan

    sub["value"] = sub["params"].map(first_number)
    return objective, sub


@item("table4", "Table 4: temperature sweep — source accuracy, R², linear transfer", "table",
      ("stores (params)", "separation.csv", "probes.csv"))
def table4(inputs: Inputs) -> Table:
    objective, sweep = swept_runs(inputs)
    labels = sweep.drop_duplicates("label").sort_values("value")["label"].tolist()
    parts = []
    try:
        src = inputs.source_accuracy()
        parts.append(src.assign(column="Top-1", value=as_percent(src["top1"])))
    except Missing:
        pass
    try:
        parts.append(one_r2_per_run(penultimate_r2(inputs)).rename(columns={"r2": "value"}).assign(column="R²"))
    except Missing:
        pass
    lin = probe_rows(inputs, "linear")
    parts.append(lin.rename(columns={"task": "column", "accuracy": "value"}))
    long = pd.concat([p[["label", "seed", "column", "value"]] for p in parts], ignore_index=True)
    long = long[long["label"].isin(labels)]
    if long.empty:
        raise Missing(f"no results for the {objective} sweep")
    cols = [c for c in ("Top-1", "R²") if (long["column"] == c).any()] + sorted(lin["task"].astype(str).unique())
    numeric, shown, bold = seed_summary(long, cols, digits={"R²": 3}, bold=False,
                                        row_order=lambda l: labels.index(l) if l in labels else 1e9)
    shown["label"] = shown["label"].map(lambda l: split_label(l)[1] or l)  # the swept parameter(s)
    tasks = sorted(lin["task"].astype(str).unique())
    px = pixel_baseline(inputs, tasks)
    if px:
        for frame in (numeric, shown, bold):
            frame.insert(0, "probe", "linear")
        numeric, shown, bold = _with_pixel_row(numeric, shown, bold, px, tasks)
        for frame in (numeric, shown, bold):
            frame.pop("probe")
    shown = shown.rename(columns={"label": "Setting"})
    cap = (f"{display(objective)} trained at {len(labels)} settings; mean ± s.e. over seeds, accuracies in %. "
           f"{describe_rows(lin[lin['label'].isin(labels)])}. {probe_settings(lin)}.")
    return Table(numeric.rename(columns={"label": "setting"}), shown, cap)


@item("fig5b", "Fig. 5b: temperature controls class separation and linear transfer", "figure",
      ("stores (params)", "separation.csv", "probes.csv"))
def fig5b(inputs: Inputs) -> Figure:
    objective, sweep = swept_runs(inputs)
    r2 = one_r2_per_run(penultimate_r2(inputs))
    lin = probe_rows(inputs, "linear")
    df = r2.merge(mean_transfer(lin), on=["label", "seed"]).merge(
        sweep.drop_duplicates("label")[["label", "value", "params"]], on="label")
    if df["label"].nunique() < 2:
        raise Missing(f"fewer than 2 {objective} settings with both R² and transfer results")
    g = df.groupby(["label", "value", "params"]).agg(r2=("r2", "mean"), t=("transfer", "mean")).reset_index()
    g = g.sort_values("value")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    runs = df.sort_values("value")
    ax.scatter(runs["r2"], runs["transfer"], c=runs["value"], cmap="viridis", s=14, alpha=0.45, zorder=2,
               vmin=g["value"].min(), vmax=g["value"].max())  # every run (seed), faint
    sc = ax.scatter(g["r2"], g["t"], c=g["value"], cmap="viridis", s=60, edgecolor="black", zorder=3)
    ax.plot(g["r2"], g["t"], color="0.6", lw=1, zorder=2)
    for k, (_, r) in enumerate(g.iterrows()):  # labels alternate above and below: neighbours do not touch
        ax.annotate(split_label(r["label"])[1], (r["r2"], r["t"]), textcoords="offset points",
                    xytext=(5, 5) if k % 2 == 0 else (5, -12), fontsize=8)
    fig.colorbar(sc, ax=ax, label="temperature τ" if "tau" in "".join(g["params"]) else "parameter")
    ax.margins(x=0.15)  # room for the last point's label
    px = pixel_line(ax, inputs, lin["task"].unique())
    n = len(runs)
    rho, p = spearman(runs["r2"], runs["transfer"]) if n >= 3 else (np.nan, np.nan)
    ax.set_xlabel("Class separation R² (penultimate, cosine)")
    ax.set_ylabel("Mean linear transfer accuracy (%)")
    ax.set_title(f"{display(objective)}: parameter sweep"
                 + (f" (ρ(R², transfer) over {n} runs = {rho:.2f}, p = {p:.2g})" if n >= 3 else ""))
    return Figure(fig, f"Large points: one setting each (mean over seeds), joined in parameter order; small "
                       f"points: the runs (seeds); ρ: Spearman over the runs. {describe_rows(lin)}. "
                       f"{probe_settings(lin)}." + px)


@item("fig6", "Fig. 6: relearning the source classes from fixed features vs. class separation", "figure",
      ("separation.csv", "probes.csv (task relearn*: `repsim probe --relearn`; or source* with training.csv)"))
def fig6(inputs: Inputs) -> Figure:
    """The paper's protocol when probes.csv has ``original_head`` rows (`repsim probe --relearn`: both
    classifiers scored on the same held-out examples per class); otherwise footnote 2's variant, a
    probe fit on a separate split with the original head's accuracy from training.csv."""
    r2 = one_r2_per_run(penultimate_r2(inputs))
    relearn = probe_rows(inputs, "linear", source=True)
    try:
        heads = probe_rows(inputs, "original_head", source=True)
    except Missing:
        heads = None
    if heads is not None:  # paper protocol: the same held-out examples for both classifiers
        relearn = relearn[relearn["task"].isin(set(heads["task"]))]
        orig = heads.groupby(["label", "seed"], dropna=False)["accuracy"].mean().rename("top1").reset_index()
        held = pd.to_numeric(heads["n"], errors="coerce").dropna() if "n" in heads else pd.Series(dtype=float)
        where = ("on the held-out examples of probes.csv "
                 + (f"({int(held.max())} per network; " if len(held) else "(")
                 + f"{heads['protocol'].iloc[0] if 'protocol' in heads else 'held out per class'})")
    else:
        orig = inputs.source_accuracy()
        orig["top1"] = as_percent(orig["top1"])
        where = f"training.csv, {orig['split'].iloc[0]} split (footnote 2's variant: probe fit on another split)"
    a = r2.merge(orig, on=["label", "seed"]).groupby("label")[["r2", "top1"]].mean()
    b = r2.merge(relearn, on=["label", "seed"]).groupby("label")[["r2", "accuracy"]].mean()
    labels = labels_in_order(set(a.index) & set(b.index))
    if not labels:
        raise Missing("no objective with R², original-head accuracy and a relearned source-task probe")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label in labels:
        x = a.loc[label, "r2"]
        ax.plot([x, x], [a.loc[label, "top1"], b.loc[label, "accuracy"]], color="0.6", lw=1, zorder=1)
    # blue: hollow rings drawn over the filled orange dots, so that both show where they coincide
    ax.scatter(b.loc[labels, "r2"], b.loc[labels, "accuracy"], color="#ff7f0e", s=30, zorder=3,
               label="relearned linear classifier")
    ax.scatter(a.loc[labels, "r2"], a.loc[labels, "top1"], facecolors="none", edgecolors="#1f77b4", s=90,
               linewidths=1.6, zorder=4, label="original classifier")
    ax.set_xlabel("Class separation R² (penultimate, cosine)")
    ax.set_ylabel("Source-task accuracy (%)")
    legend_outside(ax)
    ax.margins(x=0.12, y=0.1)  # room for the labels at the edges
    label_points(ax, [(a.loc[l, "r2"], b.loc[l, "accuracy"]) for l in labels], [display(l) for l in labels])
    cap = (f"Blue rings: accuracy of the network's own final layer ({where}). "
           f"Orange dots: L²-regularised logistic regression relearned on fixed penultimate features "
           f"(probes.csv tasks {', '.join(sorted(relearn['task'].astype(str).unique()))}). "
           f"Means over seeds. {describe_rows(relearn)}.")
    return Figure(fig, cap)


@item("tableF1", "Table F.1: class overlap between the source and transfer datasets", "table",
      ("stores with logits on transfer datasets", "probes.csv"))
def tableF1(inputs: Inputs) -> Table:
    stores = inputs.require_stores("logits of the source classifier on each transfer dataset")
    lin = probe_rows(inputs, "linear")
    runs = inputs.runs.set_index("store")
    rows = []
    for task in sorted(lin["task"].astype(str).unique()):
        cands = [s for s in stores.values() if runs.loc[s.name, "dataset"] == task and s.logits is not None]
        if not cands:
            continue
        by_label = sorted(cands, key=lambda s: (runs.loc[s.name, "label"] != "softmax", s.name))
        label = runs.loc[by_label[0].name, "label"]
        same = [s for s in by_label if runs.loc[s.name, "label"] == label
                and runs.loc[s.name, "seed"] == runs.loc[by_label[0].name, "seed"]]
        fit = next((s for s in same if runs.loc[s.name, "split"] == "train"), same[0])
        ev = next((s for s in same if runs.loc[s.name, "split"] == "test"), fit)
        K = int(fit.logits.shape[1])
        n_target = int(max(fit.labels.max(), ev.labels.max())) + 1
        pf = np.asarray(fit.logits.argmax(axis=1).compute())
        pe = np.asarray(ev.logits.argmax(axis=1).compute())
        r = assignment_accuracy(pf, np.asarray(fit.labels), K, n_target, eval_pred=pe,
                                eval_target=np.asarray(ev.labels))
        acc, k = r.accuracy, r.k
        t = lin[(lin["task"] == task) & (lin["label"] == label)]["accuracy"].mean()
        rows.append(dict(dataset=task, classes=n_target, source_model=f"{label} seed {runs.loc[fit.name, 'seed']}",
                         replications_k=k, assignment_accuracy=100 * acc, linear_transfer_accuracy=t,
                         fit_split=runs.loc[fit.name, "split"], eval_split=runs.loc[ev.name, "split"]))
    if not rows:
        raise Missing("no store with logits on any probes.csv transfer task (dataset name = task name)")
    numeric = pd.DataFrame(rows)
    shown = numeric.copy()
    for c in ("assignment_accuracy", "linear_transfer_accuracy"):
        shown[c] = shown[c].map(lambda v: f"{v:.1f}")
    cap = ("Assignment accuracy: each source class is mapped to a transfer class by "
           "scipy.optimize.linear_sum_assignment on the matching matrix of the source classifier's top-1 "
           "predictions on the fit split (target classes replicated k times, k increased until k+1 gives no "
           "improvement), scored on the eval split. Semantic class overlap needs class names and is not "
           "computed. Linear transfer accuracy (%) of the same objective from probes.csv.")
    return Table(numeric, shown, cap)


@item("figD2", "Fig. D.2: linear transfer accuracy over pretraining", "figure",
      ("stores or probes.csv with epochs", "probes.csv"))
def figD2(inputs: Inputs) -> Figure:
    lin = probe_rows(inputs, "linear", all_epochs=True)
    if "epoch" not in lin or lin.groupby(["label", "seed"])["epoch"].nunique().max() < 2:
        raise Missing("probes.csv results for ≥ 2 checkpoints (epochs) of one run are needed")
    lin = lin[lin.groupby(["label", "seed"])["epoch"].transform("nunique") >= 2]  # runs followed over training
    tasks = sorted(lin["task"].astype(str).unique())
    fig, shown_axes, axes = panel_grid(len(tasks), 4, (3.3, 2.9), 2.2)
    for ax, task in zip(shown_axes, tasks):
        sub = lin[lin["task"] == task]
        for label in labels_in_order(sub["label"]):
            g = sub[sub["label"] == label].groupby("epoch")["accuracy"].mean()
            ax.plot(g.index, g.values, marker="o", ms=3, color=color(label), label=display(label))
        ax.set_title(task)
        ax.set_xlabel("Pretraining epoch")
        ax.set_ylabel("Linear transfer acc. (%)")
    legend_outside(axes[0, -1])
    fig.tight_layout()
    return Figure(fig, f"Mean over seeds at each checkpoint. {describe_rows(lin)}. {probe_settings(lin)}.")
