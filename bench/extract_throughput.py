"""Extraction overhead and store compression, measured in one run.

For each configuration (model, data, batch), on the CPU:

* ``forward``: the same DataLoader batches through ``model(x)`` under ``inference_mode``, nothing
  captured or written (the floor any extractor pays);
* ``extract``: ``extract.extract_store`` end to end (probe pass, store creation, hooks, float16
  cast + range check, zstd compression and writing in background threads, head, finalisation);
* ratio = extract / forward (goal <= 1.2), best of ``--repeats`` for each;
* compression ratio per layer = uncompressed bytes / bytes of its chunk objects on disk.

With a GPU (``--device cuda``, issue 26): ResNet-50 at 224 px, channels-last, autocast (``--amp``,
bfloat16 by default): forwards of device-resident batches, of pinned host batches (the floor of the
ratios) and fed by the in-memory path (repsim/extract/memory.py); extraction of ``pool,logits`` and of the
16 blocks (``--gpu-spatial``) from in-memory float32 and uint8 sources, and through the DataLoader
(``--workers``); the fixed cost of a store; CPU against nvJPEG decoding of ``--jpegs`` generated
JPEGs (see :func:`pipeline_rows`); sized to finish within 100 s at ``--gpu-n 10000`` (not yet timed on a GPU); a failing row prints its
error and the rest still run. Writes ``--out`` (default bench/results/extract_throughput_gpu.json) and the
``## extract_throughput_gpu`` section of bench/RESULTS.md.

CPU mode writes ``--out`` (default bench/results/extract_throughput.json) and the ``## extract_throughput``
section of bench/RESULTS.md. As in every benchmark here (bench/_results.records), only a run of every row
(no ``--only``, ``--pipeline-on-cpu`` or ``--no-markdown``) to the default ``--out`` rewrites RESULTS.md;
a trial's JSON to the default path goes to the temporary directory instead.

    python bench/extract_throughput.py            # CPU configurations
    python bench/extract_throughput.py --device cuda --gpu-n 10000
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
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # run from a checkout without installing

from repsim.extract import extract_store  # noqa: E402

from _timing import best_of  # noqa: E402  (bench/ is this script's directory)


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
    from repsim.extract.pipeline import _resolve_memory_format

    model = model.to(device).eval()
    cl = _resolve_memory_format(kw.get("memory_format"), model, dataset[0][0]) == "channels_last"
    # the contiguous forward (how the model runs as written), for the gain of the layout alone: best of
    # as many runs (repeats + 1) as the forward in the extraction's layout gets below
    forward_only(model, dataset, batch_size, workers, device)  # warm-up (allocator, oneDNN kernels)
    contiguous = min(forward_only(model, dataset, batch_size, workers, device)[0] for _ in range(repeats + 1))
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
    from repsim.train.data import build_dataset
    from repsim.train.models import build_network

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


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _jpeg_rows(n: int, size: int, tmp: Path) -> list[dict]:
    """CPU ``decode_jpeg`` (one thread, and a thread pool as DataLoader workers would) against
    ``device='cuda'`` (nvJPEG, batched) on ``n`` generated ``size`` px JPEGs in an ImageFolder."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg, read_file

    g = torch.Generator().manual_seed(0)
    # smooth random images (upsampled 14 px noise): JPEG sizes like photos', not like white noise's
    small = torch.rand((n, 3, 14, 14), generator=g)
    images = (F.interpolate(small, size=(size, size), mode="bicubic").clamp(0, 1) * 255).to(torch.uint8)
    root = tmp / "jpegs"
    for k, data in enumerate(encode_jpeg(list(images), quality=90)):
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{k:05d}.jpg").write_bytes(data.numpy().tobytes())
    files = sorted(root.rglob("*.jpg"))
    blobs = [read_file(str(f)) for f in files]
    mb = sum(b.numel() for b in blobs) / 2**20
    rows = []

    def add(label: str, fn, warmup: bool = False) -> None:
        try:
            t = best_of(fn, 1, warmup)
            rows.append({"label": label, "n": n, "s": t, "img_per_s": n / t, "jpeg_mb": mb})
        except Exception as exc:  # noqa: BLE001 - a failing row is reported, the others still run
            rows.append({"label": label, "error": _error(exc)})
        print(_row_line(rows[-1]), flush=True)

    threads = min(8, os.cpu_count() or 1)
    add("JPEG decode, CPU, 1 thread", lambda: [decode_jpeg(b, mode=ImageReadMode.RGB) for b in blobs])
    with ThreadPoolExecutor(threads) as pool:
        add(f"JPEG decode, CPU, {threads} threads",
            lambda: list(pool.map(lambda b: decode_jpeg(b, mode=ImageReadMode.RGB), blobs)))

    def gpu() -> None:
        for lo in range(0, n, 256):  # batched nvJPEG, as a loader of 256-image batches would call it
            decode_jpeg(blobs[lo:lo + 256], mode=ImageReadMode.RGB, device="cuda")
        torch.cuda.synchronize()

    add("JPEG decode, GPU (nvJPEG, batches of 256)", gpu, warmup=True)  # the warm-up initialises nvJPEG
    try:
        cpu = decode_jpeg(blobs[0], mode=ImageReadMode.RGB).float()
        dev = decode_jpeg([blobs[0]], mode=ImageReadMode.RGB, device="cuda")[0].cpu().float()
        rows[-1]["max_abs_diff_vs_cpu"] = float((cpu - dev).abs().max())
    except Exception:  # noqa: BLE001 - no GPU decode: already reported as the row's error
        pass
    return rows


