"""The tuning protocol of App. A.1/A.3 (repsim.train.tune): the selection rule on planted holdout accuracies, the
grid, and `repsim finetune` / `repsim tune` end to end on digits (real training subprocesses)."""
from __future__ import annotations

import csv
import hashlib
import json
import math

import numpy as np
import pytest

pytest.importorskip("torch")  # training and extraction need the [torch] extra

from repsim.commands.main import main
from repsim.results import COLUMNS, columns
from repsim.train.config import finetune_grid, load_config
from repsim.train.tune import Run, select_point, toml_literal

SMALL = ['arch="mini_resnet14"', "arch_params.width=4", "batch_size=32", "optim.ref_batch=32",
         "schedule.warmup_epochs=1", "threads=1"]


# -- the rule --------------------------------------------------------------------------------------
def test_select_last_averages_over_replicates_not_the_best_single_run():
    curves = [[{5: 90.0}, {5: 50.0}],   # best single run, mean 70
              [{5: 80.0}, {5: 70.0}],   # mean 75: first of the tie
              [{5: 75.0}, {5: 75.0}],   # mean 75
              [{5: 99.0}, {5: math.nan}]]  # diverged replicate: never selected
    sel = select_point(curves, "last")
    assert sel.point == 1 and sel.score == 75.0 and sel.epoch is None
    assert sel.means[:3] == [70.0, 75.0, 75.0] and math.isnan(sel.means[3])
    # only the last epoch counts
    assert select_point([[{1: 99.0, 2: 10.0}], [{1: 0.0, 2: 20.0}]], "last").point == 1


def test_select_best_uses_the_replicate_averaged_curve_and_its_epoch():
    curves = [[{1: 60.0, 2: 90.0, 3: 70.0}, {1: 60.0, 2: 40.0, 3: 70.0}],  # mean curve 60, 65, 70
              [{1: 50.0, 2: 80.0, 3: 60.0}, {1: 50.0, 2: 78.0, 4: 99.0}]]  # common epochs 1, 2: 50, 79
    sel = select_point(curves, "best")
    assert (sel.point, sel.epoch, sel.score) == (1, 2, 79.0) and sel.means == [70.0, 79.0]
    tie = select_point([[{1: 70.0, 2: 70.0}]], "best")
    assert tie.epoch == 1  # first epoch reaching the maximum


@pytest.mark.parametrize("curves,match", [
    ([], "empty grid"),
    ([[{1: 1.0}], [{1: 1.0}, {1: 2.0}]], "same, non-zero number of replicates"),
    ([[{}]], "no holdout score"),
    ([[{1: math.nan}]], "every grid point has a NaN"),
])
def test_select_refuses_bad_grids(curves, match):
    with pytest.raises(ValueError, match=match):
        select_point(curves, "last")


