"""`repsim similarity`: several similarity measures between every (store, layer) pair, from one pass
over the stores (docs/measures.md); `repsim cka` is the same for linear CKA alone."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from repsim.commands.args import int_at_least, positive, positive_float
from repsim.commands._stream import layers_arg, stream_options
from repsim.commands import cka as _cka

HELP = "similarity measures (CKA, RBF CKA, CCA family, Procrustes, RSA, mutual kNN, ridge) between every pair"


def measure_listing() -> str:
    """One line per registered measure (repsim.kernels.measures, in their listing order): name, its
    estimators, range and formula — the epilog of ``repsim similarity --help``."""
    from repsim.kernels.measures import MEASURES, measure_names

    names = measure_names()
    width = max(map(len, names))
    ranges = {name: "[{}, {}]".format(*(f"{v:g}".replace("inf", "∞") for v in MEASURES[name].info.range))
              for name in names}
    lines = []
    for name in names:
        info = MEASURES[name].info
        lines.append(f"  {name:<{width}}  {'+'.join(info.estimators):<15}  {ranges[name]:<{max(map(len, ranges.values()))}}"
                     f"  {info.formula}")
    return ("measures (--measures; formulas, sources and invariances in docs/measures.md):\n" + "\n".join(lines)
            + "\n\nminibatch+exact: --method minibatch (default) streams batches, --method exact the full data; "
              "exact: the full data either way")


def configure(parser: argparse.ArgumentParser) -> None:
    # the same stores, batches, resume and refusals as `repsim cka`
    _cka.add_pair_arguments(parser, out_help="result file (.npz: SimilarityResult.save, repsim.load_result; one "
                                             "L x L matrix per measure; e.g. similarity_resnet50.npz)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the measure listing keeps its lines
    parser.epilog = measure_listing()
    parser.add_argument("--measures", default="linear_cka", metavar="A,B,...",
                        help="comma-separated measures, listed below (default linear_cka; --scheduler "
                             "distributes the minibatch pass only: the exact estimators run in this process)")
    parser.add_argument("--rbf-threshold", type=rbf_threshold, default=1.0, metavar="T",
                        help="rbf_cka: sigma^2 = T^2 x median squared distance (default 1.0; 0.167 to 5790, what "
                             "float64 holds: rbf_cka.RBF_THRESHOLD_RANGE)")
    parser.add_argument("--knn-k", type=positive, default=10, metavar="K", help="mutual_knn: neighbours (default 10)")
    parser.add_argument("--rsa-max-rows", type=int_at_least(3), default=2000, metavar="N",
                        help="rsa: above N examples, a seeded subsample of N rows (default 2000; >= 3)")
    parser.add_argument("--ridge-folds", type=int_at_least(2), default=5,
                        help="ridge_r2: cross-validation folds (default 5; >= 2)")
    parser.add_argument("--jackknife", type=int_at_least(5), default=None, metavar="G",
                        help="intervals for the exact measures: delete-a-group jackknife over the examples, G random "
                             "groups drawn from --seed (each group one more exact pass over the held columns: G times "
                             "the exact phase; e.g. 20). The minibatch measures always keep their per-batch "
                             "statistics (bootstrap over batches). Read them with SimilarityResult.ci(measure)")
    calib = parser.add_argument_group("calibration (permutation nulls, Groeger et al. 2026)")
    calib.add_argument("--permutations", type=positive, default=None, metavar="K",
                       help="K permutation nulls of every measure and pair in the same pass (rows of one side "
                            "permuted, within each batch on the minibatch route; one permutation per store and "
                            "draw, drawn from --seed): p-values, thresholds and calibrated scores in the result")
    calib.add_argument("--alpha", type=_alpha, default=0.05, metavar="A",
                       help="level of the threshold tau, the ceil((1-A)(K+1))-th order statistic (default 0.05; "
                            "needs K >= 1/A - 1)")
    calib.add_argument("--null", choices=("permutation", "analytic"), default="permutation",
                       help="permutation (default: needs --permutations) or analytic (linear/RBF CKA: exact "
                            "permutation moments, Pearson type III p-values, no draws)")


def _alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"alpha must lie in (0, 1), got {text}")
    return value


def rbf_threshold(text: str) -> float:
    """An argparse ``type`` for ``--rbf-threshold``: a number in ``RBF_THRESHOLD_RANGE``, one line else."""
    from repsim.kernels.measures.rbf_cka import check_threshold

    value = positive_float(text)
    try:
        return check_threshold(value, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


rbf_threshold.__name__ = "threshold"


def run(args: argparse.Namespace) -> int:
    from repsim.engine.minibatch import similarity_matrix
    from repsim.kernels.measures import parse_measures

    measures = parse_measures(args.measures)  # an unknown name is refused before any store is opened
    if args.permutations is not None or args.null == "analytic":  # refused before any store is opened
        from repsim.engine.calibration import null_request
        from repsim.kernels.measures import get_measure

        null_request(args.permutations, args.alpha, args.null, args.seed, [get_measure(m) for m in measures], [])
    options = {"rbf_threshold": args.rbf_threshold, "knn_k": args.knn_k, "rsa_max_rows": args.rsa_max_rows,
               "rsa_seed": args.seed, "ridge_folds": args.ridge_folds, "ridge_seed": args.seed}
    with _cka.claimed_outputs(args) as (out, ckpt):
        result = similarity_matrix(args.stores, measures, layers=layers_arg(args.layers),
                                   batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                                   shuffle=args.shuffle, spatial=args.spatial, debiased=not args.biased,
                                   method=args.method, options=options, shuffle_window=args.shuffle_window,
                                   checkpoint=ckpt if args.method == "minibatch" else None,
                                   checkpoint_every=args.checkpoint_every, allow_mixed_datasets=args.allow_mixed_datasets,
                                   permutations=args.permutations, alpha=args.alpha, null=args.null,
                                   jackknife=args.jackknife, stream=stream_options(args))
        path = _cka.finish(result, args, out, ckpt)
    L = len(result.index)
    print(f"repsim similarity: {', '.join(result.measures)} ({L}x{L}) over "
          f"{len(dict.fromkeys(s for s, _ in result.index))} store(s), n={result.meta['n']} -> {path}", file=sys.stderr)
    if args.jackknife is not None and not result.jackknife:
        print("repsim similarity: --jackknife applies to the exact estimators; every measure here ran on batches "
              "(their intervals: the bootstrap over batches, SimilarityResult.ci)", file=sys.stderr)
    for m in result.calibration:
        p = result.pvalues(m)
        cal = result.meta["calibration"]
        what = f"{cal['permutations']} permutations" if cal["kind"] == "permutation" else "analytic null"
        print(f"repsim similarity: {m}: {int((p <= cal['alpha']).sum())} of {int((~np.isnan(p)).sum())} "
              f"entries significant at alpha = {cal['alpha']} ({what})", file=sys.stderr)
    return 0
