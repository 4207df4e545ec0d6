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
  reads), when asked (``--heatmap``; several minutes: give the device call room).

Writes bench/results/gpu.json (with the device name) and the ``## gpu`` section of bench/RESULTS.md.

    python bench/gpu.py                 # about 2 minutes on an H200
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

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))


def _sync() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


def _best(f, repeats: int) -> float:
    f()
    _sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def allpairs(L: int, n: int, p: int, repeats: int) -> dict:
    """MinibatchCKA.update on L CuPy layers (n, p) float32 vs the L float32 Grams alone."""
    import cupy as cp

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
    t_update = _best(lambda: MinibatchCKA(L, keep_batches=False).update(layers), repeats)
    t_grams = _best(lambda: [cp.matmul(x, x.T) for x in layers], repeats)
    h32 = batch_hsic(layers)
    h64 = batch_hsic(layers, compute_dtype="float64")
    err = float(np.max(np.abs(hsic_to_cka(h32) - hsic_to_cka(h64))))
    return {"L": L, "n": n, "p": p, "update_s": t_update, "grams_fp32_s": t_grams,
            "ratio": t_update / t_grams, "tflops_grams": 2 * L * n * n * p / t_grams / 1e12,
            "max_abs_cka_err_vs_float64": err, "gpu_pool_bytes": int(pool.total_bytes())}


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
        runs = []
        for _ in range(2):
            pool.free_all_blocks()
            t0 = time.perf_counter()
            got = cka_matrix(paths, device="cuda", **kw)
            runs.append(time.perf_counter() - t0)
        out["gpu_pool_peak_bytes"] = int(pool.total_bytes())
        reads.append(engine_read(paths, batch_size, threads))
        out["engine_read_upload_s"] = engine_read(paths, batch_size, threads, upload=True)
        t0 = time.perf_counter()
        ref = cka_matrix(paths, device="cpu", threads=os.cpu_count(), **kw)
        out["cpu_all_cores_s"] = time.perf_counter() - t0
        out.update(cuda_s=min(runs), cuda_runs=runs, engine_read_s=min(reads), engine_reads=reads,
                   ratio_to_read=min(runs) / min(reads), cpu_over_cuda=out["cpu_all_cores_s"] / min(runs),
                   columns=int(got.values.shape[0]),
                   max_abs_cuda_vs_cpu=float(np.nanmax(np.abs(got.values - ref.values))))
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def extract_rows(n: int) -> dict:
    out = HERE / "results" / "extract_throughput_gpu.json"  # (and its own ## extract_throughput_gpu section)
    r = subprocess.run([sys.executable, str(HERE / "extract_throughput.py"), "--device", "cuda", "--gpu-n", str(n)],
                       capture_output=True, text=True, timeout=240)
    print(r.stdout[-4000:], r.stderr[-3000:], sep="\n")
    return json.loads(out.read_text()) if out.is_file() else {"error": r.stderr[-2000:]}


def heatmap_rows(n: int, timeout: int) -> dict:
    """bench/heatmap18.py at the ResNet-18 scale on the GPU (18 networks, 64 px, ``n`` images): repsim
    (extract + cka) against pytorch-cka, and the workflow's floor, as that script measures them."""
    out = HERE / "results" / "heatmap18_gpu.json"
    cmd = [sys.executable, str(HERE / "heatmap18.py"), "--scale", "resnet18", "--device", "cuda", "--nets", "18",
           "--image-size", "64", "--resnet-n", str(n), "--resnet-batch", "256", "--repsim-runs", "1",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-3000:], r.stderr[-2000:], sep="\n")
    if not out.is_file():
        return {"error": (r.stderr or r.stdout)[-2000:]}
    run = json.loads(out.read_text())["runs"][-1]
    keep = ("networks", "columns", "images", "repsim", "peer", "ratio", "floor", "agreement")
    return {k: run[k] for k in keep if k in run}


