"""`repsim check STORE...`: validate activation stores before analysing them (the checks are
:func:`repsim.store.check.check_stores`).

Prints one table row per array (store, layer, shape, dtype, stored size, compression ratio, NaN,
Inf; the logits once), then one line per problem on stderr; the exit status is 1 when there is any
problem, else 0. Each store is checked on its own; ``--compare`` also requires every store to hold the
first one's examples (stores meant for one ``repsim cka``/``similarity``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from repsim.commands.args import add_progress_option
from repsim.store.check import ArrayReport, check_stores

HELP = "validate activation stores: schema, checksums, completeness, alignment, NaN/Inf"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", nargs="+", metavar="STORE", help="activation store directories (.zarr)")
    parser.add_argument("--no-values", dest="scan_values", action="store_false",
                        help="skip the NaN/Inf scan of layers and logits (reads metadata, ids and labels only; fast)")
    parser.add_argument("--compare", action="store_true",
                        help="the stores are meant to be compared (one repsim cka/similarity): report every store "
                             "whose examples, labels or dataset differ from the first store's (default: each store "
                             "is checked on its own, differences are one note)")
    parser.add_argument("--allow-mixed-datasets", action="store_true",
                        help="with --compare: do not report stores whose dataset name/split differ from the first "
                             "store's (they hold the same examples in the same order)")
    add_progress_option(parser)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError  # pragma: no cover


def format_table(arrays: Sequence[ArrayReport]) -> str:
    head = ("store", "layer", "shape", "dtype", "stored", "ratio", "NaN", "Inf")
    rows = [
        (a.store, a.layer, "x".join(map(str, a.shape)), a.dtype, _size(a.stored), f"{a.ratio:.2f}",
         "-" if a.nan is None else str(a.nan), "-" if a.inf is None else str(a.inf))
        for a in arrays
    ]
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    right = {4, 5, 6, 7}
    fmt = lambda r: "  ".join(c.rjust(w) if j in right else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def run(args) -> int:
    report = check_stores(args.stores, scan_values=args.scan_values, progress=args.progress,
                          allow_mixed_datasets=args.allow_mixed_datasets, compare=args.compare)
    if report.arrays:
        print(format_table(report.arrays))
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    for problem in report.problems:
        print(problem, file=sys.stderr)
    if report.ok:
        print(f"{len(args.stores)} store(s) OK" if args.scan_values else
              f"{len(args.stores)} store(s) OK (metadata, ids and labels; --no-values read no layer chunks, so a "
              "corrupt or swapped chunk is found only by a full check)")
        return 0
    print(f"repsim check: {len(report.problems)} problem(s)", file=sys.stderr)
    return 1
