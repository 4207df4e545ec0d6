"""Similarity measures from stores (issue 27): time per measure per pass on the same stores, one pass
for several measures vs separate runs, and linear + RBF CKA in one minibatch pass vs linear CKA alone
(measured side by side in one run: the runs alternate, each timed ``--repeat`` times, best kept).

Stores: ``--stores`` synthetic float16 stores of n = ``--n`` rows with layers of widths 64 .. 1024
(post-ReLU-like: non-negative, correlated), written once into ``--dir``.  Minibatch: batch ``--batch``,
one epoch.  Exact: every other measure on the full data.  Peak RSS of each run (its own process).

    python bench/measures.py                 # n = 2000, 2 stores × 4 layers
    python bench/measures.py --n 4000        # peak RSS flat in n for the streamed measures
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

WIDTHS = {"l1": 1024, "l2": 256, "l3": 128, "l4": 64}


def make_stores(root: str, n: int, k: int) -> list[str]:
    import repsim

    paths = []
    rng = np.random.default_rng(0)
    base = rng.normal(size=(n, 32))
    for s in range(k):
        path = os.path.join(root, f"net{s}_n{n}.zarr")
        if not os.path.exists(path):
            layers = {name: np.maximum(base @ rng.normal(size=(32, p)) + rng.normal(size=(n, p)), 0).astype(np.float16)
                      for name, p in WIDTHS.items()}
            repsim.save_store(path, layers=layers, labels=np.arange(n) % 10)
        paths.append(path)
    return paths


def one(paths: list[str], measures: str, method: str, batch: int) -> dict:
    """A run in its own process: wall time and peak RSS."""
    code = (
        "import json, resource, sys, time, repsim\n"
        "t = time.perf_counter()\n"
        f"r = repsim.similarity_matrix({paths!r}, {measures.split(',')!r}, method={method!r}, batch_size={batch}, "
        "epochs=1, progress=False)\n"
        "print(json.dumps({'s': time.perf_counter() - t, 'rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--stores", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "repsim-bench-measures"))
    ap.add_argument("--ridge", action="store_true", help="time ridge_r2 too (slow at wide layers)")
    ap.add_argument("--no-results", action="store_true", help="do not rewrite bench/RESULTS.md")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    paths = make_stores(args.dir, args.n, args.stores)
    L = len(WIDTHS) * args.stores
    runs = {"linear_cka": ("linear_cka", "minibatch"), "linear_cka+rbf_cka": ("linear_cka,rbf_cka", "minibatch"),
            "rbf_cka": ("rbf_cka", "minibatch")}
    best: dict[str, dict] = {}
    for _ in range(args.repeat):  # alternate: linear alone and linear + RBF side by side
        for key, (m, method) in runs.items():
            got = one(paths, m, method, args.batch)
            if key not in best or got["s"] < best[key]["s"]:
                best[key] = got
    exact = ["procrustes", "cca", "svcca", "rsa", "mutual_knn", "rbf_cka", "linear_cka"]  # ridge_r2: --ridge
    if args.ridge:  # n·r_x·r_y per pair, × 9 λ × 5 folds: minutes at r = 1024
        exact.insert(5, "ridge_r2")
    for m in exact:
        best[f"{m} (exact)"] = one(paths, m, "exact", args.batch)
    k = len(exact) - 2
    best[f"{k} exact measures, one pass"] = one(paths, ",".join(exact[:k]), "exact", args.batch)
    ratio = best["linear_cka+rbf_cka"]["s"] / best["linear_cka"]["s"]
    separate = sum(best[f"{m} (exact)"]["s"] for m in exact[:k])
    rows = "\n".join(f"| {k} | {v['s']:.2f} | {v['rss_mib']:.0f} |" for k, v in best.items())
    section = f"""## measures

`python bench/measures.py --n {args.n} --stores {args.stores} --batch {args.batch}` — {L} columns (widths
{', '.join(map(str, WIDTHS.values()))}, float16, post-ReLU-like), n = {args.n}, minibatch: batch {args.batch}, one
epoch; each run a fresh process (wall time of `similarity_matrix` only; peak RSS of the process).
{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end
(other jobs shared the cores: compare rows of this table only).

| run | seconds | peak RSS MiB |
| --- | --- | --- |
{rows}

- linear + RBF CKA in one minibatch pass: **{ratio:.2f}×** linear CKA alone (best of {args.repeat}, alternating).
- the {k} exact measures in one pass: {best[f'{k} exact measures, one pass']['s']:.2f} s vs {separate:.2f} s run separately
  (the full columns are read once).
"""
    print(section)
    if not args.no_results:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import replace_section

        replace_section("measures", section)


if __name__ == "__main__":
    main()
