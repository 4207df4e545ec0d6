"""Extraction overhead and store compression, measured in one run.

For each configuration (model, data, batch), on the CPU:

* ``forward``: the same DataLoader batches through ``model(x)`` under ``inference_mode``, nothing
  captured or written (the floor any extractor pays);
* ``extract``: ``extract.extract_store`` end to end (probe pass, store creation, hooks, float16
  cast + range check, zstd compression and writing in background threads, head, finalisation);
* ratio = extract / forward (goal <= 1.2), best of ``--repeats`` for each;
* compression ratio per layer = uncompressed bytes / bytes of its chunk objects on disk.

With a GPU (``--device cuda``): ResNet-50 at 224 px on synthetic images, img/s for ``pool,logits``
and for all 16 blocks (``--spatial`` of your choice), AMP float16.

Writes bench/results/extract_throughput.json and the ``## extract_throughput`` section of
bench/RESULTS.md.

    python bench/extract_throughput.py            # CPU configurations
    python bench/extract_throughput.py --device cuda --gpu-n 20000
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # run from a checkout without installing

from extract import extract_store  # noqa: E402


def forward_only(model, dataset, batch_size: int, workers: int, device: str,
                 channels_last: bool = False) -> tuple[float, float]:
    """(wall s, process CPU s) to push the dataset through ``model`` with the extractor's loader
    settings, in the memory format the extraction uses (``channels_last``: NHWC weights and batches)."""
    from torch.utils.data import DataLoader

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    dev = torch.device(device)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        pin_memory=dev.type == "cuda")
    amp = torch.autocast("cuda", dtype=torch.float16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode(), amp:
        for x, _ in loader:
            model(x.to(dev, non_blocking=True).contiguous(memory_format=fmt))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def store_compression(path: Path, layers: list[str]) -> dict[str, dict[str, float]]:
    import zarr

    g = zarr.open_group(str(path), mode="r")
    out = {}
    for name in layers:
        arr = g[f"layers/{name}"]
        stored = sum(p.stat().st_size for p in (path / "layers" / name).rglob("*") if p.is_file() and p.name != "zarr.json")
        raw = arr.nbytes
        out[name] = {"uncompressed_mb": raw / 2**20, "stored_mb": stored / 2**20, "ratio": raw / max(stored, 1)}
    return out


ONLY: list[str] = []  # --only: substrings of the labels to run (default all)


def measure(label: str, model, dataset, *, batch_size: int, workers: int, device: str, repeats: int,
            tmp: Path, **kw) -> dict | None:
    """forward, extract, forward, extract, ..., forward: each extraction is compared with the mean
    of the forward runs just before and after it (a shared machine's load drifts), and the median
    of these paired ratios is reported next to the ratio of the best times."""
    if ONLY and not any(o in label for o in ONLY):
        return None
    from extract.pipeline import _resolve_memory_format

    model = model.to(device).eval()
    cl = _resolve_memory_format(kw.get("memory_format"), model, dataset[0][0]) == "channels_last"
    # the contiguous forward (how the model runs as written), for the gain of the layout alone
    forward_only(model, dataset, batch_size, workers, device)  # warm-up (allocator, oneDNN kernels)
    contiguous = min(forward_only(model, dataset, batch_size, workers, device)[0] for _ in range(2))
    forward_only(model, dataset, batch_size, workers, device, cl)  # warm-up in the extraction's layout
    fwds, ext, fwd_cpu, ext_cpu = [], [], [], []
    wall, cpu = forward_only(model, dataset, batch_size, workers, device, cl)
    fwds.append(wall)
    fwd_cpu.append(cpu)
    for r in range(repeats):
        out = tmp / f"{label}-{r}.zarr"
        t0, c0 = time.perf_counter(), time.process_time()
        store = extract_store(model, dataset, out, batch_size=batch_size, workers=workers, device=device,
                              progress=False, **kw)
        ext.append(time.perf_counter() - t0)
        ext_cpu.append(time.process_time() - c0)
        wall, cpu = forward_only(model, dataset, batch_size, workers, device, cl)
        fwds.append(wall)
        fwd_cpu.append(cpu)
        if r < repeats - 1:
            shutil.rmtree(out)  # outside the timed region
    paired = [e / ((fwds[i] + fwds[i + 1]) / 2) for i, e in enumerate(ext)]
    paired_cpu = [e / ((fwd_cpu[i] + fwd_cpu[i + 1]) / 2) for i, e in enumerate(ext_cpu)]
    fwd = min(fwds)
    comp = store_compression(out, store.layers)
    n = len(dataset)
    res = {
        "label": label, "n": n, "batch_size": batch_size, "workers": workers, "device": device,
        "layers": store.layers, "spatial": kw.get("spatial", "flatten"), "dtype": kw.get("dtype", "float16"),
        "compression_codec": kw.get("compression", "zstd"),
        "chunk_rows": store.chunk_rows, "memory_format": store.attrs["extraction"]["memory_format"],
        "forward_s": fwd, "forward_contiguous_s": contiguous, "extract_s": min(ext),
        "ratio": float(np.median(paired)), "ratio_of_best": min(ext) / fwd,
        "cpu_ratio": float(np.median(paired_cpu)), "paired_ratios": paired,
        "forward_runs_s": fwds, "extract_runs_s": ext, "forward_cpu_s": fwd_cpu, "extract_cpu_s": ext_cpu,
        "extract_img_per_s": n / min(ext), "forward_img_per_s": n / fwd,
        "store_uncompressed_mb": sum(c["uncompressed_mb"] for c in comp.values()),
        "store_stored_mb": sum(c["stored_mb"] for c in comp.values()),
        "compression": comp,
    }
    print(f"{label}: n={n} batch={batch_size} forward {fwd:.2f} s ({res['memory_format']}; contiguous "
          f"{contiguous:.2f} s), extract {min(ext):.2f} s (best); "
          f"paired ratio {res['ratio']:.2f} (runs {', '.join(f'{x:.2f}' for x in paired)}), CPU-time ratio "
          f"{res['cpu_ratio']:.2f}; store {res['store_uncompressed_mb']:.1f} MiB -> {res['store_stored_mb']:.1f} MiB",
          flush=True)
    for name, c in comp.items():
        print(f"    {name:>8}: {c['uncompressed_mb']:8.2f} MiB  x{c['ratio']:.2f}")
    shutil.rmtree(out, ignore_errors=True)
    return res


def cpu_configs(args, tmp: Path) -> list[dict]:
    import torchvision
    from train.data import build_dataset
    from train.models import build_network

    results = []
    torch.manual_seed(0)
    cfg = {"arch": "mini_resnet", "arch_params": {"width": 8, "layers": [3, 4, 6, 3]}, "in_channels": 1,
           "objective": "softmax", "objective_params": {}, "num_classes": 10, "seed": 0}
    net = build_network(cfg)
    digits = build_dataset("digits", "train")
    # 1,168 digits take ~0.1 s through the mini ResNet: the fixed cost of a store (creation, probe
    # batch, finalisation, ~0.3 s) would be the whole ratio, so the set is repeated 10 times
    digits10 = torch.utils.data.ConcatDataset([digits] * 10)
    results.append(measure("digits x10 mini_resnet, 16 blocks+pool+logits, flatten", net, digits10,
                           batch_size=128, workers=0, device="cpu", repeats=args.repeats, tmp=tmp))
    synth = build_dataset("synthetic", "test", image_size=64, n=args.cpu_n, num_classes=100)
    r50 = torchvision.models.resnet50(num_classes=100)
    common = dict(batch_size=32, workers=0, device="cpu", repeats=args.repeats, tmp=tmp)
    for spatial in ("flatten", "pool2", "mean"):
        results.append(measure(f"resnet50 64px synthetic, 16 blocks+pool+logits, {spatial}", r50, synth,
                               spatial=spatial, **common))
    results.append(measure("resnet50 64px synthetic, 16 blocks+pool+logits, flatten, --compression none", r50,
                           synth, spatial="flatten", compression="none", **common))
    results.append(measure("resnet50 64px synthetic, pool+logits", r50, synth, layers="pool,logits", **common))
    return [r for r in results if r is not None]


def gpu_configs(args, tmp: Path) -> list[dict]:
    import torchvision
    from train.data import build_dataset

    synth = build_dataset("synthetic", "test", image_size=224, n=args.gpu_n, num_classes=1000)
    r50 = torchvision.models.resnet50()
    common = dict(batch_size=args.gpu_batch, workers=args.workers, device="cuda", repeats=1, tmp=tmp)
    return [
        measure("resnet50 224px, pool+logits, AMP", r50, synth, layers="pool,logits", **common),
        measure(f"resnet50 224px, 16 blocks+pool+logits ({args.gpu_spatial}), AMP", r50, synth,
                spatial=args.gpu_spatial, **common),
    ]


def write_results(results: list[dict], cmd: str) -> None:
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    meta = {"command": cmd, "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (ROOT / "bench" / "results" / "extract_throughput.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = ["## extract_throughput", "",
             f"`{cmd}` — {meta['date']}, {meta['cpus']} CPUs ({meta['torch_threads']} torch threads), "
             f"torch {meta['torch']}, load average {meta['load_average'][0]:.1f} at the end (a machine shared "
             "with other jobs: timings drift by up to 2x between runs). Extraction = `extract_store` end to end "
             "(probe, store creation, hooks, range check, compression, writing, head, finalisation); forward = "
             "the same loader batches through the model with nothing captured. Runs alternate forward, extract, "
             "forward, ...; ratio = median over extractions of extract / mean(forward before, forward after). "
             "Goal: ratio <= 1.2.", "",
             "Forward and extraction run in the memory format extraction picks (`--memory-format auto`: "
             "channels_last for conv nets); the contiguous column is the same forward with the model as written.", "",
             "| configuration | n | batch | best forward s (contiguous) | best extract s | ratio (wall, paired median) | ratio of best times | ratio (process CPU time) | img/s | store MiB (raw -> stored) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} ({r['device']}) | {r['n']} | {r['batch_size']} | {r['forward_s']:.2f} "
                     f"{r.get('memory_format', 'contiguous')} ({r.get('forward_contiguous_s', r['forward_s']):.2f}) | "
                     f"{r['extract_s']:.2f} | **{r['ratio']:.2f}** | {r['ratio_of_best']:.2f} | {r['cpu_ratio']:.2f} | {r['extract_img_per_s']:.0f} | "
                     f"{r['store_uncompressed_mb']:.1f} -> {r['store_stored_mb']:.1f} |")
    lines += ["", "Compression ratio per layer (uncompressed / stored, float16 + zstd level 1 unless the row says "
              "`--compression none`):", ""]
    for r in results:
        comp = ", ".join(f"{k} x{v['ratio']:.2f}" for k, v in r["compression"].items())
        lines.append(f"- {r['label']}: {comp}")
    section = "\n".join(lines) + "\n"
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(r"^## extract_throughput\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-n", type=int, default=1024, help="synthetic images for the CPU ResNet-50 runs")
    p.add_argument("--gpu-n", type=int, default=20000)
    p.add_argument("--gpu-batch", type=int, default=256)
    p.add_argument("--gpu-spatial", default="mean")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--only", nargs="*", default=[], metavar="TEXT",
                   help="run only configurations whose label contains one of these (e.g. flatten)")
    p.add_argument("--no-markdown", action="store_true", help="write the JSON only, leave RESULTS.md alone")
    args = p.parse_args()
    ONLY[:] = args.only
    cmd = "python bench/extract_throughput.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="extract-bench-") as tmp:
        results = cpu_configs(args, Path(tmp)) if args.device == "cpu" else gpu_configs(args, Path(tmp))
        results = [r for r in results if r is not None]
    if not args.no_markdown:
        write_results(results, cmd.strip())
    else:
        print(json.dumps([{k: r[k] for k in ("label", "ratio", "ratio_of_best", "cpu_ratio", "forward_s", "extract_s")}
                          for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
