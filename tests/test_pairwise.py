"""``repsim.pairwise(measure, arrays)``: every pair of K in-memory representations (netrep's
``pairwise_distances`` shape), through the all-pairs driver ``exact_matrix``; each entry is the one-pair
``repsim.similarity`` of the two arrays, for every registered measure."""
from __future__ import annotations

import array_api_strict
import numpy as np
import pytest

import repsim
from repsim.kernels.measures import MEASURES, get_measure, measure_names
from repsim.kernels.measures.exact import pairwise, similarity

N = 60
WIDTHS = (4, 7, 12, 5)  # different p_i, all <= N (pwcca refuses wider than n)


def arrays(seed: int = 0, widths=WIDTHS, n: int = N) -> list[np.ndarray]:
    """K representations of the same n examples, related (a shared signal plus noise) so that no
    measure sits at its null."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 3))
    return [z @ rng.normal(size=(3, p)) + 0.5 * rng.normal(size=(n, p)) + rng.normal(size=p) for p in widths]


@pytest.mark.parametrize("name", measure_names())
def test_each_entry_is_the_one_pair_similarity(name):
    xs = arrays()
    K = len(xs)
    M = pairwise(name, xs)
    assert M.shape == (K, K) and M.dtype == np.float64
    for i in range(K):
        for j in range(K):
            assert M[i, j] == pytest.approx(similarity(xs[i], xs[j], name), rel=1e-9, abs=1e-12), (i, j)
    info = MEASURES[name].info
    lo, hi = info.range
    assert np.all((M >= lo - 1e-9) & (M <= hi + 1e-9))
    # m(X, X): the measure's declared value (ridge's fold-wise fit of X on itself stops a little short of 1)
    assert np.diag(M) == pytest.approx([info.identical] * K, abs=2e-3 if name == "ridge_r2" else 1e-9)
    if info.symmetric:
        assert np.array_equal(M, M.T)
        # and the mirrored entry is m(column j, column i) computed on its own
        assert M[1, 0] == pytest.approx(similarity(xs[0], xs[1], name), rel=1e-9)


def test_asymmetric_measures_put_the_first_argument_in_the_row():
    xs = arrays(1)
    for name in [n for n in measure_names() if not MEASURES[n].info.symmetric]:
        M = pairwise(name, xs)
        assert M[0, 2] == pytest.approx(similarity(xs[0], xs[2], name), rel=1e-9)
        assert M[2, 0] == pytest.approx(similarity(xs[2], xs[0], name), rel=1e-9)
        assert abs(M[0, 2] - M[2, 0]) > 1e-6, name  # they differ: the order is not lost


def test_linear_cka_from_its_formula():
    """Biased linear CKA (Kornblith et al. 2019, Eq. 5 with linear kernels):
    ‖Ỹᵀ X̃‖²_F / (‖X̃ᵀ X̃‖_F ‖Ỹᵀ Ỹ‖_F), X̃, Ỹ column-centred."""
    xs = arrays(2)
    c = [x - x.mean(axis=0) for x in xs]
    ref = np.array([[np.linalg.norm(b.T @ a) ** 2 / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b)) for b in c]
                    for a in c])
    np.testing.assert_allclose(pairwise("linear_cka", xs, debiased=False), ref, rtol=1e-12)


def test_wide_arrays_and_trailing_shapes():
    """p > n (the Gram route) and conv-shaped arrays (n, c, h, w), flattened, as ``similarity`` does."""
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(30, 2, 4, 5)), rng.normal(size=(30, 50)), rng.normal(size=(30, 6))]
    for name in ("linear_cka", "procrustes", "rsa"):
        M = pairwise(name, xs)
        flat = [x.reshape(30, -1) for x in xs]
        np.testing.assert_allclose(M, [[similarity(a, b, name) for b in flat] for a in flat], rtol=1e-9, atol=1e-12)


def test_array_api_strict_inputs_give_the_numpy_matrix():
    xs = arrays(4)
    got = pairwise("linear_cka", [array_api_strict.asarray(x) for x in xs])
    np.testing.assert_array_equal(got, pairwise("linear_cka", xs))


def test_each_array_is_prepared_once_whatever_k():
    """The all-pairs driver prepares (centres, factorises) each array once and shares it across its K
    pairs: K prepares, not K²."""
    calls = []

    class Counted(type(get_measure("procrustes"))):
        def prepare(self, column):
            calls.append(column.name)
            return super().prepare(column)

    xs = arrays(5)
    M = pairwise(Counted(), xs)
    assert sorted(calls) == sorted(f"arrays[{i}]" for i in range(len(xs)))
    np.testing.assert_allclose(M, pairwise("procrustes", xs), rtol=1e-12)


def test_undefined_pairs_are_nan_not_errors():
    xs = arrays(6)
    xs[1] = np.ones((N, 3))  # a constant representation: CKA's denominator is 0
    M = pairwise("linear_cka", xs)
    assert np.isnan(M[1]).all() and np.isnan(M[:, 1]).all()
    assert np.isfinite(np.delete(np.delete(M, 1, 0), 1, 1)).all()


def test_bad_input_is_refused_in_one_line():
    xs = arrays(7)
    with pytest.raises(ValueError, match=r"different numbers of examples \(arrays\[0\]: 60, arrays\[1\]: 59"):
        pairwise("linear_cka", [xs[0], xs[1][:59]])
    with pytest.raises(ValueError, match="unknown option"):
        pairwise("linear_cka", xs, topk=3)
    with pytest.raises(ValueError, match="unknown measure"):
        pairwise("cosine", xs)
    with pytest.raises(ValueError, match="at least one array"):
        pairwise("linear_cka", [])
    with pytest.raises(TypeError, match="sequence of arrays"):
        pairwise("linear_cka", 3)
    with pytest.raises(ValueError, match="NaN or infinite"):
        pairwise("linear_cka", [xs[0], np.full((N, 2), np.nan)])
    assert pairwise("linear_cka", xs[:1]).shape == (1, 1)


def test_the_public_names_resolve():
    """``repsim.pairwise`` and ``repsim.similarity`` are the public module's functions, and every lazy export
    of the package root resolves (``repsim.similarity`` pointed at the old private module name)."""
    assert repsim.pairwise is pairwise and repsim.similarity is similarity
    assert {"pairwise", "similarity"} <= set(repsim.__all__)
    missing = []
    for name in repsim.__all__:
        try:
            getattr(repsim, name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert missing == []
