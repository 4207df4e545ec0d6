"""Singular values of many cross-products in few LAPACK calls: :func:`cross_singular_values`.

The exact measures whose pair is a small SVD (Procrustes' nuclear norm, CCA's canonical
correlations) spend their time in LAPACK.  NumPy keeps the GIL for a gufunc call over one matrix and
lets go of it for a stack of a few (4 or more here, NumPy 2.4): the engine's pair threads
(:func:`repsim.kernels.measures.exact.exact_matrix`) ran one 225 x 225 SVD at a time (0.95x on 2
threads), and 1.8x with stacks of 4-16.  The digits demo's similarity step (306 columns, 46,971
Procrustes pairs on 2 cores): 150 s -> 90 s, values bitwise equal.  Stacking leaves each matrix's
SVD as it was: the same LAPACK routine on the same matrix.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PAIR_BATCH = 16  # matrices per stacked call
STACK_BYTES = 64 << 20  # at most this much of the B operands copied into one stack (wide columns: fewer)


def cross_singular_values(A: np.ndarray, Bs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The singular values (descending) of AᵀB for each B of ``Bs`` (A (n, r_a), each B (n, r_b)):
    the B of one width stacked by up to ``PAIR_BATCH`` (fewer when that would copy more than
    ``STACK_BYTES``), one batched product and one batched SVD per stack."""
    out: list[np.ndarray] = [np.zeros(0)] * len(Bs)
    by_width: dict[int, list[int]] = {}
    for k, B in enumerate(Bs):
        by_width.setdefault(int(B.shape[1]), []).append(k)
    At = A.T
    for width, members in by_width.items():
        if width == 0 or At.shape[0] == 0:
            continue  # no singular values
        per = max(1, min(PAIR_BATCH, STACK_BYTES // max(1, A.shape[0] * width * 8)))
        for start in range(0, len(members), per):
            part = members[start:start + per]
            M = np.matmul(At, np.stack([Bs[k] for k in part]))  # (m, r_a, r_b)
            for k, s in zip(part, np.linalg.svd(M, compute_uv=False)):
                out[k] = s
    return out


def null_singular_values(A: np.ndarray, B: np.ndarray, perms: np.ndarray) -> list[np.ndarray]:
    """The singular values of Aᵀ B[π_k] for every permutation π_k of ``perms`` (K, n): per chunk of draws
    one batched product and one batched SVD (the permutation nulls of Procrustes and the CCA family,
    :meth:`repsim.kernels.measures.Measure.null_block`); a list of K descending arrays."""
    K = perms.shape[0]
    if A.shape[1] == 0 or B.shape[1] == 0:
        return [np.zeros(0)] * K
    per = max(1, min(K, STACK_BYTES // max(1, 8 * B.shape[0] * B.shape[1])))
    out: list[np.ndarray] = []
    At = A.T
    for k0 in range(0, K, per):
        M = np.matmul(At, B[perms[k0:k0 + per]])  # (c, r_a, r_b)
        out.extend(np.linalg.svd(M, compute_uv=False))
    return out
