"""Argument types and flags shared by the commands: integers with a lower bound; the pairing overrides.

A value out of range is an argparse error (one line naming the option, exit 2), never an exception
deep inside the computation (``--seed -1`` reached NumPy's "expected non-negative integer", naming no
option) nor a value silently clamped (``--shuffle-window -5`` ran with another window).
"""
from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its messages
    return parse


non_negative = int_at_least(0)
# --memory-budget of `repsim probe` / `calibrate` (MiB): in memory below it, out of core above. Fixed, not
# sized to the machine, so the route (and with it the last digits of a fit) is the same everywhere.
DEFAULT_BUDGET_MIB = 512
positive = int_at_least(1)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """An argparse ``type`` accepting finite floats > 0."""
    value = _number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


positive_float.__name__ = "number > 0"


def fraction(text: str) -> float:
    """An argparse ``type`` accepting numbers strictly between 0 and 1."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


fraction.__name__ = "fraction in (0, 1)"


def scheduler_address(text: str) -> str:
    """An argparse ``type`` for ``--scheduler``: ``local:N`` (N >= 1 worker processes, the rule of
    :func:`repsim.engine.scheduler.local_workers`), ``threads``, or an address (``tcp://host:8786``)."""
    from repsim.engine.scheduler import local_workers

    try:
        local_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


scheduler_address.__name__ = "scheduler address"


def add_pairing_flags(parser: argparse.ArgumentParser, first: str, second: str, *, same_examples_use: str,
                      mixed_datasets_risk: str, other_classes_scope: str = "") -> None:
    """The overrides of ``repsim.store.pairing``'s refusals for a command that pairs a ``first`` and a
    ``second`` store (probe: training/test; calibrate: test/holdout): ``--same-examples``,
    ``--allow-mixed-datasets`` and ``--allow-other-classes``, each used on purpose with a warning."""
    parser.add_argument("--same-examples", action="store_true",
                        help=f"allow a {second} store that shares examples with its {first} store ({same_examples_use}; "
                             "a warning says so)")
    parser.add_argument("--allow-mixed-datasets", action="store_true",
                        help=f"allow a {second} store of another dataset than its {first} store (dataset.name differs; "
                             f"default: refused, {mixed_datasets_risk}; a warning says so)")
    parser.add_argument("--allow-other-classes", action="store_true",
                        help=f"{other_classes_scope}score the network's own head on a store whose metadata say its "
                             "labels number other classes than the head's outputs (default: refused; a warning says so)")
