"""Bounded memory: CKA over > 1 GB of stores with the `repsim cka` process peaking below 1 GB RSS."""
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


@pytest.mark.slow
def test_cka_over_a_gigabyte_of_stores_stays_under_1gb_rss(tmp_path):
    import time

    t0 = time.perf_counter()
    paths = []
    for s in range(2):
        path = str(tmp_path / f"big_{s}.zarr")
        repsim.save_store(path, layers={"b1": _dask_layer(2 * s, 512), "b2": _dask_layer(2 * s + 1, 512)},
                          labels=np.zeros(N, np.int32), progress=False)
        paths.append(path)
    on_disk = sum(_du(p) for p in paths)
    t1 = time.perf_counter()
    assert on_disk >= 1e9, on_disk

    out = str(tmp_path / "cka_big.npz")
    cmd = [sys.executable, "-m", "repsim", "cka", *paths, "--out", out, "--batch-size", "32", "--epochs", "1",
           "--no-progress"]
    # a wrapper process whose only child is the CKA run, so RUSAGE_CHILDREN is that run's peak RSS
    wrapper = ("import json, resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(json.dumps({'rc': rc, 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, done.stderr
    peak = report["maxrss_kb"] * 1024
    print(f"\nstores on disk: {on_disk / 1e9:.2f} GB (written in {t1 - t0:.1f} s); repsim cka peak RSS: "
          f"{peak / 1e6:.0f} MB ({time.perf_counter() - t1:.1f} s)")
    assert peak < 1e9, f"peak RSS {peak / 1e6:.0f} MB for {on_disk / 1e9:.2f} GB of stores"
    res = CKAResult.load(out)
    assert res.values.shape == (4, 4) and res.meta["n_batches"] == sum(res.meta["batches_per_epoch"]) >= N // 40
    assert np.allclose(np.diag(res.values), 1.0)
