"""NLL, ECE (15 bins) and temperature scaling against hand-computed values (Table C.3)."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.probes.calibration import (calibration_report, ece, ece_from_probabilities, fit_temperature, nll,
                                       probabilities)


def test_nll_by_hand():
    z = np.log(np.array([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]))
    y = np.array([0, 1])
    assert nll(z, y) == pytest.approx(-(np.log(0.7) + np.log(0.25)) / 2, rel=1e-12)


def test_ece_by_hand():
    # confidences 0.7 (right), 0.5 (wrong), 0.95 (right), 0.72 (wrong) with 15 bins:
    # 0.7 and 0.72 share bin (0.6667, 0.7333]; 0.5 in (0.4667, 0.5333]; 0.95 in (0.9333, 1]
    p = np.array([[0.7, 0.3], [0.5, 0.5], [0.05, 0.95], [0.72, 0.28]])
    y = np.array([0, 1, 1, 1])
    # argmax of [0.5, 0.5] is class 0 -> wrong
    expected = (2 * abs(0.5 - (0.7 + 0.72) / 2) + abs(0.0 - 0.5) + abs(1.0 - 0.95)) / 4
    assert ece_from_probabilities(p, y) == pytest.approx(expected, abs=1e-12)
    assert ece(np.log(p), y) == pytest.approx(expected, abs=1e-12)
    # bin edges: confidence exactly 2/3 goes to bin (0.6, 0.6667], not with 0.7
    q = np.array([[2 / 3, 1 / 3], [0.7, 0.3]])
    assert ece_from_probabilities(q, np.array([0, 1])) == pytest.approx(
        (abs(1 - 2 / 3) + abs(0 - 0.7)) / 2)


def test_sigmoid_probabilities_normalised_by_sum():
    z = np.array([[2.0, -1.0, 0.5]])
    s = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(probabilities(z, "sigmoid"), s / s.sum(), rtol=1e-12)
    np.testing.assert_allclose(probabilities(z / 2, "sigmoid"), probabilities(z, "sigmoid", 2.0))
    assert nll(z, np.array([2]), "sigmoid") == pytest.approx(-np.log(s[0, 2] / s.sum()))


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_temperature_scaling_minimises_holdout_nll(kind):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 400)
    z = rng.normal(size=(400, 5)) + 2.0 * np.eye(5)[y]
    z *= 3.0                                                   # overconfident
    T = fit_temperature(z, y, kind)
    grid = np.exp(np.linspace(np.log(0.05), np.log(20), 2001))
    brute = grid[np.argmin([nll(z, y, kind, t) for t in grid])]
    assert T == pytest.approx(brute, rel=5e-3)
    assert nll(z, y, kind, T) <= nll(z, y, kind) + 1e-12
    rep = calibration_report(z, y, z, y, kind)
    assert rep["nll_ts"] <= rep["nll"] and rep["temperature"] == pytest.approx(T)
    if kind == "softmax":
        assert T > 1.5 and rep["ece_ts"] < rep["ece"]


def test_bad_input():
    with pytest.raises(ValueError, match="labels"):
        nll(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="kind"):
        nll(np.zeros((2, 3)), np.array([0, 1]), kind="tanh")
