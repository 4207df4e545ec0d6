"""A probe result prints as one line, and a λ chosen at the edge of the grid, beating its neighbour, is
warned about in one line (and recorded in ``info``); a plateau reaching the edge is not."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import repsim
from repsim.probes.linear import edge_warning


def test_probe_result_repr_is_one_short_line():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 20))
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0)
    r = repsim.linear_probe(X[:200], y[:200], X[200:], y[200:], lambdas=np.logspace(-3, 3, 7))
    text = repr(r)
    assert "\n" not in text and len(text) < 200
    assert text.startswith(f"ProbeResult(linear: top1 {r.accuracy:.4f} on 100 test examples; λ = {r.best_lambda:g} of 7 ")
    assert "coef_ (3, 20)" in text and "3 classes" in text
    k = repsim.knn_probe(X[:200], y[:200], X[200:], y[200:])
    assert repr(k).startswith("ProbeResult(knn: top1 ") and "k = " in repr(k)


def test_lambda_at_the_edge_is_warned_once_in_one_line():
    grid = [1e-3, 1e-2, 1e-1, 1.0]
    with pytest.warns(RuntimeWarning, match=r"λ = 0.001, the smallest of the grid \(0.001 to 1\).*beyond the grid") as rec:
        assert edge_warning({1e-3: 0.9, 1e-2: 0.8, 1e-1: 0.7, 1.0: 0.6}, 1e-3)
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    with pytest.warns(RuntimeWarning, match="the largest of the grid"):
        assert edge_warning({1e-3: 0.5, 1e-2: 0.6, 1e-1: 0.7, 1.0: 0.8}, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not edge_warning({1e-3: 0.9, 1e-2: 0.9, 1e-1: 0.7, 1.0: 0.6}, 1e-3)  # a plateau to the edge
        assert not edge_warning(dict.fromkeys(grid, 0.5) | {1e-2: 0.9}, 1e-2)  # inside the grid


def test_linear_probe_warns_when_it_picks_the_grids_edge():
    """Separable classes with the grid's λ far too large: the smallest λ wins clearly."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((400, 30))
    y = (X @ rng.standard_normal(30) > 0).astype(int)
    with pytest.warns(RuntimeWarning, match="the smallest of the grid"):
        r = repsim.linear_probe(X[:300], y[:300], X[300:], y[300:], lambdas=[1e3, 1e4, 1e5])
    assert r.best_lambda == 1e3 and r.info["lambda_at_edge"] is True
    assert "(at the grid's edge)" in repr(r)
