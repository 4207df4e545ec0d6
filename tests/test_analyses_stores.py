"""`repsim figures` with real Zarr stores (repsim.save_store) beside the synthetic results files:
the store-only items (Figs. C.4–C.7, E.1, E.3, Table F.1), store metadata (temperature sweep, stage
boundaries, epochs) and the complete report."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from repsim import open_store, save_store
from repsim.commands.main import main
from tests.test_analyses_figures import LAYERS, OBJS, SEEDS, write_results

N, K = 60, 3
SHAPES = {"block1": (4, 4, 4), "block2": (4, 4, 4), "block3": (8, 2, 2), "block4": (8, 2, 2), "pool": (8,)}


def write_stores(root, rng=None):
    rng = rng or np.random.default_rng(1)
    d = root / "stores"
    d.mkdir()
    y = np.arange(N) % K
    for oi, o in enumerate(OBJS):
        for s in SEEDS:
            params = {"tau": [0.05, 0.1][s]} if o == "cosine_softmax" else {}
            W = rng.normal(size=(K, 8))
            pool = np.abs(W[y] * (1 + oi) + rng.normal(size=(N, 8)))  # class structure grows with oi
            layers = {l: np.maximum(rng.normal(size=(N,) + SHAPES[l]), 0).astype(np.float32) for l in LAYERS[:-1]}
            layers["pool"] = pool.astype(np.float32)
            logits = pool @ W.T + rng.normal(scale=2.0, size=(N, K))
            meta = {"model": {"arch": "mini_resnet", "objective": o, "seed": s, "params": params, "epoch": 3},
                    "dataset": {"name": "digits-source", "split": "test"}}
            save_store(d / f"{o}-s{s}-test.zarr", layers, y, logits=logits.astype(np.float32), meta=meta,
                       head=(W.astype(np.float32), np.zeros(K, np.float32)))
    # the softmax network on a transfer task (Table F.1): its 3 source classes map onto 2 target classes
    for split in ("train", "test"):
        yt = np.arange(40) % 2
        logits = np.eye(K)[np.where(yt == 0, 0, 1 + (np.arange(40) % 4 == 1))] * 5
        save_store(d / f"softmax-s0-taskA-{split}.zarr", {"pool": rng.normal(size=(40, 8)).astype(np.float32)}, yt,
                   logits=logits.astype(np.float32),
                   meta={"model": {"objective": "softmax", "seed": 0, "epoch": 3},
                         "dataset": {"name": "taskA", "split": split}})
    return d


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    res, stores = write_results(root), write_stores(root)
    out = root / "out"
    rc = main(["figures", "--stores", str(stores), "--results", str(res), "--out", str(out), "--no-progress"])
    return rc, out, (out / "report.html").read_text()


def test_every_store_item_renders(rendered):
    rc, out, report = rendered
    assert rc == 0, report
    from repsim.analyses.items.catalog import ORDER

    dynamics = {"figD2", "figE4",  # need several checkpoints per run
                # inputs of tests/test_analyses_recipes.py: finetune.csv, accuracy.csv, training variants
                "table2", "figD3", "tableC1", "tableC4", "tableC5", "tableC6", "tableE3",
                "agreement",  # ≥ 2 similarity measures (one CKA file here): tests/test_analyses_measures.py
                # a permutation null (none in these results): tests/test_analyses_calibrated.py
                "fig2a_calibrated", "fig2b_calibrated",
                "heatmap"}  # own models' heatmaps: every store here has an objective (tests/test_own_models.py)
    for item in ORDER:
        files = (f"{item}.png", f"{item}.pdf") if item.startswith("fig") else (f"{item}.csv", f"{item}.md")
        if item in dynamics:
            assert f"id='{item}' class='skipped'" in report
            continue
        for f in files:
            assert (out / f).stat().st_size > 0, (item, report[report.find(f"id='{item}'"):][:400])
            assert f"href='{f}'" in report
    for png in out.glob("*.png"):
        assert f"<img src='{png.name}'" in report


def test_sweep_table_uses_store_params(rendered):
    _, out, _ = rendered
    t4 = pd.read_csv(out / "table4.csv")
    assert list(t4["setting"]) == ["cosine_softmax (tau=0.05)", "cosine_softmax (tau=0.1)"]


def test_stage_boundaries_from_store_shapes(rendered):
    _, _, report = rendered
    cap = report[report.find("id='fig3'"):][:3000]
    assert "Dashed lines: stage boundaries" in cap


def test_class_overlap_table(rendered):
    _, out, _ = rendered
    f1 = pd.read_csv(out / "tableF1.csv")
    row = f1.set_index("dataset").loc["taskA"]
    # source class 0 -> target 0, classes 1 and 2 -> target 1: perfect with 2 copies of target 1
    assert row["assignment_accuracy"] == pytest.approx(100.0) and row["replications_k"] == 2
    assert row["classes"] == 2


def test_dynamics_items_and_final_epoch_only(tmp_path):
    res = write_results(tmp_path)
    for name, col in (("probes", "accuracy"), ("separation", "r2")):
        df = pd.read_csv(res / f"{name}.csv").assign(epoch=3)
        early = df.assign(epoch=1, **{col: df[col] * 0.5})
        pd.concat([df, early]).to_csv(res / f"{name}.csv", index=False)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress",
                 "--only", "figD2", "figE4", "table1"]) == 0
    assert (out / "figD2.png").exists() and (out / "figE4.png").exists()
    num = pd.read_csv(out / "table1.csv")
    pro = pd.read_csv(res / "probes.csv")
    final = pro[(pro.epoch == 3) & (pro.probe == "linear") & (pro.task == "taskA") & (pro.objective == "softmax")]
    assert num[num.probe == "linear"].set_index("objective").loc["softmax", "taskA"] == pytest.approx(
        100 * final.accuracy.mean())


def test_store_roundtrip_sanity(tmp_path):
    d = write_stores(tmp_path)
    s = open_store(d / "softmax-s0-test.zarr")
    assert s.attrs["model"]["objective"] == "softmax" and s.logits is not None and s.head is not None


def test_prediction_figures_with_stores_of_different_class_counts(tmp_path):
    """Networks with 5 and 1000 classes on one split: the figures compare the networks that share a
    class count, whichever store name sorts first (issue 30: IndexError before)."""
    d = tmp_path / "stores"
    d.mkdir()
    rng = np.random.default_rng(0)
    y = np.arange(40) % 5
    for name, k, obj, seed in (("a-wide", 1000, "softmax", 9), ("softmax-s0", 5, "softmax", 0),
                               ("sigmoid-s0", 5, "sigmoid", 0), ("softmax-s1", 5, "softmax", 1)):
        logits = rng.normal(size=(40, k)).astype(np.float32)
        logits[np.arange(40), y] += 3
        save_store(d / f"{name}.zarr", {"pool": rng.normal(size=(40, 4)).astype(np.float32)}, y, logits=logits,
                   meta={"model": {"objective": obj, "seed": seed}, "dataset": {"name": "toy", "split": "test"}})
    out = tmp_path / "out"
    assert main(["figures", "--stores", str(d), "--out", str(out), "--only", "figC6", "figC7", "--no-progress"]) == 0
    assert (out / "figC6.png").stat().st_size > 0 and (out / "figC7.png").stat().st_size > 0


def test_stores_under_symlinked_directories_are_found(tmp_path):
    """A stores directory assembled from links to other runs' store directories (and a link cycle)."""
    from repsim.analyses.data import Inputs

    run = tmp_path / "run1"
    rng = np.random.default_rng(0)
    save_store(str(run / "a.zarr"), {"pool": rng.normal(size=(20, 3))}, np.arange(20) % 2)
    stores = tmp_path / "stores"
    stores.mkdir()
    (stores / "linked").symlink_to(run, target_is_directory=True)
    (run / "loop").symlink_to(stores, target_is_directory=True)  # a cycle back up
    assert list(Inputs(stores, None).all_stores) == ["a"]


