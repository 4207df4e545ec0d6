"""L2-regularised logistic regression on fixed features, solved with L-BFGS (paper App. A.2).

Objective, for weights W (P, K) and an unpenalised bias b (K,)::

    f(W, b) = Σ_i loss_i(x_i W + b) + Σ_k λ_k ‖W[:, k]‖²          (λ_k = λ for the multinomial probe)

``loss = "softmax"``: multinomial cross-entropy, the paper's probe; equal to scikit-learn's
``LogisticRegression(C=1/(2λ))``. ``loss = "sigmoid"``: independent binary cross-entropies, one per
column (the multi-label CheXpert probe of Table D.1, where each class has its own λ_k).

How it is made fast without changing the optimum (every step below is an exact reparameterisation,
so the minimiser in (W, b) is the same one scikit-learn finds; nothing is standardised):

1. Centring: ``x W + b = (x − μ) W + (b + μ W)``; the penalty does not involve b, so optimising over
   (W, b' = b + μW) with centred features is the same problem. Centring decouples the bias from the
   weights (post-ReLU features have large means, which makes the raw problem badly conditioned).
2. Rotation: with ``X_c = X − μ`` and the eigenvectors V (P, r) of ``X_cᵀ X_c`` (or, when P > N, an
   orthonormal basis of X_c's row space), ``W = V Ŵ``. The Frobenius penalty is rotation invariant
   and any component of W outside span(V) only adds penalty (X_c maps it to zero; a constant shift of
   the logits is absorbed by b'), so the optimum lies in span(V). Rotated features ``X̂ = X_c V``
   (N, r), r = min(P, N), are computed once; every L-BFGS iteration then costs two (N, r)×(r, K)
   products, as before, but with r < P whenever the features are rank deficient or P > N.
3. Diagonal preconditioning: in the rotated basis the Hessian at W = 0 is ``α diag(s) ⊗ (…) + 2λ``,
   (s = eigenvalues of X_cᵀX_c, α = 1/K for softmax, 1/4 for sigmoid). The optimiser works on
   ``Ŵ_jk = d_jk W̃_jk`` with ``d_jk = ((α s_j + 2λ_k)/N)^(-1/2)``, i.e. approximately whitened
   coordinates, which is what L-BFGS needs to converge in tens rather than thousands of iterations
   on raw network features. The bias is scaled by ``α^(-1/2)``.
4. The objective handed to L-BFGS is f / N (a mean), so tolerances do not depend on N.

The loss and gradient are computed with the array module of the features (NumPy on CPU, CuPy on a
GPU, array-api-strict in tests); only the parameter vector (r·K + K floats) crosses to the host per
iteration, where scipy's L-BFGS-B driver runs. Per-example losses use the stable
``CE_i = m + log1p(s + expm1(−m))`` form (m = max_j z_j − z_y, s = Σ_{j≠y} exp(z_j − z_y − m)), which
keeps relative precision for well-classified examples even in float32; sums are accumulated in float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import minimize

from repsim._xp import array_namespace, to_numpy


@dataclass
class Solution:
    """Weights in the rotated basis (``Wd``: (r, K) actual rotated weights) and centred bias ``b``."""

    Wd: np.ndarray
    b: np.ndarray
    n_iter: int
    converged: bool
    message: str = ""


@dataclass
class RotatedProblem:
    """Features centred and rotated once; rows ``[0, n)`` of ``Xh`` hold the examples.

    ``Xh = (X − mean) @ V`` in the compute dtype on the array module ``xp``; ``s`` (r,) float64 are the
    squared column norms of Xh (the diagonal of the rotated Gram matrix, used by the preconditioner).
    """

    Xh: Any
    V: np.ndarray            # (P, r) float64, orthonormal columns
    mean: np.ndarray         # (P,) float64
    s: np.ndarray            # (r,) float64
    xp: Any
    dtype: Any               # xp dtype used for the big products
    stats: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.V.shape[1])

    def to_original(self, Wd: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map rotated weights back: ``W = V Wd`` (P, K); ``b = b' − mean·W``."""
        W = self.V @ Wd
        return W, b - self.mean @ W


