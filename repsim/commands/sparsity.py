"""`repsim sparsity`: fraction of non-zero activations by layer (paper Fig. 3)."""
from __future__ import annotations

import argparse
import sys

from repsim.engine.options import DEFAULT_BUDGETS
from repsim.commands._stream import LAYERS_MEMORY, MERGED_OUT, add_store_arguments, layers_arg, stream_options

HELP = "fraction of non-zero activations by layer, streamed from stores (sparsity.csv)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, nonzero_fraction" + MERGED_OUT,
                        memory_default=DEFAULT_BUDGETS["layers"], memory_bounds=LAYERS_MEMORY)


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import sparsity_rows
    from repsim.results import KEYS, merge_csv

    rows = sparsity_rows(args.stores, layers_arg(args.layers), stream=stream_options(args))
    path = merge_csv(rows, args.out, KEYS["sparsity"], unique=True)
    print(f"repsim sparsity: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
