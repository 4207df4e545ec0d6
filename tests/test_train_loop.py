"""The training loop: LR schedule and EMA formulas, exact resume, DDP (2 gloo processes) equals one
process, load_model, metrics files, and one-line CLI errors."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

from repsim.commands.main import main
from repsim.train import load_model
from repsim.train.checkpoint import load_checkpoint
from repsim.train.config import load_config
from repsim.study.runs import best_epoch, holdout_curve
from repsim.train.loop import EMA, lr_at, train_run
from repsim.train.models import Network

ROOT = Path(__file__).resolve().parents[1]
# a small, fast variant of the demo preset: 4 blocks of width 4, 2 epochs
SMALL = ["arch=\"mini_resnet14\"", "arch_params.width=4", "epochs=2", "batch_size=32", "optim.ref_batch=32",
         "schedule.warmup_epochs=1", "deterministic=true"]


def _cfg(preset="digits-softmax", extra=()):
    return load_config(preset, SMALL + list(extra))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    metrics = train_run(_cfg("digits-sigmoid"), out, progress=False, log=lambda s: None)
    return out, metrics


def test_lr_schedule_warmup_then_exponential_and_cosine():
    kw = dict(peak=1.6, steps_per_epoch=10, total_steps=1000, warmup_epochs=10, decay=0.975)
    assert lr_at(0, name="exponential", **kw) == pytest.approx(1.6 / 100)
    assert lr_at(99, name="exponential", **kw) == pytest.approx(1.6)
    assert lr_at(100, name="exponential", **kw) == pytest.approx(1.6)
    assert lr_at(110, name="exponential", **kw) == pytest.approx(1.6 * 0.975)      # ×0.975 per epoch
    assert lr_at(150, name="exponential", **kw) == pytest.approx(1.6 * 0.975**5)
    cos = dict(kw, warmup_epochs=0)
    assert lr_at(0, name="cosine", **cos) == pytest.approx(1.6)
    assert lr_at(500, name="cosine", **cos) == pytest.approx(0.8)
    assert lr_at(1000, name="cosine", **cos) == pytest.approx(0.0, abs=1e-12)
    # linear scaling with batch size is applied by the loop: peak = lr · batch / ref_batch
    cfg = load_config("resnet50-imagenet-softmax", ["batch_size=1024"])
    assert cfg["optim"]["lr"] * cfg["batch_size"] / cfg["optim"]["ref_batch"] == pytest.approx(0.4)


def test_ema_formula_with_tf_warmup():
    m = torch.nn.BatchNorm1d(3)
    ema = EMA(m, decay=0.9, warmup=True)
    ref_w = m.weight.detach().clone()
    ref_rm = m.running_mean.clone()
    for t in range(30):
        with torch.no_grad():
            m.weight.add_(1.0)
            m.running_mean.add_(2.0)
        m.num_batches_tracked += 1
        ema.update(m, t)
        d = min(0.9, (1 + t) / (10 + t))
        ref_w = d * ref_w + (1 - d) * m.weight.detach()
        ref_rm = d * ref_rm + (1 - d) * m.running_mean
    assert torch.allclose(ema.module.weight, ref_w) and torch.allclose(ema.module.running_mean, ref_rm)
    assert ema.module.num_batches_tracked == 30 and not ema.module.training


def test_run_writes_checkpoint_metrics_and_load_model(trained):
    out, metrics = trained
    assert [m["epoch"] for m in metrics] == [1, 2]
    for key in ("train_loss", "train_top1", "holdout_top1", "holdout_top5", "test_top1", "test_top5", "lr"):
        assert key in metrics[-1] and math.isfinite(metrics[-1][key])
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2]
    assert (out / "metrics.csv").read_text().splitlines()[0].startswith("epoch,step,lr,train_loss")
    ck = load_checkpoint(out / "checkpoint.pt")
    assert {"config", "model", "ema", "optimizer", "scheduler", "scaler", "rng", "epoch", "metrics"} <= set(ck)
    assert ck["epoch"] == 2 and ck["config"]["num_classes"] == 5 and ck["config"]["arch"] == "mini_resnet14"
    assert ck["config"]["dataset"]["spec"] == "digits-source" and ck["config"]["objective"] == "sigmoid"
    # channels_last = "auto": a conv net trains in NHWC memory on the CPU too (its saved conv weights keep it)
    conv = [v for k, v in ck["model"].items() if v.ndim == 4 and v.shape[1] > 1 and v.shape[-1] > 1]
    assert conv and all(v.is_contiguous(memory_format=torch.channels_last) and not v.is_contiguous() for v in conv)
    net = load_model(out / "checkpoint.pt")
    assert isinstance(net, Network) and not net.training and net.objective == "sigmoid"
    for k, v in net.state_dict().items():
        assert torch.equal(v, ck["ema"][k])  # EMA weights
    x = torch.randn(4, 1, 8, 8)
    assert torch.allclose(net(x), net.head(net.backbone(x))) and net(x).shape == (4, 5)
    assert list(net.backbone.layer1) and isinstance(net.backbone.fc, torch.nn.Identity)
    assert (out / "best.pt").exists() and not list(out.glob(".*.tmp"))
    # best.pt is the epoch of the one early-stopping rule (repsim.study.runs, which `repsim runs` and tune read)
    assert load_checkpoint(out / "best.pt")["epoch"] == best_epoch(holdout_curve(metrics))


def test_resume_after_kill_gives_identical_weights(tmp_path, trained):
    """Uninterrupted 2 epochs == 1 epoch, 'killed', then --resume for epoch 2 (bitwise, deterministic)."""
    full, _ = trained
    cfg = _cfg("digits-sigmoid")
    part = tmp_path / "part"
    train_run(cfg, part, progress=False, stop_after_epoch=1, log=lambda s: None)
    assert load_checkpoint(part / "checkpoint.pt")["epoch"] == 1
    train_run(cfg, part, resume=True, progress=False, log=lambda s: None)
    a, b = load_checkpoint(full / "checkpoint.pt"), load_checkpoint(part / "checkpoint.pt")
    assert b["epoch"] == 2
    for key in ("model", "ema"):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ("train_seconds", "images_per_second")} for m in ms]
    assert strip(a["metrics"]) == strip(b["metrics"])


def test_dropout_and_augmentation_resume_exactly(tmp_path):
    cfg = _cfg("digits-dropout", ["epochs=2"])
    train_run(cfg, tmp_path / "a", progress=False, log=lambda s: None)
    train_run(cfg, tmp_path / "b", progress=False, stop_after_epoch=1, log=lambda s: None)
    train_run(cfg, tmp_path / "b", resume=True, progress=False, log=lambda s: None)
    a, b = (load_checkpoint(tmp_path / d / "checkpoint.pt")["model"] for d in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # two gloo processes and one more run
def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    """Global batch 32: 2 processes × 16 (torchrun, gloo) vs 1 × 32. BatchNorm is frozen
    (``freeze_bn``): with per-process BN statistics, 2 × 16 is ghost-batch BN, a different function
    from BN over 32 (SyncBatchNorm does not run on CPU), so equality is only expected with BN fixed.
    Everything else — sampler sharding, gradient all-reduce, EMA, LR schedule, and the digits shift
    augmentation (seeded per example, so the same in any number of processes; before, per-rank
    streams made the weights differ by 3.25 relative) — is exercised. Tolerance: float32 summation
    order differs; measured max |Δw|/(1+max|w|) = 1.2e-7 after 36 steps without augmentation
    (without freeze_bn it is 0.9), asserted < 1e-5."""
    sets = SMALL + ["freeze_bn=true", "eval_every=1"]
    ref = tmp_path / "one"
    train_run(load_config("digits-softmax", sets), ref, progress=False, log=lambda s: None, device="cpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "repsim.train",
           "--preset", "digits-softmax", "--out", str(tmp_path / "two"), "--no-progress", "--device", "cpu"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    if r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        # seen once in ~15 runs on a loaded 2-core box (2026-11-26): a gloo rank aborted inside torch's C++
        # (SIGABRT) mid-run, not reproduced in 14 reruns; one fresh rerun (it starts over: no --resume), so
        # a wrong result or any other failure still fails the test
        shutil.rmtree(tmp_path / "two", ignore_errors=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_checkpoint(ref / "checkpoint.pt"), load_checkpoint(tmp_path / "two" / "checkpoint.pt")
    assert a["scheduler"]["step"] == b["scheduler"]["step"] == 2 * (576 // 32)
    assert len(b["rng"]) == 2
    for key in ("model", "ema"):
        for k, v in a[key].items():
            if v.dtype.is_floating_point:
                torch.testing.assert_close(b[key][k], v, rtol=1e-5, atol=1e-5, msg=f"{key}/{k}")
    for split in ("train_loss", "test_top1", "holdout_top1"):
        assert b["metrics"][-1][split] == pytest.approx(a["metrics"][-1][split], rel=1e-3, abs=0.5)


def _cli(capsys, *argv):
    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("argv,match", [
    (["--preset", "digits-softmaxx"], "unknown preset 'digits-softmaxx'"),
    (["--preset", "digits-softmax", "--objective", "softmaxx"], "unknown objective 'softmaxx'"),
    (["--preset", "digits-softmax", "--set", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["--preset", "digits-softmax", "--set", "objective_params.tauu=1"], "unknown hyperparameter(s) tauu"),
    (["--preset", "resnet50-imagenet-softmax", "--data", "/no/such/imagenet"], "does not exist"),
    (["--preset", "digits-softmax", "--set", "batch_size=-8"], "config key 'batch_size' must be >= 1, got -8"),
    (["--preset", "digits-softmax", "--set", "optim.lr=0"], "config key 'optim.lr' must be > 0"),
])
def test_cli_bad_input_one_line_error(capsys, tmp_path, argv, match):
    rc, err = _cli(capsys, *argv, "--out", str(tmp_path / "o"), "--no-progress")
    assert rc != 0 and len(err) == 1 and match in err[0] and err[0].startswith("repsim train: error:"), err


def test_load_model_takes_the_checkpoint_tensors_without_running_the_initialisers(trained):
    """The network is built on the meta device and adopts the checkpoint's tensors: no random draws
    (the initialisers never ran), no meta tensor left, the same outputs as the ordinary build + copy."""
    from repsim.train.checkpoint import network_from_checkpoint
    from repsim.train.models import build_network

    ck = load_checkpoint(trained[0] / "checkpoint.pt")
    torch.manual_seed(0)
    net = network_from_checkpoint(ck, "c")
    drawn_after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(drawn_after, torch.rand(3))  # an initialiser would have advanced the generator
    assert all(t.device.type == "cpu" for t in (*net.parameters(), *net.buffers()))
    ordinary = build_network(ck["config"])
    ordinary.load_state_dict(ck["ema"])
    x = torch.randn(6, 1, 8, 8)
    assert torch.allclose(net(x), ordinary.eval()(x), atol=1e-5)


def test_the_meta_build_skips_the_initialisers_values_and_imports_no_dynamo(trained):
    """On the meta device the initialisers' value ops (normal_, fill_, ...) return the tensor untouched
    (_NoValuesOnMeta; CPU tensors are still drawn), the network has the ordinary build's shapes, and a
    process that loads a checkpoint never imports torch._dynamo (the meta normal_'s Python reference
    imported it: ~2 s of every `repsim extract` of a repsim network)."""
    import subprocess
    import sys

    from repsim.train.checkpoint import _NoValuesOnMeta
    from repsim.train.models import build_network

    ck = load_checkpoint(trained[0] / "checkpoint.pt")
    with torch.device("meta"), _NoValuesOnMeta():
        meta = build_network(ck["config"])
        cpu = torch.zeros(3, device="cpu").normal_()
    assert cpu.abs().sum() > 0  # (a real tensor keeps its values' ops)
    ordinary = build_network(ck["config"])
    assert [(k, v.shape, v.dtype) for k, v in meta.state_dict().items()] == \
        [(k, v.shape, v.dtype) for k, v in ordinary.state_dict().items()]
    code = ("import sys; from repsim.train.checkpoint import load_model; load_model(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code, str(trained[0] / "checkpoint.pt")], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0 and got.stdout.strip() == "False", got.stdout + got.stderr[-2000:]


@pytest.mark.parametrize("arch", ["resnet18", "inception_v3", "allcnn_c", "wrn16_8", "mini_resnet14"])
def test_every_architecture_loads_through_the_meta_build_to_the_same_outputs(arch):
    """Each architecture family (torchvision's ResNet and Inception with its truncated-normal init,
    All-CNN-C, the WRN, the mini ResNets) is rebuilt from a state dict on the meta device with its
    initialisers skipped, every tensor the checkpoint's, and computes bit for bit what the network it
    came from computes."""
    from repsim.train.checkpoint import network_from_checkpoint
    from repsim.train.config import load_config
    from repsim.train.models import build_network

    cfg = load_config(None, [f'arch="{arch}"', "arch_params={}", "in_channels=3", "num_classes=10",
                             'objective="cosine_softmax"', 'data.spec="synthetic"'])
    torch.manual_seed(0)
    net = build_network(cfg).eval()
    torch.manual_seed(1)
    got = network_from_checkpoint({"config": cfg, "model": net.state_dict(), "ema": {}}, arch)
    drawn_after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(drawn_after, torch.rand(3))  # the meta route: no initialiser drew (the ordinary one would)
    assert not any(t.is_meta for t in (*got.parameters(), *got.buffers()))
    size = 75 if arch == "inception_v3" else 32
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(got(x), net(x))


def test_load_model_falls_back_to_the_ordinary_build_when_the_state_does_not_fit(trained):
    from repsim.train.checkpoint import CheckpointError, network_from_checkpoint

    ck = load_checkpoint(trained[0] / "checkpoint.pt")
    # a float64 tensor: the ordinary route casts it into the float32 parameter
    key = next(k for k, v in ck["ema"].items() if v.is_floating_point())
    wide = {**ck, "ema": {**ck["ema"], key: ck["ema"][key].double()}}
    net = network_from_checkpoint(wide, "c")
    assert net.state_dict()[key].dtype == torch.float32 and torch.equal(net.state_dict()[key], ck["ema"][key])
    # a tensor missing: the same one-line error as before
    short = {**ck, "ema": {k: v for k, v in ck["ema"].items() if k != key}}
    with pytest.raises(CheckpointError, match="does not fit this architecture"):
        network_from_checkpoint(short, "c")


def test_load_checkpoint_mapped_equals_read_and_reads_legacy_files(trained, tmp_path):
    path = trained[0] / "checkpoint.pt"
    read, mapped = load_checkpoint(path), load_checkpoint(path, mmap=True)
    assert read["ema"].keys() == mapped["ema"].keys()
    assert all(torch.equal(read["ema"][k], mapped["ema"][k]) for k in read["ema"])
    legacy = tmp_path / "legacy.pt"  # torch's pre-zip format cannot be mapped: read instead
    torch.save({"config": read["config"], "model": read["model"]}, legacy, _use_new_zipfile_serialization=False)
    got = load_checkpoint(legacy, mmap=True)
    assert all(torch.equal(got["model"][k], read["model"][k]) for k in read["model"])


def test_cli_checkpoint_from_another_architecture(capsys, tmp_path, trained):
    ckpt = str(trained[0] / "checkpoint.pt")
    base = ["--preset", "finetune-digits", "--no-progress", "--set", "max_steps=2"]
    rc, err = _cli(capsys, *base, "--init-from", ckpt, "--out", str(tmp_path / "a"), "--set", "arch=\"mini_resnet26\"")
    assert rc != 0 and len(err) == 1 and "holds a mini_resnet14" in err[0], err
    rc, err = _cli(capsys, *base, "--init-from", ckpt, "--out", str(tmp_path / "b"), "--set", "arch_params.width=8",
                   "--set", "arch=\"mini_resnet14\"")
    assert rc != 0 and len(err) == 1 and "mini_resnet14" in err[0], err
    # --resume into a run directory of another architecture / objective
    rc, err = _cli(capsys, "--preset", "digits-softmax", "--out", str(trained[0]), "--resume", "--no-progress")
    assert rc != 0 and len(err) == 1 and "other settings" in err[0] and "arch 'mini_resnet14' there, 'mini_resnet' here" in err[0], err
    # an existing run without --resume
    rc, err = _cli(capsys, "--preset", "digits-sigmoid", "--out", str(trained[0]), *sum([["--set", s] for s in SMALL], []))
    assert rc != 0 and len(err) == 1 and "--resume" in err[0]
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"not a checkpoint")
    rc, err = _cli(capsys, *base, "--init-from", str(bad), "--out", str(tmp_path / "c"))
    assert rc != 0 and len(err) == 1 and "not a readable repsim checkpoint" in err[0]


def test_resume_with_other_hyperparameters_is_refused_more_epochs_are_not(capsys, tmp_path, trained):
    """Issue 15, reproduction 5: ``--resume --set optim.lr=0.5`` used to continue silently, and config.json
    then claimed lr 0.5 for epochs that ran at 0.1."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    sets = [a for s in SMALL for a in ("--set", s)]
    base = ["--preset", "digits-sigmoid", "--out", str(run), "--resume", "--no-progress", *sets]
    rc, err = _cli(capsys, *base, "--set", "optim.lr=0.5", "--set", "optim.momentum=0.5")
    assert rc == 2 and len(err) == 1, err
    assert "was trained with other settings: optim.lr 0.1 there, 0.5 here; optim.momentum 0.9 there, 0.5 here" in err[0]
    assert load_checkpoint(run / "checkpoint.pt")["epoch"] == 2
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == 0.1
    # more epochs (and other resumable settings) continue the run
    rc, err = _cli(capsys, *base, "--set", "epochs=3", "--set", "threads=1", "--set", "eval_every=2")
    assert rc == 0, err
    assert load_checkpoint(run / "checkpoint.pt")["epoch"] == 3
    assert json.loads((run / "config.json").read_text())["epochs"] == 3


