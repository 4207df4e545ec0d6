"""`repsim collapse`: neural-collapse metrics (paper Table E.2) and spectra (Fig. E.2) of the penultimate layer."""
from __future__ import annotations

import argparse
import sys

from repsim.commands._stream import MERGED_OUT, add_store_arguments, layers_arg, progress_arg

HELP = "neural-collapse metrics (and spectra) of the penultimate layer (collapse.csv, spectra.npz)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, <Table E.2 keys>" + MERGED_OUT,
                        layers_default="pool")
    parser.add_argument("--spectra", default=None, metavar="FILE",
                        help="also write singular-value spectra (activations, class centroids, final-layer "
                             "weights) to this .npz, keys <store>/<layer>/<kind>")


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import collapse_rows, merge_csv, merge_npz
    from repsim.engine.scheduler import scheduler
    from repsim.results import KEYS

    with scheduler(args.scheduler):
        rows, spectra = collapse_rows(args.stores, layers_arg(args.layers), spectra=args.spectra is not None,
                                      spatial=args.spatial, device=args.device, progress=progress_arg(args),
                                      threads=args.threads)
    path = merge_csv(rows, args.out, KEYS["collapse"], unique=True)
    if args.spectra is not None:  # merged as the CSV is: another store's or layer's spectra are kept
        merge_npz(spectra, args.spectra)
    print(f"repsim collapse: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
