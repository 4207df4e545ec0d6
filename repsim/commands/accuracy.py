"""`repsim accuracy`: top-1, top-5 and mean per-class accuracy of each network's own final layer, from the
logits in its stores (Table C.1: accuracy on the training set; any split).

    repsim accuracy 'stores/*-src-train.zarr' --out results/accuracy.csv

Rows (accuracy.csv): store, objective, seed, epoch, dataset, split, n, top1, top5, mean_per_class
(fractions; :mod:`repsim.kernels.accuracy`). The logits are read chunk by chunk. Rows for the same store
already in ``--out`` are replaced, others kept, so splits can be added one call at a time.

The head is scored only on labels numbered as its K outputs (``repsim.store.pairing.check_label_space``):
labels outside [0, K) are refused, and so is a store whose metadata prove another label space — its
``dataset.num_classes`` is not K, its recorded classes differ from those the network was trained on
(``model.train_dataset.classes``), or it holds another class subset of the training dataset's family
(``digits-target`` data under a ``digits-source`` network) — unless ``--allow-other-classes``. A store of
another dataset with the network's classes (ImageNet-V2 under an ImageNet network) is scored.
"""
from __future__ import annotations

import argparse
import sys

from repsim.commands.args import add_progress_option, show_progress

HELP = "top-1/top-5/mean per-class accuracy from stores' logits (accuracy.csv, Table C.1)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", nargs="+", metavar="STORE_OR_GLOB", help="activation stores with logits, or quoted globs")
    parser.add_argument("--out", required=True, metavar="FILE", help="CSV to write (merged by store)")
    add_progress_option(parser, what="a line per store on stderr as it is scored")
    parser.add_argument("--allow-other-classes", action="store_true",
                        help="score the head on a store whose metadata say its labels number other classes than "
                             "the head's outputs (default: refused; a warning says so)")


def run(args: argparse.Namespace) -> int:
    from repsim.paths import expand_paths
    from repsim.probes.writers import accuracy_rows
    from repsim.results import KEYS, merge_csv

    paths = expand_paths(args.stores, "store")
    rows = accuracy_rows(paths, progress=show_progress(args.progress), allow_other_classes=args.allow_other_classes)
    merge_csv(rows, args.out, key=KEYS["accuracy"], unique=True)
    print(f"repsim accuracy: {len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0
