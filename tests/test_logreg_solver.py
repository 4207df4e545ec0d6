"""The L-BFGS solver of repsim.probes._logreg: its line search works on logits that are linear in the
parameters (one product per direction, none per trial); checked against direct products and scipy."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from repsim.probes import _logreg


def problem(n=300, p=12, k=4, seed=0, loss="softmax", dtype=np.float64):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    X = np.maximum(rng.normal(size=(k, p))[y] + rng.normal(size=(n, p)) + 0.5, 0).astype(dtype)
    if loss == "sigmoid":
        y = (X @ rng.normal(size=(p, k)) + rng.normal(size=(n, k)) > 0.5).astype(np.float64)
    rp = _logreg.rotate(X)
    return _logreg.LogisticObjective(rp, y, k, loss=loss), rng


@pytest.mark.parametrize("loss,lam", [("softmax", 0.3), ("softmax", 1e-3), ("sigmoid", [0.1, 1.0, 10.0, 0.01])])
def test_solver_matches_scipy_lbfgsb(loss, lam):
    """Strictly convex problem: same optimum as scipy's L-BFGS-B run on the same objective. tol 1e-10:
    the solver reached max|∇|/f of 5e-12 to 1.3e-11 on these problems with OpenBLAS's Haswell,
    SkylakeX and Prescott kernels (its line search works on φ', whose sum over n·K terms rounds at
    about that level); 1e-11 was met by the AVX-512 kernel only after a restart (see solve)."""
    obj, _ = problem(loss=loss)
    sol = obj.solve(lam, tol=1e-10, max_iter=5000)
    assert sol.converged, sol.message
    theta = obj.pack(sol.Wd, sol.b)
    f, g = obj(theta)
    assert np.max(np.abs(g)) <= 1e-10 * f
    res = minimize(obj, np.zeros_like(theta), jac=True, method="L-BFGS-B",
                   options={"maxiter": 20000, "gtol": 1e-13, "ftol": 1e-16, "maxcor": 20})
    Wd_ref, b_ref = obj.unpack(res.x)
    scale = np.abs(Wd_ref).max()
    assert np.abs(sol.Wd - Wd_ref).max() <= 1e-6 * scale
    if loss == "softmax":                      # the softmax bias is defined up to a common shift
        assert np.allclose(sol.b - sol.b.mean(), b_ref - b_ref.mean(), atol=1e-6 * max(1, scale))
    else:
        assert np.allclose(sol.b, b_ref, atol=1e-6 * max(1, scale))
    assert f <= res.fun * (1 + 1e-12)


CASES = [("softmax", 0.3), ("softmax", 1e-3), ("sigmoid", [0.1, 1.0, 10.0, 0.01])]


def _float64_twin(obj):
    """The same objective (same rotated features, labels) computed in float64."""
    rp = obj.rp
    rp64 = _logreg.RotatedProblem(Xh=np.asarray(rp.Xh, dtype=np.float64), V=rp.V, mean=rp.mean, s=rp.s,
                                  xp=rp.xp, dtype=np.float64)
    y = np.asarray(obj.yrow[0]) if obj.loss == "softmax" else (np.asarray(obj.sign).T > 0).astype(np.float64)
    return _logreg.LogisticObjective(rp64, y, obj.K, loss=obj.loss)


@pytest.mark.parametrize("loss,lam", CASES)
def test_gradient_floor_bounds_the_float32_gradient_error(loss, lam):
    """gradient_floor bounds |g_float32 − g_float64| entrywise, at a random point and at the optimum
    (measured: 0.2-1.6 % of the bound, which is a worst case), whatever the BLAS kernel."""
    obj, rng = problem(loss=loss, dtype=np.float32)
    twin = _float64_twin(obj)
    obj.set_lambda(lam), twin.set_lambda(lam)
    sol = obj.solve(lam, tol=1e-4)
    for theta in (rng.normal(size=obj.r * obj.K + obj.K), obj.pack(sol.Wd, sol.b)):
        (_, g), (_, g64) = obj(theta), twin(theta)
        floor = obj.gradient_floor(theta)
        assert np.all(np.abs(g - g64) <= floor)
        assert np.max(np.abs(g - g64) / floor) > 1e-4  # a bound, not a number too large to matter


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_line_search_logits_equal_direct_product(loss, dtype, rtol):
    """L(θ + αp) = L(θ) + α·L(p) (the trial state) equals the state from a direct product, and the
    trial's φ'(0), φ''(0) are the directional derivatives of f."""
    obj, rng = problem(loss=loss, dtype=dtype, seed=1)
    obj.set_lambda(0.5)
    theta = rng.normal(size=obj.r * obj.K + obj.K)
    p = rng.normal(size=theta.size)
    st = obj._state_at(theta)
    Ld = obj._linear(obj._logits_t(*obj.unpack(p)), state=False)
    for alpha in (0.0, 0.37, 2.5):
        trial = np.asarray(st.L + alpha * Ld, dtype=np.float64)
        direct = np.asarray(obj._state_at(theta + alpha * p).L, dtype=np.float64)
        np.testing.assert_array_equal(np.isinf(trial), np.isinf(direct))
        fin = np.isfinite(direct)
        assert np.all(np.isfinite(trial) == fin)
        scale = np.abs(direct[fin]).max()
        assert np.abs(trial[fin] - direct[fin]).max() <= rtol * scale
    if dtype == np.float64:
        f, g = obj(theta)
        pt = obj._point(st)
        d1, d2 = obj._slopes(pt, Ld)
        Wd, _ = obj.unpack(theta)
        dW, _ = obj.unpack(p)
        dphi = (d1 + 2 * np.sum(obj.lam * Wd * dW)) / obj.n
        d2phi = (d2 + 2 * np.sum(obj.lam * dW * dW)) / obj.n
        assert dphi == pytest.approx(float(g @ p), rel=1e-10)
        h = 1e-5
        gp = obj(theta + h * p)[1] @ p
        gm = obj(theta - h * p)[1] @ p
        assert d2phi == pytest.approx((gp - gm) / (2 * h), rel=1e-5)


def test_sweep_start_state_equals_direct_product():
    """The extrapolated warm start's logits (combination of two solutions' states) equal X·θ0."""
    obj, _ = problem(seed=2)
    sols = [sol for _, sol in obj.sweep(np.array([10.0, 1.0]), tol=1e-8)]
    a, b = sols[1], sols[0]
    st = obj._combine(a.state, b.state, 0.8)
    direct = obj._state_at(obj.pack(a.Wd + 0.8 * (a.Wd - b.Wd), a.b + 0.8 * (a.b - b.b))).L
    fin = np.isfinite(direct)
    np.testing.assert_array_equal(fin, np.isfinite(st.L))
    np.testing.assert_allclose(st.L[fin], direct[fin], rtol=0, atol=1e-12 * np.abs(direct[fin]).max())


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_two_products_per_iteration(loss):
    """Counts, not time: a solve does one product for the start's gradient (none for the logits
    at θ = 0) and two per iteration (direction, gradient at the accepted step); a warm-started sweep
    needs no product for its extrapolated starts' logits."""
    obj, _ = problem(n=400, p=20, k=5, seed=3, loss=loss)
    sol = obj.solve(1e-2 if loss == "softmax" else 1.0, tol=1e-9, max_iter=500)
    assert sol.converged and sol.n_iter > 5
    assert obj.n_refreshes == 0
    assert obj.n_products == 2 * sol.n_iter + 1
    assert obj.n_evals == sol.n_iter + 1
    assert obj.n_trials <= 2 * sol.n_iter            # a near-exact line search with few trials
    obj2, _ = problem(n=400, p=20, k=5, seed=3, loss=loss)
    lams = np.logspace(3, -3, 13)
    iters = sum(sol.n_iter for _, sol in obj2.sweep(lams, tol=1e-4))
    # + one product per REFRESH_AGE linear updates of the logits
    assert obj2.n_products == 2 * iters + lams.size + obj2.n_refreshes
    assert obj2.n_refreshes <= iters // _logreg.REFRESH_AGE + 1


