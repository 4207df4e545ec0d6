"""Lazy public names for a package: ``import pkg`` stays cheap (no torch, no dask) until a name is used."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """Module ``__getattr__`` for ``package``, whose public ``name`` lives in submodule
    ``exports[name]``; a resolved name is cached in the package ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
