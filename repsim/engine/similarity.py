"""The exact estimators of the similarity measures, streamed from stores (the ``exact`` half of
:func:`repsim.engine.minibatch.similarity_matrix`).

Linear CKA keeps its own streamed all-pairs route (:mod:`repsim.engine.exact`: cross-covariances or
n × n Gram panels, chosen by FLOPs), registered in :data:`STREAMED_EXACT`; every other measure reads
each column once into a :class:`~repsim.kernels.measures.FullColumn` (:mod:`repsim.engine.full`:
rows when p <= n, else the n × n Gram) and runs its ``prepare``/``pair`` over all pairs
(:func:`repsim.kernels.measures.exact.exact_matrix`).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from repsim.engine.blocks import Column, progress_bar
from repsim.engine.full import full_columns, read_passes
from repsim.engine.options import StreamOptions
from repsim.kernels.measures import Measure
from repsim.kernels.measures.exact import exact_matrix

KIND = "similarity"  # the default memory budget of these runs (repsim.engine.options.DEFAULT_BUDGETS)


def _linear_cka_exact(measure: Measure, columns: Sequence[Column], n: int, block_rows: int, *, spatial: str,
                      xp: Any, stream: StreamOptions, meta: dict[str, Any]) -> np.ndarray:
    from repsim.engine.exact import exact_cka

    values, plan_info = exact_cka(columns, n, block_rows, debiased=bool(measure.options["debiased"]),
                                  spatial=spatial, xp=xp, panel_bytes=stream.panel(KIND),
                                  max_bytes=stream.budget(KIND), prefetch=int(stream.read_ahead),
                                  threads=int(stream.threads or 2), progress=stream.progress)
    meta.update(plan_info)
    report_undefined(values, columns, meta, measure)
    return values


def report_undefined(values: np.ndarray, columns: Sequence[Column], meta: dict[str, Any], measure: Measure,
                      bad: Sequence[str] | None = None) -> None:
    """Columns a measure cannot define (constant over the examples, or the measure's own conditions:
    :meth:`Measure.undefined_when`; NaN row and column, every other pair is computed): one line on
    stderr naming them and saying when that happens, and ``meta["undefined_columns"]`` (linear CKA)
    or ``meta["undefined"][measure]["columns"]``.  ``bad``: the undefined columns' names when the
    measure says which (default: those with a NaN diagonal)."""
    if bad is None:
        bad = [f"{c.store}/{c.layer}" for k, c in enumerate(columns) if np.isnan(values[k, k])]
    bad = list(bad)
    if not bad:
        return
    name = measure.name
    if name == "linear_cka":
        meta["undefined_columns"] = bad
    meta.setdefault("undefined", {}).setdefault(name, {})["columns"] = bad
    what = "CKA" if name == "linear_cka" else name
    print(f"repsim: {what} is undefined (NaN, blank in figures) for {len(bad)} column(s): "
          f"{', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}; a column has no {what} when it is {measure.undefined_when()}",
          file=sys.stderr)


# measures whose exact estimator streams all pairs itself instead of holding full columns
STREAMED_EXACT: dict[str, Callable[..., np.ndarray]] = {"linear_cka": _linear_cka_exact}


def report_pairs(measure: str, pairs: Sequence[tuple[str, str]], meta: dict[str, Any]) -> None:
    """Pairs a measure could not define (e.g. CCA with too few rows): one line on stderr and
    ``meta["undefined"][measure]["pairs"]``."""
    if not pairs:
        return
    meta.setdefault("undefined", {}).setdefault(measure, {})["pairs"] = [list(p) for p in pairs]
    shown = ", ".join(f"({a}, {b})" for a, b in pairs[:6])
    print(f"repsim: {measure} is undefined (NaN, blank in figures) for {len(pairs)} pair(s): {shown}"
          f"{' ...' if len(pairs) > 6 else ''} — e.g. CCA needs more examples than the two ranks together",
          file=sys.stderr)


def exact_measures(measures: Sequence[Measure], columns: Sequence[Column], n: int, block_rows: int, *,
                   spatial: str, xp: Any, stream: StreamOptions, meta: dict[str, Any],
                   null: dict[str, Any] | None = None, calibration: dict[str, Any] | None = None,
                   jackknife: dict[str, Any] | None = None, replicates: dict[str, np.ndarray] | None = None
                   ) -> dict[str, np.ndarray]:
    """``{measure name: (L, L) values}`` of each measure's exact estimator on the full data. ``stream``:
    the run's options (reader threads resolved); its memory budget bounds what the estimators hold, a
    share of it sizes their read panels (:mod:`repsim.engine.options`).  With a ``null``
    (:func:`repsim.engine.calibration.null_request`) every measure runs on held columns (linear CKA too:
    its nulls are products of the n × n Grams) and ``calibration[name]`` receives its arrays
    (:func:`repsim.engine.calibration.exact_calibration`).  With ``jackknife`` (``{"groups": G, "seed": S}``)
    every measure runs on held columns too and ``replicates[name]`` receives its (G, L, L) delete-a-group
    replicates (:mod:`repsim.kernels.jackknife`: G more exact passes over the held columns)."""
    out: dict[str, np.ndarray] = {}
    progress, panel, threads = stream.progress, stream.panel(KIND), int(stream.threads or 2)
    held = [m for m in measures if m.name not in STREAMED_EXACT or null is not None or jackknife is not None]
    for m in measures:
        if m.name in STREAMED_EXACT and m not in held:
            out[m.name] = STREAMED_EXACT[m.name](m, columns, n, block_rows, spatial=spatial, xp=xp, stream=stream,
                                                 meta=meta)
    if held:
        bar = progress_bar(read_passes(columns, n, block_rows, spatial, panel), "read", progress, unit="block")
        try:
            full = full_columns(columns, n, block_rows, spatial=spatial, panel_bytes=panel,
                                max_bytes=stream.budget(KIND), prefetch=int(stream.read_ahead), threads=threads,
                                bar=bar)
        finally:
            bar.close()
        for m in held:
            bar = progress_bar(len(full), m.name, progress, unit="column")
            try:
                outcome = exact_matrix(m, full, bar.update, keep_prepared=null is not None)
            finally:
                bar.close()
            out[m.name] = outcome.values
            if null is not None and calibration is not None:
                from repsim.engine.calibration import exact_calibration

                what = "analytic null" if null["kind"] == "analytic" else f"null ({null['permutations']} draws)"
                bar = progress_bar(len(full), f"{m.name} {what}", progress, unit="column")
                try:
                    calibration[m.name] = exact_calibration(m, outcome.prepared, outcome.values, n, null, bar.update)
                finally:
                    bar.close()
                outcome.prepared = None
            if jackknife is not None and replicates is not None:
                from repsim.kernels.jackknife import jackknife_replicates

                G = int(jackknife["groups"])
                bar = progress_bar(G, f"{m.name} jackknife", progress, unit="replicate")
                try:
                    replicates[m.name] = jackknife_replicates(m, full, G, int(jackknife["seed"]), bar.update)
                finally:
                    bar.close()
            meta["measure_info"][m.name].update(m.exact_info(n))
            report_undefined(outcome.values, columns, meta, m, outcome.undefined_columns)
            report_pairs(m.name, outcome.undefined_pairs, meta)
    return out
