"""Full-data linear CKA out-of-core (``cka_matrix(..., method="exact")``), float64.

CKA(i, j) = HSIC(i, j) / sqrt(HSIC(i, i) · HSIC(j, j)) over all n examples (paper Eq. 10), with
HSIC either biased, ``tr(H K_i H · H K_j H)``, or unbiased (Song et al. 2012),

    HSIC₁ = [tr(K̃ L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n−1)(n−2)) − 2/(n−2) · 1ᵀK̃L̃1] / (n(n−3)),

K̃ = K with its diagonal zeroed.  Both are invariant to translating X, so every column is first
shifted by the mean of its first block (conditioning only).  Each pair takes one of two routes:

- **cross-covariance**, one streaming pass: S = XᵀY (p_i × p_j) plus column sums s, row norms
  a_k = ‖x_k‖², b_k = ‖y_k‖² and the vectors Xᵀb, Yᵀa, scalar aᵀb.  Then biased
  HSIC = ‖S − s_x s_yᵀ/n‖²_F and unbiased, with ‖·‖ the Frobenius norm,
  tr(K̃L̃) = ‖S‖² − aᵀb,  1ᵀK̃1 = ‖s_x‖² − Σa,  1ᵀK̃L̃1 = s_xᵀ S s_y − s_xᵀ(Xᵀb) − s_yᵀ(Yᵀa) + aᵀb.
  Cost 2·n·p_i·p_j.
- **Gram**, K = X Xᵀ (n × n) accumulated panel by panel (rows of a panel × every later block;
  ⌈n / panel⌉ passes over the Gram columns, panel sized by ``panel_bytes``), then
  biased ⟨HKH, HLH⟩ or unbiased ⟨U(K), U(L)⟩ / (n(n−3)) with :func:`repsim.ucenter`.
  Cost 2·n²·(p_i + p_j).

Which columns get an n × n Gram is decided per column, not per pair (:func:`choose_gram_columns`):
a Gram is built once and then serves the column's pairs with every other Gram column, so pricing
each pair as if it built its own Grams (the rule before) sent narrow columns (pool, logits) down
the cross-covariance route with every wide block although their own Gram was cheap once the wide
ones had theirs.  The set G is the k widest columns for the k that minimises the FLOPs

    Σ_{i∈G} 2·n²·p_i  +  Σ_{pairs not both in G} 2·n·p_i·p_j  +  |G|²·n²   (Grams, cross, one HSIC product);

a pair uses the Gram route iff both columns are in G.  All cross pairs of a block come from one
product Z_Nᵀ Z_X (N: the columns outside G, X: every column with a cross pair), so the pass costs a
few GEMMs per block whatever the number of pairs.

Memory: the route holds 8·n²·(|G| + 1) bytes of Grams (one more while one is U-centred) and the
8·(Σ_N p)·(Σ_X p) of Z_NᵀZ_X, both independent of ``panel_bytes`` (which sizes the Gram panels:
rows read per pass). Only the k whose total stays within ``max_bytes`` (the run's memory budget,
``--memory-budget``, default 8 GiB, as the other exact measures' held columns; the panels take 1/16 of
it, at most 512 MiB: :mod:`repsim.engine.options`) are considered; when none does, the run is refused naming what
to do (``--spatial mean``, fewer layers, or the minibatch estimator), before anything is read.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.engine.blocks import BlockReader, Column, progress_bar
from repsim.engine.options import format_size
from repsim.kernels.hsic import double_center


def route_bytes(widths: Sequence[int], n: int, k: int) -> int:
    """Bytes the exact route holds with Grams for the ``k`` widest columns (module docstring): the Grams
    (one more while one is U-centred) and Z_NᵀZ_X of the cross pairs."""
    p = sorted((int(w) for w in widths), reverse=True)
    grams = 8 * n * n * (k + 1) if k else 0
    cross = 8 * sum(p[k:]) * sum(p) if k < len(p) else 0
    return grams + cross


def choose_gram_columns(widths: Sequence[int], n: int, max_bytes: int | None = None) -> list[int]:
    """Indices of the columns that get an n × n Gram: the k widest, k minimising the FLOP model of
    the module docstring (ties: fewer Grams) among the k whose :func:`route_bytes` fit ``max_bytes``
    (None: any). ``ValueError`` when no k fits."""
    order = sorted(range(len(widths)), key=lambda k: (-widths[k], k))
    p = np.array([float(widths[k]) for k in order])
    s1, s2 = p.sum(), (p * p).sum()
    all_pairs = (s1 * s1 + s2) / 2  # Σ_{i<=j} p_i p_j
    fits = [max_bytes is None or route_bytes(widths, n, k) <= max_bytes for k in range(len(order) + 1)]
    best_k, best = (0, 2.0 * n * all_pairs) if fits[0] else (None, math.inf)
    c1 = c2 = 0.0
    for k in range(1, len(order) + 1):
        c1 += p[k - 1]
        c2 += p[k - 1] ** 2
        within = (c1 * c1 + c2) / 2
        cost = 2.0 * n * n * c1 + 2.0 * n * (all_pairs - within) + float(k * k) * n * n
        if fits[k] and cost < best:
            best_k, best = k, cost
    if best_k is None:
        need = min(route_bytes(widths, n, k) for k in range(len(order) + 1))
        raise ValueError(
            f"exact CKA would hold at least {format_size(need)} ({len(widths)} columns, n = {n}: n × n float64 "
            f"Grams or a Σp × Σp cross-covariance) over the limit of {format_size(max_bytes)} (--memory-budget): pool conv maps "
            "(--spatial mean), compare fewer layers, raise --memory-budget, or use --method minibatch (the paper's "
            "estimator, memory independent of n)")
    return sorted(order[:best_k])


def choose_routes(widths: Sequence[int], n: int, max_bytes: int | None = None) -> dict[tuple[int, int], str]:
    """``{(i, j): "cross" | "gram"}`` for i <= j: "gram" iff both columns are in
    :func:`choose_gram_columns`."""
    gram = set(choose_gram_columns(widths, n, max_bytes))
    return {(i, j): "gram" if i in gram and j in gram else "cross"
            for i in range(len(widths)) for j in range(i, len(widths))}


def exact_cka(columns: Sequence[Column], n: int, block_rows: int, *, debiased: bool, spatial: str, xp: Any = np,
              panel_bytes: int = 512 * 2**20, max_bytes: int = 8 * 2**30, prefetch: int = 2, threads: int = 2,
              progress: bool | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Return ``(values (L, L), meta)`` — meta records the route of every pair and the pass count.
    ``panel_bytes`` sizes the Gram panels (rows per pass); ``max_bytes`` bounds what the routes hold
    (module docstring, "Memory"). Both come from the run's memory budget
    (:class:`repsim.engine.options.StreamOptions`: the budget itself and its :func:`~repsim.engine.options.panel_bytes`)."""
    from repsim.engine.blocks import MIN_BATCH

    if debiased and n < MIN_BATCH:
        raise ValueError(f"debiased CKA needs n >= {MIN_BATCH}, stores have {n}")
    L = len(columns)
    widths = [c.features_after(spatial) for c in columns]
    routes = choose_routes(widths, n, max_bytes)
    cross_pairs = [pair for pair, r in routes.items() if r == "cross"]
    gram_cols = sorted({k for pair, r in routes.items() if r == "gram" for k in pair})
    gram_set = set(gram_cols)
    cross_cols = sorted({k for pair in cross_pairs for k in pair})
    n_blocks = -(-n // block_rows)
    hsic = np.zeros((L, L))
    passes = 0
    row_bytes = 8 * sum(widths[k] for k in gram_cols)
    gram_bytes = 8 * n * n * len(gram_cols)
    # (the Grams are bounded by max_bytes; subtracting them from the panel budget left one block per
    # panel once they passed it, and ⌈n / block_rows⌉ passes)
    panel_blocks = max(1, int(panel_bytes // max(1, row_bytes * block_rows)))
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
        # N: columns outside G (the left member of every cross pair, ordered i <= j below); X: every
        # column with a cross pair.  Per block, one product Z_Nᵀ Z_X holds every cross pair's XᵢᵀXⱼ.
        left = [k for k in cross_cols if k not in gram_set]
        off_l = np.concatenate([[0], np.cumsum([widths[k] for k in left])]).astype(int)
        off_x = np.concatenate([[0], np.cumsum([widths[k] for k in cross_cols])]).astype(int)
        lpos = {k: i for i, k in enumerate(left)}
        xpos = {k: i for i, k in enumerate(cross_cols)}
        S_all = np.zeros((off_l[-1], off_x[-1]))
        s_all = np.zeros(off_x[-1])
        asum = np.zeros(len(cross_cols))
        if debiased:
            ZtQ = np.zeros((off_l[-1], len(cross_cols)))  # Σ_k b_k x_k for x in N, b of every X column
            XtQ = np.zeros((off_x[-1], len(left)))        # Σ_k a_k y_k for y in X, a of every N column
            QtQ = np.zeros((len(left), len(cross_cols)))  # Σ_k a_k b_k
        sub = [columns[k] for k in cross_cols]
        with BlockReader(sub, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads) as reader:
            for _, arrays in reader.iter_blocks(range(n_blocks)):
                bar.update(1)
                ZX = np.concatenate([as64(arrays[xpos[k]]).reshape(arrays[xpos[k]].shape[0], -1) - shift[k]
                                     for k in cross_cols], axis=1)
                ZN = np.concatenate([ZX[:, off_x[xpos[k]]:off_x[xpos[k] + 1]] for k in left], axis=1) \
                    if left != cross_cols else ZX
                S_all += ZN.T @ ZX
                s_all += ZX.sum(axis=0)
                Q = np.stack([np.einsum("ij,ij->i", ZX[:, off_x[i]:off_x[i + 1]], ZX[:, off_x[i]:off_x[i + 1]])
                              for i in range(len(cross_cols))], axis=1)
                asum += Q.sum(axis=0)
                if debiased:
                    QN = Q[:, [xpos[k] for k in left]]
                    ZtQ += ZN.T @ Q
                    XtQ += ZX.T @ QN
                    QtQ += QN.T @ Q
        passes += 1
        for (i, j) in cross_pairs:
            a, b = (i, j) if i in lpos else (j, i)  # a outside G; HSIC is symmetric
            la, xa, xb_ = lpos[a], xpos[a], xpos[b]
            Sij = S_all[off_l[la]:off_l[la + 1], off_x[xb_]:off_x[xb_ + 1]]
            sa, sb = s_all[off_x[xa]:off_x[xa + 1]], s_all[off_x[xb_]:off_x[xb_ + 1]]
            if debiased:
                ab = float(QtQ[la, xb_])
                tr = float(np.sum(Sij * Sij)) - ab
                one_k = float(sa @ sa) - float(asum[xa])
                one_l = float(sb @ sb) - float(asum[xb_])
                xb = ZtQ[off_l[la]:off_l[la + 1], xb_]            # Σ_k b_k x_k
                ya = XtQ[off_x[xb_]:off_x[xb_ + 1], la]           # Σ_k a_k y_k
                kl = float(sa @ Sij @ sb) - float(sa @ xb) - float(sb @ ya) + ab
                value = (tr + one_k * one_l / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * kl) / (n * (n - 3))
            else:
                C = Sij - np.outer(sa, sb) / n
                value = float(np.sum(C * C))
            hsic[i, j] = hsic[j, i] = value
        del S_all

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
            from repsim.kernels.hsic import ucenter

            def center(K: np.ndarray) -> np.ndarray:
                return np.asarray(ucenter(K), dtype=np.float64)

            scale = 1.0 / (n * (n - 3))
        else:
            center, scale = double_center, 1.0
        # each Gram replaced by its centred self (one more n × n while it is made), then every
        # Gram-route HSIC as the Frobenius product of two of them (no flattened copy of all of them)
        for g in range(len(gram_cols)):
            grams[g] = center(grams[g])
        G = len(gram_cols)
        gram_hsic = np.empty((G, G))
        for a in range(G):
            for b in range(a, G):
                gram_hsic[a, b] = gram_hsic[b, a] = np.vdot(grams[a], grams[b]) * scale
        del grams
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
    zero = d == 0.0  # constant features (zero HSIC with itself): no CKA, NaN in its row and column
    values[zero, :] = np.nan
    values[:, zero] = np.nan
    info = {
        "exact_routes": {f"{i},{j}": r for (i, j), r in routes.items()},
        "exact_passes": passes,
        "exact_gram_bytes": gram_bytes,
        "exact_route_rule": "n×n Grams for the k widest columns (k minimising FLOPs); a pair uses them iff "
                            "both columns have one, else the cross-covariance route",
    }
    return values, info
