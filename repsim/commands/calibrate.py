"""`repsim calibrate`: NLL and ECE before and after temperature scaling, from stores' logits (Table C.3).

    repsim calibrate --test A_test.zarr B_test.zarr --holdout A_holdout.zarr B_holdout.zarr \
        [--kind auto|softmax|sigmoid] [--bins 15] --out results/calibration.csv

Test and holdout stores are paired in order (one pair per network: the same checkpoint evaluated on
the evaluation split and on the holdout split it never trained on; App. C.2 uses the 50,046-image
ImageNet holdout); each pair is verified as ``repsim probe``'s are (``repsim.store.pairing.check_pair``:
one network; one dataset, the ``dataset.name`` both record, so that the temperature is not fit on another
dataset's labels — ``--allow-mixed-datasets`` allows it on purpose, with a warning; different examples),
the head's probabilities are scored only on labels numbered as its K outputs (``repsim.store.pairing.
check_label_space``, as ``repsim accuracy``: labels outside [0, K) are refused, and so is a store whose
metadata prove another label space, e.g. a ``digits-target`` store of a ``digits-source`` network,
unless ``--allow-other-classes``), and NaN/Inf logits are refused naming the store that holds them. For
each network (``repsim.probes.calibration``, after Guo et al. 2017):

- probabilities ``p = softmax(z / T)``; for sigmoid-trained networks ``σ(z_k / T) / Σ_j σ(z_j / T)``
  (Table C.3: "we normalize the probability distribution by summing probabilities over all classes").
  ``--kind auto`` (default) takes ``sigmoid`` for objectives whose loss is sigmoid cross-entropy.
- ``NLL = −(1/N) Σ_i log p_{i, y_i}``;
- ``ECE = Σ_b (|B_b| / N) |acc(B_b) − conf(B_b)|`` over 15 equal-width bins of the confidence
  ``max_k p_ik``, bin b = ((b−1)/15, b/15];
- ``T`` minimises the NLL on the holdout store; NLL and ECE are reported at T = 1 and at that T.

Writes one row per network: store, objective, seed, kind, top1, nll, ece, temperature, nll_ts, ece_ts,
holdout_top1, then the estimator metadata: dataset, split, n, holdout_store, holdout_split, holdout_n,
bins. T is searched in [0.01, 100]; a holdout the network classifies perfectly drives it to 0.01 (the
NLL of correct predictions only falls as T → 0), which Table C.3's caption points out.
"""
from __future__ import annotations

import argparse
import sys

from repsim.commands.args import add_memory_budget_option, add_pairing_flags
from repsim.probes.writers import DEFAULT_BUDGET_MIB, write_calibration

HELP = "NLL and ECE before/after temperature scaling from stores' logits (calibration.csv, Table C.3)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--test", nargs="+", required=True, metavar="STORE",
                        help="stores of the evaluation split (with logits), one per network")
    parser.add_argument("--holdout", nargs="+", required=True, metavar="STORE",
                        help="stores of the holdout split of the same networks, paired in order; the "
                             "temperature is fit on these")
    parser.add_argument("--kind", choices=["auto", "softmax", "sigmoid"], default="auto",
                        help="how logits become probabilities (auto: sigmoid for sigmoid-loss objectives)")
    parser.add_argument("--bins", type=int, default=15, help="ECE bins (default 15, Table C.3)")
    add_pairing_flags(parser, "test", "holdout", same_examples_use="on purpose",
                      mixed_datasets_risk="the temperature would be fit on another dataset's labels")
    add_memory_budget_option(parser, default=DEFAULT_BUDGET_MIB * 2**20,
                             bounds="the logits are loaded when their float64 working set (test + holdout rows x "
                                    "classes x 32 bytes) fits, else streamed chunk by chunk (the same numbers up to "
                                    "summation order, peak memory flat in n; 0: always stream)")
    parser.add_argument("--out", default="calibration.csv", help="CSV to write (default calibration.csv)")


def run(args) -> int:
    rows, path = write_calibration(args.test, args.holdout, args.out, kind=args.kind, bins=args.bins,
                                   same_examples=args.same_examples, memory_budget=args.memory_budget / 2**20,
                                   allow_mixed_datasets=args.allow_mixed_datasets,
                                   allow_other_classes=args.allow_other_classes)
    print(f"repsim calibrate: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
