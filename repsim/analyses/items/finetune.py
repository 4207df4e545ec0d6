"""Fine-tuning items: Table 2 (fine-tuned transfer accuracy, App. A.3) from finetune.csv, and Fig. D.3 (CKA
between each layer of a network before and after fine-tuning, App. D.4) from cka_*.npz holding the stores
of both checkpoints."""
from __future__ import annotations

import numpy as np
import pandas as pd

from repsim.analyses.data import Inputs, Missing, display, natural_key, objective_key
from repsim.analyses.items.common import legend_outside, pyplot
from repsim.analyses.item import Figure, Table, item
from repsim.analyses.style import color
from repsim.analyses.summary import ALPHA, as_percent, bold_rule_text, seed_summary


def _grid_text(df: pd.DataFrame) -> str:
    """Caption fragment: the selected learning rates / weight decays and the grid behind them."""
    parts = []
    for col, name in (("lr", "learning rate"), ("weight_decay", "weight decay λ")):
        if col in df:
            v = pd.to_numeric(df[col], errors="coerce").dropna()
            if len(v):
                parts.append(f"{name} {v.min():.3g}–{v.max():.3g}")
    grid = pd.to_numeric(df.get("grid_points"), errors="coerce").dropna() if "grid_points" in df else []
    steps = pd.to_numeric(df.get("steps"), errors="coerce").dropna() if "steps" in df else []
    return ((f"selected {', '.join(parts)}" if parts else "")
            + (f" from a grid of {int(grid.max())} points" if len(grid) else "")
            + (f"; {int(steps.max())} steps of SGD" if len(steps) else ""))


@item("table2", "Table 2: fine-tuning transfer accuracy", "table", ("finetune.csv",))
def table2(inputs: Inputs) -> Table:
    df = inputs.csv("finetune")
    df["accuracy"] = as_percent(df["accuracy"])
    tasks = sorted(df["task"].astype(str).unique())
    long = df.rename(columns={"task": "column", "accuracy": "value"})[["label", "seed", "column", "value"]]
    cols = list(tasks)
    anova_note = ""
    avg_bold: set[str] | None = None
    if len(tasks) > 1:
        wide = long.pivot_table(index=["label", "seed"], columns="column", values="value", aggfunc="mean")
        wide = wide.dropna()  # the seeds fine-tuned on every task
        avg = wide.mean(axis=1).rename("value").reset_index().assign(column="Avg.")
        long = pd.concat([long, avg[["label", "seed", "column", "value"]]], ignore_index=True)
        cols.append("Avg.")
        per = {lab: g.to_numpy() for lab, g in wide.groupby(level="label")}
        if per and len({a.shape for a in per.values()}) == 1 and next(iter(per.values())).shape[0] * len(tasks) > 2:
            from repsim.probes.stats import not_significantly_worse_anova

            avg_bold = not_significantly_worse_anova(per, alpha=ALPHA)
            anova_note = (f" Avg.: mean over the {len(tasks)} tasks; bold by a two-way ANOVA (objective × task, "
                          f"seeds as replicates) of each objective against the best, p ≥ {ALPHA}.")
        else:
            if len({a.shape[0] for a in per.values()}) > 1:
                anova_note = (" Avg.: mean over tasks; bold by Student's pooled two-sample t-test over the per-seed averages (the objectives' "
                              "seed counts differ, so the two-way ANOVA's balanced design does not apply).")
            else:
                anova_note = (" Avg.: mean over tasks; bold as in the other columns (one seed per objective on two "
                              "tasks: the two-way ANOVA needs more seeds or tasks).")
    numeric, shown, bold = seed_summary(long, cols, digits={c: 1 for c in cols})
    if avg_bold is not None:
        bold["Avg."] = [lab in avg_bold for lab in numeric["label"]]
    shown["label"] = shown["label"].map(display)
    n_seeds = int(long.groupby("label")["seed"].nunique().min())
    metrics = ", ".join(f"{t}: {m}" for t, m in df.groupby("task")["metric"].first().items()) if "metric" in df else "top1"
    cap = (f"Accuracy (%) of networks fine-tuned from each pretrained network (App. A.3: learning rate and "
           f"weight decay chosen on a holdout split by the accuracy averaged over the pretrained seeds, then "
           f"retrained on train + holdout and tested); mean ± s.e. over pretrained seeds (n = {n_seeds}"
           f"{'' if long.groupby('label')['seed'].nunique().nunique() == 1 else ' or more'}). Metric per task: "
           f"{metrics}. {_grid_text(df)}. {bold_rule_text(n_seeds)}{anova_note}")
    names = {"label": "Pretraining objective"}
    return Table(numeric.rename(columns={"label": "objective"}), shown.rename(columns=names), cap, bold.rename(columns=names))


