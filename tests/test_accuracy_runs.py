"""`repsim accuracy` (top-1/top-5/mean per-class from stores' logits, Table C.1) against a brute-force
sort, and `repsim runs` (training.csv from run directories)."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from repsim import save_store
from repsim.commands.main import main
from repsim.kernels.accuracy import TopKAccuracy, topk_ranks


def _brute(z, y, k):
    """Label among the first k of a stable descending sort (ties: lower class index first)."""
    order = [sorted(range(len(row)), key=lambda j: (-row[j], j)) for row in z.tolist()]
    return np.array([int(y[i]) in order[i][:k] for i in range(len(y))])


def test_topk_against_brute_force_with_ties_and_merging():
    rng = np.random.default_rng(0)
    z = rng.integers(0, 4, size=(300, 7)).astype(np.float32)  # many ties
    y = rng.integers(0, 6, size=300)  # class 6 never occurs
    for k in (1, 2, 5):
        rank = topk_ranks(z, y)
        assert np.array_equal(rank < k, _brute(z, y, k))
    assert np.array_equal(topk_ranks(z, y) == 0, z.argmax(1) == y)
    one = TopKAccuracy(7, ks=(1, 5)).update(z, y).result()
    parts = TopKAccuracy(7, ks=(1, 5)).update(z[:100], y[:100]).merge(TopKAccuracy(7, ks=(1, 5)).update(z[100:], y[100:]))
    assert parts.result() == one
    assert one["top1"] == pytest.approx(_brute(z, y, 1).mean()) and one["top5"] == pytest.approx(_brute(z, y, 5).mean())
    hit = z.argmax(1) == y
    assert one["mean_per_class"] == pytest.approx(np.mean([hit[y == c].mean() for c in range(6)]))
    with pytest.raises(ValueError, match="NaN"):
        topk_ranks(np.full((2, 3), np.nan), [0, 1])
    with pytest.raises(ValueError, match="labels must be in"):
        topk_ranks(np.zeros((2, 3)), [0, 3])


@pytest.mark.parametrize("device", ["CPU_DEVICE", "device1"])
def test_topk_takes_device_logits(device):
    """Logits (and labels) on a device, which refuses np.asarray as CuPy does (array-api-strict's device1),
    are copied to the host once: the same counts as NumPy's."""
    xs = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(2)
    z = rng.normal(size=(40, 6))
    y = rng.integers(0, 6, size=40)
    dev = xs.Device(device)
    got = TopKAccuracy(6, ks=(1, 3)).update(xs.asarray(z, device=dev), xs.asarray(y, device=dev)).result()
    assert got == TopKAccuracy(6, ks=(1, 3)).update(z, y).result()
    np.testing.assert_array_equal(topk_ranks(xs.asarray(z, device=dev), y), topk_ranks(z, y))


def test_accuracy_command_streams_chunks_and_merges(tmp_path, capsys):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 10, size=250)
    z = rng.normal(size=(250, 10)).astype(np.float32)
    z[np.arange(250), y] += 1.5
    for split in ("train", "test"):
        save_store(tmp_path / f"net-{split}.zarr", {"pool": rng.normal(size=(250, 4)).astype(np.float32)}, y, logits=z,
                   chunk_rows=64, meta={"model": {"objective": "sigmoid", "seed": 2, "epoch": 7},
                                        "dataset": {"name": "digits-source", "split": split}})
    out = tmp_path / "accuracy.csv"
    assert main(["accuracy", str(tmp_path / "net-train.zarr"), "--out", str(out), "--no-progress"]) == 0
    assert main(["accuracy", str(tmp_path / "net-*.zarr"), "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out)))
    assert sorted(r["split"] for r in rows) == ["test", "train"]  # merged by store, not duplicated
    r = rows[0]
    assert (r["objective"], r["seed"], r["epoch"], r["n"]) == ("sigmoid", "2", "7", "250")
    assert float(r["top1"]) == pytest.approx(_brute(z, y, 1).mean()) and float(r["top5"]) == pytest.approx(_brute(z, y, 5).mean())
    save_store(tmp_path / "nologits.zarr", {"pool": np.ones((4, 2), np.float32)}, [0, 1, 0, 1])
    capsys.readouterr()
    assert main(["accuracy", str(tmp_path / "nologits.zarr"), "--out", str(out)]) == 2
    assert "holds no logits" in capsys.readouterr().err


def _run_dir(path, cfg, metrics, best=False):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    with open(path / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(metrics[0]))
        w.writeheader()
        w.writerows(metrics)
    if best:
        (path / "best.pt").write_bytes(b"")


def test_runs_collects_training_csv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = [{"epoch": e, "step": 10 * e, "train_top1": 50 + e, "holdout_top1": h, "holdout_top5": 99, "test_top1": 60 + e,
          "test_top5": 98, "test_mean_per_class": 59 + e} for e, h in ((1, 70), (2, 80), (3, 80), (4, 75))]
    cfg = {"objective": "logit_penalty", "objective_params": {"beta": 6e-4}, "seed": 1, "variant": "autoaugment",
           "preset": "p", "schedule": {"decay": 0.975}, "mixup": {"alpha": 0.0}}
    _run_dir(tmp_path / "runs" / "a" / "lp-s1", cfg, m, best=True)
    _run_dir(tmp_path / "runs" / "b" / "lp-s1", {**cfg, "seed": 2, "variant": ""}, m, best=False)
    out = tmp_path / "training.csv"
    assert main(["runs", str(tmp_path / "runs" / "*" / "*"), "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    a = [r for r in rows if r["store"] == "runs/a/lp-s1"]
    b = [r for r in rows if r["store"] == "runs/b/lp-s1"]
    # best.pt: the curve stops at the first best holdout epoch (2); without it, at the last epoch
    assert sorted({int(r["epoch"]) for r in a}) == [1, 2] and sorted({int(r["epoch"]) for r in b}) == [1, 2, 3, 4]
    t = next(r for r in a if r["split"] == "test" and r["epoch"] == "2")
    assert (float(t["top1"]), float(t["top5"]), float(t["mean_per_class"])) == (62, 98, 61)
    assert (t["objective"], t["seed"], t["variant"], json.loads(t["params"])) == ("logit_penalty", "1", "autoaugment",
                                                                                    {"beta": 6e-4})
    assert {r["split"] for r in a} == {"train", "holdout", "test"} and t["schedule_decay"] == "0.975"


def test_the_early_stopping_rule_has_one_home(tmp_path, monkeypatch):
    """App. A.1's rule (first epoch with the best holdout score, NaN never) lives in repsim.study.runs; the
    training curves of a run evaluated every 2nd epoch stop at best.pt's epoch (they ran to the end
    while the first epoch had no holdout score), and repsim/train/, `repsim runs` and the demo import it."""
    from repsim.study.runs import best_epoch

    assert best_epoch({1: math.nan, 2: 50.0, 3: 50.0, 4: 49.0}) == 2 and best_epoch({1: math.nan}) is None
    assert best_epoch({3: 1.0, 1: 2.0, 2: 2.0}) == 1 and best_epoch({}) is None
    monkeypatch.chdir(tmp_path)
    m = [{"epoch": e, "train_top1": 50 + e, "holdout_top1": h, "test_top1": 60 + e}
         for e, h in ((1, ""), (2, 80), (3, ""), (4, 75))]
    _run_dir(tmp_path / "runs" / "lp-s1", {"objective": "softmax", "seed": 1}, m, best=True)
    out = tmp_path / "training.csv"
    assert main(["runs", str(tmp_path / "runs" / "lp-s1"), "--out", str(out)]) == 0
    assert sorted({int(r["epoch"]) for r in csv.DictReader(open(out))}) == [1, 2]

    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for user in ("repsim/train/loop.py", "repsim/train/tune.py", "repsim/commands/runs.py", "repsim/analyses/pipeline.py",
                 "repsim/analyses/demo_analysis.py"):
        tree = ast.parse((root / user).read_text())
        assert any(isinstance(n, ast.ImportFrom) and n.module == "repsim.study.runs" for n in ast.walk(tree)), user


def test_tune_grid_best_epoch_skips_a_diverged_epoch(tmp_path):
    from repsim.train.tune import Group, Replicate, _write_grid

    class _Run:
        dir = tmp_path / "r0"

    g = Group("softmax", [Replicate("s0", ())])
    _write_grid(tmp_path, [{"lr": 0.1}], g, [[{1: math.nan, 2: 70.0, 3: 70.0, 4: 60.0}]], [[_Run()]])
    row = next(csv.DictReader(open(tmp_path / "grid.csv")))
    assert (row["best_epoch"], float(row["holdout_best"]), row["last_epoch"]) == ("2", 70.0, "4")


def _head_store(path, dataset, train_dataset=None, *, K=5, n=100, labels=None):
    """A network's logits on ``dataset`` (its attrs), the network trained on ``train_dataset`` (K outputs)."""
    rng = np.random.default_rng(3)
    y = np.arange(n) % K if labels is None else np.asarray(labels)
    z = rng.normal(size=(n, K)).astype(np.float32)
    z[np.arange(n), np.clip(y, 0, K - 1)] += 2.0
    model = {"objective": "softmax", "seed": 0, "checkpoint_sha256": "cc" * 32}
    if train_dataset:
        model["train_dataset"] = train_dataset
    return save_store(path, {"pool": rng.normal(size=(n, 4)).astype(np.float32)}, y, logits=z,
                      example_ids=np.arange(n), meta={"model": model, "dataset": dataset})


def test_accuracy_refuses_a_store_whose_labels_number_other_classes_than_the_head(tmp_path, capsys):
    """A digits-target store under a digits-source network (5 classes each, other digits under labels 0-4)
    was scored top-1 0.2756 with exit 0. What the stores record proves it: the two names are different
    class subsets of one family; a class count other than the head's outputs; recorded class lists that
    differ. Another dataset of the network's classes (ImageNet-V2 under an ImageNet net) is still scored."""
    src = {"spec": "digits-source", "name": "digits-source", "classes": ["0", "1", "2", "3", "4"]}
    _head_store(tmp_path / "src.zarr", {"name": "digits-source", "split": "test", "num_classes": 5}, src)
    _head_store(tmp_path / "tgt.zarr", {"name": "digits-target", "split": "test", "num_classes": 5}, src)
    _head_store(tmp_path / "v2.zarr", {"name": "digits-v2", "split": "test", "num_classes": 5}, src)
    _head_store(tmp_path / "ten.zarr", {"name": "cifar10", "split": "test", "num_classes": 10}, K=5)
    _head_store(tmp_path / "txt.zarr", {"name": "reviews", "split": "test", "classes": list("abcde")},
                {"name": "reviews", "classes": list("abcdf")})
    _head_store(tmp_path / "unl.zarr", {"name": "digits-source", "split": "test"}, src, labels=np.full(100, -1))
    out = tmp_path / "accuracy.csv"
    code = main(["accuracy", str(tmp_path / "src.zarr"), str(tmp_path / "tgt.zarr"), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert ("store tgt: it holds dataset 'digits-target' but its network was trained on 'digits-source', another "
            "class subset of 'digits'") in err and "--allow-other-classes" in err
    for name, says in (("ten", "its dataset 'cifar10' records 10 classes but the network's head has 5 outputs"),
                       ("txt", "its dataset 'reviews' records the classes [a, b, c, d, e] but the network was "
                               "trained on [a, b, c, d, f]"),
                       ("unl", "labels must lie in [0, 5) (its network's head has 5 outputs), got range [-1, -1]")):
        assert main(["accuracy", str(tmp_path / f"{name}.zarr"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: store {name}: {says}" in err and err.count("\n") == 1, err
    # other names, the same classes: scored (the paper's robustness sets); on purpose, with a warning
    assert main(["accuracy", str(tmp_path / "src.zarr"), str(tmp_path / "v2.zarr"), "--out", str(out),
                 "--no-progress"]) == 0
    assert main(["accuracy", str(tmp_path / "tgt.zarr"), "--allow-other-classes", "--out", str(out),
                 "--no-progress"]) == 0
    assert "WARNING: store tgt: it holds dataset 'digits-target'" in capsys.readouterr().err
    assert sorted(r["store"] for r in csv.DictReader(open(out))) == ["src", "tgt", "v2"]
