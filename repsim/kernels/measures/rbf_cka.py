"""``rbf_cka``: CKA with Gaussian (RBF) kernels (Kornblith et al. 2019, ICML, §3 and their notebook).

    K_ij = exp(−‖x_i − x_j‖² / (2σ²)),   σ² = t² · median_{i,j} ‖x_i − x_j‖²,

the median over the full n × n matrix of squared distances *including its zero diagonal* (the
google-research CKA notebook's ``gram_rbf``; ``rbf_threshold`` t, default 1.0), then
CKA = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with HSIC₁ (Song et al. 2012; ``debiased=True``,
default) or HSIC₀.  Invariant to orthogonal transforms, translation and isotropic scaling (σ
scales with the data).

Minibatch: the squared distances of a batch come from its centred linear Gram,
‖x_i − x_j‖² = K_ii + K_jj − 2K_ij, so the Gram that linear CKA forms is reused (statistic
``"gram"``); σ is the batch's median, and the batch's RBF Gram, double-centred, enters a
:class:`repsim.MinibatchCKA` as a :class:`~repsim.kernels._precision.CentredGram` (HSIC₁ is invariant to
the centring, HSIC₀ needs it): CKA_mb = Σ_B HSIC(K_B, L_B) / sqrt(Σ_B HSIC(K_B, K_B) Σ_B HSIC(L_B, L_B)).
A batch on which a column is constant (or has a zero median distance) adds nothing to its sums.
Exact: the same on the full data's n × n Gram (σ from all n² distances).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim._xp import array_namespace, to_numpy
from repsim.kernels._precision import CentredGram, is_constant
from repsim.kernels.cka import MinibatchCKA, centred_gram
from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import Accumulator, FullColumn, MeasureInfo
from repsim.kernels.measures.linear_cka import CKAFamily, hsic_prepared


def rbf_gram(K: np.ndarray, threshold: float) -> np.ndarray | None:
    """The RBF Gram exp(−D / (2 t² median D)) from a (centred) linear Gram K (D_ij = K_ii + K_jj − 2K_ij,
    clipped at 0); None when the median distance is 0 (no scale: the kernel is undefined)."""
    d = np.diag(K)
    D = np.maximum(d[:, None] + d[None, :] - 2.0 * K, 0.0)
    med = float(np.median(D))
    if not med > 0:
        return None
    return np.exp(D / (-2.0 * threshold * threshold * med))


def _double_centre(K: np.ndarray) -> np.ndarray:
    r = K.mean(axis=1, keepdims=True)
    return K - r - r.T + r.mean()


class MinibatchRBFCKA(Accumulator):
    """All-pairs minibatch RBF CKA: each column's batch becomes its RBF Gram (module docstring),
    then one :class:`MinibatchCKA` sums HSIC over batches (merge, state and CIs are its)."""

    def __init__(self, inner: MinibatchCKA, threshold: float) -> None:
        self.inner = inner
        self.threshold = float(threshold)

    def _kernel(self, x: Any, name: str) -> CentredGram:
        G = x if isinstance(x, CentredGram) else centred_gram(x, array_namespace(x), name)
        K = np.asarray(to_numpy(G.K), dtype=np.float64)
        mean_sq = 0.0 if G.mean_sq is None else float(to_numpy(G.mean_sq))
        R = None if is_constant(name, float(np.trace(K)), mean_sq, K.shape[0]) else rbf_gram(K, self.threshold)
        return CentredGram(np.zeros_like(K) if R is None else _double_centre(R), mean_sq=0.0)

    def update(self, batch: Sequence[Any]) -> "MinibatchRBFCKA":
        names = self.inner._names()
        self.inner.update([self._kernel(batch[i], names[i]) for i in range(len(batch))])
        return self

    def merge(self, other: "MinibatchRBFCKA") -> "MinibatchRBFCKA":
        if other.threshold != self.threshold:
            raise ValueError(f"cannot merge RBF CKA with threshold {other.threshold} into {self.threshold}")
        self.inner.merge(other.inner)
        return self

    def result(self, ci: float | None = None, **kw: Any) -> Any:
        return self.inner.result(ci, **kw)

    def undefined(self) -> list[str]:
        return self.inner.undefined()

    @property
    def n_batches(self) -> int:
        return self.inner.n_batches

    def to_state(self) -> dict[str, Any]:
        return dict(self.inner.to_state(), rbf_threshold=self.threshold)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "MinibatchRBFCKA":
        inner = {k: v for k, v in state.items() if k != "rbf_threshold"}
        return cls(MinibatchCKA.from_state(inner), float(state["rbf_threshold"]))


@register
class RBFCKA(CKAFamily):
    info = MeasureInfo(
        name="rbf_cka",
        formula="CKA of Gaussian Grams exp(−‖xᵢ−xⱼ‖²/(2σ²)), σ² = t²·median of the n×n squared distances",
        source="Kornblith et al. 2019 (ICML), google-research CKA notebook (gram_rbf)",
        estimators=("minibatch", "exact"), symmetric=True, range=(0.0, 1.0), identical=1.0, null=0.0,
        statistic="gram", invariances=("orthogonal", "isotropic scaling", "translation"))
    OPTIONS = {"debiased": True, "rbf_threshold": 1.0}

    def accumulator(self, names: Sequence[str], **kw: Any) -> MinibatchRBFCKA:
        inner = MinibatchCKA(len(names), debiased=bool(self.options["debiased"]), keep_batches=True, names=names)
        return MinibatchRBFCKA(inner, float(self.options["rbf_threshold"]))

    def accumulator_from_state(self, state: dict[str, Any]) -> MinibatchRBFCKA:
        return MinibatchRBFCKA.from_state(state)

    def prepare(self, column: FullColumn) -> Any:
        if column.is_constant():
            return None
        R = rbf_gram(column.centred_gram(), float(self.options["rbf_threshold"]))
        return None if R is None else hsic_prepared(R, bool(self.options["debiased"]))