def _finetune_pairs(inputs: Inputs) -> list[dict]:
    """(source store, fine-tuned store, layers, diagonal CKA) for every fine-tuned store whose source
    network's store on the same data is in the same CKA file."""
    cka = inputs.cka
    runs = inputs.runs.drop_duplicates("store").set_index("store")
    known = [s for s in cka.stores if s in runs.index]
    tuned = [s for s in known if runs.loc[s, "finetuned_from"]]
    if not tuned:
        raise Missing("no fine-tuned network's store (model.finetuned_from) among the CKA files' stores")
    pairs = []
    for f in tuned:
        r = runs.loc[f]
        sources = [p for p in known if p != f and runs.loc[p, "sha256"] == r["finetuned_from"]
                   and runs.loc[p, "dataset"] == r["dataset"] and runs.loc[p, "split"] == r["split"]]
        for p in sources:
            layers = [l for l in cka.layers(p) if l in set(cka.layers(f)) and l != "logits"]
            m = cka.block(p, f, layers, layers) if layers else None
            if m is not None:
                layers_sorted = sorted(layers, key=natural_key)
                order = [layers.index(l) for l in layers_sorted]
                pairs.append(dict(source=p, tuned=f, label=runs.loc[p, "label"], seed=runs.loc[p, "seed"],
                                  data=f"{r['dataset']}/{r['split']}", layers=layers_sorted,
                                  cka=np.diag(m)[order]))
    if not pairs:
        raise Missing("no CKA file holds a fine-tuned network's store together with its source network's store on "
                      "the same data (extract both checkpoints on one split, then `repsim cka` over them)")
    return pairs


@item("figD3", "Fig. D.3: CKA between each layer before and after fine-tuning", "figure",
      ("results of repsim cka (.npz) with stores of source and fine-tuned checkpoints",))
def figD3(inputs: Inputs) -> Figure:
    pairs = _finetune_pairs(inputs)
    layers = max((p["layers"] for p in pairs), key=len)
    pos = {l: i for i, l in enumerate(layers)}
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in pairs:
        groups.setdefault((p["label"], p["data"]), []).append(p)
    datas = sorted({d for _, d in groups})
    styles = ["-", "--", ":", "-."]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.38 * len(layers) + 3), 4.2))
    for (label, data), ps in sorted(groups.items(), key=lambda kv: (objective_key(kv[0][0]), kv[0][1])):
        mat = np.full((len(ps), len(layers)), np.nan)
        for i, p in enumerate(ps):
            for l, v in zip(p["layers"], p["cka"]):
                mat[i, pos[l]] = v
        mean = np.nanmean(mat, axis=0)
        x = np.arange(len(layers))
        name = display(label) + (f", {data}" if len(datas) > 1 else "")
        ax.plot(x, mean, marker="o", ms=3.5, color=color(label), ls=styles[datas.index(data) % 4],
                label=f"{name} (n={len(ps)})")
        if len(ps) > 1:
            sd = np.nanstd(mat, axis=0, ddof=1)
            ax.fill_between(x, mean - sd, mean + sd, color=color(label), alpha=0.15)
    ax.set_xticks(range(len(layers)), [l.replace("block", "") for l in layers], rotation=45 if len(layers) > 10 else 0)
    ax.set_xlabel("Layer (block number, then penultimate pool)")
    ax.set_ylabel("CKA (before vs. after fine-tuning)")
    ax.set_ylim(min(0.0, float(np.nanmin([p["cka"].min() for p in pairs]))), 1.02)
    ax.set_title("Fine-tuning changes later layers more")
    legend_outside(ax)
    cap = (f"Linear CKA between each layer of a pretrained network and the same layer after fine-tuning, on "
           f"{', '.join(datas)}; mean over pretrained seeds (band: ± sd; n = networks). "
           f"{inputs.describe([p['source'] for p in pairs])}. {inputs.cka.meta_text()}.")
    return Figure(fig, cap)
