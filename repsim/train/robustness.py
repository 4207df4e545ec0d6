"""Evaluating checkpoints on out-of-distribution test sets (paper App. C.2, Table C.2).

Layouts (each the benchmark's own distribution format):

``imagenet-v2``      ``ROOT/<i>/*.jpeg`` with ``i`` = 0..999 the ImageNet class index (ImageNetV2's
                     folders are class indices, not WordNet ids); all classes scored.
``imagenet-a``,      ``ROOT/<wnid>/*`` for 200 ImageNet classes; the arg max is taken over the logits of
``imagenet-r``       the classes present as folders only (the benchmarks' ``indices_in_1k`` mask,
                     :func:`repsim.probes.robustness.masked_predictions`).
``imagenet-sketch``  ``ROOT/<wnid>/*`` for the 1,000 classes; all classes scored.
``imagenet-c``       ``ROOT/<corruption>/<severity 1-5>/<wnid>/*``; top-1 error per corruption and
                     severity, CE per corruption and mCE normalised by AlexNet's errors
                     (:func:`repsim.probes.robustness.mce`; the 4 extra corruptions are scored but not
                     part of mCE).
any other ``NAME``   ``ROOT/<class name>/*``, scored over all classes (unmasked top-1).

WordNet-id folders are mapped to the network's logit order through its class list: ``--classes``
(a text file with one name per line, or an ImageFolder root whose sorted sub-folders are the classes,
e.g. ImageNet's ``train/``), by default the sorted class folders of the run's own training data
(``repsim.train.data``'s ImageFolder order).

Transforms: the run's evaluation transform (resize to ``eval_resize`` on the short side, centre crop
``image_size``; ImageNet normalisation) for V2/A/R/Sketch; ImageNet-C's images are already
224 × 224 centre crops, so they get only a centre crop to ``image_size`` (the benchmark's own
evaluation code). Images are decoded once per batch and run through every network given.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

BENCHMARKS = ("imagenet-v2", "imagenet-a", "imagenet-r", "imagenet-sketch", "imagenet-c")
MASKED = ("imagenet-a", "imagenet-r")  # scored over the classes present (200 of 1,000)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class RobustnessError(ValueError):
    """A refused evaluation (bad layout, unknown classes, mismatched networks); one line."""


@dataclass
class EvalSet:
    """Images of one benchmark (or one ImageNet-C corruption × severity) with their true classes."""

    benchmark: str
    subset: str                      # "" or "<corruption>/<severity>"
    paths: list[str]
    targets: np.ndarray              # (N,) true classes, in the networks' logit order
    mask: np.ndarray | None          # classes the arg max runs over (None: all)
    crop_only: bool = False          # ImageNet-C: centre crop only


def _subdirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir())


def _images(folder: Path) -> list[str]:
    out = []
    for dirpath, dirnames, files in os.walk(folder, followlinks=True):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
    return out


def class_list(source: str | os.PathLike | None, config: dict[str, Any]) -> list[str] | None:
    """The networks' class names in logit order: ``source`` (a file, one name per line, or an
    ImageFolder root), else the sorted class folders of the run's training data; None when unknown."""
    if source is not None:
        p = Path(source)
        if p.is_file():
            return [line.strip() for line in p.read_text().splitlines() if line.strip()]
        if p.is_dir():
            return _subdirs(p / "train" if (p / "train").is_dir() else p)
        raise RobustnessError(f"robustness: --classes {source!r} is neither a file nor a directory")
    d = config.get("data") or {}
    spec, root = d.get("spec"), d.get("root")
    if not spec:
        return None
    path = Path(root) / spec if root and (Path(root) / spec).is_dir() else Path(spec)
    if not path.is_dir():
        return None
    return _subdirs(path / "train" if (path / "train").is_dir() else path)


