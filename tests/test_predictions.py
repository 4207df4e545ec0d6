"""Prediction agreement, clustering and modal-vote ensembles (App. C.3) against brute-force loops."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.probes.predictions import (agreement_matrices, group_ensembles, load_predictions, modal_vote,
                                       prediction_linkage, save_predictions)


def test_agreement_matrices_equal_loops():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 60)
    P = np.where(rng.random((5, 60)) < 0.6, y, rng.integers(0, 4, (5, 60)))
    A = agreement_matrices(P, y)
    for i in range(5):
        for j in range(5):
            assert A["all"][i, j] == pytest.approx(np.mean(P[i] == P[j]))
            assert A["correctness"][i, j] == pytest.approx(np.mean((P[i] == y) == (P[j] == y)))
            bw = (P[i] != y) & (P[j] != y)
            assert A["both_wrong"][i, j] == pytest.approx(np.mean(P[i][bw] == P[j][bw]))
    assert np.all(np.diag(A["all"]) == 1)


def test_both_wrong_nan_when_never_both_wrong():
    y = np.array([0, 1])
    A = agreement_matrices(np.array([[0, 1], [0, 0]]), y)
    assert np.isnan(A["both_wrong"][0, 1])


def test_modal_vote_confidence_breaks_ties_only():
    P = np.array([[0, 2, 1], [1, 2, 0]])
    conf = np.array([[0.6, 0.9, 0.99], [0.7, 0.1, 0.98]])
    # example 0: 0 vs 1 tied, class 1's voter is surer; example 1: unanimous; example 2: 1 (0.99) beats 0
    np.testing.assert_array_equal(modal_vote(P, 3, confidence=conf), [1, 2, 1])
    P3 = np.array([[0], [0], [1]])
    np.testing.assert_array_equal(modal_vote(P3, 2, confidence=np.array([[0.0], [0.0], [1.0]])), [0])  # count wins
    np.testing.assert_array_equal(modal_vote(P, 3, confidence=conf, rows=1), modal_vote(P, 3, confidence=conf))
    with pytest.raises(ValueError, match="confidence"):
        modal_vote(P, 3, confidence=conf[:1])


def test_modal_vote_and_ties():
    P = np.array([[0, 1, 2, 3], [0, 2, 2, 1], [1, 2, 0, 3], [1, 1, 0, 1]])
    np.testing.assert_array_equal(modal_vote(P), [0, 1, 0, 1])   # ties -> smallest class
    names, E = group_ensembles(P, ["a", "b", "a", "b"])
    assert names == ["a", "b"]
    np.testing.assert_array_equal(E, [modal_vote(P[[0, 2]]), modal_vote(P[[1, 3]])])


def test_linkage_clusters_groups():
    from scipy.cluster.hierarchy import fcluster

    S = np.full((4, 4), 0.2)
    S[:2, :2] = S[2:, 2:] = 0.9
    np.fill_diagonal(S, 1.0)
    Z = prediction_linkage(S)
    lab = fcluster(Z, 2, criterion="maxclust")
    assert lab[0] == lab[1] != lab[2] == lab[3]


def test_save_load(tmp_path):
    P = np.array([[0, 1], [1, 1]])
    save_predictions(tmp_path / "predictions.npz", ["a", "b"], P, np.array([0, 1]))
    d = load_predictions(tmp_path / "predictions.npz")
    assert d["names"].tolist() == ["a", "b"]
    np.testing.assert_array_equal(d["predictions"], P)
