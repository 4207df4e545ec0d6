"""`repsim runs`: collect training runs' per-epoch accuracies into training.csv (Figs. C.1–C.3; the source
accuracy of Tables 1, 3, C.4–C.6, E.3).

    repsim runs 'runs/*' 'tune/*/final/*' --out results/training.csv

Each RUN directory is a `repsim train` output (metrics.csv, config.json). With a best.pt (the App. A.1
early-stopping checkpoint: ``repsim.study.runs.best_epoch``) the curve stops at that epoch, as the
paper's curves do (Figs. C.1–C.3); otherwise it runs to the last epoch. Rows: store (the run's name:
its path relative to the working directory), objective, params (JSON), variant, seed, epoch, split (train:
the running training accuracy as logged; holdout; test), top1, top5, mean_per_class (%), plus the
run's preset, schedule decay, Mixup α and epochs trained. Rows of the same runs already in ``--out``
are replaced, others kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "collect training runs' metrics into training.csv (each curve up to its best.pt epoch)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_OR_GLOB",
                        help="`repsim train` output directories or quoted globs; a run with a best.pt (App. A.1's "
                             "early-stopping checkpoint) contributes its epochs up to best.pt's, as the paper's "
                             "curves and tables do, else all of them")
    parser.add_argument("--out", required=True, metavar="FILE", help="training.csv to write (merged by run)")


def run(args: argparse.Namespace) -> int:
    from repsim.paths import expand_paths
    from repsim.results import merge_csv
    from repsim.study.runs import training_rows

    dirs = [Path(h) for h in expand_paths(args.runs, "run directory") if (Path(h) / "metrics.csv").is_file()]
    if not dirs:
        raise ValueError(f"no run directory with a metrics.csv among {' '.join(args.runs)}")
    rows = training_rows(dirs)
    merge_csv(rows, args.out, key=("store",))
    print(f"repsim runs: {len(dirs)} runs, {len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0