def compute_dtype(X: Any, xp: Any) -> Any:
    """float64 inputs are solved in float64; everything else (float16/float32 stores) in float32."""
    return xp.float64 if X.dtype == xp.float64 else xp.float32


def rotate(X: Any, *, xp: Any = None, overwrite: bool = False) -> RotatedProblem:
    """Centre X (N, P) and rotate it onto an orthonormal basis of its centred row space (see module doc).

    ``overwrite=True`` lets a NumPy X be centred in place (the caller's private copy), which keeps the
    peak memory at two feature matrices (X and the rotated one).
    """
    xp = xp or array_namespace(X)
    dt = compute_dtype(X, xp)
    X = xp.astype(X, dt) if X.dtype != dt else X
    n, p = X.shape
    # Any centre gives an exact reparameterisation, so its rounding does not matter; what matters is
    # that the centre used to map the bias back is the one subtracted.
    mu = xp.mean(X, axis=0)
    mean = np.asarray(to_numpy(mu), dtype=np.float64)
    if overwrite and xp is np and X.flags.writeable:
        X -= mu
        Xc = X
    else:
        Xc = X - mu
    if p <= n:
        G = to_numpy(xp.astype(xp.matmul(xp.permute_dims(Xc, (1, 0)), Xc), xp.float64))
        s, V = np.linalg.eigh((G + G.T) / 2)
        order = np.argsort(s)[::-1]
        V = V[:, order]
    else:
        # P > N: the row space has dimension ≤ N; take it from the (N, N) Gram and re-orthonormalise.
        G = to_numpy(xp.astype(xp.matmul(Xc, xp.permute_dims(Xc, (1, 0))), xp.float64))
        s, U = np.linalg.eigh((G + G.T) / 2)
        order = np.argsort(s)[::-1]
        s, U = s[order], U[:, order]
        keep = s > max(s[0], 0.0) * n * np.finfo(np.float64).eps * 10
        U = U[:, keep] / np.sqrt(s[keep])
        Vt = xp.matmul(xp.permute_dims(Xc, (1, 0)), xp.asarray(U, dtype=dt))
        V, _ = np.linalg.qr(to_numpy(xp.astype(Vt, xp.float64)))
    Xh = xp.matmul(Xc, xp.asarray(V, dtype=dt))
    del Xc
    s_diag = np.asarray(to_numpy(xp.sum(Xh * Xh, axis=0)), dtype=np.float64)
    return RotatedProblem(Xh=Xh, V=V, mean=mean, s=s_diag, xp=xp, dtype=dt)


RUN_TOL_FACTOR = 0.5