def test_finetune_grid_options_and_literals():
    g = finetune_grid((-2, -1, 2), (-4, -3, 3), no_decay=False)
    assert len(g) == 6 and [p["optim.lr"] for p in g[:3]] == [0.01] * 3
    assert [p["optim.weight_decay"] for p in g[:3]] == pytest.approx([1e-4, 10**-3.5, 1e-3])
    assert finetune_grid((-3, -3, 1), (-5, -5, 1))[0] == {"optim.lr": 0.001, "optim.weight_decay": 0.0}
    # every literal the protocol writes is read back by --set as the same value
    for v in (3.1622776601683795e-06, 0.0, 12, True, "digits-target", [1, 2, 3], {"width": 4, "layers": [1, 1]}):
        cfg = load_config("digits-softmax", [f"arch_params={toml_literal({'v': v})}"])
        assert cfg["arch_params"] == {"v": v}
    path = __import__("pathlib").Path
    key = lambda *sets: Run(path("x"), "digits-softmax", list(sets), "l", "grid").key  # noqa: E731
    assert key(("optim.lr", 1.5)) == Run(path("y"), "digits-softmax", [("optim.lr", 1.5)], "m", "final").key
    # the resolved config, not the command line: the preset's own value given again is the same run
    assert key() == key(("optim.lr", load_config("digits-softmax")["optim"]["lr"])) != key(("optim.lr", 1.5))


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from repsim.train.loop import train_run

    root = tmp_path_factory.mktemp("pre")
    for s in (0, 1):
        train_run(load_config("digits-softmax", SMALL + ["epochs=1", f"seed={s}"]), root / f"softmax-s{s}",
                  progress=False, log=lambda m: None)
    return root


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_finetune_grid_selection_retraining_and_resume(pretrained, tmp_path, capsys):
    out, res = tmp_path / "ft", tmp_path / "results"
    argv = ["finetune", "--preset", "finetune-digits", "--init-from", str(pretrained / "softmax-s*" / "checkpoint.pt"),
            "--out", str(out), "--results", str(res), "--steps", "6", "--lr-grid", "-2", "-1", "2",
            "--wd-grid", "-4", "-4", "1", "--no-zero-decay", "--jobs", "2", "--task", "digits-target"]
    assert main(argv) == 0, capsys.readouterr().err
    grid = _rows(out / "softmax" / "grid.csv")
    assert len(grid) == 4 and {r["replicate"] for r in grid} == {"s0", "s1"}
    # the selection, recomputed from the runs' own metrics files: highest mean of the last holdout top-1
    means = {}
    for r in grid:
        last = _rows(f"{r['run']}/metrics.csv")[-1]
        assert "test_top1" not in last or last["test_top1"] == ""  # the grid never looks at test
        means.setdefault(int(r["point"]), []).append(float(last["holdout_top1"]))
    best = max(sorted(means), key=lambda p: sum(means[p]) / 2)
    sel = json.loads((out / "softmax" / "selection.json").read_text())
    assert sel["point"] == best and sel["score"] == pytest.approx(sum(means[best]) / 2)
    lr = finetune_grid((-2, -1, 2), (-4, -4, 1), no_decay=False)[best]["optim.lr"]
    rows = _rows(res / "finetune.csv")
    assert sorted(r["seed"] for r in rows) == ["0", "1"] and {r["objective"] for r in rows} == {"softmax"}
    # the files' columns: repsim.results' declarations (grid.csv: the grid's axes after replicate)
    assert tuple(rows[0]) == COLUMNS["finetune"] == tuple(_rows(out / "results.csv")[0])
    assert tuple(grid[0]) == columns("grid", ["optim.lr", "optim.weight_decay"])
    for r in rows:
        final = json.loads(open(f"{r['run']}/config.json").read())
        assert final["data"]["train_split"] == "train+holdout" and final["optim"]["lr"] == lr
        assert final["optim"]["weight_decay"] == 1e-4 and final["optim"]["wd_over_lr"]
        src = final["finetune"]["source"]
        assert src["sha256"] == hashlib.sha256(open(r["source_checkpoint"], "rb").read()).hexdigest()
        assert float(r["accuracy"]) == float(_rows(f"{r['run']}/metrics.csv")[-1]["test_top1"])
        assert r["task"] == "digits-target" and float(r["lr"]) == lr and int(r["steps"]) == 6
    assert not list((out / "softmax" / "grid").glob("*/checkpoint.pt"))  # grid checkpoints removed
    # a rerun trains nothing; a final run interrupted after its checkpoint resumes
    capsys.readouterr()
    (out / "softmax" / "final" / "s1" / "DONE").unlink()
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "4 of 4 runs already done; nothing to run" in log and "1 of 2 runs already done; running 1" in log
    assert "resuming" in (out / "softmax" / "final" / "s1" / "train.log").read_text()
    assert len(_rows(res / "finetune.csv")) == 2
    # Fig. D.3 from real stores: extract source and fine-tuned checkpoints on the target test split, CKA, figures
    stores = tmp_path / "stores"
    for r in rows:
        for kind, ck in (("pre", r["source_checkpoint"]), ("post", r["checkpoint"])):
            assert main(["extract", "--checkpoint", ck, "--data", "digits-target", "--split", "test", "--layers",
                         "block1,block3,pool", "--out", str(stores / f"{kind}-s{r['seed']}.zarr"), "--workers", "0",
                         "--no-progress"]) == 0
    from repsim import open_store

    post = open_store(stores / "post-s0.zarr").model
    assert post["finetuned_from"]["sha256"] == open_store(stores / "pre-s0.zarr").model["checkpoint_sha256"]
    assert main(["cka", *map(str, sorted(stores.glob("*.zarr"))), "--method", "exact", "--out",
                 str(res / "cka_finetune.npz"), "--no-progress"]) == 0
    fig = tmp_path / "fig"
    assert main(["figures", "--stores", str(stores), "--results", str(res), "--out", str(fig), "--no-progress",
                 "--only", "table2", "figD3"]) == 0
    assert (fig / "figD3.png").exists() and (fig / "table2.md").exists()
    assert "digits-target/test" in (fig / "report.html").read_text()


