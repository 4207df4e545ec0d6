"""Non-zero fraction (Fig. 3), overall and per channel, and its exact streaming accumulator."""
from __future__ import annotations

import array_api_strict
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from repsim.kernels.sparsity import Sparsity, nonzero_fraction, nonzero_fraction_per_channel

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(array_api_strict, id="strict")]


@pytest.mark.parametrize("xp", NAMESPACES)
def test_known_counts(xp):
    rng = np.random.default_rng(0)
    X = np.maximum(rng.normal(size=(7, 3, 4, 5)), 0)  # post-ReLU conv maps
    X[:, 1] = 0.0  # a dead channel
    ref_total = np.count_nonzero(X) / X.size
    ref_channel = np.array([np.count_nonzero(X[:, c]) / X[:, c].size for c in range(3)])
    assert nonzero_fraction(xp.asarray(X)) == pytest.approx(ref_total, abs=0)
    np.testing.assert_array_equal(nonzero_fraction_per_channel(xp.asarray(X)), ref_channel)
    assert ref_channel[1] == 0.0
    assert nonzero_fraction(xp.asarray(np.ones((4, 2)))) == 1.0
    assert nonzero_fraction(xp.asarray(np.array([0.0, 1.0, 0.0, -2.0]))) == 0.5
    np.testing.assert_array_equal(nonzero_fraction_per_channel(xp.asarray(np.eye(4)[:, :2])), [0.25, 0.25])


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_split_any_merge_order(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    X = np.maximum(rng.normal(size=(25, 4, 2)), 0).astype(np.float32)
    cuts = sorted(data.draw(st.lists(st.integers(1, 24), max_size=6, unique=True)))
    bounds = [0, *cuts, 25]
    parts = [Sparsity().update(X[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    parts = [Sparsity.from_state(p.to_state()) for p in parts]
    order = data.draw(st.permutations(range(len(parts))))
    acc = Sparsity()
    for i in order:
        acc.merge(parts[i])
    assert acc.result() == nonzero_fraction(X)
    np.testing.assert_array_equal(acc.result_per_channel(), nonzero_fraction_per_channel(X))


def test_errors_and_state(tmp_path):
    with pytest.raises(ValueError, match="before any update"):
        Sparsity().result()
    with pytest.raises(ValueError, match="NaN"):
        nonzero_fraction(np.array([[1.0, np.nan]]))
    acc = Sparsity(name="s/block3").update(np.ones((2, 3)))
    with pytest.raises(ValueError, match="channel count"):
        acc.update(np.ones((2, 4)))
    np.savez(tmp_path / "s.npz", **acc.to_state())
    back = Sparsity.from_state(dict(np.load(tmp_path / "s.npz")))
    assert back.to_state()["per_channel_total"] == 2 and back.name == "s/block3"
    np.testing.assert_array_equal(back.nonzero, acc.nonzero)


@pytest.mark.parametrize("count_nonzero", [True, False], ids=["count_nonzero", "without"])
def test_no_wide_integer_copy_of_the_block(count_nonzero):
    """The counts come from xp.count_nonzero (or an int8 mask summed in int64), never from an int64
    copy of the whole block (8 bytes per activation: 4x a float16 block on a GPU)."""
    import types

    made = []

    class Recording(types.ModuleType):
        def __getattr__(self, name):
            if name == "count_nonzero" and not count_nonzero:
                raise AttributeError(name)
            return getattr(array_api_strict, name)

        @staticmethod
        def astype(x, dtype, /, **kw):
            made.append((x.shape, dtype))
            return array_api_strict.astype(x, dtype, **kw)

    rng = np.random.default_rng(3)
    X = np.maximum(rng.normal(size=(6, 3, 4, 5)), 0)
    xp = Recording("recording")
    acc = Sparsity().update(array_api_strict.asarray(X), xp=xp)
    np.testing.assert_array_equal(acc.nonzero, [np.count_nonzero(X[:, c]) for c in range(3)])
    wide = [(shape, dt) for shape, dt in made
            if int(np.prod(shape)) == X.size and dt in (array_api_strict.int64, array_api_strict.float64)]
    assert not wide, made
