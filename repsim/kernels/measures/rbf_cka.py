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
:class:`repsim.MinibatchCKA` as a :class:`~repsim.kernels._precision.CenteredGram` (HSIC₁ is invariant to
the centring, HSIC₀ needs it): CKA_mb = Σ_B HSIC(K_B, L_B) / sqrt(Σ_B HSIC(K_B, K_B) Σ_B HSIC(L_B, L_B)).
A batch on which a column is constant (or has a zero median distance) adds nothing to its sums.
Exact: the same on the full data's n × n Gram (σ from all n² distances).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from repsim.blas import blas_thread_split
from repsim.array_api import array_namespace, astype, diagonal, on_device, to_numpy
from repsim.kernels._precision import CenteredGram, constant_tolerance, is_constant
from repsim.kernels.hsic import centered_gram, double_center
from repsim.kernels.minibatch_cka import MinibatchCKA
from repsim.kernels.measures import register
from repsim.kernels.measures._protocol import Accumulator, FullColumn, MeasureInfo
from repsim.kernels.measures.linear_cka import CKAFamily, hsic_prepared


def threshold_range(dtype: Any = np.float64) -> tuple[float, float]:
    """The bandwidth factors t for which ``dtype`` holds RBF CKA, derived from its ``eps`` (rounded
    inwards to 3 significant digits). At the median pair the kernel entry is exp(−1/(2t²)); the Gram
    is centred against its diagonal of 1s, so that entry keeps half of the digits only while it lies at
    least √eps from 0 and from 1:

    - exp(−1/(2t²)) ≥ √eps: t ≥ 1/√(−ln eps) (float64: 0.167). Below it the minibatch route (each
      batch's RBF Gram double-centred) loses the pairs: against the exact route (which sums the
      uncentred entries) its relative error was 7e-5 at t = 0.05 and NaN ("undefined") at 0.0376; at
      t = 1e-200, σ² = 0 (a ZeroDivisionError);
    - 1 − exp(−1/(2t²)) ≈ 1/(2t²) ≥ √eps: t ≤ (2√eps)^(−1/2) (float64: 5790). At t = 1e8 every entry
      rounded to 1: RBF CKA 0.985-1.0 for layers of linear CKA 0.13.

    One rule for every route (minibatch, exact, the accumulators, the CLI's ``--rbf-threshold``):
    :func:`check_threshold`."""
    eps = float(np.finfo(dtype).eps)
    lo = 1.0 / math.sqrt(-math.log(eps))
    hi = (2.0 * math.sqrt(eps)) ** -0.5

    def inwards(x: float, up: bool) -> float:
        e = math.floor(math.log10(x)) - 2
        m = x / 10.0 ** e
        return float(f"{math.ceil(m) if up else math.floor(m)}e{e}")

    return inwards(lo, True), inwards(hi, False)


RBF_THRESHOLD_RANGE = threshold_range()


def check_threshold(threshold: float, flag: str = "rbf_threshold") -> float:
    """``threshold`` as a float, or a one-line ``ValueError`` outside :data:`RBF_THRESHOLD_RANGE`."""
    lo, hi = RBF_THRESHOLD_RANGE
    value = float(threshold)
    if not lo <= value <= hi:
        shown = f"{value:g}" if not math.isfinite(value) or float(f"{value:g}") == value else repr(value)
        raise ValueError(f"{flag + ' ' if flag else ''}must lie in [{lo:g}, {hi:g}] (beyond it float64 keeps fewer than half of the "
                         f"digits of the Gaussian kernel, and RBF CKA means nothing), got {shown}")
    return value


def squared_distances(K: np.ndarray) -> np.ndarray:
    """D_ij = K_ii + K_jj − 2K_ij, clipped at 0 (rounding), from a (centred) linear Gram K: a new
    array, formed in place (three passes over b², no temporaries)."""
    d = np.diag(K).copy()
    D = np.multiply(K, -2.0)
    D += d[:, None]
    D += d[None, :]
    np.maximum(D, 0.0, out=D)
    return D


