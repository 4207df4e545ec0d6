"""`repsim collapse`: neural-collapse metrics (paper Table E.2) and spectra (Fig. E.2) of the penultimate layer."""
from __future__ import annotations

import argparse
import sys

from repsim.engine.options import DEFAULT_BUDGETS
from repsim.commands._stream import LAYERS_MEMORY, MERGED_OUT, add_store_arguments, layers_arg, stream_options

HELP = "neural-collapse metrics (and spectra) of the penultimate layer (collapse.csv, spectra.npz)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, <Table E.2 keys>" + MERGED_OUT,
                        memory_default=DEFAULT_BUDGETS["layers"], memory_bounds=LAYERS_MEMORY, layers_default="pool")
    parser.add_argument("--spectra", default=None, metavar="FILE",
                        help="also write singular-value spectra (activations, class centroids, final-layer "
                             "weights) to this .npz, keys <store>/<layer>/<kind>")


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import collapse_rows
    from repsim.results import KEYS, merge_csv, merge_npz

    rows, spectra = collapse_rows(args.stores, layers_arg(args.layers), spectra=args.spectra is not None,
                                  spatial=args.spatial, stream=stream_options(args))
    path = merge_csv(rows, args.out, KEYS["collapse"], unique=True)
    if args.spectra is not None:  # merged as the CSV is: another store's or layer's spectra are kept
        merge_npz(spectra, args.spectra)
    print(f"repsim collapse: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
