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


def _permutation_p(x, y):
    """SciPy's exact permutation p of Spearman's ρ: every pairing (n_resamples=inf) of ``y`` with ``x``
    (one sample permuted, as scipy's documentation does for correlations)."""
    from scipy import stats

    rx = stats.rankdata(x)

    def rho(b, axis=-1):
        rb = stats.rankdata(b, axis=axis)
        a, rb = rx - rx.mean(), rb - rb.mean(axis=axis, keepdims=True)
        return (rb @ a) / np.sqrt((a @ a) * (rb * rb).sum(axis=axis))

    return stats.permutation_test((np.asarray(y, float),), rho, vectorized=True, permutation_type="pairings",
                                  n_resamples=np.inf).pvalue


def test_spearman_p_is_exact_at_small_n():
    """For n ≤ 9 the p-value is the exact permutation p (scipy.stats.permutation_test over all n! pairings),
    ties by average ranks; the t approximation it replaced is anticonservative there (stats audit F6)."""
    rng = np.random.default_rng(0)
    for n in (3, 4, 5, 6, 7):
        for k in range(6):
            x = rng.normal(size=n) if k % 2 else rng.integers(0, 3, n).astype(float)  # ties in x
            y = rng.normal(size=n) if k % 3 else rng.integers(0, 3, n).astype(float)  # ties in y
            if np.ptp(x) == 0 or np.ptp(y) == 0:
                continue
            assert spearman(x, y)[1] == pytest.approx(_permutation_p(x, y), abs=1e-12), (x, y)
    x = np.arange(5.0)
    rho, p = spearman(x, [0, 1, 2, 4, 3])
    assert rho == pytest.approx(0.9) and p == pytest.approx(10 / 120)  # t approximation: 0.037
    assert spearman(x, x)[1] == pytest.approx(2 / 120)
    # n = 9: |ρ| = 0.683 and 0.667 are not significant exactly (t approximation: p = 0.042 and 0.050)
    y9 = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8])
    for d2, want in ((38, 0.0503), (40, 0.0589), (36, 0.0433)):
        perm = _perm_with_d2(9, d2)
        rho, p = spearman(np.arange(9.0), y9[perm])
        assert rho == pytest.approx(1 - 6 * d2 / 720) and p == pytest.approx(want, abs=5e-5)


def _perm_with_d2(n, d2):
    """A permutation of range(n) whose Σ (i − π(i))² is ``d2``."""
    from repsim.probes.stats import _orderings

    perms = _orderings(n)
    hit = np.flatnonzero(((perms - np.arange(n)) ** 2).sum(axis=1) == d2)
    return perms[hit[0]]


def test_spearman_exact_at_nine_is_fast_and_t_beyond():
    """n = 9 enumerates 362,880 pairings once per process (later calls reuse them: the speed is
    bench material, the reuse is checked here, not a wall clock); n = 10 keeps scipy's t approximation."""
    from scipy import stats

    from repsim.probes.stats import _orderings

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=9), rng.normal(size=9)
    spearman(x, y)
    before = _orderings.cache_info()
    rho, p = spearman(x, y)
    after = _orderings.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1  # not enumerated again
    null = __import__("repsim.probes.stats", fromlist=["spearman_null"]).spearman_null(9)
    assert null.size == 362_880 and p == pytest.approx(2 * min(np.mean(null <= rho + 1e-12),
                                                               np.mean(null >= rho - 1e-12)))
    x, y = rng.normal(size=10), rng.normal(size=10)
    assert spearman(x, y)[1] == pytest.approx(stats.spearmanr(x, y).pvalue)
    with pytest.warns(stats.ConstantInputWarning):
        assert np.isnan(spearman(np.ones(5), np.arange(5.0))[1])


def test_bold_rule_caption_names_the_test_and_the_missing_multiplicity_control():
    """The bold rule compares every row with a best chosen from the same data, each at 0.05 with no
    multiplicity control (as the paper's Table 1 does): the caption says so and names Student's pooled
    t-test (stats audit F5, F9)."""
    from repsim.analyses.summary import bold_rule_text

    text = bold_rule_text(2)
    assert text.startswith("Bold: best, or not significantly different from the best (two-sided Student's pooled "
                           "two-sample t-test over seeds, p ≥ 0.05).")
    assert "the best is chosen from the same data" in text and "no correction for multiple comparisons" in text
    assert bold_rule_text(1).startswith("Bold: best mean only")
