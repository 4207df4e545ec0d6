"""Options shared by the streaming subcommands (cka, similarity, separation, sparsity, collapse), and the
one :class:`~repsim.engine.options.StreamOptions` they build from them (:func:`stream_options`)."""
from __future__ import annotations

import argparse

from repsim.commands.args import (add_device_option, add_memory_budget_option, add_progress_option,
                                   scheduler_address)

# what --out does with an existing file in the commands that merge their rows (repsim.results.KEYS)
MERGED_OUT = (" (an existing FILE is merged into: rows of the same store, layer and settings are replaced, "
              "the others kept)")
# what --memory-budget bounds in the per-layer commands (repsim.engine.drivers), and in cka / similarity
LAYERS_MEMORY = ("the accumulators' state (class means, scatter matrices), layers grouped to fit it, one pass over "
                 "a store per group")
PAIRS_MEMORY = ("the exact estimators' n x n Grams, cross-covariances and full columns (beyond it the run is "
                "refused before reading); 1/16 of it, at most 512MiB, sizes their read panels and the minibatch "
                "read-ahead")


def add_store_arguments(parser: argparse.ArgumentParser, *, out_help: str, memory_default: int, memory_bounds: str,
                        layers_default: str | None = None) -> None:
    parser.add_argument("stores", nargs="+", metavar="STORE_OR_GLOB",
                        help="activation stores (Zarr directories) or quoted globs such as 'runs/*.zarr'")
    parser.add_argument("--out", required=True, metavar="FILE", help=out_help)
    parser.add_argument("--layers", default=layers_default, metavar="L1,L2",
                        help="comma-separated layer names (default: %s)" % (layers_default or "every layer of every store"))
    parser.add_argument("--spatial", choices=("flatten", "mean"), default="flatten",
                        help="conv maps: flatten across space (paper, default) or average over space; "
                             "token sequences (T, D): flatten, or average over the tokens")
    add_device_option(parser, package="CuPy (repsim-toolkit[gpu])",
                      cuda="cuda: the kernels run on the GPU, the stores' chunks decoded there")
    parser.add_argument("--scheduler", type=scheduler_address, default=None, metavar="ADDRESS",
                        help="dask.distributed scheduler address (tcp://host:8786), or local:N for a local "
                             "cluster of N worker processes; default: this process")
    parser.add_argument("--threads", type=int, default=None,
                        help="reader threads (prefetch); default 2 on the CPU, one per core (at most 16) "
                             "on the GPU, where decoding the chunks is the bound")
    add_memory_budget_option(parser, default=memory_default, bounds=memory_bounds)
    add_progress_option(parser)


def stream_options(args: argparse.Namespace):
    """The run's :class:`~repsim.engine.options.StreamOptions` from the parsed options (built once)."""
    from repsim.engine.options import StreamOptions

    return StreamOptions(device=args.device, threads=args.threads, memory_budget=args.memory_budget,
                         dtype=getattr(args, "compute_dtype", None), progress=args.progress,
                         scheduler=args.scheduler)


def layers_arg(value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    return names or None
