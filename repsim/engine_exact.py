"""Full-data linear CKA out-of-core (``cka_matrix(..., method="exact")``), float64.

CKA(i, j) = HSIC(i, j) / sqrt(HSIC(i, i) · HSIC(j, j)) over all n examples (paper Eq. 10), with
HSIC either biased, ``tr(H K_i H · H K_j H)``, or unbiased (Song et al. 2012),

    HSIC₁ = [tr(K̃ L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n−1)(n−2)) − 2/(n−2) · 1ᵀK̃L̃1] / (n(n−3)),

K̃ = K with its diagonal zeroed.  Both are invariant to translating X, so every column is first
shifted by the mean of its first block (conditioning only).  Each pair takes the cheaper of two
routes (FLOPs; memory follows the same sizes):

- **cross-covariance**, one streaming pass: S = XᵀY (p_i × p_j) plus column sums s, row norms
  a_k = ‖x_k‖², b_k = ‖y_k‖² and the vectors Xᵀb, Yᵀa, scalar aᵀb.  Then biased
  HSIC = ‖S − s_x s_yᵀ/n‖²_F and unbiased, with ‖·‖ the Frobenius norm,
  tr(K̃L̃) = ‖S‖² − aᵀb,  1ᵀK̃1 = ‖s_x‖² − Σa,  1ᵀK̃L̃1 = s_xᵀ S s_y − s_xᵀ(Xᵀb) − s_yᵀ(Yᵀa) + aᵀb.
  Cost 2·n·p_i·p_j.
- **Gram**, K = X Xᵀ (n × n) accumulated panel by panel (rows of a panel × every later block;
  ⌈n / panel⌉ passes over the Gram columns, panel sized by ``memory_budget``), then
  biased ⟨HKH, HLH⟩ or unbiased ⟨U(K), U(L)⟩ / (n(n−3)) with :func:`repsim.ucenter`.
  Cost 2·n²·(p_i + p_j).

The pair uses cross-covariance iff p_i·p_j ≤ n·(p_i + p_j) (so a self pair iff p ≤ n).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim.engine_io import BlockReader, Column, progress_bar


def choose_routes(widths: Sequence[int], n: int) -> dict[tuple[int, int], str]:
    """``{(i, j): "cross" | "gram"}`` for i <= j by the FLOP rule above."""
    routes = {}
    for i, p in enumerate(widths):
        for j in range(i, len(widths)):
            q = widths[j]
            routes[(i, j)] = "cross" if p * q <= n * (p + q) else "gram"
    return routes


def _center_gram(K: np.ndarray) -> np.ndarray:
    """H K H with H = I − 11ᵀ/n."""
    row = K.mean(axis=1, keepdims=True)
    return K - row - row.T + row.mean()


def exact_cka(columns: Sequence[Column], n: int, block_rows: int, *, debiased: bool, spatial: str, xp: Any = np,
              memory_budget: int = 512 * 2**20, prefetch: int = 2, threads: int = 2,
              progress: bool | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Return ``(values (L, L), meta)`` — meta records the route of every pair and the pass count."""
    from repsim.engine_io import MIN_BATCH

    if debiased and n < MIN_BATCH:
        raise ValueError(f"debiased CKA needs n >= {MIN_BATCH}, stores have {n}")
    L = len(columns)
    widths = [c.features_after(spatial) for c in columns]
    routes = choose_routes(widths, n)
    cross_pairs = [pair for pair, r in routes.items() if r == "cross"]
    gram_cols = sorted({k for pair, r in routes.items() if r == "gram" for k in pair})
    cross_cols = sorted({k for pair in cross_pairs for k in pair})
    n_blocks = -(-n // block_rows)
    hsic = np.zeros((L, L))
    passes = 0
    row_bytes = 8 * sum(widths[k] for k in gram_cols)
    gram_bytes = 8 * n * n * len(gram_cols)
    panel_blocks = max(1, int(max(memory_budget - gram_bytes, 0) // max(1, row_bytes * block_rows)))
    panels = range(0, n_blocks, panel_blocks) if gram_cols else range(0)
    bar = progress_bar((n_blocks if cross_cols else 0) + sum(n_blocks - p0 for p0 in panels), "exact cka", progress,
                       unit="block")

    def as64(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    # ---- shifts (first block means) ---------------------------------------------------------------
    with BlockReader(columns, n, block_rows, spatial=spatial, prefetch=0, threads=1) as reader:
        first = reader.read_block(0)
    shift = [as64(x).mean(axis=0) for x in first]
    del first

    # ---- pass 1: cross-covariance statistics ------------------------------------------------------
    if cross_cols:
        sub = [columns[k] for k in cross_cols]
        pos = {k: i for i, k in enumerate(cross_cols)}
        s = {k: np.zeros(widths[k]) for k in cross_cols}
        asum = {k: 0.0 for k in cross_cols}
        S = {pair: np.zeros((widths[pair[0]], widths[pair[1]])) for pair in cross_pairs}
        xb = {pair: np.zeros(widths[pair[0]]) for pair in cross_pairs}  # Σ_k b_k x_k
        ya = {pair: np.zeros(widths[pair[1]]) for pair in cross_pairs}  # Σ_k a_k y_k
        ab = {pair: 0.0 for pair in cross_pairs}
        with BlockReader(sub, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads) as reader:
            for _, arrays in reader.iter_blocks(range(n_blocks)):
                bar.update(1)
                X = {k: as64(arrays[pos[k]]) - shift[k] for k in cross_cols}
                sq = {k: np.einsum("ij,ij->i", X[k], X[k]) for k in cross_cols}
                for k in cross_cols:
                    s[k] += X[k].sum(axis=0)
                    asum[k] += float(sq[k].sum())
                for (i, j) in cross_pairs:
                    S[(i, j)] += X[i].T @ X[j]
                    if debiased:
                        xb[(i, j)] += X[i].T @ sq[j]
                        ya[(i, j)] += X[j].T @ sq[i]
                        ab[(i, j)] += float(sq[i] @ sq[j])
        passes += 1
        for (i, j) in cross_pairs:
            Sij = S.pop((i, j))
            if debiased:
                tr = float(np.sum(Sij * Sij)) - ab[(i, j)]
                one_k = float(s[i] @ s[i]) - asum[i]
                one_l = float(s[j] @ s[j]) - asum[j]
                kl = float(s[i] @ Sij @ s[j]) - float(s[i] @ xb[(i, j)]) - float(s[j] @ ya[(i, j)]) + ab[(i, j)]
                value = (tr + one_k * one_l / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * kl) / (n * (n - 3))
            else:
                C = Sij - np.outer(s[i], s[j]) / n
                value = float(np.sum(C * C))
            hsic[i, j] = hsic[j, i] = value

    # ---- Gram route: panels of rows × all later blocks --------------------------------------------
    if gram_cols:
        sub = [columns[k] for k in gram_cols]
        grams = [np.zeros((n, n)) for _ in gram_cols]
        with BlockReader(sub, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads) as reader:
            for p0 in panels:
                panel_ids = list(range(p0, min(n_blocks, p0 + panel_blocks)))
                a0 = p0 * block_rows
                panel = None
                for k, arrays in reader.iter_blocks(range(p0, n_blocks)):
                    bar.update(1)
                    X = [as64(x) - shift[c] for x, c in zip(arrays, gram_cols)]
                    if k in panel_ids:  # collect the panel while streaming its own blocks
                        panel = X if panel is None else [np.concatenate([P, x]) for P, x in zip(panel, X)]
                        if k != panel_ids[-1]:
                            continue
                        # the panel's own diagonal block
                        a1 = a0 + panel[0].shape[0]
                        for g, P in enumerate(panel):
                            grams[g][a0:a1, a0:a1] = P @ P.T
                        continue
                    r0 = k * block_rows
                    r1 = r0 + X[0].shape[0]
                    for g, (P, x) in enumerate(zip(panel, X)):
                        block = P @ x.T
                        grams[g][a0:a0 + P.shape[0], r0:r1] = block
                        grams[g][r0:r1, a0:a0 + P.shape[0]] = block.T
                passes += 1
        if debiased:
            from repsim.cka import ucenter

            def centre(K: np.ndarray) -> np.ndarray:
                return np.asarray(ucenter(K), dtype=np.float64)

            scale = 1.0 / (n * (n - 3))
        else:
            centre, scale = _center_gram, 1.0
        # every Gram-route HSIC from one product of the flattened centred Grams (G × n²) — the
        # same "one product for all pairs" as MinibatchCKA; each Gram is freed once flattened
        flat = np.empty((len(gram_cols), n * n))
        for g in range(len(gram_cols)):
            flat[g] = centre(grams[g]).reshape(-1)
            grams[g] = None
        del grams
        gram_hsic = (flat @ flat.T) * scale
        del flat
        gpos = {k: g for g, k in enumerate(gram_cols)}
        for (i, j), r in routes.items():
            if r == "gram":
                hsic[i, j] = hsic[j, i] = float(gram_hsic[gpos[i], gpos[j]])

    bar.close()
    bad = [f"{columns[k].store}/{columns[k].layer}" for k in range(L) if not np.isfinite(hsic[k, k])]
    if bad:  # NaN/inf anywhere in a column makes its self-HSIC non-finite
        raise ValueError(f"NaN or infinite values (or float64 overflow) in {bad}: CKA is undefined")
    d = np.sqrt(np.clip(np.diag(hsic), 0.0, None))
    with np.errstate(invalid="ignore", divide="ignore"):
        values = hsic / np.outer(d, d)
    zero = [f"{columns[k].store}/{columns[k].layer}" for k in range(L) if d[k] == 0.0]
    if zero:
        raise ValueError(f"constant features (zero HSIC with itself), CKA undefined: {zero}")
    info = {
        "exact_routes": {f"{i},{j}": r for (i, j), r in routes.items()},
        "exact_passes": passes,
        "exact_gram_bytes": gram_bytes,
        "exact_route_rule": "cross-covariance iff p_i*p_j <= n*(p_i+p_j), else n×n Gram",
    }
    return values, info
