"""All pairs of one measure's exact estimator on in-memory columns, and the one-pair convenience
:func:`similarity`; undefined columns and pairs become NaN, reported (not raised)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from repsim.array_api import to_numpy
from repsim.kernels.measures._protocol import FullColumn, Measure, shift_dots, source_eps


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
                 keep_prepared: bool = False) -> ExactOutcome:
    """m(column i, column j) for every pair (row = first argument): each column prepared once, then
    the upper triangle (symmetric measures) or every ordered pair, a row at a time
    (``Measure.pairs``: stacked LAPACK calls where a measure batches them).  The pairs are
    independent: rows of them run on the BLAS thread budget's k threads
    (:func:`repsim.blas.blas_thread_split`, each single-threaded BLAS/LAPACK, which release the GIL
    for stacked calls), so the result does not depend on k."""
    L = len(columns)
    prepared = []
    for c in columns:
        prepared.append(measure.prepare(c))
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


def similarity(X: Any, Y: Any, measure: str | Measure = "linear_cka", **options: Any) -> float:
    """One measure's exact value for two in-memory representations X (n, ...) and Y (n, ...)
    (row = X for asymmetric measures); NaN when undefined."""
    from repsim.kernels.measures import check_options, get_measure

    if isinstance(measure, str):
        check_options([measure], options)
        m = get_measure(measure, **options)
    elif options:
        raise ValueError(f"options {sorted(options)} given with a Measure object: set them when building it")
    else:
        m = measure
    a, b = full_column(X, "X"), full_column(Y, "Y")
    if a.n != b.n:
        raise ValueError(f"X has {a.n} examples and Y {b.n}: a similarity compares the same examples")
    pa, pb = m.prepare(a), m.prepare(b)
    return math.nan if pa is None or pb is None else float(m.pair(pa, pb))
