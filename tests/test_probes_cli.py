"""`repsim probe` on real stores in tmp_path."""
from __future__ import annotations

import csv
import json

import numpy as np

from repsim.commands.main import main
from repsim.probes.knn import knn_probe
from repsim.probes.linear import linear_probe
from repsim.store.writer import save_store


def _stores(tmp_path, name, seed):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(3, 6)) * 2
    out = {}
    for split, n in (("train", 90), ("test", 45)):
        y = np.arange(n) % 3
        X = np.maximum(means[y] + rng.normal(size=(n, 6)), 0).astype(np.float32)
        out[split] = save_store(tmp_path / f"{name}_{split}.zarr", {"pool": X}, y,
                                meta={"model": {"objective": name, "seed": seed},
                                      "dataset": {"name": "toy", "split": split, "n": n}})
    return out


def test_cli_writes_csv_and_json(tmp_path):
    a, b = _stores(tmp_path, "softmax", 0), _stores(tmp_path, "sigmoid", 1)
    out = tmp_path / "res"
    rc = main(["probe", "--train", a["train"].path, b["train"].path, "--test", a["test"].path,
               b["test"].path, "--lambdas", "9", "--ks", "1", "5", "--out", str(out), "--no-progress"])
    assert rc == 0
    with open(out / "probes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["probe"] for r in rows] == ["linear", "knn", "linear", "knn"]
    assert rows[0]["objective"] == "softmax" and rows[2]["seed"] == "1" and rows[0]["task"] == "toy"
    Xtr = np.asarray(a["train"].layer("pool").compute())
    Xte = np.asarray(a["test"].layer("pool").compute())
    lin = linear_probe(Xtr, a["train"].labels, Xte, a["test"].labels, lambdas=np.logspace(-6, 5, 9))
    knn = knn_probe(Xtr, a["train"].labels, Xte, a["test"].labels, ks=(1, 5))
    assert float(rows[0]["accuracy"]) == lin.accuracy and float(rows[0]["best_param"]) == lin.best_lambda
    assert float(rows[1]["accuracy"]) == knn.accuracy and float(rows[1]["best_param"]) == knn.best_k
    details = json.loads((out / "probes.json").read_text())
    assert len(details) == 4 and len(details[0]["curve"]) == 9
    # rerunning one network replaces its rows and keeps the other's
    assert main(["probe", a["train"].path, "--test", a["test"].path, "--probe", "knn", "--ks", "1",
                 "--out", str(out)]) == 0
    with open(out / "probes.csv", newline="") as f:
        rows2 = list(csv.DictReader(f))
    assert len(rows2) == 4 and rows2[-1]["best_param"] == "1"


def test_cli_errors(tmp_path, capsys):
    a = _stores(tmp_path, "softmax", 0)
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, a["test"].path]) == 2
    assert "paired" in capsys.readouterr().err
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, "--layer", "nope",
                 "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
