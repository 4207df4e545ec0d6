"""The results files' columns, declared once (docs/architecture.md "Results files").

Writers pass their rows through :func:`conform` (which orders them by the declaration and refuses a
column it does not list) and write them with :func:`write_csv`, or :func:`merge_csv` into an existing
file (by the file's :data:`KEYS`, under :func:`results_lock`, so that writers in other processes take
turns); readers take column names from here. ``tests/test_results_columns.py`` fails when a writer or
reader spells out a results file's columns anywhere else. Torch-free, and numpy only inside
:func:`merge_npz` (the base layer: kernels, engine, probes, commands and the stages above all import it).
"""
from __future__ import annotations

import csv
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Mapping, Sequence

from repsim.fileio import atomic_write

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


# ---------------------------------------------------------------- reading and writing results files
_MERGE_LOCK = threading.Lock()  # fcntl locks belong to a process: its threads are kept apart by this


@contextmanager
def results_lock(path: str):
    """Hold an exclusive lock on results file ``path`` for a read-merge-replace: a blocking
    ``flock`` of ``<dir>/.<name>.lock`` (left in place; the kernel releases the lock with its holder),
    so that writers in other processes (a job array of ``repsim probe`` runs sharing one probes.csv)
    wait their turn instead of each replacing the file with its own merge of the old rows. Where the
    lock file cannot be made (a read-only directory, no ``fcntl``), only this process's threads are
    kept apart."""
    head, name = os.path.split(os.path.abspath(path))
    with _MERGE_LOCK:
        try:
            import fcntl

            fd = os.open(os.path.join(head, f".{name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (ImportError, OSError):
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: proceed as before
                pass
            yield
        finally:
            os.close(fd)


def merge_csv(rows: Sequence[dict], path: str | os.PathLike, key: Sequence[str], *, unique: bool = False) -> str:
    """Merge ``rows`` into the CSV at ``path`` (atomically, under :func:`results_lock`): existing rows
    whose ``key`` columns equal those of a new row are replaced, the others kept, new rows last. A
    missing file is created. ``unique``: the key names one result, and two new rows with the same key
    (results no reader could tell apart) raise ValueError (else a key may cover several rows, e.g. a
    training run's per-epoch rows, replaced together)."""
    path = os.fspath(path)
    if path == "-":
        return write_csv(rows, path)
    keyed = [tuple(str(r.get(k, "")) for k in key) for r in rows]
    if unique and len(set(keyed)) < len(keyed):
        dup = next(k for k in keyed if keyed.count(k) > 1)
        raise ValueError(f"{os.path.basename(path)}: two results with the same {', '.join(key)} "
                         f"({', '.join(dup)}); give the stores different names")
    new_keys = set(keyed)
    with results_lock(path):
        old: list[dict] = []
        if os.path.isfile(path):
            with open(path, newline="") as fh:
                old = list(csv.DictReader(fh))
        kept = [r for r in old if tuple(str(r.get(k, "")) for k in key) not in new_keys]
        return write_csv(kept + list(rows), path)


def merge_npz(arrays: Mapping[str, Any], path: str | os.PathLike) -> str:
    """Merge named ``arrays`` into the .npz at ``path`` (``.npz`` appended when missing, as ``numpy.savez``
    does; atomically, under :func:`results_lock`): an existing array of the same name is replaced, the
    others kept (spectra.npz, keyed by store/layer/kind)."""
    import numpy as np

    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    with results_lock(path):
        kept = {}
        if os.path.isfile(path):
            with np.load(path) as old:
                kept = {k: old[k] for k in old.files}
        with atomic_write(path) as fh:
            np.savez(fh, **{**kept, **{k: np.asarray(v) for k, v in arrays.items()}})
    return path


def write_csv(rows: Sequence[dict], path: str | os.PathLike) -> str:
    """Write rows (header = union of keys in first-seen order) atomically; ``-`` writes to stdout."""
    header: list[str] = []
    for row in rows:
        header.extend(k for k in row if k not in header)
    if os.fspath(path) == "-":
        writer = csv.DictWriter(sys.stdout, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
        return "-"
    path = os.fspath(path)
    with atomic_write(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


__all__ = ["COLUMNS", "KEYS", "PARAMETERS", "ESTIMATOR", "COLLAPSE_KEYS", "columns", "conform", "merge_csv",
           "merge_npz", "results_lock", "write_csv"]
