"""The environment of the ``python -m repsim.<stage>`` subprocesses repsim starts (the demo's
``repsim.analyses.command_runs`` and ``repsim.analyses.pixel_baseline``, ``repsim tune``'s ``repsim train``
and its torchrun workers).

Every stage lives under the one import root ``repsim`` (``repsim.train``, ``repsim.extract``,
``repsim.analyses``), so a researcher's own ``train.py`` or ``extract.py`` in the current directory can no
longer stand in for one of them. What is left to arrange: a checkout run without installing must be
importable by the subprocess, so the folder holding ``repsim/`` goes first on ``PYTHONPATH`` unless it is
a site-packages folder (an installed repsim is found there as usual).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) for a ``python -m`` subprocess of repsim's packages (module doc):
    the folder holding ``repsim/`` first on ``PYTHONPATH`` unless it is a site-packages folder."""
    import site

    out = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    parts = [] if os.path.realpath(root) in installed else [root]  # (site-packages ahead of the stdlib: never)
    parts += [os.path.abspath(p) for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parts:
        out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    else:
        out.pop("PYTHONPATH", None)
    return out
