"""--resume after a kill anywhere, with data workers, into an empty --out, with a longer cosine schedule
or another number of processes, and the files a kill inside a save leaves (audit of repsim/train/, F1-F4, F7-F9).
Tiny digits runs (the SMALL recipe of test_train_loop), 2 epochs."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

import repsim.train.loop as loop
from repsim.study.runs import best_epoch, holdout_curve
from repsim.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from repsim.train.config import load_config
from repsim.train.loop import sample_seed, train_run

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["arch=\"mini_resnet14\"", "arch_params.width=4", "epochs=2", "batch_size=32", "optim.ref_batch=32",
         "schedule.warmup_epochs=1", "deterministic=true"]
# digits-dropout: the digits shift augmentation (per example) and dropout (the training process's generator)
PRESET = "digits-dropout"
TIMING = ("train_seconds", "images_per_second")


def _cfg(*extra, preset=PRESET):
    return load_config(preset, SMALL + list(extra))


def _run(cfg, out, **kw):
    return train_run(cfg, out, progress=False, log=lambda s: None, **kw)


def _same_run(a: Path, b: Path, name: str = "checkpoint.pt") -> None:
    x, y = load_checkpoint(a / name), load_checkpoint(b / name)
    assert x["epoch"] == y["epoch"] and x["scheduler"]["step"] == y["scheduler"]["step"]
    for key in ("model", "ema"):
        for k in x[key]:
            assert torch.equal(x[key][k], y[key][k]), (name, key, k)
    assert torch.equal(x["rng"][0]["torch"], y["rng"][0]["torch"])
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING} for m in ms]  # noqa: E731
    assert strip(x["metrics"]) == strip(y["metrics"])


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run (workers=0), and its epoch-1 checkpoint."""
    out = tmp_path_factory.mktemp("full")
    metrics = _run(_cfg(), out)
    assert best_epoch(holdout_curve(metrics)) == 2  # the tests below kill the run while it saves a best.pt
    part = tmp_path_factory.mktemp("part")
    _run(_cfg(), part, stop_after_epoch=1)
    return out, part


def test_sample_seeds_depend_on_seed_epoch_and_index_only():
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(200)}
    assert len(seeds) == 3 * 3 * 200 and all(0 <= v < 2**63 for v in seeds)
    # nothing else: another process (another hash seed, nothing run before it) draws the same seeds
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from repsim.train.loop import sample_seed; "
            "print(json.dumps([sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(200)]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(200)]
    # and every input matters: neighbouring seeds, epochs and indices give unrelated values (about half
    # of the 63 bits differ, as for a hash; a seed that ignored one input would differ in none)
    flips = [bin(sample_seed(1, 2, 3) ^ v).count("1") for v in (sample_seed(2, 2, 3), sample_seed(1, 3, 3),
                                                                 sample_seed(1, 2, 4))]
    assert all(16 <= f <= 48 for f in flips), flips


