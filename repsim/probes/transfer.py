"""Transfer analyses beyond the plain probes: relearned heads (Fig. 6) and assignment accuracy (App. F).

- :func:`relearn_head`: Fig. 6. Hold out ``per_class`` examples of every class as the test set, train
  the linear probe of App. A.2 on the rest, and report its accuracy next to the accuracy of the
  network's own final layer (its logits, or ``X W^T + b``) on the same held-out examples.
- :func:`assignment_accuracy`: App. F. From the source network's predictions on the target task's
  training set, the matching matrix ``M[s, t] = #{i: pred_i = s, y_i = t}``; each source class is
  mapped to one target class by ``scipy.optimize.linear_sum_assignment`` on ``−[M, …, M]`` (target
  classes replicated k times so several source classes can share a target), with k = 1, 2, … until
  k + 1 replications no longer increase the matched count. Source classes left unassigned (when
  S > kT) map to nothing and count as errors. Accuracy is that of the mapping on the evaluation set
  (the training set itself unless test predictions are given).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from repsim.probes.linear import DEFAULT_LAMBDAS, linear_probe
from repsim.probes._common import ProbeResult, accuracy
from repsim.probes.rows import Rows


@dataclass
class RelearnResult:
    """Fig. 6 point: relearned-head and original-head accuracy on the same held-out examples."""

    relearned_accuracy: float
    original_accuracy: float
    best_lambda: float
    test_index: np.ndarray
    probe: ProbeResult = field(repr=False)


def heldout_per_class(labels: np.ndarray, per_class: int = 10, seed: int = 0) -> np.ndarray:
    """Sorted indices of ``per_class`` random examples of every class (all of a smaller class but one)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    out = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        take = min(per_class, idx.size - 1)
        if take > 0:
            out.append(rng.permutation(idx)[:take])
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def relearn_head(X: Any, labels: np.ndarray, *, logits: np.ndarray | None = None,
                 head: tuple[np.ndarray, np.ndarray] | None = None, per_class: int = 10,
                 seed: int = 0, lambdas=DEFAULT_LAMBDAS, **probe_kw) -> RelearnResult:
    """Fig. 6 on one network: features X (N, P) of the source task's examples and their labels; the
    original head's predictions come from ``logits`` (N, K) or ``head = (W (K, P), b (K,))``."""
    labels = np.asarray(labels)
    if logits is None and head is None:
        raise ValueError("relearn_head needs the network's logits or its head (W, b)")
    test = heldout_per_class(labels, per_class, seed)
    train = np.setdiff1d(np.arange(labels.size), test)
    Xn = np.asarray(X)
    r = linear_probe(Xn[train], labels[train], Xn[test], labels[test], lambdas=lambdas, seed=seed,
                     **probe_kw)
    if logits is not None:
        orig = np.argmax(np.asarray(logits)[test], axis=1)
    else:
        orig = _head_predictions(Xn[test], head)
    return RelearnResult(relearned_accuracy=r.accuracy,
                         original_accuracy=accuracy(labels[test], orig),
                         best_lambda=r.best_lambda, test_index=test, probe=r)


def _head_predictions(X: np.ndarray, head: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """argmax of the original head ``X Wᵀ + b`` (float64)."""
    W, b = head
    return np.argmax(X.astype(np.float64) @ np.asarray(W, np.float64).T + b, axis=1)


def relearn_head_rows(X: Rows, labels: np.ndarray, *, logits: Rows | None = None,
                      head: tuple[np.ndarray, np.ndarray] | None = None, per_class: int = 10,
                      seed: int = 0, lambdas=DEFAULT_LAMBDAS, **probe_kw) -> RelearnResult:
    """:func:`relearn_head` out of core: features (and logits) are :class:`repsim.probes.rows.Rows`
    (a store's chunks); the probe is :func:`repsim.probes.linear.linear_probe_rows` on the rows not held
    out, and only the held-out rows (``per_class`` × classes) are gathered. Every logits chunk is
    read once and checked finite (the rule of the in-memory route, which loads them all)."""
    from repsim.probes.linear import linear_probe_rows

    labels = np.asarray(labels)
    if logits is None and head is None:
        raise ValueError("relearn_head needs the network's logits or its head (W, b)")
    test = heldout_per_class(labels, per_class, seed)
    train = np.setdiff1d(np.arange(labels.size), test)
    r = linear_probe_rows(X, labels[train], X, labels[test], lambdas=lambdas, seed=seed, train_select=train,
                          test_select=test, **probe_kw)
    orig = np.empty(test.size, dtype=np.int64)
    if logits is not None:
        for i in range(logits.n_blocks):             # every chunk: the finiteness check covers all
            a, b = logits.bounds(i)
            Z = logits.block(i)
            lo, hi = np.searchsorted(test, [a, b])
            orig[lo:hi] = np.argmax(Z[test[lo:hi] - a], axis=1)
    else:
        for pos, Xb in X.blocks(test):
            orig[pos] = _head_predictions(Xb, head)
            del Xb
    return RelearnResult(relearned_accuracy=r.accuracy, original_accuracy=accuracy(labels[test], orig),
                         best_lambda=r.best_lambda, test_index=test, probe=r)


@dataclass
class AssignmentResult:
    """``mapping[s]`` = target class of source class s (−1: unassigned); ``k`` replications used."""

    accuracy: float
    fit_accuracy: float
    mapping: np.ndarray
    k: int
    matching: np.ndarray


def matching_matrix(source_pred: np.ndarray, target: np.ndarray, n_source: int, n_target: int
                    ) -> np.ndarray:
    """(S, T) counts of (source prediction, target label) pairs."""
    s, t = np.asarray(source_pred), np.asarray(target)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"predictions {s.shape} and labels {t.shape} must be equal-length 1-D arrays")
    if s.size and (s.min() < 0 or s.max() >= n_source or t.min() < 0 or t.max() >= n_target):
        raise ValueError("predictions/labels out of range of n_source/n_target")
    M = np.zeros((n_source, n_target), dtype=np.int64)
    np.add.at(M, (s, t), 1)
    return M


def _assign(M: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    S, T = M.shape
    rows, cols = linear_sum_assignment(-np.tile(M, (1, k)))
    mapping = np.full(S, -1, dtype=np.int64)
    mapping[rows] = cols % T
    matched = int(M[rows, cols % T].sum())
    return mapping, matched


def assignment_accuracy(source_pred: np.ndarray, target: np.ndarray, n_source: int, n_target: int,
                        *, eval_pred: np.ndarray | None = None, eval_target: np.ndarray | None = None,
                        max_k: int | None = None) -> AssignmentResult:
    """App. F assignment accuracy (see module docstring)."""
    M = matching_matrix(source_pred, target, n_source, n_target)
    limit = max_k or max(1, n_source)
    mapping, matched = _assign(M, 1)
    k = 1
    while k < limit:
        m2, matched2 = _assign(M, k + 1)
        if matched2 <= matched:
            break
        mapping, matched, k = m2, matched2, k + 1
    fit_acc = matched / max(int(M.sum()), 1)
    if eval_pred is None:
        acc = fit_acc
    else:
        ep, et = np.asarray(eval_pred), np.asarray(eval_target)
        acc = float(np.mean(mapping[ep] == et)) if ep.size else float("nan")
    return AssignmentResult(accuracy=float(acc), fit_accuracy=float(fit_acc), mapping=mapping, k=k,
                            matching=M)


__all__ = ["relearn_head", "relearn_head_rows", "RelearnResult", "heldout_per_class", "assignment_accuracy",
           "AssignmentResult", "matching_matrix"]
