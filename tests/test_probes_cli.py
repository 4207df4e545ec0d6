"""`repsim probe` on real stores in tmp_path."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

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


def _source_store(tmp_path, objective, seed, *, head_only=False):
    """A network's features of its own classes' evaluation set, with logits (or only its head)."""
    rng = np.random.default_rng(seed)
    y = np.arange(120) % 4
    X = (rng.normal(size=(4, 8))[y] * 1.5 + rng.normal(size=(120, 8))).astype(np.float32)
    W, b = rng.normal(size=(4, 8)), rng.normal(size=4)
    kw = dict(head=(W, b)) if head_only else dict(logits=X @ W.T + b, head=(W, b))
    return save_store(tmp_path / f"{objective}-s{seed}.zarr", {"pool": X}, y, chunk_rows=50,
                      meta={"model": {"objective": objective, "seed": seed},
                            "dataset": {"name": "source", "split": "test"}}, **kw)


def test_cli_relearn_paper_protocol(tmp_path, capsys):
    from repsim.probes.transfer import heldout_per_class, relearn_head

    s = _source_store(tmp_path, "softmax", 0)
    h = _source_store(tmp_path, "sigmoid", 1, head_only=True)
    out = tmp_path / "res"
    assert main(["probe", "--relearn", s.path, h.path, "--per-class", "5", "--lambdas", "5", "--out", str(out),
                 "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out / "probes.csv", newline="")))
    assert [(r["task"], r["probe"]) for r in rows] == [("relearn", "linear"), ("relearn", "original_head")] * 2
    X, y = np.asarray(s.layer("pool").compute()), s.labels
    Z = np.asarray(s.logits.compute())
    ref = relearn_head(X, y, logits=Z, per_class=5, lambdas=np.logspace(-6, 5, 5))
    test = heldout_per_class(y, 5, 0)                      # 5 held-out examples of each of the 4 classes
    assert test.size == 20 and np.array_equal(test, ref.test_index)
    assert float(rows[0]["accuracy"]) == ref.relearned_accuracy and float(rows[0]["best_param"]) == ref.best_lambda
    assert float(rows[1]["accuracy"]) == np.mean(Z[test].argmax(1) == y[test])   # same held-out examples
    assert rows[0]["n"] == rows[1]["n"] == "20" and rows[0]["train_n"] == "100" and rows[1]["best_param"] == ""
    W, b = h.head                                          # no logits: the stored head scores them
    Xh, yh = np.asarray(h.layer("pool").compute()), h.labels
    assert float(rows[3]["accuracy"]) == np.mean((Xh[test] @ W.T.astype(np.float64) + b).argmax(1) == yh[test])
    capsys.readouterr()
    assert main(["probe", "--relearn", s.path, "--test", s.path, "--out", str(out)]) == 2
    assert "no --test" in capsys.readouterr().err
    assert main(["probe", "--relearn", s.path, "--task", "imagenet", "--out", str(out)]) == 2
    assert "must start with 'relearn' or 'source'" in capsys.readouterr().err


def test_fig6_uses_the_held_out_original_head(tmp_path):
    from repsim.analyses.cli import make_figures
    from repsim.results import write_csv

    res = tmp_path / "res"
    stores = [_source_store(tmp_path, o, s) for o in ("softmax", "sigmoid", "cosine_softmax") for s in (0, 1)]
    assert main(["probe", "--relearn", *(s.path for s in stores), "--per-class", "5", "--lambdas", "5",
                 "--out", str(res), "--no-progress"]) == 0
    write_csv([dict(store=s.name, objective=s.model["objective"], seed=s.model["seed"], layer="pool",
                    distance="cosine", r2=0.1 * i) for i, s in enumerate(stores)], res / "separation.csv")
    outcomes, _ = make_figures(tmp_path, res, tmp_path / "fig", only=["fig6"], progress=False)
    assert outcomes[0].status == "done", outcomes[0].note
    assert "on the held-out examples of probes.csv (20 per network" in outcomes[0].caption
    assert (tmp_path / "fig" / "fig6.png").is_file() and (tmp_path / "fig" / "fig6.pdf").is_file()


def test_out_names_the_csv_like_every_other_analysis_command(tmp_path, capsys):
    """`--out probes.csv` writes that file (details beside it as probes.json), not a folder of that
    name, and says where with the same `-> path` line as the other commands."""
    a = _stores(tmp_path, "softmax", 0)
    out = tmp_path / "results" / "my_probes.csv"
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, "--lambdas", "5", "--ks", "1",
                 "--out", str(out), "--no-progress"]) == 0
    assert out.is_file() and not out.is_dir() and out.with_suffix(".json").is_file()
    assert f"repsim probe: 2 rows -> {out}" in capsys.readouterr().err
    with open(out, newline="") as f:
        assert [r["probe"] for r in csv.DictReader(f)] == ["linear", "knn"]


def test_the_command_and_the_library_call_write_the_same_files(tmp_path):
    """`repsim probe` is a thin layer over ``write_probes``: the same stores give byte-identical files
    whichever is called (the demo calls the function: no argv lists)."""
    from repsim.probes.writers import write_probes

    a = _stores(tmp_path, "softmax", 0)
    src = _source_store(tmp_path, "softmax", 0)
    cli, lib = tmp_path / "cli", tmp_path / "lib"
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, "--probe", "linear", "knn",
                 "--task", "toy", "--lambdas", "9", "--out", str(cli), "--no-progress"]) == 0
    assert main(["probe", "--relearn", src.path, "--task", "relearn", "--lambdas", "9", "--out", str(cli),
                 "--no-progress"]) == 0
    rows, ml_rows = write_probes([a["train"].path], [a["test"].path], probe=["linear", "knn"], task="toy",
                                 lambdas=9, out=lib, progress=False)
    write_probes([src.path], relearn=True, task="relearn", lambdas=9, out=lib, progress=False)
    assert len(rows) == 2 and ml_rows == []
    assert (lib / "probes.csv").read_bytes() == (cli / "probes.csv").read_bytes()

    def untimed(path):  # the solver info records wall-clock seconds
        return [{**d, "info": {k: v for k, v in d.get("info", {}).items() if not k.startswith("seconds")}}
                for d in json.loads(path.read_text())]

    assert untimed(lib / "probes.json") == untimed(cli / "probes.json")
    import pytest

    with pytest.raises(TypeError, match="unknown option"):
        write_probes([a["train"].path], [a["test"].path], probes=["linear"], out=lib)


def test_the_demo_calls_the_library_not_the_cli():
    """repsim/analyses/demo_analysis.py drove `repsim probe` / `repsim calibrate` with argv lists through
    ``repsim.commands.main``, then imported the writers from the command modules; it calls the library
    functions those commands call (``repsim.probes.writers``), and nothing of repsim/commands/ (the CLI)."""
    import ast
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "repsim" / "analyses" / "demo_analysis.py"
    tree = ast.parse(path.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in modules if m.startswith("repsim.commands")]
    assert "repsim.probes.writers" in modules


def test_relearn_refuses_a_store_of_other_classes_than_the_head(tmp_path, capsys):
    """`probe --relearn` on a digits-target store of a digits-source network scored the original head on
    another label space (0.28, exit 0): refused as `repsim accuracy` refuses it, unless --allow-other-classes."""
    import pytest

    from repsim.probes.writers import write_probes

    src = _source_store(tmp_path, "softmax", 0)
    train = {"name": "dig-source", "spec": "dig-source", "classes": ["a", "b", "c", "d"]}
    tgt = save_store(tmp_path / "tgt.zarr", {"pool": np.asarray(src.layer("pool").compute())}, src.labels,
                     logits=np.asarray(src.logits.compute()), head=src.head, chunk_rows=50,
                     meta={"model": {"objective": "softmax", "seed": 0, "train_dataset": train},
                           "dataset": {"name": "dig-target", "split": "test", "num_classes": 4}})
    out = tmp_path / "res"
    assert main(["probe", "--relearn", tgt.path, "--per-class", "5", "--lambdas", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (out / "probes.csv").exists()
    assert ("store tgt: it holds dataset 'dig-target' but its network was trained on 'dig-source', another class "
            "subset of 'dig'") in err and "--allow-other-classes" in err
    assert main(["probe", "--relearn", tgt.path, "--per-class", "5", "--lambdas", "3", "--allow-other-classes",
                 "--out", str(out), "--no-progress"]) == 0
    assert "WARNING: store tgt:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="another class subset of 'dig'"):
        write_probes([tgt.path], relearn=True, per_class=5, lambdas=3, out=out, progress=False)


def test_probe_refuses_unlabelled_examples(tmp_path, capsys):
    """Labels -1 (unlabelled) were a class to the probe: an all-unlabelled test store scored top-1 0.0,
    exit 0. They are refused in the training store, the test store and a --relearn store."""
    a = _stores(tmp_path, "softmax", 0)
    X = np.asarray(a["test"].layer("pool").compute())
    y = np.asarray(a["train"].labels).copy()
    y[::10] = -1
    meta = {"model": {"objective": "softmax", "seed": 0}}
    unl = save_store(tmp_path / "unl_test.zarr", {"pool": X}, np.full(len(X), -1), meta={
        **meta, "dataset": {"name": "toy", "split": "test"}}, example_ids=np.arange(len(X)))
    part = save_store(tmp_path / "part_train.zarr", {"pool": np.asarray(a["train"].layer("pool").compute())}, y,
                      meta={**meta, "dataset": {"name": "toy", "split": "train"}})
    out = tmp_path / "res"
    assert main(["probe", "--train", a["train"].path, "--test", unl.path, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("error: test store unl_test: labels must lie in [0, K) (class indices), but 45 of its 45 labels are "
            "negative") in err and err.count("\n") == 1 and not (out / "probes.csv").exists()
    assert main(["probe", "--train", part.path, "--test", a["test"].path, "--out", str(out), "--no-progress"]) == 2
    assert "error: train store part_train: labels must lie in [0, K) (class indices), but 9 of its 90" in \
        capsys.readouterr().err
    logits = np.zeros((90, 3), np.float32)
    rel = save_store(tmp_path / "rel.zarr", {"pool": part.layer("pool").compute()}, y, logits=logits,
                     meta={**meta, "dataset": {"name": "toy", "split": "test"}})
    assert main(["probe", "--relearn", rel.path, "--per-class", "5", "--out", str(out), "--no-progress"]) == 2
    assert "error: store rel: labels must lie in [0, K) (class indices), but 9 of its 90" in capsys.readouterr().err


def test_per_class_must_be_positive(tmp_path, capsys):
    """--per-class 0 held out nothing and wrote NaN rows over the store's valid ones, exit 0."""
    import pytest

    from repsim.probes.writers import write_probes

    s = _source_store(tmp_path, "softmax", 0)
    out = tmp_path / "res"
    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as exc:
            main(["probe", "--relearn", s.path, "--per-class", value, "--out", str(out)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"error: argument --per-class: must be >= 1, got {value}" in err
    with pytest.raises(ValueError, match="per_class must be >= 1, got 0"):
        write_probes([s.path], relearn=True, per_class=0, out=out)
    assert not (out / "probes.csv").exists()


def test_probe_warns_when_the_test_store_holds_classes_the_train_store_lacks(tmp_path, capsys):
    """A class with no training example is never predicted: its test examples all count as errors. The
    probe still runs (a subsample may lack a rare class) but says so on one line; none when every test
    class was seen."""
    a = _stores(tmp_path, "softmax", 0)
    rng = np.random.default_rng(5)
    y = np.arange(60) % 2  # classes 0 and 1 only
    sub = save_store(tmp_path / "two_train.zarr", {"pool": rng.normal(size=(60, 6)).astype(np.float32)}, y,
                     meta={"model": {"objective": "softmax", "seed": 0}, "dataset": {"name": "toy", "split": "train"}})
    out = tmp_path / "res"
    assert main(["probe", "--train", sub.path, "--test", a["test"].path, "--probe", "knn", "--out", str(out),
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("WARNING: test store softmax_test: 15 of its 45 examples are of 1 class(es) that train store two_train "
            "has no example of (2)") in err
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, "--probe", "knn", "--out", str(out),
                 "--no-progress"]) == 0
    assert "WARNING" not in capsys.readouterr().err


PROBE_VALUES = [
    (["--probe", "linear"], {}), (["--probe", "knn"], {}), (["--probe", "linear", "knn"], {}),
    (["--metric", "top1"], {"metric": "top1"}), (["--metric", "mean_per_class"], {"metric": "mean_per_class"}),
    (["--ks", "1", "3"], {"ks": (1, 3)}), (["--lambdas", "5"], {"lambdas": np.logspace(-6, 5, 5)}),
    (["--val-fraction", "0.4"], {"val_fraction": 0.4}), (["--seed", "2"], {"seed": 2}),
    (["--layer", "pool"], {}), (["--task", "named"], {}),
    (["--memory-budget", "0"], {}), (["--memory-budget", "1GiB"], {}),
]


@pytest.mark.parametrize("flags, kw", PROBE_VALUES, ids=[" ".join(f) for f, _ in PROBE_VALUES])
def test_every_probe_option_value_reaches_the_probe(tmp_path, flags, kw):
    """Each valid value once: the rows are the linear / kNN probe functions' results called with that value
    on the stores' arrays (--memory-budget 0: the out-of-core route, the same numbers to the solver's
    tolerance), and the recorded metadata says so."""
    a = _stores(tmp_path, "softmax", 0)
    out = tmp_path / "p.csv"
    probes = flags[1:] if flags[0] == "--probe" else ["linear", "knn"]
    argv = flags if flags[0] == "--probe" else ["--probe", "linear", "knn", *flags]
    if "--lambdas" not in flags:
        argv += ["--lambdas", "9"]
        kw = {"lambdas": np.logspace(-6, 5, 9), **kw}
    assert main(["probe", "--train", a["train"].path, "--test", a["test"].path, *argv, "--out", str(out),
                 "--no-progress"]) == 0
    with open(out, newline="") as f:
        rows = {r["probe"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == sorted(probes)
    Xtr, Xte = (np.asarray(a[s].layer("pool").compute()) for s in ("train", "test"))
    ytr, yte = a["train"].labels, a["test"].labels
    metric = kw.get("metric", "top1")
    tol = dict(rel=1e-6) if "0" in flags and "--memory-budget" in flags else dict(rel=0, abs=0)
    if "linear" in rows:
        lin = linear_probe(Xtr, ytr, Xte, yte, lambdas=kw["lambdas"], val_fraction=kw.get("val_fraction", 0.2),
                           metric=metric, seed=kw.get("seed", 0))
        assert float(rows["linear"]["accuracy"]) == pytest.approx(lin.accuracy, **tol)
        assert float(rows["linear"]["best_param"]) == pytest.approx(lin.best_lambda, rel=1e-6)
        assert int(rows["linear"]["n_lambdas"]) == len(kw["lambdas"])
    if "knn" in rows:
        knn = knn_probe(Xtr, ytr, Xte, yte, ks=kw.get("ks", (1, 3, 5, 10, 20, 50, 100)), metric=metric)
        assert float(rows["knn"]["accuracy"]) == pytest.approx(knn.accuracy, **tol)
        assert int(float(rows["knn"]["best_param"])) == knn.best_k
    for row in rows.values():
        assert row["metric"] == metric and row["task"] == ("named" if "--task" in flags else "toy")
    if "linear" in rows:  # (kNN chooses k by leave-one-out on the training store: no validation split)
        assert float(rows["linear"]["val_fraction"]) == kw.get("val_fraction", 0.2)
