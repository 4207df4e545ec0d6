"""All pairs of one measure's exact estimator on in-memory columns (:func:`exact_matrix`), and the public
in-memory API over it: :func:`similarity` (one pair, ``repsim.similarity``) and :func:`pairwise` (every
pair of K representations, ``repsim.pairwise``: netrep's ``pairwise_distances`` shape); undefined columns
and pairs become NaN, reported (not raised).  And their permutation nulls (:func:`exact_null`; in memory
:func:`calibrated_similarity` and :func:`calibrated_matrix`).

Layer-aggregate calibration (Gröger et al. 2026, Algorithm 2, ``calibrate_layers``): within a draw k
every column of one group (a store) is permuted by the same π_{g,k}, and a pair (i, j) is compared as
m(column i, column j permuted by its group's π) — so a block of pairs between two stores sees one
permutation per draw, and a maximum or mean over the block has a valid null
(:meth:`repsim.engine.result.SimilarityResult.aggregate`).  Symmetric measures compute i <= j and mirror.
Each group's draws come from ``default_rng([seed, g])`` (:func:`repsim.kernels.permutation.permutations`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from repsim.array_api import to_numpy
from repsim.kernels.measures._protocol import FullColumn, Measure, shift_dots, source_eps
from repsim.kernels.permutation import calibrate, check_null, permutations


@dataclass
class ExactOutcome:
    """``values`` (L, L); ``undefined_columns`` (names) and ``undefined_pairs`` ((row, column) names)."""

    values: np.ndarray
    undefined_columns: list[str] = field(default_factory=list)
    undefined_pairs: list[tuple[str, str]] = field(default_factory=list)
    prepared: list[Any] | None = None  # each column's prepared form (keep_prepared=True: the nulls reuse it)


def full_column(x: Any, name: str = "X") -> FullColumn:
    """An in-memory layer (n, ...) as a :class:`FullColumn`: float64 rows when p <= n, else its Gram."""
    held = np.asarray(to_numpy(x))
    X = held.astype(np.float64, copy=False).reshape(held.shape[0], -1)
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{name} contains NaN or infinite values")
    n, p = X.shape
    eps = source_eps(held.dtype)
    if p <= n:
        return FullColumn(name, p, rows=X, source_eps=eps)
    m = X.mean(axis=0)
    Xs = X - m  # the Gram of rows far from the origin, uncentred, would cancel most of its digits
    dots, dots_c = shift_dots(Xs, m)
    return FullColumn(name, p, gram=Xs @ Xs.T, sums=Xs.sum(axis=1), shift=m, shift_dots=dots, shift_dots_c=dots_c,
                      source_eps=eps)


def exact_matrix(measure: Measure, columns: Sequence[FullColumn], progress: Any = None, *,
                 keep_prepared: bool = False, view: Callable[[FullColumn], FullColumn] | None = None) -> ExactOutcome:
    """m(column i, column j) for every pair (row = first argument): each column prepared once, then
    the upper triangle (symmetric measures) or every ordered pair, a row at a time
    (``Measure.pairs``: stacked LAPACK calls where a measure batches them).  The pairs are
    independent: rows of them run on the BLAS thread budget's k threads
    (:func:`repsim.blas.blas_thread_split`, each single-threaded BLAS/LAPACK, which release the GIL
    for stacked calls), so the result does not depend on k.  ``view``: what each column is prepared
    from, formed just before and dropped after (the jackknife's subsets of the rows:
    :mod:`repsim.kernels.jackknife`)."""
    L = len(columns)
    prepared = []
    for c in columns:
        prepared.append(measure.prepare(c if view is None else view(c)))
        if progress is not None:
            progress(1)
    values = np.full((L, L), np.nan)
    out = ExactOutcome(values, [c.name for c, p in zip(columns, prepared) if p is None],
                       prepared=prepared if keep_prepared else None)
    symmetric = measure.info.symmetric

    def row(i: int) -> list[tuple[int, float]]:
        if prepared[i] is None:
            return []
        js = [j for j in range(i if symmetric else 0, L) if prepared[j] is not None]
        return [(j, float(v)) for j, v in zip(js, measure.pairs(prepared[i], [prepared[j] for j in js]))]

    from repsim.blas import blas_thread_split

    with blas_thread_split() as k:
        if k > 1 and L > 2:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=k, thread_name_prefix="repsim-pairs") as pool:
                rows = list(pool.map(row, range(L)))
        else:
            rows = [row(i) for i in range(L)]
    for i, got in enumerate(rows):
        for j, v in got:
            if not math.isfinite(v):
                out.undefined_pairs.append((columns[i].name, columns[j].name))
                v = math.nan
            values[i, j] = v
            if symmetric:
                values[j, i] = v
    return out


def _measure(measure: str | Measure, options: dict[str, Any]) -> Measure:
    """The measure ``measure`` names, built with ``options`` (refused when no measure takes one), or the
    :class:`Measure` object itself (which takes no ``options``: they are set when it is built)."""
    from repsim.kernels.measures import check_options, get_measure

    if isinstance(measure, str):
        check_options([measure], options)
        return get_measure(measure, **options)
    if options:
        raise ValueError(f"options {sorted(options)} given with a Measure object: set them when building it")
    return measure


def similarity(X: Any, Y: Any, measure: str | Measure = "linear_cka", **options: Any) -> float:
    """One measure's exact value for two in-memory representations X (n, ...) and Y (n, ...)
    (row = X for asymmetric measures); NaN when undefined.  ``options`` as the measure's ``OPTIONS``
    (``"linear_cka"`` and ``"rbf_cka"``: ``debiased=True`` by default, the paper's estimator, as
    :func:`repsim.linear_cka`)."""
    m = _measure(measure, options)
    a, b = full_column(X, "X"), full_column(Y, "Y")
    if a.n != b.n:
        raise ValueError(f"X has {a.n} examples and Y {b.n}: a similarity compares the same examples")
    pa, pb = m.prepare(a), m.prepare(b)
    return math.nan if pa is None or pb is None else float(m.pair(pa, pb))


def pairwise(measure: str | Measure, arrays: Sequence[Any], **options: Any) -> np.ndarray:
    """``measure`` between every pair of K in-memory representations of the same n examples: ``arrays``
    is a sequence of K arrays (n, p_i), any trailing shape flattened (NumPy, CuPy or array-api-strict;
    held as float64); returns the K × K float64 matrix with entry (i, j) = ``similarity(arrays[i],
    arrays[j], measure)`` (row = first argument for asymmetric measures), NaN where a pair or an array is
    undefined (a constant array under CKA, too few rows for CCA). The shape of netrep's
    ``pairwise_distances(metric, train_data)`` (Williams et al. 2021, "Generalized shape metrics on neural
    representations"), with a similarity measure of the registry (``repsim.kernels.measures``: linear_cka,
    rbf_cka, procrustes, cca, svcca, pwcca, rsa, mutual_knn, ridge_r2; ``options`` as for
    :func:`similarity`). Each array is prepared once (its centring, factorisation or Gram) and the
    prepared forms are shared by all its pairs (:func:`exact_matrix`); symmetric measures compute the
    upper triangle and mirror it. Arrays of different n, or fewer than one array, raise ValueError."""
    m = _measure(measure, options)
    if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
        raise TypeError(f"arrays must be a sequence of arrays (n, p_i), got {type(arrays).__name__}")
    if len(arrays) < 1:
        raise ValueError("pairwise needs at least one array")
    columns = [full_column(x, f"arrays[{i}]") for i, x in enumerate(arrays)]
    ns = sorted({c.n for c in columns})
    if len(ns) > 1:
        sizes = ", ".join(f"arrays[{i}]: {c.n}" for i, c in enumerate(columns))
        raise ValueError(f"the arrays hold different numbers of examples ({sizes}); a similarity compares the "
                         "same examples")
    return exact_matrix(m, columns).values


# -- permutation nulls ----------------------------------------------------------------------------

def group_permutations(K: int, n: int, seed: int, group: int) -> np.ndarray:
    """Group ``group``'s K permutations of n rows."""
    return permutations(K, n, [int(seed), int(group)])