def test_a_kill_while_best_pt_is_written_redoes_the_epoch(tmp_path, monkeypatch, full):
    """F1: checkpoint.pt used to be committed before best.pt and metrics.*; a kill (or a full disk) in
    between left best.pt and metrics.csv an epoch behind, and --resume, trusting checkpoint.pt, trained
    nothing. Now checkpoint.pt is written last, so the resume redoes that epoch."""
    out = tmp_path / "run"
    shutil.copytree(full[1], out)
    real = loop.save_checkpoint

    def disk_full_at_best(state, path):
        if Path(path).name == "best.pt" and state["epoch"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(state, path)

    monkeypatch.setattr(loop, "save_checkpoint", disk_full_at_best)
    with pytest.raises(OSError, match="No space left"):
        _run(_cfg(), out, resume=True)
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1  # --resume still starts before epoch 2
    monkeypatch.setattr(loop, "save_checkpoint", real)
    _run(_cfg(), out, resume=True)
    for name in ("checkpoint.pt", "best.pt"):
        _same_run(full[0], out, name)
    assert [r["epoch"] for r in _rows(out)] == [1, 2]
    assert (out / "metrics.csv").read_text().count("\n") == 3


def test_resume_repairs_best_pt_and_metrics_left_behind_by_an_older_repsim(tmp_path, full):
    """F1: a run directory as the old order left it (checkpoint.pt of epoch 2, best.pt and metrics of
    epoch 1): --resume rewrites the metrics files and best.pt from the checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(full[0], out)
    shutil.copyfile(full[1] / "best.pt", out / "best.pt")
    shutil.copyfile(full[1] / "metrics.jsonl", out / "metrics.jsonl")
    shutil.copyfile(full[1] / "metrics.csv", out / "metrics.csv")
    assert load_checkpoint(out / "best.pt")["epoch"] == 1
    _run(_cfg(), out, resume=True)
    _same_run(full[0], out, "best.pt")
    assert (out / "metrics.jsonl").read_text() == (full[0] / "metrics.jsonl").read_text()
    assert (out / "metrics.csv").read_text() == (full[0] / "metrics.csv").read_text()


def test_resume_removes_the_temporaries_of_a_save_killed_midway(tmp_path, full):
    """F7: save_checkpoint cleans up after Python exceptions only; SIGKILL left .checkpoint.pt.XXXX.tmp
    (half a checkpoint, hundreds of MB at ResNet-50 scale) for good."""
    out = tmp_path / "run"
    shutil.copytree(full[1], out)
    stale = [".checkpoint.pt.k2j4l1.tmp", ".best.pt.abcd12.tmp", ".epoch-0002.pt.tmp", ".checkpoint.pt.tmp",
             "metrics.csv.tmp-4242"]
    for name in stale:
        (out / name).write_bytes(b"half a checkpoint")
    (out / "notes.tmp").write_text("not ours")
    _run(_cfg(), out, resume=True)
    assert sorted(p.name for p in out.iterdir() if "tmp" in p.name) == ["notes.tmp"]


def test_resume_with_data_workers_is_the_uninterrupted_run_whatever_the_worker_count(tmp_path, full):
    """F2: with data.workers > 0 the augmentations came from persistent workers' generators, seeded once
    from the training process's and never checkpointed: a resumed run differed in every weight. Now they
    are seeded per example from (seed, epoch, index): 1 worker, killed after epoch 1, resumed with 2
    (data.workers may change on --resume) is the uninterrupted run without workers, bit for bit."""
    out = tmp_path / "w"
    _run(_cfg("data.workers=1"), out, stop_after_epoch=1)
    _same_run(full[1], out)
    _run(_cfg("data.workers=2"), out, resume=True)
    _same_run(full[0], out)


def test_resume_into_an_empty_out_is_a_fresh_start(tmp_path, full):
    """F3: --resume with no checkpoint skipped the per-rank seeding, so a job script that always passes
    --resume did not reproduce a plain run."""
    _run(_cfg(), tmp_path / "r", resume=True)
    _same_run(full[0], tmp_path / "r")


def test_a_longer_cosine_schedule_is_refused_on_resume(tmp_path):
    """F4: epochs/max_steps may change on --resume, but under cosine they set the curve of the steps to
    come: a 1-epoch cosine run resumed for 2 epochs restarted from an annealed LR (a warm restart)."""
    out = tmp_path / "cos"
    cfg = _cfg('schedule.name="cosine"', "epochs=1", "eval_every=1", preset="digits-softmax")
    _run(cfg, out)
    with pytest.raises(CheckpointError, match=r"anneals a cosine schedule over 18 steps, this run over 36 \(epochs=2, "
                                              r"max_steps=0\).*resume with the run's epochs and max_steps"):
        _run(_cfg('schedule.name="cosine"', "epochs=2", preset="digits-softmax"), out, resume=True)
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] == 1
    _run(cfg, out, resume=True)  # the same length resumes (nothing left to train)


def test_resume_with_another_number_of_processes_is_refused(tmp_path, full):
    """F9: a 2-process checkpoint resumed by 1 process (or the reverse) changed the per-process BatchNorm
    batch and the random streams mid-run, silently."""
    out = tmp_path / "run"
    shutil.copytree(full[1], out)
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck.get("world_size", 1) == 1
    save_checkpoint({**ck, "world_size": 2, "rng": ck["rng"] * 2}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"trained by 2 process\(es\), this run has 1.*--nproc_per_node=2"):
        _run(_cfg(), out, resume=True)
    del ck["world_size"]  # a checkpoint from before world_size was stored: one RNG state per process
    save_checkpoint({**ck, "rng": ck["rng"] * 2}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"trained by 2 process\(es\)"):
        _run(_cfg(), out, resume=True)


DUMP = """import sys, torch
import repsim.train.loop as L
_eval = L.evaluate
def evaluate(net, dataset, **kw):
    out = sys.argv[sys.argv.index("--out") + 1]
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, f"{out}/../eval-net-rank{kw['rank']}.pt")
    return _eval(net, dataset, **kw)
