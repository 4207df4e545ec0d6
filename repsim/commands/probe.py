"""`repsim probe`: linear and kNN transfer probes on stored features (paper Table 1, App. A.2).

    repsim probe --train A_train.zarr B_train.zarr --test A_test.zarr B_test.zarr \
        [--layer pool] [--probe linear knn] [--metric top1|mean_per_class] [--task NAME] --out DIR

Train and test stores are paired in order (one pair per network; positional STOREs are more training
stores, before those of --train). Writes ``DIR/probes.csv`` (columns: store, objective, seed, task,
probe, metric, accuracy, best_param; rows for the same (store, task, probe, metric) are replaced, others
kept) and ``DIR/probes.json`` (the same rows plus the validation / leave-one-out curves and solver info).
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from repsim._io import atomic_write

HELP = "linear and kNN transfer probes on stored features"
COLUMNS = ["store", "objective", "seed", "task", "probe", "metric", "accuracy", "best_param"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stores", nargs="*", metavar="STORE", help="training-split stores (as --train)")
    parser.add_argument("--train", nargs="+", default=[], metavar="STORE",
                        help="training-split stores, one per network")
    parser.add_argument("--test", nargs="+", required=True, metavar="STORE",
                        help="test-split stores, paired in order with the training stores")
    parser.add_argument("--layer", default="pool", help="layer to probe (default: pool)")
    parser.add_argument("--probe", nargs="+", choices=["linear", "knn"], default=["linear", "knn"])
    parser.add_argument("--metric", choices=["top1", "mean_per_class"], default="top1")
    parser.add_argument("--task", default=None,
                        help="task name in the output (default: the test store's dataset name)")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--lambdas", type=int, default=45,
                        help="number of log-spaced λ in [1e-6, 1e5] (default 45, App. A.2)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5, 10, 20, 50, 100])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=".", help="results directory (default: current)")
    parser.add_argument("--no-progress", action="store_true")


def _meta(store) -> tuple[str, str]:
    model = store.model or {}
    obj = model.get("objective", "")
    seed = model.get("seed", "")
    return ("" if obj is None else str(obj)), ("" if seed is None else str(seed))


def run(args) -> int:
    import numpy as np

    from repsim.probes.knn import knn_probe
    from repsim.probes.linear import linear_probe
    from repsim.store.reader import open_store

    train = list(args.stores) + list(args.train)
    if not train:
        raise ValueError("give training stores (positional or --train)")
    if len(train) != len(args.test):
        raise ValueError(f"{len(train)} training stores but {len(args.test)} test stores; they are paired in order")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, details = [], []
    lambdas = np.logspace(-6, 5, args.lambdas)
    for tr_path, te_path in zip(train, args.test):
        tr, te = open_store(tr_path), open_store(te_path)
        Xtr, Xte = _features(tr, args.layer), _features(te, args.layer)
        task = args.task or (te.dataset or {}).get("name") or te.name
        objective, seed = _meta(tr)
        for kind in args.probe:
            if kind == "linear":
                r = linear_probe(Xtr, tr.labels, Xte, te.labels, lambdas=lambdas,
                                 val_fraction=args.val_fraction, metric=args.metric, seed=args.seed,
                                 progress=not args.no_progress)
            else:
                r = knn_probe(Xtr, tr.labels, Xte, te.labels, ks=args.ks, metric=args.metric)
            row = {"store": tr.name, "objective": objective, "seed": seed, "task": task,
                   "probe": kind, "metric": args.metric, "accuracy": r.accuracy,
                   "best_param": r.best_param}
            rows.append(row)
            details.append({**row, "layer": args.layer, "train_store": tr.path, "test_store": te.path,
                            **{k: v for k, v in r.to_dict().items() if k in ("curve", "info")}})
            print(f"{tr.name} {task} {kind}: {args.metric} {r.accuracy:.4f} "
                  f"({'λ' if kind == 'linear' else 'k'}={r.best_param:g})", flush=True)
    _write_csv(out / "probes.csv", rows)
    jpath = out / "probes.json"
    old = json.loads(jpath.read_text()) if jpath.exists() else []
    keys = {_key(d) for d in details}
    with atomic_write(jpath, "w") as fh:
        fh.write(json.dumps([d for d in old if _key(d) not in keys] + details, indent=1))
    return 0


def _features(store, layer: str):
    """Layer ``layer`` of ``store`` in memory; NaN/Inf refused naming the store (no probe fits them)."""
    import numpy as np

    X = np.asarray(store.layer(layer).compute())
    bad = int(np.count_nonzero(~np.isfinite(X)))
    if bad:
        raise ValueError(f"store {store.name}: layer {layer!r} holds {bad} NaN/Inf value(s); a probe cannot be fit "
                         f"on them (`repsim check {store.path}` counts them per layer)")
    return X


def _key(row: dict) -> tuple:
    return (str(row["store"]), str(row["task"]), str(row["probe"]), str(row["metric"]))


def _write_csv(path: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into the CSV at ``path``, replacing rows with the same key."""
    old = []
    if path.exists():
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    keys = {_key(r) for r in rows}
    merged = [r for r in old if _key(r) not in keys] + rows
    with atomic_write(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in merged:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
