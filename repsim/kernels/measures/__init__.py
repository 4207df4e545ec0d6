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
                                               MinibatchUnsupported, NoNull, shift_dots, source_eps)

__all__ = ["Accumulator", "FullColumn", "Measure", "MeasureInfo", "MinibatchUnsupported", "NoNull", "register",
           "shift_dots",
           "source_eps",
           "get_measure", "measure_label", "check_options", "measure_names", "MEASURES"]

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


def measure_label(name: str) -> str:
    """The display name of measure ``name`` (``MeasureInfo.label``: "linear CKA", "ridge R²"), or ``name``
    itself when no registered measure has it (a result file written by another version)."""
    try:
        return measure_class(name).info.label
    except ValueError:
        return name


def get_measure(name: str, **options: Any) -> Measure:
    """The measure ``name`` with ``options`` (keys it does not know are ignored: the engine hands one
    dict to every measure of a call, checked once by :func:`check_options`)."""
    return measure_class(name)(**options)


# passed by the engine to every measure of a call, used by those that take them
SHARED_OPTIONS = ("debiased", "compute_dtype")


def check_options(names: Iterable[str], options: dict[str, Any]) -> None:
    """Refuse (``ValueError``) an option that no measure takes: a misspelt or another library's name
    (``k``, ``topk``, ``threshold``, ``unbiased``) would otherwise leave the default in force without a
    word. Any registered measure's option is accepted (one dict may serve several measures, as the
    command line's does), and :data:`SHARED_OPTIONS`; the error lists those of ``names``."""
    names = list(names)
    known = {k: v for name in names for k, v in measure_class(name).OPTIONS.items()}
    allowed = {k for name in measure_names() for k in MEASURES[name].OPTIONS} | set(SHARED_OPTIONS)
    unknown = [k for k in options if k not in allowed]
    if unknown:
        which = ", ".join(f"{k} (default {v!r})" for k, v in known.items()) or "none"
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for {', '.join(names)}; "
                         f"the options: {which}")


def parse_measures(names: str | Iterable[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> validated names, each once, in the given order."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = list(dict.fromkeys(s.strip() for s in items if s and s.strip()))
    if not out:
        raise ValueError("no measure named; known: " + ", ".join(measure_names()))
    for name in out:
        measure_class(name)
    return out
