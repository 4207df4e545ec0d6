"""What every probe shares: :class:`ProbeResult`, accuracy metrics, the stratified validation split,
and input checks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repsim.array_api import array_namespace, as_array, asarray_like, to_numpy


METRICS = ("top1", "mean_per_class")


@dataclass
class ProbeResult:
    """Outcome of one probe.

    ``accuracy``: test metric; ``best_param``: chosen λ (linear) or k (knn); ``curve``: {param:
    validation (linear) or leave-one-out (knn) metric}; ``predictions``: test predictions in the
    original label values; ``coef_`` (K, P) and ``intercept_`` (K,) for the linear probe (original
    feature space, float64); ``info``: timings, iteration counts, solver messages, and for the linear
    probe the counts of (N×P)·(P×K)-sized products (``products_sweep``, ``products_refit``, the
    solver's cost unit) and of line-search trials (elementwise work only).
    """

    probe: str
    metric: str
    accuracy: float
    best_param: float
    curve: dict
    predictions: np.ndarray
    classes: np.ndarray
    coef_: np.ndarray | None = None
    intercept_: np.ndarray | None = None
    info: dict = field(default_factory=dict)

    @property
    def best_lambda(self) -> float:
        if self.probe != "linear":
            raise AttributeError("best_lambda is defined for linear probes only")
        return float(self.best_param)

    @property
    def best_k(self) -> int:
        if self.probe != "knn":
            raise AttributeError("best_k is defined for kNN probes only")
        return int(self.best_param)

    def __repr__(self) -> str:
        """One line: the probe, its test metric, the chosen λ or k within its grid, the classes and the
        weights' shape (the predictions, weights and validation curve stay attributes)."""
        grid = sorted(self.curve)
        name = "λ" if self.probe == "linear" else "k"
        where = ""
        if len(grid) > 1:
            edge = " (at the grid's edge)" if self.best_param in (grid[0], grid[-1]) else ""
            where = f" of {len(grid)} from {grid[0]:g} to {grid[-1]:g}{edge}"
        coef = f", coef_ {tuple(self.coef_.shape)}" if self.coef_ is not None else ""
        return (f"ProbeResult({self.probe}: {self.metric} {self.accuracy:.4f} on {len(self.predictions)} test "
                f"examples; {name} = {self.best_param:g}{where}; {len(self.classes)} classes{coef})")

    def to_dict(self) -> dict:
        """JSON-ready summary (no weights, no predictions)."""
        return {"probe": self.probe, "metric": self.metric, "accuracy": self.accuracy,
                "best_param": self.best_param,
                "curve": {repr(float(k)): float(v) for k, v in self.curve.items()},
                "info": {k: v for k, v in self.info.items() if _jsonable(v)}}


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, list, dict)) or v is None


# ------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------

def accuracy(y_true: np.ndarray, y_pred: np.ndarray, metric: str = "top1") -> float:
    """Top-1 accuracy, or the mean over the classes present in ``y_true`` of per-class recall."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if metric == "top1":
        return float(np.mean(y_true == y_pred)) if y_true.size else float("nan")
    if metric == "mean_per_class":
        classes = np.unique(y_true)
        return float(np.mean([np.mean(y_pred[y_true == c] == c) for c in classes]))
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train_idx, val_idx): per class, ``round(val_fraction·n_c)`` random examples go to
    validation (at least one when the class has ≥ 2 examples, never all of them)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    val = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        if idx.size < 2:
            continue
        n_val = min(max(int(round(val_fraction * idx.size)), 1), idx.size - 1)
        val.append(rng.permutation(idx)[:n_val])
    val_idx = np.sort(np.concatenate(val)) if val else np.zeros(0, dtype=np.int64)
    train_mask = np.ones(labels.size, dtype=bool)
    train_mask[val_idx] = False
    return np.flatnonzero(train_mask), val_idx


def _as_2d(X: Any, name: str) -> Any:
    X = as_array(X)
    if X.ndim < 2:
        raise ValueError(f"{name} must have shape (N, features...), got {tuple(X.shape)}")
    if X.ndim > 2:
        xp = array_namespace(X)
        X = xp.reshape(X, (X.shape[0], -1))
    return X


def _take_rows(X: Any, idx: np.ndarray, xp: Any) -> Any:
    return X[idx] if xp is np else xp.take(X, asarray_like(idx, X, xp), axis=0)


def _check_xy(X: Any, y: Any, name: str) -> tuple[Any, np.ndarray]:
    X = _as_2d(X, name)
    y = np.asarray(to_numpy(y))
    if y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{name} has {X.shape[0]} rows but its labels have shape {y.shape}")
    xp = array_namespace(X)
    if not bool(xp.all(xp.isfinite(X))):
        raise ValueError(f"{name} contains NaN or inf")
    return X, y



def _progress_fn(enabled: bool, desc: str):
    """A tqdm wrapper when ``enabled`` and stderr is a terminal, else None."""
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return lambda it: tqdm(it, desc=desc, leave=False)
