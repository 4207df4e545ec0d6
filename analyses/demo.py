"""`repsim demo`: the whole study end to end on scikit-learn's digits (no download), in minutes on a CPU.

Pretrains the mini ResNet (ResNet-50's block layout) under every objective × seeds on digits 0–4,
extracts every block, computes CKA, R², sparsity, collapse, spectra, linear/kNN transfer to digits 5–9
and relearning of the source classes, and writes ``OUT/report/report.html`` with every figure and
table the data supports and whether the run reproduces the paper's three findings (criteria in
:mod:`analyses.findings`). Reruns reuse finished runs, stores and results; ``--fresh`` redoes all.
See :mod:`analyses.pipeline` for the stages and the layout of ``OUT``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

HELP = "end-to-end demo on the scikit-learn digits set (train, extract, analyse, report)"


def configure(parser: argparse.ArgumentParser) -> None:
    from analyses.objectives import OBJECTIVES

    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default demo-out)")
    parser.add_argument("--fresh", action="store_true", help="discard previous runs, stores, results and report")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES, metavar="NAME",
                        help="objectives to train (default: all nine)")
    parser.add_argument("--seeds", type=int, default=2, help="networks per objective (default 2)")
    parser.add_argument("--epochs", type=int, default=None, help="override the presets' epochs (quick runs)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="training/extraction processes at a time (default: min(2, CPUs))")


def run(args) -> int:
    from analyses.pipeline import Demo, DemoError, fresh
    from repsim.commands.main import CommandError
    from repsim.extras import require

    require("torch", "the demo (it trains and extracts)")

    if args.seeds < 1:
        raise ValueError("--seeds must be >= 1")
    jobs = args.jobs or max(1, min(2, os.cpu_count() or 1))
    out = args.out.resolve()
    if args.fresh:
        fresh(out)
    out.mkdir(parents=True, exist_ok=True)
    demo = Demo(out, tuple(args.objectives), args.seeds, args.epochs, jobs)
    try:
        return demo.run()
    except DemoError as exc:  # a stage cannot run: one line, exit 2 (repsim.commands.main)
        raise CommandError(str(exc)) from None
