"""Similarity measures between representations: one protocol (:mod:`._protocol`), one module per
measure, and a registry by name (the names of ``repsim similarity --measures``).

Adding a measure: a module here with a :class:`Measure` subclass decorated with :func:`register`,
its name in :data:`_MODULES`, and one test (docs/architecture.md "Adding a measure")."""
from __future__ import annotations

import importlib
from typing import Any, Iterable

from repsim.kernels.measures._protocol import (Accumulator, FullColumn, Measure, MeasureInfo,
                                               MinibatchUnsupported)

__all__ = ["Accumulator", "FullColumn", "Measure", "MeasureInfo", "MinibatchUnsupported", "register",
           "get_measure", "measure_names", "MEASURES"]

MEASURES: dict[str, type[Measure]] = {}

# measure name -> module defining it (imported on first use, so the registry stays cheap)
_MODULES: dict[str, str] = {
    "linear_cka": "linear_cka",
    "rbf_cka": "rbf_cka",
    "procrustes": "procrustes",
    "cca": "cca",
    "svcca": "cca",
    "pwcca": "cca",
    "rsa": "rsa",
    "mutual_knn": "mutual_knn",
    "ridge_r2": "ridge",
}


def register(cls: type[Measure]) -> type[Measure]:
    """Class decorator: add a :class:`Measure` subclass to the registry under ``cls.info.name``."""
    MEASURES[cls.info.name] = cls
    return cls


def measure_names() -> list[str]:
    """Every registered measure name, in the documented order."""
    return list(_MODULES)


def measure_class(name: str) -> type[Measure]:
    if name not in MEASURES:
        if name not in _MODULES:
            raise ValueError(f"unknown measure {name!r}; known: {', '.join(_MODULES)}")
        importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return MEASURES[name]


def get_measure(name: str, **options: Any) -> Measure:
    """The measure ``name`` with ``options`` (keys it does not know are ignored)."""
    return measure_class(name)(**options)


def parse_measures(names: str | Iterable[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> validated names, each once, in the given order."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = list(dict.fromkeys(s.strip() for s in items if s and s.strip()))
    if not out:
        raise ValueError("no measure named; known: " + ", ".join(_MODULES))
    for name in out:
        measure_class(name)
    return out
