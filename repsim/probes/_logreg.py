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
   products (see the solver below), with r < P whenever the features are rank deficient or P > N.
3. Diagonal preconditioning: in the rotated basis the Hessian at W = 0 is ``α diag(s) ⊗ (…) + 2λ``,
   (s = eigenvalues of X_cᵀX_c, α = 1/K for softmax, 1/4 for sigmoid). The optimiser works on
   ``Ŵ_jk = d_jk W̃_jk`` with ``d_jk = ((α s_j + 2λ_k)/N)^(-1/2)``, i.e. approximately whitened
   coordinates, which is what L-BFGS needs to converge in tens rather than thousands of iterations
   on raw network features. The bias is scaled by ``α^(-1/2)``.
4. The objective handed to L-BFGS is f / N (a mean), so tolerances do not depend on N.

The solver: L-BFGS (two-loop recursion, ``HISTORY`` = 20 pairs) on the parameter vector θ (r·K + K
floats, host NumPy float64), with a line search that uses that the logits are linear in θ. Let
``Z(θ) = X̂ Wd(θ) + b(θ)`` (n, K) and, for a search direction p, ``Z_p = X̂ dW + db`` (one product).
Then ``Z(θ + αp) = Z(θ) + α Z_p`` and, with the residual ``R(α) = ∂loss/∂z`` at those logits,

    φ(α)   = f(θ + αp) = ( Σ_i loss_i(Z + α Z_p) + P0 + 2α P1 + α² P2 ) / n
    φ'(α)  = ( ⟨R(α), Z_p⟩ + 2 P1 + 2α P2 ) / n
    φ''(α) = ( Σ_i Z_p,iᵀ H_i(α) Z_p,i + 2 P2 ) / n

(P0 = Σ_k λ_k‖Wd_k‖², P1 = Σ_k λ_k Wd_k·dW_k, P2 = Σ_k λ_k‖dW_k‖²; H_i = diag(p_i) − p_i p_iᵀ for
softmax, diag(σ(1 − σ)) for sigmoid). A trial step therefore costs O(n·K) elementwise work and no
product; φ is convex, and the search is a safeguarded Newton iteration on φ' (bracket, secant,
bisection) until sufficient decrease and ``|φ'(α)| <= C2·|φ'(0)|`` (C2 = 0.1), mostly 1-2 trials.
Only the accepted point needs the gradient ``X̂ᵀ R`` (one product): two products per iteration,
where scipy's L-BFGS-B driver (used before) needed f and the full gradient, i.e. two products, at
every trial point. The logits are kept in a linear form, (K, n) so that reductions over classes
are contiguous: softmax ``L = z − z_y`` with −inf at the label (``CE_i = m + log1p(s + expm1(−m))``,
m = max(0, max_k L_k), s = Σ_{k≠y} exp(L_k − m): exact for well-classified examples even in float32),
sigmoid the margin ``±z``. Updating L by ``L + α L_p`` accumulates rounding (float32, 10,000 × 512
sweep: ≤ 5e-6·max|L| after 134 updates), so L is recomputed by a product every ``REFRESH_AGE``
updates. Along the λ sweep the extrapolated start ``θ_a + t(θ_a − θ_b)`` gets its logits from the same
combination of the two solutions' L (no product), and the L-BFGS pairs carry over exactly: a pair is
stored as (s, Δ∇ data term) in the unscaled coordinates, and the penalty's part of Δ∇ is 2λ·s/n for
any λ (``CARRY_MEMORY``). Array work uses the module of the features (NumPy on CPU, CuPy on a GPU,
array-api-strict in tests); per iteration only θ-sized vectors cross to the host. Sums are
accumulated in float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repsim.array_api import array_namespace, asarray_like, on_device, to_numpy


