"""Calibrated similarity: repsim's permutation nulls against the reference tool and against the
uncalibrated pass, each ratio from one run.

1. **18 × 18 layers, K = 200** (``--layers 18 --n 500 --p 256``): every pair of two stacks of 18 layers
   (a shared latent plus noise, so some pairs are related and some are not), each pair calibrated with
   200 permutations — repsim's :func:`repsim.calibrated_matrix` (each layer prepared once, the nulls as
   batched products / index maps) against ``calibrated_similarity.calibrate`` (Gröger et al. 2026, the
   reference) called per pair with the same metric written in torch float64 (debiased linear CKA;
   mutual k-NN, k = 10).  The reference does (K + 1) · 18 · 18 = 65,124 metric calls; it is timed on
   ``--reference-pairs`` pairs (all K draws each) and extrapolated linearly to the 324 pairs (every
   pair does identical work); ``--reference-pairs 324`` times all of them.
2. **minibatch CKA heatmap, CPU**: ``repsim.similarity_matrix`` over two Zarr stores of ``--mb-layers``
   flattened conv-width layers each (float16, p from ``--mb-widths``), one epoch, batch ``--batch``:
   uncalibrated, with ``permutations=200`` (the within-batch Monte Carlo null of all column pairs in the
   same pass) and with ``null="analytic"``.  Goals: ≤ 5× and ≤ 1.1× the uncalibrated pass.
3. ``--device cuda``: part 2 on the GPU (CuPy) — goal: K = 200 null products ≤ 2× the uncalibrated GPU pass.
   On a lent H200 (the image lacks zarr and dask: the wheels of bench/gpu_device.sh in .whl/, carried):
   ``python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && python3 -m pip install -q
   --no-index --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 python3 bench/calibration.py
   --device cuda --mb-n 4096 --batch 1024 --mb-layers 9 --repeats 2 && cp bench/RESULTS.md
   bench/results/calibration_gpu.json $OUT/`` (``carry: [".whl"]``, ``timeout_s: 500``).

Writes JSON (``--out``, default bench/results/calibration.json; a ``--device cuda`` run writes
calibration_gpu.json) and, for a full run with the default ``--out``, the ``## calibration`` section of
bench/RESULTS.md (the GPU run its ``## calibration_gpu`` section).

Usage: python bench/calibration.py [--quick] [--device cuda] [--skip-reference]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _results import json_out, provenance, provenance_line, records, replace_section  # noqa: E402


def stacks(rng: np.random.Generator, L: int, n: int, p: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two stacks of L layers (n, p): layer l mixes a shared latent with weight that falls with l."""
    Z = rng.normal(size=(n, 16))
    out = []
    for _ in range(2):
        layers = []
        for ell in range(L):
            w = 1.0 - ell / L
            layers.append(w * Z @ rng.normal(size=(16, p)) + rng.normal(size=(n, p)))
        out.append(layers)
    return out[0], out[1]


def torch_metrics(k: int):
    import torch

    def cka(X, Y):
        def u(K):
            n = K.shape[0]
            K = K.clone()
            K.fill_diagonal_(0)
            r = K.sum(1)
            U = K - (r[:, None] + r[None, :]) / (n - 2) + r.sum() / ((n - 1) * (n - 2))
            U.fill_diagonal_(0)
            return U
        Kx, Ky = u(X @ X.T), u(Y @ Y.T)
        return (Kx * Ky).sum() / torch.sqrt((Kx * Kx).sum() * (Ky * Ky).sum())

    def knn(X, Y):
        def lists(F):
            F = F / F.norm(dim=1, keepdim=True)
            S = F @ F.T
            S.fill_diagonal_(-1e8)
            return S.topk(k, dim=1).indices
        a, b = lists(X), lists(Y)
        return (a[:, :, None] == b[:, None, :]).any(2).sum(1).double().mean() / k

    return {"linear_cka": cka, "mutual_knn": knn}