def test_figures_only_an_unknown_item_is_refused(tmp_path, capsys):
    assert main(["figures", "--results", str(tmp_path), "--out", str(tmp_path / "f"), "--only", "fig99"]) == 2
    err = capsys.readouterr().err
    assert "--only: unknown item(s) fig99; `repsim figures --list` lists the items" in err
    assert main(["figures", "--results", str(tmp_path), "--out", str(tmp_path / "f"), "--only", "fig2a_rbf_cka",
                 "--no-progress"]) == 0


def test_figE3_reads_the_networks_own_training_set_not_a_transfer_task(tmp_path):
    """Fig. E.3 is of the pretraining task's training set (App. E). With training-split stores of the
    source and of a transfer task that tie on every other count, the source group is read — whichever
    dataset name sorts last (the audit: "digits-target" > "digits-source" picked the transfer task)."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.predictions import Models, figE3

    d = tmp_path / "stores"
    d.mkdir()
    rng = np.random.default_rng(0)
    y = np.arange(40) % 2
    for o in ("softmax", "sigmoid"):
        for data, tag in (("digits-source", "src"), ("digits-target", "tgt")):
            logits = rng.normal(size=(40, 2)).astype(np.float32)
            save_store(d / f"{o}-s0-{tag}-train.zarr", {"pool": rng.normal(size=(40, 4)).astype(np.float32)}, y,
                       logits=logits,
                       meta={"model": {"objective": o, "seed": 0, "train_dataset": {"name": "digits-source@20"}},
                             "dataset": {"name": data, "split": "train"}})
    inputs = Inputs(d, None)
    M = Models(inputs, prefer_split="train")
    assert (M.dataset, M.split) == ("digits-source", "train")
    assert all("-src-" in n for n in M.names)
    assert "digits-source/train" in figE3(inputs).caption


def _pred_stores(d, preds, y, k):
    """One store per (name, predictions): logits peaked at each prediction."""
    rng = np.random.default_rng(0)
    for name, (obj, seed, pred) in preds.items():
        logits = np.full((len(y), k), -2.0, np.float32)
        logits[np.arange(len(y)), pred] = 3.0
        save_store(d / f"{name}.zarr", {"pool": rng.normal(size=(len(y), 4)).astype(np.float32)}, y, logits=logits,
                   meta={"model": {"objective": obj, "seed": seed}, "dataset": {"name": "toy", "split": "test"}})


def test_figC4_explains_pairs_with_no_common_error_and_clusters_them_neutrally(tmp_path):
    """Two networks with no example both get wrong have undefined agreement: blank cell, a caption
    sentence saying why, and in the dendrogram the mean of the other pairs rather than 0 % (distance 1)."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.predictions import clustering_similarity, figC4

    S, n, fill = clustering_similarity(np.array([[np.nan, np.nan, 0.2], [np.nan, np.nan, 0.6], [0.2, 0.6, np.nan]]))
    assert n == 1 and fill == pytest.approx(0.4)
    np.testing.assert_allclose(S, [[1, 0.4, 0.2], [0.4, 1, 0.6], [0.2, 0.6, 1]])

    d = tmp_path / "stores"
    d.mkdir()
    y = np.arange(40) % 4
    a, b, c = y.copy(), y.copy(), y.copy()
    a[:4] = (y[:4] + 1) % 4     # a errs on 0–3
    b[4:8] = (y[4:8] + 1) % 4   # b errs on 4–7: no error in common with a
    c[:4] = (y[:4] + 2) % 4     # c errs on 0–3 unlike a (0 %) and on 4–7 like b (100 %)
    c[4:8] = (y[4:8] + 1) % 4
    _pred_stores(d, {"softmax-s0": ("softmax", 0, a), "softmax-s1": ("softmax", 1, b),
                     "sigmoid-s0": ("sigmoid", 0, c)}, y, 4)
    out = figC4(Inputs(d, None))
    assert "1 pair(s) of networks have no example both get wrong" in out.caption
    assert "(50.0 %)" in out.caption
    # b and c join at distance 0; a joins them at the mean of 1 − 0.5 (a, b: filled) and 1 − 0 (a, c) = 0.75,
    # where the undefined pair taken as 0 % agreement put it at 1
    segments = np.concatenate([seg for coll in out.fig.axes[1].collections for seg in coll.get_segments()])
    assert segments[:, 0].max() == pytest.approx(0.75)


