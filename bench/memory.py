"""Memory benchmark (issue 31): peak RSS of every analysis command at n = 20,000 and 80,000.

For each chunking (``chunk_rows=2500``, and the default rule of ``save_store``) and each n, writes a
fit store and an evaluation store of one synthetic network with the issue's widths — layers ``block``
(2,048), ``pool`` (512), logits (10), float16 layers, 10 classes, a head — then runs every analysis
command in a fresh process (``python -m repsim ...``; peak RSS from ``os.wait4``'s rusage, the number
``/usr/bin/time -v`` prints as "Maximum resident set size") and reports RSS(80k) / RSS(20k) per
command, with the route ``probe`` and ``calibrate`` took (in memory below ``--memory-budget``, out of
core above it; the default budget unless ``--memory-budget`` is given). Goal: every ratio ≤ 1.15.

    OMP_NUM_THREADS=1 python bench/memory.py                  # both chunkings, n = 20k and 80k
    OMP_NUM_THREADS=1 python bench/memory.py --only probe-knn --chunking default
    OMP_NUM_THREADS=1 python bench/memory.py --streamed          # issue 43 item 12's rows (below)

To fit ~15 minutes on 2 cores the probe runs use ``--lambdas 9`` (the protocol's 45-value grid
thinned; the same code path: every λ is another warm-started L-BFGS run over the same passes) and the
evaluation stores hold n/8 examples (the kNN search costs n² · P flops, the leave-one-out part on the
fit store; its memory is per query block). Writes bench/results/memory.json and the ``## memory``
section of bench/RESULTS.md. Stores go to ``--root`` (default a temporary directory, removed).

``--streamed`` (issue 43 item 12): the out-of-core probes held to a budget below the data — ``probe
--probe linear`` and ``probe --relearn`` at ``--memory-budget 8`` (MiB) on stores of one 512-wide float16
layer (``pool``, save_store's chunking: 8,192 rows per chunk), n = 10,000 and 40,000, ``--lambdas 3``;
goal RSS(40k) / RSS(10k) ≤ 1.15 for both. Writes bench/results/memory_streamed.json and the
``## memory_streamed`` section.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

WIDTHS = {"block": 2048, "pool": 512}
# --streamed: the issue-43 rows (module doc); these replace the defaults of the options named
STREAMED = {"sizes": [10000, 40000], "memory_budget": 8.0, "only": ["probe-linear", "probe-relearn"],
            "chunking": ["default"], "lambdas": 3, "widths": {"pool": 512}, "section": "memory_streamed",
            "out": "memory_streamed.json"}
CLASSES = 10
SIZES = (20000, 80000)
LAMBDAS = 9
GOAL = 1.15

# name -> argv after `python -m repsim` ({F}: fit store, {E}: evaluation store, {O}: output directory)
COMMANDS: dict[str, list[str]] = {
    "check": ["check", "{F}", "--no-progress"],
    "cka-minibatch": ["cka", "{F}", "--out", "{O}/cka.npz", "--no-progress"],
    "cka-exact": ["cka", "{F}", "--method", "exact", "--out", "{O}/cka_exact.npz", "--no-progress"],
    "separation": ["separation", "{F}", "--out", "{O}/separation.csv", "--no-progress"],
    "sparsity": ["sparsity", "{F}", "--out", "{O}/sparsity.csv", "--no-progress"],
    "collapse": ["collapse", "{F}", "--out", "{O}/collapse.csv", "--no-progress"],
    "collapse-spectra": ["collapse", "{F}", "--out", "{O}/collapse_s.csv", "--spectra", "{O}/spectra.npz",
                         "--no-progress"],
    "accuracy": ["accuracy", "{F}", "{E}", "--out", "{O}/accuracy.csv", "--no-progress"],
    "probe": ["probe", "--train", "{F}", "--test", "{E}", "--lambdas", "{L}", "--no-progress", "--out", "{O}/p"],
    "probe-linear": ["probe", "--train", "{F}", "--test", "{E}", "--probe", "linear", "--lambdas", "{L}",
                     "--no-progress", "--out", "{O}/pl"],
    "probe-knn": ["probe", "--train", "{F}", "--test", "{E}", "--probe", "knn", "--no-progress", "--out", "{O}/pk"],
    "probe-relearn": ["probe", "--relearn", "{F}", "--lambdas", "{L}", "--no-progress", "--out", "{O}/pr"],
    "calibrate": ["calibrate", "--test", "{E}", "--holdout", "{F}", "--out", "{O}/calibration.csv"],
}
BUDGETED = ("probe", "calibrate")   # commands that take --memory-budget


# ---------------------------------------------------------------------------------------------- data


def _features(n: int, width: int, chunk: int, seed: int, y: np.ndarray):
    """(n, width) float16 post-ReLU features with a class signal, generated chunk by chunk (dask)."""
    import dask.array as da

    means = np.random.default_rng([seed, 1]).normal(size=(CLASSES, 32))
    mix = np.random.default_rng([seed, 2]).normal(size=(32, width)).astype(np.float32) / np.sqrt(32)

    def make(block_info=None):
        a, b = block_info[None]["array-location"][0]
        rng = np.random.default_rng([seed, a])
        z = means[y[a:b]] + rng.normal(size=(b - a, 32))
        x = z.astype(np.float32) @ mix + 0.5 * rng.normal(size=(b - a, width)).astype(np.float32)
        return np.maximum(x, 0).astype(np.float16)

    chunks = ((chunk,) * (n // chunk) + ((n % chunk,) if n % chunk else ()), (width,))
    return da.map_blocks(make, chunks=chunks, dtype=np.float16)


def make_store(path: Path, n: int, split: str, chunk_rows: int | None, offset: int,
               widths: dict[str, int] = WIDTHS) -> dict:
    import repsim

    y = np.random.default_rng([7, offset]).integers(0, CLASSES, n)
    layers = {name: _features(n, w, 4096, i + 10 * (offset > 0), y) for i, (name, w) in enumerate(widths.items())}
    head = np.random.default_rng(3).normal(size=(CLASSES, widths["pool"])) * 0.05
    logits = (np.eye(CLASSES)[y] * 3 + np.random.default_rng([5, offset]).normal(size=(n, CLASSES))).astype(np.float32)
    store = repsim.save_store(path, layers=layers, labels=y, logits=logits, head=(head, np.zeros(CLASSES)),
                              example_ids=np.arange(n) + offset, chunk_rows=chunk_rows, progress=False,
                              meta={"model": {"arch": "synthetic", "objective": "softmax", "seed": 0},
                                    "dataset": {"name": "synthetic", "split": split}})
    return {"path": str(path), "n": n, "chunk_rows": int(store.chunk_rows), "bytes_on_disk": du(path)}


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------------------------------ measuring


# The measured command runs as the only child of this small wrapper, which reports that child's peak
# RSS: on Linux a process's ru_maxrss includes the RSS of the image it was exec'ed from, so a command
# forked from the benchmark process itself (stores' data, dask) would report the benchmark's RSS.
_WRAP = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
         "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT); "
         "w = time.perf_counter() - t; r = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "sys.stdout.write(p.stdout.decode(errors='replace')[-600:]); "
         "print(); print(json.dumps({'rc': p.returncode, 'maxrss_MiB': r.ru_maxrss / 1024, 'seconds': w, "
         "'cpu_seconds': r.ru_utime + r.ru_stime}))")


def run_child(argv: list[str]) -> dict:
    """Run ``python -m repsim argv`` in a fresh process (under :data:`_WRAP`); its peak RSS and times."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _WRAP, sys.executable, "-m", "repsim", *argv], env=env,
                         cwd=str(REPO), stdout=subprocess.PIPE, check=True).stdout.decode(errors="replace")
    *tail, last = out.rstrip("\n").split("\n")
    return {**json.loads(last), "output_tail": "\n".join(tail)}


