"""`repsim collapse`: neural-collapse metrics (paper Table E.2) and spectra (Fig. E.2) of the penultimate layer."""
from __future__ import annotations

import argparse
import sys

from repsim.commands._stream import add_store_arguments, layers_arg, progress_arg

HELP = "neural-collapse metrics (and spectra) of the penultimate layer (collapse.csv, spectra.npz)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, <Table E.2 keys>", layers_default="pool")
    parser.add_argument("--spectra", default=None, metavar="FILE",
                        help="also write singular-value spectra (activations, class centroids, final-layer "
                             "weights) to this .npz, keys <store>/<layer>/<kind>")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from repsim.engine.drivers import collapse_rows, write_csv
    from repsim.engine.result import _atomic_savez
    from repsim.engine.scheduler import scheduler

    with scheduler(args.scheduler):
        rows, spectra = collapse_rows(args.stores, layers_arg(args.layers), spectra=args.spectra is not None,
                                      spatial=args.spatial, device=args.device, progress=progress_arg(args),
                                      threads=args.threads)
    path = write_csv(rows, args.out)
    if args.spectra is not None:
        _atomic_savez(args.spectra, {k: np.asarray(v) for k, v in spectra.items()})
    print(f"repsim collapse: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