def _error(exc: BaseException) -> str:
    """An exception on one line (for the table), at most 300 characters."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['label']}: FAILED {r['error']}"
    ratio = f", {r['ratio']:.2f}x the pinned-host forward" if r.get("ratio") is not None else ""
    return f"{r['label']}: {r['img_per_s']:,.0f} img/s ({r['s']:.2f} s for {r['n']}){ratio}"


def pipeline_rows(args, tmp: Path, device: str) -> dict:
    """Issue 26's extraction rows, each in img/s and as a ratio to (b), all in this one run:

    (a) forward of GPU-resident batches; (b) forward from pinned host float32 batches (copy, then
    forward, one stream: the floor of the acceptance ratio); (b') forward fed by ``MemoryFeed``
    (float32, and uint8 NHWC normalised on the device): the in-memory path without capture;
    (c) extraction pool+logits from the in-memory source (float32; and uint8 NHWC); (d) extraction
    of 16 blocks with ``--gpu-spatial``; (e) the DataLoader path (the lazily generated synthetic
    dataset, ``--workers`` processes); the fixed cost of one store (an extraction of one batch), so
    that the steady rate ``n / (t - fixed)`` is shown beside the end-to-end one; JPEG decoding.
    A failing row prints its error and the others still run. Returns ``{"rows": [...], "checks":
    {...}}`` (:func:`_gpu_checks`)."""
    import torchvision
    from repsim.extract.memory import ImageTensor, MemoryFeed
    from repsim.train.data import build_dataset

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # every row alike (extraction records the setting)
    n, bs, size = args.gpu_n, args.gpu_batch, args.image_size
    amp = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.amp]
    results: list[dict] = []
    floor: list[float] = []  # (b)'s img/s once measured

    def row(label: str, fn, count: int = n, ratio: bool = True, repeats: int = 2, **extra) -> None:
        """Time ``fn`` (best of ``repeats`` after a warm-up, or one run without for ``repeats=0``) and
        record img/s and the ratio to (b)."""
        try:
            t = best_of(fn, max(1, repeats), warmup=repeats > 0)
            r = {"label": label, "n": count, "s": t, "img_per_s": count / t, **extra}
            r["ratio"] = r["img_per_s"] / floor[0] if floor and ratio else None
        except Exception as exc:  # noqa: BLE001 - a failing row is reported, the others still run
            traceback.print_exc()
            r = {"label": label, "error": _error(exc)}
        results.append(r)
        print(_row_line(r), flush=True)

    t0 = time.perf_counter()
    synth = build_dataset("synthetic", "test", image_size=size, n=n, num_classes=1000)
    mem = ImageTensor.from_dataset(synth, threads=os.cpu_count() or 1)  # the same images, in memory
    u8 = ImageTensor(torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0)), np.arange(n) % 1000,
                     layout="NHWC", name="uint8 noise")
    print(f"data: {n} synthetic {size} px images in memory (float32 {mem.images.nbytes / 2**30:.1f} GiB, "
          f"uint8 NHWC {u8.images.nbytes / 2**30:.1f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
    torch.manual_seed(0)
    net = torchvision.models.resnet50().to(dev).eval().to(memory_format=torch.channels_last)
    spans = [(lo, min(lo + bs, n)) for lo in range(0, n, bs)]
    autocast = torch.autocast(dev.type, dtype=amp)

    def forward_from(batches) -> None:
        with torch.inference_mode(), autocast:
            for x in batches:
                net(x)
        _sync(dev)

    def resident() -> None:
        forward_from(on_dev[lo:hi] for lo, hi in spans)

    try:  # (a) the model's own speed: inputs already on the device, channels-last
        on_dev = mem.images.to(dev).contiguous(memory_format=torch.channels_last)
        row("(a) forward, device-resident batches", resident)
        del on_dev
    except Exception as exc:  # noqa: BLE001 - e.g. out of device memory
        results.append({"label": "(a) forward, device-resident batches", "error": _error(exc)})
        print(_row_line(results[-1]), flush=True)
    pinned = mem.images.pin_memory() if cuda else mem.images

    def from_pinned() -> None:  # (b) the naive loop: copy (non-blocking, same stream), then forward
        forward_from(pinned[lo:hi].to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last)
                     for lo, hi in spans)

    row("(b) forward, pinned host float32 batches (floor)", from_pinned)
    if "error" not in results[-1]:
        floor.append(results[-1]["img_per_s"])
        results[-1]["ratio"] = 1.0
    del pinned
    row("(b') forward, MemoryFeed float32 (copy one batch ahead, side stream)",
        lambda: forward_from(x for x, _ in MemoryFeed(mem, None, spans, dev, channels_last=True)))
    row("(b') forward, MemoryFeed uint8 NHWC (normalised on the device)",
        lambda: forward_from(x for x, _ in MemoryFeed(u8, None, spans, dev, channels_last=True)))

    stores: dict[str, Path] = {}

    def extraction(label: str, data, count: int = n, ratio: bool = True, repeats: int = 2, **kw) -> None:
        written: list[Path] = []  # each timed run writes a new store, as a user's run does (deleting the
        # previous run's store is not extraction: it is removed after the row, outside the timings)

        def run() -> None:
            written.append(tmp / f"{len(results)}-{len(written)}.zarr")
            extract_store(net, data, written[-1], batch_size=bs, device=device, amp=args.amp, progress=False, **kw)

        row(label, run, count=count, ratio=ratio, repeats=repeats, **{k: str(v) for k, v in kw.items()})
        stores[label] = written[-1]
        for old in written[:-1]:
            shutil.rmtree(old, ignore_errors=True)

    one_batch = ImageTensor(mem.images[:bs], mem.labels[:bs], name="one batch")
    extraction("fixed cost: extraction of one batch, pool+logits", one_batch, count=bs, ratio=False, layers="pool,logits")
    fixed = results[-1].get("s")
    extraction("(c) extraction pool+logits, in-memory float32", mem, layers="pool,logits")
    extraction("(c) extraction pool+logits, in-memory uint8 NHWC", u8, layers="pool,logits")
    extraction(f"(d) extraction 16 blocks ({args.gpu_spatial}), in-memory float32", mem, spatial=args.gpu_spatial)
    extraction(f"(d) extraction 16 blocks ({args.gpu_spatial}), in-memory uint8 NHWC", u8, spatial=args.gpu_spatial)
    # the slow DataLoader row: one run (the rows before warmed up cuDNN for these shapes)
    extraction(f"(e) extraction pool+logits, DataLoader ({args.workers} workers, lazily generated images)",
               synth, repeats=0, layers="pool,logits", workers=args.workers)
    for r in results:
        if fixed and "error" not in r and r["label"].startswith(("(c)", "(d)", "(e)")) and r["s"] > fixed:
            r["steady_img_per_s"] = (r["n"] - bs) / (r["s"] - fixed)
    checks = _gpu_checks(stores, dev)
    return {"rows": results + _jpeg_rows(args.jpegs, size, tmp), "checks": checks}


def _gpu_checks(stores: dict[str, Path], dev: torch.device) -> dict:
    """Correctness beside the speed: the in-memory and DataLoader stores of the same images agree
    (cuDNN autotuning may pick other kernels per run, so equality is not required, the difference
    is reported); NaN propagates through the range check's reduction on this device."""
    import math

    from repsim.store.reader import open_store

    out: dict = {}
    try:
        mem = next(p for k, p in stores.items() if k.startswith("(c)") and "float32" in k)
        loader = next(p for k, p in stores.items() if k.startswith("(e)"))
        a, b = open_store(str(mem)), open_store(str(loader))
        la, lb = np.asarray(a.logits), np.asarray(b.logits)
        out["memory_vs_dataloader_logits_identical"] = bool(np.array_equal(la, lb))
        out["memory_vs_dataloader_logits_max_abs_diff"] = float(np.max(np.abs(la - lb)))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        out["memory_vs_dataloader"] = _error(exc)
    y = torch.tensor([1.0, float("nan"), -3.0], device=dev, dtype=torch.float16)
    with torch.autocast(dev.type, dtype=torch.float16):
        out["vector_norm_inf_propagates_nan"] = math.isnan(float(torch.linalg.vector_norm(y, math.inf,
                                                                                         dtype=torch.float32)))
    print(f"checks: {out}", flush=True)
    return out


def write_results(results: list[dict], cmd: str, out: Path, markdown: bool) -> None:
    """``out`` (JSON) and, with ``markdown``, the ``## extract_throughput`` section of bench/RESULTS.md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": cmd, "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from _results import provenance

    meta["provenance"] = provenance()
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    if not markdown:
        print(json.dumps([{k: r[k] for k in ("label", "ratio", "ratio_of_best", "cpu_ratio", "forward_s", "extract_s")}
                          for r in results], indent=1))
        print("bench/RESULTS.md left alone (a trial: --no-markdown, --only or --out elsewhere)")
        return
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


def write_pipeline_results(measured: dict, cmd: str, device: str, out: Path, markdown: bool) -> None:
    """``out`` (JSON; by default bench/results/extract_throughput_gpu.json), the table printed, and
    (``markdown``) the ``## extract_throughput_gpu`` section of bench/RESULTS.md."""
    name = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else platform.processor() or "cpu"
    meta = {"command": cmd, "device": name, "torch": torch.__version__, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from _results import provenance

    meta["provenance"] = provenance()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **measured}, indent=2) + "\n")
    lines = ["## extract_throughput_gpu", "",
             f"`{cmd}` — {meta['date']}, {name}, torch {meta['torch']}, {meta['cpus']} CPUs, {measured['wall_s']:.0f} s in "
             "all. ResNet-50, channels-last, "
             "autocast as the command says, cuDNN autotuning on, every row best of the repeats after a warm-up run; "
             "ratio = img/s / row (b)'s (acceptance: (c) >= 0.8, (d) >= 0.7). Extraction rows are end to end "
             "(probe, store creation, writes, finalisation); steady = (n - batch) / (time - the one-batch "
             "extraction's time).", "",
             "| row | img/s | ratio to (b) | steady img/s | s | n |", "|---|---|---|---|---|---|"]
    for r in measured["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | |")
            continue
        ratio = f"**{r['ratio']:.2f}**" if r.get("ratio") is not None else ""
        steady = f"{r['steady_img_per_s']:,.0f}" if "steady_img_per_s" in r else ""
        lines.append(f"| {r['label']} | {r['img_per_s']:,.0f} | {ratio} | {steady} | {r['s']:.2f} | {r['n']} |")
    lines += ["", "Checks: " + "; ".join(f"{k} = {v}" for k, v in measured["checks"].items())]
    section = "\n".join(lines) + "\n"
    print("\n" + section)
    if markdown:
        path = ROOT / "bench" / "RESULTS.md"
        text = path.read_text() if path.exists() else "# Benchmark results\n"
        pattern = re.compile(r"^## extract_throughput_gpu\n.*?(?=^## |\Z)", re.S | re.M)
        text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
        path.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-n", type=int, default=1024, help="synthetic images for the CPU ResNet-50 runs")
    p.add_argument("--gpu-n", type=int, default=10000, help="images of the GPU rows (float32 in memory: 0.6 MB each)")
    p.add_argument("--gpu-batch", type=int, default=256)
    p.add_argument("--gpu-spatial", default="mean")
    p.add_argument("--image-size", type=int, default=224, help="image size of the GPU rows")
    p.add_argument("--amp", default="bfloat16", choices=("float16", "bfloat16"), help="autocast dtype of the GPU rows")
    p.add_argument("--jpegs", type=int, default=2000, help="generated JPEGs of the decode rows")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--pipeline-on-cpu", action="store_true",
                   help="run the GPU rows on the CPU (a smoke test of the script: small --gpu-n and --image-size)")
    p.add_argument("--only", nargs="*", default=[], metavar="TEXT",
                   help="run only configurations whose label contains one of these (e.g. flatten)")
    p.add_argument("--out", default=None, metavar="JSON",
                   help="where the JSON goes (default bench/results/extract_throughput.json, with --device cuda "
                        "extract_throughput_gpu.json); RESULTS.md is rewritten only by a run of every row to the "
                        "default file (bench/_results.records)")
    p.add_argument("--no-markdown", action="store_true", help="write the JSON only, leave RESULTS.md alone")
    args = p.parse_args()
    gpu = args.device == "cuda" or args.pipeline_on_cpu
    default_out = ROOT / "bench" / "results" / ("extract_throughput_gpu.json" if gpu else "extract_throughput.json")
    out = Path(args.out or default_out)
    from _results import json_out, records

    trial = bool(args.only) or args.pipeline_on_cpu or args.no_markdown
    markdown = records(out, default_out, quick=trial)
    out = Path(json_out(out, default_out, quick=trial))
    ONLY[:] = args.only
    cmd = "python bench/extract_throughput.py " + " ".join(sys.argv[1:])
    if args.device == "cuda" or args.pipeline_on_cpu:
        with tempfile.TemporaryDirectory(prefix="extract-bench-") as tmp:
            t0 = time.perf_counter()
            measured = pipeline_rows(args, Path(tmp), args.device)
            measured["wall_s"] = time.perf_counter() - t0  # the whole measurement (goal: <= 100 s)
        write_pipeline_results(measured, cmd.strip(), args.device, out, markdown)
        return 0
    with tempfile.TemporaryDirectory(prefix="extract-bench-") as tmp:
        results = [r for r in cpu_configs(args, Path(tmp)) if r is not None]
    write_results(results, cmd.strip(), out, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
