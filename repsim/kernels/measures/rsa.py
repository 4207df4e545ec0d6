"""``rsa``: representational similarity analysis (Kriegeskorte, Mur & Bandettini 2008).

Each representation's RDM is D_ij = 1 − Pearson(x_i, x_j) between examples (rows, correlation over
the p features); RSA = Spearman correlation of the two RDMs' strict upper triangles (ranks with
ties averaged), ∈ [−1, 1], 1 for identical inputs (and for any transform that keeps the RDM's
order, e.g. isotropic scaling or adding a constant to every feature), ≈ 0 for independent noise.

Exact over all n rows when n <= ``rsa_max_rows`` (default 2000: an RDM has n(n−1)/2 entries), else
over a seeded subsample of ``rsa_max_rows`` rows (``default_rng(rsa_seed).choice(n, m)``, sorted; the
same rows for every column), recorded in the result's metadata.  Pearson between rows needs only
the Gram of the rows centred over their features (:meth:`FullColumn.row_centered_gram`), so wide
columns use their n × n (shifted) Gram; a row with no variance over its features (all-zero after a ReLU) has no
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


def rdm_upper(RC: np.ndarray, slack: np.ndarray) -> np.ndarray:
    """The strict upper triangle of 1 − Pearson(rows) from the row-centred Gram RC
    (:meth:`FullColumn.row_centered_gram`); a row whose variance RC_ii is within its rounding ``slack``
    is flat (uncorrelated with every other row)."""
    d = np.diag(RC)
    ok = d > np.maximum(slack, np.finfo(np.float64).tiny)
    sd = np.sqrt(np.where(ok, d, 1.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        R = RC / np.outer(sd, sd)
    R[~ok, :] = 0.0
    R[:, ~ok] = 0.0
    iu = np.triu_indices(RC.shape[0], 1)
    return 1.0 - np.clip(R[iu], -1.0, 1.0)


@register
class RSA(Measure):
    info = MeasureInfo(
        name="rsa", display="RSA", order=6, formula="Spearman ρ of the upper triangles of the 1 − Pearson(rows) RDMs",
        source="Kriegeskorte, Mur & Bandettini 2008 (Front. Syst. Neurosci.)", estimators=("exact",),
        symmetric=True, range=(-1.0, 1.0), identical=1.0, null="0",
        invariances=("isotropic scaling", "translation by a constant", "permutation of features"))
    OPTIONS = {"rsa_max_rows": 2000, "rsa_seed": 0}

    def rows_used(self, n: int) -> np.ndarray | None:
        return subsample(n, int(self.options["rsa_max_rows"]), int(self.options["rsa_seed"]))

    def exact_info(self, n: int) -> dict[str, Any]:
        used = self.rows_used(n)
        return {"rows_used": n if used is None else int(used.size)}

    def undefined_when(self) -> str:
        return ("constant over the examples, or whose RDM is constant (one feature: the Pearson correlation "
                "between two examples needs at least 2 features)")

    def prepare(self, column: FullColumn) -> Any:
        from scipy.stats import rankdata

        if column.is_constant():
            return None
        idx = self.rows_used(column.n)
        if column.has_features:
            X = column.rows if idx is None else column.rows[idx]
            RC, slack = FullColumn(column.name, column.features, rows=X).row_centered_gram()
        else:
            RC, slack = column.row_centered_gram()
            if idx is not None:
                RC, slack = RC[np.ix_(idx, idx)], slack[idx]
        ranks = rankdata(rdm_upper(RC, slack))
        ranks -= ranks.mean()
        norm = float(np.linalg.norm(ranks))
        return ranks / norm if norm > 0 else None

    def null_rows(self, n: int) -> int:
        used = self.rows_used(n)
        return int(n) if used is None else int(used.size)

    def permute(self, prepared: Any, perm: np.ndarray) -> Any:
        """The RDM of the permuted rows is the RDM's entries re-indexed: entry (a, b) of the new
        one is entry (π(a), π(b)) of the old (ranks move with their entries)."""
        m = perm.size
        ia, ib = np.triu_indices(m, 1)
        pa, pb = perm[ia], perm[ib]
        lo, hi = np.minimum(pa, pb), np.maximum(pa, pb)
        pos = lo * m - lo * (lo + 1) // 2 + (hi - lo - 1)  # index of (lo, hi) in the row-major triangle
        return prepared[pos]

    def pair(self, a: Any, b: Any) -> float:
        value = float(a @ b)
        return max(-1.0, min(1.0, value)) if math.isfinite(value) else math.nan