class LogisticObjective:
    """Loss and gradient of the (preconditioned, mean-normalised) objective on rows ``[0, n)`` of Xh."""

    def __init__(self, rp: RotatedProblem, y: np.ndarray, n_classes: int, *, n: int | None = None,
                 loss: str = "softmax"):
        if loss not in ("softmax", "sigmoid"):
            raise ValueError(f"loss must be 'softmax' or 'sigmoid', got {loss!r}")
        xp, dt = rp.xp, rp.dtype
        self.rp, self.xp, self.dt, self.loss = rp, xp, dt, loss
        self.n = int(n if n is not None else rp.Xh.shape[0])
        self.X = rp.Xh[: self.n, ...]
        self.K = int(n_classes)
        y = np.asarray(y)
        if loss == "softmax":
            if y.shape != (self.n,):
                raise ValueError(f"softmax labels must have shape ({self.n},), got {y.shape}")
            Y = np.zeros((self.n, self.K), dtype=np.float64)
            Y[np.arange(self.n), y] = 1.0
        else:
            if y.shape != (self.n, self.K):
                raise ValueError(f"sigmoid targets must have shape ({self.n}, {self.K}), got {y.shape}")
            Y = y.astype(np.float64)
        self.Y = xp.asarray(Y, dtype=dt)
        self.notY = 1 - self.Y
        self.alpha = 1.0 / self.K if loss == "softmax" else 0.25
        self.r = rp.rank
        self.lam = np.zeros(self.K)
        self.d = np.ones((self.r, self.K))
        self.cb = 1.0 / np.sqrt(self.alpha)
        self.n_evals = 0
        self._cache: tuple | None = None

    # ---- parameter packing -------------------------------------------------------------------
    def set_lambda(self, lam: float | np.ndarray) -> None:
        lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (self.K,)).copy()
        self._cache = None
        if np.any(lam < 0) or not np.all(np.isfinite(lam)):
            raise ValueError(f"regularisation strengths must be finite and >= 0, got {lam}")
        self.lam = lam
        self.d = 1.0 / np.sqrt((self.alpha * self.rp.s[:, None] + 2.0 * lam[None, :]) / self.n
                               + 1e-300)

    def pack(self, Wd: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.concatenate([(Wd / self.d).ravel(), b / self.cb])

    def unpack(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rk = self.r * self.K
        return theta[:rk].reshape(self.r, self.K) * self.d, theta[rk:] * self.cb

    # ---- objective ---------------------------------------------------------------------------
    def logits(self, X: Any, Wd: np.ndarray, b: np.ndarray) -> Any:
        xp, dt = self.xp, self.dt
        return xp.matmul(X, xp.asarray(Wd, dtype=dt)) + xp.asarray(b, dtype=dt)

    def __call__(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        if self._cache is not None and np.array_equal(self._cache[0], theta):
            return self._cache[1], self._cache[2].copy()
        f, g = self._evaluate(theta)
        self._cache = (theta.copy(), f, g)
        return f, g.copy()

    def _evaluate(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        xp = self.xp
        self.n_evals += 1
        Wd, b = self.unpack(theta)
        Z = self.logits(self.X, Wd, b)
        Y = self.Y
        if self.loss == "softmax":
            zy = xp.sum(Z * Y, axis=1, keepdims=True)
            D = Z - zy
            m = xp.max(D, axis=1, keepdims=True)          # >= 0
            E = xp.exp(D - m) * self.notY                   # exp(z_j - z_y - m), j != y
            s = xp.sum(E, axis=1, keepdims=True)
            T = s + xp.exp(-m)                             # Σ_j exp(z_j - z_y - m)
            ce = m + xp.log1p(s + xp.expm1(-m))
            R = E / T - Y * (s / T)                        # softmax(z) - onehot(y)
        else:
            ce = xp.maximum(Z, 0 * Z) - Z * Y + xp.log1p(xp.exp(-xp.abs(Z)))
            ez = xp.exp(-xp.abs(Z))
            sig = xp.where(Z >= 0, 1 / (1 + ez), ez / (1 + ez))
            R = sig - Y
        data = float(xp.sum(xp.astype(ce, xp.float64)))
        gW = to_numpy(xp.astype(xp.matmul(xp.permute_dims(self.X, (1, 0)), R), xp.float64))
        gb = to_numpy(xp.astype(xp.sum(R, axis=0), xp.float64))
        pen = float(np.sum(self.lam[None, :] * Wd * Wd))
        f = (data + pen) / self.n
        gWd = (gW + 2.0 * self.lam[None, :] * Wd) / self.n
        grad = np.concatenate([(gWd * self.d).ravel(), gb * self.cb / self.n])
        return f, grad

    def solve(self, lam: float | np.ndarray, init: Solution | None = None, *, tol: float = 1e-6,
              max_iter: int = 1000, run_tol: float | None = None) -> Solution:
        """Minimise f for ``lam``, warm-started from ``init`` (a solution at another λ) when given.

        Stops when the preconditioned gradient's largest entry is below ``tol`` times the (mean)
        objective, when f stops decreasing (relative change < 1e-12), or after ``max_iter`` iterations.
        ``run_tol`` (≤ tol, default tol): a start that meets ``tol`` is returned as is, but once
        L-BFGS has to run it goes on to ``run_tol`` (see :meth:`sweep` for why).
        """
        run_tol = tol if run_tol is None else min(run_tol, tol)
        self.set_lambda(lam)
        if init is None:
            theta0 = np.zeros(self.r * self.K + self.K)
        else:
            theta0 = self.pack(init.Wd, init.b)
        # Stopping rule, relative to the current objective: stop once max|∇f̃| <= tol · f (f = the
        # mean objective, ∇f̃ its gradient in the preconditioned coordinates). An absolute gtol would
        # stop small-λ problems on (nearly) separable data at once, where f and ∇f are tiny; one
        # relative to the starting value would make the result depend on the warm start. L-BFGS sees
        # f / f(θ0) so that its own ftol (a safety net, 1e-12) is relative as well.
        f0, g0 = self(theta0)
        if np.max(np.abs(g0)) <= tol * f0:          # the (extrapolated) warm start already qualifies
            Wd, b = self.unpack(theta0)
            return Solution(Wd=Wd, b=b, n_iter=0, converged=True,
                            message="CONVERGENCE: max |gradient| <= tol * f at the start")
        scale = 1.0 / max(f0, 1e-300)

        def scaled(theta):
            f, g = self(theta)
            return f * scale, g * scale

        stopped = []

        def done(intermediate_result):
            f, g = self(intermediate_result.x)
            if np.max(np.abs(g)) <= run_tol * f:
                stopped.append(True)
                raise StopIteration

        res = minimize(scaled, theta0, jac=True, method="L-BFGS-B", callback=done,
                       options={"maxiter": int(max_iter), "gtol": 1e-300, "ftol": 1e-12,
                                "maxcor": 20, "maxls": 50})
        if stopped:
            res.success, res.message = True, "CONVERGENCE: max |gradient| <= tol * f"
        elif not res.success:
            f, g = self(res.x)
            if np.max(np.abs(g)) <= tol * f:
                res.success, res.message = True, "CONVERGENCE: max |gradient| <= tol * f"
        Wd, b = self.unpack(res.x)
        return Solution(Wd=Wd, b=b, n_iter=int(res.nit), converged=bool(res.success),
                        message=str(res.message))

    def sweep(self, lambdas: np.ndarray, *, warm_start: bool = True, extrapolate: bool = True,
              tol: float = 1e-4, max_iter: int = 1000, progress=None, run_tol: float | None = None):
        """Solve for each λ in the given order; yields (λ, Solution).

        Warm start: each problem starts from the previous λ's solution. ``extrapolate`` adds a
        predictor step along the regularisation path (linear in log λ through the last two
        solutions), which lands much closer to the next optimum than the previous solution does.

        ``run_tol`` (default ``RUN_TOL_FACTOR · tol``): an extrapolated start that already meets
        ``tol`` is accepted as is, but when L-BFGS has to run it continues to ``run_tol``. Each
        solution is an anchor of the next extrapolation (``2·sol − prev`` on a uniform grid), which
        amplifies the anchors' own errors; anchors stopped just inside ``tol`` make every later start
        miss it by a little, and on the (nearly) separable small-λ end the ill-conditioned problem
        then needs tens of iterations per λ to close that small gap (50,000 × 2,048 × 100 benchmark,
        run_tol = tol = 1e-3: 155 of 223 sweep iterations went to the 12 λ ≤ 1e-3, whereas the
        extrapolated path from anchors converged to 1e-4 met 1e-3 at those λ with 5 iterations in
        all). A few extra iterations on the λ that run anyway buy anchors from which the next start
        often needs none (same benchmark, factor 0.5: 136 sweep iterations, 0.3: 115, 0.1: 169; 0.5
        is kept because on the 10,000 × 512 benchmark its validation curve stays as close to a
        tightly converged one as before, 0.3's did not at large λ). The optimum and the acceptance
        rule are unchanged: every returned solution still meets ``tol``.
        """
        prev = sol = None
        prev_lam = lam_k = None
        it = progress(lambdas) if progress else lambdas
        for lam in it:
            init = sol if warm_start else None
            if warm_start and extrapolate and prev is not None:
                t = np.log(lam / lam_k) / np.log(lam_k / prev_lam)
                init = Solution(Wd=sol.Wd + t * (sol.Wd - prev.Wd), b=sol.b + t * (sol.b - prev.b),
                                n_iter=0, converged=True)
            new = self.solve(lam, init, tol=tol, max_iter=max_iter,
                             run_tol=RUN_TOL_FACTOR * tol if run_tol is None else run_tol)
            prev, sol, prev_lam, lam_k = sol, new, lam_k, lam
            yield lam, sol
