"""`repsim robustness`: evaluate checkpoints on OOD test sets — ImageNet-V2/-A/-R/-Sketch top-1, ImageNet-C mCE
(paper App. C.2, Table C.2); the layouts, class masks and transforms are in :mod:`repsim.train.robustness`.

    repsim robustness --checkpoint 'runs/*/best.pt' --eval-set imagenet-v2=/data/imagenetv2-matched-frequency \
        --eval-set imagenet-a=/data/imagenet-a --eval-set imagenet-r=/data/imagenet-r \
        --eval-set imagenet-sketch=/data/sketch --eval-set imagenet-c=/data/imagenet-c \
        [--classes /data/imagenet/train] --out results/robustness.csv

Writes robustness.csv (one row per network × set; ImageNet-C per corruption × severity, with CE and mCE
summaries); a rerun skips what is already in it for the same checkpoints.
"""
from __future__ import annotations

import argparse
import sys

from repsim.commands.args import add_deprecated, add_device_option

from .placement import device_arg

HELP = "evaluate checkpoints on ImageNet-V2/A/R/Sketch (top-1) and ImageNet-C (mCE) (robustness.csv)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", action="append", required=True, metavar="CKPT",
                        help="train checkpoint (repeatable; globs expanded)")
    parser.add_argument("--eval-set", action="append", default=None, metavar="NAME=DIR", dest="sets",
                        help="an evaluation set: imagenet-v2, imagenet-a, imagenet-r, imagenet-sketch, imagenet-c "
                             "(their own layouts; A and R scored over their 200 classes), or any NAME for a "
                             "class-folder tree scored over all classes (repeatable; at least one)")
    add_deprecated(parser, "--set", dest="sets", append=True, metavar="NAME=DIR", instead="--eval-set {value}")
    parser.add_argument("--classes", default=None, metavar="FILE_OR_DIR",
                        help="the networks' class names in logit order: a file (one per line) or an ImageFolder "
                             "root such as ImageNet's train/ (default: the run's training data folders)")
    parser.add_argument("--name", default="{parent}",
                        help="run name in the results: {stem}, {parent} of the checkpoint path (default {parent})")
    parser.add_argument("--out", default="robustness.csv", help="results CSV (default robustness.csv)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers (default min(4, cpus-1))")
    add_device_option(parser, package="PyTorch", type=device_arg, metavar="DEVICE",
                      cuda="cuda or cuda:N: that GPU, refused when there is none")
    parser.add_argument("--overwrite", action="store_true", help="re-evaluate everything instead of resuming")


def run(args) -> int:
    import os
    from pathlib import Path

    from repsim.paths import expand_paths
    from repsim.train.robustness import RobustnessError, evaluate

    # expected failures raise (RobustnessError, CheckpointError: ValueErrors): one line, exit status 2
    if not args.sets:
        raise RobustnessError("robustness: give at least one --eval-set NAME=DIR")
    ckpts = expand_paths(args.checkpoint, "file", "robustness: --checkpoint")
    sets = {}
    for spec in args.sets:
        name, sep, root = spec.partition("=")
        if not sep or not name or not root:
            raise RobustnessError(f"robustness: --eval-set {spec!r}: expected NAME=DIR")
        if name in sets:
            raise RobustnessError(f"robustness: --eval-set {name} given twice")
        sets[name.lower()] = root
    names = []
    for c in ckpts:
        p = Path(c)
        try:
            names.append(args.name.format(stem=p.stem, parent=p.resolve().parent.name))
        except (KeyError, IndexError) as exc:
            raise RobustnessError(f"robustness: --name {args.name!r}: unknown field {exc}") from None
    workers = min(4, max(0, (os.cpu_count() or 1) - 1)) if args.workers is None else args.workers
    evaluate(ckpts, sets, args.out, names=names, classes=args.classes, device=args.device,
             batch_size=args.batch_size, workers=workers, overwrite=args.overwrite,
             log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"repsim robustness: results -> {args.out}", file=sys.stderr)
    return 0
