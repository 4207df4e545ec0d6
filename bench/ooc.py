"""Out-of-core engine benchmark (issue 4): cka_matrix over stores vs a plain Dask read of the same arrays.

One run measures, on this machine:
  * t_read     plain Dask read of every (store, layer) array (threaded scheduler, chunks decompressed
               and dropped), in a fresh process;
  * t_cka      ``cka_matrix`` over the same stores, one epoch, in a fresh process (peak RSS recorded);
  * t_compute  the same batches through the same engine code with the stores preloaded in RAM
               (no I/O, no decompression);
  * t_engine_read  the engine's read schedule for the same epoch (same reader, batch groups and
               prefetch) without compute: the engine's I/O path against Dask's;
and extrapolates the paper's case (18 ResNet-50s × 16 blocks, 50,000 ImageNet val images) from the
architecture and stated hardware assumptions.  Writes ``--out`` (default bench/results/ooc.json) and,
for a full run into the default ``--out`` only, the ``## ooc`` section of bench/RESULTS.md: a ``--quick``
run (its JSON goes to the temporary directory unless ``--out`` says elsewhere) or an ``--out``
elsewhere never replaces the recorded results.

    python bench/ooc.py                              # ~0.7 GB of float16 stores (records)
    python bench/ooc.py --quick --out /tmp/ooc.json  # ~0.1 GB, for a smoke run
"""
from __future__ import annotations

import argparse
import json
import os

# One BLAS thread per process unless told otherwise: on a shared, oversubscribed box multi-threaded
# OpenBLAS spins and runs several times slower (measured: 256×16384 Gram 0.40 s vs 0.06 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

# (C, H, W) of a small "ResNet-like" stack of blocks; float16, post-ReLU-like (about half zeros)
LAYERS = {"block_a": (64, 16, 16), "block_b": (128, 8, 8), "block_c": (256, 4, 4), "pool": (512,)}


# ---------------------------------------------------------------------------------------------- data


