"""Spectra (Fig. E.2), angular visual hardness (Fig. E.1), cosine-distance samples (Fig. E.3)."""
from __future__ import annotations

import array_api_strict
import numpy as np
import pytest

from repsim.kernels.spectra import (ActivationSpectrum, activation_spectrum, angular_visual_hardness,
                                    centroid_spectrum, cosine_distance_samples, weight_spectrum)

NAMESPACES = [pytest.param(np, id="numpy"), pytest.param(array_api_strict, id="strict")]


@pytest.mark.parametrize("xp", NAMESPACES)
@pytest.mark.parametrize("shape", [(40, 6), (8, 30), (10, 2, 2, 2)])
def test_activation_spectrum(xp, shape):
    rng = np.random.default_rng(0)
    X = rng.normal(size=shape) * np.linspace(0.5, 3, int(np.prod(shape[1:]))).reshape(shape[1:]) + 5.0
    Xf = X.reshape(len(X), -1)
    ref = np.linalg.svd(Xf - Xf.mean(axis=0), compute_uv=False)
    got = activation_spectrum(xp.asarray(X))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-6 * ref[0])
    acc = ActivationSpectrum()
    for part in np.array_split(X, 3):
        acc.merge(ActivationSpectrum.from_state(ActivationSpectrum().update(xp.asarray(part)).to_state()))
    streamed = acc.result()
    full = np.zeros(Xf.shape[1])
    full[: ref.size] = ref
    np.testing.assert_allclose(streamed, full, rtol=1e-8, atol=1e-6 * ref[0])


@pytest.mark.parametrize("xp", NAMESPACES)
def test_weight_and_centroid_spectra(xp):
    rng = np.random.default_rng(1)
    W = rng.normal(size=(7, 5))
    np.testing.assert_allclose(weight_spectrum(xp.asarray(W)), np.linalg.svd(W, compute_uv=False), rtol=1e-12)
    H = rng.normal(size=(60, 5)) + 3.0
    y = np.arange(60) % 4 + 10  # arbitrary label values
    mu = np.array([H[y == c].mean(axis=0) for c in range(10, 14)])
    full = np.linalg.svd(mu - mu.mean(axis=0), compute_uv=False)  # 4 values, the last ~1e-15 (rank C - 1 = 3)
    assert full[-1] < 1e-12 * full[0]
    np.testing.assert_allclose(centroid_spectrum(xp.asarray(H), y), full[:3], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(centroid_spectrum(xp.asarray(H), y, center=False),
                               np.linalg.svd(mu, compute_uv=False), rtol=1e-10)


@pytest.mark.parametrize("xp", NAMESPACES)
def test_angular_visual_hardness(xp):
    rng = np.random.default_rng(2)
    X, W = rng.normal(size=(20, 6)), rng.normal(size=(4, 6))
    y = rng.integers(0, 4, 20)
    ref = []
    for x, label in zip(X, y):
        ang = [np.arccos(np.clip(x @ w / (np.linalg.norm(x) * np.linalg.norm(w)), -1, 1)) for w in W]
        ref.append(ang[label] / sum(ang))
    np.testing.assert_allclose(angular_visual_hardness(xp.asarray(X), y, xp.asarray(W)), ref, rtol=1e-12)
    # an example on its class's weight direction has hardness 0; invariant to scaling x
    got = angular_visual_hardness(xp.asarray(np.stack([3 * W[1], W[2]])), np.array([1, 2]), xp.asarray(W))
    np.testing.assert_allclose(got, 0.0, atol=1e-7)
    with pytest.raises(ValueError, match="features"):
        angular_visual_hardness(xp.asarray(X), y, xp.asarray(W[:, :3]))


@pytest.mark.parametrize("xp", NAMESPACES)
def test_cosine_distance_samples(xp):
    rng = np.random.default_rng(3)
    C, P = 4, 6
    dirs = np.eye(P)[:C]  # orthogonal class directions
    y = np.repeat(np.arange(C), 9)
    X = dirs[y] * rng.uniform(0.5, 2, size=(y.size, 1))  # one ray per class
    within, between = cosine_distance_samples(xp.asarray(X), y, 500, seed=5)
    assert within.shape == (500,) and between.shape == (500,)
    np.testing.assert_allclose(within, 0.0, atol=1e-12)
    np.testing.assert_allclose(between, 1.0, atol=1e-12)
    Z = rng.normal(size=(50, 3))
    yz = rng.integers(0, 3, 50)
    a = cosine_distance_samples(xp.asarray(Z), yz, 200, seed=1)
    b = cosine_distance_samples(xp.asarray(Z), yz, 200, seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    # every sampled distance is the distance of a real within (between) pair, never i == j
    zn = Z / np.linalg.norm(Z, axis=1, keepdims=True)
    D = 1 - zn @ zn.T
    same = yz[:, None] == yz[None, :]
    np.fill_diagonal(same, False)
    diff = yz[:, None] != yz[None, :]
    assert all(np.any(np.isclose(D[same], v, rtol=0, atol=1e-12)) for v in a[0])
    assert all(np.any(np.isclose(D[diff], v, rtol=0, atol=1e-12)) for v in a[1])
    with pytest.raises(ValueError, match="2 classes"):
        cosine_distance_samples(xp.asarray(Z), np.zeros(50, dtype=int))


def test_cosine_distance_samples_are_uniform_over_pairs():
    """Balanced classes: each unordered within (between) pair is drawn equally often (docstring)."""
    rng = np.random.default_rng(4)
    Z = rng.normal(size=(9, 5))  # generic: every pair has its own distance
    y = np.repeat(np.arange(3), 3)
    zn = Z / np.linalg.norm(Z, axis=1, keepdims=True)
    D = 1 - zn @ zn.T
    iu = np.triu_indices(9, 1)
    d_pairs, same = D[iu], (y[iu[0]] == y[iu[1]])
    n_draw = 36_000
    within, between = cosine_distance_samples(Z, y, n_draw, seed=2)
    for sample, mask in ((within, same), (between, ~same)):
        ref = d_pairs[mask]
        which = np.abs(sample[:, None] - ref[None, :]).argmin(axis=1)
        assert np.abs(sample - ref[which]).max() < 1e-12  # every draw is one of these pairs
        counts = np.bincount(which, minlength=ref.size)
        expected = n_draw / ref.size  # 9 within pairs, 27 between pairs
        assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts
