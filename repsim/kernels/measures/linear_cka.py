"""``linear_cka``: linear centred kernel alignment, the reference instance of the protocol.

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L)),   K = X̃X̃ᵀ, L = ỸỸᵀ

(Kornblith et al. 2019, ICML, "Similarity of Neural Network Representations Revisited"; paper Eq. 10),
HSIC₁ the unbiased estimator of Song et al. 2012 (``debiased=True``, default) or HSIC₀ = ⟨HKH, HLH⟩.
Minibatch: Nguyen, Raghu & Kornblith 2021 — sums of per-batch HSIC, accumulated by
:class:`repsim.MinibatchCKA` (all the math, precision rule and error bound: :mod:`repsim.kernels.hsic`).
Exact: on the full data, streamed by :mod:`repsim.engine.exact`; :meth:`LinearCKA.pair` is the same
on in-memory columns.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim.kernels.hsic import double_center, ucenter
from repsim.kernels.minibatch_cka import MinibatchCKA
from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import FullColumn, Measure, MeasureInfo


def hsic_prepared(K: np.ndarray, debiased: bool) -> tuple[np.ndarray, float] | None:
    """(the centred Gram in the form whose inner products are HSIC, its self-HSIC) or None (constant):
    U(K)/sqrt(n(n−3)) for HSIC₁, HKH/(n−1) for HSIC₀."""
    n = K.shape[0]
    if debiased:
        U = np.asarray(ucenter(K), dtype=np.float64) / np.sqrt(n * (n - 3))
    else:
        U = double_center(K) / (n - 1)
    self_h = float(np.sum(U * U))
    return (U, self_h) if self_h > 0 else None


def cka_pair(a: tuple[np.ndarray, float], b: tuple[np.ndarray, float]) -> float:
    """HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) of two :func:`hsic_prepared` Grams."""
    return float(np.sum(a[0] * b[0])) / float(np.sqrt(a[1] * b[1]))


def cka_null_block(rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
    """(K, len(rows), len(cols)) null CKA of :func:`hsic_prepared` columns (None: NaN)."""
    from repsim.kernels.permutation import gram_null_products

    out = np.full((perms.shape[0], len(rows), len(cols)), np.nan)
    live_r = [r for r, a in enumerate(rows) if a is not None]
    live_c = [c for c, b in enumerate(cols) if b is not None]
    if not live_r or not live_c:
        return out
    A = np.stack([rows[r][0] for r in live_r])
    B = np.stack([cols[c][0] for c in live_c])
    diag = bool(np.any(np.diagonal(A, axis1=1, axis2=2)) and np.any(np.diagonal(B, axis1=1, axis2=2)))
    h = gram_null_products(A, B, perms, diagonal=diag)
    ha = np.sqrt([rows[r][1] for r in live_r])
    hb = np.sqrt([cols[c][1] for c in live_c])
    out[np.ix_(range(perms.shape[0]), live_r, live_c)] = h / (ha[None, :, None] * hb[None, None, :])
    return out


class CKAFamily(Measure):
    """The CKA measures: ``prepare`` gives :func:`hsic_prepared` of a column's kernel matrix, and a
    pair is :func:`cka_pair` of two of them."""

    def pair(self, a: Any, b: Any) -> float:
        return cka_pair(a, b)

    def permute(self, prepared: Any, perm: np.ndarray) -> Any:
        U, h = prepared
        return U[np.ix_(perm, perm)], h

    def null_block(self, rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
        """HSIC is bilinear: every draw's nulls are Frobenius products of the prepared Grams with the
        permuted ones (:func:`repsim.kernels.permutation.gram_null_products`), over the self-HSICs."""
        return cka_null_block(rows, cols, perms)


@register
class LinearCKA(CKAFamily):
    info = MeasureInfo(
        name="linear_cka", display="linear CKA", order=0,
        formula="HSIC(XXᵀ, YYᵀ) / sqrt(HSIC(XXᵀ, XXᵀ) HSIC(YYᵀ, YYᵀ)), HSIC₁ unbiased (Song et al. 2012)",
        source="Kornblith et al. 2019 (ICML); minibatch: Nguyen, Raghu & Kornblith 2021",
        estimators=("minibatch", "exact"), symmetric=True, range=(0.0, 1.0), identical=1.0, null="0",
        statistic="rows", invariances=("orthogonal", "isotropic scaling", "translation"))
    OPTIONS = {"debiased": True, "compute_dtype": None}

    def accumulator(self, names: Sequence[str], **kw: Any) -> MinibatchCKA:
        return MinibatchCKA(len(names), debiased=bool(self.options["debiased"]), keep_batches=True, names=names,
                            compute_dtype=self.options["compute_dtype"], **kw)

    def accumulator_from_state(self, state: dict[str, Any]) -> MinibatchCKA:
        return MinibatchCKA.from_state(state)

    def prepare(self, column: FullColumn) -> Any:
        if column.is_constant():
            return None
        return hsic_prepared(column.centered_gram(), bool(self.options["debiased"]))
