"""The probes' array-module paths (CuPy on GPU) run unchanged under array-api-strict."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.probes.linear import fit_logistic, linear_probe
from repsim.probes.knn import knn_probe

xps = pytest.importorskip("array_api_strict")


# the CPU device and a second one: array-api-strict refuses to mix arrays of two devices, so a
# probe that makes an array without ``device=`` (host/device mixing on a GPU) fails on "device1"
@pytest.fixture(params=[xps.Device("CPU_DEVICE"), xps.Device("device1")], ids=["cpu", "device1"])
def device(request):
    return request.param


def data(n, p, k, seed):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    X = np.maximum(rng.normal(size=(k, p))[y] + rng.normal(size=(n, p)) + 0.5, 0)
    return X, y


def test_linear_probe_strict_equals_numpy(device):
    X, y = data(120, 6, 3, 0)
    Xt, yt = data(60, 6, 3, 1)
    lams = np.logspace(-2, 2, 5)
    a = linear_probe(X, y, Xt, yt, lambdas=lams, tol=1e-9, refit_tol=1e-10)
    b = linear_probe(xps.asarray(X, device=device), y, xps.asarray(Xt, device=device), yt, lambdas=lams, tol=1e-9, refit_tol=1e-10)
    assert a.curve == b.curve and a.best_lambda == b.best_lambda
    np.testing.assert_array_equal(a.predictions, b.predictions)
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-6, atol=1e-8)


def test_fit_logistic_strict_p_greater_than_n(device):
    X, y = data(20, 30, 2, 2)
    ca, ba, _ = fit_logistic(X, y, 0.5, tol=1e-10)
    cb, bb, _ = fit_logistic(xps.asarray(X, device=device), y, 0.5, tol=1e-10)
    np.testing.assert_allclose(ca, cb, rtol=1e-6, atol=1e-9)


def test_knn_strict_equals_numpy(device):
    X, y = data(50, 5, 3, 3)
    Xt, yt = data(20, 5, 3, 4)
    a = knn_probe(X, y, Xt, yt, ks=(1, 3, 5))
    b = knn_probe(xps.asarray(X, device=device), y, xps.asarray(Xt, device=device), yt, ks=(1, 3, 5), chunk_bytes=2000)
    assert a.curve == b.curve
    np.testing.assert_array_equal(a.predictions, b.predictions)


def test_fit_logistic_sigmoid_strict_equals_numpy(device):
    X, y = data(80, 5, 3, 5)
    Y = np.eye(3)[y]
    Y[::7, 0] = 1 - Y[::7, 0]
    lam = np.array([0.1, 1.0, 10.0])
    ca, ba, _ = fit_logistic(X, Y, lam, loss="sigmoid", tol=1e-10)
    cb, bb, _ = fit_logistic(xps.asarray(X, device=device), Y, lam, loss="sigmoid", tol=1e-10)
    np.testing.assert_allclose(ca, cb, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ba, bb, rtol=1e-6, atol=1e-9)
