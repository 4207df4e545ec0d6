"""Training-recipe tables of App. C and E: Table C.1 (training-set accuracy, from accuracy.csv), Table C.4
(combined losses and regularisers, training.csv), Tables C.5 and C.6 (AutoAugment, Mixup, the longer
×0.985 schedule: training.csv with its ``variant`` column) and Table E.3 (AutoAugment: top-1 and R²).

Training variants (``repsim.train.augment``, the ``variant`` of a run's config, recorded in training.csv and
in stores' ``model.variant``): "" is the standard recipe; "autoaugment", "mixup", and any variant with
a ``decay…`` token (the Table C.6 presets, e.g. "autoaugment+decay0.985")."""
from __future__ import annotations

import json

import pandas as pd

from repsim.analyses.data import DISPLAY, Inputs, Missing, describe_rows, display
from repsim.analyses.items.common import one_r2_per_run, one_split, penultimate_r2
from repsim.analyses.item import Table, item
from repsim.analyses.summary import as_percent, bold_rule_text, seed_summary
from repsim.study.objectives import BY_NAME

C5_VARIANTS = {"": "Standard", "autoaugment": "AutoAugment", "mixup": "Mixup"}


def _named(shown: pd.DataFrame, numeric: pd.DataFrame, row: str = "Objective"):
    shown = shown.copy()
    shown["label"] = shown["label"].map(display)
    return numeric.rename(columns={"label": "objective"}), shown.rename(columns={"label": row})


@item("tableC1", "Table C.1: training-set accuracy of each objective's network", "table", ("accuracy.csv (train split)",))
def tableC1(inputs: Inputs) -> Table:
    df = inputs.csv("accuracy")
    tr = df[df["split"].astype(str) == "train"]
    if tr.empty:
        raise Missing("accuracy.csv has no rows for a train-split store (`repsim accuracy` on the training-set stores)")
    tr = one_split(tr)
    long = pd.concat([tr.assign(column=c, value=as_percent(tr[k])) for c, k in (("Top-1 (%)", "top1"), ("Top-5 (%)", "top5"))])
    numeric, shown, _ = seed_summary(long[["label", "seed", "column", "value"]], ["Top-1 (%)", "Top-5 (%)"],
                                     digits={"Top-1 (%)": 2, "Top-5 (%)": 2}, bold=False)
    numeric, shown = _named(shown, numeric)
    cap = ("Top-1 / top-5 accuracy of each network's own final layer on the training set, evaluated without "
           "augmentation with the evaluated (EMA) weights (`repsim accuracy` over the stores' logits); mean ± s.e. "
           f"over seeds. {describe_rows(tr)}.")
    return Table(numeric, shown, cap)


# -- Table C.4 -------------------------------------------------------------------------------------
_COLUMN_ORDER = ("sigmoid", "label_smoothing", "squared_error", "cosine_softmax")  # the loss of the column
_ROW_ORDER = ("dropout", "logit_penalty", "logit_norm", "cosine_softmax", "extra_l2")


def _component(name: str, params: dict) -> str:
    keys = BY_NAME[name].defaults if name in BY_NAME else ()  # its hyperparameters (repsim.study.objectives)
    vals = [f"{k}={params[k]}" for k in keys if k in params and not (k == "scale_by_tau" and not params[k])]
    return DISPLAY.get(name, name) + (f" ({', '.join(vals)})" if vals else "")


def combination_cell(objective: str, params: dict) -> tuple[str, str, tuple]:
    """(row, column, sort key) of an objective in Table C.4's layout: the column is the loss (softmax
    "Baseline", label smoothing, sigmoid, cosine softmax), the row the regulariser or normaliser combined
    with it ("Baseline" for none); e.g. "sigmoid+cosine_softmax" is row Cosine softmax, column Sigmoid."""
    parts = [p for p in str(objective).split("+") if p]
    col = next((p for p in _COLUMN_ORDER if p in parts), "softmax")
    rest = sorted((p for p in parts if p not in (col, "softmax")),
                  key=lambda p: _ROW_ORDER.index(p) if p in _ROW_ORDER else len(_ROW_ORDER))
    row = " + ".join(_component(p, params) for p in rest) if rest else "Baseline"
    column = "Baseline" if col == "softmax" else _component(col, params)
    key = (tuple(_ROW_ORDER.index(p) if p in _ROW_ORDER else 9 for p in rest),
           tuple(sorted((k, str(v)) for k, v in params.items())))
    return row, column, key


