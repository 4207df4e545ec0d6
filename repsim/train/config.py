"""Run configuration: defaults, TOML presets (``repsim/train/presets/*.toml``) and ``--set key=value``.

A preset is a TOML file whose tables mirror :data:`DEFAULTS`; ``inherit = "other-preset"`` loads
another preset first (files whose name starts with ``_`` are bases, not listed as presets). Keys not
in :data:`DEFAULTS` are errors, except under ``objective_params`` and ``arch_params`` (checked when the
network is built). ``--set`` takes dotted keys and TOML literals: ``--set optim.lr=0.2``,
``--set objective_params.tau=0.05``, ``--set arch_params.layers=[1,1,1,1]``, ``--set data.spec=digits``.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import tomllib

PRESET_DIR = Path(__file__).with_name("presets")

DEFAULTS: dict[str, Any] = {
    "preset": "",
    "seed": 0,
    "arch": "resnet50",
    "arch_params": {},            # e.g. width, layers (mini_resnet), depth/widen (wrn)
    "in_channels": 3,
    "objective": "softmax",
    "objective_params": {},       # hyperparameters of repsim.train.objectives.make_objective
    "num_classes": 0,             # 0: taken from the training set
    "epochs": 90,
    "max_steps": 0,               # > 0: stop after this many optimizer steps (fine-tuning, A.3)
    "batch_size": 256,            # global batch over all processes
    "threads": 0,                 # torch intra-op threads (0: torch's default)
    "deterministic": False,       # torch.use_deterministic_algorithms + no cudnn autotuning
    "amp": "auto",                # "auto" (bf16 on CUDA, off on CPU), "bf16", "fp16", "off"
    "channels_last": "auto",      # "auto" (conv nets, and anything on CUDA), true, false
    "compile": False,             # torch.compile the training module
    "sync_bn": False,             # SyncBatchNorm across processes (CUDA only)
    "freeze_bn": False,           # BN layers in eval mode while training (running statistics fixed)
    "eval_every": 1,              # evaluate holdout/test every k epochs (and at the last one)
    "eval_batch_size": 0,         # 0: same as the per-process training batch
    "save_best": True,            # keep best.pt by holdout top-1 (early stopping, App. A.1)
    "stop_epoch": 0,              # > 0: stop after this epoch, schedule unchanged (an early-stopping epoch chosen on the holdout)
    "keep_every": 0,              # > 0: also keep epoch-EEEE.pt every K epochs (training dynamics, Figs. D.2, E.4)
    "variant": "",                # recipe label beyond the objective; "" derives it: autoaugment, mixup (App. C.4)
    "data": {
        "spec": "",               # dataset spec of repsim.train.data.build_dataset (--data overrides)
        "root": "",
        "image_size": 224,
        "eval_resize": 256,
        "augment": "imagenet",    # imagenet | cifar | digits | none | true (dataset default) | shift, flip, shift+flip (Fashion-MNIST)
        "autoaugment": False,     # + torchvision AutoAugment, ImageNet policy (Tables C.5, C.6, E.3)
        "train_split": "train",   # "train+holdout": retrain on both after tuning (App. A.1, A.3)
        "holdout_size": -1,       # -1: dataset default (ImageNet 50,046; torchvision sets 5,000)
        "eval_holdout": True,
        "eval_test": True,
        "workers": 8,
        "download": False,
        "synthetic_n": 512,       # synthetic spec only
        "synthetic_classes": 10,
        "train_per_class": -1,    # Fashion-MNIST specs: training images per class (0: all; -1: default, all)
        "holdout_per_class": -1,  # Fashion-MNIST specs: holdout images per class (-1: default, 500)
        "test_per_class": -1,     # Fashion-MNIST specs: test images per class (0 or -1: all 1,000)
    },
    "optim": {
        "lr": 1.6,                # peak learning rate at batch ref_batch; scaled linearly with batch
        "ref_batch": 4096,
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 8e-5,
        "wd_norm": False,         # also decay normalisation-layer parameters (WRN on CIFAR-100: true)
        "wd_over_lr": False,      # weight_decay is λ with decay coefficient λ/η (ICLR A.1, A.3)
    },
    "schedule": {
        "name": "exponential",    # exponential (A.1: warmup then ×decay per epoch) | cosine (A.3, CIFAR)
        "warmup_epochs": 10.0,
        "decay": 0.975,
    },
    "mixup": {
        "alpha": 0.0,             # > 0: Mixup with λ ~ Beta(α, α) per batch (Table C.5; repsim.train.augment)
    },
    "ema": {
        "enabled": True,
        "decay": 0.9999,
        "warmup": True,           # TF ExponentialMovingAverage num_updates: min(decay, (1+t)/(10+t))
    },
    "finetune": {
        "init_from": "",          # checkpoint whose (EMA) backbone initialises this run (A.3)
        "freeze_backbone": False,
    },
    "tune_grid": {},              # {"dotted.key": [values, ...]}: the grid `repsim tune` searches by default
}

_FREE = ("objective_params", "arch_params", "tune_grid")


class ConfigError(ValueError):
    """A bad preset name, key or value."""


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml") if not p.stem.startswith("_"))


def _read_preset(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.toml"
    if Path(name).suffix == ".toml" and Path(name).is_file():
        path = Path(name)
    if not path.is_file():
        close = [p for p in list_presets() if name.split("-")[0] in p][:5]
        hint = f" (e.g. {', '.join(close)})" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint}; see `repsim train --list-presets`")
    if name in seen:
        raise ConfigError(f"preset inheritance cycle: {' -> '.join(seen + (name,))}")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"preset {path}: {e}") from None
    parent = data.pop("inherit", None)
    if parent:
        base = _read_preset(parent, seen + (name,))
        _merge(base, data, str(path))
        return base
    return data


def _merge(into: dict[str, Any], new: dict[str, Any], where: str, schema: dict[str, Any] | None = None) -> None:
    schema = DEFAULTS if schema is None else schema
    for k, v in new.items():
        if k not in schema:
            raise ConfigError(f"unknown config key {k!r} in {where}; known: {', '.join(sorted(schema))}")
        if isinstance(schema[k], dict) and k not in _FREE and schema is DEFAULTS:
            if not isinstance(v, dict):
                raise ConfigError(f"config key {k!r} in {where} must be a table")
            into.setdefault(k, {})
            _merge(into[k], v, where, schema[k])
        elif k in _FREE and schema is DEFAULTS:
            into.setdefault(k, {}).update(v)
        else:
            into[k] = v


def parse_value(text: str) -> Any:
    """A TOML literal (number, bool, string in quotes, array) or else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_set(cfg: dict[str, Any], assignment: str) -> None:
    """Apply one ``key=value`` override (dotted key) in place; unknown keys raise ConfigError."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    node, schema = cfg, DEFAULTS
    for i, p in enumerate(parts[:-1]):
        if p not in schema or not isinstance(schema[p], dict):
            raise ConfigError(f"unknown config key {key!r}")
        node = node.setdefault(p, {})
        schema = schema[p] if p not in _FREE else {}
        if p in _FREE:
            if i != len(parts) - 2:
                raise ConfigError(f"unknown config key {key!r}")
            node[parts[-1]] = parse_value(text)
            return
    last = parts[-1]
    if last not in schema or isinstance(schema[last], dict) and last not in _FREE:
        raise ConfigError(f"unknown config key {key!r}")
    value = parse_value(text)
    default = schema[last]
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} expects true/false, got {text!r}")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} expects a number, got {text!r}")
        value = float(value) if isinstance(default, float) else value
    node[last] = value


# numeric keys with their smallest allowed value (">" marks a strict bound); integers must be whole
BOUNDS: dict[str, tuple[str, float]] = {
    "batch_size": (">=", 1), "epochs": (">=", 0), "max_steps": (">=", 0), "threads": (">=", 0),
    "eval_every": (">=", 1), "eval_batch_size": (">=", 0), "num_classes": (">=", 0), "in_channels": (">=", 1),
    "data.image_size": (">=", 0), "data.eval_resize": (">=", 0), "data.holdout_size": (">=", -1),
    "data.workers": (">=", 0), "data.synthetic_n": (">=", 1), "data.synthetic_classes": (">=", 1),
    "optim.lr": (">", 0), "optim.ref_batch": (">", 0), "optim.momentum": (">=", 0), "optim.weight_decay": (">=", 0),
    "schedule.warmup_epochs": (">=", 0), "schedule.decay": (">", 0), "ema.decay": (">=", 0),
    "keep_every": (">=", 0), "stop_epoch": (">=", 0), "mixup.alpha": (">=", 0),
}


# keys with a fixed set of values. data.augment: true is the dataset's standard training augmentation,
# imagenet/cifar the App. A.1 / ICLR crops (image datasets), digits the digits shift, shift/flip/shift+flip
# the Fashion-MNIST ones (repsim.train.data); schedule.name: repsim.train.loop.lr_at
CHOICES: dict[str, tuple[Any, ...]] = {
    "schedule.name": ("exponential", "cosine"),
    "data.augment": (True, False, "imagenet", "cifar", "digits", "none", "shift", "flip", "shift+flip"),
}


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Refuse out-of-range values (:data:`BOUNDS`; ``ema.decay`` at most 1) and names outside
    :data:`CHOICES` with a ConfigError naming the key (and the accepted names), before they surface as an obscure error deep inside torch. Returns ``cfg``."""
    for key, (op, low) in BOUNDS.items():
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        default = DEFAULTS
        for part in key.split("."):
            default = default[part]
        whole = isinstance(default, int) and not isinstance(default, bool)
        if isinstance(node, bool) or not isinstance(node, (int, float)) or (whole and node != int(node)):
            raise ConfigError(f"config key {key!r} must be {'an integer' if whole else 'a number'}, got {node!r}")
        if node < low or (op == ">" and node == low):
            raise ConfigError(f"config key {key!r} must be {op} {low:g}, got {node!r}")
    if float(cfg.get("ema", {}).get("decay", 0)) > 1:
        raise ConfigError(f"config key 'ema.decay' must be <= 1, got {cfg['ema']['decay']!r}")
    for key, allowed in CHOICES.items():  # a misspelt name must not train another recipe (or crash late)
        node = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not any(node is a or (type(node) is type(a) and node == a) for a in allowed):
            raise ConfigError(f"config key {key!r} must be one of {', '.join(repr(a) for a in allowed)}, got {node!r}")
    return cfg


