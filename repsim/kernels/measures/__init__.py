"""Similarity measures between representations: one protocol (:mod:`._protocol`), one module per
measure, and a registry by name (the names of ``repsim similarity --measures``).

Adding a measure: a module here with a :class:`Measure` subclass decorated with :func:`register`, and
one test (docs/architecture.md "Adding a measure").  Nothing lists the measures: the registry imports
every public module of this package the first time a name is looked up, and the command line, the
engine and the results file take the names from it."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Iterable

from repsim.kernels.measures._protocol import (Accumulator, FullColumn, Measure, MeasureInfo,
                                               MinibatchUnsupported, shift_dots)

__all__ = ["Accumulator", "FullColumn", "Measure", "MeasureInfo", "MinibatchUnsupported", "register", "shift_dots",
           "get_measure", "measure_names", "MEASURES"]

MEASURES: dict[str, type[Measure]] = {}


def register(cls: type[Measure]) -> type[Measure]:
    """Class decorator: add a :class:`Measure` subclass to the registry under ``cls.info.name``."""
    MEASURES[cls.info.name] = cls
    return cls


def _import_measure_modules() -> None:
    """Import every module of this package whose name has no leading underscore: each registers the
    measures it defines (on first use, so that importing the registry stays cheap)."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def measure_names() -> list[str]:
    """Every registered measure name, in listing order (``MeasureInfo.order``, then by name: linear
    CKA first)."""
    _import_measure_modules()
    return sorted(MEASURES, key=lambda name: (MEASURES[name].info.order, name))


def measure_class(name: str) -> type[Measure]:
    if name not in MEASURES:
        _import_measure_modules()
        if name not in MEASURES:
            raise ValueError(f"unknown measure {name!r}; known: {', '.join(measure_names())}")
    return MEASURES[name]


def get_measure(name: str, **options: Any) -> Measure:
    """The measure ``name`` with ``options`` (keys it does not know are ignored)."""
    return measure_class(name)(**options)


def parse_measures(names: str | Iterable[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> validated names, each once, in the given order."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = list(dict.fromkeys(s.strip() for s in items if s and s.strip()))
    if not out:
        raise ValueError("no measure named; known: " + ", ".join(measure_names()))
    for name in out:
        measure_class(name)
    return out
