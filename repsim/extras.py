"""The optional parts of repsim: which pip extra provides which module, and the one-line message a
command prints when one is missing.

``pip install repsim`` is the analysis core (NumPy, SciPy, Zarr, Dask, scikit-learn, matplotlib, ...);
training and extraction need ``repsim-toolkit[torch]``, the model sources ``timm:`` and ``hf:`` need
``repsim-toolkit[timm]`` / ``repsim-toolkit[hf]``, ``--device cuda`` needs ``repsim-toolkit[gpu]`` and ``xarray`` views need
``repsim-toolkit[xarray]`` (``pyproject.toml`` lists them). This module imports none of them.
"""
from __future__ import annotations

import importlib.util

# top-level module -> the extra that installs it
EXTRAS: dict[str, str] = {
    "torch": "torch",
    "torchvision": "torch",
    "PIL": "torch",
    "train": "torch",  # repsim's own torch packages: repsim/train/ and repsim/extract/ need the [torch] extra
    "extract": "torch",
    "timm": "timm",
    "transformers": "hf",
    "tokenizers": "hf",
    "huggingface_hub": "hf",
    "safetensors": "hf",
    "cupy": "gpu",
    "cupyx": "gpu",
    "cupy_backends": "gpu",  # (shipped by the cupy-cuda12x/13x wheels beside cupy)
    "nvidia": "gpu",  # nvidia.nvcomp: GPU zstd decoding of the stores' chunks (engine/device_decode.py)
    "dask_cuda": "gpu",
    "xarray": "xarray",
}


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that provides it."""


def extra_for(module: str | None) -> str | None:
    """The extra that provides ``module`` (any dotted name; its top-level package decides), or None."""
    return EXTRAS.get((module or "").split(".")[0])


def missing_message(module: str, what: str) -> str:
    """``"<what> needs <module>, which is not installed: pip install 'repsim-toolkit[<extra>]'"``."""
    top = module.split(".")[0]
    extra = extra_for(top)
    hint = f"pip install 'repsim-toolkit[{extra}]'" if extra else f"pip install {top}"
    return f"{what} needs {top}, which is not installed: {hint}"


def explain(exc: ImportError) -> str | None:
    """The one-line message for ``exc`` when it is a missing optional dependency (``this command needs
    torch, which is not installed: pip install 'repsim-toolkit[torch]'``), else None (a missing module that no
    extra provides is a broken install, reported as it is)."""
    if isinstance(exc, MissingExtra):
        return str(exc)
    name = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or extra_for(name) is None:
        return None
    return missing_message(name, "this command")


def require(module: str, what: str) -> None:
    """Raise :class:`MissingExtra` (naming the extra) unless ``module`` can be imported; imports nothing."""
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module blocked in sys.modules
        found = False
    if not found:
        raise MissingExtra(missing_message(module, what), name=module.split(".")[0])