@pytest.mark.slow
def test_tune_selects_mixup_alpha_and_stopping_epoch(tmp_path, capsys):
    out = tmp_path / "tune"
    sets = sum([["--set", s] for s in SMALL + ["epochs=3"]], [])
    argv = ["tune", "--preset", "digits-softmax-mixup", "--seeds", "0", "--grid", "mixup.alpha=0.1,0.4",
            "--out", str(out), "--results", str(tmp_path / "res"), "--jobs", "2", "--metric", "mean_per_class",
            "--keep-checkpoints", *sets]
    assert main(argv) == 0, capsys.readouterr().err
    sel = json.loads((out / "softmax-mixup" / "selection.json").read_text())
    assert sel["metric"] == "mean_per_class" and sel["select_on"] == "best"
    # recompute: mean over seeds of each epoch's holdout mean per-class accuracy (--metric), best (point, epoch)
    grid = _rows(out / "softmax-mixup" / "grid.csv")
    curves = {}
    for r in grid:
        for m in _rows(f"{r['run']}/metrics.csv"):
            curves.setdefault((int(r["point"]), int(m["epoch"])), []).append(float(m["holdout_mean_per_class"]))
    best = max(sorted(curves), key=lambda k: sum(curves[k]) / len(curves[k]))
    assert (sel["point"], sel["epoch"]) == best and sel["selected"] == {"mixup.alpha": [0.1, 0.4][best[0]]}
    assert sel["score"] == pytest.approx(sum(curves[best]) / len(curves[best]))
    assert len(list((out / "softmax-mixup" / "grid").glob("*/checkpoint.pt"))) == 2  # --keep-checkpoints
    rows = _rows(tmp_path / "res" / "tune.csv")
    assert len(rows) == 1 and {r["variant"] for r in rows} == {"mixup"}
    assert tuple(rows[0]) == COLUMNS["tune"] and tuple(grid[0]) == columns("grid", ["mixup.alpha"])
    for r in rows:
        assert int(r["epochs_trained"]) == best[1] and r["selected_epoch"] == str(best[1])
        assert r["metric"] == "mean_per_class" and float(r["accuracy"]) == float(r["mean_per_class"])
    # training.csv of the retrained runs
    assert main(["runs", str(out / "softmax-mixup" / "final" / "*"), "--out", str(tmp_path / "training.csv")]) == 0
    tr = _rows(tmp_path / "training.csv")
    assert {r["store"].split("/")[-1] for r in tr} == {"s0"} and {r["variant"] for r in tr} == {"mixup"}
    assert {r["mixup_alpha"] for r in tr} == {str([0.1, 0.4][best[0]])}


