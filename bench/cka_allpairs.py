"""All-pairs minibatch CKA: repsim vs the pairwise and batched peer algorithms, on the same data.

One minibatch of n = 600 examples, L = 64 layers of p = 384 features (float32, post-ReLU-like),
debiased (unbiased HSIC) CKA between every pair of layers:

* ours      ``repsim.kernels.cka.batch_hsic`` (NumPy): centred features, Gram triangles by row blocks
            (SYRK/GEMM), all L×L values from one product A Aᵀ, float64 L×L accumulation.
            Run in float32 (the GPU numerics, same precision as the peers) and float64 (the CPU
            default of repsim).
* pairwise  torch_cka (AntixK/PyTorch-Model-Compare, ``pip install torch_cka``): the body of
            ``CKA.compare`` for one batch -- per layer pair, the Gram L of layer j is rebuilt,
            diagonals zeroed, and ``CKA._HSIC`` evaluates trace(K @ L) (an n×n×n product) for
            (K, L) and (L, L). Timed on the first ``--pairwise-rows`` rows of the L×L loop and
            extrapolated linearly to all L rows (every row does identical work).
* batched   pytorch-cka (ryusudol/pytorch-cka, ``pip install pytorch-cka``): the same-model path
            of ``CKA._accumulate_hsic`` -- one ``torch.mm`` Gram per layer, stacked to (L, n, n),
            then ``hsic_cross`` (``einsum("aij,bij->ab")`` plus the Song et al. correction terms).

The peers are installed at run time into a temporary directory (never a dependency); if an install
fails, a faithful re-implementation of the same code path runs instead and the JSON says so.
All runs use one thread (``OMP/OPENBLAS/MKL_NUM_THREADS=1``, ``torch.set_num_threads(1)``) so the
numbers compare algorithms, not thread pools; times are the best of ``--repeats`` interleaved
rounds (each round runs every candidate once, so a busy machine slows all of them alike).
The FLOP bound is the time the L symmetric Grams need at the machine's measured GEMM rate
(L · n² · p FLOPs: n(n+1)/2 dot products of length p, measured as float32 GEMM GFLOP/s here).

Usage: python bench/cka_allpairs.py [--layers 64 --n 600 --p 384 --repeats 5 --pairwise-rows 2]
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from repsim.kernels.cka import batch_hsic, hsic_to_cka  # noqa: E402


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (caches, lazy init)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def install_peers(target: str) -> dict[str, str]:
    """pip install the two peers (no dependencies: torch, tqdm, matplotlib are already here)."""
    status = {}
    for pkg in ("torch_cka", "pytorch-cka"):
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, pkg]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            status[pkg] = "installed" if r.returncode == 0 else f"pip failed: {r.stderr.strip()[-200:]}"
        except Exception as e:  # noqa: BLE001
            status[pkg] = f"pip failed: {e}"
    sys.path.insert(0, target)
    return status


# --- faithful re-implementations, used only when the real package cannot be installed ---------
def _fallback_torch_cka_hsic(self, K, L):
    import torch

    N = K.shape[0]
    ones = torch.ones(N, 1).to(self.device)
    result = torch.trace(K @ L)
    result += ((ones.t() @ K @ ones @ ones.t() @ L @ ones) / ((N - 1) * (N - 2))).item()
    result -= ((ones.t() @ K @ L @ ones) * 2 / (N - 2)).item()
    return (1 / (N * (N - 3)) * result).item()


def _fallback_hsic_cross(grams_x, grams_y):
    import torch

    n = grams_x.shape[1]
    diag_x = torch.diagonal(grams_x, dim1=-2, dim2=-1)
    diag_y = torch.diagonal(grams_y, dim1=-2, dim2=-1)
    trace_kl = torch.einsum("aij,bij->ab", grams_x, grams_y) - torch.einsum("ai,bi->ab", diag_x, diag_y)
    sum_k = grams_x.sum(dim=(-2, -1)) - diag_x.sum(dim=-1)
    sum_l = grams_y.sum(dim=(-2, -1)) - diag_y.sum(dim=-1)
    term2 = torch.outer(sum_k, sum_l) / ((n - 1) * (n - 2))
    col_k = grams_x.sum(dim=-2) - diag_x
    col_l = grams_y.sum(dim=-2) - diag_y
    term3 = 2 * torch.mm(col_k, col_l.T) / (n - 2)
    return (trace_kl + term2 - term3) / (n * (n - 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--p", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pairwise-rows", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cka_allpairs.json"))
    args = ap.parse_args()
    L, n, p = args.layers, args.n, args.p

    import torch

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="repsim-peers-")
    pip_status = install_peers(tmp)

    try:
        torch_cka = importlib.import_module("torch_cka")
        pairwise_hsic = torch_cka.CKA._HSIC
        pairwise_impl = f"torch_cka {getattr(torch_cka, '__version__', '0.21')} (real CKA._HSIC)"
    except Exception as e:  # noqa: BLE001
        pairwise_hsic = _fallback_torch_cka_hsic
        pairwise_impl = f"faithful re-implementation of torch_cka CKA._HSIC ({type(e).__name__}: {e})"
    try:
        cka_hsic = importlib.import_module("cka.hsic")
        hsic_cross = getattr(cka_hsic, "hsic_cross", None) or cka_hsic.hsic_outer
        batched_impl = f"pytorch-cka (real cka.hsic.{hsic_cross.__name__})"
    except Exception as e:  # noqa: BLE001
        hsic_cross = _fallback_hsic_cross
        batched_impl = f"faithful re-implementation of pytorch-cka hsic_cross ({type(e).__name__}: {e})"

    rng = np.random.default_rng(0)
    z = rng.standard_normal((n, 16), dtype=np.float32)
    feats = []
    for _ in range(L):  # post-ReLU-like layers sharing a latent
        w = rng.standard_normal((16, p), dtype=np.float32) * 0.5
        feats.append(np.maximum(z @ w + rng.standard_normal((n, p), dtype=np.float32) + 0.5, 0))
    feats_t = [torch.from_numpy(f) for f in feats]

    # --- batched peer (pytorch-cka same-model path) ----------------------------------------------
    def batched():
        with torch.no_grad():
            grams = torch.stack([torch.mm(f, f.T) for f in feats_t])
            h = hsic_cross(grams, grams)
            d = torch.diagonal(h)
            return h / torch.sqrt(torch.clamp(d[:, None] * d[None, :], min=0.0))

    # --- interleaved timing: every round times each candidate once, so load drift hits all alike --
    a = feats[0]
    b = np.ascontiguousarray(feats[1].T)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    at, bt = feats_t[0], feats_t[1].T.contiguous()
    centred = [f - f.mean(axis=0) for f in feats]
    candidates = {
        "gemm_numpy_float32": lambda: a @ b,
        "gemm_torch_float32": lambda: torch.mm(at, bt),
        "gemm_numpy_float64": lambda: a64 @ b64,
        "syrk_floor_float32": lambda: [c @ c.T for c in centred],
        "ours_float32": lambda: batch_hsic(feats, compute_dtype="float32"),
        "ours_float64": lambda: batch_hsic(feats, compute_dtype="float64"),
        "batched": batched,
    }
    best = {k: float("inf") for k in candidates}
    for f in candidates.values():
        f()  # warm-up
    for _ in range(args.repeats):
        for k, f in candidates.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    gemm_np = 2 * n * n * p / best["gemm_numpy_float32"] / 1e9
    gemm_torch = 2 * n * n * p / best["gemm_torch_float32"] / 1e9
    gemm_np64 = 2 * n * n * p / best["gemm_numpy_float64"] / 1e9
    peak = max(gemm_np, gemm_torch)
    t_ours32, t_ours64, t_batched = best["ours_float32"], best["ours_float64"], best["batched"]
    ours = hsic_to_cka(batch_hsic(feats, compute_dtype="float64"))
    ours32 = hsic_to_cka(batch_hsic(feats, compute_dtype="float32"))
    batched_vals = batched().double().numpy()

    # --- pairwise peer (torch_cka compare loop body), first rows, extrapolated ------------------
    fake_self = SimpleNamespace(device="cpu")
    rows = max(1, min(args.pairwise_rows, L))
    pair_vals = np.full((rows, L), np.nan)

    def pairwise():
        with torch.no_grad():
            for i in range(rows):
                X = feats_t[i].flatten(1)
                K = X @ X.t()
                K.fill_diagonal_(0.0)
                kk = pairwise_hsic(fake_self, K, K)
                for j in range(L):
                    Y = feats_t[j].flatten(1)
                    Lg = Y @ Y.t()
                    Lg.fill_diagonal_(0)
                    kl = pairwise_hsic(fake_self, K, Lg)
                    ll = pairwise_hsic(fake_self, Lg, Lg)
                    pair_vals[i, j] = kl / np.sqrt(kk * ll)

    t_pair_rows = best_time(pairwise, max(1, min(args.repeats, 2)))
    t_pairwise = t_pair_rows * L / rows

    flops_sym = L * n * n * p
    bound = flops_sym / (peak * 1e9)
    res = {
        "benchmark": "cka_allpairs",
        "config": {"layers": L, "n": n, "p": p, "dtype_input": "float32", "threads": 1,
                   "repeats": args.repeats, "pairwise_rows_timed": rows},
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "loadavg": os.getloadavg()},
        "peers": {"pairwise": pairwise_impl, "batched": batched_impl, "pip": pip_status},
        "gemm_gflops": {"numpy_float32": gemm_np, "torch_float32": gemm_torch, "numpy_float64": gemm_np64},
        "seconds": {"ours_float32": t_ours32, "ours_float64": t_ours64, "batched": t_batched,
                    "syrk_floor_float32": best["syrk_floor_float32"],
                    "pairwise_extrapolated": t_pairwise, "pairwise_rows_measured": t_pair_rows},
        "speedup": {"vs_pairwise": t_pairwise / t_ours32, "vs_batched": t_batched / t_ours32,
                    "vs_pairwise_float64": t_pairwise / t_ours64, "vs_batched_float64": t_batched / t_ours64},
        "flop_bound": {"gram_flops_symmetric": flops_sym, "bound_seconds": bound,
                       "ours_float32_over_bound": t_ours32 / bound,
                       "ours_float32_over_syrk_floor": t_ours32 / best["syrk_floor_float32"],
                       "ours_float64_over_bound_at_f64_rate": t_ours64 / (flops_sym / (gemm_np64 * 1e9))},
        "agreement": {"max_abs_ours32_vs_ours64": float(np.max(np.abs(ours32 - ours))),
                      "max_abs_batched_vs_ours64": float(np.max(np.abs(batched_vals - ours))),
                      "max_abs_pairwise_vs_ours64": float(np.nanmax(np.abs(pair_vals - ours[:rows])))},
        "goals": {"vs_pairwise>=30": t_pairwise / t_ours32 >= 30, "vs_batched>=2": t_batched / t_ours32 >= 2},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")

    s = res["seconds"]
    print(f"L={L} n={n} p={p}, 1 thread, best of {args.repeats}; GEMM f32 numpy {gemm_np:.1f} / torch "
          f"{gemm_torch:.1f} GFLOP/s, f64 numpy {gemm_np64:.1f}")
    print(f"  ours float32 {s['ours_float32'] * 1e3:8.1f} ms   ({t_ours32 / bound:.2f}x the Gram FLOP bound, "
          f"{t_ours32 / s['syrk_floor_float32']:.2f}x the time of the L NumPy SYRK Grams alone "
          f"({s['syrk_floor_float32'] * 1e3:.1f} ms))")
    print(f"  ours float64 {s['ours_float64'] * 1e3:8.1f} ms")
    print(f"  batched      {s['batched'] * 1e3:8.1f} ms   -> ours is {t_batched / t_ours32:.2f}x faster   [{batched_impl}]")
    print(f"  pairwise     {s['pairwise_extrapolated'] * 1e3:8.1f} ms   -> ours is {t_pairwise / t_ours32:.1f}x faster "
          f"(extrapolated from {rows} of {L} rows)   [{pairwise_impl}]")
    print(f"  agreement (max |ΔCKA| vs ours float64): ours32 {res['agreement']['max_abs_ours32_vs_ours64']:.1e}, "
          f"batched {res['agreement']['max_abs_batched_vs_ours64']:.1e}, "
          f"pairwise {res['agreement']['max_abs_pairwise_vs_ours64']:.1e}")
    write_results_md(res)
    return 0


def write_results_md(res: dict) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    c, s, sp, fb = res["config"], res["seconds"], res["speedup"], res["flop_bound"]
    section = (
        "## cka_allpairs\n\n"
        f"Debiased CKA between all pairs of L={c['layers']} layers on one batch (n={c['n']}, p={c['p']}, "
        f"float32 input), one thread, best of {c['repeats']} interleaved rounds (`python bench/cka_allpairs.py`; "
        f"load average at start {res['machine']['loadavg'][0]:.1f}).\n\n"
        "| algorithm | time (ms) | ours float32 is faster by |\n|---|---:|---:|\n"
        f"| repsim `batch_hsic`, float32 | {s['ours_float32'] * 1e3:.1f} | 1 |\n"
        f"| repsim `batch_hsic`, float64 | {s['ours_float64'] * 1e3:.1f} | {s['ours_float64'] / s['ours_float32']:.2f} |\n"
        f"| batched (L,n,n) einsum — {res['peers']['batched']} | {s['batched'] * 1e3:.1f} | {sp['vs_batched']:.2f} |\n"
        f"| pairwise trace(K·L) — {res['peers']['pairwise']} (extrapolated from {c['pairwise_rows_timed']} rows) "
        f"| {s['pairwise_extrapolated'] * 1e3:.0f} | {sp['vs_pairwise']:.1f} |\n\n"
        f"Machine GEMM rate (same run): {res['gemm_gflops']['numpy_float32']:.1f} GFLOP/s float32 (NumPy), "
        f"{res['gemm_gflops']['torch_float32']:.1f} (torch), {res['gemm_gflops']['numpy_float64']:.1f} float64. "
        f"FLOP bound of the L symmetric Grams (L·n²·p = {fb['gram_flops_symmetric'] / 1e9:.2f} GFLOP at the best "
        f"float32 rate): {fb['bound_seconds'] * 1e3:.1f} ms; ours float32 takes {fb['ours_float32_over_bound']:.2f}× "
        f"that, and {fb['ours_float32_over_syrk_floor']:.2f}× the time of the L SYRK Grams alone "
        f"({s['syrk_floor_float32'] * 1e3:.1f} ms, same run). Goals: ≥30× pairwise {'met' if res['goals']['vs_pairwise>=30'] else 'NOT met'}, "
        f"≥2× batched {'met' if res['goals']['vs_batched>=2'] else 'NOT met'}. "
        f"Max |ΔCKA| vs ours float64: ours float32 {res['agreement']['max_abs_ours32_vs_ours64']:.1e}, "
        f"batched {res['agreement']['max_abs_batched_vs_ours64']:.1e}, "
        f"pairwise {res['agreement']['max_abs_pairwise_vs_ours64']:.1e}.\n"
    )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find("## cka_allpairs")
    if start >= 0:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