def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    import resource

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "repsim.train", "--preset", "digits-softmax", "--out", str(out), "--no-progress",
           *[a for s in SMALL + ["max_steps=1"] for a in ("--set", s)]]
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))  # noqa: E731
    r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=240, preexec_fn=limit)
    err = [line for line in r.stderr.splitlines() if line.startswith("repsim train")]
    assert r.returncode == 3 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith(f"repsim train: error: {out}/") and "File too large" in err[0], err
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") or ".tmp-" in p.name]


def test_cli_fine_tunes_from_a_checkpoint(capsys, tmp_path, trained):
    ckpt = trained[0] / "checkpoint.pt"
    out = tmp_path / "ft"
    rc, _ = _cli(capsys, "--preset", "finetune-digits", "--init-from", str(ckpt), "--out", str(out), "--no-progress",
                 "--set", "max_steps=5", "--set", "arch=\"mini_resnet14\"", "--set", "arch_params.width=4")
    assert rc == 0
    ck = load_checkpoint(out / "checkpoint.pt")
    src = load_checkpoint(ckpt)["ema"]
    assert ck["scheduler"]["step"] == 5 and ck["config"]["dataset"]["spec"] == "digits-target"
    assert ck["config"]["finetune"]["source"]["objective"] == "sigmoid"
    # the backbone moved away from its initialisation (training happened) but started from the source
    init = {k: v for k, v in ck["model"].items() if k.startswith("backbone.") and k.endswith("conv1.weight")}
    assert all(not torch.equal(v, src[k]) for k, v in init.items())
    # ... and close to it: 5 steps move each conv weight by under 5 % of its norm (measured ≤ 0.8 %; a fresh
    # initialisation instead of the source would differ by about 100 %; atol 0.5 passed either way)
    rel = {k: float((v - src[k]).norm() / src[k].norm()) for k, v in init.items()}
    assert init and all(r < 0.05 for r in rel.values()), rel
