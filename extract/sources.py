"""Where a model and a dataset come from, and their provenance for the store's attrs.

A model is a ``train`` checkpoint path (rebuilt with ``train.load_model``, EMA weights, eval mode),
``torchvision:<name>[:<weights>]`` (e.g. ``torchvision:resnet50``, random init unless weights are
named, e.g. ``torchvision:resnet50:DEFAULT``), or an ``nn.Module`` passed from Python. A dataset is
a ``train.data.build_dataset`` spec plus split (always built with ``augment=False``: deterministic
evaluation transforms, fixed order) or a ``torch.utils.data.Dataset`` passed from Python.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

TORCHVISION_PREFIX = "torchvision:"


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def weights_sha256(model: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, raw bytes): the identity of an in-memory
    model, so that a resumed store never mixes two models' rows."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{t.numel()}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_meta(model: nn.Module) -> dict[str, Any]:
    """Provenance of a model: arch, objective, params, seed (from a ``train`` Network)."""
    config = dict(getattr(model, "config", None) or {})
    return _clean({
        "arch": getattr(model, "arch", None) or config.get("arch") or type(model).__name__,
        "objective": getattr(model, "objective", None) or config.get("objective"),
        "params": config.get("objective_params"),
        "seed": config.get("seed"),
    })


def load_model(source: str | os.PathLike | nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, attrs["model"]) for a checkpoint path, a torchvision spec or a module."""
    if isinstance(source, nn.Module):
        return source.eval(), {**model_meta(source), "weights_sha256": weights_sha256(source)}
    spec = str(source)
    if spec.startswith(TORCHVISION_PREFIX):
        import torchvision

        name, _, weights = spec[len(TORCHVISION_PREFIX):].partition(":")
        try:
            model = torchvision.models.get_model(name, weights=weights or None)
        except ValueError as exc:
            raise ValueError(f"extract: unknown torchvision model {spec!r}: {exc}") from None
        meta = {"arch": name, "params": {"weights": weights or None}, "weights_sha256": weights_sha256(model)}
        return model.eval(), _clean(meta)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"extract: checkpoint {spec!r} does not exist")
    from train.checkpoint import load_checkpoint, network_from_checkpoint

    ckpt = load_checkpoint(path)  # read once: the weights and the metadata below
    model = network_from_checkpoint(ckpt, path)
    meta = model_meta(model)
    config = dict(ckpt.get("config") or {})
    meta.setdefault("arch", config.get("arch"))
    meta.setdefault("objective", config.get("objective"))
    if "params" not in meta and config.get("objective_params") is not None:
        meta["params"] = config["objective_params"]
    if "seed" not in meta and config.get("seed") is not None:
        meta["seed"] = config["seed"]
    meta.update(_clean({
        "checkpoint": str(path.resolve()),
        "checkpoint_sha256": sha256_file(path),
        "epoch": ckpt.get("epoch") if isinstance(ckpt, dict) else None,
        "preset": config.get("preset"),
        "train_dataset": config.get("dataset"),
    }))
    return model.eval(), _clean(meta)


_DATASETS: dict[str, Any] = {}  # the last few datasets built, so a batch of checkpoints shares one


def load_dataset(source, split: str | None, root: str | None = None, model: nn.Module | None = None):
    """(dataset, attrs["dataset"] without n) for a spec (or None) + split, or a Dataset object.

    A spec is built with ``augment=False`` (deterministic evaluation transform, fixed order). When
    ``model`` carries its run config (``train`` Network), the dataset is built the way the run built
    its evaluation sets (``train.data.dataset_from_config``: image size, resize, holdout, root), and
    ``source=None`` means the run's own dataset.
    """
    if source is None or isinstance(source, (str, os.PathLike)):
        if not split:
            raise ValueError("extract: --split is required with a dataset name or path")
        config = dict(getattr(model, "config", None) or {})
        if config.get("data"):
            config["data"] = {**config["data"], **({"root": str(root)} if root else {})}
            key = json.dumps(["config", source and str(source), split, config["data"], config.get("in_channels")],
                             sort_keys=True, default=str)
        elif source is None:
            raise ValueError("extract: --data is required (the model carries no run config naming its dataset)")
        else:
            key = json.dumps(["spec", str(source), split, root and str(root)])
        dataset = _DATASETS.get(key)
        if dataset is None:
            if config.get("data"):
                from train.data import dataset_from_config

                dataset = dataset_from_config(config, split, spec=str(source) if source else None)
            else:
                from train.data import build_dataset

                dataset = build_dataset(str(source), split, augment=False, root=root)
            while len(_DATASETS) >= 2:
                _DATASETS.pop(next(iter(_DATASETS)))
            _DATASETS[key] = dataset
    else:
        dataset = source
    transform = getattr(dataset, "transform_desc", None)
    if transform is None and getattr(dataset, "transform", None) is not None:
        transform = repr(dataset.transform)
    return dataset, _clean({
        "name": getattr(dataset, "name", None) or (str(source) if source is not None else type(dataset).__name__),
        "split": split or getattr(dataset, "split", None),
        "transform": transform,
        "num_classes": getattr(dataset, "num_classes", None),
    })


def example_ids(dataset, n: int) -> np.ndarray:
    """Stable example ids: ``dataset.example_ids`` when it has them, else row numbers 0..n-1."""
    ids = getattr(dataset, "example_ids", None)
    if ids is None:
        return np.arange(n, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.shape != (n,):
        raise ValueError(f"extract: dataset.example_ids has shape {ids.shape}, expected ({n},)")
    return ids


def head_weights(model: nn.Module, logits_module: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(W (K, M), b (K,)) float32 of the final layer, or None if it has no ``weight``."""
    head = dict(model.named_modules())[logits_module]
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        return None
    b = getattr(head, "bias", None)
    W = w.detach().float().cpu().numpy()
    bias = np.zeros(W.shape[0], np.float32) if b is None else b.detach().float().cpu().numpy()
    return W, bias
