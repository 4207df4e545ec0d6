"""Options shared by the streaming subcommands (cka, separation, sparsity, collapse)."""
from __future__ import annotations

import argparse

from repsim.commands.args import scheduler_address

# what --out does with an existing file in the commands that merge their rows (repsim.results.KEYS)
MERGED_OUT = (" (an existing FILE is merged into: rows of the same store, layer and settings are replaced, "
              "the others kept)")


def add_store_arguments(parser: argparse.ArgumentParser, *, out_help: str, layers_default: str | None = None) -> None:
    parser.add_argument("stores", nargs="+", metavar="STORE_OR_GLOB",
                        help="activation stores (Zarr directories) or quoted globs such as 'runs/*.zarr'")
    parser.add_argument("--out", required=True, metavar="FILE", help=out_help)
    parser.add_argument("--layers", default=layers_default, metavar="L1,L2",
                        help="comma-separated layer names (default: %s)" % (layers_default or "every layer of every store"))
    parser.add_argument("--spatial", choices=("flatten", "mean"), default="flatten",
                        help="conv maps: flatten across space (paper, default) or average over space; "
                             "token sequences (T, D): flatten, or average over the tokens")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: NumPy (default); cuda: CuPy on the GPU (needs repsim-toolkit[gpu])")
    parser.add_argument("--scheduler", type=scheduler_address, default=None, metavar="ADDRESS",
                        help="dask.distributed scheduler address (tcp://host:8786), or local:N for a local "
                             "cluster of N worker processes; default: this process")
    parser.add_argument("--threads", type=int, default=None,
                        help="reader threads (prefetch); default 2 with --device cpu, one per core (at most 16) "
                             "with --device cuda, where decoding the chunks is the bound")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def layers_arg(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    return names or None


def progress_arg(args: argparse.Namespace) -> bool | None:
    return False if args.no_progress else None