def test_refresh_recomputes_drifted_logits(monkeypatch):
    """After REFRESH_AGE linear updates the logits come from a product again (same optimum)."""
    obj, _ = problem(seed=4)
    ref = obj.solve(1e-3, tol=1e-10, max_iter=2000)
    monkeypatch.setattr(_logreg, "REFRESH_AGE", 3)
    obj2, _ = problem(seed=4)
    sol = obj2.solve(1e-3, tol=1e-10, max_iter=2000)
    assert sol.state.age < 3
    assert obj2.n_products > 2 * sol.n_iter + 1
    np.testing.assert_allclose(sol.Wd, ref.Wd, rtol=0, atol=1e-6 * np.abs(ref.Wd).max())


def test_unattainable_tol_in_float32_stops_early():
    """A tolerance below float32's precision of the gradient stops early, not after max_iter, at
    (nearly) the float64 optimum, converged: the gradient is within its rounding floor, which any
    correct arithmetic reaches (a stall or a failed line search above the floor is not converged)."""
    obj64, _ = problem(seed=5)
    ref = obj64.solve(0.1, tol=1e-10, max_iter=2000)
    obj32, _ = problem(seed=5, dtype=np.float32)
    sol = obj32.solve(0.1, tol=1e-14, max_iter=1000)
    assert sol.n_iter < 200 and sol.converged
    assert sol.message == "CONVERGENCE: |gradient| within its rounding floor", sol.message
    theta = obj32.pack(sol.Wd, sol.b)
    assert np.all(np.abs(obj32(theta)[1]) <= obj32.gradient_floor(theta))
    np.testing.assert_allclose(sol.Wd, ref.Wd, rtol=0, atol=1e-4 * np.abs(ref.Wd).max())
