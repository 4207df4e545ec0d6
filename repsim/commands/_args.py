"""Argument types shared by the commands: integers with a lower bound.

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