def route(name: str, fit: dict, ev: dict, budget_mib: float, widths: dict[str, int] = WIDTHS) -> str:
    """The route ``probe`` / ``calibrate`` choose (their own rules: probes.writers._fits, write_calibration)."""
    from repsim.probes.rows import nbytes_in_memory

    if name == "calibrate":
        return "in memory" if (fit["n"] + ev["n"]) * CLASSES * 32 <= budget_mib * 2**20 else "out of core"
    if name.startswith("probe"):
        n = fit["n"] + (0 if name == "probe-relearn" else ev["n"])
        return "in memory" if nbytes_in_memory(n, widths["pool"]) <= budget_mib * 2**20 else "out of core"
    return "streamed"


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv=None) -> int:
    from repsim.probes.writers import DEFAULT_BUDGET_MIB

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs=2, default=None, help=f"default {SIZES[0]} {SIZES[1]}")
    ap.add_argument("--chunking", nargs="+", default=None,
                    help="store chunkings: rows per chunk, or 'default' (save_store's rule); default 2500 default")
    ap.add_argument("--only", nargs="+", choices=sorted(COMMANDS), default=None, help="default: all")
    ap.add_argument("--lambdas", type=int, default=None, help=f"probe λ grid size (default {LAMBDAS}; protocol: 45)")
    ap.add_argument("--eval-divisor", type=int, default=8, help="evaluation stores hold n / this examples")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help=f"passed to probe/calibrate (default: theirs, {DEFAULT_BUDGET_MIB} MiB)")
    ap.add_argument("--root", default=None, help="where the stores go (kept); default a temporary directory")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/memory.json, or "
                    "memory_streamed.json with --streamed)")
    ap.add_argument("--streamed", action="store_true",
                    help="issue 43 item 12's rows: " + ", ".join(f"{k} {v}" for k, v in STREAMED.items()
                                                                if k not in ("section", "out")))
    ap.add_argument("--no-markdown", action="store_true")
    ap.add_argument("--markdown-only", action="store_true")
    args = ap.parse_args(argv)
    preset = STREAMED if args.streamed else {"sizes": list(SIZES), "memory_budget": None, "lambdas": LAMBDAS,
                                             "only": list(COMMANDS), "chunking": ["2500", "default"]}
    for k in ("sizes", "memory_budget", "only", "chunking", "lambdas"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    widths, section = (STREAMED["widths"], STREAMED["section"]) if args.streamed else (WIDTHS, "memory")
    default_out = HERE / "results" / (STREAMED["out"] if args.streamed else "memory.json")
    args.out = args.out or str(default_out)
    if args.markdown_only:
        write_markdown(json.loads(Path(args.out).read_text()))
        return 0
    budget = DEFAULT_BUDGET_MIB if args.memory_budget is None else args.memory_budget
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="repsim-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res = {"config": {"sizes": args.sizes, "widths": widths, "section": section, "classes": CLASSES, "dtype": "float16",
                      "lambdas": args.lambdas, "eval_divisor": args.eval_divisor, "memory_budget_MiB": budget,
                      "memory_budget_default": args.memory_budget is None,
                      "threads": os.environ.get("OMP_NUM_THREADS"), "machine": platform.machine(),
                      "cpus": os.cpu_count(), "started": started, "load_before": _load()},
           "stores": {}, "runs": {}}
    t_all = time.perf_counter()
    try:
        for ch in args.chunking:
            chunk_rows = None if ch == "default" else int(ch)
            for n in args.sizes:
                d = root / f"c{ch}_n{n}"
                fit = make_store(d / "fit.zarr", n, "train", chunk_rows, 0, widths) \
                    if not (d / "fit.zarr").exists() else _existing(d / "fit.zarr")
                ev_n = n // args.eval_divisor
                ev = make_store(d / "eval.zarr", ev_n, "test", chunk_rows, 10**8, widths) \
                    if not (d / "eval.zarr").exists() else _existing(d / "eval.zarr")
                res["stores"][f"{ch}/{n}"] = {"fit": fit, "eval": ev}
                print(f"stores chunking={ch} n={n}: fit {fit['chunk_rows']} rows/chunk, "
                      f"{fit['bytes_on_disk'] / 2**20:.0f} MiB; eval n={ev['n']}", flush=True)
                for name in args.only:
                    out = d / "out"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    cmd = [a.format(F=fit["path"], E=ev["path"], O=out, L=args.lambdas) for a in COMMANDS[name]]
                    if name.startswith(BUDGETED) and args.memory_budget is not None:
                        cmd += ["--memory-budget", f"{args.memory_budget:g}"]
                    r = run_child(cmd)
                    r["route"] = route(name, fit, ev, budget, widths)
                    r["argv"] = cmd
                    res["runs"].setdefault(ch, {}).setdefault(name, {})[str(n)] = r
                    flag = "" if r["rc"] == 0 else f"  FAILED rc={r['rc']}: {r['output_tail'][-300:]}"
                    print(f"  {name:17s} n={n:6d}: {r['maxrss_MiB']:7.0f} MiB  {r['seconds']:7.1f} s  "
                          f"({r['route']}){flag}", flush=True)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    res["config"]["seconds_total"] = time.perf_counter() - t_all
    res["config"]["load_after"] = _load()
    table = ratios(res)
    print(f"\n{'chunking':9s} {'command':17s} {'RSS ' + str(res['config']['sizes'][0]):>8s} {'RSS ' + str(res['config']['sizes'][1]):>8s} {'ratio':>6s}  route small / large")
    for row in table:
        print(f"{row['chunking']:9s} {row['command']:17s} {row['rss_small']:8.0f} {row['rss_large']:8.0f} "
              f"{row['ratio']:6.2f}  {row['route_small']} / {row['route_large']}"
              f"{'' if row['ratio'] <= GOAL else '  > ' + str(GOAL)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench._results import provenance

    res["provenance"] = provenance()
    out.write_text(json.dumps(res, indent=1))
    from bench._results import records

    if records(out, default_out, no_markdown=args.no_markdown):
        write_markdown(res)
    return 0 if all(r["ok"] for r in table) else 1


def _existing(path: Path) -> dict:
    import repsim

    s = repsim.open_store(path)
    return {"path": str(path), "n": int(s.n), "chunk_rows": int(s.chunk_rows), "bytes_on_disk": du(path)}


def ratios(res: dict) -> list[dict]:
    small, large = (str(n) for n in res["config"]["sizes"])
    rows = []
    for ch, by_name in res["runs"].items():
        for name, by_n in by_name.items():
            if small not in by_n or large not in by_n:
                continue
            a, b = by_n[small], by_n[large]
            ratio = b["maxrss_MiB"] / a["maxrss_MiB"]
            rows.append({"chunking": ch, "command": name, "rss_small": a["maxrss_MiB"], "rss_large": b["maxrss_MiB"],
                         "ratio": ratio, "s_small": a["seconds"], "s_large": b["seconds"],
                         "route_small": a["route"], "route_large": b["route"],
                         "ok": ratio <= GOAL and a["rc"] == 0 and b["rc"] == 0})
    return rows


def write_markdown(res: dict) -> None:
    from bench._results import replace_section

    c = res["config"]
    small, large = c["sizes"]
    chunk_rows = {k: v["fit"]["chunk_rows"] for k, v in res["stores"].items()}
    budget = (f"default --memory-budget ({c['memory_budget_MiB']:g} MiB)" if c["memory_budget_default"]
              else f"--memory-budget {c['memory_budget_MiB']:g}")
    section = c.get("section", "memory")
    layers = " and ".join(f"`{k}` ({v:,})" for k, v in c["widths"].items())
    lines = [f"## {section}", "",
             f"`OMP_NUM_THREADS=1 python bench/memory.py{' --streamed' if section != 'memory' else ''}` on {c['machine']} {c['cpus']} cores ({c['started']}; "
             f"load average before {c['load_before']}, after {c['load_after']}; {c['seconds_total'] / 60:.1f} min "
             "in all). Peak RSS of each analysis command in a fresh process (`os.wait4` rusage, the "
             "number `/usr/bin/time -v` reports), stores of one synthetic network at n = "
             f"{small:,} and {large:,}: layers {layers}, float16, logits ({c['classes']}), {c['classes']} classes, a head; "
             f"evaluation stores n / {c['eval_divisor']}. Chunk rows: "
             + ", ".join(f"{k} → {v}" for k, v in chunk_rows.items())
             + f" (`default` = save_store's byte rule). {budget}; probes with `--lambdas {c['lambdas']}` "
             "(the protocol's 45-value grid thinned to fit the run in minutes: the same code path, fewer "
             "warm-started solves). Route: what `probe`/`calibrate` chose (in memory when the working set "
             "fits the budget, else out of core); the other commands always stream. Goal: RSS "
             f"ratio {large // 1000}k / {small // 1000}k ≤ {GOAL}.", "",
             f"| chunking | command | RSS MiB n = {small // 1000}k | RSS MiB n = {large // 1000}k | ratio | "
             f"seconds {small // 1000}k | seconds {large // 1000}k | route {small // 1000}k / {large // 1000}k |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    table = ratios(res)
    for r in table:
        ratio = f"{r['ratio']:.2f}" if r["ok"] else f"**{r['ratio']:.2f}**"
        lines.append(f"| {r['chunking']} | `{r['command']}` | {r['rss_small']:.0f} | {r['rss_large']:.0f} | {ratio} | "
                     f"{r['s_small']:.1f} | {r['s_large']:.1f} | {r['route_small']} / {r['route_large']} |")
    bad = [f"{r['chunking']}/{r['command']}" for r in table if not r["ok"]]
    lines += ["", f"- Goal (every ratio ≤ {GOAL}): " + ("met." if not bad else "NOT met by " + ", ".join(bad) + "."),
              "- Wall times are of a shared 2-core box (load above), one BLAS thread; they include "
              "interpreter start and imports (~1-2 s).", ""]
    for note in NOTES if section == "memory" else STREAMED_NOTES:
        lines.append(note)
    replace_section(section, "\n".join(lines) + "\n")


# Hand-written observations about the last --streamed run (edited with each re-measurement).
STREAMED_NOTES: list[str] = [
    "- Run of 2026-11-29 00:00-00:13 UTC, beside the same rows on main before the fix (7ce62f2, same stores, "
    "run at the same time from a copy of main's repsim/): `probe-linear` 113 → 161 MiB (1.43), `probe-relearn` "
    "149 → 193 MiB (1.29) — issue 43's 127 → 161 and 152 → 197. After: 106 → 125 (1.17) and 143 → 161 (1.12); "
    "wall times 491 → 426 s and 284 → 151 s at 40k (shared box, load 5-6).",
    "- The cause (tracemalloc snapshots at the peak, in-process runs on these stores): a streamed pass held the "
    "previous block's gathered and centred rows while it read the next (the generators' and the callers' loop "
    "variables), so at 40k two full 8,192-row blocks (8 MiB float16 + 16 MiB float32 each) were alive where "
    "10k's second chunk held 1,808 rows — what looked like a float16 copy of the added rows; and those "
    "block-sized copies were allocated afresh per block, which glibc's heap kept (its mmap threshold rises to "
    "the largest block freed): RSS above the traced bytes grew with n too (pinning MALLOC_MMAP_THRESHOLD_ cut "
    "40k's 121 to 104 MiB before the buffers). Now each block is dropped before the next is read and the "
    "gathered and centred rows go to two buffers reused by every pass (`Rows.scratch`); test rows are scored "
    "from the decoded chunk, 1,024 rows at a time. `release_free_memory()` (malloc_trim) after each pass or "
    "around the refit was tried and changed nothing (121 → 119, 122 → 122): not used.",
    "- What still grows (linear 1.17, above the goal): the solver's (K, n) logits and line-search arrays, "
    "O(n·K) by design (docs/architecture.md), +9.6 MiB traced from 10k to 40k at K = 10, and ~8 MiB of heap "
    "slack around them that no fixed mmap threshold removed (115-120 MiB at 40k for thresholds 128 KiB-4 MiB). "
    "`--relearn` has the same solver but no test store; `probe-linear`'s test store (n / 8) also grows from "
    "one 1,250-row chunk to 5,000 rows.",
]

# Hand-written observations about the last run (edited with each re-measurement).
NOTES: list[str] = [
    "- Run of 2026-11-26 08:16-08:33 UTC (17.4 min with writing the chunk-2500 stores; the default-chunking "
    "stores were reused from a first run, whose ratios agreed except where noted). Default chunking gives "
    "2,048 rows per chunk at both n (8 MiB of `block`), no longer one 32,768-row chunk.",
    "- `probe` (all modes) and `calibrate`: at n = 20k the probes fit the default budget and run in memory; at "
    "80k they stream, and their peak RSS is 22-27 % *lower* than in memory at 20k, although the out-of-core "
    "route keeps the fit store's `pool` rows (80,000 × 512 float32 = 156 MiB: centred for the linear "
    "probe, decoded chunks for kNN) in its cache of half the budget; with `--memory-budget 0` it keeps "
    "none. Issue 31 measured 547 → 996 MiB (default probe), 379 → 903 (linear), 527 → 950 (kNN), "
    "374 → 920 (relearn), 166 → 199 (calibrate). `calibrate` stays in memory at both n (10 classes); its "
    "(N, K) float64 copies are gone (`probes.calibration` works on row blocks): 195 → 223 MiB before "
    "that change in the first run, 191 → 193 after.",
    "- `collapse --spectra` at chunk 2500 (1.17) and `collapse` with default chunks (1.17 in the first run, "
    "1.14 here) are not O(n): `engine.drivers._scan_store` reads 16 chunks per task, so a 20k store is one "
    "task while an 80k store runs two at once on the threaded scheduler (two readers' prefetched chunks "
    "and accumulators). Run with `blocks_per_task=64` (one task), the 80k chunk-2500 store's "
    "`collapse --spectra` peaks at 117 MiB against 110 MiB at 20k (1.06); with the default 16, 130. A "
    "larger n adds no further tasks in flight.",
    "- `cka` (minibatch) varies from run to run by ±10 %: n = 20k default chunks 282, 258, 259 MiB and "
    "80k 315, 320, 302 MiB in three runs (ratios 1.12, 1.24, 1.17). With `--shuffle none` the same stores "
    "give 229 → 257 MiB (1.12), so the extra memory at 80k comes with the default window shuffle "
    "(`engine.blocks.BatchPlan`: windows of whole permuted blocks); not investigated further "
    "(`kernels/cka.py` and the engine's drivers were being reworked in parallel).",
]


if __name__ == "__main__":
    raise SystemExit(main())
