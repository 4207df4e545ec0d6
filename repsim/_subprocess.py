"""The environment of the ``python -m <package>`` subprocesses repsim starts (the demo's
``analyses.command_runs`` and ``analyses.pixel_baseline``, ``repsim tune``'s ``repsim train`` and its
torchrun workers).

``python -m`` puts the current directory first on ``sys.path``, so a researcher's own ``train.py`` (or
an ``extract``/``analyses`` file or folder) there would be imported instead of the package installed
beside repsim, and the run would fail far from the cause. ``PYTHONSAFEPATH=1`` (Python 3.11) keeps the
current directory off the path, in torchrun's workers too (they inherit the environment). The folder
holding repsim goes first on ``PYTHONPATH`` when it is a checkout run without installing; an installed
repsim is found in site-packages as usual. The current directory is not put back anywhere: every
``PYTHONPATH`` entry comes before site-packages, so it would shadow an installed repsim again. These
subprocesses run repsim's own presets and stages, which need nothing from the current directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def module_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) for a ``python -m`` subprocess of repsim's packages (module doc):
    ``PYTHONSAFEPATH=1``; repsim's folder first on ``PYTHONPATH`` unless it is a site-packages folder;
    ``PYTHONPATH`` entries that name the current directory (``.``, or it spelled out) dropped."""
    import site

    out = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    cwd = os.path.realpath(os.getcwd())
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    parts = [] if os.path.realpath(root) in installed else [root]  # (site-packages ahead of the stdlib: never)
    parts += [os.path.abspath(p) for p in out.get("PYTHONPATH", "").split(os.pathsep)
              if p and os.path.realpath(p) != cwd]
    if parts:
        out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    else:
        out.pop("PYTHONPATH", None)
    out["PYTHONSAFEPATH"] = "1"
    return out
