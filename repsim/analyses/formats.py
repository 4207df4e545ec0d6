"""The files a figure is written as (``repsim figures --formats``): kept apart from the renderer, which
imports every item, so that building the command line imports nothing heavy."""
from __future__ import annotations

from typing import Sequence

FIGURE_FORMATS = ("png", "pdf", "svg")  # what matplotlib writes a figure as here
DEFAULT_FORMATS = ("png", "pdf")  # PNG for the report, PDF (TrueType fonts embedded) for papers


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` lower-cased, without a leading dot, in order, once each; ValueError naming any that is
    not one of :data:`FIGURE_FORMATS` (or when none is given)."""
    got = tuple(dict.fromkeys(str(f).lower().lstrip(".") for f in formats))
    bad = [f for f in got if f not in FIGURE_FORMATS]
    if bad or not got:
        what = f"{', '.join(bad)} {'is not a figure format' if len(bad) == 1 else 'are not figure formats'}" if bad \
            else "no format given"
        raise ValueError(f"--formats: {what}; choose from {', '.join(FIGURE_FORMATS)}")
    return got