def _layer_dask(n: int, shape: tuple[int, ...], chunk: int, seed: int):
    import dask.array as da

    def make(block_info=None):
        loc = block_info[None]["chunk-location"][0]
        rows = block_info[None]["chunk-shape"][0]
        rng = np.random.default_rng([seed, loc])
        z = rng.normal(size=(rows, 8)).astype(np.float32)  # a shared low-rank signal across layers
        mix = np.random.default_rng([seed, 10**6]).normal(size=(8, int(np.prod(shape)))).astype(np.float32)
        x = z @ mix + rng.normal(size=(rows, mix.shape[1])).astype(np.float32)
        return np.maximum(x, 0).astype(np.float16).reshape((rows,) + shape)

    chunks = ((chunk,) * (n // chunk) + ((n % chunk,) if n % chunk else ()),) + tuple((s,) for s in shape)
    return da.map_blocks(make, chunks=chunks, dtype=np.float16)


def make_stores(root: str, n_stores: int, n: int) -> list[str]:
    import repsim

    paths = []
    for s in range(n_stores):
        path = os.path.join(root, f"net{s:02d}.zarr")
        layers = {name: _layer_dask(n, shape, 256, 1000 * s + i) for i, (name, shape) in enumerate(LAYERS.items())}
        repsim.save_store(path, layers=layers, labels=np.arange(n) % 10, progress=False,
                          meta={"model": {"arch": "synthetic", "objective": "bench", "seed": s}})
        paths.append(path)
    return paths


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------------------- timings

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
mode, paths, kw = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
import repsim, dask
t0 = time.perf_counter()
if mode == "read":  # plain Dask: every chunk of every array read and decompressed, then dropped
    arrays = [repsim.open_store(p).layer(l) for p in paths for l in repsim.open_store(p).layers]
    touched = [a.map_blocks(lambda b: np.zeros((1,) * b.ndim, b.dtype), chunks=(1,) * a.ndim) for a in arrays]
    dask.compute(*[t.sum() for t in touched], scheduler="threads")
elif mode == "engine_read":  # the engine's read schedule for one epoch (same reader, groups, prefetch), no compute
    from repsim.engine.blocks import BatchPlan, BlockReader, block_rows_for, resolve_columns
    stores, columns, ids = resolve_columns(paths)
    g = block_rows_for(columns, ids.shape[0])
    plan = BatchPlan(n=ids.shape[0], batch_size=kw["batch_size"], block_rows=g)
    groups = plan.groups(0)
    with BlockReader(columns, ids.shape[0], g) as reader:
        units = [(i, c) for i in range(len(groups)) for c in range(len(columns))]
        for _ in reader.prefetched(units, lambda u: reader.gather(u[1], groups[u[0]])):
            pass
else:
    res = repsim.cka_matrix(paths, progress=False, **kw)
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""

# Runs the measured process as its only child and reports that child's peak RSS.  (A process's
# ru_maxrss on Linux includes the RSS of the image it was exec'ed from, so the measured process
# must be spawned from this small wrapper, not from the benchmark process itself.)
_WRAP = ("import json, resource, subprocess, sys; out = subprocess.run(sys.argv[1:], capture_output=True, text=True, "
         "check=True).stdout; r = json.loads(out.strip().splitlines()[-1]); "
         "r['maxrss_bytes'] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024; print(json.dumps(r))")


def child(mode: str, paths: list[str], **kw) -> dict:
    code = _CHILD.format(repo=REPO)
    out = subprocess.run([sys.executable, "-c", _WRAP, sys.executable, "-c", code, mode, json.dumps(paths),
                          json.dumps(kw)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_rate(paths: list[str]) -> float:
    """GB of float16 arrays read + decompressed (zstd, crc32c) per CPU-second, one thread: CPU time
    rather than wall time, so the figure does not depend on how loaded the machine is."""
    import repsim

    total = 0
    t0 = time.process_time()
    for p in paths:
        s = repsim.open_store(p)
        for layer in s.layers:
            for i in range(s.n_chunks):
                total += s.read_chunk(layer, i).nbytes
    return total / 1e9 / (time.process_time() - t0)


def compute_only(paths: list[str], batch_size: int, seed: int) -> tuple[float, float]:
    """The engine's own batch loop (_cka_segment) over one epoch with every chunk served from RAM."""
    from dataclasses import asdict

    from repsim.engine.minibatch import _cka_segment
    from repsim.engine.blocks import BatchPlan, BlockReader, block_rows_for, resolve_columns

    stores, columns, ids = resolve_columns(paths)
    n = ids.shape[0]
    g = block_rows_for(columns, n)
    plan = BatchPlan(n=n, batch_size=batch_size, shuffle="window", seed=seed, block_rows=g)
    preloaded = [np.asarray(s.zarr_array(c.layer)[...]) for c in columns for s in stores if s.path == c.path]

    class MemoryReader(BlockReader):
        def _chunks(self, c, first, last):
            cr = self.columns[c].chunk_rows
            return preloaded[c][first * cr:(last + 1) * cr]

    spec = {"plan": asdict(plan), "columns": [asdict(c) for c in columns], "device": "cpu", "spatial": "flatten",
            "debiased": True, "prefetch": 2, "threads": 2}
    with MemoryReader(columns, n, g) as reader:
        t0, c0 = time.perf_counter(), time.process_time()
        _cka_segment(spec, 0, 0, len(plan.groups(0)), reader=reader, xp=np)
        return time.perf_counter() - t0, time.process_time() - c0  # (wall, CPU of all threads)


# ------------------------------------------------------------------------------------ extrapolation


def resnet50_blocks() -> list[int]:
    """Per-example sizes of the 16 bottleneck outputs of ResNet-50 at 224×224 (torchvision)."""
    stages = [(3, 256, 56), (4, 512, 28), (6, 1024, 14), (3, 2048, 7)]
    return [c * s * s for blocks, c, s in stages for _ in range(blocks)]


def extrapolate(measured: dict) -> dict:
    nets, n, b, epochs = 18, 50_000, 1500, 10
    p = resnet50_blocks()
    cols = nets * len(p)
    bytes_per_example = nets * sum(p) * 2  # float16
    read_epoch = n * bytes_per_example
    batches = n // b  # window shuffle: ~n/b batches per epoch
    gram = 2.0 * b * n * nets * sum(p)  # Σ_batches 2 b² p  =  2 b n p per column
    factor = batches * cols * 2.0 * b * b  # U-centring and triangle copy of each column's b×b centred Gram
    hsic = batches * 2.0 * cols ** 2 * b * (b - 1) / 2  # one L×L product of U-centred upper triangles
    flops_epoch = gram + factor + hsic
    a = {
        "h100_fp32_tflops_sustained": 40.0,  # ~60 % of the 67 TFLOP/s FP32 (non-tensor) peak of an H100 SXM
        "node_storage_GBps": 5.0,  # local NVMe RAID / parallel-FS share per node
        "fs_aggregate_GBps": 60.0,  # aggregate parallel file-system bandwidth (caps scale-out)
        "zstd_decode_GBps_per_core": measured["decode_GBps_per_core"],  # measured here, per CPU-second
        "cores_per_node": 32,
        "pcie_h2d_GBps": 25.0,
    }
    t_compute = flops_epoch / (a["h100_fp32_tflops_sustained"] * 1e12)
    t_decode = read_epoch / (a["zstd_decode_GBps_per_core"] * 1e9 * a["cores_per_node"])
    t_pcie = read_epoch / (a["pcie_h2d_GBps"] * 1e9)
    per_node = {}
    for nodes in (1, 2, 4, 8, 16, 32):
        t_io = read_epoch / (min(nodes * a["node_storage_GBps"], a["fs_aggregate_GBps"]) * 1e9)
        t = max(t_io, t_compute / nodes, t_decode / nodes, t_pcie / nodes)
        per_node[nodes] = {"epoch_s": t, "ten_epochs_h": epochs * t / 3600,
                           "bound": ["storage", "compute", "decode", "pcie"][
                               int(np.argmax([t_io, t_compute / nodes, t_decode / nodes, t_pcie / nodes]))]}
    window_rows = b  # one batch per window at this scale (shuffle_window=1500)
    return {
        "case": f"{nets} ResNet-50 × {len(p)} blocks = {cols} columns, n = {n} ImageNet val, float16, "
                f"batch {b}, {epochs} epochs, window shuffle",
        "bytes_per_example_all_nets": bytes_per_example,
        "read_TB_per_epoch": read_epoch / 1e12,
        "read_TB_total": epochs * read_epoch / 1e12,
        "flops_per_epoch": flops_epoch,
        "flops_total": epochs * flops_epoch,
        "flops_share": {"grams": gram / flops_epoch, "gram_centering": factor / flops_epoch, "hsic": hsic / flops_epoch},
        "one_h100_compute_s_per_epoch": t_compute,
        "decode_s_per_epoch_one_node": t_decode,
        "pcie_s_per_epoch": t_pcie,
        "nodes": per_node,
        "memory": {
            "largest_column_read_GB": window_rows * max(p) * 2 / 1e9,
            "host_reads_in_flight_GB": 3 * window_rows * max(p) * 2 / 1e9,  # prefetch 2 + current
            "gpu_grams_GB": cols * b * b * 8 / 1e9,  # one b×b float64 centred Gram per column per batch
        },
        "assumptions": a,
    }


# -------------------------------------------------------------------------------------------- report


def _blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in threadpool_info()
                if i.get("user_api") == "blas"]
    except Exception:  # pragma: no cover
        info = []
    core = os.environ.get("OPENBLAS_CORETYPE")
    return ", ".join(info) + (f" (OPENBLAS_CORETYPE={core} set by the environment)" if core else "")


DEFAULT_OUT = os.path.join(HERE, "results", "ooc.json")
DEFAULT_OUT_CUDA = os.path.join(HERE, "results", "ooc_cuda.json")


def write_json(res: dict, out: str) -> None:
    from _results import provenance

    res["provenance"] = provenance()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=2)


def write_results(res: dict) -> None:
    """The ``## ooc`` section of bench/RESULTS.md from a results dict."""
    m, x = res["measured"], res["extrapolation"]
    lines = [
        "## ooc",
        "",
        f"`python bench/ooc.py{' --quick' if res['quick'] else ''}` on {res['machine']} "
        f"({res['date']}; BLAS threads {os.environ.get('OMP_NUM_THREADS')}, reader threads 2, load average "
        f"{res['load_average']}); stores: {m['n_stores']} × {len(LAYERS)} float16 layers, n = {m['n']}, "
        f"{m['store_GB_raw']:.2f} GB of arrays, {m['store_GB_disk']:.2f} GB on disk (zstd); page cache warm.",
        "",
        "| measurement | seconds | ratio to plain Dask read |",
        "|---|---:|---:|",
        f"| plain Dask read of every array (threaded) | {m['t_read']:.2f} | 1.00 |",
        f"| the engine's read schedule alone (same reader, groups, prefetch; no compute) | {m['t_engine_read']:.2f} | "
        f"**{m['t_engine_read'] / m['t_read']:.2f}** |",
        f"| `cka_matrix`, 1 epoch, flatten (as in the paper), batch {m['batch_size']} | {m['t_cka']:.2f} | "
        f"**{m['t_cka'] / m['t_read']:.2f}** |",
        f"| same batches, stores preloaded in RAM (compute only) | {m['t_compute']:.2f} | "
        f"{m['t_compute'] / m['t_read']:.2f} |",
        "",
        f"- Overlap: t_cka / max(t_read, t_compute) = {m['t_cka'] / max(m['t_read'], m['t_compute']):.2f} "
        f"(1.0 = reads fully hidden behind compute or vice versa); t_cka / (t_read + t_compute) = "
        f"{m['t_cka'] / (m['t_read'] + m['t_compute']):.2f}.",
        f"- Peak RSS of the `cka_matrix` process: {m['cka_maxrss_MB']:.0f} MB for {m['store_GB_disk']:.2f} GB of "
        f"stores ({m['cka_maxrss_MB'] / 1e3 / m['store_GB_disk']:.2f}× store size); plain Dask read process: "
        f"{m['read_maxrss_MB']:.0f} MB.",
        f"- Plain Dask read throughput: {m['read_GBps']:.2f} GB/s of float16 arrays (wall clock, {m['cores']} shared "
        f"cores); read + zstd decode + crc per CPU-second in one thread: {m['decode_GBps_per_core']:.2f} GB/s.",
        "- The machine was shared with other jobs (load average above), so wall-clock ratios are noisy; the "
        "CPU-time figures (decode rate, GFLOP/s) are the stable ones.",
        f"- Batch Grams of the float16 columns in float32 (default `compute_dtype=None`), formed on the 2 reader "
        f"threads next to decoding; {m['gflops']:.1f} GFLOP/s (2·b·n·p per column, counted as GEMM FLOPs) "
        f"sustained in the compute-only run; OpenBLAS kernel: {res.get('blas', '?')}.",
        (f"- CPU budget of one epoch: decoding {m['store_GB_raw'] / m['decode_GBps_per_core']:.2f} core-s (the rate "
         f"above) + batch Grams and HSIC {m.get('cpu_compute', float('nan')):.2f} core-s (compute-only run, all threads) "
         f"= {m['store_GB_raw'] / m['decode_GBps_per_core'] + m.get('cpu_compute', float('nan')):.2f} core-s: on "
         f"{m['cores']} cores at least {(m['store_GB_raw'] / m['decode_GBps_per_core'] + m.get('cpu_compute', float('nan'))) / m['cores']:.2f} s "
         f"= {(m['store_GB_raw'] / m['decode_GBps_per_core'] + m.get('cpu_compute', float('nan'))) / m['cores'] / m['t_read']:.2f}× "
         "the plain read even with perfect overlap."),
        ("- Goal (cka_matrix ≤ 1.3× a plain Dask read: I/O-bound) met in this run." if m['t_cka'] / m['t_read'] <= 1.3
         else "- Goal (≤ 1.3× a plain Dask read) not met in this run: decoding and the Gram arithmetic share the same "
              "2 cores, so the flatten run cannot hide its compute behind the reads here."),
        "",
        f"Extrapolation — {x['case']}:",
        "",
        f"- Read volume: {x['read_TB_per_epoch']:.2f} TB per epoch ({x['bytes_per_example_all_nets'] / 1e6:.0f} MB "
        f"per image over all 18 networks), {x['read_TB_total']:.0f} TB for 10 epochs (each chunk once per epoch).",
        f"- FLOPs: {x['flops_per_epoch']:.2e} per epoch, {x['flops_total']:.2e} total "
        f"(Grams {100 * x['flops_share']['grams']:.1f} %, b×b Gram centring {100 * x['flops_share']['gram_centering']:.1f} %, "
        f"L×L HSIC products {100 * x['flops_share']['hsic']:.2f} %).",
        f"- One H100 (FP32 Grams at {x['assumptions']['h100_fp32_tflops_sustained']:.0f} TFLOP/s sustained): "
        f"{x['one_h100_compute_s_per_epoch']:.0f} s of compute per epoch; PCIe copy {x['pcie_s_per_epoch']:.0f} s; "
        f"zstd decode on {x['assumptions']['cores_per_node']} cores at the measured "
        f"{x['assumptions']['zstd_decode_GBps_per_core']:.2f} GB/s/core: {x['decode_s_per_epoch_one_node']:.0f} s. "
        f"Memory: one column's batch read {x['memory']['largest_column_read_GB']:.1f} GB "
        f"(×3 in flight with prefetch), {x['memory']['gpu_grams_GB']:.1f} GB of b×b float64 centred Grams on the GPU "
        "(window shuffle with shuffle_window = batch size).",
        "",
        "| nodes (1 H100 each) | s per epoch | 10 epochs (h) | bound by |",
        "|---:|---:|---:|---|",
    ]
    for nodes, v in x["nodes"].items():
        lines.append(f"| {nodes} | {v['epoch_s']:.0f} | {v['ten_epochs_h']:.2f} | {v['bound']} |")
    lines += [
        "",
        f"Assumptions: storage {x['assumptions']['node_storage_GBps']:.0f} GB/s per node, parallel file system "
        f"{x['assumptions']['fs_aggregate_GBps']:.0f} GB/s aggregate, PCIe {x['assumptions']['pcie_h2d_GBps']:.0f} GB/s, "
        "segments of batches spread evenly over nodes (dask.distributed), merge cost negligible (L×L per segment). "
        "No GPU was available for this run, so the CuPy path was not timed.",
        "",
    ]
    section = "\n".join(lines)
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    if "## ooc" in text:
        text = re.sub(r"## ooc\n.*?(?=\n## |\Z)", section.rstrip("\n") + "\n", text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as fh:
        fh.write(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small stores (smoke run)")
    ap.add_argument("--stores", type=int, default=4)
    ap.add_argument("--n", type=int, default=None, help="examples per store")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to write the stores (default: a temp dir, removed)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where cka_matrix computes (cuda: CuPy; its rows go to bench/results/ooc_cuda.json and a "
                         "## ooc_cuda section; bench/gpu.py's store row has the GPU's floors too)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default bench/results/ooc.json, or ooc_cuda.json with --device cuda); "
                         "RESULTS.md is rewritten only for the default and never with --quick")
    ap.add_argument("--no-markdown", action="store_true", help="leave bench/RESULTS.md alone")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the RESULTS.md section from bench/results/ooc.json without measuring")
    args = ap.parse_args()
    from _results import json_out, records

    default_out = DEFAULT_OUT_CUDA if args.device == "cuda" else DEFAULT_OUT
    args.out = args.out or default_out
    args.record = records(args.out, default_out, quick=args.quick, no_markdown=args.no_markdown)
    args.out = json_out(args.out, default_out, quick=args.quick)  # a quick run never writes the recorded JSON
    if args.report_only:
        with open(DEFAULT_OUT) as fh:
            write_results(json.load(fh))
        return 0
    n = args.n or (600 if args.quick else 4000)
    root = args.dir or tempfile.mkdtemp(prefix="repsim-ooc-")
    try:
        t0 = time.perf_counter()
        paths = make_stores(root, args.stores, n)
        t_write = time.perf_counter() - t0
        raw = args.stores * n * sum(int(np.prod(s)) for s in LAYERS.values()) * 2
        disk = sum(du(p) for p in paths)
        child("read", paths)  # warm the page cache so both sides read from memory
        read = child("read", paths)
        if args.device == "cuda":
            return _cuda_rows(args, paths, n, read, t_write)
        engine_read = child("engine_read", paths, batch_size=args.batch_size)
        cka = child("cka", paths, batch_size=args.batch_size, epochs=1)
        t_compute, cpu_compute = compute_only(paths, args.batch_size, seed=0)
        decode = decode_rate(paths)
        cores = os.cpu_count() or 1
        gram_flops = 2.0 * args.batch_size * raw / 2  # Σ 2 b² p over batches = 2 b (n p), elements = raw / 2
        measured = {
            "n_stores": args.stores, "n": n, "batch_size": args.batch_size, "store_GB_raw": raw / 1e9,
            "store_GB_disk": disk / 1e9, "t_write": t_write, "t_read": read["seconds"], "t_cka": cka["seconds"],
            "t_engine_read": engine_read["seconds"], "t_compute": t_compute, "cpu_compute": cpu_compute, "cka_maxrss_MB": cka["maxrss_bytes"] / 1e6,
            "engine_read_maxrss_MB": engine_read["maxrss_bytes"] / 1e6, "read_maxrss_MB": read["maxrss_bytes"] / 1e6,
            "read_GBps": raw / 1e9 / read["seconds"], "cores": cores,
            "decode_GBps_per_core": decode, "gflops": gram_flops / t_compute / 1e9,
            "ratio_cka_to_read": cka["seconds"] / read["seconds"],
            "ratio_engine_read_to_read": engine_read["seconds"] / read["seconds"],
        }
        res = {"quick": args.quick, "machine": f"{platform.machine()} {platform.processor() or ''} {cores} cores".strip(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "measured": measured,
               "load_average": " ".join(f"{v:.1f}" for v in os.getloadavg()),
               "blas": _blas_info(),
               "extrapolation": extrapolate(measured)}
        write_json(res, args.out)
        print(f"wrote {args.out}")
        if args.record:
            write_results(res)
        else:
            print("bench/RESULTS.md left alone (quick run, --no-markdown or --out elsewhere)")
        print(json.dumps(measured, indent=2))
        print(f"ratio cka/read = {measured['ratio_cka_to_read']:.2f}; engine read schedule/read = "
              f"{measured['ratio_engine_read_to_read']:.2f}; peak RSS {measured['cka_maxrss_MB']:.0f} MB for "
              f"{measured['store_GB_disk']:.2f} GB on disk")
        return 0
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _cuda_rows(args, paths: list[str], n: int, read: dict, t_write: float) -> int:
    """``--device cuda``: the plain read, the engine's read schedule and ``cka_matrix(device="cuda")``
    (fresh processes each), into bench/results/ooc_cuda.json and a ``## ooc_cuda`` section."""
    engine_read = child("engine_read", paths, batch_size=args.batch_size)
    cka = child("cka", paths, batch_size=args.batch_size, epochs=1, device="cuda")
    cpu = child("cka", paths, batch_size=args.batch_size, epochs=1, device="cpu")
    m = {"n_stores": args.stores, "n": n, "batch_size": args.batch_size, "store_GB_disk": sum(du(p) for p in paths) / 1e9,
         "t_write": t_write, "t_read": read["seconds"], "t_engine_read": engine_read["seconds"],
         "t_cka_cuda": cka["seconds"], "t_cka_cpu": cpu["seconds"], "cka_cuda_maxrss_MB": cka["maxrss_bytes"] / 1e6}
    res = {"device": "cuda", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "measured": m,
           "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_average": " ".join(f"{v:.1f}" for v in os.getloadavg())}
    write_json(res, args.out)
    from _results import replace_section

    args.record and replace_section("ooc_cuda", "\n".join([
        "## ooc_cuda", "",
        f"`python bench/ooc.py --device cuda` on {res['machine']} ({res['date']}, load {res['load_average']}): "
        f"{m['n_stores']} stores, n = {n}, {m['store_GB_disk']:.2f} GB on disk, batch {m['batch_size']}, fresh "
        "processes (imports included), page cache warm.", "",
        "| measurement | seconds | ratio to plain Dask read |", "|---|---:|---:|",
        f"| plain Dask read of every array (threaded) | {m['t_read']:.2f} | 1.00 |",
        f"| the engine's read schedule alone | {m['t_engine_read']:.2f} | {m['t_engine_read'] / m['t_read']:.2f} |",
        f"| `cka_matrix(device=\"cuda\")`, 1 epoch | {m['t_cka_cuda']:.2f} | **{m['t_cka_cuda'] / m['t_read']:.2f}** |",
        f"| `cka_matrix(device=\"cpu\")`, 1 epoch, all cores | {m['t_cka_cpu']:.2f} | {m['t_cka_cpu'] / m['t_read']:.2f} |",
        ""]) + "\n")
    print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
