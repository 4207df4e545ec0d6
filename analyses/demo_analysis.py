"""The demo's analysis stage: results files (CONTRACTS.md formats) from the demo's stores, via the
torch-free ``repsim`` API. One store is in memory at a time (digits stores are a few MB)."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from analyses.pipeline import Demo

DISTANCES = ("cosine", "cosine_centered", "sqeuclidean")


def _api(name: str):
    """A public repsim name, or a DemoError naming the helper whose piece has not landed."""
    import repsim
    from analyses.pipeline import DemoError

    owner = {"cka_matrix": "engine (issue 4)", "linear_probe": "probes (issue 7)", "knn_probe": "probes (issue 7)",
             "class_separation": "kernels (issue 3)", "nonzero_fraction": "kernels (issue 3)",
             "collapse_metrics": "kernels (issue 3)", "open_store": "store (issue 2)",
             "activation_spectrum": "kernels (issue 3)", "weight_spectrum": "kernels (issue 3)",
             "centroid_spectrum": "kernels (issue 3)"}
    try:
        return getattr(repsim, name)
    except (ImportError, AttributeError) as exc:
        raise DemoError(f"analyse: repsim.{name} is not available — {owner.get(name, 'an upstream piece')} "
                        f"has not landed ({type(exc).__name__}: {exc})") from exc


def _id(store) -> dict:
    model = store.attrs.get("model") or {}
    return {"store": store.name, "objective": model.get("objective", ""), "seed": model.get("seed", "")}


def _features(store, layer: str) -> np.ndarray:
    return np.asarray(store.layer(layer).compute(), dtype=np.float32).reshape(store.n, -1)


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


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
    _write_csv(path, rows)


def cka(demo: "Demo", path: Path) -> None:
    """CKA across every (network, layer) of the source test split: minibatch CKA (paper §3.2) with one
    batch holding every example and one epoch — on 225 examples, the unbiased-HSIC CKA of the whole
    split. (The engine's method="exact" gives the same numbers but took ~20x longer here.)"""
    stores = demo.stores("src-test")
    layers = [l for l in stores[0].layers if l != "logits"]
    result = _api("cka_matrix")([s.path for s in stores], layers=layers, batch_size=stores[0].n, epochs=1,
                                shuffle=False, debiased=True, progress=False)
    result.save(str(path))


def layer_metrics(demo: "Demo", res: Path) -> None:
    """separation.csv (every layer on the source test split; the penultimate layer also on the training
    split, all three distances), sparsity.csv (every layer, test split), collapse.csv (penultimate layer)."""
    class_separation, nonzero = _api("class_separation"), _api("nonzero_fraction")
    collapse_metrics = _api("collapse_metrics")
    sep, spa, col = [], [], []
    for group in ("src-test", "src-train"):
        for store in demo.stores(group):
            ident, y = _id(store), np.asarray(store.labels)
            for layer in [l for l in store.layers if l != "logits"]:
                X = _features(store, layer)
                for d in DISTANCES if layer == "pool" else ("cosine",):
                    sep.append({**ident, "layer": layer, "distance": d, "r2": class_separation(X, y, distance=d)})
                if group == "src-test":
                    spa.append({**ident, "layer": layer, "nonzero_fraction": nonzero(X)})
                if layer == "pool":
                    W = store.head[0] if store.head is not None else None
                    col.append({**ident, "layer": layer, **collapse_metrics(X.astype(np.float64), y, W=W)})
    _write_csv(res / "separation.csv", sep)
    _write_csv(res / "sparsity.csv", spa)
    _write_csv(res / "collapse.csv", col)


def probes(demo: "Demo", path: Path) -> None:
    """probes.csv: linear and kNN transfer to digits 5–9 (fit on its train split, score on its test
    split) and relearning the source classes (linear; fit on the source holdout split, never trained
    on, score on the source test split) from each network's penultimate features."""
    from analyses.pipeline import RELEARN_TASK, TRANSFER_TASK

    linear_probe, knn_probe = _api("linear_probe"), _api("knn_probe")
    rows = []
    pairs = {TRANSFER_TASK: ("tgt-train", "tgt-test"), RELEARN_TASK: ("src-holdout", "src-test")}
    for task, (fit_group, eval_group) in pairs.items():
        for fit, ev in zip(demo.stores(fit_group), demo.stores(eval_group)):
            Xtr, ytr = _features(fit, "pool"), np.asarray(fit.labels)
            Xte, yte = _features(ev, "pool"), np.asarray(ev.labels)
            ident = _id(fit) | {"store": ev.name}
            r = linear_probe(Xtr, ytr, Xte, yte)
            rows.append({**ident, "task": task, "probe": "linear", "metric": "top1", "accuracy": r.accuracy,
                         "best_param": r.best_lambda})
            if task == TRANSFER_TASK:
                r = knn_probe(Xtr, ytr, Xte, yte)
                rows.append({**ident, "task": task, "probe": "knn", "metric": "top1", "accuracy": r.accuracy,
                             "best_param": r.best_k})
    _write_csv(path, rows)


def spectra(demo: "Demo", path: Path) -> None:
    """spectra.npz (App. Fig. E.2): singular values of the centred penultimate activations (training
    split), of the final-layer weights, and of the class centroids minus their mean."""
    activation_spectrum, weight_spectrum = _api("activation_spectrum"), _api("weight_spectrum")
    centroid_spectrum = _api("centroid_spectrum")
    out = {}
    for store in demo.stores("src-train"):
        X, y = _features(store, "pool"), np.asarray(store.labels)
        out[f"{store.name}/pool/activations"] = activation_spectrum(X)
        if store.head is not None:
            out[f"{store.name}/pool/weights"] = weight_spectrum(np.asarray(store.head[0], np.float64))
        out[f"{store.name}/pool/centroids"] = centroid_spectrum(X, y)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **out)
    tmp.replace(path)
