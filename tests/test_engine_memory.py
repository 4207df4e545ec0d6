"""Bounded memory: CKA over > 1 GB of stores, the `repsim cka` process's peak RSS above that of the same
command over a tiny store of the same layers within what the engine may hold in flight (the reader threads'
decoded chunks and the read-ahead queue of the memory budget), derived from the chunk size and the budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import repsim
from repsim.engine.result import CKAResult

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, SHAPE = 9000, (1024, 4, 4)  # 32 KiB per row in float16; 2 stores x 2 layers = 1.18 GB of arrays


def _random_float16(block_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Finite float16 in [0, 1) with random mantissas (barely compressible), made fast from random bits."""
    bits = np.random.default_rng(block_id).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return (bits & np.uint16(0x3BFF)).view(np.float16)


def _dask_layer(seed: int, chunk: int):
    import dask.array as da

    def make(block_info=None):
        loc = block_info[None]["chunk-location"][0]
        rows = block_info[None]["chunk-shape"][0]
        return _random_float16(seed * 100_000 + loc, (rows,) + SHAPE)

    return da.map_blocks(make, chunks=((chunk,) * (N // chunk) + ((N % chunk,) if N % chunk else ()),) + tuple(
        (s,) for s in SHAPE), dtype=np.float16)


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


WRAPPER = ("import json, resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
           "print(json.dumps({'rc': rc, 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
BUDGET = 256 << 20  # --memory-budget: its read-ahead share (engine.options.read_ahead_bytes) is 16 MiB
THREADS = 2  # --threads: reader threads, each decoding one chunk of one column at a time


def _peak_rss(paths: list[str], out: str) -> int:
    """Peak RSS in bytes of ``repsim cka PATHS`` (a wrapper process whose only child is that run, so
    RUSAGE_CHILDREN is the run's own peak)."""
    cmd = [sys.executable, "-m", "repsim", "cka", *paths, "--out", out, "--batch-size", "32", "--epochs", "1",
           "--no-progress", "--memory-budget", f"{BUDGET >> 20}MiB", "--threads", str(THREADS)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, done.stderr
    return report["maxrss_kb"] * 1024


@pytest.mark.slow
def test_cka_over_a_gigabyte_of_stores_holds_only_what_is_in_flight(tmp_path):
    """The bound, and why: the run over 1.1 GB of stores may hold, beyond what the same command holds over
    a 64-row store of the same layers (the interpreter, its imports, one chunk, the allocator's arenas:
    measured, not guessed), the chunks its reader threads decode (each thread one chunk of one column at a
    time: the compressed bytes, the float16 chunk and its float32 copy, < 2 chunks of float32) and the
    read-ahead queue (read_ahead_bytes of the budget). Twice that is allowed: freed decode buffers the
    allocator keeps for reuse instead of returning them (glibc's mmap threshold rises to the chunk size),
    one more chunk each per thread. The data's size is not in the bound: it is over 3x smaller than the
    stores even so, and a run that held the data would exceed it by 1 GB."""
    from repsim.engine.options import read_ahead_bytes
    from repsim.store.reader import open_store

    paths, tiny = [], []
    for s in range(2):
        path = str(tmp_path / f"big_{s}.zarr")
        repsim.save_store(path, layers={"b1": _dask_layer(2 * s, 512), "b2": _dask_layer(2 * s + 1, 512)},
                          labels=np.zeros(N, np.int32), progress=False)
        paths.append(path)
        small = str(tmp_path / f"tiny_{s}.zarr")
        repsim.save_store(small, layers={k: _random_float16(10 * s + j, (64,) + SHAPE) for j, k in
                                         enumerate(("b1", "b2"))}, labels=np.zeros(64, np.int32), progress=False)
        tiny.append(small)
    on_disk = sum(_du(p) for p in paths)
    assert on_disk >= 1e9, on_disk
    chunk_rows = open_store(paths[0]).zarr_array("b1").chunks[0]
    chunk_f32 = chunk_rows * int(np.prod(SHAPE)) * 4
    in_flight = THREADS * 2 * chunk_f32 + read_ahead_bytes(BUDGET)

    base = _peak_rss(tiny, str(tmp_path / "tiny.npz"))
    out = str(tmp_path / "cka_big.npz")
    peak = _peak_rss(paths, out)
    print(f"\nstores on disk: {on_disk / 1e9:.2f} GB; peak RSS {peak / 1e6:.0f} MB, over a 64-row store "
          f"{base / 1e6:.0f} MB; in flight at most {in_flight / 1e6:.0f} MB ({chunk_rows}-row chunks)")
    assert peak - base <= 2 * in_flight, (f"{(peak - base) / 1e6:.0f} MB above the tiny run's peak, more than twice "
                                          f"the {in_flight / 1e6:.0f} MB in flight")
    assert 2 * in_flight < on_disk / 3  # (the bound says something: holding the data would break it)
    res = CKAResult.load(out)
    assert res.values.shape == (4, 4) and res.meta["n_batches"] == sum(res.meta["batches_per_epoch"]) >= N // 40
    assert np.allclose(np.diag(res.values), 1.0)
