"""The ``repsim`` command line: one entry point, one module per subcommand.

Each subcommand module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``.
Modules are imported only to build their parser; anything heavy (torch, dask, zarr) is imported
inside ``run`` so that ``repsim --help`` is fast and ``import repsim`` never pulls in torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "train": "train.cli",
    "extract": "extract.cli",
    "check": "repsim.commands.check",
    "cka": "repsim.commands.cka",
    "separation": "repsim.commands.separation",
    "sparsity": "repsim.commands.sparsity",
    "collapse": "repsim.commands.collapse",
    "probe": "repsim.commands.probe",
    "figures": "analyses.cli",
    "demo": "analyses.demo",
}


def build_parser() -> argparse.ArgumentParser:
    from repsim import __version__

    parser = argparse.ArgumentParser(
        prog="repsim",
        description="Train, extract, and analyse neural-network representations "
        "(CKA, class separation, sparsity, neural collapse, transfer probes).",
    )
    parser.add_argument("--version", action="version", version=f"repsim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("repsim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
