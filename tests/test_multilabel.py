"""Multi-label transfer (Table D.1): stores with (N, K) bool labels, the CheXpert-layout CSV loader,
extraction of multi-label stores, `repsim probe` on them (AUC against scikit-learn) and the item."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import zarr
from sklearn.metrics import roc_auc_score

from helpers_eval import tiny_checkpoint, write_image
from repsim.commands.main import main
from repsim.probes.multilabel import multilabel_probe
from repsim.store.format import StoreError
from repsim.store.reader import open_store
from repsim.store.writer import save_store

FINDINGS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Pleural Effusion"]


def _ml_store(path, X, Y, *, objective="softmax", seed=0, split="train", classes=("a", "b", "c")):
    return save_store(path, {"pool": X}, Y, chunk_rows=32,
                      meta={"model": {"objective": objective, "seed": seed},
                            "dataset": {"name": "toyxray", "split": split, "classes": list(classes)}})


# --------------------------------------------------------------------------------------- store
def test_multilabel_store_roundtrip_and_check(tmp_path, capsys):
    rng = np.random.default_rng(0)
    Y = rng.random((70, 3)) < 0.3
    s = _ml_store(tmp_path / "a.zarr", rng.normal(size=(70, 4)).astype(np.float32), Y)
    assert s.multilabel and s.labels.dtype == bool and np.array_equal(s.labels, Y)
    g = zarr.open_group(str(tmp_path / "a.zarr"), mode="r")
    assert g["labels"].shape == (70, 3) and g["labels"].chunks == (32, 3)
    assert tuple(g["labels"].metadata.dimension_names) == ("example", "class")
    # 0/1 integers are accepted as targets; other values and 3-D labels are refused
    s01 = save_store(tmp_path / "b.zarr", {"pool": np.zeros((70, 4), np.float32)}, Y.astype(np.int64), chunk_rows=32)
    assert np.array_equal(s01.labels, Y)
    with pytest.raises(ValueError, match="multi-label targets must be bool or 0/1"):
        save_store(tmp_path / "c.zarr", {"pool": np.zeros((4, 2), np.float32)}, np.full((4, 3), 2))
    with pytest.raises(ValueError, match="labels must be a 1-D integer array or"):
        save_store(tmp_path / "d.zarr", {"pool": np.zeros((4, 2), np.float32)}, np.zeros((4, 3, 1), int))
    assert main(["check", "--no-progress", str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")]) == 0
    # a row whose targets differ is reported at that row; a single-label store against a multi-label one
    Y2 = Y.copy()
    Y2[41, 2] = not Y2[41, 2]
    _ml_store(tmp_path / "e.zarr", np.zeros((70, 4), np.float32), Y2)
    save_store(tmp_path / "f.zarr", {"pool": np.zeros((70, 4), np.float32)}, np.arange(70) % 3, chunk_rows=32)
    capsys.readouterr()
    assert main(["check", "--no-progress", "--compare", *(str(tmp_path / f"{x}.zarr") for x in "aef")]) == 1
    err = capsys.readouterr().err
    assert "labels differ from store a (first mismatch at row 41)" in err
    assert "store f: labels have shape (70,) but store a has (70, 3)" in err


def test_check_flags_wrong_multilabel_dtype(tmp_path, capsys):
    s = _ml_store(tmp_path / "a.zarr", np.zeros((40, 2), np.float32), np.zeros((40, 3), bool))
    g = zarr.open_group(s.path, mode="r+")
    del g["labels"]
    g.create_array("labels", shape=(40, 3), chunks=(32, 3), dtype="int32", fill_value=0,
                   dimension_names=["example", "class"])
    g["labels"][...] = np.zeros((40, 3), np.int32)
    capsys.readouterr()
    assert main(["check", "--no-progress", s.path]) == 1
    assert "labels has dtype int32, expected bool" in capsys.readouterr().err
    del g["labels"]
    g.create_array("labels", shape=(40, 3), chunks=(16, 3), dtype="bool", fill_value=False)
    with pytest.raises(StoreError, match="labels has shape"):
        open_store(s.path)


def test_class_metrics_refuse_multilabel_stores(tmp_path):
    from repsim.engine.drivers import separation_rows, sparsity_rows

    s = _ml_store(tmp_path / "a.zarr", np.abs(np.random.default_rng(0).normal(size=(40, 3))).astype(np.float32),
                  np.eye(3, dtype=bool)[np.arange(40) % 3])
    with pytest.raises(ValueError, match="multi-label targets"):
        separation_rows([s.path], progress=False)
    assert sparsity_rows([s.path], progress=False)[0]["nonzero_fraction"] == 1.0


# ------------------------------------------------------------------------------------ CSV loader
def _chexpert(root, rng, n_train=12, n_valid=5):
    """A CheXpert-v1.0-small-shaped tree: CSV paths relative to the folder that holds the dataset."""
    base = root / "CheXpert-v1.0-small"
    header = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding", *FINDINGS, "Support Devices"]
    cells = ["1.0", "0.0", "-1.0", ""]
    truth = {}
    for split, n in (("train", n_train), ("valid", n_valid)):
        rows = []
        for i in range(n):
            rel = f"CheXpert-v1.0-small/{split}/patient{i:05d}/study1/view1_frontal.jpg"
            write_image(root / rel, rng)
            vals = [cells[j] for j in rng.integers(0, 4, len(FINDINGS) + 2)]
            rows.append([rel, "Female", str(20 + i), "Frontal", "AP", *vals])
        with open(base / f"{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        truth[split] = np.array([[r[6 + k] == "1.0" for k in range(len(FINDINGS))] for r in rows])
    return base, truth


def test_csv_loader_chexpert_layout(tmp_path):
    pytest.importorskip("torch")
    from repsim.train.csvdata import read_label_csv
    from repsim.train.data import build_dataset

    base, truth = _chexpert(tmp_path, np.random.default_rng(1))
    paths, T, names = read_label_csv(base / "valid.csv")
    assert names == FINDINGS  # the five competition findings, not Age / No Finding / Support Devices
    assert np.array_equal(T, truth["valid"])  # positive iff the cell is 1; 0, -1 (uncertain), blank -> negative
    test = build_dataset(str(base), "test", image_size=8)
    assert len(test) == 5 and test.multilabel and test.classes == FINDINGS and np.array_equal(test.targets, truth["valid"])
    x, y = test[2]
    assert tuple(x.shape) == (3, 8, 8) and y.dtype.is_floating_point is False and y.tolist() == truth["valid"][2].tolist()
    tr = build_dataset(str(base), "train", image_size=8, holdout_size=4)
    ho = build_dataset(str(base), "holdout", image_size=8, holdout_size=4)
    assert len(tr) == 8 and len(ho) == 4 and not set(tr.example_ids) & set(ho.example_ids)
    assert len(build_dataset(str(base), "holdout", image_size=8)) == 1   # default: 10 % of a small CSV
    from repsim.train.data import dataset_from_config

    run = {"data": {"spec": "digits", "holdout_size": 5, "image_size": 8}}  # a run's holdout is its own dataset's
    assert len(dataset_from_config(run, "holdout", spec=str(base))) == 1
    assert np.array_equal(tr.targets, truth["train"][tr.example_ids])
    # a CSV file as the spec; findings chosen explicitly; every 1/0/-1/blank column when the five are absent
    assert len(build_dataset(str(base / "valid.csv"), "test", image_size=8)) == 5
    _, T2, names2 = read_label_csv(base / "valid.csv", ["Edema"])
    assert names2 == ["Edema"] and np.array_equal(T2[:, 0], truth["valid"][:, 3])
    small = tmp_path / "small.csv"
    small.write_text("Path,Age,Flu,Cough\nx.png,33,1,-1\ny.png,40,,1.0\n")
    assert read_label_csv(small)[2] == ["Flu", "Cough"]
    bad = tmp_path / "bad.csv"
    bad.write_text("Path,Flu\nx.png,2\n")
    with pytest.raises(ValueError, match="no finding columns"):
        read_label_csv(bad)
    with pytest.raises(ValueError, match="not 1, 0, -1 or blank"):
        read_label_csv(bad, ["Flu"])
    with pytest.raises(ValueError, match="not found relative to"):
        build_dataset(str(small), "test", image_size=8)


def test_extract_writes_multilabel_store(tmp_path):
    pytest.importorskip("torch")
    from repsim.extract.pipeline import extract_store

    base, truth = _chexpert(tmp_path, np.random.default_rng(2), n_train=4, n_valid=9)
    ckpt = tiny_checkpoint(tmp_path / "run" / "best.pt", 6)
    store = extract_store(str(ckpt), str(base), tmp_path / "s.zarr", split="test", layers="pool", batch_size=4,
                          chunk_rows=4, workers=0, progress=False, device="cpu")
    assert store.multilabel and store.labels.shape == (9, 5)
    assert np.array_equal(store.labels, truth["valid"][store.example_ids])  # rows shuffled, ids follow
    assert store.dataset["classes"] == FINDINGS and store.logits.shape == (9, 6)
    assert main(["check", "--no-progress", store.path]) == 0


# ------------------------------------------------------------------------------------- the probe
def _ml_pairs(tmp_path, objective, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", 160), ("test", 90)):
        X = rng.normal(size=(n, 6))
        Y = np.stack([X[:, 0] + 0.5 * rng.normal(size=n) > 0.3, X[:, 1] - X[:, 2] + rng.normal(size=n) > 0,
                      rng.random(n) < 0.3], axis=1)
        out[split] = _ml_store(tmp_path / f"{objective}-{split}.zarr", X.astype(np.float32), Y, objective=objective,
                               seed=seed, split=split)
    return out


def test_probe_multilabel_auc_against_sklearn(tmp_path):
    a, b = _ml_pairs(tmp_path, "softmax", 0), _ml_pairs(tmp_path, "sigmoid", 1)
    out = tmp_path / "res"
    assert main(["probe", "--train", a["train"].path, b["train"].path, "--test", a["test"].path, b["test"].path,
                 "--lambdas", "7", "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out / "multilabel.csv")))
    assert [r["target"] for r in rows] == ["a", "b", "c"] * 2 and not (out / "probes.csv").exists()
    assert rows[0]["objective"] == "softmax" and rows[3]["seed"] == "1" and rows[0]["split"] == "test"
    assert rows[0]["n"] == "90" and rows[0]["train_n"] == "160" and rows[0]["bins"] == "1000"
    Xtr, Xte = (np.asarray(a[s].layer("pool").compute()) for s in ("train", "test"))
    Ytr, Yte = a["train"].labels, a["test"].labels
    ref = multilabel_probe(Xtr, Ytr, Xte, Yte, lambdas=np.logspace(-6, 5, 7))
    for k in range(3):
        assert float(rows[k]["best_lambda"]) == ref.best_lambda[k]
        assert rows[k]["positives"] == str(int(Yte[:, k].sum()))
        # AUC from 1,000 evenly spaced bins == scikit-learn's exact AUC of the scores quantised to those bins
        binned = np.clip(np.floor(ref.scores[:, k] * 1000), 0, 999)
        assert float(rows[k]["auc"]) == pytest.approx(roc_auc_score(Yte[:, k], binned), abs=1e-12)
        if k < 2:  # informative targets: scores spread over many bins, so binning changes the AUC little
            assert float(rows[k]["auc"]) == pytest.approx(roc_auc_score(Yte[:, k], ref.scores[:, k]), abs=0.02)
    assert float(rows[0]["auc"]) > 0.8 and float(rows[1]["auc"]) > 0.7   # informative targets
    details = json.loads((out / "multilabel.json").read_text())
    assert len(details) == 6 and len(details[0]["val_auc"]) == 7
    # mixing a multi-label store with a single-label one is refused in one line
    save_store(tmp_path / "single.zarr", {"pool": np.zeros((90, 6), np.float32)}, np.arange(90) % 2)
    assert main(["probe", a["train"].path, "--test", str(tmp_path / "single.zarr"), "--out", str(out)]) == 2


def test_table_d1_item(tmp_path):
    from repsim.analyses.cli import make_figures

    rows = []
    for obj, aucs in (("softmax", (0.80, 0.70)), ("sigmoid", (0.75, 0.72))):
        for seed in range(3):
            for split, shift in (("test", 0.0), ("holdout", -0.05)):
                for target, auc in zip(("Edema", "Atelectasis"), aucs):
                    rows.append(dict(store=f"{obj}-s{seed}", objective=obj, seed=seed, task="chexpert", split=split,
                                     target=target, auc=auc + shift + 0.002 * seed, best_lambda=1.0, layer="pool",
                                     n=234 if split == "test" else 500, bins=1000))
    res = tmp_path / "res"
    res.mkdir()
    from repsim.results import write_csv

    write_csv(rows, res / "multilabel.csv")
    outcomes, _ = make_figures(None, res, tmp_path / "fig", only=["tableD1"], progress=False)
    assert outcomes[0].status == "done", outcomes[0].note
    t = outcomes[0].table
    assert list(t.shown.columns) == ["Evaluation set", "Pretraining loss", "Edema", "Atelectasis"]
    assert t.shown.iloc[0].tolist()[:3] == ["chexpert / test (234 images)", "Softmax", "80.2 ± 0.1"]
    num = t.numeric.set_index(["evaluation", "objective"])
    assert num.loc[("chexpert / holdout (500 images)", "sigmoid"), "Atelectasis"] == pytest.approx(67.2)
    bold = t.bold.set_index(t.shown["Evaluation set"] + "|" + t.shown["Pretraining loss"])
    assert bold.loc["chexpert / test (234 images)|Softmax", "Edema"] and not bold.loc[
        "chexpert / test (234 images)|Sigmoid", "Edema"]
    assert (tmp_path / "fig" / "tableD1.md").is_file() and "1000 evenly spaced" in outcomes[0].caption


def test_a_target_without_both_classes_in_the_validation_rows_is_warned_and_shares_a_lambda():
    """Its validation AUC is undefined at every λ: it took λ = 1e-6 (nearly unregularised) silently."""
    import warnings

    from repsim.probes.multilabel import multilabel_probe

    rng = np.random.default_rng(0)
    X, Xt = rng.normal(size=(200, 32)), rng.normal(size=(100, 32))
    Y = np.zeros((200, 2), bool)
    Y[:, 0] = X[:, 0] > 0
    val = set(np.random.default_rng(0).permutation(200)[:40].tolist())  # seed 0's validation rows
    Y[[i for i in range(200) if i not in val][:3], 1] = True  # target 1: no positive among them
    Yt = np.zeros((100, 2), bool)
    Yt[:, 0], Yt[:5, 1] = Xt[:, 0] > 0, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = multilabel_probe(X, Y, Xt, Yt, seed=0)
    assert np.isnan(r.val_auc[:, 1]).all()
    assert r.best_lambda[1] == r.lambdas[np.argmax(r.val_auc[:, 0])] > r.lambdas[0]
    assert any("target(s) [1] have only positives or only negatives" in str(w.message) for w in caught)
