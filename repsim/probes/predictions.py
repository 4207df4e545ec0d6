"""How networks' predictions relate (paper App. C.3, Figs. C.4–C.7).

- :func:`agreement_matrices`: for M networks' top-1 predictions on the same N examples, three (M, M)
  matrices (Fig. C.5): ``all`` — fraction of examples where the two predictions are equal; ``correctness``
  — fraction where both are right or both are wrong; ``both_wrong`` — among examples both get wrong,
  fraction with the same (wrong) prediction (Fig. C.4a; NaN when no example is wrong for both).
- :func:`prediction_linkage`: hierarchical clustering of networks from a similarity matrix
  (distance ``1 − similarity``, average linkage by default) for the dendrogram of Fig. C.4b; plot with
  ``scipy.cluster.hierarchy.dendrogram(Z, labels=...)``.
- :func:`modal_vote`: ensemble prediction = the most common top-1 prediction of the members
  (Figs. C.6/C.7); ties go to the smallest class index (``scipy.stats.mode``'s convention).
- :func:`save_predictions` / :func:`load_predictions`: ``predictions.npz`` with ``names`` (M,),
  ``predictions`` (M, N) int32, ``labels`` (N,) int32 and ``example_ids`` (N,) int64.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _check_preds(predictions: np.ndarray, labels: np.ndarray | None = None) -> np.ndarray:
    P = np.asarray(predictions)
    if P.ndim != 2:
        raise ValueError(f"predictions must be (models, examples), got shape {P.shape}")
    if labels is not None and np.asarray(labels).shape != (P.shape[1],):
        raise ValueError(f"labels must have shape ({P.shape[1]},), got {np.asarray(labels).shape}")
    return P


def agreement_matrices(predictions: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """{"all", "correctness", "both_wrong"} → (M, M) float64 matrices (see module docstring)."""
    P = _check_preds(predictions, labels)
    y = np.asarray(labels)
    M, _ = P.shape
    wrong = (P != y[None, :])
    Wf = wrong.astype(np.float64)
    n = P.shape[1]
    both_wrong_n = Wf @ Wf.T
    correctness = (Wf @ Wf.T + (1 - Wf) @ (1 - Wf).T) / n
    same = np.empty((M, M))
    same_wrong = np.empty((M, M))
    for i in range(M):
        eq = P == P[i][None, :]
        same[i] = eq.mean(axis=1)
        same_wrong[i] = (eq & wrong & wrong[i][None, :]).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        both_wrong = np.where(both_wrong_n > 0, same_wrong / both_wrong_n, np.nan)
    return {"all": same, "correctness": correctness, "both_wrong": both_wrong}


def prediction_linkage(similarity: np.ndarray, method: str = "average") -> np.ndarray:
    """scipy linkage matrix Z ((M−1), 4) from an (M, M) similarity in [0, 1] (distance 1 − s)."""
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform

    S = np.asarray(similarity, dtype=np.float64)
    if S.ndim != 2 or S.shape[0] != S.shape[1] or S.shape[0] < 2:
        raise ValueError(f"similarity must be square with at least 2 rows, got {S.shape}")
    if not np.all(np.isfinite(S)):
        raise ValueError("similarity contains NaN/inf (e.g. no examples both networks got wrong)")
    D = 1.0 - (S + S.T) / 2
    np.fill_diagonal(D, 0.0)
    return linkage(squareform(np.clip(D, 0, None), checks=False), method=method)


def modal_vote(predictions: np.ndarray, num_classes: int | None = None,
               confidence: np.ndarray | None = None, rows: int = 8192) -> np.ndarray:
    """Most common prediction per example (M, N) → (N,) (App. C.3 ensembles).

    Ties go to the smallest class index, or, given ``confidence`` (M, N) in [0, 1] (e.g. each
    network's top-1 probability), to the class whose voters are jointly more confident: each vote
    weighs ``1 + c / (M + 1)``, a bonus below one vote in total, so it never overturns a count. Small
    ensembles (2 seeds) tie often, and the index rule would bias them towards low classes. Votes are
    counted ``rows`` examples at a time (bounded memory).
    """
    P = _check_preds(predictions)
    if P.size and P.min() < 0:
        raise ValueError("predictions must be non-negative class indices")
    M, N = P.shape
    K = int(num_classes if num_classes is not None else P.max() + 1)
    if confidence is not None:
        confidence = np.asarray(confidence, dtype=np.float64)
        if confidence.shape != P.shape:
            raise ValueError(f"confidence has shape {confidence.shape}, predictions {P.shape}")
    out = np.empty(N, dtype=np.int64)
    for a in range(0, N, rows):
        b = min(N, a + rows)
        votes = np.zeros((b - a, K))
        cols = np.arange(b - a)
        for m in range(M):
            weight = 1.0 if confidence is None else 1.0 + confidence[m, a:b] / (M + 1)
            np.add.at(votes, (cols, P[m, a:b]), weight)
        out[a:b] = np.argmax(votes, axis=1)  # argmax returns the first (smallest) maximal class
    return out


def group_ensembles(predictions: np.ndarray, groups: Sequence[str], num_classes: int | None = None
                    ) -> tuple[list[str], np.ndarray]:
    """Modal-vote ensemble of each group of networks (e.g. the 8 seeds of one objective, Fig. C.6):
    returns (group names in first-seen order, (G, N) ensemble predictions)."""
    P = _check_preds(predictions)
    groups = list(groups)
    if len(groups) != P.shape[0]:
        raise ValueError(f"{len(groups)} group names for {P.shape[0]} networks")
    names = list(dict.fromkeys(groups))
    K = int(num_classes if num_classes is not None else P.max() + 1)
    return names, np.stack([modal_vote(P[[g == n for g in groups]], K) for n in names])


def save_predictions(path: str | Path, names: Sequence[str], predictions: np.ndarray,
                     labels: np.ndarray, example_ids: np.ndarray | None = None) -> None:
    P = _check_preds(predictions, labels)
    ids = np.arange(P.shape[1]) if example_ids is None else np.asarray(example_ids)
    np.savez_compressed(path, names=np.asarray(list(names), dtype=str), predictions=P.astype(np.int32),
                        labels=np.asarray(labels, dtype=np.int32), example_ids=ids.astype(np.int64))


def load_predictions(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


__all__ = ["agreement_matrices", "prediction_linkage", "modal_vote", "group_ensembles",
           "save_predictions", "load_predictions"]