@item("tableC4", "Table C.4: combining losses and regularisers", "table", ("training.csv with '+' objectives",))
def tableC4(inputs: Inputs) -> Table:
    tr = inputs.csv("training")
    standard = tr["variant"] == "" if "variant" in tr else pd.Series(True, index=tr.index)
    tr = tr[(tr["split"] == "holdout") & standard]
    if tr.empty or not tr["objective"].astype(str).str.contains(r"\+").any():
        raise Missing("training.csv has no holdout-split rows of a combined objective ('a+b', e.g. sigmoid+dropout)")
    params = tr["params"].fillna("{}").astype(str) if "params" in tr else pd.Series("{}", index=tr.index)
    best = tr.assign(_p=params).groupby(["objective", "_p", "seed"], dropna=False)["top1"].max().reset_index()
    cells = [combination_cell(o, json.loads(p) if p.startswith("{") else {}) for o, p in zip(best["objective"], best["_p"])]
    best["row"], best["column"], best["key"] = [c[0] for c in cells], [c[1] for c in cells], [c[2] for c in cells]
    order = {r: k for r, k in zip(best["row"], best["key"])}
    cols = sorted(best["column"].unique(), key=lambda c: (c != "Baseline", c))
    long = best.rename(columns={"row": "label", "top1": "value"})[["label", "seed", "column", "value"]]
    long["value"] = as_percent(long["value"])
    numeric, shown, _ = seed_summary(long, cols, bold=False,
                                     row_order=lambda r: ((r != "Baseline",) + order.get(r, ((9,), ())), r))
    cap = ("Highest holdout top-1 accuracy (%) reached during training (training.csv, holdout split), mean ± s.e. "
           "over seeds; columns: the loss, rows: the regulariser or normaliser combined with it. "
           f"{describe_rows(tr)}.")
    return Table(numeric.rename(columns={"label": "combined with"}),
                 shown.rename(columns={"label": "Combined with"}).fillna("–"), cap)


# -- Tables C.5, C.6, E.3 --------------------------------------------------------------------------
def _source_by_variant(inputs: Inputs) -> pd.DataFrame:
    src = inputs.source_accuracy()
    if "variant" not in src:
        src["variant"] = ""
    if "base_label" not in src:
        src["base_label"] = src["label"]
    src["variant"] = src["variant"].fillna("").astype(str)
    return src


def _alpha_note(inputs: Inputs) -> str:
    tune = inputs._raw_csv("tune")
    if tune is None or "selected" not in tune:
        return ""
    notes = []
    for (o, v), g in tune.groupby(["objective", "variant"] if "variant" in tune else ["objective"], dropna=False):
        sel = {json.loads(s).get("mixup.alpha") for s in g["selected"].astype(str) if s.startswith("{")} - {None}
        if sel:
            notes.append(f"{display(str(o))}: α = {', '.join(map(str, sorted(sel)))}")
    return f" Mixup α selected on the holdout (tune.csv): {'; '.join(notes)}." if notes else ""


@item("tableC5", "Table C.5: AutoAugment and Mixup on top of each objective", "table",
      ("training.csv with variants autoaugment / mixup",))
def tableC5(inputs: Inputs) -> Table:
    src = _source_by_variant(inputs)
    src = src[src["variant"].isin(C5_VARIANTS)]
    src = src[src["base_label"].isin(set(src.loc[src["variant"] != "", "base_label"]))]  # objectives with a variant
    present = [v for v in C5_VARIANTS if (src["variant"] == v).any()]
    if len(present) < 2 or "" not in present:
        raise Missing("training.csv needs standard runs and runs of variant autoaugment or mixup "
                      "(presets *-autoaugment, *-mixup)")
    parts, cols = [], []
    for v in present:
        sub = src[src["variant"] == v]
        for k in ("top1", "top5"):
            if k in sub and as_percent(sub[k]).notna().any():
                col = f"{C5_VARIANTS[v]} top-{k[3:]}"
                cols.append(col)
                parts.append(sub.assign(label=sub["base_label"], column=col, value=as_percent(sub[k])))
    long = pd.concat(parts)[["label", "seed", "column", "value"]]
    numeric, shown, bold = seed_summary(long, cols, digits={c: 1 if c.endswith("1") else 2 for c in cols})
    numeric, shown = _named(shown, numeric)
    n = int(long.groupby(["label", "column"])["seed"].nunique().min())
    cap = (f"Top-1 / top-5 accuracy (%) on the {src['split'].iloc[0]} split of the final (holdout-selected) "
           f"checkpoint, mean ± s.e. over seeds; AutoAugment: torchvision's ImageNet policy; the loss "
           f"hyperparameters are those of the standard runs. {bold_rule_text(n)}{_alpha_note(inputs)}")
    return Table(numeric, shown.fillna("–"), cap, bold.rename(columns={"label": "Objective"}))


