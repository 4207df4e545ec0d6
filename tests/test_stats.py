"""Table statistics against formulas written out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from repsim.probes.stats import mean_se, not_significantly_worse, spearman, ttest


def test_mean_se_by_hand():
    m, se = mean_se([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    var = ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2
    assert se == pytest.approx(math.sqrt(var / 3))
    m2, se2 = mean_se(np.array([[1.0, 2.0], [3.0, 6.0]]), axis=0)
    np.testing.assert_allclose(m2, [2, 4])
    np.testing.assert_allclose(se2, [1, 2])
    assert math.isnan(mean_se([5.0])[1])


def test_ttest_pooled_by_hand():
    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([3.0, 5.0, 6.0])
    sp2 = (a.var(ddof=1) * 3 + b.var(ddof=1) * 2) / 5
    t = (a.mean() - b.mean()) / math.sqrt(sp2 * (1 / 4 + 1 / 3))
    from scipy.stats import t as tdist

    got_t, got_p = ttest(a, b)
    assert got_t == pytest.approx(t)
    assert got_p == pytest.approx(2 * tdist.sf(abs(t), 5))


def test_not_significantly_worse():
    g = {"softmax": [0.70, 0.71, 0.69, 0.70], "ls": [0.695, 0.705, 0.70, 0.69],
         "mse": [0.60, 0.61, 0.59, 0.60]}
    assert not_significantly_worse(g) == {"softmax", "ls"}
    assert not_significantly_worse(g, higher_is_better=False) == {"mse"}
    assert not_significantly_worse({"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [0.0, 0.0]}) == {"a", "b"}


def test_spearman_by_hand():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    y = np.array([5.0, 6.0, 7.0, 8.0, 7.5])
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    d2 = np.sum((rx - ry) ** 2)
    rho = 1 - 6 * d2 / (5 * (25 - 1))
    got, p = spearman(x, y)
    assert got == pytest.approx(rho)
    assert 0 < p < 1
    assert spearman(x, -x)[0] == pytest.approx(-1.0)


def test_ttest_of_near_identical_groups_does_not_warn():
    """SciPy warns about precision loss for groups equal to ~1e-16 (two seeds with the same accuracy);
    the report logs are not to be filled with it, and the answer is unchanged."""
    import warnings

    from repsim.probes.stats import ttest

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t, p = ttest([0.96, 0.96], [0.97, 0.97 + 1e-16])
    assert p < 1e-6 and t < 0
