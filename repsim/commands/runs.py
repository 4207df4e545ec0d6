"""`repsim runs`: collect training runs' per-epoch accuracies into training.csv (Figs. C.1–C.3; the source
accuracy of Tables 1, 3, C.4–C.6, E.3).

    repsim runs 'runs/*' 'tune/*/final/*' --out results/training.csv

Each RUN directory is a `repsim train` output (metrics.csv, config.json). With a best.pt (the App. A.1
early-stopping checkpoint, best holdout top-1, first maximum) the curve stops at that epoch, as the
paper's curves do (Figs. C.1–C.3); otherwise it runs to the last epoch. Rows: store (the run's name:
its path relative to the working directory), objective, params (JSON), variant, seed, epoch, split (train:
the running training accuracy as logged; holdout; test), top1, top5, mean_per_class (%), plus the
run's preset, schedule decay, Mixup α and epochs trained. Rows of the same runs already in ``--out``
are replaced, others kept.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Sequence

HELP = "collect training runs' metrics into training.csv"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_OR_GLOB", help="`repsim train` output directories or quoted globs")
    parser.add_argument("--out", required=True, metavar="FILE", help="training.csv to write (merged by run)")


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import merge_csv

    from repsim._paths import expand_paths

    dirs = [Path(h) for h in expand_paths(args.runs, "run directory") if (Path(h) / "metrics.csv").is_file()]
    if not dirs:
        raise ValueError(f"no run directory with a metrics.csv among {' '.join(args.runs)}")
    rows = training_rows(dirs)
    merge_csv(rows, args.out, key=("store",))
    print(f"repsim runs: {len(dirs)} runs, {len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0


def run_names(dirs: Sequence[Path]) -> list[str]:
    """Each run's path relative to the working directory (absolute when outside it): unique, so rows of
    runs collected by separate calls never replace each other."""
    out = []
    for d in dirs:
        rel = os.path.relpath(Path(d).resolve())
        out.append(str(Path(d).resolve()) if rel.startswith("..") else rel)
    return out


def best_epoch(metrics: Sequence[dict]) -> int:
    """The epoch `repsim train` saved as best.pt: the first with the highest holdout top-1 (App. A.1 early
    stopping); the last epoch when no holdout was evaluated. ``metrics``: metrics.csv rows, in order."""
    if not metrics or metrics[0].get("holdout_top1", "") in ("", None):
        return len(metrics)
    hold = [float(m["holdout_top1"]) if m.get("holdout_top1") not in ("", None) else -1.0 for m in metrics]
    return int(metrics[hold.index(max(hold))]["epoch"])


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
        last = best_epoch(metrics) if (d / "best.pt").is_file() else len(metrics)
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
    return rows
