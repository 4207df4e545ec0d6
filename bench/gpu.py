"""The GPU route against its floors, every row measured in one run on one GPU (issue 26).

Rows (each with the floor it is held against, measured in the same process):

* ``allpairs``: in-memory all-pairs CKA, L = 64 layers, one batch of 1,500 × 4,096 float32
  (``MinibatchCKA.update`` on CuPy arrays) against the 64 float32 Gram GEMMs of the same batch
  alone; accuracy against the same update with float64 Grams.
* ``store``: ``cka_matrix(device="cuda")`` over 4 stores (bench/ooc.py's, n = 8,192 by default,
  batch 1,024, one epoch) against the engine's own read schedule (the same reader threads, batch
  groups and read-ahead, every chunk read and decoded, no compute), and ``device="cpu"`` with all
  cores; peak GPU pool bytes.
* ``extract``: ``bench/extract_throughput.py --device cuda`` (its own floor rows), when asked.
* ``heatmap``: ``bench/heatmap18.py --scale resnet18 --device cuda`` (repsim vs pytorch-cka and the
  workflow's floor: imports + one forward per network + the stores' bytes at the disk's rate + the CKA
  reads), when asked (``--heatmap``; about 3 minutes: give the device call room); its log streams to
  ``$OUT/heatmap18_gpu.log``, so a run out of time still says how far it got.
* ``extract_profile`` (``--extract-profile``): the 16 blocks' spatial reductions against the forward,
  and a cProfile of a one-batch extraction.
* the store row also times nvCOMP's GPU zstd decoding of the same chunks against CPU decoding, and
  the engine's pass with the chunks decoded on the GPU (repsim/engine/device_decode.py) against the same
  pass with ``REPSIM_GPU_DECODE=0`` (the CPU-decoded read schedule), each held to the CPU's result.
* ``jpeg`` (``--jpeg``): ``extract_store`` of ResNet-50 over a generated JPEG ImageFolder end to end,
  nvJPEG route (repsim/extract/jpeg.py) against ``REPSIM_NVJPEG=0`` (PIL in DataLoader workers), the
  decoders' agreement in levels of 255 and the stores' logits.
* the heatmap row (``--heatmap``) also times ``repsim extract --job-mode processes`` (spawned jobs,
  the route before the one-process threads) against ``--job-mode threads`` (``--job-modes``).

Every row runs in a child process of its own, killed with its process group after its timeout
(``--row-timeout KEY=S``) or when ``--budget`` seconds are spent: a hung row cannot eat the call,
and a row's failure is reported while the others run. Writes bench/results/gpu.json (with the
device name and date) and the ``## gpu`` section of bench/RESULTS.md after every row (and copies
both into ``$OUT``). Without CUDA every row is skipped with the reason (a dry run of the script).

    python bench/gpu.py                 # about 2 minutes on an H100/H200
    python bench/gpu.py --extract --heatmap --jpeg --skip-allpairs   # the issue's rows (bench/gpu_device.sh)
    python bench/gpu.py --n 4096 --skip-store
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def _sync() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


def _best(f, repeats: int) -> float:
    """Best of ``repeats`` synchronised calls after a warm-up (bench/_timing.py)."""
    from _timing import best_of

    return best_of(f, repeats, sync=_sync)


def allpairs(L: int, n: int, p: int, repeats: int) -> dict:
    """MinibatchCKA.update on L CuPy layers (n, p) float32 vs the L float32 Grams alone; every
    :class:`repsim.kernels._cka_device.Tuning` choice and float64 Grams as extra rows, and the
    update's phases timed apart (each synchronised: where the time over the Grams goes)."""
    import dataclasses

    import cupy as cp

    from repsim.kernels import _cka_device as dev
    from repsim.kernels._precision import GRAM_SLAB
    from repsim.kernels.hsic import batch_hsic, hsic_to_cka
    from repsim.kernels.minibatch_cka import MinibatchCKA

    rng = cp.random.default_rng(0)
    z = rng.standard_normal((n, 32), dtype=cp.float32)  # a shared signal, so CKA is not ~0 everywhere
    layers = []
    for i in range(L):
        mix = rng.standard_normal((32, p), dtype=cp.float32)
        x = z @ mix + (1 + i % 4) * rng.standard_normal((n, p), dtype=cp.float32)
        layers.append(cp.maximum(x, 0) + 3.0 if i % 2 else x)  # post-ReLU-like layers with a mean
    pool = cp.get_default_memory_pool()
    default = dev.TUNING
    t_grams = _best(lambda: [cp.matmul(x, x.T) for x in layers], repeats)
    x64 = [x.astype(cp.float64) for x in layers[: max(1, L // 4)]]
    t_grams64 = _best(lambda: [cp.matmul(x, x.T) for x in x64], repeats) * L / len(x64)
    x64 = None  # (freed)
    h64 = batch_hsic(layers, compute_dtype="float64")
    ref = hsic_to_cka(h64)
    from repsim.array_api import fast_float64_products

    fast64 = fast_float64_products(cp)
    host = hsic_to_cka(batch_hsic([cp.asnumpy(x).astype(np.float64) for x in layers]))  # NumPy, float64
    variants = [(f"default: {'float64' if fast64 else 'float32'} Grams on this GPU", default, None),
                ("float32 Grams (slabs of 2,048 summed in float64)", default, "float32"),
                ("float32 Grams, product gemm: one A Aᵀ", dataclasses.replace(default, product="gemm"), "float32"),
                ("float64 Grams, product gemm: one A Aᵀ", dataclasses.replace(default, product="gemm"), "float64")]
    rows = []
    try:
        for label, tuning, cdt in variants:
            dev.TUNING = tuning
            try:
                t = _best(lambda: MinibatchCKA(L, keep_batches=False, compute_dtype=cdt).update(layers), repeats)
                got = hsic_to_cka(batch_hsic(layers, compute_dtype=cdt))
                err = float(np.max(np.abs(got - ref)))
                rows.append({"label": label, "s": t, "ratio": t / t_grams, "max_abs_cka_err_vs_float64": err,
                             "max_abs_cka_err_vs_host_float64": float(np.max(np.abs(got - host))),
                             "tuning": dataclasses.asdict(tuning), "compute_dtype": cdt})
            except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the others still run
                traceback.print_exc()
                rows.append({"label": label, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
        dev.TUNING = default
        # phases of the default route, each synchronised
        A = cp.empty((L, n * n), dtype=cp.float64)
        centered = [dev.center_once(x, cp)[0] for x in layers]
        phases = {
            "centre (L x center_once)": _best(lambda: [dev.center_once(x, cp) for x in layers], repeats),
            "grams into A (L x gram_rows, slabs)": _best(
                lambda: [dev.gram_rows(x, x, cp, GRAM_SLAB, out=A[i, :]) for i, x in enumerate(centered)], repeats),
            "row sums of A": _best(lambda: cp.sum(cp.reshape(A, (L, n, n)), axis=2), repeats),
            "A Aᵀ one GEMM": _best(lambda: A @ A.T, repeats),
        }
        for c in (256,):
            try:
                phases[f"A Aᵀ batched, {c} chunks"] = _best(lambda: dev._batched_row_products(A, c), repeats)
            except Exception as exc:  # noqa: BLE001
                phases[f"A Aᵀ batched, {c} chunks"] = f"{type(exc).__name__}: {exc}"
        A = centered = None  # (freed)
    finally:
        dev.TUNING = default
    best = min((r for r in rows if "s" in r), key=lambda r: r["s"], default=None)
    first = rows[0] if rows and "s" in rows[0] else {}
    return {"L": L, "n": n, "p": p, "update_s": first.get("s"), "grams_fp32_s": t_grams,
            "ratio": first.get("ratio"), "tflops_grams": 2 * L * n * n * p / t_grams / 1e12,
            "grams_fp64_s": t_grams64, "tflops_grams64": 2 * L * n * n * p / t_grams64 / 1e12,
            "max_abs_cka_err_vs_float64": first.get("max_abs_cka_err_vs_float64"),
            "variants": rows, "best": best and best["label"], "phases_s": phases, "fast_float64_products": fast64,
            "max_abs_cka_err_vs_host_float64": first.get("max_abs_cka_err_vs_host_float64"),
            "batched_unavailable": list(dev._BATCHED_UNAVAILABLE),
            "gpu_pool_bytes": int(pool.total_bytes())}


def engine_read(paths: list[str], batch_size: int, threads: int, prefetch: int = 2, upload: bool = False) -> float:
    """The engine's read schedule of ``cka_matrix(paths, batch_size, epochs=1)`` with
    ``threads`` reader threads and the device read-ahead: every (group, column) read and decoded
    (``upload``: and copied to the GPU as the engine does, engine/upload.py; nothing computed)."""
    from repsim.engine.blocks import BatchPlan, BlockReader, block_rows_for, resolve_columns

    t0 = time.perf_counter()  # opening and checking the stores is part of the engine's schedule too
    opened, columns, ids = resolve_columns(paths)
    n = int(ids.shape[0])
    g = block_rows_for(columns, n)
    plan = BatchPlan(n=n, batch_size=batch_size, shuffle="window", seed=0, block_rows=g)
    groups = plan.groups(0)
    put = None
    if upload:
        import cupy as cp

        from repsim.engine.upload import DeviceUploader

        put = DeviceUploader(cp)
    with BlockReader(columns, n, g, prefetch=prefetch, threads=threads, opened=opened) as reader:
        units = [(i, c) for i in range(len(groups)) for c in range(len(columns))]

        def load(u):
            arrays = reader.gather(u[1], groups[u[0]])
            return [put(a) for a in arrays] if put is not None else arrays

        for _ in reader.prefetched(units, load, max(prefetch, threads)):
            pass
    return time.perf_counter() - t0


def store_rows(n: int, batch_size: int) -> dict:
    import cupy as cp
    import ooc

    from repsim import cka_matrix
    from repsim.engine.scheduler import reader_threads

    root = tempfile.mkdtemp(prefix="repsim-gpu-")
    try:
        t0 = time.perf_counter()
        paths = ooc.make_stores(root, 4, n)
        out: dict = {"n": n, "stores": 4, "batch": batch_size, "bytes_on_disk": sum(ooc.du(p) for p in paths),
                     "make_s": time.perf_counter() - t0}
        threads = reader_threads(None, cp)
        out["threads"] = threads
        reads = [engine_read(paths, batch_size, threads)]
        pool = cp.get_default_memory_pool()
        kw = dict(batch_size=batch_size, epochs=1, progress=False)
        from repsim.engine.device_decode import device_decoder

        os.environ["REPSIM_GPU_DECODE"] = "1"  # (opt-in: engine/device_decode.py)
        out["gpu_decoding"] = device_decoder(cp) is not None  # nvCOMP installed: chunks decoded on the GPU
        runs = []  # (a failed GPU decoding: that try is reported, the next runs with the CPU decoding)
        for _ in range(2 + out["gpu_decoding"]):
            if len(runs) == 2:
                break
            pool.free_all_blocks()
            t0 = time.perf_counter()
            try:
                got = cka_matrix(paths, device="cuda", **kw)
            except Exception as exc:  # noqa: BLE001 - the GPU decoding failed: the row runs on with the CPU's
                if not out["gpu_decoding"]:
                    raise
                traceback.print_exc()
                out.update(gpu_decoding=False, gpu_decoding_error=f"{type(exc).__name__}: {exc}")
                os.environ["REPSIM_GPU_DECODE"] = "0"
                continue
            runs.append(time.perf_counter() - t0)
        os.environ.pop("REPSIM_GPU_DECODE", None)
        out["gpu_pool_peak_bytes"] = int(pool.total_bytes())
        host_decoded = None
        if out["gpu_decoding"]:  # the GPU decoding one call per (group, column), as before the spans
            from repsim.engine import device_decode

            limit, device_decode.DECODE_CALL_BYTES = device_decode.DECODE_CALL_BYTES, 0
            os.environ["REPSIM_GPU_DECODE"] = "1"
            try:
                t0 = time.perf_counter()
                per_column = cka_matrix(paths, device="cuda", **kw)
                out["cuda_decode_per_column_s"] = time.perf_counter() - t0
                out["max_abs_decode_per_column_vs_spans"] = float(np.nanmax(np.abs(per_column.values - got.values)))
            except Exception as exc:  # noqa: BLE001 - reported, the row runs on
                traceback.print_exc()
                out["decode_per_column_error"] = f"{type(exc).__name__}: {exc}"
            finally:
                device_decode.DECODE_CALL_BYTES = limit
                del os.environ["REPSIM_GPU_DECODE"]
            out["decode_call_bytes"] = limit
        if out["gpu_decoding"]:  # ... and the same pass with the CPU decoding them, as before
            os.environ["REPSIM_GPU_DECODE"] = "0"
            try:
                t0 = time.perf_counter()
                host_decoded = cka_matrix(paths, device="cuda", **kw)
                out["cuda_cpu_decoding_s"] = time.perf_counter() - t0
            finally:
                del os.environ["REPSIM_GPU_DECODE"]
        reads.append(engine_read(paths, batch_size, threads))
        out["engine_read_upload_s"] = engine_read(paths, batch_size, threads, upload=True)
        try:
            out["nvcomp"] = nvcomp_rows(paths, threads)
        except Exception as exc:  # noqa: BLE001 - reported, the row still runs
            traceback.print_exc()
            out["nvcomp"] = {"error": f"{type(exc).__name__}: {exc}"}
        t0 = time.perf_counter()
        ref = cka_matrix(paths, device="cpu", threads=os.cpu_count(), **kw)
        out["cpu_all_cores_s"] = time.perf_counter() - t0
        out.update(cuda_s=min(runs), cuda_runs=runs, engine_read_s=min(reads), engine_reads=reads,
                   ratio_to_read=min(runs) / min(reads), cpu_over_cuda=out["cpu_all_cores_s"] / min(runs),
                   columns=int(got.values.shape[0]),
                   max_abs_cuda_vs_cpu=float(np.nanmax(np.abs(got.values - ref.values))))
        if host_decoded is not None:
            out["max_abs_cuda_cpu_decoding_vs_cpu"] = float(np.nanmax(np.abs(host_decoded.values - ref.values)))
            out["gpu_decoding_over_cpu_decoding"] = out["cuda_cpu_decoding_s"] / out["cuda_s"]
        out["equal_to_cpu_within_1e-9"] = bool(out["max_abs_cuda_vs_cpu"] <= 1e-9 and
                                               out.get("max_abs_cuda_cpu_decoding_vs_cpu", 0.0) <= 1e-9)
        print(f"store: cka_matrix(device='cuda') {out['cuda_s']:.2f} s "
              f"({'GPU' if out['gpu_decoding'] else 'CPU'} decoding); REPSIM_GPU_DECODE=0 "
              f"{out.get('cuda_cpu_decoding_s', float('nan')):.2f} s; read schedule {out['engine_read_s']:.2f} s; "
              f"max |Δ| vs CPU {out['max_abs_cuda_vs_cpu']:.1e} / {out.get('max_abs_cuda_cpu_decoding_vs_cpu', float('nan')):.1e}",
              flush=True)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def extract_rows(n: int) -> dict:
    """bench/extract_throughput.py --device cuda (its own ## extract_throughput_gpu section): the 16-block
    row (d) against the forward from pinned host batches (b), with the fixed cost of a store; the
    row's headline numbers are copied up (``ratio_16_blocks``: the better of (d)'s two sources)."""
    out = HERE / "results" / "extract_throughput_gpu.json"
    before = out.stat().st_mtime if out.is_file() else None  # (an earlier run's file: not this run's result)
    r = subprocess.run([sys.executable, str(HERE / "extract_throughput.py"), "--device", "cuda", "--gpu-n", str(n)],
                       capture_output=True, text=True)
    print(r.stdout[-4000:], r.stderr[-3000:], sep="\n")
    if not out.is_file() or out.stat().st_mtime == before:
        return {"error": r.stderr[-2000:]}
    got = json.loads(out.read_text())
    rows = {row["label"]: row for row in got.get("rows", [])}
    d = [row for label, row in rows.items() if label.startswith("(d)") and row.get("ratio") is not None]
    c = [row for label, row in rows.items() if label.startswith("(c)") and row.get("ratio") is not None]
    fixed = next((row for label, row in rows.items() if label.startswith("fixed cost")), {})
    got["ratio_16_blocks"] = max((row["ratio"] for row in d), default=None)
    got["ratio_pool_logits"] = max((row["ratio"] for row in c), default=None)
    got["fixed_cost_s"] = fixed.get("s")
    return got


def heatmap_key(n: int) -> str:
    """The JSON key of the heatmap row at ``n`` images (``heatmap`` at the default 2,048)."""
    return "heatmap" if n == 2048 else f"heatmap_{n}"


def heatmap_rows(n: int, timeout: int, job_modes: bool = True) -> dict:
    """bench/heatmap18.py at the ResNet-18 scale on the GPU (18 networks, 64 px, ``n`` images): repsim
    (extract + cka) against pytorch-cka, and the workflow's floor, as that script measures them."""
    suffix = "" if n == 2048 else f"_{n}"
    out = HERE / "results" / f"heatmap18_gpu{suffix}.json"
    cmd = [sys.executable, str(HERE / "heatmap18.py"), "--scale", "resnet18", "--device", "cuda", "--nets", "18",
           "--image-size", "64", "--resnet-n", str(n), "--resnet-batch", "256", "--repsim-runs", "1",
           *(["--job-modes"] if job_modes else []),
           "--cache", str(Path(tempfile.gettempdir()) / "repsim-heatmap18"), "--out", str(out)]
    log = Path(os.environ.get("OUT") or HERE / "results") / f"heatmap18_gpu{suffix}.log"  # kept if it runs out of time
    before = out.stat().st_mtime if out.is_file() else None  # (an earlier run's file: not this run's result)
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s; its log: " + log.read_text()[-1500:]}
    print(log.read_text()[-4000:])
    if not out.is_file() or out.stat().st_mtime == before:
        return {"error": log.read_text()[-2000:]}
    run = json.loads(out.read_text())["runs"][-1]
    keep = ("networks", "columns", "images", "repsim", "peer", "ratio", "ratio_matched_work", "floor", "floor_parts",
            "agreement", "cka_profile", "runs_each_side", "extract_job_modes")
    return {k: run[k] for k in keep if k in run}


def extract_profile(batch: int = 256, size: int = 224) -> dict:
    """Where extraction's time over the forward goes (issue 26): the 16 bottleneck outputs of a
    ResNet-50 batch (bf16, channels-last) reduced by ``--spatial mean`` three ways, each
    synchronised, against the forward; and a cProfile of a warm one-batch extraction (its fixed
    cost), top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    import torch
    import torch.nn.functional as F
    import torchvision

    from repsim.extract.memory import ImageTensor
    from repsim.extract.pipeline import extract_store

    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = torchvision.models.resnet50().to(dev).eval().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last)
    blocks = [b for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for b in stage]
    outs: list = []
    hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o)) for b in blocks]

    def timed(fn, k: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / k

    res: dict = {"batch": batch, "size": size}
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        res["forward_s"] = timed(lambda: (outs.clear(), net(x)))
        ys = list(outs)
        res["reduce_mean_s"] = timed(lambda: [y.mean(dim=(2, 3)) for y in ys])
        res["reduce_adaptive_avg_pool_s"] = timed(lambda: [F.adaptive_avg_pool2d(y, 1) for y in ys])
        res["reduce_sum_s"] = timed(lambda: [y.sum(dim=(2, 3)) for y in ys])
        res["reduce_float_mean_s"] = timed(lambda: [y.float().mean(dim=(2, 3)) for y in ys])
        res["amax_of_means_s"] = timed(lambda: [torch.linalg.vector_norm(y.mean(dim=(2, 3)), float("inf"),
                                                                          dtype=torch.float32) for y in ys])
        res["mean_vs_pool_max_abs_diff"] = max(float((y.mean(dim=(2, 3)).float() - F.adaptive_avg_pool2d(y, 1)
                                                      .flatten(1).float()).abs().max()) for y in ys)
    for h in hooks:
        h.remove()
    tmp = Path(tempfile.mkdtemp(prefix="repsim-xprof-"))
    try:
        one = ImageTensor(torch.randn(batch, 3, size, size), np.arange(batch) % 1000, name="one batch")
        for spatial, layers in (("flatten", "pool,logits"), ("mean", None)):
            kw = {"layers": layers} if layers else {}
            for i in range(3):
                t0 = time.perf_counter()
                pr = cProfile.Profile() if i == 2 else None
                if pr:
                    pr.enable()
                extract_store(net, one, tmp / f"{spatial}-{i}.zarr", batch_size=batch, device="cuda", amp="bfloat16",
                              progress=False, spatial=spatial, **kw)
                if pr:
                    pr.disable()
                res[f"one_batch_{spatial}_s_run{i}"] = time.perf_counter() - t0
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(30)
            res[f"profile_{spatial}"] = out.getvalue()[-6000:]
            print(out.getvalue()[-6000:], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def nvcomp_rows(paths: list[str], threads: int) -> dict:
    """GPU decompression (nvCOMP's zstd through ``nvidia.nvcomp``) of every layer chunk of the stores
    against CPU decoding (``numcodecs.Zstd`` on ``threads`` threads, as the engine's readers do), on
    the same bytes read into memory first: the decode alone, the files' read timed apart."""
    import glob
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp
    import numcodecs

    files = sorted(f for p in paths for f in glob.glob(os.path.join(p, "layers", "*", "c", "**"), recursive=True)
                   if os.path.isfile(f))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        blobs = list(ex.map(lambda f: open(f, "rb").read(), files))
    out: dict = {"chunks": len(files), "compressed_bytes": sum(len(b) for b in blobs),
                 "read_s": time.perf_counter() - t0}
    zstd = numcodecs.Zstd()

    def cpu_decode() -> list:
        with ThreadPoolExecutor(threads) as ex:
            return list(ex.map(lambda b: zstd.decode(b[:-4]), blobs))  # (the last 4 bytes: crc32c)

    t0 = time.perf_counter()
    ref = cpu_decode()
    out["cpu_decode_s_first"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = cpu_decode()
    out["cpu_decode_s"] = time.perf_counter() - t0
    out["raw_bytes"] = sum(len(r) for r in ref)
    try:
        from nvidia import nvcomp

        out["nvcomp"] = getattr(nvcomp, "__version__", "?")
        codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
        sizes = [len(b) - 4 for b in blobs]
        host = cp.cuda.alloc_pinned_memory(sum(sizes))
        staged = np.frombuffer(host, np.uint8, sum(sizes))
        offs = np.concatenate([[0], np.cumsum(sizes)])
        for b, a, e in zip(blobs, offs[:-1], offs[1:]):
            staged[a:e] = np.frombuffer(b, np.uint8, e - a)

        out["nvcomp_names"] = [k for k in dir(nvcomp) if not k.startswith("_")]
        mode = {"batch": hasattr(nvcomp, "as_arrays")}

        def gpu_decode():
            d = cp.asarray(staged)  # one host-to-device copy of every compressed chunk
            arrays = [nvcomp.as_array(d[a:e]) for a, e in zip(offs[:-1], offs[1:])]
            if mode["batch"]:
                try:
                    got = codec.decode(nvcomp.as_arrays(arrays))
                except Exception as exc:  # noqa: BLE001 - then one decode call per chunk
                    out["nvcomp_batch_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    mode["batch"] = False
            if not mode["batch"]:
                got = [codec.decode(a) for a in arrays]
            cp.cuda.Device().synchronize()
            return got

        gpu_decode()
        t0 = time.perf_counter()
        got = gpu_decode()
        out["gpu_h2d_and_decode_s"] = time.perf_counter() - t0
        first = cp.asnumpy(cp.asarray(got[0]).view(cp.uint8)).tobytes()
        out["gpu_equals_cpu_first_chunk"] = first == bytes(ref[0])
        out["gpu_over_cpu"] = out["cpu_decode_s"] / out["gpu_h2d_and_decode_s"]
        out["gpu_batched"] = mode["batch"]
    except Exception as exc:  # noqa: BLE001 - not installed, or the API differs: reported, not fatal
        traceback.print_exc()
        out["nvcomp_error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
    return out


def make_jpeg_folder(root: Path, n: int, size: int = 256) -> Path:
    """``n`` smooth random RGB JPEGs (quality 90, ``size`` x 5/4 ``size`` px, sizes like photos') in an
    ImageFolder test split of ten classes (bench/extract_throughput.py's images, larger)."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import encode_jpeg

    g = torch.Generator().manual_seed(0)
    for lo in range(0, n, 256):
        small = torch.rand((min(256, n - lo), 3, 14, 14), generator=g)
        images = (F.interpolate(small, size=(size, size * 5 // 4), mode="bicubic").clamp(0, 1) * 255).to(torch.uint8)
        for k, data in enumerate(encode_jpeg(list(images), quality=90), start=lo):
            folder = root / "test" / f"class{k % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{k:05d}.jpg").write_bytes(data.numpy().tobytes())
    return root


def jpeg_rows(n: int, batch: int = 256) -> dict:
    """Extraction over a JPEG folder end to end (``extract_store`` of a random-init ResNet-50, ``pool``
    and ``logits``, the folder's evaluation transform Resize(256) + CenterCrop(224), repsim's default
    workers), once with the GPU decoding (nvJPEG, repsim/extract/jpeg.py) and once with ``REPSIM_NVJPEG=0``
    (PIL in DataLoader workers), after a warm-up extraction of one batch on each route; the decoders'
    agreement on the first batch (uint8 levels of the decoded images, and the transformed batches)
    and the two stores' logits."""
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    from repsim.extract import jpeg as xj
    from repsim.extract.pipeline import extract_store
    from repsim.store.reader import open_store
    from repsim.train.data import build_dataset

    root = Path(tempfile.mkdtemp(prefix="repsim-jpeg-"))
    try:
        t0 = time.perf_counter()
        make_jpeg_folder(root / "images", n)
        out: dict = {"n": n, "batch": batch, "make_s": time.perf_counter() - t0,
                     "jpeg_mb": sum(f.stat().st_size for f in (root / "images").rglob("*.jpg")) / 2**20}
        data = str(root / "images")
        ds = build_dataset(data, "test")
        tf, why = xj.choose(ds, "cuda")
        out["route"] = why
        if tf is None:
            raise RuntimeError(f"the nvJPEG route was not chosen: {why}")
        blobs = [read_file(p) for p, _ in ds.base.samples[:batch]]
        gpu = decode_jpeg(blobs, mode=ImageReadMode.RGB, device="cuda")
        cpu = [decode_jpeg(b, mode=ImageReadMode.RGB) for b in blobs]
        levels = [(g.cpu().int() - c.int()).abs() for g, c in zip(gpu, cpu)]
        out["decode_max_abs_levels"] = int(max(int(d.max()) for d in levels))
        out["decode_mean_abs_levels"] = float(np.mean([float(d.float().mean()) for d in levels]))
        xg, xc = xj.decode_batch(blobs, tf, "cuda").cpu(), xj.decode_batch(blobs, tf, "cpu")
        out["batch_max_abs_diff"] = float((xg - xc).abs().max())  # normalised units (1 level ~ 0.017)
        kw = dict(split="test", layers="pool,logits", batch_size=batch, device="cuda", progress=False)
        for route in ("0", "1"):  # warm-ups: one batch each (worker start, cuDNN, nvJPEG initialisation)
            os.environ["REPSIM_NVJPEG"] = route
            extract_store("torchvision:resnet50", data, root / f"warm{route}.zarr", **kw, chunk_rows=batch)
        for route, key in (("0", "cpu_decode"), ("1", "nvjpeg")):
            os.environ["REPSIM_NVJPEG"] = route
            t0 = time.perf_counter()
            extract_store("torchvision:resnet50", data, root / f"{key}.zarr", **kw)
            out[f"{key}_s"] = time.perf_counter() - t0
            out[f"{key}_img_per_s"] = n / out[f"{key}_s"]
        os.environ.pop("REPSIM_NVJPEG", None)
        a, b = open_store(str(root / "cpu_decode.zarr")), open_store(str(root / "nvjpeg.zarr"))
        la, lb = np.asarray(a.logits), np.asarray(b.logits)
        out["logits_max_abs_diff"] = float(np.abs(la - lb).max())
        out["logits_max_abs"] = float(np.abs(la).max())
        out["labels_equal"] = bool(np.array_equal(np.asarray(a.labels), np.asarray(b.labels)))
        out["nvjpeg_route_recorded"] = xj.ROUTE_NOTE in b.attrs["dataset"]["transform"]
        out["speedup"] = out["cpu_decode_s"] / out["nvjpeg_s"]
        print(f"jpeg: {n} JPEGs, extraction with CPU decoding {out['cpu_decode_s']:.2f} s "
              f"({out['cpu_decode_img_per_s']:,.0f} img/s), with nvJPEG {out['nvjpeg_s']:.2f} s "
              f"({out['nvjpeg_img_per_s']:,.0f} img/s): {out['speedup']:.2f}x; decoders differ by at most "
              f"{out['decode_max_abs_levels']} levels (mean {out['decode_mean_abs_levels']:.3f}); logits max |Δ| "
              f"{out['logits_max_abs_diff']:.2e} of max {out['logits_max_abs']:.2f}", flush=True)
        return out
    finally:
        os.environ.pop("REPSIM_NVJPEG", None)
        shutil.rmtree(root, ignore_errors=True)


def write_md(res: dict) -> None:
    from _results import replace_section

    lines = ["## gpu", "",
             f"`python bench/gpu.py` on {res['device']} ({res['date']}; CuPy {res['cupy']}, "
             f"{res['cpus']} CPU cores). Every ratio is of two timings taken in the same run.", "",
             "| row | repsim | floor, same run | ratio |", "|---|---|---|---|"]
    a = res.get("allpairs")
    if isinstance(a, dict) and a.get("ratio"):
        lines.append(f"| in-memory all-pairs CKA, L = {a['L']}, batch {a['n']:,} × {a['p']:,} float32 "
                     f"(`MinibatchCKA.update`) | {a['update_s'] * 1e3:.1f} ms | the {a['L']} float32 Grams alone: "
                     f"{a['grams_fp32_s'] * 1e3:.1f} ms ({a['tflops_grams']:.0f} TFLOP/s) | **{a['ratio']:.2f}×** "
                     f"(max abs CKA error vs NumPy float64 {a.get('max_abs_cka_err_vs_host_float64', float('nan')):.1e}) |")
        for v in a.get("variants", [])[1:]:
            if "s" in v:
                lines.append(f"| … {v['label']} | {v['s'] * 1e3:.1f} ms | the same Grams | {v['ratio']:.2f}× "
                             f"(error vs NumPy float64 {v.get('max_abs_cka_err_vs_host_float64', float('nan')):.1e}) |")
        if a.get("grams_fp64_s"):
            lines.append(f"| (the {a['L']} Grams as float64 DGEMMs) | {a['grams_fp64_s'] * 1e3:.1f} ms "
                         f"({a['tflops_grams64']:.0f} TFLOP/s) | | |")
    s = res.get("store")
    if isinstance(s, dict) and "cuda_s" in s:
        lines.append(f"| `cka_matrix(device=\"cuda\")`, {s['stores']} stores, n = {s['n']:,}, {s['columns']} columns, "
                     f"{s['bytes_on_disk'] / 1e9:.2f} GB zstd, batch {s['batch']}, 1 epoch, {s['threads']} reader "
                     f"threads | {s['cuda_s']:.2f} s (GPU pool peak {s['gpu_pool_peak_bytes'] / 2**30:.2f} GiB) | "
                     f"the engine's read schedule alone: {s['engine_read_s']:.2f} s (with the uploads, no "
                     f"compute: {s['engine_read_upload_s']:.2f} s) | **{s['ratio_to_read']:.2f}×** "
                     f"({'chunks decoded on the GPU' if s.get('gpu_decoding') else 'chunks decoded on the CPU'}) |")
        if "cuda_cpu_decoding_s" in s:
            lines.append(f"| … the same with the CPU decoding the chunks (`REPSIM_GPU_DECODE=0`, today's read "
                         f"schedule) | {s['cuda_cpu_decoding_s']:.2f} s | with the GPU decoding them: {s['cuda_s']:.2f} s | "
                         f"GPU decoding at **{s['gpu_decoding_over_cpu_decoding']:.2f}×** the CPU decoding's speed "
                         f"({'faster' if s['gpu_decoding_over_cpu_decoding'] > 1 else 'slower'}; both within 1e-9 "
                         f"of the CPU's: {s.get('equal_to_cpu_within_1e-9')}; max abs diff "
                         f"{s.get('max_abs_cuda_cpu_decoding_vs_cpu', float('nan')):.1e}) |")
        if "cuda_decode_per_column_s" in s:
            lines.append(f"| … the GPU decoding one call per (batch group, column) (the route before the spans of "
                         f"{s['decode_call_bytes'] / 2**20:.0f} MiB per call) | {s['cuda_decode_per_column_s']:.2f} s | "
                         f"spans: {s['cuda_s']:.2f} s | spans {s['cuda_decode_per_column_s'] / s['cuda_s']:.2f}× as fast "
                         f"(max abs diff {s['max_abs_decode_per_column_vs_spans']:.1e}) |")
        lines.append(f"| the same on the CPU, all {res['cpus']} cores (`device=\"cpu\"`) | {s['cpu_all_cores_s']:.2f} s | "
                     f"`device=\"cuda\"`: {s['cuda_s']:.2f} s | cuda {s['cpu_over_cuda']:.2f}× faster "
                     f"(max abs diff {s['max_abs_cuda_vs_cpu']:.1e}) |")
    nv = s.get("nvcomp") if isinstance(s, dict) else None
    if isinstance(nv, dict) and "gpu_h2d_and_decode_s" in nv:
        lines.append(f"| decoding the same stores' {nv['chunks']} layer chunks ({nv['compressed_bytes'] / 1e9:.2f} GB zstd → "
                     f"{nv['raw_bytes'] / 1e9:.2f} GB) on the GPU: nvCOMP {nv.get('nvcomp', '?')} zstd, "
                     f"{'one batched call' if nv.get('gpu_batched') else 'one call per chunk'}, the compressed bytes "
                     f"copied once (the library alone; the rows above time the engine's route) | {nv['gpu_h2d_and_decode_s']:.3f} s | CPU decoding "
                     f"(numcodecs zstd, {s['threads']} threads): {nv['cpu_decode_s']:.3f} s | GPU "
                     f"{nv['gpu_over_cpu']:.2f}× faster (first chunk byte-identical: {nv.get('gpu_equals_cpu_first_chunk')}) |")
    elif isinstance(nv, dict) and "nvcomp_error" in nv:
        lines.append(f"| GPU decoding (nvCOMP) | failed: {nv['nvcomp_error'][:160]} | | |")
    for key in sorted((k for k in res if k.startswith("heatmap")), key=lambda k: res[k].get("images", 0)):
        h = res[key]
        if not (isinstance(h, dict) and "floor" in h):
            continue
        f = h["floor"]
        mm = h["repsim"].get("modes", {}).get("matched", h["repsim"])  # (results before the defaults row: one row)
        lines.append(f"| 18-network heatmap, ResNet-18 64 px, {h.get('images', '?')} images, {h.get('columns', '?')} columns "
                     f"(`repsim extract` + `repsim cka --device cuda`, the peer's batches, one epoch) | "
                     f"{mm['seconds']['total']:.1f} s | floor "
                     f"{f['seconds']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in f["parts"].items())
                     + f"); pytorch-cka {h['peer']['seconds']['total']:.1f} s | **{f['repsim_over_floor']:.2f}×** the floor, "
                     + (f"{h['ratio_matched_work']:.1f}× faster than pytorch-cka; with `repsim cka` at its defaults "
                        f"{h['repsim']['seconds']['total']:.1f} s, **{f.get('repsim_defaults_over_floor', float('nan')):.2f}×** "
                        f"the floor, {h['ratio']:.1f}× |" if "ratio_matched_work" in h
                        else f"{h['ratio']:.1f}× faster than pytorch-cka |"))
        jm = h.get("extract_job_modes")
        if isinstance(jm, dict) and "threads" in jm:
            lines.append(f"| … `repsim extract` of the {h.get('networks', 18)} checkpoints as threads of one process "
                         f"(`--job-mode threads`, the GPU default) | {jm['threads']['seconds']:.1f} s | spawned processes "
                         f"(`--job-mode processes`, the route before): {jm['processes']['seconds']:.1f} s | threads at "
                         f"**{jm['processes_over_threads']:.2f}×** the processes' speed "
                         f"({'faster' if jm['processes_over_threads'] > 1 else 'slower'}) |")
            from heatmap18 import setup_summary

            for mode in ("threads", "processes"):
                summary = setup_summary(jm[mode])  # where each mode's time went, summed over the stores
                if summary:
                    lines.append(f"| … {mode}: the stores' setup and passes | {summary} | | |")
    x = res.get("extract")
    if isinstance(x, dict) and x.get("ratio_16_blocks") is not None:
        lines.append(f"| extraction of ResNet-50's 16 blocks (`--spatial mean`, 224 px, in memory; "
                     f"bench/extract_throughput.py row (d)) | fixed cost of a store {x.get('fixed_cost_s') or float('nan'):.2f} s | "
                     f"the forward from pinned host batches (row (b)) | **{x['ratio_16_blocks']:.2f}×** the forward's "
                     f"rate (pool+logits {x.get('ratio_pool_logits') or float('nan'):.2f}×; section extract_throughput_gpu) |")
    j = res.get("jpeg")
    if isinstance(j, dict) and "nvjpeg_s" in j:
        lines.append(f"| extraction over a folder of {j['n']:,} JPEGs ({j['jpeg_mb']:.0f} MB; ResNet-50, Resize(256) + "
                     f"CenterCrop(224), pool+logits) with nvJPEG (repsim/extract/jpeg.py) | {j['nvjpeg_s']:.2f} s "
                     f"({j['nvjpeg_img_per_s']:,.0f} img/s) | PIL in DataLoader workers (`REPSIM_NVJPEG=0`): "
                     f"{j['cpu_decode_s']:.2f} s ({j['cpu_decode_img_per_s']:,.0f} img/s) | **{j['speedup']:.2f}×** faster "
                     f"(decoders differ by ≤ {j['decode_max_abs_levels']} levels of 255, mean "
                     f"{j['decode_mean_abs_levels']:.3f}; logits max abs diff {j['logits_max_abs_diff']:.1e} of "
                     f"{j['logits_max_abs']:.1f}) |")
    if isinstance(a, dict) and a.get("phases_s"):
        lines += ["", "Phases of the float32-slab route's update, each synchronised: " + "; ".join(
            f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k}: {v}" for k, v in a["phases_s"].items()) + "."]
    for key in ("allpairs", "store", "extract", "jpeg", *(k for k in res if k.startswith("heatmap"))):
        if isinstance(res.get(key), dict) and "error" in res[key]:
            lines.append(f"| {key} | failed: {res[key]['error'].splitlines()[-1][:200]} | | |")
    (HERE / "RESULTS.md").exists() and replace_section("gpu", "\n".join(lines) + "\n")


ROW_TIMEOUTS = {"allpairs": 90, "heatmap": 270, "extract_profile": 120, "extract": 110, "store": 90, "jpeg": 90}


def _steps(args) -> list[tuple[str, Any]]:
    """(key, function) of every row asked for, in the order they run."""
    steps = []
    if args.heatmap:  # (the headline rows first: a call that runs out of time keeps them)
        steps += [(heatmap_key(n), lambda n=n: heatmap_rows(n, _row_timeout(args, heatmap_key(n)) - 15,
                                                            job_modes=n == 2048)) for n in args.heatmap_n]
    if args.extract_profile:
        steps.append(("extract_profile", extract_profile))
    if args.extract:
        steps.append(("extract", lambda: extract_rows(args.extract_n)))
    if not args.skip_store:
        steps.append(("store", lambda: store_rows(args.n, args.store_batch)))
    if args.jpeg:
        steps.append(("jpeg", lambda: jpeg_rows(args.jpeg_n)))
    if not args.skip_allpairs:  # (measured before, 5 s: last, in what the --budget leaves)
        steps.append(("allpairs", lambda: allpairs(args.layers, args.batch, args.features, args.repeats)))
    return steps


def _row_timeout(args, key: str) -> int:
    """A row's timeout: ``--row-timeout KEY=S``, else :data:`ROW_TIMEOUTS` (a heatmap row: ``--heatmap-timeout``)."""
    given = dict(item.split("=", 1) for item in args.row_timeout)
    if key in given:
        return int(given[key])
    if key.startswith("heatmap"):
        return args.heatmap_timeout
    return ROW_TIMEOUTS.get(key, 120)


def _run_row(key: str, timeout: float) -> dict:
    """Run row ``key`` in a child process (this script with ``--run-row``) in a process group of its
    own; on its timeout the whole group (the heatmap's commands too) is killed. Its result, or why not."""
    import signal

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--run-row", key, "--row-out", path]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"error": f"timed out after {timeout:.0f} s (killed with its process group)"}
    finally:
        text = Path(path).read_text() if os.path.getsize(path) else ""
        os.unlink(path)
    if text:
        return json.loads(text)
    return {"error": f"the row's process exited with status {proc.returncode} and no result (its output above)"}


def _cuda_missing() -> str | None:
    """Why the rows cannot run here (no CuPy, no CUDA device), or None."""
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - not installed, or no driver
        return f"CuPy/CUDA unavailable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1500)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=8192, help="examples per store of the store row")
    ap.add_argument("--store-batch", type=int, default=1024)
    ap.add_argument("--skip-store", action="store_true")
    ap.add_argument("--extract", action="store_true", help="also run bench/extract_throughput.py --device cuda")
    ap.add_argument("--extract-n", type=int, default=10000)
    ap.add_argument("--extract-profile", action="store_true",
                    help="also time --spatial mean's reductions against the forward and profile a one-batch extraction")
    ap.add_argument("--heatmap", action="store_true", help="also run bench/heatmap18.py on the GPU (several minutes)")
    ap.add_argument("--heatmap-n", type=int, nargs="+", default=[2048],
                    help="images of the heatmap rows, one row each (e.g. 2048 8192: the issue's two criteria)")
    ap.add_argument("--heatmap-timeout", type=int, default=270, help="seconds for each heatmap row")
    ap.add_argument("--jpeg", action="store_true", help="also time extraction over a JPEG folder, nvJPEG against CPU decoding")
    ap.add_argument("--jpeg-n", type=int, default=4096, help="JPEGs of the jpeg row")
    ap.add_argument("--skip-allpairs", action="store_true")
    ap.add_argument("--row-timeout", nargs="*", default=[], metavar="KEY=S",
                    help=f"seconds for a row (defaults {ROW_TIMEOUTS}; heatmap rows: --heatmap-timeout)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all the rows: a row gets at most what is left of it (the rows after one that "
                         "would start with under 20 s left are skipped, with the reason)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of an earlier run in --out on the same device and day (a second device call adds rows)")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    ap.add_argument("--no-markdown", action="store_true")
    ap.add_argument("--force-rows", action="store_true",
                    help="run the rows even without CUDA (each fails in its own process with its error: a dry run "
                         "of the script's plumbing; use with --no-markdown --out elsewhere)")
    ap.add_argument("--run-row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = _steps(args)
    if args.run_row:  # a child of _run_row: one row, its result as JSON
        fn = dict(steps)[args.run_row]
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 - a failed row is reported, the others still run
            traceback.print_exc()
            got = {"error": f"{type(exc).__name__}: {exc}"}
        Path(args.row_out).write_text(json.dumps(got, default=float))
        return 0
    missing = _cuda_missing()
    res: dict = {"benchmark": "gpu", "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "numpy": np.__version__}
    if missing is None:
        import cupy as cp

        res.update(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), cupy=cp.__version__)
    else:
        res.update(device=f"none ({missing})", cupy=None)
    if args.merge and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())
        if (earlier.get("device"), earlier.get("date")) == (res["device"], res["date"]):
            res = {**earlier, **res}
    t_start = time.perf_counter()
    for key, _ in steps:
        left = None if args.budget is None else args.budget - (time.perf_counter() - t_start)
        if missing is not None and not args.force_rows:
            print(f"{key}: skipped: {missing}", flush=True)
            continue  # (a dry run: the rows' results, and RESULTS.md, are left as they were)
        if left is not None and left < 20:
            res[key] = {"error": f"skipped: {left:.0f} s of the --budget left"}
        else:
            timeout = _row_timeout(args, key) if left is None else min(_row_timeout(args, key), left - 5)
            t0 = time.perf_counter()
            print(f"=== row {key} (timeout {timeout:.0f} s)", flush=True)
            res[key] = _run_row(key, timeout)
            res[key]["wall_s"] = time.perf_counter() - t0
        print(json.dumps({key: res[key]}, default=float)[:3000], flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        from _results import provenance

        res["provenance"] = provenance()
        Path(args.out).write_text(json.dumps(res, indent=2, default=float) + "\n")  # after every row
        if not args.no_markdown:
            write_md(res)
        mirror(args.out, markdown=not args.no_markdown)
    return 0


def mirror(out: str, markdown: bool) -> None:
    """On the device machine (``$OUT`` set by its runner), copy the JSON and RESULTS.md into ``$OUT``
    after every row: a call cut off by its time limit still brings back the rows it finished."""
    dest = os.environ.get("OUT")
    if not dest or not os.path.isdir(dest):
        return
    for src in [out] + ([str(HERE / "RESULTS.md")] if markdown else []):
        target = os.path.join(dest, os.path.basename(src))
        if os.path.abspath(src) != os.path.abspath(target) and os.path.isfile(src):
            shutil.copyfile(src, target)


if __name__ == "__main__":
    sys.exit(main())
