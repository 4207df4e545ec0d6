"""The pairwise-measure protocol: what every similarity measure declares and implements.

A *measure* compares two columns (one layer of one store each) over the same n examples.  It
declares its metadata (:class:`MeasureInfo`) and implements one or both estimators:

- **minibatch** (:meth:`Measure.accumulator`): a mergeable accumulator over batches of all L
  columns at once — ``update(batch)`` with one per-batch *statistic* per column (the measure's
  ``info.statistic``: ``"rows"`` — the batch rows or, for a wide column, its centred b × b Gram
  as a :class:`~repsim.kernels._precision.CenteredGram`; ``"gram"`` — always the centred Gram, so
  that measures which start from it share one product per column), ``merge(other)`` (threads, Dask
  workers and resumed checkpoints combine partial states in segment order), ``result()`` → (L, L),
  ``to_state()`` / ``from_state(state)`` (plain NumPy values: checkpoints, task results) and
  ``undefined()`` (the columns it could not define); an estimator with bootstrap intervals adds
  ``ci(level, n_boot=, seed=, draws=)`` → (lower, upper) and ``n_batches`` (:meth:`SimilarityResult.ci`);
- **exact** (:meth:`Measure.prepare` + :meth:`Measure.pair`): on the full data of each column
  (:class:`FullColumn`: its float64 rows when p <= n, its Gram otherwise), ``prepare`` once per
  column (``None``: the column is undefined for this measure, e.g. constant), then ``pair`` per
  pair (``nan``: this pair is undefined, e.g. too few rows for CCA).

An undefined column or pair is NaN in the matrix with one warning naming it (the engine's
constant-layer policy), never an aborted matrix.  A new measure is one module that subclasses
:class:`Measure` and decorates it with :func:`repsim.kernels.measures.register` (docs/measures.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from repsim.kernels._precision import constant_tolerance
from repsim.kernels.hsic import double_center

__all__ = ["MeasureInfo", "Measure", "Accumulator", "FullColumn", "MinibatchUnsupported", "NoNull", "shift_dots",
           "source_eps"]


@dataclass(frozen=True)
class MeasureInfo:
    """A measure's declared metadata.

    ``name``: as on the command line; ``display``: as in figure titles and legends (default: ``name``); ``formula`` and ``source`` (the paper it follows); ``estimators``:
    the routes it implements, of ``("minibatch", "exact")``; ``statistic``: the per-batch statistic
    of its minibatch route (``"rows"`` or ``"gram"``, module docstring; ``""`` without one);
    ``symmetric``: m(X, Y) = m(Y, X) (else row i, column j is m(column i, column j): row = first
    argument); ``range`` its (min, max); ``identical`` its value for m(X, X); ``null`` what it gives for
    independent noise, as text, since for most measures that depends on n and p (``"0"``, ``"≈ k/(n−1)"``,
    ``"small > 0"``: finite-sample bias; docs/measures.md's table shows it); ``invariances`` what transforms of
    X leave it unchanged; ``order`` its place in listings (docs/measures.md's order; a new measure
    may leave the default: after the others, by name).
    """

    name: str
    formula: str
    source: str
    estimators: tuple[str, ...]
    symmetric: bool
    range: tuple[float, float]
    identical: float
    null: str
    statistic: str = ""
    invariances: tuple[str, ...] = ()
    order: int = 100
    display: str = ""

    @property
    def label(self) -> str:
        """The display name (``display``, else ``name``)."""
        return self.display or self.name

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "display": self.label, "formula": self.formula, "source": self.source,
                "estimators": list(self.estimators), "symmetric": self.symmetric, "range": list(self.range),
                "identical": self.identical, "null": self.null, "statistic": self.statistic,
                "invariances": list(self.invariances)}


class MinibatchUnsupported(ValueError):
    """The measure has no minibatch estimator."""


class NoNull(ValueError):
    """The measure defines no permutation null (no :meth:`Measure.permute`)."""


class Accumulator:
    """The minibatch accumulator protocol (:class:`repsim.MinibatchCKA` is the reference instance).

    Subclasses implement ``update``, ``merge``, ``result``, ``to_state``, ``from_state`` and
    ``undefined``; this base only documents them."""

    def update(self, batch: Sequence[Any]) -> "Accumulator":  # pragma: no cover - protocol
        raise NotImplementedError

    def merge(self, other: "Accumulator") -> "Accumulator":  # pragma: no cover - protocol
        raise NotImplementedError

    def result(self) -> np.ndarray:  # pragma: no cover - protocol
        raise NotImplementedError

    def to_state(self) -> dict[str, Any]:  # pragma: no cover - protocol
        raise NotImplementedError

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Accumulator":  # pragma: no cover - protocol
        raise NotImplementedError

    def undefined(self) -> list[str]:  # pragma: no cover - protocol
        raise NotImplementedError


def source_eps(dtype: Any) -> float:
    """Machine epsilon of the dtype data was held in before it became float64 (float16: 9.8e-4, float32:
    1.2e-7); float64's for float64 and for exact types (integers, booleans)."""
    dt = np.dtype(dtype)
    return float(np.finfo(dt).eps) if dt.kind == "f" and dt.itemsize < 8 else float(np.finfo(np.float64).eps)


def shift_dots(y: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y m, y (m − m̄)) for rows ``y`` already shifted by ``m``: :class:`FullColumn`'s ``shift_dots`` and
    ``shift_dots_c`` (the latter formed directly: from the former it would cancel when m̄ is large)."""
    return y @ m, y @ (m - m.mean())


@dataclass
class FullColumn:
    """One column on all n examples, for the exact estimators.

    ``rows``: the float64 rows (n, p) when p <= n, else ``None``; ``gram``: else the Gram of the
    shifted rows X − 1 mᵀ (n, n) float64, ``sums`` their row sums, ``shift`` m (e.g. the first rows'
    mean; None: m = 0) and ``shift_dots``/``shift_dots_c`` (:func:`shift_dots`): the centred Gram is the
    shifted one's, double-centred, without the cancellation an uncentred X Xᵀ of rows far from the
    origin suffers, and X Xᵀ is rebuilt from them where a measure needs it.  ``features`` is p.  Derived
    views (cached): :meth:`centered_gram` K_c = X̃ X̃ᵀ (X̃ column-centred), :meth:`factor` an (n, r)
    matrix R with R Rᵀ = K_c (r = min(p, n); R = X̃ itself when the rows are kept, so R = X̃ Q with Q orthonormal in general:
    measures that are invariant to orthogonal transforms of the features may use R for X̃),
    :meth:`raw_gram` and :meth:`row_sums` (for measures on uncentred rows: RSA, mutual kNN).
    """

    name: str
    features: int
    rows: np.ndarray | None = None
    gram: np.ndarray | None = None
    sums: np.ndarray | None = None  # row sums Σ_f (x_if − m_f) (needed with ``gram``)
    shift: np.ndarray | None = None  # m (p,), with ``gram``; None: m = 0
    shift_dots: np.ndarray | None = None  # (X − 1 mᵀ) m, (n,)
    shift_dots_c: np.ndarray | None = None  # (X − 1 mᵀ)(m − m̄), (n,): m centred over its features
    source_eps: float = float(np.finfo(np.float64).eps)  # machine epsilon of the dtype the data was held in
    _cache: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.rows is None) == (self.gram is None):
            raise ValueError("a FullColumn holds either its rows or its Gram")
        self._cache = {}

    @property
    def _shift_sq(self) -> float:  # ‖m‖²
        return 0.0 if self.shift is None else float(self.shift @ self.shift)

    @property
    def _shift_sum(self) -> float:  # Σ_f m_f
        return 0.0 if self.shift is None else float(self.shift.sum())

    @property
    def _shift_centered_sq(self) -> float:  # ‖m − m̄‖²
        if self.shift is None:
            return 0.0
        mc = self.shift - self.shift.mean()
        return float(mc @ mc)

    @property
    def n(self) -> int:
        return int((self.rows if self.rows is not None else self.gram).shape[0])

    @property
    def has_features(self) -> bool:
        return self.rows is not None

    def _cached(self, key: str, make: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def centered_rows(self) -> np.ndarray:
        """X̃ = X − x̄ (only when the rows are kept)."""
        if self.rows is None:
            raise ValueError(f"{self.name}: its features are not kept (p = {self.features} > n = {self.n})")
        return self._cached("centered", lambda: self.rows - self.rows.mean(axis=0, keepdims=True))

    def centered_gram(self) -> np.ndarray:
        """K_c = X̃ X̃ᵀ = H G H (n, n)."""
        def make() -> np.ndarray:
            if self.rows is not None:
                Xc = self.centered_rows()
                return Xc @ Xc.T
            K = double_center(self.gram)
            return (K + K.T) / 2
        return self._cached("kc", make)

    def factor(self) -> np.ndarray:
        """R (n, r) with R Rᵀ = K_c: X̃ itself, or the eigen-factor V Λ^½ of K_c (eigenvalues below
        n·eps·λ_max dropped)."""
        def make() -> np.ndarray:
            if self.rows is not None:
                return self.centered_rows()
            w, V = np.linalg.eigh(self.centered_gram())
            keep = w > max(w[-1], 0.0) * self.n * np.finfo(np.float64).eps
            return V[:, keep] * np.sqrt(w[keep])
        return self._cached("factor", make)

    def raw_gram(self) -> np.ndarray:
        """G = X Xᵀ, uncentred (n, n): with a shift m, (X − 1mᵀ)(X − 1mᵀ)ᵀ + d 1ᵀ + 1 dᵀ + ‖m‖² (d = shift_dots)."""
        if self.gram is None:
            return self._cached("g", lambda: self.rows @ self.rows.T)
        if self.shift_dots is None:
            return self.gram
        d = self.shift_dots
        return self._cached("g", lambda: self.gram + d[:, None] + d[None, :] + self._shift_sq)

    def row_sums(self) -> np.ndarray:
        """Σ_f x_if per row (n,)."""
        if self.rows is not None:
            return self._cached("sums", lambda: self.rows.sum(axis=1))
        return self.sums + self._shift_sum

    def row_centered_gram(self) -> tuple[np.ndarray, np.ndarray]:
        """(RC, slack): RC_ij = (x_i − x̄_i)·(x_j − x̄_j), each row centred over its features (RSA's
        Pearson between examples), and the rounding its diagonal may carry (n,). From a shifted Gram
        (y = x − m): RC = G − s sᵀ/p + c 1ᵀ + 1 cᵀ + ‖m − m̄‖² (c = y·(m − m̄)), none of whose terms
        carries the rows' distance from the origin."""
        eps, p = float(np.finfo(np.float64).eps), self.features

        def make() -> tuple[np.ndarray, np.ndarray]:
            means = self.row_sums() / p
            if self.rows is not None:
                R = self.rows - self.rows.mean(axis=1, keepdims=True)
                slack = np.zeros(self.n)
                RC = R @ R.T
            else:
                s = self.sums
                c = self.shift_dots_c if self.shift_dots_c is not None else np.zeros(self.n)
                RC = self.gram - np.outer(s, s) / p + c[:, None] + c[None, :] + self._shift_centered_sq
                slack = 64 * eps * (np.diag(self.gram) + s * s / p + 2 * np.abs(c) + self._shift_centered_sq)
            return RC, np.maximum(slack, (4 * p * eps) ** 2 * p * means ** 2)  # + the row means' rounding
        return self._cached("rc", make)

    def raw_energy(self) -> float:
        """‖X‖²_F of the uncentred rows (from a shifted Gram: tr G + 2 Σ shift_dots + n ‖m‖²)."""
        def make() -> float:
            if self.rows is not None:
                return float(np.einsum("ij,ij->", self.rows, self.rows))
            dots = float(np.sum(self.shift_dots)) if self.shift_dots is not None else 0.0
            return max(0.0, float(np.trace(self.gram)) + 2 * dots + self.n * self._shift_sq)
        return self._cached("energy", make)

    def rounding_floor(self) -> float:
        """The singular value below which a direction of X̃ may be the rounding of the data to its source
        dtype alone: u ‖X‖_F, u = ``source_eps`` / 2. Rounding perturbs each entry by at most u |x_ij|, so
        the perturbation E has ‖E‖₂ ≤ ‖E‖_F ≤ u ‖X‖_F, centring does not enlarge it, and by Weyl's
        inequality every singular value of the stored X̃ beyond the exact data's rank is at most that
        (float16: 4.9e-4 ‖X‖_F, float32: 6e-8 ‖X‖_F, float64: 1.1e-16 ‖X‖_F)."""
        return 0.5 * self.source_eps * math.sqrt(self.raw_energy())

    def is_constant(self) -> bool:
        """No variance over the examples: tr K_c within the rounding of the data, the larger of what the
        float64 mean's rounding leaves (:func:`~repsim.kernels._precision.constant_tolerance`, as the
        minibatch route's check) and, for a Gram, 1e-12 of the shifted rows' energy tr G (its
        double-centring's rounding). Not relative to the uncentred energy: rows far from the origin
        (an offset 1e6 times their spread) keep their variance in float64."""
        def make() -> bool:
            tr = float(np.trace(self.centered_gram()))
            if self.gram is not None:
                shifted = float(np.trace(self.gram))
                tol = max(constant_tolerance(self.n, self.raw_energy() / self.n), 1e-12 * shifted)  # ‖X‖²/n >= ‖x̄‖²
            else:
                mean = self.rows.mean(axis=0)
                tol = constant_tolerance(self.n, float(mean @ mean))
            return not tr > max(tol, np.finfo(np.float64).tiny)
        return self._cached("const", make)


class Measure:
    """Base of every measure: metadata in ``info``, options in ``OPTIONS`` (name -> default), and
    the estimators it implements (module docstring).

    ``Measure(**options)``: unknown keys are ignored, so the engine can pass one option dict to
    every measure of a call; ``self.options`` holds the measure's own (recorded in results)."""

    info: ClassVar[MeasureInfo]
    OPTIONS: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **options: Any) -> None:
        self.options = {k: options.get(k, v) if options.get(k) is not None else v for k, v in self.OPTIONS.items()}

    @property
    def name(self) -> str:
        return self.info.name

    def has(self, estimator: str) -> bool:
        return estimator in self.info.estimators

    # -- minibatch -----------------------------------------------------------------------------
    def accumulator(self, names: Sequence[str], **kw: Any) -> Accumulator:
        """A fresh minibatch accumulator over the columns ``names``."""
        raise MinibatchUnsupported(f"{self.name} has no minibatch estimator: use method='exact'")

    def accumulator_from_state(self, state: dict[str, Any]) -> Accumulator:
        raise MinibatchUnsupported(f"{self.name} has no minibatch estimator")

    # -- exact ---------------------------------------------------------------------------------
    def prepare(self, column: FullColumn) -> Any:
        """What ``pair`` needs of one column (computed once per column); ``None``: undefined."""
        raise NotImplementedError(f"{self.name} has no exact estimator")

    def pair(self, a: Any, b: Any) -> float:
        """The measure of two prepared columns (row = ``a``); ``nan`` when undefined."""
        raise NotImplementedError(f"{self.name} has no exact estimator")

    def pairs(self, a: Any, bs: Sequence[Any]) -> list[float]:
        """``[pair(a, b) for b in bs]``: one row of the matrix; a measure whose pairs batch (stacked
        LAPACK calls, repsim.kernels.measures._batched) overrides it with the same values."""
        return [self.pair(a, b) for b in bs]

    # -- permutation null (repsim.kernels.permutation) ------------------------------------------
    def null_rows(self, n: int) -> int:
        """How many rows a prepared column indexes (the length of its permutations): n, or fewer for a
        measure that subsamples (RSA)."""
        return int(n)

    def permute(self, prepared: Any, perm: np.ndarray) -> Any:
        """The prepared column of Y[perm] (row i of the new column is row perm[i]) from Y's prepared
        column, without recomputing what does not depend on the row order."""
        raise NoNull(f"{self.name} defines no permutation null (no Measure.permute)")

    def null_kernel(self) -> Any:
        """The minibatch null's kernel of a batch column (:class:`repsim.kernels.minibatch_null.MinibatchNull`):
        None for the linear Gram; a measure whose minibatch route starts from another kernel returns
        ``kernel(x, name) -> CenteredGram``."""
        return None

    @classmethod
    def has_null(cls) -> bool:
        """Whether the measure defines a permutation null (overrides :meth:`permute`)."""
        return cls.permute is not Measure.permute

    def null_block(self, rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
        """(K, len(rows), len(cols)): ``pair(rows[r], permute(cols[c], perms[k]))`` (NaN where either is
        undefined); measures whose nulls batch (CKA: Gram products, mutual k-NN: index maps) override it
        with the same values."""
        K = perms.shape[0]
        out = np.full((K, len(rows), len(cols)), np.nan)
        live_c = [c for c, b in enumerate(cols) if b is not None]
        live_r = [r for r, a in enumerate(rows) if a is not None]
        for k in range(K):
            moved = [self.permute(cols[c], perms[k]) for c in live_c]
            for r in live_r:
                out[k, r, live_c] = self.pairs(rows[r], moved)
        return out

    def undefined_when(self) -> str:
        """When a column has no value of this measure (NaN row and column), as the warning that names
        such columns says it; measures with conditions beyond a constant column extend it."""
        return ("constant over the examples — e.g. a zero-initialised head, or float16 storage that rounded "
                "a tiny variance to zero (re-extract with --dtype float32)")

    def exact_info(self, n: int) -> dict[str, Any]:
        """What the exact route on n examples adds to this measure's metadata in the result (e.g. the
        rows a subsampling measure used); none by default."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"


def finite_or_nan(value: float) -> float:
    return float(value) if math.isfinite(value) else math.nan
