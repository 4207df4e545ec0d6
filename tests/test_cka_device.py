"""The accelerator route of all-pairs CKA (repsim/kernels/_cka_device.py), run on array-api-strict.

It must give the host route's numbers (itself tested against the brute-force definition in
test_cka.py), keep its checks and messages, and have the shape a GPU needs: a number of matrix
products per batch that grows with the layers, not with the examples (no row panels), and a
single device-to-host transfer per update (no synchronisation per layer).
"""
from __future__ import annotations

import math

import array_api_strict
import numpy as np
import pytest

from repsim.array_api import to_numpy
from repsim.kernels._precision import GRAM_SLAB, CenteredGram
from repsim.kernels.cka import linear_cka
from repsim.kernels.hsic import batch_hsic, centered_gram
from repsim.kernels.minibatch_cka import MinibatchCKA

xs = array_api_strict


def _layers(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Float32 layers of several widths, a conv-shaped one, post-ReLU ones with a large mean, and
    one wider than two Gram slabs."""
    base = rng.standard_normal((n, 12))
    relu = np.maximum(base @ rng.standard_normal((12, 40)), 0) + 50.0
    conv = (base @ rng.standard_normal((12, 3 * 4 * 4))).reshape(n, 3, 4, 4)
    wide = np.concatenate([base, rng.standard_normal((n, 2 * GRAM_SLAB + 500))], axis=1)
    return [a.astype(np.float32) for a in (base, relu, conv, wide, base[:, :2] ** 2)]


# the default (CPU) device and a second one: array-api-strict refuses to combine arrays of two
# devices, so an allocation without ``device=`` (host/device mixing on a GPU) fails on "device1"
DEVICES = [xs.Device("CPU_DEVICE"), xs.Device("device1")]


@pytest.fixture(params=DEVICES, ids=["cpu", "device1"])
def device(request):
    return request.param


def _strict(arrays, device=None):
    return [xs.asarray(a, device=device) for a in arrays]


@pytest.mark.parametrize("debiased", [True, False])
def test_device_route_equals_host_route(debiased, device):
    rng = np.random.default_rng(0)
    layers = _layers(37, rng)
    host64 = batch_hsic([a.astype(np.float64) for a in layers], debiased=debiased)
    host32 = batch_hsic(layers, debiased=debiased)
    dev = batch_hsic(_strict(layers, device), debiased=debiased)
    scale = np.abs(host64).max()
    assert np.abs(dev - host32).max() / scale < 1e-6  # the same float32 Grams up to summation order
    assert np.abs(dev - host64).max() / scale < 1e-6
    dev64 = batch_hsic(_strict([a.astype(np.float64) for a in layers], device), debiased=debiased)
    np.testing.assert_allclose(dev64, host64, rtol=1e-11, atol=1e-11 * scale)
    np.testing.assert_array_equal(dev, dev.T)


@pytest.mark.parametrize("debiased", [True, False])
def test_row_groups_add_up_to_the_whole_batch(debiased, device):
    """A block_bytes that holds a few Gram rows cuts the examples into groups; the sums agree."""
    rng = np.random.default_rng(1)
    layers = [a.astype(np.float64) for a in _layers(23, rng)]
    whole = batch_hsic(_strict(layers, device), debiased=debiased)
    L, n = len(layers), 23
    for rows in (1, 5, 22):
        parts = batch_hsic(_strict(layers, device), debiased=debiased, block_bytes=L * rows * n * 8)
        np.testing.assert_allclose(parts, whole, rtol=1e-11, atol=1e-11 * np.abs(whole).max())


def test_centered_grams_enter_without_a_host_check(device):
    """A wide layer reduced to its centred Gram on an accelerator is checked with the batch."""
    rng = np.random.default_rng(2)
    layers = _layers(30, rng)
    gram = centered_gram(xs.asarray(layers[3], device=device), xs, "wide")
    assert isinstance(gram, CenteredGram) and gram.mean_sq is not None
    mixed = _strict(layers[:3], device) + [gram] + _strict(layers[4:], device)
    ref = batch_hsic(_strict(layers, device))
    np.testing.assert_allclose(batch_hsic(mixed), ref, rtol=1e-9)
    const = centered_gram(xs.asarray(np.full((30, 9000), 3.5, dtype=np.float32), device=device), xs, "flat")
    got = batch_hsic([xs.asarray(layers[0], device=device), const], names=["a", "flat"])
    assert got[0, 0] > 0 and not got[1].any() and not got[:, 1].any()


def test_device_route_refuses_what_the_host_route_refuses(device):
    rng = np.random.default_rng(3)
    X = rng.standard_normal((20, 4)).astype(np.float32)
    nan = X.copy()
    nan[3, 1] = np.nan
    inf = X.copy()
    inf[0, 0] = np.inf
    for bad in (nan, inf):
        for put in (np.asarray, lambda a: xs.asarray(a, device=device)):
            with pytest.raises(ValueError, match="b contains NaN"):
                batch_hsic([put(X), put(bad)], names=["a", "b"])
    const = np.full((20, 3), 7.0, dtype=np.float32)  # constant: a zero row and column on both routes
    for put in (np.asarray, lambda a: xs.asarray(a, device=device)):
        got = batch_hsic([put(X), put(const)], names=["a", "b"])
        assert got[0, 0] > 0 and not got[1].any() and not got[:, 1].any()
    with pytest.raises(ValueError, match="has 10 examples, expected 20"):
        batch_hsic(_strict([X, X[:10]], device))
    acc = MinibatchCKA(2).update(_strict([X, X[:, :2]], device))
    with pytest.raises(ValueError, match="3 features in this batch but 2"):
        acc.update(_strict([X, X[:, :3]], device))


def test_minibatch_accumulator_and_linear_cka_on_the_device_route(device):
    rng = np.random.default_rng(4)
    batches = [_layers(25, rng) for _ in range(3)]
    host, dev = MinibatchCKA(5), MinibatchCKA(5)
    for b in batches:
        host.update(b)
        dev.update(_strict(b, device))
    np.testing.assert_allclose(dev.result(), host.result(), atol=1e-6)
    X, Y = batches[0][0], batches[0][1]
    for deb in (True, False):
        assert linear_cka(xs.asarray(X, device=device), xs.asarray(Y, device=device), debiased=deb) == pytest.approx(
            linear_cka(X.astype(np.float64), Y.astype(np.float64), debiased=deb), abs=1e-6)


@pytest.fixture
def counted(monkeypatch):
    """Counts the matrix products of strict arrays and every way one reaches the host (DLPack,
    buffer, Python scalars)."""
    count = {"matmul": 0, "host": 0}
    cls = type(xs.asarray(0.0))
    for name in ("__matmul__", "__dlpack__", "__array__", "__float__", "__bool__", "__int__", "__index__"):
        orig = getattr(cls, name, None)
        if orig is None:
            continue
        key = "matmul" if name == "__matmul__" else "host"

        def wrapped(self, *a, _orig=orig, _key=key, **k):
            count[_key] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)
    return count


@pytest.mark.parametrize("n", [16, 300])
def test_operations_per_update_grow_with_layers_not_examples(n, counted, device):
    """One Gram per slab of each layer plus A Aᵀ and R Rᵀ — the same count at n = 16 and n = 300
    (the host route's row panels would make it grow with n) — and one copy to the host."""
    rng = np.random.default_rng(5)
    layers = _strict(_layers(n, rng), device)
    widths = [12, 40, 48, 12 + 2 * GRAM_SLAB + 500, 2]
    slabs = sum(max(1, math.ceil(p / GRAM_SLAB)) for p in widths)
    acc = MinibatchCKA(len(layers))
    counted.update(matmul=0, host=0)
    acc.update(layers)
    assert counted["matmul"] == slabs + 2
    assert counted["host"] == 1


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:  # noqa: BLE001 - no driver
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.parametrize("L,N,chunks", [(5, 997, 7), (3, 64, 64), (64, 1500 * 1500, 256), (1, 10, 3), (7, 1000, 1)])
def test_batched_row_products_equal_one_product(L, N, chunks):
    """The strided-batched DGEMM route (CuPy) sums the same terms as A Aᵀ: a prime N (a short last
    chunk), a chunk per column, the benchmark's size."""
    import dataclasses

    from repsim.kernels import _cka_device

    cp = _cupy_or_skip()
    A = cp.random.default_rng(0).standard_normal((L, N))
    ref = A @ A.T
    got = _cka_device._batched_row_products(A, chunks)  # (raises where the binding differs)
    assert float(cp.abs(got - ref).max()) <= 1e-12 * float(cp.abs(ref).max()) * max(1.0, math.log2(N))
    old = _cka_device.TUNING
    try:  # and through the update, against the one-product route
        layers = [cp.asarray(a) for a in _layers(41, np.random.default_rng(6))]
        _cka_device.TUNING = dataclasses.replace(old, product="gemm")
        one = batch_hsic(layers)
        _cka_device.TUNING = dataclasses.replace(old, product="batched", chunks=chunks)
        np.testing.assert_allclose(batch_hsic(layers), one, rtol=1e-10, atol=1e-10 * np.abs(one).max())
        assert not _cka_device._BATCHED_UNAVAILABLE
    finally:
        _cka_device.TUNING = old


def test_batched_product_only_for_real_cupy_arrays(monkeypatch):
    """NumPy arrays handed in with a CuPy-named namespace (tests/test_xp.py's CupyCompat) take the one
    product and leave the batched DGEMM available: before, the attempt failed (no cupy, or NumPy's
    array has no ``.data.ptr``) and switched it off for the rest of the process."""
    import dataclasses
    import warnings

    from repsim import array_api
    from repsim.kernels import _cka_device

    monkeypatch.setattr(_cka_device, "TUNING", dataclasses.replace(_cka_device.TUNING, product="batched"))
    layers = _layers(19, np.random.default_rng(9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = batch_hsic(layers, xp=array_api.CupyCompat(np))
    assert not _cka_device._BATCHED_UNAVAILABLE
    np.testing.assert_allclose(got, batch_hsic(_strict(layers)), rtol=1e-9, atol=1e-9 * np.abs(got).max())


def test_column_sums_as_a_product_on_the_layers_device(monkeypatch, device):
    """Tuning colsum="gemv" (the centring's column sums as a product with a row of ones, made on the
    layers' device) gives the reduction's HSIC."""
    import dataclasses

    from repsim.kernels import _cka_device

    layers = _layers(21, np.random.default_rng(10))
    ref = batch_hsic(_strict(layers, device))
    monkeypatch.setattr(_cka_device, "TUNING", dataclasses.replace(_cka_device.TUNING, colsum="gemv"))
    np.testing.assert_allclose(batch_hsic(_strict(layers, device)), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_wide_layer_gram_in_feature_slabs_equals_the_whole(dtype, device):
    """A wide layer's centred Gram on the accelerator route, made a few features at a time (so that
    its cast and centred copies stay small) equals the one made at once, ‖x̄‖² too."""
    from repsim.kernels._cka_device import centered_gram_slabs

    rng = np.random.default_rng(7)
    X = (np.maximum(rng.standard_normal((20, 9000)), 0) + 5.0).astype(np.float32)  # (strict has no float16)
    dt = getattr(xs, dtype)
    whole, m_whole = centered_gram_slabs(xs.asarray(X, device=device), xs, dt, GRAM_SLAB, cap=1 << 40)
    parts, m_parts = centered_gram_slabs(xs.asarray(X, device=device), xs, dt, GRAM_SLAB, cap=20 * GRAM_SLAB * 4)  # 2 slabs
    whole, parts = to_numpy(whole), to_numpy(parts)
    np.testing.assert_allclose(parts, whole, rtol=1e-6 if dtype == "float32" else 1e-12,
                               atol=(1e-6 if dtype == "float32" else 1e-12) * np.abs(whole).max())
    assert float(m_parts) == pytest.approx(float(m_whole), rel=1e-6)
    ref = X.astype(np.float64) - X.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(whole, ref @ ref.T, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


def test_wide_in_memory_layers_enter_as_their_centered_gram(monkeypatch, device):
    """Above WIDE_BYTES an in-memory layer takes the slab route inside the update: same HSIC."""
    from repsim.kernels import _cka_device

    rng = np.random.default_rng(8)
    layers = _layers(31, rng)
    ref = batch_hsic(_strict(layers, device))
    monkeypatch.setattr(_cka_device, "WIDE_BYTES", 31 * 100 * 4)  # the 4,596-wide layer (and only it) is "wide"
    seen = []
    real = _cka_device.centered_gram_slabs
    monkeypatch.setattr(_cka_device, "centered_gram_slabs", lambda X, *a, **k: seen.append(X.shape) or real(X, *a, **k))
    np.testing.assert_allclose(batch_hsic(_strict(layers, device)), ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    assert seen == [(31, 12 + 2 * GRAM_SLAB + 500)]
