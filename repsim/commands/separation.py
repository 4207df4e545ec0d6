"""`repsim separation`: class separation R² by layer (paper Eq. 11, Fig. 4, Table 3, Table E.1)."""
from __future__ import annotations

import argparse
import sys

from repsim.engine.options import DEFAULT_BUDGETS
from repsim.commands._stream import LAYERS_MEMORY, MERGED_OUT, add_store_arguments, layers_arg, stream_options

HELP = "class separation R^2 by layer, streamed from stores (separation.csv)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, out_help="CSV: store, objective, seed, layer, distance, r2" + MERGED_OUT,
                        memory_default=DEFAULT_BUDGETS["layers"], memory_bounds=LAYERS_MEMORY)
    parser.add_argument("--distance", default="cosine", metavar="D1,D2",
                        help="cosine (paper), cosine_centered, sqeuclidean (Table E.1), comma-separated, or all")


def run(args: argparse.Namespace) -> int:
    from repsim.engine.drivers import DISTANCES, separation_rows
    from repsim.results import KEYS, merge_csv

    distances = DISTANCES if args.distance == "all" else tuple(d.strip() for d in args.distance.split(","))
    rows = separation_rows(args.stores, layers_arg(args.layers), distances=distances, spatial=args.spatial,
                           stream=stream_options(args))
    path = merge_csv(rows, args.out, KEYS["separation"], unique=True)
    print(f"repsim separation: {len(rows)} rows -> {path}", file=sys.stderr)
    return 0