def median_all(D: np.ndarray, sample: int = 4096) -> float:
    """``np.median(D)`` over all entries, exactly, without partitioning all of them.

    The order statistics at the middle ranks are bracketed by quantiles of a strided sample of the
    entries (±4 standard errors of a sample quantile's rank, √S/2 each); the entries below the bracket are counted
    and only those inside it are partitioned.  When the bracket misses a middle rank (possible for
    data in an adversarial order) it falls back to a full partition, so the value is always the
    exact median — only the time depends on the sample."""
    flat = D.reshape(-1)
    N = flat.size
    ranks = [(N - 1) // 2, N // 2]  # equal when N is odd
    if N <= 8 * sample:
        return float(np.median(flat))
    s = np.sort(flat[:: N // sample])
    S = s.size
    margin = int(2 * math.sqrt(S)) + 2
    lo_i, hi_i = ranks[0] * S // N - margin, ranks[1] * S // N + margin
    lo = s[lo_i] if lo_i > 0 else -np.inf
    hi = s[hi_i] if hi_i < S else np.inf
    below = int(np.count_nonzero(flat < lo))
    inside = flat[(flat >= lo) & (flat <= hi)]
    k = [r - below for r in ranks]
    if k[0] < 0 or k[1] >= inside.size:
        picked = np.partition(flat, ranks)[ranks]
    else:
        picked = np.partition(inside, k)[k]
    return float((picked[0] + picked[1]) / 2)


def rbf_gram(K: np.ndarray, threshold: float) -> np.ndarray | None:
    """The RBF Gram exp(−D / (2 t² median D)) from a (centred) linear Gram K (D_ij = K_ii + K_jj − 2K_ij,
    clipped at 0); None when the median distance is 0 (no scale: the kernel is undefined)."""
    D = squared_distances(K)
    med = median_all(D)
    if not med > 0:
        return None
    D *= -1.0 / (2.0 * threshold * threshold * med)
    return np.exp(D, out=D)


def device_rbf_kernel(G: CenteredGram, xp: Any, threshold: float) -> CenteredGram:
    """:meth:`MinibatchRBFCKA._kernel` on an accelerator (CuPy; array-api-strict in the tests), with
    no host synchronisation: the double-centred RBF Gram of a column's centred linear Gram, made on
    its device with the host route's arithmetic — D = −2K + diag 1ᵀ + 1 diagᵀ clipped at 0 (the
    order of :func:`squared_distances`), the median of all b² entries (zero diagonal included) as
    the mean of the two middle entries of ``xp.sort`` (:func:`median_all`'s value), ``xp.exp``,
    :func:`~repsim.kernels.hsic.double_center` — and the host route's checks kept on the device: a column constant over
    the batch (tr K within :func:`constant_tolerance`) or with a zero median distance gets a zero
    Gram (the inner accumulator then counts it as constant, as on the host), and one with NaN or
    infinity a NaN Gram, which the inner update's one transfer per batch reports under its name."""
    K = G.K if G.K.dtype == xp.float64 else astype(G.K, xp.float64, xp)
    n = K.shape[0]
    dev = getattr(K, "device", None)
    d = diagonal(K, xp)
    D = xp.maximum((K * -2.0 + d[:, None]) + d[None, :], 0.0)
    flat = xp.sort(xp.reshape(D, (-1,)))
    N = n * n
    med = (flat[(N - 1) // 2] + flat[N // 2]) / 2
    del flat
    one = on_device(xp.ones, (), dtype=xp.float64, device=dev)
    scale = xp.where(med > 0, med, one)  # (a zero median: any finite width; the Gram is zeroed below)
    R = xp.exp(D * (-1.0 / (2.0 * threshold * threshold * scale)))
    del D
    R = double_center(R, xp=xp)
    trace = xp.sum(d)
    mean_sq = 0.0 if G.mean_sq is None else G.mean_sq
    defined = (trace > constant_tolerance(n, 1.0) * mean_sq) & (med > 0)
    zero = on_device(xp.zeros, (), dtype=xp.float64, device=dev)
    # 1 where defined, 0 where constant, NaN where the linear Gram is not finite (tr K NaN or inf)
    keep = xp.where(xp.isfinite(trace), xp.where(defined, one, zero), zero * xp.nan)
    return CenteredGram(R * keep, mean_sq=zero)


class MinibatchRBFCKA(Accumulator):
    """All-pairs minibatch RBF CKA: each column's batch becomes its RBF Gram (module docstring),
    then one :class:`MinibatchCKA` sums HSIC over batches (merge, state and CIs are its)."""

    def __init__(self, inner: MinibatchCKA, threshold: float) -> None:
        check_threshold(threshold)
        self.inner = inner
        self.threshold = float(threshold)

    def _kernel(self, x: Any, name: str) -> CenteredGram:
        xp = array_namespace(x.K if isinstance(x, CenteredGram) else x)
        G = x if isinstance(x, CenteredGram) else centered_gram(x, xp, name)
        if xp is not np:  # an accelerator: the Gram stays on its device (one host transfer per batch)
            return device_rbf_kernel(G, xp, self.threshold)
        K = np.asarray(G.K, dtype=np.float64)
        mean_sq = 0.0 if G.mean_sq is None else float(to_numpy(G.mean_sq))
        R = None if is_constant(name, float(np.trace(K)), mean_sq, K.shape[0]) else rbf_gram(K, self.threshold)
        return CenteredGram(np.zeros_like(K) if R is None else double_center(R, overwrite=True), mean_sq=0.0)

    def update(self, batch: Sequence[Any]) -> "MinibatchRBFCKA":
        """One batch of all L columns: their RBF Grams (independent, element-wise work that releases
        the GIL: spread over the BLAS thread budget, :func:`repsim.blas.blas_thread_split`), then
        one update of the HSIC sums."""
        names = self.inner._names()
        L = len(batch)
        first = batch[0].K if L and isinstance(batch[0], CenteredGram) else (batch[0] if L else None)
        if L and array_namespace(first) is not np:  # device work is queued on its stream: no threads
            self.inner.update([self._kernel(batch[i], names[i]) for i in range(L)])
            return self
        with blas_thread_split() as k:
            if k > 1 and L > 1:
                with ThreadPoolExecutor(max_workers=min(k, L), thread_name_prefix="repsim-rbf") as pool:
                    kernels = list(pool.map(self._kernel, batch, names))
            else:
                kernels = [self._kernel(batch[i], names[i]) for i in range(L)]
        self.inner.update(kernels)
        return self

    def merge(self, other: "MinibatchRBFCKA") -> "MinibatchRBFCKA":
        if other.threshold != self.threshold:
            raise ValueError(f"cannot merge RBF CKA with threshold {other.threshold} into {self.threshold}")
        self.inner.merge(other.inner)
        return self

    def result(self) -> np.ndarray:
        return self.inner.result()

    def ci(self, level: float = 0.95, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        """Bootstrap bounds over batches (:meth:`repsim.MinibatchCKA.ci`)."""
        return self.inner.ci(level, **kw)

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
        name="rbf_cka", display="RBF CKA", order=1,
        formula="CKA of Gaussian Grams exp(−‖xᵢ−xⱼ‖²/(2σ²)), σ² = t²·median of the n×n squared distances",
        source="Kornblith et al. 2019 (ICML), google-research CKA notebook (gram_rbf)",
        estimators=("minibatch", "exact"), symmetric=True, range=(0.0, 1.0), identical=1.0, null="0",
        statistic="gram", invariances=("orthogonal", "isotropic scaling", "translation"))
    OPTIONS = {"debiased": True, "rbf_threshold": 1.0}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.options["rbf_threshold"] = check_threshold(self.options["rbf_threshold"])

    def undefined_when(self) -> str:
        return ("constant over the examples, or with a median squared distance of 0 between its examples "
                "(more than half of the pairs coincide, e.g. a sparse layer where most examples are all zero: "
                "the median heuristic gives the kernel no width; compare such a layer with linear CKA)")

    def accumulator(self, names: Sequence[str], **kw: Any) -> MinibatchRBFCKA:
        inner = MinibatchCKA(len(names), debiased=bool(self.options["debiased"]), keep_batches=True, names=names)
        return MinibatchRBFCKA(inner, float(self.options["rbf_threshold"]))

    def null_kernel(self) -> Any:
        """The batch's double-centred RBF Gram, as the minibatch accumulator forms it."""
        return MinibatchRBFCKA(None, float(self.options["rbf_threshold"]))._kernel  # type: ignore[arg-type]

    def accumulator_from_state(self, state: dict[str, Any]) -> MinibatchRBFCKA:
        return MinibatchRBFCKA.from_state(state)

    def prepare(self, column: FullColumn) -> Any:
        if column.is_constant():
            return None
        R = rbf_gram(column.centered_gram(), float(self.options["rbf_threshold"]))
        return None if R is None else hsic_prepared(R, bool(self.options["debiased"]))
