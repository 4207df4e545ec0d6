"""Assignment accuracy (App. F) and relearned heads (Fig. 6)."""
from __future__ import annotations

import numpy as np

from repsim.probes.transfer import assignment_accuracy, heldout_per_class, matching_matrix, relearn_head


def test_assignment_recovers_planted_mapping():
    rng = np.random.default_rng(0)
    S, T = 30, 4
    planted = rng.integers(0, T, S)          # several source classes per target class
    planted[:T] = np.arange(T)               # every target used
    src = rng.integers(0, S, 2000)
    tgt = planted[src].copy()
    noisy = rng.random(2000) < 0.1
    tgt[noisy] = rng.integers(0, T, noisy.sum())
    r = assignment_accuracy(src, tgt, S, T)
    np.testing.assert_array_equal(r.mapping, planted)
    assert r.k >= np.bincount(planted).max() - 1
    assert r.fit_accuracy == np.mean(planted[src] == tgt)
    # evaluation on separate predictions uses the fitted mapping
    r2 = assignment_accuracy(src, tgt, S, T, eval_pred=src[:100], eval_target=planted[src[:100]])
    assert r2.accuracy == 1.0


def test_assignment_k_stops_when_no_gain():
    # two source classes, both mostly target 0: with k=1 only one can take target 0
    src = np.array([0, 0, 0, 1, 1, 1, 1])
    tgt = np.array([0, 0, 1, 0, 0, 0, 1])
    r = assignment_accuracy(src, tgt, 2, 2)
    assert r.k == 2 and r.mapping.tolist() == [0, 0]
    assert r.fit_accuracy == 5 / 7
    M = matching_matrix(src, tgt, 2, 2)
    assert M.tolist() == [[2, 1], [3, 1]]


def test_relearn_head():
    rng = np.random.default_rng(1)
    K, P = 5, 8
    y = np.repeat(np.arange(K), 40)
    means = rng.normal(size=(K, P)) * 2
    X = means[y] + rng.normal(size=(y.size, P))
    W, b = means, -0.5 * np.sum(means ** 2, axis=1)
    r = relearn_head(X, y, head=(W, b), per_class=10, lambdas=np.logspace(-2, 2, 5))
    assert r.test_index.size == 50
    assert np.all(np.bincount(y[r.test_index]) == 10)
    assert r.original_accuracy > 0.8 and r.relearned_accuracy > 0.8
    r2 = relearn_head(X, y, logits=X @ W.T + b, per_class=10, lambdas=np.logspace(-2, 2, 5))
    assert r2.original_accuracy == r.original_accuracy
    assert heldout_per_class(np.array([0, 0, 1]), 10).tolist() == [0]