L.evaluate = evaluate
from repsim.commands.main import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def _torchrun_train(out: Path, *extra: str, dump: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m repsim.train`` (gloo on the CPU) of the SMALL digits-dropout recipe;
    once more after the rare gloo abort that test_train_loop's DDP test documents (a real failure fails twice).
    ``dump``: through DUMP, each rank saving the network it evaluates beside ``out``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if dump:
        script = out.parent / "dump.py"
        script.write_text(DUMP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *([str(script)] if dump else ["-m", "repsim.train"]),
           "--preset", PRESET, "--out", str(out), "--no-progress", "--device", "cpu",
           *[a for s in SMALL for a in ("--set", s)], *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        if "--resume" not in extra:  # a first run starts over; a resume resumes from the same checkpoint again
            shutil.rmtree(out, ignore_errors=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow  # three 2-process torchrun runs
def test_a_two_process_ddp_run_resumed_equals_the_uninterrupted_one(tmp_path):
    """A real 2-process torchrun (gloo) run stopped after epoch 1 and resumed by torchrun with --resume is the
    uninterrupted 2-process run, bit for bit: weights, EMA, both ranks' random states, scheduler and metrics
    (the per-rank RNG states and the sampler's epoch are restored on each rank; the checkpoint records
    world_size 2). Faking world_size in one process (above) only checks the refusal.

    F8, on the stopped run: each rank's EMA averaged its own BatchNorm statistics, so rank 1 evaluated its
    half of the holdout/test sets with a network that was never saved. Now rank 0's buffers are broadcast
    first: each rank dumps the network it evaluates (DUMP), and both equal the checkpoint's EMA."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    _torchrun_train(whole)
    _torchrun_train(part, "--stop-after-epoch", "1", dump=True)
    stopped = load_checkpoint(part / "checkpoint.pt")
    assert stopped["epoch"] == 1 and stopped["world_size"] == 2 and len(stopped["rng"]) == 2
    for rank in (0, 1):
        got = torch.load(tmp_path / f"eval-net-rank{rank}.pt")
        assert got.keys() == stopped["ema"].keys()
        for k, v in stopped["ema"].items():
            assert torch.equal(got[k], v), (rank, k)
    _torchrun_train(part, "--resume")
    x, y = load_checkpoint(whole / "checkpoint.pt"), load_checkpoint(part / "checkpoint.pt")
    assert x["world_size"] == y["world_size"] == 2
    _same_run(whole, part)
    for a, b in zip(x["rng"], y["rng"]):  # every rank's generator, not only rank 0's
        assert torch.equal(a["torch"], b["torch"])
    for sa, sb in zip(x["optimizer"]["state"].values(), y["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
