"""Similarity measures from stores (issue 27): time per measure per pass on the same stores, one pass
for several measures vs separate runs, linear + RBF CKA in one minibatch pass vs linear CKA alone
(measured side by side in one run: the runs alternate, each timed ``--repeat`` times, best kept), and
peak RSS against n for the streamed (minibatch) measures.

Two sets of layer widths, because the cost of RBF CKA relative to linear CKA depends on them:

- ``narrow`` (1024, 256, 128, 64): every layer narrower than 4 × the batch, where linear CKA never forms
  a b × b Gram (it works on the rows) but RBF CKA must (its distances need it);
- ``conv`` (16384, 8192, 4096, 2048: flattened conv blocks such as a ResNet-18's at 64 px, the
  paper's setting of flattened block outputs): linear CKA forms the b × b Grams of the wide layers
  itself, and RBF CKA adds its O(b²) work per layer on top of the shared Gram.

Stores: ``--stores`` synthetic float16 stores per set (post-ReLU-like: non-negative, correlated),
written once into ``--dir``.  Minibatch: batch ``--batch``, one epoch.  Exact: every other measure on
the full data (narrow set).  Each run is a fresh process: wall time of ``similarity_matrix`` only,
peak RSS of the process.  Writes ``--out`` (default bench/results/measures.json) and, only when
``--out`` is the default, the ``## measures`` section of bench/RESULTS.md: a trial run with ``--out``
elsewhere never replaces the recorded results.

    python bench/measures.py                 # n = 2000; the RSS rows at n = 8000 and 32000
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

WIDTH_SETS = {"narrow": {"l1": 1024, "l2": 256, "l3": 128, "l4": 64},
              "conv": {"b1": 16384, "b2": 8192, "b3": 4096, "b4": 2048}}
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results", "measures.json")


def make_stores(root: str, n: int, k: int, widths: str = "narrow") -> list[str]:
    import repsim

    paths = []
    rng = np.random.default_rng(0)
    base = rng.normal(size=(n, 32))
    for s in range(k):
        path = os.path.join(root, f"{widths}{s}_n{n}.zarr")
        if not os.path.exists(path):
            layers = {name: np.maximum(base @ rng.normal(size=(32, p)) + rng.normal(size=(n, p)), 0).astype(np.float16)
                      for name, p in WIDTH_SETS[widths].items()}
            repsim.save_store(path, layers=layers, labels=np.arange(n) % 10, example_ids=np.arange(n),
                              meta={"dataset": {"name": "bench-measures", "split": "synthetic"}})
        paths.append(path)
    return paths


def one(paths: list[str], measures: str, method: str, batch: int) -> dict:
    """A run in its own process: wall time and peak RSS (VmHWM of the new process image: ru_maxrss
    would include the RSS of this benchmark process, which the child was exec'ed from)."""
    code = (
        "import json, time, repsim\n"
        "t = time.perf_counter()\n"
        f"r = repsim.similarity_matrix({paths!r}, {measures.split(',')!r}, method={method!r}, batch_size={batch}, "
        "epochs=1, progress=False)\n"
        "s = time.perf_counter() - t\n"
        "hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(json.dumps({'s': s, 'rss_mib': hwm / 1024}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--stores", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rss-n", type=int, default=8000,
                    help="the RSS rows compare n = this and --rss-factor × this (minibatch routes)")
    ap.add_argument("--rss-factor", type=int, default=4, help="the RSS rows compare --rss-n and this × it")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "repsim-bench-measures"))
    ap.add_argument("--ridge", action="store_true", help="time ridge_r2 too (slow at wide layers)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="results JSON; bench/RESULTS.md is rewritten only when this is the default")
    ap.add_argument("--no-results", "--no-markdown", dest="no_results", action="store_true",
                    help="do not rewrite bench/RESULTS.md")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    load0 = os.getloadavg()[0]
    stores = {w: make_stores(args.dir, args.n, args.stores, w) for w in WIDTH_SETS}
    best: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    for w, paths in stores.items():  # linear alone and linear + RBF side by side, alternating
        runs = {f"{w}: linear_cka": "linear_cka", f"{w}: linear_cka+rbf_cka": "linear_cka,rbf_cka",
                f"{w}: rbf_cka": "rbf_cka"}
        for _ in range(args.repeat):
            for key, m in runs.items():
                got = one(paths, m, "minibatch", args.batch)
                if key not in best or got["s"] < best[key]["s"]:
                    best[key] = got
        ratios[w] = best[f"{w}: linear_cka+rbf_cka"]["s"] / best[f"{w}: linear_cka"]["s"]
    paths = stores["narrow"]
    exact = ["procrustes", "cca", "svcca", "rsa", "mutual_knn", "rbf_cka", "linear_cka"]  # ridge_r2: --ridge
    if args.ridge:  # n·r_x·r_y per pair, × 9 λ × 5 folds: minutes at r = 1024
        exact.insert(5, "ridge_r2")
    for m in exact:
        best[f"narrow: {m} (exact)"] = one(paths, m, "exact", args.batch)
    k = len(exact) - 2
    best[f"narrow: {k} exact measures, one pass"] = one(paths, ",".join(exact[:k]), "exact", args.batch)
    separate = sum(best[f"narrow: {m} (exact)"]["s"] for m in exact[:k])
    # peak RSS against n: the streamed measures (minibatch; linear CKA's exact route streams too)
    small, big = (make_stores(args.dir, k * args.rss_n, args.stores, "narrow") for k in (1, args.rss_factor))
    rss = []
    for m in ("linear_cka", "rbf_cka", "linear_cka,rbf_cka"):
        a, b = one(small, m, "minibatch", args.batch), one(big, m, "minibatch", args.batch)
        rss.append({"measures": m, "method": "minibatch", "n": args.rss_n, "rss_mib": a["rss_mib"],
                    "n_big": args.rss_factor * args.rss_n, "rss_mib_big": b["rss_mib"],
                    "ratio": b["rss_mib"] / a["rss_mib"], "s": a["s"], "s_big": b["s"]})
    L = len(WIDTH_SETS["narrow"]) * args.stores
    rows = "\n".join(f"| {key} | {v['s']:.2f} | {v['rss_mib']:.0f} |" for key, v in best.items())
    rss_rows = "\n".join(f"| {r['measures']} ({r['method']}) | {r['rss_mib']:.0f} | {r['rss_mib_big']:.0f} | {r['ratio']:.2f} |"
                          for r in rss)
    widths = "; ".join(f"{w}: {', '.join(map(str, v.values()))}" for w, v in WIDTH_SETS.items())
    section = f"""## measures

`python bench/measures.py --n {args.n} --stores {args.stores} --batch {args.batch}` — {args.stores} stores × 4 layers per
width set ({widths}; float16, post-ReLU-like), n = {args.n}, minibatch: batch {args.batch}, one epoch; each run a
fresh process (wall time of `similarity_matrix` only; peak RSS of the process); best of {args.repeat} for the
minibatch rows (alternating). {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average
{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other jobs may share the cores: compare rows of this
table only). {time.strftime('%Y-%m-%d %H:%M')}.

| run | seconds | peak RSS MiB |
| --- | --- | --- |
{rows}

- linear + RBF CKA in one minibatch pass vs linear CKA alone: **{ratios['conv']:.2f}×** on the `conv` widths
  (flattened conv blocks: linear CKA forms the b × b Grams itself, RBF CKA shares them and adds O(b²) per layer:
  squared distances, an exact median by bracketing, exp, centring, and its HSIC sums), **{ratios['narrow']:.2f}×** on the
  `narrow` widths (p < 4b: linear CKA works on the rows and forms no Gram, while RBF CKA's distances need the
  b × b Gram of every layer, b²·p multiply-adds each — the RBF kernel itself costs that much more there).
- the {k} exact measures in one pass: {best[f'narrow: {k} exact measures, one pass']['s']:.2f} s vs {separate:.2f} s run
  separately (the full columns are read once).
- peak RSS against n for the streamed (minibatch) routes (narrow widths, batch {args.batch}): each holds a few
  chunks, b × b batch statistics and the host readers' read-ahead of reduced columns, which is bounded
  (`engine.minibatch.AHEAD_BYTES`, 512 MiB) but fills only when an epoch has that much to read ahead (a small
  n such as {args.n}, two batches, has less), so the rows start at n = {args.rss_n}. The exact measures hold full
  columns (n · min(p, n) float64 each, bounded by `--max-memory`; docs/measures.md), by design not flat in n.

| measures (route) | RSS MiB at n = {args.rss_n} | at n = {args.rss_factor * args.rss_n} | ratio |
| --- | --- | --- | --- |
{rss_rows}
"""
    print(section)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "n": args.n, "batch": args.batch, "stores": args.stores,
              "widths": WIDTH_SETS, "runs": best, "linear_plus_rbf_over_linear": ratios, "rss_vs_n": rss,
              "exact_one_pass_s": best[f"narrow: {k} exact measures, one pass"]["s"], "exact_separate_s": separate,
              "cpus": os.cpu_count(), "load": [load0, os.getloadavg()[0]]}
    sys.path.insert(0, HERE)
    from _results import provenance, records, replace_section

    record["provenance"] = provenance()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    if records(args.out, DEFAULT_OUT, no_markdown=args.no_results):
        replace_section("measures", section)
    else:
        print(f"wrote {args.out}; bench/RESULTS.md left alone (--no-results or --out elsewhere)")


if __name__ == "__main__":
    main()