def part_matrix(args: argparse.Namespace) -> dict:
    import repsim

    rng = np.random.default_rng(0)
    A, B = stacks(rng, args.layers, args.n, args.p)
    out = {"layers": args.layers, "n": args.n, "p": args.p, "permutations": args.permutations, "rows": {}}
    for name in ("linear_cka", "mutual_knn"):
        opts = {"knn_k": 10} if name == "mutual_knn" else {}
        t0 = time.perf_counter()
        ours = repsim.calibrated_matrix(A, B, name, permutations=args.permutations, seed=0, **opts)
        t_ours = time.perf_counter() - t0
        row = {"repsim_s": t_ours, "significant": int((ours["pvalues"] <= 0.05).sum())}
        if not args.skip_reference:
            import torch
            from calibrated_similarity import calibrate

            torch.set_num_threads(args.threads)
            sim = torch_metrics(10)[name]
            At = [torch.as_tensor(x) for x in A]
            Bt = [torch.as_tensor(y) for y in B]
            pairs = [(i, j) for i in range(args.layers) for j in range(args.layers)][:: max(1, args.layers ** 2
                                                                                            // args.reference_pairs)]
            pairs = pairs[:args.reference_pairs]
            t0 = time.perf_counter()
            agree = []
            for i, j in pairs:
                cal, p, tau = calibrate(At[i], Bt[j], sim, K=args.permutations, alpha=0.05,
                                        generator=torch.Generator().manual_seed(i * 100 + j))
                agree.append(abs(float(p) - float(ours["pvalues"][i, j])))
            t_ref = (time.perf_counter() - t0) * (args.layers ** 2 / len(pairs))
            se = float(np.sqrt(0.25 * 2 / args.permutations))
            row.update(reference_s=t_ref, reference_pairs_timed=len(pairs), ratio=t_ref / t_ours,
                       max_abs_p_difference_independent_draws=max(agree), p_mc_error_bound=4 * se)
        out["rows"][name] = row
        print(f"  {name}: repsim {t_ours:.2f} s" + (f", reference {row['reference_s']:.1f} s (extrapolated from "
              f"{row['reference_pairs_timed']} pairs): {row['ratio']:.0f}x" if "ratio" in row else ""), flush=True)
    return out


def make_stores(root: Path, L: int, n: int, widths: list[int]) -> list:
    import repsim

    rng = np.random.default_rng(1)
    Z = rng.normal(size=(n, 32)).astype(np.float32)
    stores = []
    for s in ("a", "b"):
        layers = {}
        for ell in range(L):
            p = widths[ell % len(widths)]
            W = rng.normal(size=(32, p)).astype(np.float32)
            x = np.maximum(Z @ W * (1 - ell / L) + rng.normal(size=(n, p)).astype(np.float32), 0)
            layers[f"l{ell}"] = x.reshape(n, -1, 4, 4) if p % 16 == 0 else x
        ids = np.arange(n)
        stores.append(repsim.save_store(str(root / f"{s}.zarr"), layers=layers, labels=ids % 10, example_ids=ids,
                                        dtype="float16",
                                        meta={"dataset": {"name": "bench", "split": "val"}}))
    return stores


def part_heatmap(args: argparse.Namespace, device: str) -> dict:
    import repsim

    widths = [int(w) for w in args.mb_widths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        stores = make_stores(Path(tmp), args.mb_layers, args.mb_n, widths)
        kw = dict(batch_size=args.batch, epochs=1, seed=0, shuffle=False, progress=False, device=device)
        sync = None
        if device == "cuda":
            import cupy

            sync = cupy.cuda.Device().synchronize
        runs = {"uncalibrated": {}, "permutation": {"permutations": args.permutations},
                "analytic": {"null": "analytic"}, "analytic_before": {"null": "analytic"}}
        # interleaved rounds (every run once per round, after one warm-up round), best of the rounds: on
        # a shared box the load drifts over minutes, and run-by-run blocks of repeats would see different
        # loads; the process's CPU time (all its threads) is recorded beside the wall time
        # ... and the CPU time of the analytic null's own updates (thread CPU time: not the waits for
        # the GIL or a core, which make the wall-time ratios of a loaded box noisy), per batch
        times, cpu, update_cpu = {}, {}, {}
        for round_ in range(args.repeats + 1):
            for what, extra in runs.items():
                with previous_analytic_update() if what == "analytic_before" else nullcontext(), \
                        timed_analytic_updates() as spent:
                    w0, c0 = time.perf_counter(), time.process_time()
                    repsim.similarity_matrix(stores, ["linear_cka"], **kw, **extra)
                    if sync is not None:
                        sync()
                    w, c = time.perf_counter() - w0, time.process_time() - c0
                if round_:  # (round 0: the warm-up)
                    times[what], cpu[what] = min(times.get(what, w), w), min(cpu.get(what, c), c)
                    if spent["batches"]:
                        per = spent["cpu"] / spent["batches"]
                        update_cpu[what] = min(update_cpu.get(what, per), per)
        for what in runs:
            print(f"  heatmap {device} {what}: {times[what]:.2f} s (CPU {cpu[what]:.2f} s)"
                  + (f"; its null's update {1e3 * update_cpu[what]:.1f} ms CPU per batch" if what in update_cpu else ""),
                  flush=True)
    L = 2 * args.mb_layers
    return {"device": device, "columns": L, "n": args.mb_n, "batch": args.batch, "widths": widths,
            "permutations": args.permutations, "seconds": times, "cpu_seconds": cpu,
            "analytic_update_cpu_per_batch": update_cpu,
            "cpu_ratio_analytic": cpu["analytic"] / cpu["uncalibrated"],
            "cpu_ratio_analytic_before": cpu["analytic_before"] / cpu["uncalibrated"],
            "ratio_permutation": times["permutation"] / times["uncalibrated"],
            "ratio_analytic": times["analytic"] / times["uncalibrated"],
            "ratio_analytic_before": times["analytic_before"] / times["uncalibrated"]}


@contextmanager
def timed_analytic_updates():
    """{"cpu": thread CPU seconds spent in MinibatchAnalytic.update, "batches": calls} while active."""
    from repsim.kernels.analytic_null import MinibatchAnalytic

    spent = {"cpu": 0.0, "batches": 0}
    now = MinibatchAnalytic.update

    def update(self, batch, key=()):
        t0 = time.thread_time()
        try:
            return now(self, batch, key)
        finally:
            spent["cpu"] += time.thread_time() - t0
            spent["batches"] += 1

    MinibatchAnalytic.update = update
    try:
        yield spent
    finally:
        MinibatchAnalytic.update = now


@contextmanager
def previous_analytic_update():
    """The analytic null's per-batch update as it was before 2026-11-28 23:00 UTC (commit 7ce62f2), for the
    before/after row of the same run: each column's U-centred matrix a fresh float64 array (the seven-pass
    U-centring), stacked, and the invariants from a full float64 A·A (a GEMM, not the half of one) with
    a new temporary per elementwise sum."""
    from repsim.array_api import array_namespace, diagonal, to_numpy
    from repsim.kernels._precision import CenteredGram
    from repsim.kernels.analytic_null import MinibatchAnalytic
    from repsim.kernels.minibatch_null import MinibatchNull

    def ucenter_before(K, xp):
        n = K.shape[0]
        off = 1 - xp.eye(n, dtype=K.dtype)
        K0 = K * off
        r = xp.sum(K0, axis=1)
        s = xp.sum(r)
        return (K0 - (r[:, None] + r[None, :]) / (n - 2) + s / ((n - 1) * (n - 2))) * off

    def centered(shaper, x, name, xp):
        K = x.K if isinstance(x, CenteredGram) else None
        if K is None or not shaper.debiased:
            return shaper._centered(x, name, xp)
        b = K.shape[0]
        keep = float(xp.sum(diagonal(K, xp)) > 0)
        return ucenter_before(K, xp) / float(np.sqrt(b * (b - 3))) * keep

    def invariants_before(A, xp):
        out = np.empty((A.shape[0], 8))
        for l_ in range(A.shape[0]):
            M = A[l_, ...]
            d = diagonal(M, xp)
            MM = M @ M
            dd = diagonal(MM, xp)
            vals = [xp.sum(d), xp.sum(M * M), xp.sum(d * d), xp.sum(MM * M), xp.sum(d * d * d), xp.sum(M * M * M),
                    xp.sum(d * dd), xp.sum(d * (M @ d))]
            out[l_] = [float(to_numpy(v)) for v in vals]
        return out

    def update(self, batch, key=()):
        first = batch[0].K if isinstance(batch[0], CenteredGram) else batch[0]
        xp = array_namespace(first)
        shaper = MinibatchNull(self.n_layers, [0] * self.n_layers, 1, debiased=self.debiased, names=self.names,
                               compute_dtype=self.compute_dtype)
        A = xp.stack([centered(shaper, x, name, xp) for x, name in zip(batch, self.names)])
        return self.add_batch(A, invariants_before(A, xp), xp)

    now = MinibatchAnalytic.update
    MinibatchAnalytic.update = update
    try:
        yield
    finally:
        MinibatchAnalytic.update = now


def markdown(res: dict, gpu: bool) -> str:
    prov = provenance_line(res["provenance"])
    if gpu:
        h = res["heatmap"]
        return (f"## calibration_gpu\n\n`python bench/calibration.py --device cuda` ({res['provenance']['date_utc']}). "
                f"Minibatch CKA heatmap on the GPU: {h['columns']} columns (flattened widths {h['widths']}), n = {h['n']}, "
                f"batch {h['batch']}, one epoch.\n\n| run | s | ratio |\n|---|---:|---:|\n"
                + "".join(f"| {k} | {v:.2f} | {v / h['seconds']['uncalibrated']:.2f} |\n" for k, v in h['seconds'].items())
                + f"\nGoal: K = {h['permutations']} null products ≤ 2× the uncalibrated GPU pass: "
                f"{'met' if h['ratio_permutation'] <= 2 else 'NOT met'} ({h['ratio_permutation']:.2f}×).\n\n{prov}\n")
    m, h = res["matrix"], res["heatmap"]
    lines = [f"## calibration\n\n`python bench/calibration.py` ({res['provenance']['date_utc']}; 2-core shared CPU, "
             f"{res['args']['threads']} BLAS/torch thread(s) for both sides; arguments {res['args']}).\n",
             f"**Calibrated {m['layers']} × {m['layers']}-layer matrix, K = {m['permutations']}** (n = {m['n']}, "
             f"p = {m['p']} per layer; every pair's p-value, τ and calibrated score): repsim.calibrated_matrix against "
             "calibrated_similarity.calibrate per pair with the same metric in torch float64 (reference time "
             "extrapolated linearly from the pairs timed, all K draws each).\n",
             "| measure | repsim (s) | reference (s) | pairs timed | ratio | max \\|Δp\\| (independent draws) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in m["rows"].items():
        if "ratio" in row:
            lines.append(f"| {name} | {row['repsim_s']:.2f} | {row['reference_s']:.1f} | {row['reference_pairs_timed']} "
                         f"| **{row['ratio']:.0f}×** | {row['max_abs_p_difference_independent_draws']:.3f} |")
        else:
            lines.append(f"| {name} | {row['repsim_s']:.2f} | – | – | – | – |")
    lines += ["", f"**Minibatch CKA heatmap, CPU**: two stores of {h['columns'] // 2} float16 layers (flattened widths "
              f"{h['widths']}), n = {h['n']}, batch {h['batch']}, one epoch, `similarity_matrix(..., linear_cka)`:", "",
              "| run | s | ratio to uncalibrated | CPU s (all threads) | CPU ratio |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {v / h['seconds']['uncalibrated']:.2f} | {h['cpu_seconds'][k]:.2f} | "
              f"{h['cpu_seconds'][k] / h['cpu_seconds']['uncalibrated']:.2f} |" for k, v in h["seconds"].items()]
    lines += ["", f"Best of {res['args']['repeats']} interleaved rounds (each run once per round, after a warm-up "
              "round). `analytic_before`: the analytic null's update as it was before 2026-11-28 "
              "(`previous_analytic_update`), timed in the same rounds. CPU time of the null's own update per batch "
              "(its thread's CPU time, best of the rounds): "
              + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in h.get("analytic_update_cpu_per_batch", {}).items()) + "."]
    goals = []
    for name, row in m["rows"].items():
        if "ratio" in row:
            goals.append(f"{name} ≥ 50× the reference: {'met' if row['ratio'] >= 50 else 'NOT met'} ({row['ratio']:.0f}×)")
    goals.append(f"K = {h['permutations']} within-batch null ≤ 5× the uncalibrated pass: "
                 f"{'met' if h['ratio_permutation'] <= 5 else 'NOT met'} ({h['ratio_permutation']:.2f}×)")
    goals.append(f"analytic null ≤ 1.1×: {'met' if h['ratio_analytic'] <= 1.1 else 'NOT met'} ({h['ratio_analytic']:.2f}× "
                 f"wall, {h['cpu_ratio_analytic']:.2f}× CPU; its previous update, `analytic_before`, "
                 f"{h['ratio_analytic_before']:.2f}× wall, {h['cpu_ratio_analytic_before']:.2f}× CPU in the same run)")
    lines += ["", "Goals: " + "; ".join(goals) + ".", "", prov, ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--p", type=int, default=256)
    ap.add_argument("--permutations", type=int, default=200)
    ap.add_argument("--reference-pairs", type=int, default=6)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--mb-layers", type=int, default=6, help="layers per store of the heatmap part")
    ap.add_argument("--mb-n", type=int, default=1536)
    ap.add_argument("--mb-widths", default="16384,8192,4096", help="flattened conv widths, cycled over the layers")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS and torch threads for both sides (default 1: the algorithms; on this shared 2-core "
                         "box threaded BLAS thrashed — 36 MFLOP/s for one product at load 18)")
    ap.add_argument("--quick", action="store_true", help="small sizes, a trial (writes no recorded results)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    default = HERE / "results" / ("calibration_gpu.json" if gpu else "calibration.json")
    out = args.out or str(default)
    if args.quick:
        args.layers, args.n, args.p, args.reference_pairs = 4, 120, 32, 2
        args.mb_layers, args.mb_n, args.mb_widths, args.batch = 2, 256, "1024,512", 64
    res: dict = {"args": vars(args)}
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # (the GPU image may lack it: the device run uses no host BLAS to speak of)
        from contextlib import nullcontext as threadpool_limits  # type: ignore[assignment]

    with threadpool_limits(args.threads):
        if not gpu:
            print("calibrated matrix:", flush=True)
            res["matrix"] = part_matrix(args)
        print("minibatch heatmap:", flush=True)
        res["heatmap"] = part_heatmap(args, args.device)
    res["provenance"] = provenance()
    path = json_out(out, default, args.quick)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(res, fh, indent=2)
    print(f"-> {path}")
    h = res["heatmap"]
    print(f"ratios: permutation null / uncalibrated {h['ratio_permutation']:.2f}x, analytic {h['ratio_analytic']:.2f}x"
          + "".join(f"; {k} vs reference {r['ratio']:.0f}x" for k, r in res.get("matrix", {}).get("rows", {}).items()
                    if "ratio" in r))
    if records(out, default, args.quick, args.skip_reference and not gpu):
        replace_section("calibration_gpu" if gpu else "calibration", markdown(res, gpu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
