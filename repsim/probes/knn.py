"""The kNN probe (Table 1): cosine-similarity k-nearest neighbours on fixed features.

k is chosen by leave-one-out accuracy on the training set; top-k is computed chunk by chunk (never an
N×N matrix). Ties: the smallest best k; vote ties go to the class of the nearest neighbour among the
tied classes; neighbours are ordered by decreasing similarity, then increasing training index.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from repsim._xp import array_namespace, to_numpy
from repsim.probes._common import METRICS, ProbeResult, _check_xy, accuracy


DEFAULT_KS = (1, 3, 5, 10, 20, 50, 100)


def _normalise_rows(X: Any, xp: Any) -> Any:
    dt = xp.float64 if X.dtype == xp.float64 else xp.float32
    X = xp.astype(X, dt)
    norms = xp.sqrt(xp.sum(X * X, axis=1, keepdims=True))
    return X / xp.where(norms > 0, norms, xp.ones_like(norms))


def knn_neighbours(Q: Any, X: Any, k: int, *, exclude_self: bool = False,
                   chunk_bytes: int = 128 * 2**20) -> tuple[np.ndarray, np.ndarray]:
    """Indices (M, k) and cosine similarities (M, k) of each query row's k nearest rows of X, in
    decreasing similarity (ties: increasing index). ``exclude_self``: Q is X and row i never counts
    itself (leave-one-out). Memory: one (chunk, N) similarity block, chunk chosen from ``chunk_bytes``.
    Zero rows have similarity 0 to everything."""
    xp = array_namespace(Q, X)
    Qn, Xn = _normalise_rows(Q, xp), _normalise_rows(X, xp)
    m, n = Qn.shape[0], Xn.shape[0]
    if k > n - int(exclude_self):
        raise ValueError(f"k={k} needs at least {k + int(exclude_self)} training rows, have {n}")
    itemsize = 8 if Xn.dtype == xp.float64 else 4
    chunk = max(1, min(m, chunk_bytes // (4 * itemsize * max(n, 1))))
    XnT = xp.permute_dims(Xn, (1, 0))
    cols = xp.arange(n)
    idx_out = np.empty((m, k), dtype=np.int64)
    sim_out = np.empty((m, k), dtype=np.float64)
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        S = xp.matmul(Qn[start:stop, ...], XnT)
        if exclude_self:
            rows = xp.arange(start, stop)
            S = xp.where(rows[:, None] == cols[None, :], xp.asarray(-xp.inf, dtype=S.dtype), S)
        if xp is np:
            part = np.argpartition(-S, k - 1, axis=1)[:, :k]
        else:
            part = xp.argsort(-S, axis=1, stable=True)[:, :k]
        cand_sim = np.asarray(to_numpy(xp.take_along_axis(S, part, axis=1)), dtype=np.float64)
        part = np.asarray(to_numpy(part))
        o = np.lexsort((part, -cand_sim), axis=1)
        idx_out[start:stop] = np.take_along_axis(part, o, axis=1)
        sim_out[start:stop] = np.take_along_axis(cand_sim, o, axis=1)
    return idx_out, sim_out


def knn_vote(neighbour_labels: np.ndarray, ks: Sequence[int], n_classes: int) -> dict[int, np.ndarray]:
    """Predictions for every k in ``ks`` from labels of neighbours sorted nearest first (M, kmax).

    One vote per neighbour; among classes with the most votes, the class of the nearest neighbour wins.
    """
    L = np.asarray(neighbour_labels)
    m, kmax = L.shape
    rows = np.arange(m)
    counts = np.zeros((m, n_classes), dtype=np.int64)
    first = np.full((m, n_classes), kmax, dtype=np.int64)
    out: dict[int, np.ndarray] = {}
    want = set(int(k) for k in ks)
    for j in range(kmax):
        c = L[:, j]
        counts[rows, c] += 1
        first[rows, c] = np.minimum(first[rows, c], j)
        if j + 1 in want:
            out[j + 1] = np.argmax(counts * (kmax + 1) - first, axis=1)
    return out


def knn_probe(X_train: Any, y_train: Any, X_test: Any, y_test: Any,
              ks: Sequence[int] = DEFAULT_KS, metric: str = "top1", *,
              chunk_bytes: int = 128 * 2**20) -> ProbeResult:
    """Cosine kNN probe (Table 1): k from ``ks`` by leave-one-out ``metric`` on the training set
    (each training example classified by its k nearest *other* training examples), then the test set
    classified with that k against the whole training set. ``curve`` = {k: LOO metric}."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    X_train, y_train = _check_xy(X_train, y_train, "X_train")
    X_test, y_test = _check_xy(X_test, y_test, "X_test")
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_train has {X_train.shape[1]} features but X_test has {X_test.shape[1]}")
    n = X_train.shape[0]
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    usable = [k for k in ks if k <= n - 1]
    if not usable:
        raise ValueError(f"no k in {ks} is below the number of training examples ({n})")
    classes, y_idx = np.unique(y_train, return_inverse=True)
    t0 = time.perf_counter()
    nb, _ = knn_neighbours(X_train, X_train, usable[-1], exclude_self=True, chunk_bytes=chunk_bytes)
    votes = knn_vote(y_idx[nb], usable, classes.size)
    curve = {k: accuracy(y_idx, votes[k], metric) for k in usable}
    best = max(usable, key=lambda k: (curve[k], -k))
    nb_test, _ = knn_neighbours(X_test, X_train, best, chunk_bytes=chunk_bytes)
    pred = classes[knn_vote(y_idx[nb_test], [best], classes.size)[best]]
    return ProbeResult(probe="knn", metric=metric, accuracy=accuracy(y_test, pred, metric),
                       best_param=int(best), curve=curve, predictions=pred, classes=classes,
                       info={"seconds": time.perf_counter() - t0, "skipped_ks": [k for k in ks
                                                                                 if k not in usable]})