def folder_set(root: Path, benchmark: str, num_classes: int, classes: list[str] | None,
               subset: str = "") -> EvalSet:
    """The images of one class-folder tree with their true classes (see the module docstring)."""
    if not root.is_dir():
        raise RobustnessError(f"robustness: {benchmark}: {root} is not a directory")
    folders = _subdirs(root)
    if not folders:
        raise RobustnessError(f"robustness: {benchmark}: {root} has no class folders")
    if benchmark == "imagenet-v2":
        bad = [f for f in folders if not f.isdigit() or int(f) >= num_classes]
        if bad:
            raise RobustnessError(f"robustness: imagenet-v2: folders must be class indices 0..{num_classes - 1} "
                                  f"(ImageNetV2 layout); found {bad[:3]}")
        index = {f: int(f) for f in folders}
    else:
        if classes is None:
            raise RobustnessError(f"robustness: {benchmark}: the networks' class names are unknown; pass --classes "
                                  "(a file with one class name per line, or ImageNet's train/ folder)")
        if len(classes) != num_classes:
            raise RobustnessError(f"robustness: the class list has {len(classes)} names but the networks have "
                                  f"{num_classes} outputs")
        pos = {c: i for i, c in enumerate(classes)}
        unknown = [f for f in folders if f not in pos]
        if unknown:
            raise RobustnessError(f"robustness: {benchmark}: {len(unknown)} folder(s) of {root} are not classes of "
                                  f"the networks (first: {unknown[0]!r})")
        index = {f: pos[f] for f in folders}
    paths, targets = [], []
    for f in folders:
        imgs = _images(root / f)
        paths += imgs
        targets += [index[f]] * len(imgs)
    if not paths:
        raise RobustnessError(f"robustness: {benchmark}: no images under {root}")
    mask = np.array(sorted(index.values()), dtype=np.int64) if benchmark in MASKED else None
    return EvalSet(benchmark, subset, paths, np.asarray(targets, np.int64), mask, crop_only=benchmark == "imagenet-c")


def corruption_sets(root: Path, num_classes: int, classes: list[str] | None) -> list[EvalSet]:
    """ImageNet-C: one :class:`EvalSet` per ``<corruption>/<severity>`` folder, in benchmark order."""
    from repsim.probes.robustness import CORRUPTIONS, EXTRA_CORRUPTIONS, SEVERITIES

    if not root.is_dir():
        raise RobustnessError(f"robustness: imagenet-c: {root} is not a directory")
    known = CORRUPTIONS + EXTRA_CORRUPTIONS
    found = _subdirs(root)
    unknown = [c for c in found if c not in known]
    if unknown:
        raise RobustnessError(f"robustness: imagenet-c: unknown corruption folder(s) {unknown[:3]} in {root} "
                              f"(expected {', '.join(CORRUPTIONS)} and the extras)")
    sets = []
    for c in [c for c in known if c in found]:
        sev = _subdirs(root / c)
        if sev != [str(s) for s in SEVERITIES]:
            raise RobustnessError(f"robustness: imagenet-c: {root / c} must hold severities 1..5, found {sev}")
        sets += [folder_set(root / c / s, "imagenet-c", num_classes, classes, subset=f"{c}/{s}") for s in sev]
    if not sets:
        raise RobustnessError(f"robustness: imagenet-c: no corruption folders in {root}")
    return sets


class _Images(Dataset):
    def __init__(self, paths: Sequence[str], transform):
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            return self.transform(im.convert("RGB"))


