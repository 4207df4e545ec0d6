"""`repsim demo` orchestration smoke test: 2 objectives × 1 seed × 1 epoch on real digits, real
training and extraction subprocesses, real stores; then a rerun that reuses everything."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # training and extraction need the [torch] extra


def _demo(out, *extra):
    cmd = [sys.executable, "-m", "repsim", "demo", "--out", str(out), "--objectives", "softmax", "sigmoid",
           "--num-seeds", "1", "--epochs", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a hang guard; ~100 s on an idle 2-core box


@pytest.mark.slow
def test_demo_smoke_and_rerun(tmp_path):
    out = tmp_path / "demo"
    first = _demo(out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for f in ("training.csv", "similarity_demo.npz", "separation.csv", "sparsity.csv", "collapse.csv", "probes.csv",
              "spectra.npz", "accuracy.csv", "calibration.csv", "pixels.csv"):
        assert (out / "results" / f).stat().st_size > 0, f
    report = (out / "report" / "report.html").read_text()
    assert "Does this run reproduce the paper's findings?" in report
    for item in ("fig6", "tableC3"):  # Fig. 6 by the paper's protocol (`repsim probe --relearn`), calibration
        assert f"<h2 id='{item}'>" in report, item
    assert "on the held-out examples of probes.csv" in report
    findings = (out / "report" / "findings.md").read_text().splitlines()
    verdicts = [line for line in findings if line.startswith("## ")]
    assert len(verdicts) == 3 and all(": " in line for line in verdicts)
    for v in verdicts:  # the log gives each verdict line, and says where the rest is
        assert f"- {v[3:]}" in first.stdout
    assert "findings (each with its conditions, intervals and evidence in " in first.stdout
    closing = findings[-1] if findings[-1].startswith("This run reproduces") else ""
    if closing:  # the fresh run's log prints the sentence, as the rerun's does; 1 epoch saturates nothing
        assert closing in first.stdout and "saturates" not in closing and "after 1 epoch (--epochs)" in closing
    assert re.search(r"^\[demo\] train [12]/2 softmax-s0: epoch 1/1 ", first.stdout, re.M)  # one line per network
    assert "epoch 1/1" in (out / "runs" / "softmax-s0" / "train.log").read_text()  # the network's own output
    # every line of the log is the demo's own (the commands' per-store lines go to results/*.log)
    stray = [ln for ln in first.stdout.splitlines()
             if ln.strip() and not ln.startswith(("[demo]", "[figures]", "- ", "This run"))]
    assert not stray, stray[:5]
    assert (out / "results" / "probes.log").read_text().count("top1") >= 2
    stores = sorted(p.name for p in (out / "stores").glob("*/*.zarr"))
    assert len(stores) == 2 * 5 and "softmax-s0-src-test.zarr" in stores
    fps = json.loads((out / "results" / "fingerprints.json").read_text())
    # the permutation null (issue 44): linear and RBF CKA with K draws in similarity_demo.npz, the other
    # measures without one beside it; both files are the step's outputs, which the reuse check covers
    from repsim import load_result

    from repsim.analyses.profiles import DIGITS

    sim = load_result(out / "results" / "similarity_demo.npz")
    assert sim.measures == ["linear_cka", "rbf_cka"]
    assert sim.null("linear_cka").shape[0] == DIGITS.permutations and sim.calibrated("rbf_cka").shape == (34, 34)
    assert load_result(out / "results" / "similarity_demo_nonull.npz").measures == ["procrustes", "mutual_knn"]
    assert set(fps["_outputs"]["similarity_demo.npz"]) == {"similarity_demo.npz", "similarity_demo_nonull.npz"}
    for item in ("fig2a_calibrated", "fig2b_calibrated"):  # (finding 2 needs 2 seeds: not evaluated here)
        assert f"<h2 id='{item}'>" in report, item

    second = _demo(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "2 of 2 networks already trained" in second.stdout
    assert "10 of 10 stores already complete" in second.stdout
    assert second.stdout.count("up to date") == 8  # seven results steps (pixels.csv: the pixel baseline) and the report
    assert json.loads((out / "results" / "fingerprints.json").read_text()) == fps

    # a reused output deleted or truncated since it was written (the reuse key checked only a fingerprint
    # and that one file existed: "up to date", then the report rebuild exited 70)
    (out / "results" / "collapse.csv").unlink()
    npz = out / "results" / "similarity_demo_nonull.npz"  # the step's second output (the measures without a null)
    npz.write_bytes(npz.read_bytes()[:300])
    third = _demo(out)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "separation.csv: collapse.csv changed or missing since it was written; recomputing" in third.stdout
    assert "similarity_demo.npz: similarity_demo_nonull.npz changed or missing since it was written" in third.stdout
    assert load_result(npz).measures == ["procrustes", "mutual_knn"]
    assert third.stdout.count("up to date") == 5  # the other five results steps; the report is rebuilt
    assert (out / "results" / "collapse.csv").stat().st_size > 0


def test_the_demo_train_stage_trains_as_a_network_s_own_process_does(tmp_path):
    """`python -m repsim.analyses.command_runs --jobs 2` with `repsim train` commands (the demo's train stage): two
    forked workers, each network's output in its log, checkpoints bitwise equal to `repsim train` in a
    process of its own; a failing network's status, name and the end of its log on stderr."""
    import os
    from pathlib import Path

    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def train(preset, out):
        return ["train", "--preset", preset, "--seed", "1", "--out", str(out), "--no-progress",
                "--set", "epochs=2"]

    nets = [{"name": p, "commands": [train(f"digits-{p}", tmp_path / "forked" / p)],
             "log": str(tmp_path / f"{p}.log")} for p in ("softmax", "sigmoid")]
    run = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", "--jobs", "2", json.dumps(nets)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    items = [json.loads(ln[len("@@item "):]) for ln in run.stdout.splitlines() if ln.startswith("@@item ")]
    assert sorted(i["name"] for i in items) == ["sigmoid", "softmax"] and all(i["seconds"] > 0 for i in items)
    assert "epoch" not in run.stdout  # the networks' lines went to their logs
    assert all("epoch 2/2" in (tmp_path / f"{p}.log").read_text() for p in ("softmax", "sigmoid"))
    alone = subprocess.run([sys.executable, "-m", "repsim", *train("digits-sigmoid", tmp_path / "alone")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-2000:]
    for f in ("checkpoint.pt", "best.pt"):
        a = torch.load(tmp_path / "forked" / "sigmoid" / f, map_location="cpu", weights_only=False)
        b = torch.load(tmp_path / "alone" / f, map_location="cpu", weights_only=False)
        sa, sb = a["model"], b["model"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), f

    good = {"name": "softmax", "commands": [train("digits-softmax", tmp_path / "again")],  # a new --out: it succeeds
            "log": str(tmp_path / "again.log")}
    bad = [good, {"name": "broken", "commands": [train("digits-nonexistent", tmp_path / "bad")],
                  "log": str(tmp_path / "broken.log")}]
    fail = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", "--jobs", "2", json.dumps(bad)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert fail.returncode == 2, fail.stderr[-2000:]
    assert "command_runs: broken failed (exit 2); the end of" in fail.stderr and "nonexistent" in fail.stderr


def test_fresh_removes_only_the_demo_outputs(tmp_path):
    from repsim.analyses.pipeline import fresh

    for sub in ("runs/a", "stores/b", "results", "report", "mine"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "f").write_text("x")
    (tmp_path / "timings.json").write_text("{}")
    fresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_dynamics_checkpoints_stop_before_the_analysed_epoch(tmp_path):
    """Figs. D.2/E.4 in the demo: the seed-0 runs' kept checkpoints before best.pt's epoch."""
    from repsim.analyses.pipeline import Demo

    demo = Demo(tmp_path, ("softmax",), seeds=2)
    for seed in (0, 1):
        d = demo.run_dir(f"softmax-s{seed}")
        d.mkdir(parents=True)
        rows = ["epoch,holdout_top1"] + [f"{e},{h}" for e, h in ((1, 70), (2, 80), (3, 90), (4, 90))]
        (d / "metrics.csv").write_text("\n".join(rows) + "\n")
        for f in ("best.pt", "epoch-0001.pt", "epoch-0002.pt", "epoch-0003.pt", "epoch-0004.pt"):
            (d / f).write_bytes(b"")
    got = demo.dynamics_checkpoints()
    assert [n for n, _ in got] == ["softmax-s0-epoch-0001", "softmax-s0-epoch-0002"]  # best epoch 3 (first max)
    assert demo.group_paths("dyn-src-train")[0].endswith("dyn-src-train/softmax-s0-epoch-0001-dyn-src-train.zarr")
    assert set(demo.dynamics_groups) == {"dyn-src-train", "dyn-src-test", "dyn-tgt-train", "dyn-tgt-test"}


def test_digits_extracts_every_block_of_the_training_split_and_separation_has_them(tmp_path):
    """Fig. 4 on the training set (the paper's): the digits profile extracts every block of src-train, a
    penultimate-only src-train store from before is rewritten, and separation.csv holds cosine R² of
    every block the training stores hold (beside all three distances at pool)."""
    import numpy as np
    import pandas as pd

    from repsim.analyses.demo_analysis import layer_metrics
    from repsim.analyses.pipeline import Demo
    from repsim.analyses.profiles import DIGITS, FASHION
    from repsim import save_store

    assert DIGITS.groups["src-train"][2] is None and FASHION.groups["src-train"][2] == "pool"
    rng = np.random.default_rng(0)
    y = np.arange(30) % 3
    shapes = {"block1": (2, 2, 2), "block2": (4,), "pool": (4,)}
    paths = {}
    for split, layers in (("test", shapes), ("train", shapes), ("old", {"pool": (4,)})):
        p = tmp_path / f"softmax-s0-{split}.zarr"
        save_store(p, {l: rng.normal(size=(30,) + sh).astype(np.float32) for l, sh in layers.items()}, y,
                   logits=rng.normal(size=(30, 3)).astype(np.float32),
                   meta={"model": {"objective": "softmax", "seed": 0},
                         "dataset": {"name": "digits-source", "split": "test" if split == "test" else "train"}})
        paths[split] = str(p)
    demo = Demo(tmp_path / "demo", ("softmax",), seeds=1)
    ckpt = tmp_path / "best.pt"
    ckpt.write_bytes(b"")
    import os
    os.utime(ckpt, (0, 0))
    assert not demo._store_ok(tmp_path / "softmax-s0-old.zarr", ckpt, demo.groups["src-train"][2])
    assert demo._store_ok(tmp_path / "softmax-s0-train.zarr", ckpt, demo.groups["src-train"][2])
    assert demo._store_ok(tmp_path / "softmax-s0-old.zarr", ckpt, "pool")
    res = tmp_path / "results"
    res.mkdir()
    layer_metrics([paths["test"]], [paths["train"]], res)
    sep = pd.read_csv(res / "separation.csv")
    train = sep[sep.store == "softmax-s0-train"]
    assert set(train[train.distance == "cosine"].layer) == {"block1", "block2", "pool"}
    assert set(train[train.layer == "pool"].distance) == {"cosine", "cosine_centered", "sqeuclidean"}


def test_an_item_line_that_a_workers_long_write_was_cut_by_is_still_read():
    """The fashion demo test lost "extract 2/2" once under load: a worker's write longer than the pipe's
    atomic size was cut by the @@item line, which then ended a line instead of starting it."""
    from repsim.analyses.command_runs import ITEM
    from repsim.analyses.pipeline import split_item

    assert split_item(ITEM + '{"name": "a"}') == ("", '{"name": "a"}')
    assert split_item("estimated store size 1.2 M" + ITEM + '{"name": "b"}') == ("estimated store size 1.2 M",
                                                                                 '{"name": "b"}')
    assert split_item("a plain line") == ("a plain line", None)
    assert split_item("   ") == ("", None)


def test_run_stage_verbose_streams_the_stage_lines_and_a_failure_names_its_network(tmp_path, capsys):
    """run_stage (the demo's train/extract stages) with verbose=True (`repsim demo --verbose`): every line
    the stage's process prints that is not a network's @@item line is echoed as "  [STAGE] ..."; a failing
    network ends the stage in DemoError with the process's last lines, naming the network."""
    from repsim.analyses.pipeline import DemoError, run_stage

    broken = {"name": "broken", "commands": [["train", "--preset", "digits-nonexistent", "--out", str(tmp_path / "b"),
                                              "--no-progress"]], "log": str(tmp_path / "broken.log")}
    with pytest.raises(DemoError, match="train failed .exit 2.") as err:
        run_stage("train", [broken], 1, item=lambda info: info["name"], verbose=True)
    out = capsys.readouterr().out
    assert "  [train] command_runs: broken failed (exit 2)" in out, out
    assert "nonexistent" in out and "nonexistent" in str(err.value)  # the log's tail: the command's own error
    # (without --verbose none of these lines is printed: test_demo_smoke_and_rerun's log has only [demo] lines)
