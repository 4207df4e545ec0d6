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

from repsim.commands.args import DEFAULT_BUDGET_MIB, add_memory_budget_option, add_pairing_flags

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


def kind_for(objective: str | None) -> str:
    """``sigmoid`` when the objective's loss is sigmoid cross-entropy (also in a ``+`` combination)."""
    return "sigmoid" if "sigmoid" in str(objective or "").split("+") else "softmax"


def run(args) -> int:
    rows, path = write_calibration(args.test, args.holdout, args.out, kind=args.kind, bins=args.bins,
                                   same_examples=args.same_examples, memory_budget=args.memory_budget / 2**20,
                                   allow_mixed_datasets=args.allow_mixed_datasets,
                                   allow_other_classes=args.allow_other_classes)
    print(f"repsim calibrate: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0


def write_calibration(test, holdout, out="calibration.csv", *, kind: str = "auto", bins: int = 15,
                      same_examples: bool = False, memory_budget: float | str = DEFAULT_BUDGET_MIB,
                      allow_mixed_datasets: bool = False, allow_other_classes: bool = False) -> tuple[list[dict], str]:
    """What `repsim calibrate` does, as a library call: one calibration.csv row per (test, holdout) pair
    of stores, written to ``out``; returns the rows and the path. Each pair is checked by
    ``repsim.store.pairing.check_pair`` (one network, one dataset unless ``allow_mixed_datasets``,
    different examples unless ``same_examples``), each store by ``check_label_space`` (its labels are the
    head's classes, unless ``allow_other_classes``). ``memory_budget``: MiB, or a size with units such as
    ``"4GiB"`` (``--memory-budget``). Bad input raises ValueError."""
    import numpy as np

    from repsim.engine.drivers import merge_csv
    from repsim.engine.options import parse_size
    from repsim.probes.rows import Rows
    from repsim.probes.calibration import calibration_report, calibration_report_rows, temperature_at_bound
    from repsim.results import KEYS, conform
    from repsim.store.finite import require_finite
    from repsim.store.pairing import check_label_space, check_pair
    from repsim.store.reader import open_store

    # expected failures raise ValueError: one line and exit status 2 (repsim.commands.main)
    if len(test) != len(holdout):
        raise ValueError(f"{len(test)} test stores but {len(holdout)} holdout stores; they are paired in order")
    if bins < 1:
        raise ValueError(f"--bins must be >= 1, got {bins}")
    budget = parse_size(memory_budget)  # bytes
    rows = []
    for te_path, ho_path in zip(test, holdout):
        te, ho = open_store(te_path), open_store(ho_path)
        for s in (te, ho):
            if not s.has_logits:
                raise ValueError(f"store {s.name} has no logits (extract them with `repsim extract`)")
            if s.multilabel:
                raise ValueError(f"store {s.name} holds multi-label targets; calibration needs one class per example")
        check_pair(te, ho, ("test", "holdout"), same_examples=same_examples, mixed_datasets=allow_mixed_datasets)
        for s in (te, ho):  # the head's probabilities are scored on each store's labels
            check_label_space(s, allow=allow_other_classes)
        objective = (te.model or {}).get("objective", "")
        net_kind = kind_for(objective) if kind == "auto" else kind
        # each store's values are checked on their own, so an error names the store that holds them
        y, yh = np.asarray(te.labels), np.asarray(ho.labels)
        k = int(te.zarr_array("/logits").shape[1])
        in_memory = (te.n + ho.n) * k * 32 <= budget
        try:
            if in_memory:
                z = require_finite(te.logits.compute(), te, "logits")
                zh = require_finite(ho.logits.compute(), ho, "logits")
                rep = {**calibration_report(z, y, zh, yh, kind=net_kind, bins=bins),
                       "top1": float(np.mean(z.argmax(1) == y)), "holdout_top1": float(np.mean(zh.argmax(1) == yh))}
            else:
                rep = calibration_report_rows(Rows.from_store(te, "/logits"), y, Rows.from_store(ho, "/logits"),
                                              yh, kind=net_kind, bins=bins)
        except ValueError as e:
            if str(e).startswith("store "):      # a finiteness refusal already names its store
                raise
            raise ValueError(f"test store {te.name} / holdout store {ho.name}: {e}") from e
        seed = (te.model or {}).get("seed", "")
        rows.append({"store": te.name, "objective": objective or "", "seed": "" if seed is None else seed,
                     "kind": net_kind, "top1": rep.pop("top1"), **rep,
                     "holdout_top1": rep["holdout_top1"],
                     "dataset": (te.dataset or {}).get("name", ""), "split": (te.dataset or {}).get("split", ""),
                     "n": te.n, "holdout_store": ho.name, "holdout_split": (ho.dataset or {}).get("split", ""),
                     "holdout_n": ho.n, "bins": bins})
        print(f"{te.name} ({net_kind}): NLL {rep['nll']:.4f} ECE {rep['ece']:.4f} | T={rep['temperature']:.3f}: "
              f"NLL {rep['nll_ts']:.4f} ECE {rep['ece_ts']:.4f}", flush=True)
        if temperature_at_bound(rep["temperature"]):
            print(f"WARNING: {te.name}: the temperature fit on holdout store {ho.name} ran to the end of its search "
                  f"range (T = {rep['temperature']:.3g}; holdout top-1 {100 * rep['holdout_top1']:.1f}%: a holdout "
                  "classified (almost) perfectly has its lowest NLL as T -> 0), so the scaled NLL/ECE are no "
                  "calibration; Table C.3 leaves them blank. A larger holdout with errors gives a temperature.",
                  flush=True)  # beside the pair's result line (stdout: the demo keeps both in calibration.log)
    rows = conform("calibration", rows)
    return rows, merge_csv(rows, out, KEYS["calibration"], unique=True)