def test_figE4_puts_the_training_split_left_on_one_y_scale(tmp_path):
    """App. E.4: training set (left), validation set (right); the panels share their y scale."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import figE4

    res = write_results(tmp_path)
    sep = pd.read_csv(res / "separation.csv")
    sep = pd.concat([sep.assign(split="test", dataset="toy", n=60),
                     sep.assign(split="train", dataset="toy", n=90, r2=sep.r2 + 0.3,
                                store=sep.store.str.replace("-test", "-train"))])
    sep = pd.concat([sep.assign(epoch=3), sep.assign(epoch=1, r2=sep.r2 * 0.5)])
    sep.to_csv(res / "separation.csv", index=False)
    out = figE4(Inputs(None, res))
    left, right = out.fig.axes[:2]
    assert left.get_title() == "train split" and right.get_title() == "test split"
    assert left.get_shared_y_axes().joined(left, right) and left.get_ylim() == right.get_ylim()
    assert "panels: train split, test split, left to right" in out.caption


def test_prediction_figures_skip_networks_whose_logits_are_not_their_datas_classes(tmp_path):
    """A 1000-class head on 5-class data (a pretrained or random-init model's own head): its predictions
    can be neither right nor wrong, so the prediction items skip it with that reason; and stores of
    unknown objective (own models) are skipped with theirs, instead of "s?" ticks and all-zero cells."""
    rng = np.random.default_rng(0)
    y = np.arange(40) % 5
    for case, (k, objective) in {"wide": (1000, "softmax"), "own": (5, None)}.items():
        d = tmp_path / case
        d.mkdir()
        for name in ("a", "b", "c"):
            model = {"objective": objective, "seed": 0} if objective else {"arch": "resnet18"}
            save_store(d / f"{name}.zarr", {"pool": rng.normal(size=(40, 4)).astype(np.float32)}, y,
                       logits=rng.normal(size=(40, k)).astype(np.float32),
                       meta={"model": model, "dataset": {"name": "toy", "split": "test", "num_classes": 5}})
        out = tmp_path / f"out-{case}"
        assert main(["figures", "--stores", str(d), "--out", str(out), "--only", "figC4", "figC5", "figC6",
                     "figC7", "figE3", "--quiet"]) == 0
        report = (out / "report.html").read_text()
        why = "not over their data&#x27;s classes" if case == "wide" else "the objective of no store with logits is known"
        for item in ("figC4", "figC5", "figC6", "figC7", "figE3"):
            assert f"id='{item}' class='skipped'" in report and not (out / f"{item}.png").exists(), (case, item)
        assert why in report, (case, report[-2000:])
