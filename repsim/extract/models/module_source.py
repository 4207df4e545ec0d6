"""``module:<package.module>:<factory>[:<state dict path>]``: any ``nn.Module`` a user builds.

``factory`` is called without arguments (seeded, so random weights are the same on every run) and
must return an ``nn.Module``; the optional state dict (a ``torch.save``d mapping of tensors, or a
dict holding one under ``state_dict``/``model``, or a ``.safetensors`` file) is loaded strictly. The module is imported from the
installed packages or the current directory. Its layers follow the generic registry
(repsim/extract/layers.py); a model can declare them itself (``extract_layers``), and ``output_fmt =
"NHWC"`` (timm's convention) marks channels-last maps.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from repsim.fileio import sha256_file

from .common import LoadedModel, clean, infer_input, seeded, weights_sha256

PREFIX = "module:"


def load(spec: str, *, seed: int = 0) -> LoadedModel:
    import torch
    from torch import nn

    parts = spec[len(PREFIX):].split(":", 2)
    if len(parts) < 2 or not all(parts[:2]):
        raise ValueError(f"extract: {spec!r}: expected module:<package.module>:<factory>[:<state dict path>]")
    module_name, factory_name = parts[0], parts[1]
    state_path = parts[2] if len(parts) == 3 and parts[2] else None
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ValueError(f"extract: {spec!r}: cannot import {module_name!r} ({exc})") from None
        raise
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"extract: {spec!r}: {module_name} has no callable {factory_name!r}")
    with seeded(seed):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"extract: {spec!r}: {factory_name}() returned {type(model).__name__}, not an nn.Module")
    meta = {"arch": getattr(model, "arch", None) or type(model).__name__, "source": "module",
            "factory": f"{module_name}:{factory_name}"}
    if state_path is not None:
        path = Path(state_path)
        if not path.is_file():
            raise ValueError(f"extract: {spec!r}: state dict {state_path!r} does not exist")
        if path.suffix == ".safetensors":  # (timm's and the hub's format)
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
            state = state.get("state_dict") or state.get("model") or state
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()
            raise ValueError(f"extract: {spec!r}: the state dict does not fit the model: {' '.join(first[:3])[:400]}") from None
        meta.update(checkpoint=str(path.resolve()), checkpoint_sha256=sha256_file(path), init="state dict")
    else:
        meta["init"] = f"factory(seed={seed})"
        meta["seed"] = seed
    meta["weights_sha256"] = weights_sha256(model)
    return LoadedModel(model.eval(), clean(meta), **infer_input(model))