@dataclass
class Solution:
    """Weights in the rotated basis (``Wd``: (r, K) actual rotated weights) and centred bias ``b``.

    ``state`` (the logits in their linear form) and ``memory`` (L-BFGS pairs) are what the solver
    that produced it (``memory_owner``) reuses when the solution seeds its next λ.
    """

    Wd: np.ndarray
    b: np.ndarray
    n_iter: int
    converged: bool
    message: str = ""
    state: Any = field(default=None, repr=False, compare=False)   # _State of the logits, if known
    memory: Any = field(default=None, repr=False, compare=False)  # L-BFGS pairs, λ-free (see solve)
    memory_owner: Any = field(default=None, repr=False, compare=False)


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
    if p > n and n * n * 8 > GRAM_BYTES:
        raise ValueError(f"features of {n} rows x {p} columns (wider than n): the rotation's {n} x {n} Gram "
                         f"would take {n * n * 8 / 2**30:.1f} GiB; the linear probe solves this size without "
                         "one (repsim.probes._streamed)")
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
        Vt = xp.matmul(xp.permute_dims(Xc, (1, 0)), asarray_like(U, Xc, xp, dt))
        V, _ = np.linalg.qr(to_numpy(xp.astype(Vt, xp.float64)))
    Xh = xp.matmul(Xc, asarray_like(V, Xc, xp, dt))
    del Xc
    s_diag = np.asarray(to_numpy(xp.sum(Xh * Xh, axis=0)), dtype=np.float64)
    return RotatedProblem(Xh=Xh, V=V, mean=mean, s=s_diag, xp=xp, dtype=dt)


GRAM_BYTES = 128 << 20   # largest N × N Gram (layers wider than n) a probe builds: n <= 4,096
RUN_TOL_FACTOR = 0.5
HISTORY = 20            # L-BFGS memory (pairs)
C1, C2 = 1e-4, 0.1      # line search: sufficient decrease, |φ'(α)| <= C2·|φ'(0)|
MAX_TRIALS = 20         # line-search trials per iteration
REFRESH_AGE = 200       # recompute the logits by a product after this many linear updates
CARRY_MEMORY = True     # start each λ of a sweep with the previous λ's L-BFGS pairs (module doc)
STALL_ITERS = 10        # see solve: stop when neither max|∇| nor f (beyond rounding) improve
STALL_RESTARTS = 2      # see solve: restarts (fresh logits, empty memory) before a stall stops


@dataclass
class _State:
    """Linear state of the logits at one point, (K, n) in the compute dtype (see module doc).

    softmax: ``L[k, i] = z_ik − z_iy_i`` with −inf at k = y_i; sigmoid: ``L[k, i] = ±z_ik`` (the
    margin, + for positive targets). ``age``: linear updates since it was last computed by a product.
    """

    obj: Any
    L: Any
    age: int = 0


@dataclass
class _Point:
    """What the loss at one state leaves behind for the gradient and the line search."""

    state: _State
    data: float          # Σ_i loss_i (float64)
    E: Any               # softmax: exp(L − m) (0 at y); sigmoid: σ(−L)
    s: Any = None        # softmax: Σ_k E (1, n)
    T: Any = None        # softmax: s + exp(−m) (1, n)


