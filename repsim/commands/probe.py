"""`repsim probe`: transfer probes on stored features (paper Table 1, App. A.2; Table D.1; Fig. 6).

    repsim probe --train A_train.zarr B_train.zarr --test A_test.zarr B_test.zarr \
        [--layer pool] [--probe linear knn] [--metric top1|mean_per_class] [--task NAME] --out DIR
    repsim probe --relearn A_val.zarr B_val.zarr [--per-class 10] --out DIR

Train and test stores are paired in order (one pair per network; positional STOREs are more training
stores, before those of --train), and each pair is verified (``repsim.store.pairing.check_pair``): one
network (checkpoint digests, or the ``model`` metadata of stores written by ``save_store``), one dataset
(the ``dataset.name`` both record, up to a size suffix ``@N``: a probe fit on ``digits-source`` and
scored on ``digits-target`` measures nothing; ``--allow-mixed-datasets`` allows it on purpose, with a
warning) and different examples (``--same-examples`` allows a shared one on purpose, with a warning).
Single-label stores' labels must be classes (>= 0): ``-1`` marks an unlabelled example, which a probe
can neither fit nor score. Three modes:

- **Single-label stores** (Table 1): the linear probe (L-BFGS, λ chosen on a validation split) and/or
  kNN. Writes ``--out FILE.csv`` (or ``DIR/probes.csv`` for ``--out DIR``; store, objective, seed, task, probe, metric, accuracy, best_param,
  then the estimator metadata: layer, split, n, train_split, train_n, spatial, val_fraction, n_lambdas,
  estimator_seed) and ``DIR/probes.json`` (the same rows plus validation / leave-one-out curves and
  solver info). Rows for the same (store, task, probe, metric) are replaced, others kept.
- **Multi-label stores** (labels (N, K) bool, e.g. CheXpert; Table D.1, App. D.3): one L2-regularised
  binary logistic regression per target with λ tuned per target on a validation split, AUC on the test
  store from 1,000 evenly spaced bins (``repsim.probes.multilabel``). Writes ``DIR/multilabel.csv``
  (store, objective, seed, task, split, target, auc, best_lambda, + metadata) and
  ``DIR/multilabel.json`` (validation AUC curves); rows for the same (store, task, split, target) are
  replaced.
- **--relearn** (Fig. 6, the paper's protocol): each store holds one network's features of the
  *source* task's evaluation set (ImageNet validation) with its logits; ``--per-class`` examples of
  every class are held out, the linear probe is relearned on all the others, and both the relearned
  probe and the network's own final layer are scored on the held-out examples
  (``repsim.probes.transfer.relearn_head``). probes.csv rows: task ``relearn`` (or ``--task``, which
  must start with ``relearn`` or ``source``), probe ``linear`` (relearned) and ``original_head``. The
  store's labels must be numbered as the head's K outputs: labels outside [0, K) are refused, and so
  is a store whose metadata prove another label space (``repsim.store.pairing.check_label_space``:
  its ``dataset.num_classes`` is not K, its classes differ from those the network was trained on, or
  it holds another class subset of the training dataset's family, e.g. ``digits-target`` under a
  ``digits-source`` network) unless ``--allow-other-classes``.
"""
from __future__ import annotations

import argparse
import sys

from repsim.commands.args import (add_memory_budget_option, add_pairing_flags, add_progress_option, fraction,
                                  non_negative, positive)
from repsim.probes.writers import DEFAULTS, probe_outputs, write_probes

