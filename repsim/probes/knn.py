"""The kNN probe (Table 1): cosine-similarity k-nearest neighbours on fixed features.

k is chosen by leave-one-out accuracy on the training set; top-k is computed chunk by chunk (never an
N×N matrix). :func:`knn_probe_rows` is the same probe out of core: the exact search streams the
training rows (a store's chunks) against one block of queries at a time and keeps a running top-k
per query (merged by similarity, then index), so memory is O(query block × (P + train block + k)),
never the (n, P) features nor an (n, k) neighbour table. Ties: the smallest best k; vote ties go to the class of the nearest neighbour among the
tied classes; neighbours are the k first in the order (decreasing similarity, increasing training
index) — one rule (:func:`top_k`) for both searches, so they find the same neighbours, k and
accuracy, ties included.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, asarray_like, on_device, to_numpy
from repsim.probes._common import METRICS, ProbeResult, _check_xy, accuracy
from repsim.probes.rows import Rows


DEFAULT_KS = (1, 3, 5, 10, 20, 50, 100)


def _normalise_rows(X: Any, xp: Any) -> Any:
    dt = xp.float64 if X.dtype == xp.float64 else xp.float32
    X = xp.astype(X, dt)
    norms = xp.sqrt(xp.sum(X * X, axis=1, keepdims=True))
    return X / xp.where(norms > 0, norms, xp.ones_like(norms))


SIM_TILE = 4096  # training rows per float64 product tile of :func:`similarities`


def similarities(Qn: np.ndarray, Xn: np.ndarray) -> np.ndarray:
    """Cosine similarities (m, n) float32 of normalised rows, the same numbers whatever the shapes
    of the blocks they are computed in: the products of float32 values are exact in float64 and their
    float64 sums are far below float32's rounding, so float32(Σ in float64) does not depend on how a
    BLAS tiles the product (float32 products did: a tie between two training rows in one search was
    an ulp apart in the other). Computed in tiles of :data:`SIM_TILE` training rows."""
    Q = np.asarray(Qn, dtype=np.float64)
    out = np.empty((Q.shape[0], Xn.shape[0]), dtype=np.float32)
    for j in range(0, Xn.shape[0], SIM_TILE):
        out[:, j:j + SIM_TILE] = Q @ np.asarray(Xn[j:j + SIM_TILE], dtype=np.float64).T
    return out


def top_k(S: np.ndarray, k: int) -> np.ndarray:
    """Columns (m, k) of each row's k largest entries of ``S`` (m, n), unordered, chosen by the one
    rule of both searches: larger first, and among equal values the smaller column (what a stable
    sort of −S keeps). ``argpartition`` alone takes any of the values tied at the k-th place (a sparse
    ReLU layer has many), so the in-memory and the streamed search disagreed on them (k = 100 against
    20, accuracy 0.403 against 0.353); the rows with such a tie are re-selected by a stable sort."""
    m, n = S.shape
    if k >= n:
        return np.broadcast_to(np.arange(n), (m, n)).copy()
    part = np.argpartition(-S, k - 1, axis=1)[:, :k]
    kth = np.take_along_axis(S, part, axis=1).min(axis=1, keepdims=True)
    tied = np.flatnonzero(np.count_nonzero(S >= kth, axis=1) > k)  # more candidates than places: choose
    if tied.size:
        part[tied] = np.argsort(-S[tied], axis=1, kind="stable")[:, :k]
    return part


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
    cols = on_device(xp.arange, n, device=getattr(Xn, "device", None))
    idx_out = np.empty((m, k), dtype=np.int64)
    sim_out = np.empty((m, k), dtype=np.float64)
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        S = similarities(Qn[start:stop], Xn) if xp is np else xp.matmul(Qn[start:stop, ...], XnT)
        if exclude_self:
            rows = on_device(xp.arange, start, stop, device=getattr(Xn, "device", None))
            S = xp.where(rows[:, None] == cols[None, :], asarray_like(-xp.inf, S, xp, S.dtype), S)
        if xp is np:
            part = top_k(S, k)
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
              chunk_bytes: int = 128 * 2**20, streamed: bool = False) -> ProbeResult:
    """Cosine kNN probe (Table 1): k from ``ks`` by leave-one-out ``metric`` on the training set
    (each training example classified by its k nearest *other* training examples), then the test set
    classified with that k against the whole training set. ``curve`` = {k: LOO metric}.
    ``streamed=True``: the out-of-core search of :func:`knn_probe_rows` over the arrays' row blocks."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    X_train, y_train = _check_xy(X_train, y_train, "X_train")
    X_test, y_test = _check_xy(X_test, y_test, "X_test")
    if X_test.shape[1] != X_train.shape[1]:
        raise ValueError(f"X_train has {X_train.shape[1]} features but X_test has {X_test.shape[1]}")
    if streamed:
        return knn_probe_rows(Rows.from_array(to_numpy(X_train)), y_train, Rows.from_array(to_numpy(X_test)),
                              y_test, ks=ks, metric=metric)
    n = X_train.shape[0]
    usable, ks = _usable_ks(ks, n)
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


def _usable_ks(ks: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """(the ks below n, all ks sorted); refuses an empty or non-positive grid."""
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks}")
    usable = [k for k in ks if k <= n - 1]
    if not usable:
        raise ValueError(f"no k in {ks} is below the number of training examples ({n})")
    return usable, ks


