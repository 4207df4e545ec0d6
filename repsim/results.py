"""The results files' columns, declared once (docs/architecture.md "Results files").

Writers pass their rows through :func:`conform` (which orders them by the declaration and refuses a
column it does not list); readers take column names from here. ``tests/test_results_columns.py`` fails
when a writer or reader spells out a results file's columns anywhere else. Torch- and numpy-free (the
base layer: kernels, engine, probes, commands and the stages above all import it).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

# Table E.2's neural-collapse statistics: the kernel's result keys and collapse.csv's metric columns
COLLAPSE_KEYS: tuple[str, ...] = ("norm_cv_means", "norm_cv_weights", "cos_std_means", "cos_std_weights",
                                  "equiangular_means", "equiangular_weights", "self_duality", "nc1")

# "M", the estimator metadata the per-layer metrics end with (``repsim.engine.drivers.estimator_columns``)
ESTIMATOR: tuple[str, ...] = ("dataset", "split", "n", "spatial", "method", "engine_spatial")

_NETWORK = ("store", "objective", "seed")
# a retrained network's columns in tune.csv and finetune.csv (``repsim.train.tune.tune``)
_TUNED = ("metric", "accuracy", "top1", "top5", "mean_per_class", "holdout_accuracy", "select_on", "selected",
          "selected_epoch", "epochs_trained", "steps", "grid_points", "replicates", "checkpoint", "run")

COLUMNS: dict[str, tuple[str, ...]] = {
    "separation": (*_NETWORK, "layer", "distance", "r2", *ESTIMATOR),
    "sparsity": (*_NETWORK, "layer", "nonzero_fraction", *ESTIMATOR),
    "collapse": (*_NETWORK, "layer", *COLLAPSE_KEYS, *ESTIMATOR),
    "probes": (*_NETWORK, "task", "probe", "metric", "accuracy", "best_param", "layer", "split", "n",
               "train_split", "train_n", "spatial", "protocol", "val_fraction", "n_lambdas", "estimator_seed"),
    "multilabel": (*_NETWORK, "task", "split", "target", "auc", "best_lambda", "layer", "n", "train_split",
                   "train_n", "positives", "spatial", "bins", "val_fraction", "n_lambdas", "estimator_seed"),
    "calibration": (*_NETWORK, "kind", "top1", "nll", "ece", "temperature", "nll_ts", "ece_ts", "holdout_top1",
                    "dataset", "split", "n", "holdout_store", "holdout_split", "holdout_n", "bins"),
    "training": ("store", "objective", "params", "variant", "seed", "epoch", "split", "top1", "top5",
                 "mean_per_class", "preset", "schedule_decay", "mixup_alpha", "epochs_trained", "run"),
    "accuracy": (*_NETWORK, "epoch", "dataset", "split", "n", "top1", "top5", "mean_per_class"),
    "robustness": (*_NETWORK, "checkpoint_sha256", "checkpoint", "benchmark", "subset", "metric", "value", "n",
                   "classes", "masked", "transform"),
    # repsim.train.tune: the group's and replicate's info, then the retrained network's scores (``tune``'s rows;
    # finetune adds the selected point's lr and weight_decay); OUT/results.csv holds the same rows
    "tune": ("preset", "objective", "params", "variant", "grid", "seed", *_TUNED),
    "finetune": ("objective", "params", "variant", "task", "preset", "seed", "source_checkpoint", *_TUNED,
                 "lr", "weight_decay"),
    # OUT/<group>/grid.csv: one row per grid run; the grid point's parameters (which vary with the grid)
    # go at PARAMETERS["grid"], between replicate and last_epoch
    "grid": ("point", "replicate", "last_epoch", "holdout_last", "holdout_best", "best_epoch", "run"),
}

# files with columns that vary from run to run (a grid's parameters): the position in COLUMNS[name] at
# which ``conform(name, rows, parameters=...)`` puts them, in the order given
PARAMETERS: dict[str, int] = {"grid": 2}

# the columns by which new rows replace old ones when a command merges into an existing file (a probe of
# another layer or on another split is another result: both are kept, and readers choose)
KEYS: dict[str, tuple[str, ...]] = {
    "separation": ("store", "objective", "seed", "layer", "distance", "dataset", "split", "engine_spatial"),
    "sparsity": ("store", "objective", "seed", "layer", "dataset", "split", "engine_spatial"),
    "collapse": ("store", "objective", "seed", "layer", "dataset", "split", "engine_spatial"),
    "calibration": ("store", "objective", "seed", "kind", "dataset", "split", "holdout_store"),
    "probes": ("store", "task", "probe", "metric", "layer", "split", "train_split"),
    "multilabel": ("store", "task", "split", "target", "layer", "train_split"),
    "accuracy": ("store", "objective", "seed", "dataset", "split"),
    "robustness": ("store", "checkpoint_sha256", "benchmark", "subset", "metric"),
    "tune": ("preset", "objective", "params", "variant", "seed"),
    "finetune": ("objective", "params", "variant", "seed", "task", "source_checkpoint"),
}


def columns(name: str, parameters: Sequence[str] = ()) -> tuple[str, ...]:
    """Results file ``name``'s columns: :data:`COLUMNS`, with ``parameters`` (a grid's varying parameter
    names) at :data:`PARAMETERS` ``[name]``. ``parameters`` for a file without such columns, or one that
    is also a fixed column, raises ValueError."""
    declared = COLUMNS[name]
    parameters = tuple(parameters)
    if not parameters:
        return declared
    if name not in PARAMETERS:
        raise ValueError(f"{name}.csv has no parameter columns (repsim.results.PARAMETERS)")
    clash = sorted(set(parameters) & set(declared))
    if clash or len(set(parameters)) != len(parameters):
        raise ValueError(f"{name}.csv parameter column(s) {clash or list(parameters)} repeat a column")
    at = PARAMETERS[name]
    return (*declared[:at], *parameters, *declared[at:])


def conform(name: str, rows: Iterable[Mapping], *, fill: bool = False, parameters: Sequence[str] = ()) -> list[dict]:
    """``rows`` of results file ``name`` with their columns in the declared order: every declared column
    (``fill``, missing values blank) or those some row has. A column :data:`COLUMNS` does not declare
    for ``name`` raises ValueError (a writer and the declaration have drifted apart). ``parameters``:
    the varying parameter columns of a file in :data:`PARAMETERS`, named by the writer
    (:func:`columns`)."""
    declared = columns(name, parameters)
    rows = list(rows)
    extra = sorted({k for r in rows for k in r} - set(declared))
    if extra:
        raise ValueError(f"{name}.csv rows have undeclared column(s) {extra} (repsim.results.COLUMNS)")
    present = declared if fill else [c for c in declared if any(c in r for r in rows)]
    return [{c: r.get(c, "") for c in present} for r in rows]


__all__ = ["COLUMNS", "KEYS", "PARAMETERS", "ESTIMATOR", "COLLAPSE_KEYS", "columns", "conform"]
