"""The environment of the ``python -m <package>`` subprocesses repsim starts (the demo's
``analyses.command_runs``, ``repsim tune``'s ``repsim train`` and torchrun workers).

``python -m`` puts the current directory first on ``sys.path``, so a researcher's own ``train.py`` (or
an ``extract``/``analyses`` file or folder) there would be imported instead of the package installed
beside repsim, and the run would fail far from the cause. ``PYTHONSAFEPATH=1`` (Python 3.11) keeps the
current directory off the front of the path, in torchrun's workers too (they inherit the environment);
the folder holding repsim goes first on ``PYTHONPATH`` when it is not on the path by itself (a checkout
run without installing), and the current directory last, so that modules of the researcher's own (a
``module:`` model) still import.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) for a ``python -m`` subprocess of repsim's packages (module doc)."""
    import site

    out = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    cwd = os.path.realpath(os.getcwd())
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    parts = [] if os.path.realpath(root) in installed else [root]  # (site-packages ahead of the stdlib: never)
    parts += [os.path.abspath(p) for p in out.get("PYTHONPATH", "").split(os.pathsep)
              if p and os.path.realpath(p) != cwd]  # (a "." there is the current directory: last, below)
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*parts, cwd]))
    out["PYTHONSAFEPATH"] = "1"
    return out