@item("tableC6", "Table C.6: AutoAugment with the longer (×0.985 per epoch) schedule", "table",
      ("training.csv with variants autoaugment+decay…",))
def tableC6(inputs: Inputs) -> Table:
    src = _source_by_variant(inputs)
    src = src[src["variant"].str.contains("decay")]
    if src.empty:
        raise Missing("training.csv has no runs of a variant with a decay… token "
                      "(presets resnet50-imagenet-*-autoaugment-decay0.985)")
    src = src.assign(label=[f"{b} [with Mixup]" if "mixup" in v else b for b, v in zip(src["base_label"], src["variant"])])
    parts = [src.assign(column="Epochs", value=src["epoch"])]
    parts += [src.assign(column=f"Top-{k[3:]} (%)", value=as_percent(src[k])) for k in ("top1", "top5") if k in src]
    cols = [p["column"].iloc[0] for p in parts]
    long = pd.concat(parts)[["label", "seed", "column", "value"]]
    numeric, shown, _ = seed_summary(long, cols, digits={"Epochs": 0, "Top-1 (%)": 1, "Top-5 (%)": 2}, bold=False)
    numeric, shown = _named(shown, numeric)
    cap = (f"Networks trained with AutoAugment and a learning rate decaying ×0.985 per epoch instead of ×0.975 "
           f"(variants {', '.join(sorted(src['variant'].unique()))}); Epochs: the holdout-selected stopping epoch; "
           f"accuracy on the {src['split'].iloc[0]} split; mean ± s.e. over seeds.{_alpha_note(inputs)}")
    return Table(numeric, shown.fillna("–"), cap)


@item("tableE3", "Table E.3: AutoAugment raises accuracy without raising class separation", "table",
      ("training.csv and separation.csv with variant autoaugment",))
def tableE3(inputs: Inputs) -> Table:
    names = {"": "Standard", "autoaugment": "AutoAugment"}
    parts, notes = [], []
    split = None
    try:
        src = _source_by_variant(inputs)
        for v, name in names.items():
            sub = src[src["variant"] == v]
            if len(sub):
                parts.append(sub.assign(label=sub["base_label"], column=f"{name} top-1", value=as_percent(sub["top1"])))
        split = src["split"].iloc[0]
    except Missing as exc:
        notes.append(f"top-1 omitted ({exc})")
    try:
        sep = one_split(penultimate_r2(inputs))
        sep["variant"] = sep["variant"].fillna("").astype(str) if "variant" in sep else ""
        for v in names:
            sub = sep[sep["variant"] == v]
            if len(sub):
                r2 = one_r2_per_run(sub)
                base = dict(zip(sub["label"], sub["base_label"].fillna(sub["label"])))
                parts.append(r2.assign(label=r2["label"].map(base), column=f"{names[v]} R²", value=r2["r2"]))
        notes.append(f"R² (Eq. 11, cosine) of layer {sep['layer'].iloc[0]} on {describe_rows(sep).split('data: ')[-1]}")
    except Missing as exc:
        notes.append(f"R² omitted ({exc})")
    long = pd.concat(parts)[["label", "seed", "column", "value"]] if parts else pd.DataFrame()
    if long.empty or not long["column"].str.startswith("AutoAugment").any():
        raise Missing("no AutoAugment run (variant autoaugment) in training.csv or separation.csv")
    long = long[long["label"].isin(set(long.loc[long["column"].str.startswith("AutoAugment"), "label"]))]
    cols = [f"{n} {m}" for n in names.values() for m in ("top-1", "R²") if (long["column"] == f"{n} {m}").any()]
    numeric, shown, _ = seed_summary(long, cols, digits={c: 3 if c.endswith("R²") else 1 for c in cols}, bold=False)
    numeric, shown = _named(shown, numeric)
    cap = ("Mean ± s.e. over seeds; top-1 (%) on the " + (f"{split} split" if split else "evaluation split")
           + " of the final checkpoint. " + "; ".join(notes) + ".")
    return Table(numeric, shown.fillna("–"), cap)