def test_cli_errors_are_one_line(capsys, tmp_path):
    rc = main(["finetune", "--preset", "finetune-digits", "--init-from", str(tmp_path / "none*.pt"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("repsim finetune: error: --init-from") and "matches no file" in err[0]
    rc = main(["finetune", "--preset", "finetune-digits", "--init-from", "x.pt", "--out", str(tmp_path),
               "--lr-grid", "-1", "-2", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "LO <= HI" in err[0]
    import torch

    torch.save({"config": {"arch": "mini_resnet14", "arch_params": {"width": 4}, "objective": "softmax", "seed": 0},
                "model": {}},
               tmp_path / "source.pt")  # (what --init-from reads before the holdout is checked)
    rc = main(["finetune", "--preset", "finetune-digits", "--init-from", str(tmp_path / "source.pt"), "--out",
               str(tmp_path), "--holdout-size", "100"])  # digits-target's holdout is fixed: refused, not ignored
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "holdout split of 'digits-target' is fixed" in err[0], err
    rc = main(["tune", "--preset", "digits-softmax", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no grid" in err[0]
    rc = main(["tune", "--preset", "digits-softmax", "--out", str(tmp_path), "--grid", "optim.lrr=1,2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "unknown config key" in err[0]


@pytest.mark.slow
def test_runs_under_torchrun(tmp_path):
    """--nproc-per-node 2: a run is a 2-process (gloo) torchrun job, marked done, its log kept."""
    from repsim.train.checkpoint import load_checkpoint
    from repsim.train.tune import parse_sets, run_all

    run = Run(tmp_path / "ddp", "digits-softmax", parse_sets(SMALL + ["epochs=1"]), "ddp", "final")
    run_all([run], nproc=2, say=lambda m: None, device="cpu")  # the gloo path, on any machine
    assert json.loads((run.dir / "DONE").read_text())["key"] == run.key and (run.dir / "train.log").is_file()
    assert len(load_checkpoint(run.dir / "checkpoint.pt")["rng"]) == 2  # one RNG state per rank


def test_a_finetune_run_is_not_done_once_its_source_checkpoint_changes(tmp_path):
    # A.3's Table 2 must come from the given pretrained networks: a checkpoint replaced at the same
    # --init-from path (retrained, resumed) must not leave its finished fine-tuning runs "done"
    from repsim.train.tune import Run, changed_source, mark_done, run_all, run_state

    src = tmp_path / "best.pt"
    src.write_bytes(b"network A")
    run = Run(tmp_path / "ft", "finetune-digits", [("finetune.init_from", str(src))], "ft s0", "final")
    key = run.key
    assert json.loads(key)["init_from_sha256"]
    run_state(run.dir, key)
    mark_done(run.dir, key)
    said: list[str] = []
    run_all([run], say=said.append, device="cpu")  # every run done: says so, runs nothing
    assert any("1 of 1 runs already done" in m for m in said), said
    assert run_state(run.dir, run.key) == "done" and changed_source(run.dir, run.key) is None
    src.write_bytes(b"network B, another checkpoint at the same path")
    new = Run(tmp_path / "ft", "finetune-digits", [("finetune.init_from", str(src))], "ft s0", "final").key
    assert new != key
    assert "has changed since the run finished" in changed_source(run.dir, new)
    assert run_state(run.dir, new) == "fresh"


def _finetune_config(monkeypatch, argv: list[str]) -> dict:
    """The config ``repsim finetune --preset finetune-digits --init-from x.pt ARGV`` hands the protocol
    (its ``tune`` replaced by one that only builds the config; no source checkpoint is read)."""
    import argparse

    import repsim.train.finetune_cli as fc
    import repsim.train.tune as tu
    from repsim.train.config import load_config

    seen = {}

    def fake_tune(*, preset, base_sets, **kw):
        seen["cfg"] = load_config(preset, [f"{k}={tu.toml_literal(v)}" for k, v in base_sets])
        return []

    monkeypatch.setattr(tu, "tune", fake_tune)
    monkeypatch.setattr(fc, "source_groups", lambda patterns: ([], []))
    parser = argparse.ArgumentParser()
    fc.configure(parser)
    fc.run(parser.parse_args(["--preset", "finetune-digits", "--init-from", "x.pt", "--device", "cpu", *argv]))
    return seen["cfg"]


def test_finetune_grid_rates_are_the_rates_used_at_any_batch_size(tmp_path, monkeypatch, capsys):
    # A.3's grid: with --set batch_size different from optim.ref_batch the grid's learning rates were
    # scaled by batch/ref_batch while λ was divided by the unscaled rate and finetune.csv reported the grid
    # value; now the runs set ref_batch to the batch size, so η (grid) is the peak rate and η·(λ/η) = λ
    cfg = _finetune_config(monkeypatch, ["--out", str(tmp_path / "o"), "--set", "batch_size=32"])
    assert cfg["batch_size"] == 32 and cfg["optim"]["ref_batch"] == 32  # peak lr = grid lr x 32/32
    assert "learning rates are used as given" in capsys.readouterr().out


def test_tune_options_reach_the_protocol(tmp_path, monkeypatch):
    """``repsim tune --select-on last --metric mean_per_class --keep-checkpoints``: the values the protocol
    (repsim.train.tune.tune) runs with (the slow test above runs best/mean_per_class/keep end to end)."""
    import repsim.train.tune as tu

    seen = {}

    def fake_tune(**kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(tu, "tune", fake_tune)
    assert main(["tune", "--preset", "digits-softmax-mixup", "--grid", "mixup.alpha=0.1,0.4", "--out", str(tmp_path),
                 "--select-on", "last", "--metric", "mean_per_class", "--keep-checkpoints", "--device", "cpu"]) == 0
    assert (seen["select_on"], seen["metric"], seen["keep_checkpoints"]) == ("last", "mean_per_class", True)
    assert seen["grid"] == [{"mixup.alpha": 0.1}, {"mixup.alpha": 0.4}]


def test_finetune_holdout_size_sets_the_grid_holdout_of_an_image_folder(tmp_path, monkeypatch):
    """``repsim finetune --data FOLDER --holdout-size 3``: the runs' config holds data.holdout_size = 3 and
    the holdout the grid is scored on (checked before training) has 3 images."""
    from PIL import Image

    from repsim.train.data import dataset_from_config

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "data" / "train" / c).mkdir(parents=True)
        for i in range(5):
            img = Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8))
            img.save(tmp_path / "data" / "train" / c / f"{i}.png")
    cfg = _finetune_config(monkeypatch, ["--out", str(tmp_path / "o"), "--data", str(tmp_path / "data"),
                                         "--holdout-size", "3", "--set", "data.image_size=8"])
    assert cfg["data"]["holdout_size"] == 3 and cfg["data"]["spec"] == str(tmp_path / "data")
    assert len(dataset_from_config(cfg, "holdout")) == 3 and len(dataset_from_config(cfg, "train")) == 7
