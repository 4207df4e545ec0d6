"""Evaluation items: Table C.2 (out-of-distribution robustness), Table C.3 (calibration), Table D.1
(multi-label transfer, CheXpert). Each reads one results file (docs/architecture.md "Results files")."""
from __future__ import annotations

import numpy as np
import pandas as pd

from repsim.probes.calibration import TEMPERATURE_BOUNDS, temperature_at_bound, temperature_grid_step

from repsim.analyses.data import Inputs, Missing, describe_rows, display
from repsim.analyses.item import Table, item
from repsim.analyses.items.common import penultimate_rows
from repsim.analyses.summary import bold_rule_text, seed_summary

# robustness.csv benchmark -> Table C.2 column, in the paper's order
OOD_COLUMNS = {"imagenet-v2": "ImageNet-V2 (%)", "imagenet-a": "ImageNet-A (%)",
               "imagenet-sketch": "IN-Sketch (%)", "imagenet-r": "ImageNet-R (%)"}
MCE_COLUMN = "ImageNet-C (mCE)"


def _n_seeds(long: pd.DataFrame) -> int:
    return int(long.groupby("label")["seed"].nunique().min()) if len(long) else 0


def _finish(numeric: pd.DataFrame, shown: pd.DataFrame, bold: pd.DataFrame, first: str = "Objective"
            ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    shown = shown.copy()
    shown["label"] = shown["label"].map(display)
    shown = shown.rename(columns={"label": first})
    bold = bold.copy()
    bold.columns = shown.columns
    bold[first] = False
    return numeric.rename(columns={"label": "objective"}), shown, bold


@item("tableC2", "Table C.2: accuracy on out-of-distribution test sets and ImageNet-C mCE", "table",
      ("robustness.csv",))
def tableC2(inputs: Inputs) -> Table:
    df = inputs.csv("robustness")
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    top1 = df[df["metric"].astype(str) == "top1"].copy()
    top1["column"] = [OOD_COLUMNS.get(b, f"{b} (%)") for b in top1["benchmark"].astype(str)]
    top1["value"] = 100.0 * top1["value"]
    mce = df[df["metric"].astype(str) == "mce"].assign(column=MCE_COLUMN)
    long = pd.concat([top1, mce], ignore_index=True)
    if long.empty:
        raise Missing("robustness.csv has no top1 or mce rows")
    present = set(long["column"])
    cols = [c for c in OOD_COLUMNS.values() if c in present]
    cols += sorted(present - set(OOD_COLUMNS.values()) - {MCE_COLUMN}) + ([MCE_COLUMN] if MCE_COLUMN in present else [])
    numeric, shown, bold = seed_summary(long[["label", "seed", "column", "value"]], cols,
                                        lower_is_better={MCE_COLUMN})
    numeric, shown, bold = _finish(numeric, shown, bold)
    notes = []
    masked = df[(df["metric"].astype(str) == "top1") & (df["masked"].astype(str) == "True")]
    if len(masked):
        notes.append("arg max over the classes present in " + ", ".join(
            f"{b} ({int(pd.to_numeric(g['classes']).iloc[0])} classes)" for b, g in masked.groupby("benchmark")))
    if len(mce):
        subsets = sorted(set(mce["subset"].astype(str)))
        notes.append("mCE = mean over corruptions of Σ_s error / Σ_s AlexNet error (Hendrycks & Dietterich 2019), "
                     "in %, lower is better; " + "; ".join(subsets))
    n = ", ".join(f"{c.split(' (')[0]} {int(pd.to_numeric(g['n'], errors='coerce').max())}"
                  for c, g in top1.groupby("column"))
    cap = (f"Mean ± s.e. over seeds, top-1 accuracy (%) on each set's own protocol. {bold_rule_text(_n_seeds(long))} "
           + (f"Images per set: {n}. " if n else "") + f"{describe_rows(long)}."
           + (" " + "; ".join(notes) + "." if notes else ""))
    return Table(numeric, shown, cap, bold)


def _at_temperature_bound(df: pd.DataFrame) -> pd.Series:
    """Rows whose fitted T is no calibration (:func:`repsim.probes.calibration.temperature_at_bound`)."""
    if "temperature" not in df:
        return pd.Series(False, index=df.index)
    return pd.Series(temperature_at_bound(pd.to_numeric(df["temperature"], errors="coerce").to_numpy()),
                     index=df.index)


@item("tableC3", "Table C.3: calibration (NLL, ECE) before and after temperature scaling", "table",
      ("calibration.csv",))
def tableC3(inputs: Inputs) -> Table:
    df = inputs.csv("calibration")
    # a T at the search bound, or one grid step from it, is no calibrated temperature (a perfectly
    # classified holdout drives it to 0.01): those networks' T and scaled columns are left blank rather
    # than shown as results or averaged into their objective's cells
    names = {"nll": "NLL", "ece": "ECE", "nll_ts": "NLL (TS)", "ece_ts": "ECE (TS)", "temperature": "T"}
    scaled = [c for c in names if c in df and (c.endswith("_ts") or c == "temperature")]  # what T decides
    at_bound = _at_temperature_bound(df)
    df.loc[at_bound, scaled] = np.nan
    parts = [df.assign(column=shown, value=pd.to_numeric(df[key], errors="coerce"))
             for key, shown in names.items() if key in df]
    if not parts:
        raise Missing("calibration.csv has none of the columns nll, ece, nll_ts, ece_ts")
    long = pd.concat(parts, ignore_index=True)[["label", "seed", "column", "value"]]
    cols = [c for c in names.values() if c in set(long["column"])]
    numeric, shown, bold = seed_summary(long, cols, digits={c: 3 for c in cols},
                                        lower_is_better={"NLL", "ECE", "NLL (TS)", "ECE (TS)"}, unbolded={"T"})
    numeric, shown, bold = _finish(numeric, shown, bold)
    kinds = df.groupby("label")["kind"].first() if "kind" in df else pd.Series(dtype=str)
    sig = [display(l) for l, k in kinds.items() if str(k) == "sigmoid"]
    bins = sorted(set(pd.to_numeric(df.get("bins", pd.Series([15])), errors="coerce").dropna().astype(int)))
    holdout = ""
    if "holdout_split" in df:
        hs = df[["holdout_split", "holdout_n"]].drop_duplicates()
        holdout = " (" + "; ".join(f"{r.holdout_split}, n={r.holdout_n}" for r in hs.itertuples()) + ")"
    if at_bound.any():
        perfect = (pd.to_numeric(df.get("holdout_top1", pd.Series(np.nan, index=df.index)), errors="coerce") >= 1.0)
        why = (f" ({int((perfect & at_bound).sum())} of them classify their holdout perfectly, so its NLL falls "
               "as T → 0)" if (perfect & at_bound).any() else "")
        step = np.exp(temperature_grid_step(TEMPERATURE_BOUNDS))
        holdout += (f"; for {int(at_bound.sum())} of {len(df)} networks T stopped at the search bound "
                    f"{TEMPERATURE_BOUNDS[0]:g}–{TEMPERATURE_BOUNDS[1]:g} or one step of the fit's grid "
                    f"(a factor {step:.3g} in T) from it{why}: no calibrated temperature, so their T, "
                    "NLL (TS) and ECE (TS) are left out (blank where every seed is)")
    cap = (f"Mean ± s.e. over seeds. NLL = −mean log p(y); ECE over {', '.join(map(str, bins))} equal-width "
           f"confidence bins; TS: temperature T fit to minimise NLL on the holdout split{holdout}, as in Guo et al. "
           f"(2017). {bold_rule_text(_n_seeds(long), numeric, [c for c in cols if c != 'T'])} "
           + (f"Sigmoid networks ({', '.join(sig)}): σ(z_k/T) normalised by its sum over classes. " if sig else "")
           + f"{describe_rows(df)}.")
    return Table(numeric, shown, cap, bold)


@item("tableD1", "Table D.1: multi-label linear transfer (AUC per finding, e.g. CheXpert)", "table",
      ("multilabel.csv",))
def tableD1(inputs: Inputs) -> Table:
    df = penultimate_rows(inputs, inputs.csv("multilabel")).copy()
    df["value"] = 100.0 * pd.to_numeric(df["auc"], errors="coerce")
    df["column"] = df["target"].astype(str)
    blocks, n_seeds = [], 0
    keys = df[["task", "split"]].astype(str).drop_duplicates().itertuples(index=False)
    for task, split in keys:
        sub = df[(df["task"].astype(str) == task) & (df["split"].astype(str) == split)]
        cols = list(dict.fromkeys(sub["column"]))
        numeric, shown, bold = seed_summary(sub[["label", "seed", "column", "value"]], cols)
        numeric, shown, bold = _finish(numeric, shown, bold, "Pretraining loss")
        n = pd.to_numeric(sub["n"], errors="coerce").max() if "n" in sub else float("nan")
        what = f"{task} / {split}" + (f" ({int(n)} images)" if pd.notna(n) else "")
        for frame in (numeric, shown, bold):
            frame.insert(0, "evaluation", what)
        bold["evaluation"] = False
        blocks.append((numeric, shown.rename(columns={"evaluation": "Evaluation set"}), bold))
        n_seeds = max(n_seeds, _n_seeds(sub))
    numeric = pd.concat([b[0] for b in blocks], ignore_index=True)
    shown = pd.concat([b[1] for b in blocks], ignore_index=True).fillna("–")
    bold = pd.concat([b[2] for b in blocks], ignore_index=True).fillna(False)
    bold.columns = shown.columns
    bins = ", ".join(sorted(set(df["bins"].astype(str)))) if "bins" in df else "1000"
    cap = (f"AUC (%) of L²-regularised logistic regressions on fixed {', '.join(sorted(set(df['layer'].astype(str))))} "
           f"features, one per finding, λ chosen per finding by validation AUC; AUC from {bins} evenly spaced score "
           f"bins; uncertain and unmentioned findings are negatives (App. D.3). Mean over seeds ± s.e. "
           f"{bold_rule_text(n_seeds)} {describe_rows(df)}.")
    return Table(numeric, shown, cap, bold)
