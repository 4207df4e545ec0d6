"""Where a model and a dataset come from, and their provenance for the store's attrs.

A model is a ``train`` checkpoint path (rebuilt with ``train.load_model``, EMA weights, eval mode),
a ``prefix:...`` source of repsim/extract/models (``torchvision:``, ``timm:``, ``hf:``, ``module:``), or an
``nn.Module`` passed from Python. A dataset is a ``repsim.train.data.build_dataset`` spec plus split (always
built with ``augment=False``: deterministic evaluation transforms, fixed order), a text file or CSV
for a text model (repsim/extract/text.py), a ``.npy``/``.npz`` array of images (repsim/extract/memory.py), or a
``torch.utils.data.Dataset`` passed from Python.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from repsim.fileio import sha256_file

from .models import LoadedModel, from_module, is_model_spec, load_spec
from .models.common import clean as _clean
from .models.common import weights_sha256

__all__ = ["weights_sha256", "model_meta", "load_model", "load_source", "load_dataset",
           "example_ids", "head_weights", "sample_fingerprint"]


def _run_config(model: nn.Module) -> dict[str, Any]:
    """A ``train`` Network's run config (a dict), or {} (a Hugging Face config object is not one)."""
    config = getattr(model, "config", None)
    return dict(config) if isinstance(config, dict) else {}


