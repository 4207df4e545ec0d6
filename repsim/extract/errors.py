"""The one error type of extraction (its own module so that the hooks of repsim/extract/capture.py can raise it)."""
from __future__ import annotations


class ExtractError(ValueError):
    """A refused or failed extraction (bad settings, overflow, no disk room, mismatched resume)."""
