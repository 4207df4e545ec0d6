"""`repsim plot`: the heatmap of a results file of `repsim similarity` or `repsim cka`
(:meth:`repsim.SimilarityResult.plot`), written as PNG, PDF or SVG."""
from __future__ import annotations

import argparse
import os
import sys

from repsim.commands.args import add_deprecated

HELP = "heatmap of a similarity/CKA results file (every column, or store x store panels) to PNG/PDF/SVG"

FORMATS = (".png", ".pdf", ".svg")


def _names(values: list[str] | None) -> list[str] | None:
    """``--stores a,b c`` -> ["a", "b", "c"] (commas or spaces), None when not given."""
    if not values:
        return None
    out = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return out or None


def _layout(text: str) -> str:
    if text not in ("matrix", "grid"):
        raise ValueError(f"invalid choice {text!r} (choose from 'matrix', 'grid')")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", metavar="RESULT.npz", help="results file of `repsim similarity` or `repsim cka`")
    parser.add_argument("--out", required=True, metavar="FIG.png",
                        help="figure file; its extension picks the format (.png, .pdf or .svg); "
                             "an existing file is replaced")
    parser.add_argument("--measure", nargs="+", default=None, metavar="M",
                        help="measure(s) to draw (default: every measure of the file for --layout matrix, "
                             "the first for --layout grid)")
    # --layout, not --kind (calibrate's --kind is how logits become probabilities); --only-stores, not
    # --stores (figures' --stores is the directory of the stores): one meaning per option name
    parser.add_argument("--layout", dest="kind", choices=("matrix", "grid"), default="matrix",
                        help="matrix: every (store, layer) column against every other, one panel per measure "
                             "(default); grid: one panel per (store A, store B) pair, layers against layers "
                             "(as the paper's Fig. 2a)")
    add_deprecated(parser, "--kind", dest="kind", metavar="LAYOUT", convert=_layout, instead="--layout {value}")
    parser.add_argument("--only-stores", dest="stores", nargs="+", default=None, metavar="NAME",
                        help="only these stores, in this order (names as in the result; default all)")
    add_deprecated(parser, "--stores", dest="stores", metavar="NAME", nargs="+", instead="--only-stores {value}")
    parser.add_argument("--layers", nargs="+", default=None, metavar="NAME",
                        help="only these layers of every store (default all)")
    parser.add_argument("--calibrated", action="store_true",
                        help="draw the calibrated scores of the file's null (0 = not above chance; `repsim "
                             "similarity --permutations K` or --null analytic) and dot the cells whose p-value "
                             "exceeds the null's alpha")
    parser.add_argument("--title", default=None, help="figure title (default: stores, columns and n)")
    parser.add_argument("--dpi", type=int, default=150, help="PNG resolution (default 150)")


def run(args: argparse.Namespace) -> int:
    out = os.fspath(args.out)
    ext = os.path.splitext(out)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"--out {out}: the extension picks the format, one of {', '.join(FORMATS)}")
    if args.dpi < 10:
        raise ValueError(f"--dpi must be >= 10, got {args.dpi}")
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    from repsim.fileio import atomic_write
    from repsim.engine.result import load_result

    result = load_result(args.result)
    measures = _names(args.measure)
    unknown = [m for m in measures or [] if m not in result.measures]
    if unknown:
        raise ValueError(f"--measure: {', '.join(unknown)} not in {args.result}; it holds: "
                         f"{', '.join(result.measures)}")
    if args.kind == "grid" and measures and len(measures) > 1:
        raise ValueError("--layout grid draws one measure: give one --measure")
    shown = measures or (result.measures if args.kind == "matrix" else result.measures[:1])
    if args.calibrated:
        missing = [m for m in shown if m not in result.calibration]
        if missing:
            raise ValueError(f"--calibrated: {args.result} has no null for {', '.join(missing)}; compute one with "
                             "`repsim similarity ... --permutations K` (or --null analytic)")
    fig = result.plot(measures, stores=_names(args.stores), layers=_names(args.layers), kind=args.kind,
                      title=args.title, calibrated=args.calibrated)
    with atomic_write(out) as fh:
        fig.savefig(fh, format=ext[1:], dpi=args.dpi)
    note = ""
    if args.calibrated:
        from repsim.engine.heatmap import not_significant, null_alpha, select

        picked = select(result, _names(args.stores), _names(args.layers))
        counts = [f"{m} {int(not_significant(result, m)[np.ix_(picked, picked)].sum())} of {len(picked) ** 2}"
                  for m in shown]
        note = f"; cells not significant (p > {null_alpha(result):g}, dotted): {', '.join(counts)}"
    print(f"repsim plot: {'calibrated ' if args.calibrated else ''}{', '.join(shown)} ({args.kind}) of "
          f"{args.result} -> {out}{note}", file=sys.stderr)
    return 0