def load_config(preset: str | None = None, sets: Iterable[str] = ()) -> dict[str, Any]:
    """DEFAULTS ← preset (with inheritance) ← ``--set`` overrides, then :func:`validate`."""
    cfg = copy.deepcopy(DEFAULTS)
    if preset:
        _merge(cfg, _read_preset(preset), f"preset {preset!r}")
        cfg["preset"] = preset
    for s in sets:
        apply_set(cfg, s)
    return validate(cfg)


A3_LR = (-5.5, -1.0, 8)   # App. A.3: 8 log-spaced learning rates in [10^-5.5, 10^-1]
A3_WD = (-6.5, -3.0, 8)   # App. A.3: 8 log-spaced weight decays in [10^-6.5, 10^-3], plus none


def finetune_grid(lr: tuple[float, float, int] = A3_LR, wd: tuple[float, float, int] = A3_WD,
                  no_decay: bool = True) -> list[dict[str, float]]:
    """The fine-tuning grid of App. A.3, learning rate major: ``lr`` and ``wd`` are (log10 low, log10 high,
    count) of log-spaced values (count 1: the low end); ``no_decay`` adds weight decay 0 first.

    Weight decays are "divided by the learning rate" (A.3; ICLR version Table A.2: λ is the product of the
    learning rate and the decay coefficient added to the loss), so runs set ``optim.wd_over_lr`` and the
    SGD decay coefficient is λ/η: every grid value is the per-step shrink factor η·(λ/η) = λ at the peak
    learning rate, whatever η is. This holds because η is the peak rate used: ``repsim finetune`` sets
    ``optim.ref_batch`` to the batch size, so a grid learning rate is never rescaled by
    batch_size / ref_batch (``repsim.train.loop`` scales the rate, but divides λ by the unscaled one).
    """
    import numpy as np

    def space(lo: float, hi: float, n: int) -> list[float]:
        if n < 1:
            raise ValueError(f"a grid needs at least one value, got count {n}")
        return [float(10 ** lo)] if n == 1 else [float(v) for v in np.logspace(lo, hi, int(n))]

    wds = ([0.0] if no_decay else []) + space(*wd)
    return [{"optim.lr": lr_, "optim.weight_decay": wd_} for lr_ in space(*lr) for wd_ in wds]
