"""Every column on all n examples, for the exact estimators of the similarity measures
(:class:`~repsim.kernels.measures.FullColumn`).

A column with p <= n is held as its float64 rows (n × p), read in one streamed pass together with
every other such column (each chunk once).  A wider column is held as the n × n Gram of its rows
shifted by the first block's mean m, (X − 1mᵀ)(X − 1mᵀ)ᵀ (float64 products of float64-cast rows; an
uncentred X Xᵀ of rows far from the origin cancels most of its digits when centred), with the shifted
rows' sums and (X − 1mᵀ) m (:class:`~repsim.kernels.measures.FullColumn`), formed panel by panel like the Gram
route of :mod:`repsim.engine.exact`: the rows of a panel (as many blocks as ``panel_bytes`` allows)
times every later block, so ⌈n / panel⌉ reads of that column and never a p × p matrix.  What is held
is n · min(p, n) float64 per column; more than ``max_bytes`` in all (the run's memory budget,
:mod:`repsim.engine.options`) is refused with one line naming what to do.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from repsim.engine.blocks import BlockReader, Column
from repsim.engine.options import format_size
from repsim.kernels.measures import FullColumn, shift_dots, source_eps


def held_bytes(columns: Sequence[Column], n: int, spatial: str) -> int:
    return sum(8 * n * min(c.features_after(spatial), n) for c in columns)


def _narrow(columns: Sequence[Column], names: Sequence[str], n: int, block_rows: int, spatial: str,
            prefetch: int, threads: int, bar: Any) -> list[FullColumn]:
    rows = [np.empty((n, c.features_after(spatial)), dtype=np.float64) for c in columns]
    with BlockReader(columns, n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads) as reader:
        for k, arrays in reader.iter_blocks(range(-(-n // block_rows))):
            a = k * block_rows
            for R, x in zip(rows, arrays):
                R[a:a + x.shape[0]] = np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1)
            bar.update(1)
    return [FullColumn(name, R.shape[1], rows=R, source_eps=source_eps(c.dtype)) for name, R, c in zip(names, rows, columns)]


def _wide(column: Column, name: str, n: int, block_rows: int, spatial: str, panel_bytes: int,
          prefetch: int, threads: int, bar: Any) -> FullColumn:
    p = column.features_after(spatial)
    n_blocks = -(-n // block_rows)
    panel_blocks = max(1, int(panel_bytes // max(1, 8 * p * block_rows)))
    G = np.zeros((n, n))
    sums, dots, dots_c = np.zeros(n), np.zeros(n), np.zeros(n)
    m = None  # the shift: the first block's mean
    with BlockReader([column], n, block_rows, spatial=spatial, prefetch=prefetch, threads=threads) as reader:
        for p0 in range(0, n_blocks, panel_blocks):
            last = min(n_blocks, p0 + panel_blocks) - 1
            a0, parts = p0 * block_rows, []
            for k, (x,) in reader.iter_blocks(range(p0, n_blocks)):
                bar.update(1)
                x = np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1)
                if m is None:
                    m = x.mean(axis=0)
                x = x - m
                r0 = k * block_rows
                if p0 == 0:
                    sums[r0:r0 + x.shape[0]] = x.sum(axis=1)
                    dots[r0:r0 + x.shape[0]], dots_c[r0:r0 + x.shape[0]] = shift_dots(x, m)
                if k <= last:
                    parts.append(x)
                    if k == last:
                        P = np.concatenate(parts) if len(parts) > 1 else parts[0]
                        G[a0:a0 + P.shape[0], a0:a0 + P.shape[0]] = P @ P.T
                    continue
                block = P @ x.T
                G[a0:a0 + P.shape[0], r0:r0 + x.shape[0]] = block
                G[r0:r0 + x.shape[0], a0:a0 + P.shape[0]] = block.T
    return FullColumn(name, p, gram=G, sums=sums, shift=m, shift_dots=dots, shift_dots_c=dots_c,
                      source_eps=source_eps(column.dtype))


def full_columns(columns: Sequence[Column], n: int, block_rows: int, *, spatial: str, panel_bytes: int,
                 max_bytes: int, prefetch: int = 2, threads: int = 2, bar: Any) -> list[FullColumn]:
    """Every column as a :class:`FullColumn` (module docstring), in ``columns`` order."""
    need = held_bytes(columns, n, spatial)
    if need > max_bytes:
        from repsim.kernels.measures import measure_class, measure_names

        minibatch = ", ".join(m for m in measure_names() if "minibatch" in measure_class(m).info.estimators)
        raise ValueError(
            f"the exact measures would hold {format_size(need)} (n · min(p, n) float64 per column, "
            f"{len(columns)} columns, n = {n}) over the limit of {format_size(max_bytes)} (--memory-budget): pool conv maps "
            f"(--spatial mean), compare fewer layers, raise --memory-budget, or use the minibatch measures ({minibatch})")
    names = [f"{c.store}/{c.layer}" for c in columns]
    narrow = [k for k, c in enumerate(columns) if c.features_after(spatial) <= n]
    out: list[FullColumn | None] = [None] * len(columns)
    if narrow:
        for k, col in zip(narrow, _narrow([columns[k] for k in narrow], [names[k] for k in narrow], n, block_rows,
                                          spatial, prefetch, threads, bar)):
            out[k] = col
    for k, c in enumerate(columns):
        if out[k] is None:
            out[k] = _wide(c, names[k], n, block_rows, spatial, panel_bytes, prefetch, threads, bar)
    for col in out:
        if col.rows is not None and not np.all(np.isfinite(col.rows)) or \
                col.gram is not None and not np.all(np.isfinite(col.gram)):
            raise ValueError(f"{col.name} contains NaN or infinite values (or float64 overflow)")
    return out  # type: ignore[return-value]


def read_passes(columns: Sequence[Column], n: int, block_rows: int, spatial: str, panel_bytes: int) -> int:
    """Blocks read by :func:`full_columns` (the progress bar's total)."""
    n_blocks = -(-n // block_rows)
    total = n_blocks if any(c.features_after(spatial) <= n for c in columns) else 0
    for c in columns:
        p = c.features_after(spatial)
        if p > n:
            panel = max(1, int(panel_bytes // max(1, 8 * p * block_rows)))
            total += sum(n_blocks - p0 for p0 in range(0, n_blocks, panel))
    return total
