"""Store micro-benchmarks behind three numbers the docs quote (docs/architecture.md, repsim/store/format.py):

1. **zstd level 1 vs level 3** (``format.ZSTD_LEVEL = 1``): compression time and size of one 8 MiB
   float16 post-ReLU-like chunk (256 rows of 64×16×16, about half zeros), one thread, best of
   ``--repeats``; decompression time too.
2. **direct chunk I/O vs zarr** (``repsim.store._chunkio.FastChunks``): CPU time (process time, all
   threads) to read and to write every chunk of one float16 layer, whole chunks through the fast path
   against the same chunks through the zarr array (``arr[rows]`` / ``arr[rows] = data``), best of
   ``--repeats`` passes, page cache warm.  Both paths write byte-identical objects (checked).
3. **opening a store of 18 layers**: ``repsim.open_store`` (one concurrent metadata read) against a
   plain ``zarr.open_group`` that then opens each of the 18 layer arrays (what code without repsim's
   metadata read does); wall time, best of ``--repeats``.

Each ratio comes from one run, both sides timed alternately.  Writes ``--out`` (default
bench/results/store_micro.json) and, only when ``--out`` is the default, the ``## store_micro``
section of bench/RESULTS.md.

    python bench/store_micro.py
    python bench/store_micro.py --out /tmp/m.json      # a trial: nothing recorded
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
DEFAULT_OUT = os.path.join(HERE, "results", "store_micro.json")


def post_relu(rows: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(rng.standard_normal((rows, *shape), dtype=np.float32), 0).astype(np.float16)


def zstd_levels(repeats: int) -> dict:
    from numcodecs import Zstd

    x = post_relu(256, (64, 16, 16))
    raw = x.tobytes()
    out = {"chunk_bytes": len(raw)}
    for level in (1, 3):
        codec = Zstd(level=level)
        enc, dec = float("inf"), float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            frame = codec.encode(raw)
            enc = min(enc, time.perf_counter() - t0)
            t0 = time.perf_counter()
            codec.decode(frame)
            dec = min(dec, time.perf_counter() - t0)
        out[f"level{level}"] = {"compress_s": enc, "decompress_s": dec, "bytes": len(frame),
                                "compress_GBps": len(raw) / enc / 1e9, "ratio": len(raw) / len(frame)}
    out["level3_over_level1_time"] = out["level3"]["compress_s"] / out["level1"]["compress_s"]
    out["level1_over_level3_size"] = out["level1"]["bytes"] / out["level3"]["bytes"]
    return out


def chunk_io(root: str, repeats: int, n: int) -> dict:
    import repsim
    from repsim.store._chunkio import fast_chunks

    path = os.path.join(root, "io.zarr")
    data = post_relu(n, (64, 16, 16), seed=1)
    repsim.save_store(path, {"block": data}, np.zeros(n, np.int32), example_ids=np.arange(n),
                      meta={"dataset": {"name": "bench", "split": "none"}}, progress=False)
    import zarr

    arr = zarr.open_array(os.path.join(path, "layers", "block"), mode="r+")  # (a store opens read-only)
    fast = fast_chunks(path, "layers/block", arr)
    if fast is None:
        raise SystemExit("the fast chunk path does not apply to this store (not local or another encoding)")
    c = fast.chunks[0]
    idx = [(i,) + (0,) * (data.ndim - 1) for i in range(-(-n // c))]
    rows = [slice(i[0] * c, min(n, (i[0] + 1) * c)) for i in idx]

    def fast_read():
        for i in idx:
            fast.read(i)

    def zarr_read():
        for r in rows:
            arr[r]

    def fast_write():
        for i, r in zip(idx, rows):
            fast.write(data[r], i)

    def zarr_write():
        for r in rows:
            arr[r] = data[r]

    # byte-identical objects from both writers
    zarr_write()
    via_zarr = [open(fast.path(i), "rb").read() for i in idx]
    fast_write()
    identical = via_zarr == [open(fast.path(i), "rb").read() for i in idx]
    cands = {"fast_read": fast_read, "zarr_read": zarr_read, "fast_write": fast_write, "zarr_write": zarr_write}
    best = {k: {"cpu_s": float("inf"), "wall_s": float("inf")} for k in cands}
    for f in cands.values():
        f()  # warm-up (page cache, codec objects, zarr's event loop)
    for _ in range(repeats):
        for k, f in cands.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            best[k]["cpu_s"] = min(best[k]["cpu_s"], time.process_time() - c0)
            best[k]["wall_s"] = min(best[k]["wall_s"], time.perf_counter() - t0)
    return {"chunks": len(idx), "chunk_rows": c, "chunk_bytes": fast._nbytes, "byte_identical_objects": identical,
            "best": best,
            "zarr_over_fast_cpu": {op: best[f"zarr_{op}"]["cpu_s"] / best[f"fast_{op}"]["cpu_s"] for op in ("read", "write")},
            "zarr_over_fast_wall": {op: best[f"zarr_{op}"]["wall_s"] / best[f"fast_{op}"]["wall_s"] for op in ("read", "write")}}


def open_18(root: str, repeats: int) -> dict:
    import zarr

    import repsim

    path = os.path.join(root, "open18.zarr")
    n = 512
    layers = {f"block{i:02d}": post_relu(n, (8, 4, 4), seed=i) for i in range(18)}
    repsim.save_store(path, layers, np.zeros(n, np.int32), example_ids=np.arange(n),
                      meta={"dataset": {"name": "bench", "split": "none"}}, progress=False)

    def ours():
        s = repsim.open_store(path)
        return s.layers

    def plain():
        g = zarr.open_group(path, mode="r")
        return [g[f"layers/{name}"].shape for name in layers]

    best = {"open_store": float("inf"), "zarr_group_then_arrays": float("inf")}
    ours(), plain()
    for _ in range(repeats):
        for k, f in (("open_store", ours), ("zarr_group_then_arrays", plain)):
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {"layers": len(layers), "seconds": best,
            "plain_over_open_store": best["zarr_group_then_arrays"] / best["open_store"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=2048, help="rows of the chunk-I/O layer (64x16x16 float16; 256 rows a chunk)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--no-markdown", action="store_true")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    from _results import provenance, provenance_line, records, replace_section

    root = tempfile.mkdtemp(prefix="repsim-store-micro-")
    load0 = os.getloadavg()
    try:
        with threadpool_limits(limits=1):
            z = zstd_levels(args.repeats)
        io = chunk_io(root, args.repeats, args.n)
        op = open_18(root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {"benchmark": "store_micro", "repeats": args.repeats, "zstd": z, "chunk_io": io, "open": op,
           "loadavg_start": load0, "provenance": provenance()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=2)
    l1, l3 = z["level1"], z["level3"]
    b = io["best"]
    lines = [
        "## store_micro", "",
        f"`python bench/store_micro.py` — best of {args.repeats}, both sides alternating; load average "
        f"{load0[0]:.1f} at the start, {res['provenance']['loadavg'][0]:.1f} at the end (shared box).", "",
        "| measurement | repsim | the other way | ratio |", "|---|---:|---:|---:|",
        f"| zstd compression of one {z['chunk_bytes'] / 2**20:.0f} MiB float16 post-ReLU chunk, one thread | level 1: "
        f"{l1['compress_s'] * 1e3:.1f} ms ({l1['compress_GBps']:.2f} GB/s), {l1['bytes'] / 2**20:.2f} MiB | level 3: "
        f"{l3['compress_s'] * 1e3:.1f} ms, {l3['bytes'] / 2**20:.2f} MiB | level 3 takes **{z['level3_over_level1_time']:.2f}×** "
        f"the time; level 1 is {z['level1_over_level3_size'] - 1:+.1%} larger |",
        f"| read all {io['chunks']} chunks ({io['chunk_rows']} rows, {io['chunk_bytes'] / 2**20:.0f} MiB each), CPU time | "
        f"direct: {b['fast_read']['cpu_s'] * 1e3:.0f} ms | zarr: {b['zarr_read']['cpu_s'] * 1e3:.0f} ms | "
        f"**{io['zarr_over_fast_cpu']['read']:.2f}×** less CPU (wall {io['zarr_over_fast_wall']['read']:.2f}×) |",
        f"| write the same chunks, CPU time (objects byte-identical: {io['byte_identical_objects']}) | direct: "
        f"{b['fast_write']['cpu_s'] * 1e3:.0f} ms | zarr: {b['zarr_write']['cpu_s'] * 1e3:.0f} ms | "
        f"**{io['zarr_over_fast_cpu']['write']:.2f}×** less CPU (wall {io['zarr_over_fast_wall']['write']:.2f}×) |",
        f"| open a store of {op['layers']} layers | `open_store`: {op['seconds']['open_store'] * 1e3:.1f} ms | "
        f"`zarr.open_group` + each array: {op['seconds']['zarr_group_then_arrays'] * 1e3:.1f} ms | "
        f"**{op['plain_over_open_store']:.2f}×** |",
        "", provenance_line(res["provenance"]), ""]
    print("\n".join(lines))
    if records(args.out, DEFAULT_OUT, no_markdown=args.no_markdown):
        replace_section("store_micro", "\n".join(lines))
    else:
        print(f"wrote {args.out}; bench/RESULTS.md left alone (--no-markdown or --out elsewhere)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
