"""Array-namespace detection (repsim.array_api) and the CuPy filler namespace.

CuPy is not installed here. Its arrays are recognised by type once ``cupy`` is imported (CuPy's
ndarray has no ``__array_namespace__``), and CuPy <= 13 lacks a few array-API names the kernels
use; ``CupyCompat`` fills them in from NumPy-style methods. These tests check the detection logic
on NumPy and array-api-strict arrays and on module names, and run every kernel through
``CupyCompat`` wrapped around NumPy: since its name marks it as a GPU namespace, that also runs
the GPU precision policy (float32 compute for float32 input).
"""
from __future__ import annotations

import sys

import array_api_strict
import numpy as np
import pytest

import repsim
from repsim import array_api
from repsim.kernels.minibatch_cka import MinibatchCKA
from repsim.kernels.spectra import activation_spectrum, angular_visual_hardness


def test_detection_numpy_strict_and_mixing():
    a, s = np.ones((3, 2)), array_api_strict.ones((3, 2))
    assert array_api.array_namespace(a) is np
    assert array_api.array_namespace(s) is array_api_strict
    assert array_api.array_namespace([1.0, 2.0], None) is np  # plain sequences fall back to NumPy
    with pytest.raises(TypeError, match="different array namespaces"):
        array_api.array_namespace(a, s)
    assert array_api.cupy_array_module(a) is None and array_api.cupy_array_module(s) is None
    if "cupy" not in sys.modules:  # detection never imports CuPy
        array_api.array_namespace(a)
        assert "cupy" not in sys.modules


def test_cupy_namespace_names():
    for name in ("cupy", "array_api_compat.cupy", "repsim.array_api.cupy"):
        ns = type(sys)(name)
        assert array_api.is_cupy_namespace(ns) and array_api.is_gpu_namespace(ns)
    for name in ("numpy", "array_api_strict", "cupyx", "cupy_backends", "mycupy"):
        assert not array_api.is_cupy_namespace(type(sys)(name))
    assert not array_api.is_gpu_namespace(np, np.ones(2))
    assert not array_api.is_gpu_namespace(array_api_strict, array_api_strict.ones(2))


def test_cupy_compat_fills_gaps_and_forwards():
    sh = array_api.CupyCompat(np)
    x = np.arange(6.0).reshape(2, 3)
    assert sh.matrix_transpose(x).shape == (3, 2)
    assert sh.astype(x, np.float32).dtype == np.float32
    assert sh.isdtype(np.float32, "real floating") and not sh.isdtype(np.int64, "real floating")
    assert sh.acos(np.asarray(1.0)) == 0.0
    assert sh.mean is np.mean and sh.float64 is np.float64  # everything else is forwarded
    assert array_api.array_namespace(x, xp=sh) is sh


def test_kernels_run_through_cupy_compat():
    """Every kernel through the filler namespace; float32 input is computed in float32 there
    (GPU policy), so results agree with the float64 NumPy path to float32 accuracy."""
    sh = array_api.CupyCompat(np)
    rng = np.random.default_rng(0)
    X = (rng.normal(size=(60, 30)) + 3.0).astype(np.float32)
    Y = (X[:, :5] @ rng.normal(size=(5, 40)) + rng.normal(size=(60, 40))).astype(np.float32)
    y = np.arange(60) % 4
    for deb in (False, True):
        assert repsim.linear_cka(X, Y, debiased=deb, xp=sh) == pytest.approx(
            repsim.linear_cka(X, Y, debiased=deb), rel=1e-5)
    got = MinibatchCKA(2).update([X, Y], xp=sh).result()
    np.testing.assert_allclose(got, MinibatchCKA(2).update([X, Y]).result(), rtol=1e-5)
    for d in ("cosine", "cosine_centered", "sqeuclidean"):
        assert repsim.class_separation(X, y, d, xp=sh) == pytest.approx(repsim.class_separation(X, y, d), rel=1e-5)
    W = rng.normal(size=(4, 30))
    a, b = repsim.collapse_metrics(X, y, W, xp=sh), repsim.collapse_metrics(X, y, W)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4) for k in a)
    R = np.maximum(X - 3.0, 0)
    assert repsim.nonzero_fraction(R, xp=sh) == repsim.nonzero_fraction(R)
    np.testing.assert_allclose(activation_spectrum(X, xp=sh), activation_spectrum(X), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(angular_visual_hardness(X, y, W, xp=sh), angular_visual_hardness(X, y, W), rtol=1e-5)


def test_float16_upcast_is_bit_exact_on_every_pattern(monkeypatch):
    """repsim.array_api.astype's float16 fast paths (exponent rebias for non-negative finite values,
    table lookup otherwise) equal NumPy's own conversion on all 65,536 bit patterns."""
    from repsim import array_api
    from repsim.array_api import astype

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    nonneg = every[:0x7C00]  # +0 … largest finite: the rebias path
    for x in (every, nonneg, nonneg.reshape(-1, 64)[:, ::3], every.reshape(256, 256).T):
        for dt in (np.float32, np.float64):
            got, ref = astype(x, dt, np), x.astype(dt)
            assert got.dtype == dt and got.shape == ref.shape
            np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), ref.view(f"u{ref.itemsize}"))
    # a thread that flushes subnormals takes the table path
    monkeypatch.setattr(array_api, "_subnormals_kept", lambda: False)
    got = astype(nonneg, np.float32, np)
    np.testing.assert_array_equal(got.view(np.uint32), nonneg.astype(np.float32).view(np.uint32))
    assert array_api._TWO_112 * np.float32(1) == 2.0 ** 112


def test_gram_dtype_float64_on_gpus_with_fast_float64_products(monkeypatch):
    """float16/32 columns get float32 Grams, except where float64 products are about as fast
    (a data-centre GPU): float64 there; a requested dtype always wins; never on the CPU."""
    from repsim import array_api

    assert not array_api.fast_float64_products(np)
    assert array_api.gram_dtype(np.float32, np) == np.float32 and array_api.gram_dtype("float16", np) == np.float32
    monkeypatch.setattr(array_api, "fast_float64_products", lambda xp: True)
    assert array_api.gram_dtype(np.float32, np) == np.float64 and array_api.gram_dtype("float16", np) == np.float64
    assert array_api.gram_dtype(np.float32, np, "float32") == np.float32
