"""Path arguments that may be quoted globs: the one rule every command applies.

An argument that exists is a path and is used as given, whatever characters it holds (a store named
``run[1].zarr`` or ``a*b.zarr`` is itself, never a pattern that matches something else); only an
argument that does not exist and holds glob characters (``*``, ``?``, ``[``) is expanded, sorted. A
missing argument without them is kept, so that opening it gives the caller's own "does not exist"
error; a pattern that matches nothing is an error naming ``what`` it should have matched.
"""
from __future__ import annotations

import glob
import os
from typing import Iterable


def expand_paths(patterns: Iterable[str | os.PathLike], what: str = "store", option: str | None = None) -> list[str]:
    """The paths ``patterns`` name, in order (see the module docstring); ``option`` (``"extract:
    --checkpoint"``) starts the message of a pattern that matches nothing."""
    out: list[str] = []
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if os.path.lexists(pattern) or "://" in pattern or not glob.has_magic(pattern):
            out.append(pattern)
            continue
        hits = sorted(glob.glob(pattern))
        if not hits:
            raise ValueError(f"{option} {pattern!r} matches no {what}" if option else f"no {what} matches {pattern!r}")
        out.extend(hits)
    return out
