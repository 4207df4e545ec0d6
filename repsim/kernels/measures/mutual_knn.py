"""``mutual_knn``: mutual nearest neighbours (Huh, Cheung, Wang & Isola 2024, ICML, "The Platonic
Representation Hypothesis"; their ``mutual_knn`` metric).

Rows are L2-normalised; N_X(i) are the k examples of highest cosine similarity to example i,
excluding i itself (``knn_k``, default 10); the measure is (1/n) Σᵢ |N_X(i) ∩ N_Y(i)| / k ∈ [0, 1]:
1 for identical inputs (or any transform that keeps cosine order: orthogonal maps, isotropic
scaling), ≈ k/(n − 1) for independent noise.  Exact ties at the k-th place are broken arbitrarily.

Exact by streamed row blocks: the cosine similarities of a block of rows against all n (from the
rows, or from the uncentred n × n Gram of a wide column) give each row's k neighbours, so memory
is block × n plus the n × k neighbour lists.  Cost O(n²p).  Undefined (NaN) when k >= n − 1 or
for a constant column.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo

BLOCK_ROWS = 1024


def knn_lists(column: FullColumn, k: int) -> np.ndarray:
    """(n, k) indices of each row's k nearest rows by cosine similarity, self excluded."""
    n = column.n
    if column.has_features:
        X = column.rows
        norms = np.sqrt(np.einsum("ij,ij->i", X, X))
    else:
        norms = np.sqrt(np.maximum(np.diag(column.raw_gram()), 0.0))
    inv = 1.0 / np.where(norms > 0, norms, 1.0)
    out = np.empty((n, k), dtype=np.int64)
    for a in range(0, n, BLOCK_ROWS):
        b = min(n, a + BLOCK_ROWS)
        S = (column.rows[a:b] @ column.rows.T) if column.has_features else np.array(column.raw_gram()[a:b])
        S *= inv[a:b, None] * inv[None, :]
        S[np.arange(b - a), np.arange(a, b)] = -np.inf  # not its own neighbour
        part = np.argpartition(-S, k - 1, axis=1)[:, :k]
        out[a:b] = part
    return np.sort(out, axis=1)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |a_i ∩ b_i| / k for two (n, k) neighbour lists."""
    k = a.shape[1]
    hits = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)
    return float(np.mean(hits) / k)


@register
class MutualKNN(Measure):
    info = MeasureInfo(
        name="mutual_knn", display="mutual k-NN", order=7, formula="mean_i |N_X(i) ∩ N_Y(i)| / k, cosine k-NN excluding i (null ≈ k/(n−1))",
        source="Huh, Cheung, Wang & Isola 2024 (ICML), platonic-rep mutual_knn", estimators=("exact",),
        symmetric=True, range=(0.0, 1.0), identical=1.0, null="≈ k/(n−1)",
        invariances=("orthogonal", "isotropic scaling"))
    OPTIONS = {"knn_k": 10}

    def undefined_when(self) -> str:
        return (f"constant over the examples, or with too few examples for knn_k = {int(self.options['knn_k'])} "
                "neighbours (k must lie in [1, n − 2]: pass a smaller --knn-k)")

    def prepare(self, column: FullColumn) -> Any:
        k = int(self.options["knn_k"])
        if column.is_constant() or k >= column.n - 1 or k < 1:
            return None
        return knn_lists(column, k)

    def pair(self, a: Any, b: Any) -> float:
        return overlap(a, b)

    def permute(self, prepared: Any, perm: np.ndarray) -> Any:
        """N'(i) = π⁻¹(N(π(i))): an index map of the lists, O(n k)."""
        inv = np.argsort(perm)
        return np.sort(inv[prepared[perm]], axis=1)

    def null_block(self, rows: Any, cols: Any, perms: np.ndarray) -> np.ndarray:
        from repsim.kernels.permutation import knn_null_overlaps

        out = np.full((perms.shape[0], len(rows), len(cols)), np.nan)
        live_r = [r for r, a in enumerate(rows) if a is not None]
        live_c = [c for c, b in enumerate(cols) if b is not None]
        if live_r and live_c:
            out[np.ix_(range(perms.shape[0]), live_r, live_c)] = knn_null_overlaps(
                [rows[r] for r in live_r], [cols[c] for c in live_c], perms)
        return out