HELP = "transfer probes: linear / kNN (probes.csv), multi-label AUC (multilabel.csv), relearned heads"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", nargs="*", metavar="STORE", help="training-split stores (as --train)")
    parser.add_argument("--train", nargs="+", default=[], metavar="STORE",
                        help="training-split stores, one per network")
    parser.add_argument("--test", nargs="+", default=[], metavar="STORE",
                        help="test-split stores, paired in order with the training stores")
    parser.add_argument("--relearn", action="store_true",
                        help="Fig. 6: relearn the network's own classes from the stores (source-task "
                             "evaluation set, with logits) on all but --per-class held-out examples per "
                             "class; score it and the original head on those (no --test)")
    parser.add_argument("--per-class", type=positive, default=DEFAULTS["per_class"],
                        help="--relearn: held-out examples per class (default 10, Fig. 6)")
    parser.add_argument("--layer", default=DEFAULTS["layer"], help="layer to probe (default: pool)")
    parser.add_argument("--probe", nargs="+", choices=["linear", "knn"], default=list(DEFAULTS["probe"]),
                        help="single-label stores only; multi-label stores always get the per-target "
                             "linear probe")
    parser.add_argument("--metric", choices=["top1", "mean_per_class"], default=DEFAULTS["metric"],
                        help="accuracy reported and used to pick λ / k: top1 (default) or mean_per_class "
                             "(Table 2's mean per-class accuracy)")
    parser.add_argument("--task", default=DEFAULTS["task"],
                        help="task name in the output (default: the test store's dataset name; "
                             "'relearn' with --relearn)")
    parser.add_argument("--val-fraction", type=fraction, default=DEFAULTS["val_fraction"],
                        help="share of the training store held out to choose λ and k, then refit on all of it "
                             "(default 0.2: App. A.2 holds out a validation set without stating its size)")
    parser.add_argument("--lambdas", type=positive, default=DEFAULTS["lambdas"],
                        help="number of log-spaced λ in [1e-6, 1e5] (default 45, App. A.2)")
    parser.add_argument("--ks", type=positive, nargs="+", default=list(DEFAULTS["ks"]),
                        help="kNN probe: neighbour counts tried on the validation split (default 1 3 5 10 20 50 100)")
    parser.add_argument("--bins", type=positive, default=DEFAULTS["bins"],
                        help="multi-label stores: AUC from this many evenly spaced score bins (default "
                             "1000, App. D.3)")
    add_pairing_flags(parser, "training", "test", same_examples_use="a training-set score, on purpose",
                      mixed_datasets_risk="the score would not be a held-out estimate of one task",
                      other_classes_scope="--relearn: ")
    add_memory_budget_option(parser, default=DEFAULTS["memory_budget"] * 2**20,
                             bounds="single-label stores are probed in memory when the layer's working set (train + "
                                    "test rows x width x 16 bytes) fits, else out of core from the stores' chunks, "
                                    "keeping up to half of it of decoded training rows between passes (the same "
                                    "numbers to the solver's tolerance; memory bounded whatever n; 0: always out of "
                                    "core, nothing kept)")
    parser.add_argument("--seed", type=non_negative, default=DEFAULTS["seed"],
                        help="seed of the validation split and of --relearn's held-out examples (default 0)")
    parser.add_argument("--out", default=".", metavar="FILE.csv|DIR",
                        help="the results CSV (FILE.csv; per-store details go to FILE.json beside it), as for the "
                             "other analysis commands; or a directory for probes.csv / multilabel.csv (default: .)")
    add_progress_option(parser, what="the linear probes' λ-sweep bars on stderr")


def run(args) -> int:
    """`repsim probe`: :func:`repsim.probes.writers.write_probes` with the command's flags."""
    options = {name: getattr(args, name) for name in DEFAULTS}
    options["memory_budget"] = args.memory_budget / 2**20  # bytes -> MiB, write_probes' unit for a number
    rows, ml_rows = write_probes(list(args.stores) + list(args.train), args.test, out=args.out, relearn=args.relearn,
                                 progress=args.progress, **options)
    csv_path, ml_path = probe_outputs(args.out)
    if rows:
        print(f"repsim probe: {len(rows)} rows -> {csv_path}", file=sys.stderr)
    if ml_rows:
        print(f"repsim probe: {len(ml_rows)} multi-label rows -> {ml_path}", file=sys.stderr)
    return 0
