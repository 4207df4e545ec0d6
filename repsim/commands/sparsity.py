"""`repsim sparsity`: fraction of non-zero activations by layer (paper Fig. 3)."""
from __future__ import annotations

import argparse
import sys

from repsim.commands._stream import MERGED_OUT, add_store_arguments, layers_arg, progress_arg

HELP = "fraction of non-zero activations by layer, streamed from stores (sparsity.csv)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, nonzero_fraction" + MERGED_OUT)


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import merge_csv, sparsity_rows
    from repsim.engine.scheduler import scheduler
    from repsim.results import KEYS

    with scheduler(args.scheduler):
        rows = sparsity_rows(args.stores, layers_arg(args.layers), device=args.device, progress=progress_arg(args),
                             threads=args.threads)
    path = merge_csv(rows, args.out, KEYS["sparsity"], unique=True)
    print(f"repsim sparsity: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