QUERY_BYTES = 16 << 20  # similarity block (queries × training block, float32) of the out-of-core search


def knn_search_rows(queries: Rows, q_select: np.ndarray, train: Rows, t_select: np.ndarray, k: int, *,
                    exclude_self: bool = False, query_bytes: int | None = None):
    """Yield ``(q0, q1, idx (m, k), sim (m, k))`` for consecutive blocks of the queries ``q_select``:
    each query's k most cosine-similar rows among ``t_select`` of ``train`` (indices are positions in
    ``t_select``), in decreasing similarity, ties by increasing index. ``exclude_self``: queries and
    training rows are the same selection and position i never counts itself (leave-one-out).

    Per query block of m rows (m·(training block rows)·4 bytes ≈ ``query_bytes``): one pass over
    the training blocks, each giving S = Q̂ X̂ᵀ (rows normalised), its top-k (:func:`top_k`),
    merged with the running top-k by the (−similarity, index) order."""
    n = int(np.asarray(t_select).size)
    if k > n - int(exclude_self):
        raise ValueError(f"k={k} needs at least {k + int(exclude_self)} training rows, have {n}")
    q_select = np.asarray(q_select, dtype=np.int64)
    m = max(1, int(query_bytes or QUERY_BYTES) // (4 * max(1, train.block_rows)))
    for q0 in range(0, q_select.size, m):
        sel = q_select[q0:q0 + m]
        Q = np.empty((sel.size, queries.p), dtype=np.float64 if queries.dtype == np.float64 else np.float32)
        for pos, X in queries.blocks(sel):
            Q[pos] = X
            del X
        Qn = _normalise_rows(Q, np)
        del Q
        best_i = np.zeros((sel.size, 0), dtype=np.int64)
        best_s = np.zeros((sel.size, 0), dtype=np.float64)
        for pos, X in train.blocks(t_select):
            cols = np.arange(n)[pos]
            S = similarities(Qn, _normalise_rows(X, np))
            if exclude_self:
                S[np.arange(q0, q0 + sel.size)[:, None] == cols[None, :]] = -np.inf
            part = top_k(S, min(k, S.shape[1]))
            cand_s = np.concatenate([best_s, np.take_along_axis(S, part, axis=1).astype(np.float64)], axis=1)
            cand_i = np.concatenate([best_i, cols[part]], axis=1)
            o = np.lexsort((cand_i, -cand_s), axis=1)[:, :k]
            best_i, best_s = np.take_along_axis(cand_i, o, axis=1), np.take_along_axis(cand_s, o, axis=1)
            del X, S, part  # before the next block is read
        yield q0, q0 + sel.size, best_i, best_s


def knn_probe_rows(train: Rows, y_train: Any, test: Rows, y_test: Any, ks: Sequence[int] = DEFAULT_KS,
                   metric: str = "top1", *, train_select: np.ndarray | None = None,
                   test_select: np.ndarray | None = None, query_bytes: int | None = None) -> ProbeResult:
    """:func:`knn_probe` out of core (module doc): features are :class:`repsim.probes.rows.Rows`, rows
    ``train_select`` / ``test_select`` (default all; labels for those rows, in that order). The same
    neighbours as the in-memory search, ties at the k-th place included (both keep the smallest
    training indices: :func:`top_k`), so the same k and accuracy."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if train.p != test.p:
        raise ValueError(f"X_train has {train.p} features but X_test has {test.p}")
    tr_sel = np.arange(train.n) if train_select is None else np.asarray(train_select, dtype=np.int64)
    te_sel = np.arange(test.n) if test_select is None else np.asarray(test_select, dtype=np.int64)
    y_train, y_test = np.asarray(to_numpy(y_train)), np.asarray(to_numpy(y_test))
    usable, ks = _usable_ks(ks, tr_sel.size)
    classes, y_idx = np.unique(y_train, return_inverse=True)
    t0 = time.perf_counter()
    loo = np.empty((len(usable), tr_sel.size), dtype=np.int64)
    for q0, q1, nb, _ in knn_search_rows(train, tr_sel, train, tr_sel, usable[-1], exclude_self=True,
                                         query_bytes=query_bytes):
        votes = knn_vote(y_idx[nb], usable, classes.size)
        for j, k in enumerate(usable):
            loo[j, q0:q1] = votes[k]
    curve = {k: accuracy(y_idx, loo[j], metric) for j, k in enumerate(usable)}
    del loo
    best = max(usable, key=lambda k: (curve[k], -k))
    pred = np.empty(te_sel.size, dtype=np.int64)
    for q0, q1, nb, _ in knn_search_rows(test, te_sel, train, tr_sel, best, query_bytes=query_bytes):
        pred[q0:q1] = knn_vote(y_idx[nb], [best], classes.size)[best]
    pred = classes[pred]
    return ProbeResult(probe="knn", metric=metric, accuracy=accuracy(y_test, pred, metric),
                       best_param=int(best), curve=curve, predictions=pred, classes=classes,
                       info={"seconds": time.perf_counter() - t0, "streamed": True,
                             "skipped_ks": [k for k in ks if k not in usable]})
