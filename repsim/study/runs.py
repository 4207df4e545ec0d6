"""`repsim train` run directories (metrics.csv, config.json, best.pt), torch-free: the early-stopping
rule and the training.csv rows.

:func:`best_epoch` is App. A.1's early-stopping rule, in one place: the first epoch with the highest
holdout score, NaN never. `repsim train` saves best.pt at that epoch (``repsim.train.loop``), `repsim tune`
records it per grid run and stops the selected point there (``repsim.train.tune``), and the curves of
training.csv (`repsim runs`, the demo) end there.
"""
from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

from repsim.results import conform


def run_names(dirs: Sequence[Path]) -> list[str]:
    """Each run's path relative to the working directory (absolute when outside it): unique, so rows of
    runs collected by separate calls never replace each other."""
    out = []
    for d in dirs:
        rel = os.path.relpath(Path(d).resolve())
        out.append(str(Path(d).resolve()) if rel.startswith("..") else rel)
    return out


def holdout_curve(metrics: Sequence[Mapping]) -> dict[int, float]:
    """{epoch: holdout top-1} of per-epoch metrics (metrics.csv's rows as read, or the training loop's
    records); epochs without a holdout evaluation are left out."""
    return {int(m["epoch"]): float(m["holdout_top1"]) for m in metrics
            if m.get("holdout_top1") not in ("", None)}


def best_epoch(curve: Mapping[int, float]) -> int | None:
    """The early-stopping rule (App. A.1): the first epoch with the highest score of ``curve`` ({epoch:
    score}); a NaN score (a diverged epoch) is never the best. None when no epoch has a score."""
    best = None
    for epoch in sorted(curve):
        score = curve[epoch]
        if not math.isnan(score) and (best is None or score > curve[best]):
            best = epoch
    return best


def training_rows(dirs: Sequence[Path], names: Sequence[str] | None = None) -> list[dict]:
    """training.csv rows of the runs in ``dirs`` (see the module docstring); ``names`` replace the
    default run names."""
    names = list(names) if names is not None else run_names(dirs)
    rows = []
    for name, d in zip(names, dirs):
        d = Path(d)
        with (d / "metrics.csv").open(newline="") as f:
            metrics = list(csv.DictReader(f))
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        last = (best_epoch(holdout_curve(metrics)) if (d / "best.pt").is_file() else None) or len(metrics)
        seed = cfg.get("seed", "")
        if seed == "" and "-s" in name:  # a run without config.json: <objective>-s<seed>
            seed = name.rsplit("-s", 1)[1]
        info = {"store": name, "objective": cfg.get("objective") or name.rsplit("-s", 1)[0],
                "params": json.dumps(cfg.get("objective_params", {}), sort_keys=True), "variant": cfg.get("variant", ""),
                "seed": seed}
        extra = {"preset": cfg.get("preset", ""), "schedule_decay": (cfg.get("schedule") or {}).get("decay", ""),
                 "mixup_alpha": (cfg.get("mixup") or {}).get("alpha", ""), "epochs_trained": last, "run": str(d)}
        for m in (m for m in metrics if int(m["epoch"]) <= last):
            for split in ("train", "holdout", "test"):
                top1 = m.get(f"{split}_top1", "")
                if top1 != "":
                    rows.append({**info, "epoch": int(m["epoch"]), "split": split, "top1": float(top1),
                                 "top5": m.get(f"{split}_top5", ""),
                                 "mean_per_class": m.get(f"{split}_mean_per_class", ""), **extra})
    return conform("training", rows)
