"""The demo's analysis stage: results files (CONTRACTS.md formats) from the demo's stores, through the
torch-free ``repsim`` engine drivers and `repsim probe`, in the demo's process."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from analyses.pipeline import Demo


def _api(module: str, name: str, owner: str):
    """``repsim.<module>.<name>``, or a DemoError naming the helper whose piece has not landed."""
    import importlib

    from analyses.pipeline import DemoError

    try:
        return getattr(importlib.import_module(f"repsim.{module}"), name)
    except (ImportError, AttributeError) as exc:
        raise DemoError(f"analyse: repsim.{module}.{name} is not available — {owner} has not landed "
                        f"({type(exc).__name__}: {exc})") from exc


def _paths(demo: "Demo", group: str) -> list[str]:
    return [str(demo.store_path(group, n)) for n in demo.run_names]


def training_csv(demo: "Demo", path: Path) -> None:
    """training.csv from each run's metrics.csv, up to the epoch of the extracted checkpoint.

    The extracted checkpoint is best.pt (best holdout top-1, first maximum, App. A.1 early stopping)
    when the run saved one, else the last epoch; curves stop there, as in Figs. C.1–C.3.
    """
    rows = []
    for name in demo.run_names:
        d = demo.run_dir(name)
        with (d / "metrics.csv").open() as f:
            metrics = list(csv.DictReader(f))
        objective, seed = name.rsplit("-s", 1)
        last = len(metrics)
        if demo.checkpoint(name).name == "best.pt" and metrics and metrics[0].get("holdout_top1", "") != "":
            hold = [float(m["holdout_top1"]) if m.get("holdout_top1") else -1.0 for m in metrics]
            last = int(np.argmax(hold)) + 1
        for m in metrics[:last]:
            for split in ("train", "holdout", "test"):
                top1 = m.get(f"{split}_top1", "")
                if top1 != "":
                    rows.append(dict(store=name, objective=objective, seed=int(seed), epoch=int(m["epoch"]),
                                     split=split, top1=float(top1), top5=m.get(f"{split}_top5", "")))
    _api("drivers", "write_csv", "engine (issue 4)")(rows, path)


def cka(demo: "Demo", path: Path) -> None:
    """CKA across every (network, layer) of the source test split: minibatch CKA (paper §3.2) with one
    batch holding every example and one epoch — on 225 examples, the unbiased-HSIC CKA of the whole
    split. (The engine's method="exact" gives the same numbers, to 2e-8, in ~1.5x the time here.)"""
    from repsim import open_store

    cka_matrix = _api("engine", "cka_matrix", "engine (issue 4)")
    paths = _paths(demo, "src-test")
    first = open_store(paths[0])
    layers = [l for l in first.layers if l != "logits"]
    result = cka_matrix(paths, layers=layers, batch_size=first.n, epochs=1, shuffle=False, debiased=True,
                        progress=False)
    result.save(str(path))


def layer_metrics(demo: "Demo", res: Path) -> None:
    """separation.csv (every layer on the source test split, cosine; the penultimate layer under all
    three distances on the test and training splits), sparsity.csv (every layer, test split),
    collapse.csv and spectra.npz (penultimate layer, training split), by the engine's streaming drivers."""
    from repsim import open_store

    drivers = {n: _api("drivers", n, "engine (issue 4)")
               for n in ("separation_rows", "sparsity_rows", "collapse_rows", "write_csv", "DISTANCES")}
    test, train = _paths(demo, "src-test"), _paths(demo, "src-train")
    blocks = [l for l in open_store(test[0]).layers if l != "logits"]
    kw = dict(progress=False, threads=1)
    sep = drivers["separation_rows"](test, blocks, distances=("cosine",), **kw)
    sep += [r for r in drivers["separation_rows"](test, ["pool"], distances=drivers["DISTANCES"], **kw)
            if r["distance"] != "cosine"]
    sep += drivers["separation_rows"](train, ["pool"], distances=drivers["DISTANCES"], **kw)
    drivers["write_csv"](sep, res / "separation.csv")
    drivers["write_csv"](drivers["sparsity_rows"](test, blocks, **kw), res / "sparsity.csv")
    rows, spectra = drivers["collapse_rows"](train, ["pool"], spectra=True, **kw)
    drivers["write_csv"](rows, res / "collapse.csv")
    tmp = res / "spectra.tmp.npz"
    np.savez(tmp, **spectra)
    tmp.replace(res / "spectra.npz")


def probes(demo: "Demo", path: Path) -> None:
    """probes.csv via `repsim probe` (run in this process): linear and kNN transfer to digits 5–9 (fit on
    its train split, score on its test split), and relearning the source classes (linear; fit on the
    source holdout split, never trained on, score on the source test split) from penultimate features."""
    from analyses.pipeline import RELEARN_TASK, TRANSFER_TASK, DemoError
    from repsim.cli import main

    if path.exists():
        path.unlink()  # `repsim probe` merges into an existing file; start from the current run set only
    for task, fit, ev, kinds in ((TRANSFER_TASK, "tgt-train", "tgt-test", ["linear", "knn"]),
                                 (RELEARN_TASK, "src-holdout", "src-test", ["linear"])):
        rc = main(["probe", "--train", *_paths(demo, fit), "--test", *_paths(demo, ev), "--layer", "pool",
                   "--probe", *kinds, "--task", task, "--out", str(path.parent), "--no-progress"])
        if rc != 0:
            raise DemoError(f"analyse: `repsim probe` failed for task {task} (exit {rc})")
