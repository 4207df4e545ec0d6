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


def accuracy_rows(paths: list[str], progress: bool = False, allow_other_classes: bool = False) -> list[dict]:
    """One accuracy.csv row per store (see the module docstring; ``allow_other_classes``:
    ``--allow-other-classes``)."""
    from repsim.kernels.accuracy import TopKAccuracy
    from repsim.results import conform
    from repsim.store.finite import require_finite
    from repsim.store.pairing import check_label_space
    from repsim.store.reader import open_store

    stores = [open_store(path) for path in paths]
    for s in stores:  # every store is checked before any is scored
        if not s.has_logits:
            raise ValueError(f"store {s.name} ({s.path}) holds no logits")
        check_label_space(s, allow=allow_other_classes)
    from repsim.engine.blocks import store_names

    rows = []
    for s, name in zip(stores, store_names(stores)):  # two stores of one name: their paths
        K = int(s.zarr_array("/logits").shape[1])
        acc = TopKAccuracy(K, ks=(1, 5))
        labels = s.labels
        for i in range(s.n_chunks):
            lo = i * s.chunk_rows
            z = require_finite(s.read_chunk("/logits", i), s, "logits", lo)
            acc.update(z, labels[lo:lo + len(z)])
        r = acc.result()
        model, data = s.model, s.dataset
        rows.append({"store": name, "objective": model.get("objective", "") or "",
                     "seed": "" if model.get("seed") is None else model.get("seed"),
                     "epoch": "" if model.get("epoch") is None else model.get("epoch"),
                     "dataset": data.get("name", ""), "split": data.get("split", ""), "n": s.n, **r})
        if progress:
            print(f"{s.name}: top-1 {r['top1']:.4f} top-5 {r['top5']:.4f} (n={s.n})", file=sys.stderr, flush=True)
    return conform("accuracy", rows)


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import merge_csv
    from repsim.results import KEYS

    from repsim.paths import expand_paths

    paths = expand_paths(args.stores, "store")
    rows = accuracy_rows(paths, progress=show_progress(args.progress), allow_other_classes=args.allow_other_classes)
    merge_csv(rows, args.out, key=KEYS["accuracy"], unique=True)
    print(f"repsim accuracy: {len(rows)} rows -> {args.out}", file=sys.stderr)
    return 0
