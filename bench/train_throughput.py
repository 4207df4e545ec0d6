"""Training throughput (images/s): our loop (``repsim.train.loop.train_run``) vs torchvision's reference
recipe loop (references/classification/train.py ``train_one_epoch``) on the same model, batch, data.

Both read the same in-memory ``synthetic`` dataset through a DataLoader with the same settings and
use SGD momentum 0.9 with weight decay off normalisation layers. Differences are what each loop does
per step: ours adds Nesterov, the objective head, a per-step LR update, an EMA update of every
parameter and buffer every step, and keeps loss/accuracy on device; the reference calls
``loss.item()`` and computes top-1/top-5 on the host every step (its MetricLogger) and, with
``--model-ema``, updates its EMA every 32 steps. The reference's ``--amp`` is fp16 autocast with a
GradScaler; ours on CUDA is bf16 autocast + channels_last (``amp="auto"``), and conv nets train
channels-last on the CPU too (``channels_last="auto"``), so on the CPU the reference also runs a
second time in channels-last memory (the same layout: the loops' own difference). Timing: the
second of two epochs (the first warms up allocators / cuDNN autotuning); on CUDA both loops synchronise
before reading their clocks. Both loops' mean training loss over the timed epoch is printed and recorded
beside the rates (the same model, data and step count: the losses show the work was comparable).

Threads (CPU): ``--threads 1`` (default: the algorithms, on a shared box) and/or ``all`` (torch's default,
every core, as users run it), one table row per case and thread setting: ``--threads 1 all``.
Writes ``--out`` (default bench/results/train_throughput.json) and, only when ``--out`` is the default,
the ``## train_throughput`` section of bench/RESULTS.md.

    python bench/train_throughput.py                    # CPU: mini ResNet (digits size), ResNet-50 @ 64 px
    python bench/train_throughput.py --threads 1 all    # the same, one thread and all cores
    python bench/train_throughput.py --device cuda      # GPU: ResNet-50 @ 224 px, batch 256, AMP
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_OUT = ROOT / "bench" / "results" / "train_throughput.json"


def reference_epoch(model, loader, optimizer, criterion, device, scaler=None, amp_dtype=None) -> tuple[float, float]:
    """torchvision references/classification/train.py::train_one_epoch (without logging I/O);
    returns (images/s, mean training loss over the epoch)."""
    import torch

    model.train()
    n, t0, loss_sum = 0, time.perf_counter(), 0.0
    for image, target in loader:
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float16, enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        # MetricLogger: loss.item() and utils.accuracy(output, target, topk=(1, 5)) every step
        loss_sum += loss.item() * image.shape[0]
        top5 = output.topk(min(5, output.shape[1]), 1).indices
        _ = (top5[:, :1] == target[:, None]).float().sum().item(), (top5 == target[:, None]).float().sum().item()
        n += image.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), loss_sum / max(n, 1)


def run_reference(case: dict, device) -> tuple[float, float]:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from repsim.train.data import build_dataset
    from repsim.train.loop import param_groups
    from repsim.train.models import build_backbone

    torch.manual_seed(0)
    backbone, m = build_backbone(case["arch"], **case["arch_params"])
    model = nn.Sequential(backbone, nn.Linear(m, case["classes"])).to(device)
    if case["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    ds = build_dataset("synthetic", "train", image_size=case["size"], num_classes=case["classes"],
                       n=case["n"], channels=case["channels"])
    loader = DataLoader(ds, batch_size=case["batch"], shuffle=True, drop_last=True, num_workers=case["workers"],
                        pin_memory=device.type == "cuda", persistent_workers=case["workers"] > 0)
    opt = torch.optim.SGD(param_groups(model, 1e-4, False), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda") if case["amp"] else None
    rates = [reference_epoch(model, loader, opt, nn.CrossEntropyLoss(), device, scaler) for _ in range(2)]
    return rates[-1]  # (images/s, mean loss) of the second epoch


def run_ours(case: dict) -> tuple[float, float]:
    from repsim.train.config import load_config
    from repsim.train.loop import train_run

    sets = [f'arch="{case["arch"]}"', "data.spec=\"synthetic\"", f"data.image_size={case['size']}",
            f"data.synthetic_n={case['n']}", f"data.synthetic_classes={case['classes']}", f"in_channels={case['channels']}",
            f"batch_size={case['batch']}", f"optim.ref_batch={case['batch']}", "epochs=2", "data.eval_holdout=false",
            "data.eval_test=false", f"data.workers={case['workers']}", f'amp="{"auto" if case["amp"] else "off"}"',
            "save_best=false", "schedule.warmup_epochs=1"]
    sets += [f"arch_params.{k}={json.dumps(v)}" for k, v in case["arch_params"].items() if k != "in_channels"]
    cfg = load_config(None, sets)
    with tempfile.TemporaryDirectory() as out:
        metrics = train_run(cfg, out, progress=False, log=lambda s: None)
    return metrics[-1]["images_per_second"], metrics[-1]["train_loss"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", nargs="+", default=["1"],
                    help="torch intra-op threads on CPU, one row per value: a number, or 'all' for torch's default "
                         "(every core, both loops). Default 1: the 2-core CI box is shared, and 2 spinning threads "
                         "per process there are 10x slower; '--threads 1 all' adds the all-cores row")
    ap.add_argument("--repeats", type=int, default=2, help="alternate ours/reference this many times; median")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="results JSON; bench/RESULTS.md is rewritten only when this is the default")
    ap.add_argument("--no-markdown", action="store_true", help="leave bench/RESULTS.md alone")
    args = ap.parse_args()
    import torch

    device = torch.device(args.device)
    all_threads = torch.get_num_threads()
    thread_rows = [all_threads if t == "all" else int(t) for t in args.threads] if device.type == "cpu" else [all_threads]
    if device.type == "cpu":
        cases = [
            dict(name="mini_resnet digits-size (8 px, 1 ch), batch 64", arch="mini_resnet",
                 arch_params={"width": 8, "in_channels": 1}, channels=1, size=8, batch=64, n=640, classes=5,
                 workers=0, amp=False, channels_last=False),
            dict(name="resnet50 @ 64 px, batch 16", arch="resnet50", arch_params={}, channels=3, size=64,
                 batch=16, n=96, classes=100, workers=0, amp=False, channels_last=False),
        ]
    else:
        cases = [dict(name="resnet50 @ 224 px, batch 256, AMP, channels_last", arch="resnet50", arch_params={},
                      channels=3, size=224, batch=256, n=256 * 30, classes=1000, workers=8, amp=True,
                      channels_last=True)]
    results = []
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    for threads in thread_rows:
        torch.set_num_threads(threads)
        label = f"{threads} thread{'s' if threads > 1 else ''}" + (" (all cores)" if threads == all_threads else "")
        for case in cases:
            ours, ref, ref_cl = [], [], []
            for _ in range(args.repeats):
                ours.append(run_ours(case))
                ref.append(run_reference(case, device))
                if not case["channels_last"]:  # the reference as is, then in our layout
                    ref_cl.append(run_reference(dict(case, channels_last=True), device))
            o, r = med([v[0] for v in ours]), med([v[0] for v in ref])
            res = {"case": case["name"], "threads": threads, "threads_label": label, "ours_img_s": o,
                   "reference_img_s": r, "ratio": o / r, "ours_all": [v[0] for v in ours],
                   "reference_all": [v[0] for v in ref], "ours_loss_all": [v[1] for v in ours],
                   "reference_loss_all": [v[1] for v in ref]}
            if ref_cl:
                res.update(reference_channels_last_img_s=med([v[0] for v in ref_cl]),
                           ratio_same_layout=o / med([v[0] for v in ref_cl]),
                           reference_channels_last_all=[v[0] for v in ref_cl],
                           reference_channels_last_loss_all=[v[1] for v in ref_cl])
            results.append(res)
            print(f"{case['name']}, {label}: ours {o:.1f} img/s, torchvision reference loop {r:.1f} img/s, ratio {o / r:.2f}"
                  + (f"; reference channels-last {res['reference_channels_last_img_s']:.1f} img/s, ratio "
                     f"{res['ratio_same_layout']:.2f}" if ref_cl else "")
                  + f"; mean loss of the timed epoch: ours {ours[-1][1]:.4f}, reference {ref[-1][1]:.4f}"
                  + (f", reference channels-last {ref_cl[-1][1]:.4f}" if ref_cl else ""),
                  flush=True)
    torch.set_num_threads(all_threads)
    info = {"device": args.device, "threads": thread_rows, "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0], "results": results,
            "command": "python bench/train_throughput.py " + " ".join(sys.argv[1:])}
    from bench._results import provenance, records

    info["provenance"] = provenance()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2) + "\n")
    if records(out, DEFAULT_OUT, no_markdown=args.no_markdown):
        _write_section(info)
    else:
        print(f"wrote {out}; bench/RESULTS.md left alone (--no-markdown or --out elsewhere)")
    return 0


def _write_section(info: dict) -> None:
    lines = ["## train_throughput", "",
             f"`{info['command']}` — device {info['device']}, torch threads "
             f"{', '.join(str(t) for t in info['threads']) if isinstance(info['threads'], list) else info['threads']}, "
             f"torch {info['torch']}, "
             f"{info['cpus']} CPUs, 1-min load average {info['load_avg_1min']:.1f} at the end (a shared box: "
             "absolute numbers are noisy, the ratio is what the run measures).", "",
             "| case | threads | ours (img/s) | torchvision reference loop (img/s) | ratio | reference in "
             "channels-last memory (img/s) | ratio, same layout | mean loss of the timed epoch: ours / reference |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r.get('threads_label', '')} | {r['ours_img_s']:.1f} | {r['reference_img_s']:.1f} | "
              f"{r['ratio']:.2f} | "
              + (f"{r['reference_channels_last_img_s']:.1f} | {r['ratio_same_layout']:.2f} |"
                 if "ratio_same_layout" in r else "— | — |")
              + (f" {r['ours_loss_all'][-1]:.4f} / {r['reference_loss_all'][-1]:.4f} |" if "ours_loss_all" in r else " — |")
              for r in info["results"]]
    lines += ["", "Ours does more per step (Nesterov, objective head, per-step EMA of all weights); the "
              "reference syncs to the host every step for its logger. Ours trains conv nets channels-last "
              "(`channels_last = \"auto\"`, on the CPU too); the reference as written runs contiguous on the CPU, "
              "so the last two columns run it channels-last as well."]
    if info["device"] == "cpu":
        lines += ["No GPU was lent for this run: the ResNet-50 AMP/channels_last GPU number (goal >= 0.9x the "
                  "reference; MLPerf ~7,000 img/s on one H100) is not measured yet "
                  "(`python bench/train_throughput.py --device cuda`)."]
    lines += [""]
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    start = text.find("## train_throughput")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end + 1:] if end >= 0 else text[:start]
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
