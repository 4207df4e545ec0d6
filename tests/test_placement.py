"""Every placement rule of repsim.train.placement, with the number of GPUs given (no GPU needed), and the
commands refusing an unplaceable request with one line before anything starts."""
from __future__ import annotations

import pytest

from repsim.train.placement import Placement, PlacementError, plan_placement, plan_process

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def test_no_gpu_runs_on_the_cpu_as_before():
    assert plan_placement(2, 2, []) == Placement("cpu", [{}, {}], None)
    with pytest.raises(PlacementError, match="--device cuda: no GPU is visible"):
        plan_placement(1, 1, [], "cuda")


def test_device_cpu_hides_the_gpus():
    assert plan_placement(3, 1, ["0", "1"], "cpu") == Placement("cpu", [CPU_ONLY] * 3, None)


def test_one_gpu_per_process_when_there_are_enough():
    assert plan_placement(2, 2, ["0", "1", "2", "3"]) == Placement("cuda", [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                                              {"CUDA_VISIBLE_DEVICES": "2,3"}])
    # the ids are CUDA_VISIBLE_DEVICES's own, e.g. a parent restricted to GPUs 4 and 6
    assert plan_placement(1, 1, ["4", "6"]).slots == [{"CUDA_VISIBLE_DEVICES": "4"}]


def test_jobs_beyond_the_gpus_share_them():
    """What one GPU did before: '--jobs 2 x --nproc-per-node 1 needs 2 GPUs; 1 visible'."""
    p = plan_placement(2, 1, ["0"])
    assert p.device == "cuda" and p.slots == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2
    assert p.note == "--jobs 2 x --nproc-per-node 1 on 1 GPU(s): up to 2 runs share each GPU"
    p = plan_placement(5, 2, ["0", "1", "2", "3"])  # two groups of two, round robin
    assert [s["CUDA_VISIBLE_DEVICES"] for s in p.slots] == ["0,1", "2,3", "0,1", "2,3", "0,1"]
    assert "up to 3 runs share each group of GPUs" in p.note


def test_more_processes_than_gpus_fall_back_to_the_cpu_or_are_refused():
    """NCCL needs one GPU per process: 2 processes on 1 GPU crashed ('invalid device ordinal')."""
    p = plan_placement(2, 2, ["0"])
    assert p.device == "cpu" and p.slots == [CPU_ONLY] * 2
    assert p.note.startswith("--nproc-per-node 2 needs 2 GPUs (NCCL runs one process per GPU); 1 visible: "
                             "the runs train on the CPU (gloo)")
    with pytest.raises(PlacementError, match=r"^--nproc-per-node 3 needs 3 GPUs .* 2 visible: pass "
                                             r"--nproc-per-node 2 or fewer, or --device cpu$"):
        plan_placement(1, 3, ["0", "1"], "cuda")


@pytest.mark.parametrize("jobs,nproc,device,match", [(0, 1, "auto", "must be >= 1"), (1, 0, "auto", "must be >= 1"),
                                                     (1, 1, "tpu", "--device must be one of auto, cuda, cpu")])
def test_bad_requests(jobs, nproc, device, match):
    with pytest.raises(PlacementError, match=match):
        plan_placement(jobs, nproc, ["0"], device)


def test_one_process_of_a_torchrun_job():
    assert plan_process(1, 2, 2) == ("cuda:1", None)
    assert plan_process(0, 1, 1) == ("cuda:0", None)
    assert plan_process(0, 1, 0) == ("cpu", None)
    assert plan_process(1, 2, 2, "cpu") == ("cpu", None)
    where, note = plan_process(1, 2, 1)
    assert where == "cpu" and "train on the CPU (gloo)" in note
    with pytest.raises(PlacementError, match="needs 2 GPUs"):
        plan_process(1, 2, 1, "cuda")


def test_commands_refuse_with_one_line_before_training(tmp_path, capsys, monkeypatch):
    """An unplaceable request: exit 2, one line, nothing written (GPUs faked: tune reads
    CUDA_VISIBLE_DEVICES, a training process asks torch.cuda)."""
    pytest.importorskip("torch")
    from repsim.commands.main import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = tmp_path / "tune"
    rc = main(["tune", "--preset", "digits-softmax", "--out", str(out), "--grid", "optim.lr=0.1,0.2",
               "--nproc-per-node", "2", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--nproc-per-node 2 needs 2 GPUs" in err[0], err
    assert not out.exists()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what train_run asks torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    rc = main(["train", "--preset", "digits-softmax", "--out", str(tmp_path / "t"), "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["repsim train: error: --device cuda: no GPU is visible "
                               "(torch.cuda / CUDA_VISIBLE_DEVICES)"], err
    assert not (tmp_path / "t").exists()
