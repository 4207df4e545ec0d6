"""`repsim figures`: regenerate the paper's figures and tables from stores and results files.

Every item the inputs support is written to ``--out`` (figures as PNG + PDF, or ``--formats``; tables
as CSV + Markdown) together with ``report.html``; items whose inputs are missing are listed in the report with
the reason. Exit status: 0, or 1 when an item failed with an error (its traceback is in the report).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from repsim.analyses.formats import DEFAULT_FORMATS, FIGURE_FORMATS, check_formats
from repsim.commands.args import add_deprecated, add_progress_option, show_progress

HELP = "regenerate the paper's figures and tables from stores and results"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stores", type=Path, default=None,
                        help="directory holding activation stores (*.zarr, searched recursively)")
    parser.add_argument("--results", type=Path, default=None,
                        help="directory of results files: every .npz written by repsim cka/similarity (found by content, "
                             "any name), separation.csv, probes.csv, ...")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory for figures, tables, report.html (required unless --list)")
    parser.add_argument("--only", nargs="+", metavar="ID", default=None,
                        help="render only these items (e.g. fig1 table1 fig2a; fig2a also renders fig2a_<measure>)")
    parser.add_argument("--list", action="store_true", help="list the items and their inputs, then exit")
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), metavar="FMT",
                        help=f"figure files to write, any of {', '.join(FIGURE_FORMATS)} (default: png pdf; the "
                             "report shows the PNG, else the SVG; a PDF embeds its fonts as TrueType, which "
                             "journals ask for, and takes ~0.4 s more per figure)")
    add_progress_option(parser, what="a line per item on stdout as it is rendered")
    add_deprecated(parser, "--quiet", dest="progress", takes_value=False, const=False, instead="--no-progress")


def make_figures(stores: Path | None, results: Path | None, out: Path, *, only=None, progress: bool = True,
                 title: str = "repsim figures", intro_html: str = "", only_stores: set[str] | None = None,
                 formats=DEFAULT_FORMATS):
    """Render every item the inputs support into ``out`` and write ``out/report.html``.

    ``only_stores``: names of the stores to use under ``stores`` (default: all). ``formats``: the figure
    files (:data:`repsim.analyses.formats.FIGURE_FORMATS`). Returns (outcomes, report path).
    """
    formats = check_formats(formats)  # (before the inputs are read)
    from repsim.analyses.data import Inputs
    from repsim.analyses.render import render_all
    from repsim.analyses.report import write_report

    inputs = Inputs(stores, results, only_stores)
    inputs.runs  # noqa: B018 - refuses stores it cannot tell apart (equal names) before any item renders
    outcomes = render_all(inputs, Path(out), only=set(only) if only else None, progress=progress, formats=formats)
    sources = f"Stores: {stores or '—'} ({len(inputs.stores)} complete). Results: {results or '—'}."
    return outcomes, write_report(outcomes, Path(out), title=title, intro_html=intro_html, sources=sources)


def run(args) -> int:
    if args.list:
        from repsim.analyses.render import ordered_items

        from repsim.analyses.item import NOT_PRODUCED

        for it in ordered_items():
            more = f"; also {it.id}_<measure> for every other measure in the results" if it.per_measure else ""
            if it.per_result:
                more = f"; one {it.id}_<file>_<measure> per results file and measure"
            title = it.title.format(measure="<measure>" if it.per_result else "linear CKA", file="<file>")
            print(f"{it.id:8s} {it.kind:6s} {title}  [needs: {', '.join(it.needs)}{more}]")
        for key, (title, why) in NOT_PRODUCED.items():
            print(f"{key:8s} {'-':6s} {title}  [not an item: {why}]")
        return 0
    if args.out is None:
        raise SystemExit("repsim figures: --out is required (or --list)")
    for name in ("stores", "results"):
        path = getattr(args, name)
        if path is not None and not path.is_dir():
            raise ValueError(f"--{name} {path} is not a directory")
    if args.only:
        from repsim.analyses.render import ordered_items

        items = ordered_items()
        known = {it.id for it in items}
        per_measure = tuple(f"{it.id}_" for it in items if it.per_measure)  # fig2a_<measure>
        unknown = [i for i in args.only if i not in known and not i.startswith(per_measure)]
        if unknown:
            raise ValueError(f"--only: unknown item(s) {', '.join(unknown)}; `repsim figures --list` lists the items")
    outcomes, report = make_figures(args.stores, args.results, args.out, only=args.only,
                                    progress=show_progress(args.progress), formats=args.formats)
    failed = [o for o in outcomes if o.status == "failed"]
    done = sum(o.status == "done" for o in outcomes)
    print(f"repsim figures: {done} rendered, {sum(o.status == 'skipped' for o in outcomes)} skipped, "
          f"{len(failed)} failed -> {report}")
    for o in failed:
        print(f"  FAILED {o.item.id}: {o.note.splitlines()[0]}")
    return 1 if failed else 0