def null_block_threaded(measure: Measure, rows: Sequence[Any], cols: Sequence[Any], perms: np.ndarray) -> np.ndarray:
    """``measure.null_block`` with the draws split over the BLAS thread budget's k threads, each running
    single-threaded BLAS (:func:`repsim.blas.blas_thread_split`; threaded BLAS on a busy machine spins: a
    36 MFLOP/s product measured on a loaded 2-core box against 1 GFLOP/s on one thread).  Each draw's
    value is computed alone, so the result does not depend on k (beyond the rounding of a product's
    blocking)."""
    from repsim.blas import blas_thread_split

    with blas_thread_split() as k:
        parts = [p for p in np.array_split(np.arange(perms.shape[0]), min(k, perms.shape[0])) if p.size]
        if len(parts) < 2:
            return measure.null_block(rows, cols, perms)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="repsim-null") as pool:
            blocks = list(pool.map(lambda idx: measure.null_block(rows, cols, perms[idx]), parts))
    return np.concatenate(blocks, axis=0)


def exact_null(measure: Measure, prepared: Sequence[Any], groups: Sequence[int], K: int, seed: int, n: int,
               progress: Any = None) -> np.ndarray:
    """(K, L, L) null values of ``measure`` for prepared columns (None: undefined) in ``groups`` (a
    group id per column), entry (i, j) = m(col i, col j[π_{groups[j], k}]) (module docstring)."""
    L = len(prepared)
    rows_n = measure.null_rows(n)
    out = np.full((int(K), L, L), np.nan)
    for g in dict.fromkeys(groups):
        cols = [j for j in range(L) if groups[j] == g]
        perms = group_permutations(K, rows_n, seed, g)
        block = null_block_threaded(measure, list(prepared), [prepared[j] for j in cols], perms)  # (K, L, L_g)
        out[:, :, cols] = block
        if progress is not None:
            progress(len(cols))
    if measure.info.symmetric:
        iu = np.triu_indices(L, 1)
        out[:, iu[1], iu[0]] = out[:, iu[0], iu[1]]
    return out