class LogisticObjective:
    """Loss and gradient of the (preconditioned, mean-normalised) objective on rows ``[0, n)`` of Xh,
    and the L-BFGS solver with the linear-logits line search (see the module doc).

    Counters: ``n_evals`` (points where f and the full gradient were computed), ``n_products``
    ((n, r)×(r, K)-sized products: directions, gradients, fresh logits), ``n_trials`` (line-search
    trials, each O(n·K) elementwise work and no product), ``n_refreshes`` (logits recomputed after
    ``REFRESH_AGE`` linear updates; included in ``n_products``).
    """

    def __init__(self, rp: RotatedProblem, y: np.ndarray, n_classes: int, *, n: int | None = None,
                 loss: str = "softmax"):
        if loss not in ("softmax", "sigmoid"):
            raise ValueError(f"loss must be 'softmax' or 'sigmoid', got {loss!r}")
        xp, dt = rp.xp, rp.dtype
        self.rp, self.xp, self.dt, self.loss = rp, xp, dt, loss
        self.n = int(n if n is not None else rp.Xh.shape[0])
        self.X = rp.Xh[: self.n, ...]
        self.device = getattr(rp.Xh, "device", None)  # where the arrays made here go (None: streamed, host)
        self.K = int(n_classes)
        y = np.asarray(y)
        if loss == "softmax":
            if y.shape != (self.n,):
                raise ValueError(f"softmax labels must have shape ({self.n},), got {y.shape}")
            Yt = np.zeros((self.K, self.n), dtype=bool)
            Yt[y, np.arange(self.n)] = True
            self.Ymask = self._put(Yt)                                     # (K, n)
            self.yrow = self._put(y.astype(np.int64)[None, :])             # (1, n)
            self.neg_inf = self._put(-np.inf, dt)
        else:
            if y.shape != (self.n, self.K):
                raise ValueError(f"sigmoid targets must have shape ({self.n}, {self.K}), got {y.shape}")
            self.sign = self._put(2.0 * y.T.astype(np.float64) - 1.0, dt)  # (K, n), ±1
        self.zero = self._put(0.0, dt)
        self.alpha = 1.0 / self.K if loss == "softmax" else 0.25
        self.r = rp.rank
        self.lam = np.zeros(self.K)
        self.d = np.ones((self.r, self.K))
        self.cb = 1.0 / np.sqrt(self.alpha)
        self.n_evals = 0
        self.n_products = 0
        self.n_trials = 0
        self.n_refreshes = 0

    def _put(self, a: Any, dtype: Any = None) -> Any:
        """Host data ``a`` as an array of the problem's namespace, on its features' device."""
        return on_device(self.xp.asarray, a, dtype=dtype, device=self.device)

    # ---- parameter packing -------------------------------------------------------------------
    def set_lambda(self, lam: float | np.ndarray) -> None:
        lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (self.K,)).copy()
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

    # ---- logits in their linear form ---------------------------------------------------------
    def logits(self, X: Any, Wd: np.ndarray, b: np.ndarray) -> Any:
        """(m, K) logits of the rows of X (rotated features) for rotated weights Wd and bias b."""
        xp, dt = self.xp, self.dt
        if _streamed(X):
            return X.t_matmul(np.ascontiguousarray(Wd.T)).T + xp.asarray(b, dtype=dt)
        return xp.matmul(X, asarray_like(Wd, X, xp, dt)) + asarray_like(b, X, xp, dt)

    def _logits_t(self, Wd: np.ndarray, b: np.ndarray) -> Any:
        """(K, n) logits ``Wdᵀ Xᵀ + b``: one product."""
        xp, dt = self.xp, self.dt
        self.n_products += 1
        if _streamed(self.X):
            return self.X.t_matmul(np.ascontiguousarray(Wd.T)) + xp.asarray(b[:, None], dtype=dt)
        Zt = xp.matmul(self._put(np.ascontiguousarray(Wd.T), dt), xp.permute_dims(self.X, (1, 0)))
        return Zt + self._put(b[:, None], dt)

    def _linear(self, Zt: Any, *, state: bool) -> Any:
        """The linear form of logits Zt (K, n); ``state=False`` (a direction) keeps 0 instead of −inf
        at y, so that ``L + α·L_d`` keeps −inf there."""
        xp = self.xp
        if self.loss == "sigmoid":
            return self.sign * Zt
        D = Zt - xp.take_along_axis(Zt, self.yrow, axis=0)        # exactly 0 at y
        return xp.where(self.Ymask, self.neg_inf, D) if state else D

    def _state_at(self, theta: np.ndarray) -> _State:
        if not np.any(theta):
            xp = self.xp
            L = on_device(xp.zeros, (self.K, self.n), dtype=self.dt, device=self.device)
            return _State(self, self._linear(L, state=True) if self.loss == "softmax" else L)
        return _State(self, self._linear(self._logits_t(*self.unpack(theta)), state=True))

    def _combine(self, a: _State, b: _State, t: float) -> _State:
        """State of ``θ_a + t (θ_a − θ_b)`` from those of θ_a and θ_b (no product)."""
        xp, t = self.xp, float(t)
        if self.loss == "sigmoid":
            L = a.L + t * (a.L - b.L)
        else:
            La = xp.where(self.Ymask, self.zero, a.L)
            Lb = xp.where(self.Ymask, self.zero, b.L)
            L = xp.where(self.Ymask, self.neg_inf, La + t * (La - Lb))
        return _State(self, L, max(a.age, b.age) + 1)

    # ---- loss, its derivatives along a direction, gradient -----------------------------------
    def _point(self, st: _State) -> _Point:
        xp = self.xp
        L = st.L
        if self.loss == "softmax":
            # CE_i = log(1 + Σ_{k≠y} e^{L_k}) = m + log1p(s + expm1(−m)), m = max(0, max_k L_k),
            # s = Σ_{k≠y} e^{L_k − m}: exact for well-classified examples (m = 0: log1p(s)).
            m = xp.maximum(xp.max(L, axis=0, keepdims=True), self.zero)
            E = _exp_in_place(L - m, xp)
            s = xp.sum(E, axis=0, keepdims=True)
            T = s + xp.exp(-m)
            ce = m + xp.log1p(s + xp.expm1(-m))
            data = float(xp.sum(xp.astype(ce, xp.float64)))
            return _Point(st, data, E, s, T)
        # sigmoid, margin L: loss = softplus(−L) = max(−L, 0) + log1p(e^{−|L|})
        e = xp.exp(-xp.abs(L))
        ce = xp.maximum(-L, self.zero) + xp.log1p(e)
        data = float(xp.sum(xp.astype(xp.sum(ce, axis=0), xp.float64)))
        q = xp.where(L >= 0, e, xp.ones_like(e)) / (1 + e)                 # σ(−L)
        return _Point(st, data, q)

    def _slopes(self, pt: _Point, Ld: Any) -> tuple[float, float]:
        """First and second derivative of Σ_i loss_i along the direction with linear form Ld."""
        xp = self.xp
        Q = pt.E * Ld                  # the one (K, n) temporary: products are taken in place
        if self.loss == "softmax":
            # dCE_i/dα = Σ_k p_k Ld_k (Ld = 0 at y), d² = Σ_k p_k Ld_k² − (Σ_k p_k Ld_k)²
            q1 = xp.sum(Q, axis=0, keepdims=True) / pt.T
            Q *= Ld
            q2 = xp.sum(Q, axis=0, keepdims=True) / pt.T
            d1 = float(xp.sum(xp.astype(q1, xp.float64)))
            d2 = float(xp.sum(xp.astype(q2 - q1 * q1, xp.float64)))
        else:
            # d loss/dα = −σ(−L) Ld, d² = σ(−L) σ(L) Ld²
            d1 = -float(xp.sum(xp.astype(xp.sum(Q, axis=0), xp.float64)))
            Q *= 1 - pt.E
            Q *= Ld
            d2 = float(xp.sum(xp.astype(xp.sum(Q, axis=0), xp.float64)))
        return d1, d2

    def _residual(self, pt: _Point) -> Any:
        """∂loss/∂z (K, n): softmax(z) − onehot(y), or σ(z) − y."""
        xp = self.xp
        if self.loss == "softmax":
            return xp.where(self.Ymask, -pt.s / pt.T, pt.E / pt.T)
        return -self.sign * pt.E

    def _fg(self, theta: np.ndarray, pt: _Point) -> tuple[float, np.ndarray, np.ndarray]:
        """Mean objective, its gradient in θ, and the gradient of the mean data term alone in the
        unscaled coordinates (Wd, b), at the point whose loss is ``pt``: one product."""
        xp = self.xp
        self.n_evals += 1
        self.n_products += 1
        R = self._residual(pt)
        gW = (self.X.matmul_left(R) if _streamed(self.X)
              else to_numpy(xp.astype(xp.matmul(R, self.X), xp.float64))).T     # (r, K)
        gb = to_numpy(xp.astype(xp.sum(R, axis=1), xp.float64))
        Wd, _ = self.unpack(theta)
        f = (pt.data + float(np.sum(self.lam[None, :] * Wd * Wd))) / self.n
        gWd = (gW + 2.0 * self.lam[None, :] * Wd) / self.n
        return (f, np.concatenate([(gWd * self.d).ravel(), gb * self.cb / self.n]),
                np.concatenate([gW.ravel(), gb]) / self.n)

    def gradient_floor(self, theta: np.ndarray) -> np.ndarray:
        """Bound on the rounding error of the gradient that :meth:`__call__` returns at θ, per entry
        (first order in the unit roundoff u of the compute dtype; three products). With γ_m = mu/(1 - mu):

        - logits z_ik = x̂_i·Wd_k + b_k: |Δz_ik| <= γ_{r+1} a_ik, a = |X̂||Wd| + |b|; the softmax form
          L = z − z_y adds one rounding, so δ_i = max_k |ΔL_ik| <= 2γ_{r+2} max_k a_ik (sigmoid:
          δ_ik = γ_{r+1} a_ik);
        - residuals: ∂p_k/∂L_j = p_k(1[k=j] − p_j) gives |ΔR_ik| <= (2δ_i + (K + 8)u)|R_ik| for softmax
          (the label entry −Σ_{k≠y} p_k likewise), (δ_ik + 8u)|R_ik| for sigmoid (exp, sums, division);
        - the product Rᵀ X̂ over n rows: γ_n (|R|ᵀ|X̂|) + |ΔR|ᵀ|X̂| (the bias: the same with X̂ = 1);

        then scaled as the gradient is (d/n, c_b/n), plus u|2λ Wd| d/n for the penalty. Any correct
        arithmetic (summation order, FMA, vector width) computes the gradient within it, so a gradient
        inside it cannot be told from 0: :meth:`solve` accepts it when a stall leaves it there."""
        xp = self.xp
        u = float(np.finfo(np.float64 if self.dt == xp.float64 else np.float32).eps) / 2

        def gamma(m: int) -> float:
            return m * u / (1 - m * u)

        Wd, b = self.unpack(theta)
        R = self._residual(self._point(self._state_at(theta)))                      # (K, n)
        if _streamed(self.X):                     # the same bound, block by block
            absWt = np.abs(Wd.T).astype(self.dt)
            A = np.empty((self.K, self.n))
            for pos, absXb in self.X.abs_blocks():
                A[:, pos] = absWt @ absXb.T
                del absXb
            A += np.abs(b)[:, None]
        else:
            absX = xp.abs(self.X)
            A = xp.matmul(self._put(np.abs(Wd.T), self.dt), xp.permute_dims(absX, (1, 0)))
            A = xp.astype(A, xp.float64) + self._put(np.abs(b)[:, None])           # (K, n)
        aR = xp.abs(xp.astype(R, xp.float64))
        if self.loss == "softmax":
            delta = 2 * gamma(self.r + 2) * xp.max(A, axis=0, keepdims=True)
            dR = (2 * delta + (self.K + 8) * u) * aR
        else:
            dR = (gamma(self.r + 1) * A + 8 * u) * aR
        if _streamed(self.X):
            M = gamma(self.n) * aR + dR
            fW = np.zeros((self.K, self.r))
            for pos, absXb in self.X.abs_blocks():
                fW += np.ascontiguousarray(M[:, pos]) @ absXb.astype(np.float64)
                del absXb
            fW = fW.T
        else:
            X64 = xp.astype(absX, xp.float64)
            fW = to_numpy(gamma(self.n) * xp.matmul(aR, X64) + xp.matmul(dR, X64)).T        # (r, K)
        fb = to_numpy(gamma(self.n) * xp.sum(aR, axis=1) + xp.sum(dR, axis=1))
        fW = (fW + u * np.abs(2.0 * self.lam[None, :] * Wd)) * self.d / self.n
        return np.concatenate([fW.ravel(), fb * self.cb / self.n])

    def __call__(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """(f, ∇f) at θ from scratch (two products)."""
        return self._fg(theta, self._point(self._state_at(theta)))[:2]

    # ---- L-BFGS with the linear-logits line search -------------------------------------------
    def _line_search(self, theta, p, f0, dphi0, pt0, Ld):
        """Minimise φ(α) = f(θ + α p) near-exactly; every trial is elementwise work on
        ``L + α·Ld`` (φ is convex: safeguarded Newton on φ' inside a bracket). Returns (α, point)
        of a step with sufficient decrease and |φ'(α)| <= C2·|φ'(0)|, or the best step with
        sufficient decrease after MAX_TRIALS, or (0, None)."""
        Wd, _ = self.unpack(theta)
        dW, _ = self.unpack(p)
        lamW = self.lam[None, :] * dW
        P1, P2 = float(np.sum(lamW * Wd)), float(np.sum(lamW * dW))
        P0 = float(np.sum(self.lam[None, :] * Wd * Wd))
        n = self.n
        lo, hi, dlo, dhi = 0.0, np.inf, dphi0, np.inf
        lo_state = None  # the lower bracket's logits; its loss arrays are made again if it is returned
        alpha = 1.0
        for _ in range(MAX_TRIALS):
            self.n_trials += 1
            alpha = float(alpha)
            pt = None  # the last trial's (K, n) arrays go before this one's are made (lo_state keeps the best)
            L = Ld * alpha
            L += pt0.state.L
            pt = self._point(_State(self, L, pt0.state.age + 1))
            del L
            d1, d2 = self._slopes(pt, Ld)
            phi = (pt.data + P0 + 2 * alpha * P1 + alpha * alpha * P2) / n
            dphi = (d1 + 2 * P1 + 2 * alpha * P2) / n
            d2phi = (d2 + 2 * P2) / n
            if not (np.isfinite(phi) and np.isfinite(dphi)):
                hi, dhi = alpha, np.inf
            else:
                # by convexity φ(α) <= φ(0) + α φ'(α), so φ'(α) <= C1 φ'(0) is sufficient decrease
                # too (and immune to rounding in φ)
                armijo = phi <= f0 + C1 * alpha * dphi0 or dphi <= C1 * dphi0
                if armijo and abs(dphi) <= C2 * abs(dphi0):
                    return alpha, pt
                if armijo and dphi < 0:
                    lo, dlo, lo_state = alpha, dphi, pt.state
                else:
                    hi, dhi = alpha, dphi
            # next trial: Newton on φ' from α, kept inside the bracket (secant / bisection otherwise)
            cand = alpha - dphi / d2phi if np.isfinite(d2phi) and d2phi > 0 and np.isfinite(dphi) \
                else np.nan
            if hi == np.inf:
                alpha = min(cand, 10 * alpha) if cand > alpha else 4 * alpha
            else:
                width = hi - lo
                if not (lo + 0.01 * width < cand < hi - 0.01 * width):
                    cand = lo - dlo * width / (dhi - dlo) if np.isfinite(dhi) and dhi > dlo else np.nan
                    if not (lo + 0.01 * width < cand < hi - 0.01 * width):
                        cand = lo + 0.5 * width
                alpha = cand
            if hi - lo <= 1e-10 * hi:
                break
        pt = None
        return (lo, self._point(lo_state)) if lo_state is not None else (0.0, None)

    def solve(self, lam: float | np.ndarray, init: Solution | None = None, *, tol: float = 1e-6,
              max_iter: int = 1000, run_tol: float | None = None) -> Solution:
        """Minimise f for ``lam``, warm-started from ``init`` (a solution at another λ) when given.

        Stops when the preconditioned gradient's largest entry is below ``tol`` times the (mean)
        objective (converged); when the line search finds no decrease or the iterations stall at the
        rounding level (``STALL_ITERS``): converged if every gradient entry is then within its
        rounding floor (:meth:`gradient_floor`, a bound that holds for any correct arithmetic, so a
        ``tol`` below the gradient's precision still ends converged), else a stall first restarts
        from logits recomputed by a product with an empty memory (up to ``STALL_RESTARTS`` times;
        the linear updates' drift and noisy secant pairs had stalled OpenBLAS's AVX-512 kernel at
        max|∇|/f = 1.9e-11, the Haswell kernel going on to 1e-11); or after ``max_iter`` iterations. ``run_tol`` (≤ tol, default tol):
        a start that meets ``tol`` is returned as is, but once L-BFGS has to run it goes on to
        ``run_tol`` (see :meth:`sweep` for why). ``init.state`` / ``init.memory`` (the logits and
        L-BFGS pairs of a solution of this objective) save the start's logits product and seed the
        memory.
        """
        run_tol = tol if run_tol is None else min(run_tol, tol)
        self.set_lambda(lam)
        if init is None:
            theta = np.zeros(self.r * self.K + self.K)
            st = self._state_at(theta)
        else:
            theta = self.pack(init.Wd, init.b)
            st = init.state if init.state is not None and init.state.obj is self else None
            st = self._state_at(theta) if st is None else st
        # Stopping rule, relative to the current objective: stop once max|∇f̃| <= tol · f (f = the
        # mean objective, ∇f̃ its gradient in the preconditioned coordinates). An absolute gtol would
        # stop small-λ problems on (nearly) separable data at once, where f and ∇f are tiny; one
        # relative to the starting value would make the result depend on the warm start.
        pt = self._point(st)
        f, g, gd = self._fg(theta, pt)
        pt.E = pt.s = pt.T = None                 # only its state is needed from here on (memory)
        # L-BFGS memory carried over from the previous λ: pairs (s, y_data) in the unscaled
        # coordinates (Wd, b); y_data is the change of the data term's gradient, which does not
        # depend on λ, and the quadratic penalty adds exactly 2λ s / n, so the pairs are exact
        # secant pairs of this λ's objective too.
        mem = list(init.memory) if CARRY_MEMORY and init is not None and init.memory is not None \
            and init.memory_owner is self else []
        if np.max(np.abs(g)) <= tol * f:          # the (extrapolated) warm start already qualifies
            return self._solution(theta, pt.state, 0, True,
                                  "CONVERGENCE: max |gradient| <= tol * f at the start", mem)
        scale = np.concatenate([self.d.ravel(), np.full(self.K, self.cb)])
        rk = self.r * self.K
        S: list[np.ndarray] = []
        Yv: list[np.ndarray] = []

        def add(su, yu):
            yl = yu.copy()
            yl[:rk] += (2.0 / self.n) * (self.lam[None, :] * su[:rk].reshape(self.r, self.K)).ravel()
            s, yv = su / scale, yl * scale
            if float(s @ yv) > 1e-12 * float(yv @ yv):
                S.append(s), Yv.append(yv), mem.append((su, yu))
                if len(S) > HISTORY:
                    S.pop(0), Yv.pop(0), mem.pop(0)

        old, mem[:] = list(mem), []
        for su, yu in old:
            add(su, yu)
        converged, message, it = False, "STOP: max_iter reached", 0
        g_best, f_best, since, restarts = float(np.max(np.abs(g))), f, 0, 0
        eps = float(np.finfo(np.float64 if self.dt == self.xp.float64 else np.float32).eps)
        while it < max_iter:
            p = -_two_loop(g, S, Yv)
            dphi0 = float(g @ p)
            if not dphi0 < 0:                     # not a descent direction: forget the memory
                S.clear(), Yv.clear(), mem.clear()
                p, dphi0 = -g, -float(g @ g)
            Ld = self._linear(self._logits_t(*self.unpack(p)), state=False)
            alpha, new = self._line_search(theta, p, f, dphi0, pt, Ld)
            if new is None and S:                 # retry once along the steepest descent
                S.clear(), Yv.clear(), mem.clear()
                p, dphi0 = -g, -float(g @ g)
                Ld = self._linear(self._logits_t(*self.unpack(p)), state=False)
                alpha, new = self._line_search(theta, p, f, dphi0, pt, Ld)
            if new is None:
                if np.all(np.abs(g) <= self.gradient_floor(theta)):
                    converged, message = True, "CONVERGENCE: |gradient| within its rounding floor"
                else:
                    message = "ABNORMAL: line search found no decrease"
                break
            del Ld
            pt = None                             # the previous point's logits go before R is made
            it += 1
            theta_new = theta + alpha * p
            if new.state.age >= REFRESH_AGE:      # bound the rounding drift of L + α·L_d
                self.n_refreshes += 1
                new = self._point(self._state_at(theta_new))
            f_new, g_new, gd_new = self._fg(theta_new, new)
            new.E = new.s = new.T = None
            add((alpha * p) * scale, gd_new - gd)
            theta, f, g, gd, pt = theta_new, f_new, g_new, gd_new, new
            gmax = float(np.max(np.abs(g)))
            if gmax <= run_tol * f:
                converged, message = True, "CONVERGENCE: max |gradient| <= tol * f"
                break
            # Stall: max|∇| has not improved for STALL_ITERS iterations and f has not moved beyond
            # rounding over them (a tolerance below the precision of the gradient). A test on the
            # decrease of f alone would stop float64 runs long before a tight tol: near the optimum
            # f − f* ~ |∇|², far below the rounding of f.
            if gmax < 0.999 * g_best:
                g_best, f_best, since = gmax, f, 0
                continue
            since += 1
            if not (since >= STALL_ITERS and f_best - f <= 10 * eps * abs(f_best)):
                continue
            # Stalled. The linear updates of L have drifted by up to age·u·|L|, which moves the
            # gradient too: recompute L by a product and take the gradient there (on the AVX-512
            # kernel of OpenBLAS this alone moved max|∇|/f from 1.9e-11 to 5.9e-11).
            pt = self._point(self._state_at(theta))
            f, g, gd = self._fg(theta, pt)
            pt.E = pt.s = pt.T = None
            gmax = float(np.max(np.abs(g)))
            if gmax <= run_tol * f:
                converged, message = True, "CONVERGENCE: max |gradient| <= tol * f"
                break
            if np.all(np.abs(g) <= self.gradient_floor(theta)):
                converged, message = True, "CONVERGENCE: |gradient| within its rounding floor"
                break
            if restarts >= STALL_RESTARTS:
                message = "STOP: no progress beyond rounding (tol below the gradient's precision)"
                break
            # restart from the fresh state with an empty memory (secant pairs whose Δ∇ is at the
            # rounding level of the gradient are noise)
            restarts += 1
            S.clear(), Yv.clear(), mem.clear()
            g_best, f_best, since = gmax, f, 0
        if not converged and np.max(np.abs(g)) <= tol * f:
            converged, message = True, "CONVERGENCE: max |gradient| <= tol * f"
        return self._solution(theta, pt.state, it, converged, message, mem)

    def _solution(self, theta, state, n_iter, converged, message, mem) -> Solution:
        Wd, b = self.unpack(theta)
        return Solution(Wd=Wd, b=b, n_iter=int(n_iter), converged=bool(converged),
                        message=message, state=state, memory=mem, memory_owner=self)

    def sweep(self, lambdas: np.ndarray, *, warm_start: bool = True, extrapolate: bool = True,
              tol: float = 1e-4, max_iter: int = 1000, progress=None, run_tol: float | None = None):
        """Solve for each λ in the given order; yields (λ, Solution).

        Warm start: each problem starts from the previous λ's solution. ``extrapolate`` adds a
        predictor step along the regularisation path (linear in log λ through the last two
        solutions), which lands much closer to the next optimum than the previous solution does.
        The start's logits are the same combination of the two solutions' (no product), and the
        previous λ's L-BFGS pairs seed the memory (module doc).

        ``run_tol`` (default ``RUN_TOL_FACTOR · tol``): an extrapolated start that already meets
        ``tol`` is accepted as is, but when L-BFGS has to run it continues to ``run_tol``. Each
        solution is an anchor of the next extrapolation (``2·sol − prev`` on a uniform grid), which
        amplifies the anchors' own errors; anchors stopped just inside ``tol`` make every later start
        miss it by a little, and on the (nearly) separable small-λ end the ill-conditioned problem
        then needs tens of iterations per λ to close that small gap (50,000 × 2,048 × 100 benchmark,
        run_tol = tol = 1e-3: 155 of 223 sweep iterations went to the 12 λ ≤ 1e-3, whereas the
        extrapolated path from anchors converged to 1e-4 met 1e-3 at those λ with 5 iterations in
        all). A few extra iterations on the λ that run anyway buy anchors from which the next start
        often needs none (same benchmark with scipy's L-BFGS-B driver, factor 0.5: 136 sweep
        iterations, 0.3: 115, 0.1: 169; 0.5
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
                # the logits are linear in the parameters: the start's logits without a product
                st = (self._combine(sol.state, prev.state, t) if sol.state is not None
                      and prev.state is not None and sol.state.obj is self
                      and prev.state.obj is self else None)
                init = Solution(Wd=sol.Wd + t * (sol.Wd - prev.Wd), b=sol.b + t * (sol.b - prev.b),
                                n_iter=0, converged=True, state=st, memory=sol.memory,
                                memory_owner=sol.memory_owner)
            new = self.solve(lam, init, tol=tol, max_iter=max_iter,
                             run_tol=RUN_TOL_FACTOR * tol if run_tol is None else run_tol)
            prev, sol, prev_lam, lam_k = sol, new, lam_k, lam
            yield lam, sol


def _exp_in_place(x: Any, xp: Any) -> Any:
    """``exp(x)``, written over x with NumPy (``out=``; x is a temporary (K, n) array, so this saves
    one of them at the solver's peak); a new array in other namespaces, which the standard gives no
    ``out=``."""
    if xp is np and isinstance(x, np.ndarray):
        return np.exp(x, out=x)
    return xp.exp(x)


def _streamed(X: Any) -> bool:
    """Are the features a :class:`repsim.probes._streamed.StreamedX` (read in blocks) rather than an array?"""
    return hasattr(X, "t_matmul")


def _two_loop(g: np.ndarray, S: list, Y: list) -> np.ndarray:
    """L-BFGS two-loop recursion: H g for the inverse-Hessian estimate from the pairs (s, y),
    initial matrix (sᵀy / yᵀy) I from the newest pair (I without pairs: the coordinates are
    preconditioned)."""
    q = g.copy()
    rho = [1.0 / float(s @ y) for s, y in zip(S, Y)]
    a = []
    for s, y, r in zip(reversed(S), reversed(Y), reversed(rho)):
        ai = r * float(s @ q)
        q -= ai * y
        a.append(ai)
    if S:
        q *= float(S[-1] @ Y[-1]) / float(Y[-1] @ Y[-1])
    for s, y, r, ai in zip(S, Y, rho, reversed(a)):
        q += (ai - r * float(y @ q)) * s
    return q
