"""`repsim demo`: the whole study end to end on a CPU, for one study profile (:mod:`repsim.analyses.profiles`).

``--profile digits`` (default): scikit-learn's digits (no download), in minutes. ``--profile fashion``:
Fashion-MNIST (``--data-root``, the Debian package ``dataset-fashion-mnist``, or ``--download``), where
the source task has headroom, in under an hour on 2 cores. Pretrains the mini ResNet (ResNet-50's
block layout) under every objective × seeds on the profile's source classes, extracts every block,
computes CKA, R², sparsity, collapse, spectra, linear/kNN transfer to the held-out target classes and
relearning of the source classes, and writes ``OUT/report/report.html`` with every figure and table
the data supports and whether the run reproduces the paper's three findings (criteria in
:mod:`repsim.analyses.findings`). Reruns reuse finished runs, stores and results; ``--fresh`` redoes all.
See :mod:`repsim.analyses.pipeline` for the stages and the layout of ``OUT``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from repsim.commands.args import add_deprecated

HELP = "end-to-end study on a CPU: digits (default) or Fashion-MNIST (--profile fashion)"


def configure(parser: argparse.ArgumentParser) -> None:
    from repsim.study.objectives import OBJECTIVES
    from repsim.analyses.profiles import PROFILES

    parser.add_argument("--profile", default="digits", choices=sorted(PROFILES),
                        help="study profile: digits (sklearn digits, minutes, default), fashion (Fashion-MNIST) or "
                             "fashion-tau (Fashion-MNIST, cosine softmax at 5 temperatures: Table 4, Fig. 5b)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default demo-out, or demo-out-PROFILE for other profiles)")
    parser.add_argument("--fresh", action="store_true", help="discard previous runs, stores, results and report")
    settings = sorted({s for p in PROFILES.values() for s in p.settings})
    parser.add_argument("--objectives", nargs="+", default=None, choices=[*OBJECTIVES, *settings], metavar="NAME",
                        help="objectives to train (default: all nine); for a profile of settings (fashion-tau: "
                             f"{', '.join(settings)}), the settings to train (default: all)")
    parser.add_argument("--num-seeds", dest="seeds", type=int, default=None, metavar="N",
                        help="networks per objective, seeds 0..N-1 (default: the profile's, 2)")
    add_deprecated(parser, "--seeds", dest="seeds", convert=int, metavar="N", instead="--num-seeds {value}")
    parser.add_argument("--epochs", type=int, default=None, help="override the presets' epochs (quick runs)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra `repsim train --set` for every network (e.g. data.train_per_class=100)")
    parser.add_argument("--data-root", default=None, metavar="DIR",
                        help="where the profile's data files are (fashion: the four *-idx?-ubyte[.gz] files)")
    parser.add_argument("--download", action="store_true",
                        help="fashion: fetch Fashion-MNIST with torchvision when it is not found locally")
    parser.add_argument("--jobs", type=int, default=None,
                        help="training/extraction processes at a time (default: min(2, CPUs))")
    parser.add_argument("--verbose", action="store_true", help="stream every line of the train/extract processes")


def run(args) -> int:
    from repsim.analyses.pipeline import Demo, DemoError, fresh
    from repsim.analyses.profiles import PROFILES
    from repsim.commands.main import CommandError
    from repsim.extras import require

    require("torch", "the demo (it trains and extracts)")
    profile = PROFILES[args.profile]
    objectives = tuple(args.objectives or profile.run_kinds)
    wrong = [o for o in objectives if o not in profile.run_kinds]
    if wrong:
        raise ValueError(f"--objectives {' '.join(wrong)}: profile {profile.name} trains {', '.join(profile.run_kinds)}")
    seeds = args.seeds if args.seeds is not None else profile.seeds
    if seeds < 1:
        raise ValueError("--num-seeds must be >= 1")
    jobs = args.jobs or max(1, min(2, os.cpu_count() or 1))
    out = (args.out or Path("demo-out" if profile.name == "digits" else f"demo-out-{profile.name}")).resolve()
    if args.fresh:
        fresh(out)
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(args.data_root).resolve()) if args.data_root else None
    demo = Demo(out, objectives, seeds, args.epochs, jobs, profile=profile, sets=tuple(args.sets),
                data_root=root, download=args.download, verbose=args.verbose)
    try:
        return demo.run()
    except DemoError as exc:  # a stage cannot run: one line, exit 2 (repsim.commands.main)
        raise CommandError(str(exc)) from None