def write_md(res: dict) -> None:
    from _results import replace_section

    lines = [f"## gpu", "",
             f"`python bench/gpu.py` on {res['device']} ({res['date']}; CuPy {res['cupy']}, "
             f"{res['cpus']} CPU cores). Every ratio is of two timings taken in the same run.", "",
             "| row | repsim | floor, same run | ratio |", "|---|---|---|---|"]
    a = res.get("allpairs")
    if isinstance(a, dict) and "ratio" in a:
        lines.append(f"| in-memory all-pairs CKA, L = {a['L']}, batch {a['n']:,} × {a['p']:,} float32 "
                     f"(`MinibatchCKA.update`) | {a['update_s'] * 1e3:.1f} ms | the {a['L']} float32 Grams alone: "
                     f"{a['grams_fp32_s'] * 1e3:.1f} ms ({a['tflops_grams']:.0f} TFLOP/s) | **{a['ratio']:.2f}×** "
                     f"(max abs CKA error vs float64 Grams {a['max_abs_cka_err_vs_float64']:.1e}) |")
    s = res.get("store")
    if isinstance(s, dict) and "cuda_s" in s:
        lines.append(f"| `cka_matrix(device=\"cuda\")`, {s['stores']} stores, n = {s['n']:,}, {s['columns']} columns, "
                     f"{s['bytes_on_disk'] / 1e9:.2f} GB zstd, batch {s['batch']}, 1 epoch, {s['threads']} reader "
                     f"threads | {s['cuda_s']:.2f} s (GPU pool peak {s['gpu_pool_peak_bytes'] / 2**30:.2f} GiB) | "
                     f"the engine's read schedule alone: {s['engine_read_s']:.2f} s (with the uploads, no "
                     f"compute: {s['engine_read_upload_s']:.2f} s) | **{s['ratio_to_read']:.2f}×** |")
        lines.append(f"| the same on the CPU, all {res['cpus']} cores (`device=\"cpu\"`) | {s['cpu_all_cores_s']:.2f} s | "
                     f"`device=\"cuda\"`: {s['cuda_s']:.2f} s | cuda {s['cpu_over_cuda']:.2f}× faster "
                     f"(max abs diff {s['max_abs_cuda_vs_cpu']:.1e}) |")
    h = res.get("heatmap")
    if isinstance(h, dict) and "floor" in h:
        f = h["floor"]
        lines.append(f"| 18-network heatmap, ResNet-18 64 px, {h.get('images', '?')} images, {h.get('columns', '?')} columns "
                     f"(`repsim extract` + `repsim cka --device cuda`) | {h['repsim']['seconds']['total']:.1f} s | floor "
                     f"{f['seconds']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in f["parts"].items())
                     + f"); pytorch-cka {h['peer']['seconds']['total']:.1f} s | **{f['repsim_over_floor']:.2f}×** the floor, "
                     f"{h['ratio']:.1f}× faster than pytorch-cka |")
    for key in ("allpairs", "store", "extract", "heatmap"):
        if isinstance(res.get(key), dict) and "error" in res[key]:
            lines.append(f"| {key} | failed: {res[key]['error'].splitlines()[-1][:200]} | | |")
    (HERE / "RESULTS.md").exists() and replace_section("gpu", "\n".join(lines) + "\n")


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
    ap.add_argument("--heatmap", action="store_true", help="also run bench/heatmap18.py on the GPU (several minutes)")
    ap.add_argument("--heatmap-n", type=int, default=2048)
    ap.add_argument("--heatmap-timeout", type=int, default=420)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    ap.add_argument("--no-markdown", action="store_true")
    args = ap.parse_args()
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    res: dict = {"benchmark": "gpu", "device": props["name"].decode(), "cupy": cp.__version__,
                 "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "numpy": np.__version__}
    steps = [("allpairs", lambda: allpairs(args.layers, args.batch, args.features, args.repeats))]
    if not args.skip_store:
        steps.append(("store", lambda: store_rows(args.n, args.store_batch)))
    if args.extract:
        steps.append(("extract", lambda: extract_rows(args.extract_n)))
    if args.heatmap:
        steps.append(("heatmap", lambda: heatmap_rows(args.heatmap_n, args.heatmap_timeout)))
    for key, step in steps:
        t0 = time.perf_counter()
        try:
            res[key] = step()
        except Exception as exc:  # noqa: BLE001 - a failed row is reported, the others still run
            traceback.print_exc()
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}
        res[key]["wall_s"] = time.perf_counter() - t0
        print(json.dumps({key: res[key]}), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if not args.no_markdown:
        write_md(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