def objective_params(objective: str | None, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The hyperparameters an objective trained with: its Table A.1 defaults overridden by the run's
    ``objective_params`` (:func:`repsim.study.objectives.with_defaults`) — so that a store records τ of a
    cosine-softmax network trained with the default too (Table 4 is then rebuilt from the stores
    alone).  An objective this code does not know (an older or foreign checkpoint) keeps what was given."""
    from repsim.study.objectives import BY_NAME, with_defaults

    if not objective or not all(p.strip() in BY_NAME for p in str(objective).split("+")):
        return given
    return with_defaults(str(objective), given)


def model_meta(model: nn.Module) -> dict[str, Any]:
    """Provenance of a model: arch, objective, params (defaults included), seed (from a ``train`` Network)."""
    config = _run_config(model)
    objective = getattr(model, "objective", None) or config.get("objective")
    return _clean({
        "arch": getattr(model, "arch", None) or config.get("arch") or type(model).__name__,
        "objective": objective,
        "params": objective_params(objective, config.get("objective_params")) if config else None,
        "seed": config.get("seed"),
    })


def load_model(source: str | os.PathLike | nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, attrs["model"]) for a checkpoint path, a model source spec or a module."""
    loaded = load_source(source)
    return loaded.model, loaded.meta


def load_source(source: str | os.PathLike | nn.Module, *, digest: Any = None, seed: int = 0) -> LoadedModel:
    """The model with its provenance and input requirements (repsim/extract/models) for any model source.
    ``digest``: a module's ``weights_sha256`` when the caller computes it (e.g. on a thread of its
    own, as extraction does: 70 ms for ResNet-50, beside the rest of its start).  ``seed``: of the random
    weights of a model source named without weights (repsim/extract/models)."""
    if isinstance(source, nn.Module):
        return from_module(source, {**model_meta(source),
                                    "weights_sha256": weights_sha256(source) if digest is None else digest})
    spec = str(source)
    if is_model_spec(spec):
        return load_spec(spec, seed=seed)
    path = Path(spec)
    if path.is_dir():
        inside = [n for n in ("best.pt", "checkpoint.pt") if (path / n).is_file()]
        hint = f": pass {path / inside[0]}" if inside else ""
        raise ValueError(f"extract: checkpoint {spec!r} is a directory, not a checkpoint file{hint} (a training run "
                         "holds best.pt, the best-holdout epoch's weights, and checkpoint.pt, the last epoch's)")
    if not path.is_file():
        raise ValueError(f"extract: checkpoint {spec!r} does not exist (model sources: a checkpoint path, "
                         "torchvision:<name>, timm:<name>, hf:<id or dir>, module:<module>:<factory>)")
    from repsim.train.checkpoint import load_checkpoint, network_from_checkpoint

    # the file's sha256 on a thread of its own, beside the unpickling and the build (hashlib lets go
    # of the GIL: a ResNet-50 checkpoint with its EMA and optimizer state is ~300 MB to hash)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-checkpoint-hash") as hashing:
        file_digest = hashing.submit(sha256_file, path)
        ckpt = load_checkpoint(path, mmap=True)  # opened once for the weights and the metadata below; only
        # the tensors the network adopts are ever read (not the optimizer state or the other weight set)
        model = network_from_checkpoint(ckpt, path)
    meta = model_meta(model)
    config = dict(ckpt.get("config") or {})
    meta.setdefault("arch", config.get("arch"))
    meta.setdefault("objective", config.get("objective"))
    if "params" not in meta and (config.get("objective_params") is not None or meta.get("objective")):
        meta["params"] = objective_params(meta.get("objective"), config.get("objective_params"))
    if "seed" not in meta and config.get("seed") is not None:
        meta["seed"] = config["seed"]
    meta.update(_clean({
        "checkpoint": str(path.resolve()),
        "checkpoint_sha256": file_digest.result(),
        "epoch": ckpt.get("epoch") if isinstance(ckpt, dict) else None,
        "preset": config.get("preset"),
        "train_dataset": config.get("dataset"),
        "variant": config.get("variant") or None,  # training recipe beyond the objective (App. C.4)
        "finetuned_from": (config.get("finetune") or {}).get("source"),  # App. A.3 / D.4: the source network
    }))
    return from_module(model, meta)


_DATASETS: dict[str, Any] = {}  # the last few datasets built, so a batch of checkpoints shares one
_DATASETS_LOCK = threading.Lock()  # extraction jobs run as threads (extract/cli.py): one build per key


def load_dataset(source, split: str | None, root: str | None = None, model: nn.Module | None = None,
                 tokenizer: Any = None, max_length: int | None = None):
    """(dataset, attrs["dataset"] without n) for a spec (or None) + split, or a Dataset object.

    A spec is built with ``augment=False`` (deterministic evaluation transform, fixed order). When
    ``model`` carries its run config (``train`` Network), the dataset is built the way the run built
    its evaluation sets (``repsim.train.data.dataset_from_config``: image size, resize, holdout, root), and
    ``source=None`` means the run's own dataset. A ``.txt``/``.csv``/``.tsv`` file is a text dataset
    tokenised with ``tokenizer`` (repsim/extract/text.py; ``max_length`` tokens, default 128). A ``.npy``
    (images) or ``.npz`` (``images``, ``labels``) file is loaded into memory as an
    ``repsim.extract.memory.ImageTensor`` (uint8 or float, NCHW or NHWC).
    """
    from .memory import load_array
    from .text import DEFAULT_MAX_LENGTH, TextDataset, is_text_spec

    if isinstance(source, (str, os.PathLike)) and str(source).endswith((".npy", ".npz")):
        source = load_array(str(source))  # in-memory images (repsim/extract/memory.py): no DataLoader workers
    if is_text_spec(source):
        if tokenizer is None:
            raise ValueError(f"extract: {source} is a text dataset; it needs a text model with a tokenizer "
                             "(hf:<model id or dir>)")
        source = TextDataset(source, tokenizer, max_length or DEFAULT_MAX_LENGTH)
    elif tokenizer is not None and (source is None or isinstance(source, (str, os.PathLike))):
        raise ValueError(f"extract: the model is a text model; --data must be a .txt, .csv or .tsv file, got {source!r}")
    if source is None or isinstance(source, (str, os.PathLike)):
        if not split:
            raise ValueError("extract: --split is required with a dataset name or path")
        config = _run_config(model) if model is not None else {}
        if config.get("data"):
            config["data"] = {**config["data"], **({"root": str(root)} if root else {})}
            key = json.dumps(["config", source and str(source), split, config["data"], config.get("in_channels")],
                             sort_keys=True, default=str)
        elif source is None:
            raise ValueError("extract: --data is required (the model carries no run config naming its dataset)")
        else:
            key = json.dumps(["spec", str(source), split, root and str(root)])
        with _DATASETS_LOCK:
            dataset = _DATASETS.get(key)
            if dataset is None:
                if config.get("data"):
                    from repsim.train.data import dataset_from_config

                    dataset = dataset_from_config(config, split, spec=str(source) if source else None)
                else:
                    from repsim.train.data import build_dataset

                    dataset = build_dataset(str(source), split, augment=False, root=root)
                while len(_DATASETS) >= 2:
                    _DATASETS.pop(next(iter(_DATASETS)))
                _DATASETS[key] = dataset
    else:
        dataset = source
    fingerprint = getattr(dataset, "fingerprint", None)
    if fingerprint is None and not isinstance(source, (str, os.PathLike)) and getattr(dataset, "name", None) is None:
        fingerprint = sample_fingerprint(dataset)  # a Python Dataset that names itself nowhere
    transform = getattr(dataset, "transform_desc", None)
    if transform is None and getattr(dataset, "transform", None) is not None:
        transform = repr(dataset.transform)
    return dataset, _clean({
        # a Python Dataset without a name: its class name (its repr names a memory address, which no
        # rerun, resume or other process shares)
        "name": getattr(dataset, "name", None) or (str(source) if isinstance(source, (str, os.PathLike))
                                                   else type(dataset).__name__),
        "fingerprint": None if fingerprint is None else str(fingerprint),
        "split": split or getattr(dataset, "split", None),
        "transform": transform,
        "num_classes": getattr(dataset, "num_classes", None),
        # class names: a multi-label dataset's K label columns (e.g. CheXpert's findings), or the label
        # numbering of a text CSV with named labels
        "classes": (list(dataset.classes) if (getattr(dataset, "multilabel", False) or isinstance(dataset, TextDataset))
                    and dataset.classes else None),
    })


def sample_fingerprint(dataset) -> str | None:
    """A digest of a Dataset's length and of examples 0, n // 2 and n - 1 (their tensors' bytes and
    labels): cheap, and enough to tell a rerun on other data from a resume of the same; None when an
    example holds something other than tensors, numbers or dicts of tensors."""
    import hashlib

    try:
        n = len(dataset)
    except TypeError:
        return None
    h = hashlib.sha256(f"n={n}".encode())

    def feed(v) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{tuple(v.shape)}{v.dtype}".encode())
            h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, (tuple, list)):
            for item in v:
                feed(item)
        elif isinstance(v, (int, float, bool, str, np.integer, np.floating, np.ndarray)):
            h.update(repr(np.asarray(v).tolist()).encode())
        else:
            raise TypeError(type(v).__name__)

    try:
        for i in sorted({0, n // 2, n - 1}) if n else ():
            feed(dataset[i])
    except (TypeError, IndexError, KeyError, ValueError, RuntimeError):
        return None
    return f"sample sha256 {h.hexdigest()[:32]} (examples 0, n/2, n-1)"


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