def smax_of(measure: Measure) -> float | None:
    """The measure's upper bound for the calibrated score (None: unbounded, ReLU(s − τ))."""
    top = float(measure.info.range[1])
    return top if math.isfinite(top) else None


def calibrated_similarity(X: Any, Y: Any, measure: str | Measure = "linear_cka", *, permutations: int = 200,
                          seed: int = 0, alpha: float = 0.05, **options: Any) -> dict[str, Any]:
    """One pair's exact value with its permutation null (rows of Y permuted; Gröger et al.'s Algorithm 1):
    ``{"value", "pvalue", "threshold", "calibrated", "null" (K,)}``."""
    check_null(permutations, alpha)
    m = _measure(measure, options)
    a, b = full_column(X, "X"), full_column(Y, "Y")
    if a.n != b.n:
        raise ValueError(f"X has {a.n} examples and Y {b.n}: a similarity compares the same examples")
    pa, pb = m.prepare(a), m.prepare(b)
    if pa is None or pb is None:
        nan = float("nan")
        return {"value": nan, "pvalue": nan, "threshold": nan, "calibrated": nan, "null": np.full(permutations, nan)}
    value = float(m.pair(pa, pb))
    null = m.null_block([pa], [pb], group_permutations(permutations, m.null_rows(a.n), seed, 1))[:, 0, 0]
    cal, p, tau = calibrate(np.asarray(value), null, alpha, smax_of(m))
    return {"value": value, "pvalue": float(p), "threshold": float(tau), "calibrated": float(cal), "null": null}


def calibrated_matrix(layers_a: Sequence[Any], layers_b: Sequence[Any], measure: str | Measure = "linear_cka", *,
                      permutations: int = 200, seed: int = 0, alpha: float = 0.05, **options: Any) -> dict[str, Any]:
    """Every pair of two in-memory layer lists (row i = ``layers_a[i]``), each calibrated against K draws
    that permute the rows of every layer of ``layers_b`` alike (Gröger et al.'s Algorithm 2: the
    block's maximum or mean then has a valid null too, :func:`aggregate_calibration`):
    ``{"values", "pvalues", "threshold", "calibrated"}`` (L_a, L_b) and ``"null"`` (K, L_a, L_b).
    Each layer is prepared once (Grams, bases, neighbour lists) and every draw reuses it."""
    check_null(permutations, alpha)
    m = _measure(measure, options)
    cols_a = [full_column(x, f"A[{i}]") for i, x in enumerate(layers_a)]
    cols_b = [full_column(y, f"B[{j}]") for j, y in enumerate(layers_b)]
    n = cols_a[0].n
    if any(c.n != n for c in cols_a + cols_b):
        raise ValueError("every layer must hold the same examples (rows)")
    pa = [m.prepare(c) for c in cols_a]
    pb = [m.prepare(c) for c in cols_b]
    values = np.full((len(pa), len(pb)), np.nan)
    for i, a in enumerate(pa):
        live = [j for j, b in enumerate(pb) if b is not None]
        if a is not None and live:
            values[i, live] = m.pairs(a, [pb[j] for j in live])
    null = null_block_threaded(m, pa, pb, group_permutations(permutations, m.null_rows(n), seed, 1))
    cal, p, tau = calibrate(values, null, alpha, smax_of(m))
    return {"values": values, "pvalues": p, "threshold": tau, "calibrated": cal, "null": null}


def aggregate_calibration(values: np.ndarray, null: np.ndarray, alpha: float = 0.05, agg: str = "max",
                          smax: float | None = 1.0) -> dict[str, float]:
    """The calibration of an aggregate (``"max"`` or ``"mean"``) of a block of pairs against the same
    aggregate of each draw's block (``calibrate_layers``): valid when one permutation served every
    column of the block's permuted side within a draw, as in :func:`calibrated_matrix` and the engine."""
    if agg not in ("max", "mean"):
        raise ValueError(f"agg must be 'max' or 'mean', got {agg!r}")
    fn = np.max if agg == "max" else np.mean
    obs = float(fn(values))
    draws = fn(np.asarray(null).reshape(np.asarray(null).shape[0], -1), axis=1)
    cal, p, tau = calibrate(np.asarray(obs), draws, alpha, smax)
    return {"value": obs, "pvalue": float(p), "threshold": float(tau), "calibrated": float(cal)}
