"""Memory sizes with units, read and written one way everywhere (``--memory-budget``, the probes' and
the engine's budgets): :func:`parse_size` and :func:`format_size`. Base layer (the probes and the engine
import it); the standard library only."""
from __future__ import annotations

import re

__all__ = ["MiB", "GiB", "parse_size", "format_size"]

MiB = 2**20
GiB = 2**30
_UNITS = {"": MiB, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": MiB, "mib": MiB, "mb": 10**6,
          "g": GiB, "gib": GiB, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes of a memory size: ``"512MiB"``, ``"4GiB"``, ``"1.5G"``, ``"800MB"``, ``"0"``.

    Units (case-insensitive): ``B``; ``KiB``/``MiB``/``GiB``/``TiB`` and the shorthands ``K``/``M``/
    ``G``/``T`` are powers of 1024; ``kB``/``MB``/``GB``/``TB`` powers of 1000. A plain number is MiB
    (the unit ``--memory-budget`` of ``repsim probe``/``calibrate`` took before units were accepted).
    A number (int/float) is taken as MiB too. ValueError, naming the accepted forms, otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"expected a memory size, got {text!r}")
    if isinstance(text, (int, float)):
        text = repr(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a memory size such as 512MiB, 4GiB or 1.5G (a plain number is MiB), got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value != value or value == float("inf"):
        raise ValueError(f"expected a finite memory size, got {text!r}")
    return int(value)


def format_size(nbytes: float) -> str:
    """``536870912`` -> ``"512 MiB"``; ``8589934592`` -> ``"8 GiB"`` (as :func:`parse_size` reads it back)."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{int(nbytes)} B"
