"""The CCA family: ``cca``, ``svcca``, ``pwcca`` (exact only).

Canonical correlations ρ₁ >= ... >= ρ_m of column-centred X̃ and Ỹ are the singular values of
Q_xᵀQ_y, Q an orthonormal basis of each column space (thin SVD of X̃), m = min(r_x, r_y) (Hotelling
1936).  The rank r counts the singular values above the larger of max(n, p)·eps·s₁ (float64's own
rounding) and the data's rounding to the dtype it was stored in, u ‖X‖_F
(:meth:`FullColumn.rounding_floor`): a low-rank layer stored in float16 or float32 has noise
directions at that level, each of which would otherwise count fully in ρ̄ (a rank-8 layer of 64
units against another read-out of the same code: ρ̄ 0.40 in float32, 1 in float64).

- ``cca``: mean canonical correlation ρ̄ = (1/m) Σᵢ ρᵢ (Raghu et al. 2017's summary statistic).
- ``svcca`` (Raghu, Gilmer, Yosinski & Sohl-Dickstein 2017, NeurIPS): each side reduced to its
  fewest top principal components whose variance is ≥ 99 % of the total (``svcca_variance``),
  then ρ̄ of those.
- ``pwcca`` (Morcos, Raghu & Bengio 2018, NeurIPS): Σᵢ αᵢρᵢ / Σᵢ αᵢ with αᵢ = Σⱼ |⟨hᵢ, x̃ⱼ⟩|, hᵢ the
  first representation's unit canonical variates and x̃ⱼ its centred columns (neurons).
  Asymmetric: row = first argument (whose neurons weigh the correlations).

Too few rows: the centred data span at most n − 1 dimensions, so when r_x + r_y > n − 1 some
canonical correlations are 1 whatever the data; such a pair is undefined (NaN, warned).  CCA and
SVCCA are invariant to invertible linear transforms (CCA) / orthogonal transforms and isotropic
scaling (SVCCA) and use the n × r factor of a wide column (:meth:`FullColumn.factor`); PWCCA's
weights depend on the individual neurons, so it needs the features (p <= n) and refuses wider
columns, naming what to do.  Cost: one thin SVD per column O(n r²), per pair O(n r_x r_y).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from repsim.kernels.measures import register
from repsim.kernels.measures._batched import cross_singular_values, null_singular_values
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo


class Basis(NamedTuple):
    Q: np.ndarray  # (n, r) orthonormal basis of the (reduced) column space
    n: int
    Xc: np.ndarray | None  # centred features (pwcca only)


def _basis(R: np.ndarray, variance: float | None = None, floor: float = 0.0) -> np.ndarray:
    """Orthonormal basis of R's column space (rank-revealing thin SVD: singular values above
    max(n, p)·eps·s₁ and above ``floor``, the data's rounding level); with ``variance``, only the
    fewest top directions holding that fraction of the total variance (SVCCA)."""
    U, s, _ = np.linalg.svd(R, full_matrices=False)
    if s.size == 0 or not s[0] > 0:
        return U[:, :0]
    r = int(np.sum(s > max(max(R.shape) * np.finfo(np.float64).eps * s[0], floor)))
    if variance is not None:
        frac = np.cumsum(s[:r] ** 2) / np.sum(s[:r] ** 2)
        r = min(r, int(np.searchsorted(frac, variance - 1e-12)) + 1)
    return U[:, :r]


def _defined(a: Basis, b: Basis) -> bool:
    """Whether the canonical correlations of ``a`` and ``b`` are defined (both ranks > 0, and
    r_a + r_b <= n - 1 rows: else some are 1 by construction)."""
    ra, rb = a.Q.shape[1], b.Q.shape[1]
    return ra > 0 and rb > 0 and ra + rb <= a.n - 1


def canonical(a: Basis, b: Basis) -> tuple[np.ndarray, np.ndarray] | None:
    """(ρ descending, the matching left singular vectors of Q_aᵀQ_b) or None (too few rows)."""
    ra, rb = a.Q.shape[1], b.Q.shape[1]
    if not _defined(a, b):
        return None
    U, rho, _ = np.linalg.svd(a.Q.T @ b.Q, full_matrices=False)
    m = min(ra, rb)
    return np.clip(rho[:m], 0.0, 1.0), U[:, :m]


class _CCABase(Measure):
    variance: float | None = None
    needs_features = False

    def prepare(self, column: FullColumn) -> Any:
        if column.is_constant():
            return None
        if self.needs_features and not column.has_features:
            raise ValueError(
                f"{self.name} needs the features of {column.name} (p = {column.features} > n = {column.n}): its "
                "weights Σⱼ|⟨hᵢ, xⱼ⟩| change when the neurons are rotated, so there is no n × n route; pool conv "
                "maps first (--spatial mean) or use svcca/cca")
        Xc = column.centered_rows() if self.needs_features else None
        return Basis(_basis(column.factor(), self.variance, column.rounding_floor()), column.n, Xc)

    def pair(self, a: Basis, b: Basis) -> float:
        out = canonical(a, b)
        return math.nan if out is None else float(np.mean(out[0]))

    def permute(self, prepared: Basis, perm: np.ndarray) -> Basis:
        return Basis(prepared.Q[perm], prepared.n, None if prepared.Xc is None else prepared.Xc[perm])

    def null_block(self, rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
        """Per pair, the K nulls' canonical correlations in stacked SVDs of Q_aᵀ Q_b[π] (the whitened
        bases of :meth:`prepare`, reused by every draw)."""
        out = np.full((perms.shape[0], len(rows), len(cols)), np.nan)
        for c, b in enumerate(cols):
            for r, a in enumerate(rows):
                if a is not None and b is not None and _defined(a, b):
                    out[:, r, c] = [float(np.mean(np.clip(s, 0.0, 1.0))) for s in null_singular_values(a.Q, b.Q, perms)]
        return out

    def pairs(self, a: Basis, bs: Sequence[Basis]) -> list[float]:
        """``pair`` for a row, the canonical correlations of its defined pairs in stacked SVDs."""
        defined = [k for k, b in enumerate(bs) if _defined(a, b)]
        out = [math.nan] * len(bs)
        for k, rho in zip(defined, cross_singular_values(a.Q, [bs[k].Q for k in defined])):
            out[k] = float(np.mean(np.clip(rho, 0.0, 1.0)))  # (min(r_a, r_b) values: canonical's ρ)
        return out


@register
class CCA(_CCABase):
    info = MeasureInfo(
        name="cca", display="CCA (mean ρ)", order=3, formula="mean canonical correlation ρ̄ over min(rank) directions",
        source="Hotelling 1936; ρ̄ as in Raghu et al. 2017", estimators=("exact",), symmetric=True,
        range=(0.0, 1.0), identical=1.0, null="small > 0",
        invariances=("invertible linear", "orthogonal", "isotropic scaling", "translation"))


@register
class SVCCA(_CCABase):
    info = MeasureInfo(
        name="svcca", display="SVCCA", order=4, formula="ρ̄ of the fewest top PCs of each side explaining ≥ 99 % of its variance",
        source="Raghu, Gilmer, Yosinski & Sohl-Dickstein 2017 (NeurIPS)", estimators=("exact",), symmetric=True,
        range=(0.0, 1.0), identical=1.0, null="small > 0", invariances=("orthogonal", "isotropic scaling", "translation"))
    OPTIONS = {"svcca_variance": 0.99}

    @property
    def variance(self) -> float:  # type: ignore[override]
        return float(self.options["svcca_variance"])


@register
class PWCCA(_CCABase):
    info = MeasureInfo(
        name="pwcca", display="PWCCA", order=5, formula="Σᵢ αᵢρᵢ / Σᵢ αᵢ, αᵢ = Σⱼ |⟨hᵢ, x̃ⱼ⟩| (hᵢ canonical variates of the first argument)",
        source="Morcos, Raghu & Bengio 2018 (NeurIPS)", estimators=("exact",), symmetric=False,
        range=(0.0, 1.0), identical=1.0, null="small > 0", invariances=("isotropic scaling", "translation"))
    needs_features = True
    pairs = Measure.pairs  # (its weights need the canonical variates: pair by pair)
    null_block = Measure.null_block

    def pair(self, a: Basis, b: Basis) -> float:
        out = canonical(a, b)
        if out is None:
            return math.nan
        rho, U = out
        H = a.Q @ U  # (n, m) unit canonical variates of the first representation
        alpha = np.sum(np.abs(H.T @ a.Xc), axis=1)
        return float(np.sum(alpha * rho) / np.sum(alpha))
