"""``rsa``: representational similarity analysis (Kriegeskorte, Mur & Bandettini 2008).

Each representation's RDM is D_ij = 1 − Pearson(x_i, x_j) between examples (rows, correlation over
the p features); RSA = Spearman correlation of the two RDMs' strict upper triangles (ranks with
ties averaged), ∈ [−1, 1], 1 for identical inputs (and for any transform that keeps the RDM's
order, e.g. isotropic scaling or adding a constant to every feature), ≈ 0 for independent noise.

Exact over all n rows when n <= ``rsa_max_rows`` (default 2000: an RDM has n(n−1)/2 entries), else
over a seeded subsample of ``rsa_max_rows`` rows (``default_rng(rsa_seed).choice(n, m)``, sorted; the
same rows for every column), recorded in the result's metadata.  Pearson between rows needs only
the uncentred Gram and the row sums, Cov(x_i, x_j) = x_i·x_j / p − s_i s_j / p², so wide columns use
their n × n Gram; a row with no variance over its features (all-zero after a ReLU) has no
correlation: it is taken as uncorrelated (D = 1) with every other row.  Cost O(n²p) for the RDM,
O(n² log n) for the ranks.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo


def subsample(n: int, max_rows: int, seed: int) -> np.ndarray | None:
    """The rows RSA uses: None (all) when n <= max_rows, else a seeded sorted sample of max_rows."""
    if n <= max_rows:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=max_rows, replace=False))


def rdm_upper(G: np.ndarray, sums: np.ndarray, p: int) -> np.ndarray:
    """The strict upper triangle of 1 − Pearson(rows) from the uncentred Gram G and row sums."""
    C = G / p - np.outer(sums, sums) / (p * p)
    sd = np.sqrt(np.maximum(np.diag(C), 0.0))
    ok = sd > 1e-12 * max(float(np.max(np.abs(np.diag(G)))) / p, np.finfo(np.float64).tiny)
    with np.errstate(invalid="ignore", divide="ignore"):
        R = C / np.outer(np.where(ok, sd, 1.0), np.where(ok, sd, 1.0))
    R[~ok, :] = 0.0
    R[:, ~ok] = 0.0
    iu = np.triu_indices(G.shape[0], 1)
    return 1.0 - np.clip(R[iu], -1.0, 1.0)


@register
class RSA(Measure):
    info = MeasureInfo(
        name="rsa", order=6, formula="Spearman ρ of the upper triangles of the 1 − Pearson(rows) RDMs",
        source="Kriegeskorte, Mur & Bandettini 2008 (Front. Syst. Neurosci.)", estimators=("exact",),
        symmetric=True, range=(-1.0, 1.0), identical=1.0, null=0.0,
        invariances=("isotropic scaling", "translation by a constant", "permutation of features"))
    OPTIONS = {"rsa_max_rows": 2000, "rsa_seed": 0}

    def rows_used(self, n: int) -> np.ndarray | None:
        return subsample(n, int(self.options["rsa_max_rows"]), int(self.options["rsa_seed"]))

    def exact_info(self, n: int) -> dict[str, Any]:
        used = self.rows_used(n)
        return {"rows_used": n if used is None else int(used.size)}

    def prepare(self, column: FullColumn) -> Any:
        from scipy.stats import rankdata

        if column.is_constant():
            return None
        idx = self.rows_used(column.n)
        if column.has_features:
            X = column.rows if idx is None else column.rows[idx]
            G, s = X @ X.T, X.sum(axis=1)
        else:
            sel = slice(None) if idx is None else idx
            G = column.raw_gram()[np.ix_(sel, sel)] if idx is not None else column.raw_gram()
            s = column.row_sums()[sel]
        ranks = rankdata(rdm_upper(G, s, column.features))
        ranks -= ranks.mean()
        norm = float(np.linalg.norm(ranks))
        return ranks / norm if norm > 0 else None

    def pair(self, a: Any, b: Any) -> float:
        value = float(a @ b)
        return max(-1.0, min(1.0, value)) if math.isfinite(value) else math.nan