def eval_transform(config: dict[str, Any], crop_only: bool):
    """The run's evaluation transform (``repsim.train.imaging``'s rule for image folders), or a centre crop only."""
    from torchvision import transforms as T

    from repsim.train.imaging import IMAGENET_MEAN, IMAGENET_STD, image_transforms

    d = config.get("data") or {}
    size = d.get("image_size") or 224
    if crop_only:
        return T.Compose([T.CenterCrop(size), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    resize = d.get("eval_resize") or round(size * 256 / 224)
    return image_transforms(False, size, resize)[0]


@torch.no_grad()
def predict(models: Sequence[torch.nn.Module], es: EvalSet, config: dict[str, Any], *, device: torch.device,
            batch_size: int = 128, workers: int = 0) -> np.ndarray:
    """(M, N) top-1 predictions of every model on ``es`` (the arg max over ``es.mask`` when set);
    each batch is decoded once and run through all models."""
    from repsim.probes.robustness import masked_predictions

    loader = DataLoader(_Images(es.paths, eval_transform(config, es.crop_only)), batch_size=batch_size,
                        num_workers=workers, pin_memory=device.type == "cuda")
    out = np.empty((len(models), len(es.paths)), dtype=np.int64)
    start = 0
    for x in loader:
        x = x.to(device, non_blocking=True)
        for m, net in enumerate(models):
            z = net(x).float().cpu().numpy()
            out[m, start:start + len(x)] = masked_predictions(z, es.mask)
        start += len(x)
    return out


# ------------------------------------------------------------------------------- results
def _read_csv(path: Path) -> list[dict]:
    import csv

    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def summary_rows(rows: list[dict]) -> list[dict]:
    """ImageNet-C summaries from the per-severity ``error`` rows of one network: ``ce`` per corruption
    with all 5 severities (fraction, ``repsim.probes.robustness.corruption_errors``) and ``mce`` (%) over
    the benchmark's corruptions present (the benchmark's mCE when all 15 are)."""
    from repsim.probes.robustness import CORRUPTIONS, SEVERITIES, corruption_errors, mce

    errs: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["benchmark"] == "imagenet-c" and r["metric"] == "error":
            c, s = r["subset"].split("/")
            errs.setdefault(c, {})[int(s)] = float(r["value"])
    full = {c: [e[s] for s in SEVERITIES] for c, e in errs.items() if c in CORRUPTIONS and set(e) == set(SEVERITIES)}
    if not full:
        return []
    from repsim.results import COLUMNS

    cols = COLUMNS["robustness"]
    base = {k: rows[0][k] for k in cols[:cols.index("benchmark")]}  # the network's columns
    out = [{**base, "benchmark": "imagenet-c", "subset": c, "metric": "ce", "value": v, "n": "", "classes": "",
            "masked": False} for c, v in corruption_errors(full).items()]
    subset = "all 15 corruptions" if len(full) == len(CORRUPTIONS) else \
        f"{len(full)} of {len(CORRUPTIONS)} corruptions: " + ", ".join(c for c in CORRUPTIONS if c in full)
    out.append({**base, "benchmark": "imagenet-c", "subset": subset, "metric": "mce", "value": mce(full), "n": "",
                "classes": "", "masked": False})
    return out


def evaluate(checkpoints: Sequence[str | os.PathLike], sets: dict[str, str | os.PathLike], out: str | os.PathLike, *,
             names: Sequence[str] | None = None, classes: str | os.PathLike | None = None,
             device: str | None = None, batch_size: int = 128, workers: int = 0, overwrite: bool = False,
             log=print) -> list[dict]:
    """Evaluate every checkpoint on every set ``{benchmark: root}``; merge the rows into the CSV ``out``.

    Rows (robustness.csv, docs/architecture.md "Results files"): store (run name), objective, seed,
    checkpoint_sha256, checkpoint, benchmark, subset (``<corruption>/<severity>`` for ImageNet-C), metric
    (``top1`` fraction; ImageNet-C ``error`` per subset, ``ce`` per corruption, ``mce`` in %), value,
    n, classes (classes the arg max ran over), masked, transform. The CSV is rewritten after every set;
    a rerun skips the (network, set) pairs already in it for the same checkpoint digest (resume).
    """
    from repsim.fileio import sha256_file
    from repsim.results import KEYS
    from repsim.train.checkpoint import load_checkpoint, load_model

    bad = [b for b in sets if not b.replace("-", "").replace("_", "").isalnum()]
    if bad:
        raise RobustnessError(f"robustness: set names must be letters, digits, - and _: {bad}")
    checkpoints = [str(c) for c in checkpoints]
    names = list(names) if names is not None else [Path(c).resolve().parent.name for c in checkpoints]
    if len(set(names)) != len(names):
        raise RobustnessError(f"robustness: two checkpoints share a run name ({names}); use --name '{{parent}}-{{stem}}'")
    configs, metas = [], []
    for c in checkpoints:
        ck = load_checkpoint(c)
        cfg = dict(ck["config"])
        configs.append(cfg)
        metas.append({"objective": cfg.get("objective", ""), "seed": cfg.get("seed", ""),
                      "checkpoint_sha256": sha256_file(c), "checkpoint": str(Path(c).resolve())})
    K = {int(cfg["num_classes"]) for cfg in configs}
    sizes = {((cfg.get("data") or {}).get("image_size"), (cfg.get("data") or {}).get("eval_resize")) for cfg in configs}
    if len(K) != 1 or len(sizes) != 1:
        raise RobustnessError("robustness: the checkpoints differ in classes or image size; evaluate them separately")
    num_classes, config = K.pop(), configs[0]
    class_names = class_list(classes, config)
    plan: list[EvalSet] = []
    for bench, root in sets.items():
        root = Path(root)
        plan += corruption_sets(root, num_classes, class_names) if bench == "imagenet-c" else \
            [folder_set(root, bench, num_classes, class_names)]
    out = Path(out)
    old = [] if overwrite else _read_csv(out)
    done = {tuple(r[k] for k in KEYS["robustness"]) for r in old}
    dev = (torch.device(device) if device not in (None, "auto")
           else torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    models: dict[int, torch.nn.Module] = {}
    rows = [r for r in old if r.get("metric") in ("top1", "error")]
    for es in plan:
        metric = "error" if es.benchmark == "imagenet-c" else "top1"
        todo = [i for i, (n, m) in enumerate(zip(names, metas))
                if (n, m["checkpoint_sha256"], es.benchmark, es.subset, metric) not in done]
        label = es.benchmark + (f" {es.subset}" if es.subset else "")
        if not todo:
            log(f"robustness: {label}: already in {out}")
            continue
        for i in todo:
            if i not in models:
                models[i] = load_model(checkpoints[i]).to(dev).eval()
        pred = predict([models[i] for i in todo], es, config, device=dev, batch_size=batch_size, workers=workers)
        tf = "centre crop" if es.crop_only else "run's eval transform"
        for j, i in enumerate(todo):
            top1 = float(np.mean(pred[j] == es.targets))
            key = (names[i], metas[i]["checkpoint_sha256"], es.benchmark, es.subset, metric)
            rows = [r for r in rows if tuple(r[k] for k in KEYS["robustness"]) != key]
            rows.append({"store": names[i], **metas[i], "benchmark": es.benchmark, "subset": es.subset,
                         "metric": metric, "value": top1 if metric == "top1" else 1.0 - top1, "n": len(es.paths),
                         "classes": num_classes if es.mask is None else len(es.mask), "masked": es.mask is not None,
                         "transform": tf})
            log(f"robustness: {names[i]} {label}: top-1 {100 * top1:.2f}% of {len(es.paths)}"
                + (f" (arg max over {len(es.mask)} classes)" if es.mask is not None else ""))
        _write(rows, out, merge=not overwrite)
        overwrite = False  # (the file is this run's now: later writes merge with it)
    return _write(rows, out, merge=not overwrite)


def _write(rows: list[dict], out: Path, *, merge: bool = True) -> list[dict]:
    """Per-set rows plus the ImageNet-C summaries of every network, written atomically (columns:
    ``repsim.results.COLUMNS["robustness"]``). ``merge``: under the results file's lock
    (``repsim.results.results_lock``, as every CSV-writing command), the file's per-set rows
    as they are now are kept unless ``rows`` has their key, so runs of other networks sharing the file
    (a job array) lose no row; the summaries are recomputed from the merged rows."""
    from repsim.results import KEYS, conform, results_lock, write_csv

    key = lambda r: tuple(str(r[k]) for k in KEYS["robustness"])
    with results_lock(str(out)):
        if merge:
            ours = {key(r) for r in rows}
            rows = [r for r in _read_csv(out) if r.get("metric") in ("top1", "error") and key(r) not in ours] + rows
        by_net: dict[tuple, list[dict]] = {}
        for r in rows:
            by_net.setdefault((r["store"], r["checkpoint_sha256"]), []).append(r)
        full = [r for net in by_net.values() for r in net + summary_rows(net)]
        write_csv(conform("robustness", full), out)
    return full
