"""One module per ``repsim`` subcommand (see :mod:`repsim.cli`)."""
from __future__ import annotations

import argparse
import sys


def not_implemented(command: str, issue: int) -> int:
    """Exit code 2 with a one-line message for a subcommand whose issue has not landed."""
    print(f"repsim {command}: not implemented yet (issue {issue})", file=sys.stderr)
    return 2


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """``configure`` for a stub: accepts anything so the one-line message is what users see."""
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
