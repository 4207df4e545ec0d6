"""Linear CKA: one-shot (Eq. 10) and the all-pairs minibatch estimator (paper §3.2).

Linear CKA (Kornblith et al. 2019; paper Eq. 10) of representations X (n, p1) and Y (n, p2) is

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)),    K = X Xᵀ,  L = Y Yᵀ.

*Biased* CKA uses HSIC₀(K, L) = tr(K H L H) / (n-1)² (H the centring matrix); with column-centred
features this is ⟨K, L⟩ / (n-1)² = ‖Xcᵀ Yc‖²_F / (n-1)², which is Eq. 10.
*Debiased* CKA uses the unbiased estimator of Song et al. (2012),

    HSIC₁(K, L) = [tr(K̃ L̃) + 1ᵀK̃1 · 1ᵀL̃1 / ((n-1)(n-2)) - 2/(n-2) · 1ᵀK̃ L̃1] / (n(n-3)),

K̃, L̃ the Grams with zeroed diagonals, which equals ⟨U(K), U(L)⟩ / (n(n-3)) with U the
U-centering of :func:`ucenter`. HSIC₁ is bilinear in (K, L), so for L layers one product of
U-centred, flattened Grams gives all L×L values at once (Nguyen, Raghu & Kornblith 2021, minibatch
CKA; paper §3.2):

    CKA_mb(i, j) = Σ_b HSIC₁(K_ib, K_jb) / sqrt(Σ_b HSIC₁(K_ib, K_ib) · Σ_b HSIC₁(K_jb, K_jb)).

Implementation of one batch (:func:`batch_hsic`) with NumPy — on an accelerator (CuPy, or any
array-API namespace but NumPy) the batch takes the route of :mod:`repsim.kernels._cka_device`
instead: whole Grams, one float64 A Aᵀ, one device-to-host copy, the same precision rule:

1. centre each layer's features in the batch (column means). HSIC₀ and HSIC₁ are invariant to
   it, and it removes the float32 cancellation that breaks peers on post-ReLU layers whose mean
   dwarfs their spread.
2. form each layer's Gram K and copy its entries K_ij, i < j, as float64 into layer l's row of
   A (L, m). The example rows are cut into panels of ``block_rows``: panel [a, b) is K[a:b, a:],
   stored with zeros on and below the diagonal of its leading (b-a) × (b-a) block, so a panel is
   one contiguous copy and the zeros add nothing to A Aᵀ (m = Σ (b-a)(n-a) ≈ n(n + block_rows)/2;
   A is split into groups of panels when it would exceed ``block_bytes``). The row sums
   R_l = K̃1 of the Gram with zeroed diagonal are summed from the same float64 copies. With NumPy
   the whole Gram is one SYRK (n²p FLOPs, half a GEMM) into a reused buffer when A holds every
   panel, else one GEMM per panel; a wide layer (p > 2·``GRAM_SLAB``, p >= 4n) becomes its
   centred Gram first (:func:`centred_gram`, slab by slab), and enters as a
   :class:`CentredGram`.
3. all pairs at once by Song's formula: tr(K̃L̃) = 2 A Aᵀ (symmetric product, a SYRK in NumPy),
   1ᵀK̃L̃1 = R Rᵀ, so H = [2 A Aᵀ + t tᵀ/((n-1)(n-2)) - 2/(n-2) R Rᵀ] / (n(n-3)) with t = R1;
   biased, H = (2 A Aᵀ + diag·diagᵀ) / (n-1)² with the Grams' diagonals. Song's formula holds
   for any symmetric K, so this is ⟨U(K), U(L)⟩ of the Grams exactly as computed — nothing
   assumes that their rows sum to zero.

With NumPy the L layers are spread over the BLAS thread budget (:mod:`repsim._blas`): k threads,
each forming whole layers with single-threaded BLAS in reused buffers; A Aᵀ is likewise split into
k column slabs, so no call runs multi-threaded BLAS (OpenBLAS's idle workers busy-wait ~0.1 s after
one, taking cores from whatever runs next). A itself is kept for the next batch
(:class:`_BufferCache`, :func:`release_buffers`): a fresh one costs page faults and TLB flushes.

Precision and error bound (docs/architecture.md "Numerics")
-------------------------------------------------------------
Each column's Gram precision comes from its dtype (:func:`repsim._xp.gram_dtype`, also used by the
out-of-core engine): float32 for float16/float32 layers, float64 for float64 (and integer) ones;
``compute_dtype`` overrides it.  A float32 column is computed as

(a) centred with float64 column means, rounded once (:func:`centre_rounded`):
    |X̂_c - X_c| <= 2u|X_c| + 2u²|x̄| elementwise, u = 2⁻²⁴ — the mean/spread ratio does not enter;
(b) Gram entries are float32 dot products over slabs of s <= ``GRAM_SLAB`` = 2048 features, the
    slabs summed in float64 (:func:`gram64`).  By the standard bound for inner products and
    matrix products (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002,
    Eq. (3.5) and §3.5: |fl(xᵀy) - xᵀy| <= γ_s |x|ᵀ|y|, γ_s = su/(1 - su)), together with (a),
    |K̂_ij - K_ij| <= ε |x_i|ᵀ|x_j| <= ε ‖x_i‖ ‖x_j‖,  ε = γ_s + 4u + O(u²);
(c) everything after the Gram in float64: A (the float32 Gram entries, copied exactly), the row
    sums, the products A Aᵀ (|error| <= γ_m |A||A|ᵀ with m ≈ n²/2 and u₆₄ = 2⁻⁵³) and R Rᵀ, the
    sums over batches. A holds raw Gram entries, whose common off-diagonal part (≈ -tr K/n² for a
    noise-like layer with p ≫ n) can make |A||A|ᵀ exceed n(n-3)·HSIC₁ by about p/n²: 61 at
    p = 10⁶, n = 128, i.e. ~1e-10 relative; ~2e-11 at n = 600 (against ~1e-6 in CKA when A Aᵀ
    was summed in float32).

U-centring is an orthogonal projection (for ⟨A, B⟩ = Σ_{i≠j} A_ij B_ij): K_ij - U(K)_ij = a_i + a_j
with a_i = r_i/(n-2) - S/(2(n-1)(n-2)) (r_i, S the row and total sums of ucenter's docstring),
and U(K) has zero row sums, so ⟨U(K), [a_i + a_j]⟩ = 2 Σ_i a_i Σ_j U(K)_ij = 0.  Hence an error E
in K moves h_KL = ⟨U(K), U(L)⟩ = n(n-3)·HSIC₁ by ⟨U(E_K), U(L)⟩ + ⟨U(K), U(E_L)⟩ +
⟨U(E_K), U(E_L)⟩, with ‖U(E)‖_F <= ‖E‖_F <= ε Σ_i ‖x_i‖² = ε tr K (Cauchy–Schwarz).  With
κ_K = tr K / ‖U(K)‖_F (>= 1; 3-6 for the post-ReLU layers of bench/cka_allpairs.py, about √p for
isotropic noise),

    |ΔCKA(K, L)| <= 2 (ε_K κ_K + ε_L κ_L) + O(ε² κ²)

(first order: the cross term contributes ε_Kκ_K + ε_Lκ_L, the two normalisers half of 2ε_Kκ_K and
2ε_Lκ_L).  Errors of the form [a_i + a_j] (a wrong diagonal, a residual column mean) are
projected out exactly.  The bound is a worst case: ε is ~2.3e-5 at s = 384, so κ = 6 gives
5.5e-4; under the probabilistic model of rounding errors (Higham & Mary 2019, SIAM J. Sci.
Comput. 41(5)), γ_s shrinks to about λ√s·u with failure probability about 2s·exp(-λ²/2), and the
errors of the n² entries also average out in ⟨U(E), U(L)⟩.  Measured against float64 on the hard
cases (tests/test_cka.py, bench/cka_allpairs.py: post-ReLU layers with mean/spread up to 10⁴,
p up to 10⁶ with κ ~ 1000, logits of sigmoid networks) the error is ~1e-8 to ~1e-7 depending on the
BLAS kernel's summation order (1.27e-7 on OpenBLAS's SkylakeX kernel, 1.0e-8 on Haswell), far inside
the bound, which is what the tests assert — it holds for any correct BLAS.  The accelerator route
(``kernels/_cka_device.py``) keeps the same rule; measured on an H200: 3e-9 (bench/RESULTS.md "gpu").
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Sequence

import numpy as np

from repsim._xp import (array_namespace, as_array, asarray_like, check_finite, diagonal, flatten_examples,
                        gram_dtype, row_sq_norms, to_numpy)
from repsim._xp import astype as _astype
from repsim.kernels._cka_device import centre_once, device_batch_hsic, gram_rows
from repsim.kernels._precision import (GRAM_SLAB, CentredGram, centre_rounded, constant_tolerance, is_constant,
                                      zero_constant)

__all__ = ["ucenter", "linear_cka", "batch_hsic", "hsic_to_cka", "MinibatchCKA", "CentredGram", "GRAM_SLAB",
           "release_buffers"]

_STATE_VERSION = 1
HOST_BLOCK_BYTES = 1 << 30  # default bound of the buffer A on NumPy (upper-triangle panels)
DEVICE_BLOCK_BYTES = 4 << 30  # ... and on an accelerator (whole Gram rows; kernels/_cka_device.py)



# ----------------------------------------------------------------------------------------------
# precision helpers (module docstring, "Error bound")
# ----------------------------------------------------------------------------------------------
def _is_numpy(xp: Any) -> bool:
    return getattr(xp, "__name__", "") == "numpy"


def _slabs(p: int) -> list[slice]:
    return [slice(s, min(p, s + GRAM_SLAB)) for s in range(0, p, GRAM_SLAB)] if p > GRAM_SLAB else [slice(None)]


def sq_norms64(Xc: Any, xp: Any) -> Any:
    """Squared row norms of Xc (the Gram's diagonal) in float64: float32 dot products over feature
    slabs of at most :data:`GRAM_SLAB`, the slabs summed in float64."""
    out = None
    for s in _slabs(Xc.shape[1]):
        part = row_sq_norms(Xc[:, s], xp)
        part = part if part.dtype == xp.float64 else _astype(part, xp.float64, xp)
        out = part if out is None else out + part
    return out


def gram64(A: Any, B: Any, xp: Any, scratch: "_HostScratch | None" = None, key: str = "gram") -> Any:
    """A Bᵀ (rows · rows) with float32 products summed over feature slabs of at most
    :data:`GRAM_SLAB` and the slabs in float64; a single product (in the inputs' dtype) when the
    features fit one slab.  Same buffer for A and B: a SYRK in NumPy.  With ``scratch`` (NumPy)
    the products land in reused buffers (the result is a view of one, valid until its next use)."""
    if scratch is not None:
        shape = (A.shape[0], B.shape[0])
        if A.shape[1] <= GRAM_SLAB or A.dtype == np.float64:
            return np.matmul(A, B.T, out=scratch.take(key, shape, A.dtype))
        acc = scratch.take(key + "64", shape, np.float64)
        part = scratch.take(key, shape, A.dtype)
        for i, s in enumerate(_slabs(A.shape[1])):
            np.matmul(A[:, s], B[:, s].T, out=part)
            if i:
                acc += part
            else:
                acc[...] = part
        return acc
    if A.shape[1] <= GRAM_SLAB or A.dtype == xp.float64:
        return A @ B.T
    out = None
    for s in _slabs(A.shape[1]):
        part = _astype(A[:, s] @ B[:, s].T, xp.float64, xp)
        out = part if out is None else out + part
    return out


def centred_gram_slabs(X: np.ndarray, dtype: Any) -> tuple[np.ndarray, float]:
    """K_c = Σ_slabs X_c[:, s] X_c[:, s]ᵀ over slabs of :data:`GRAM_SLAB` features (NumPy), summed
    in float64; returns (K_c float64 (n, n), ‖x̄‖²).

    Centring is per feature, so each slab is cast, centred (:func:`centre_rounded`: the same values
    as centring X whole) and multiplied while it sits in cache (n × 2048 float32 = 2 MiB at n = 256),
    instead of several passes over the whole n × p batch in memory and a centred copy of it: for
    wide layers (p ≫ n) one pass over the data does it all.
    """
    dtype = np.dtype(dtype)
    n, p = X.shape
    K = np.zeros((n, n), dtype=np.float64)
    mean_sq = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported by the caller
        for s in range(0, p, GRAM_SLAB):
            slab = X[:, s:s + GRAM_SLAB]
            fresh = slab.dtype != dtype
            S = _astype(slab, dtype, np) if fresh else slab
            S, m = centre_rounded(S, np, dtype, fresh=fresh)
            K += S @ S.T
            mean_sq += float(np.sum(m * m))
    return K, mean_sq


def _is_wide(shape: tuple[int, ...]) -> bool:
    """A host layer that enters :func:`batch_hsic` as its centred Gram (:func:`centred_gram`, formed
    slab by slab): more than two slabs of features and at least 4 features per example."""
    p = math.prod(int(d) for d in shape[1:])
    return p > 2 * GRAM_SLAB and p >= 4 * shape[0]


def check_gram(K: Any, xp: Any, mean_sq: float, what: str) -> bool:
    """The checks of :func:`_prepare` on a centred Gram: NaN/inf anywhere in the layer make its trace
    non-finite (``ValueError`` naming ``what``); returns whether the layer is constant over the
    batch: its trace within the rounding of the mean (``mean_sq`` = ‖x̄‖², 0 when unknown: then a
    trace <= 0)."""
    return is_constant(what, float(xp.sum(diagonal(K, xp))), mean_sq, K.shape[0])


def centred_gram(x: Any, xp: Any, what: str = "X", dtype: Any = None) -> CentredGram:
    """The batch's centred Gram ``K_c = X_c X_cᵀ`` (b × b, float64), which is all that linear HSIC
    sees of a layer: b² numbers instead of b·p, handed to ``MinibatchCKA.update`` as a
    :class:`CentredGram`.

    ``dtype`` (default :func:`gram_dtype` of ``x``; the engine passes it for the column) is the
    precision of the products, with the rule of this module ("Precision and error bound"): X is
    centred with float64 means and rounded once to ``dtype``, products are summed in ``dtype``
    over feature slabs of at most ``GRAM_SLAB`` and the slabs in float64; K_c is float64.
    NaN or infinite values make tr(K_c) non-finite: ``ValueError`` naming ``what``.  Whether the
    layer is constant over the batch (tr(K_c) within the rounding of the mean,
    :func:`constant_tolerance`) is decided by :func:`batch_hsic` from ``CentredGram.mean_sq``
    (see :class:`MinibatchCKA` for what a constant layer gives).  On an accelerator (any namespace but NumPy) the rows are centred
    and multiplied as in :func:`batch_hsic`'s accelerator route (``kernels/_cka_device.py``), and
    the check is left to it, which makes it with the batch's one device-to-host copy: the Gram keeps
    ‖x̄‖² on the device (``CentredGram.mean_sq``) and nothing here waits for the device.
    """
    X = xp.reshape(x, (x.shape[0], -1))
    if dtype is None:
        dtype = gram_dtype(X.dtype, xp)
    if not _is_numpy(xp):  # the accelerator route's centring and products; checked with the batch
        X = _astype(X, dtype, xp) if X.dtype != dtype else X
        X, mean_sq = centre_once(X, xp)
        return CentredGram(gram_rows(X, X, xp, GRAM_SLAB), mean_sq=mean_sq)
    if X.shape[1] > 2 * GRAM_SLAB:
        K, mean_sq = centred_gram_slabs(X, dtype)
    else:
        fresh = X.dtype != dtype
        X = _astype(X, dtype, xp) if fresh else X
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported below, by name
            X, mean = centre_rounded(X, xp, dtype, fresh=fresh)
        K = gram64(X, X, xp)
        K = K if K.dtype == xp.float64 else _astype(K, xp.float64, xp)
        mean_sq = float(xp.sum(mean * mean))
        del X
    check_gram(K, xp, mean_sq, what)
    return CentredGram(K, mean_sq=mean_sq)


# ----------------------------------------------------------------------------------------------
# one-shot kernels
# ----------------------------------------------------------------------------------------------
def ucenter(K: Any, *, xp: Any = None) -> Any:
    """U-centering of a symmetric Gram matrix K (n × n, n >= 4), Song et al. (2012), Eq. 5.

    U(K)_ij = K_ij - r_i/(n-2) - r_j/(n-2) + S/((n-1)(n-2)) for i ≠ j and U(K)_ii = 0, where
    r_i = Σ_{l≠i} K_il and S = Σ_{k≠l} K_kl. Then HSIC₁(K, L) = ⟨U(K), U(L)⟩ / (n(n-3)).
    """
    xp = array_namespace(K, xp=xp)
    if K.ndim != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"ucenter needs a square matrix, got shape {K.shape}")
    n = K.shape[0]
    if n < 4:
        raise ValueError(f"U-centering needs n >= 4 examples, got n = {n}")
    if not xp.isdtype(K.dtype, "real floating"):
        K = xp.astype(K, xp.float64)
    off = 1 - xp.eye(n, dtype=K.dtype)
    K0 = K * off
    r = xp.sum(K0, axis=1)
    s = xp.sum(r)
    U = K0 - (r[:, None] + r[None, :]) / (n - 2) + s / ((n - 1) * (n - 2))
    return U * off


def _prepare(X: Any, xp: Any, dtype: Any, n: int | None, what: str,
             scratch: "_HostScratch | None" = None) -> tuple[Any, Any, bool]:
    """Flatten, cast, validate and column-centre one layer's batch (:func:`centre_rounded`);
    returns the centred rows, their float64 squared norms (:func:`sq_norms64`, the centred
    Gram's diagonal) and whether the layer is constant over the batch.  With ``scratch`` (NumPy) the centred rows are written into a reused buffer.

    NaN/inf anywhere in X makes its column mean non-finite, so the finiteness check runs on the
    (p,) mean. X is constant to working precision when the centred rows' squared norms are all
    within the rounding of the (float64) mean: Σ_i ‖x_i - x̄‖² <= (4 n eps₆₄)² · n · ‖x̄‖²
    (:func:`constant_tolerance`).
    """
    X = flatten_examples(X, xp, None, what)
    fresh = X.dtype != dtype  # a cast (float16: the exact fast upcast of _xp.astype) makes a new array
    out = scratch.take("centred", X.shape, dtype) if scratch is not None and not fresh else None
    X = flatten_examples(X, xp, dtype, what)
    if n is not None and X.shape[0] != n:
        raise ValueError(f"{what} has {X.shape[0]} examples, expected {n} (all layers must share examples)")
    Xc, mean = (centre_rounded(X, xp, dtype, out=out) if out is not None
                else centre_rounded(X, xp, dtype, fresh=fresh))
    check_finite(mean, xp, what)
    d = sq_norms64(Xc, xp)
    spread = float(xp.sum(d))
    return Xc, d, spread <= constant_tolerance(X.shape[0], float(xp.sum(mean * mean)))


def _prepare_gram(G: "CentredGram", xp: Any, n: int | None, what: str) -> tuple["CentredGram", bool]:
    """Validate a :class:`CentredGram` (the counterpart of :func:`_prepare`; K is kept as given) and
    say whether its layer is constant over the batch."""
    if n is not None and G.shape[0] != n:
        raise ValueError(f"{what} has {G.shape[0]} examples, expected {n} (all layers must share examples)")
    return G, check_gram(G.K, xp, 0.0 if G.mean_sq is None else float(G.mean_sq), what)  # no mean: trace <= 0


def _constant_error(what: str) -> ValueError:
    return ValueError(f"{what} is constant over the examples (zero variance): CKA is undefined")


def _check_n(n: int, debiased: bool, what: str = "batch") -> None:
    need = 4 if debiased else 2
    if n < need:
        raise ValueError(
            f"{what} has n = {n} examples; {'debiased (unbiased HSIC)' if debiased else 'biased'} "
            f"CKA needs n >= {need}"
        )


def linear_cka(X: Any, Y: Any, debiased: bool = False, *, xp: Any = None,
               compute_dtype: Any = None) -> float:
    """Linear CKA of X (n, p1) and Y (n, p2) (paper Eq. 10); inputs with more axes are flattened.

    ``debiased=False``: Eq. 10, ‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F ‖Ycᵀ Yc‖_F) with column-centred
    features. ``debiased=True``: the same ratio with Song et al.'s unbiased HSIC₁ (module
    docstring). The cheaper of the feature-space form (cost ~ n(p1 p2 + p1² + p2²)) and the Gram
    form (cost ~ n²(p1 + p2)) is used; the debiased feature-space form
    n(n-3)·HSIC₁ = ‖Ycᵀ Xc‖² - (n/(n-2)) Σ_i ‖x_i‖²‖y_i‖² + tr K · tr L / ((n-1)(n-2))
    (rows of centred data) is used only in float64, where its cancellation is harmless.
    Precision as in :class:`MinibatchCKA` (module docstring): the feature-space products of
    float32 layers are summed over slabs of ``GRAM_SLAB`` rows in float64.
    """
    X, Y = as_array(X), as_array(Y)
    xp = array_namespace(X, Y, xp=xp)
    n = X.shape[0]
    _check_n(n, debiased, "X")
    Xc, k, const_x = _prepare(X, xp, gram_dtype(X.dtype, xp, compute_dtype), None, "X")
    if const_x:
        raise _constant_error("X")
    Yc, l_, const_y = _prepare(Y, xp, gram_dtype(Y.dtype, xp, compute_dtype), n, "Y")
    if const_y:
        raise _constant_error("Y")
    p1, p2 = Xc.shape[1], Yc.shape[1]
    feature_cost = p1 * p2 + p1 * p1 + p2 * p2
    gram_cost = n * (p1 + p2) + 3 * n
    exact64 = Xc.dtype == xp.float64 and Yc.dtype == xp.float64
    use_features = feature_cost <= gram_cost and (not debiased or exact64)
    if not use_features:
        h = batch_hsic([Xc, Yc], debiased=debiased, xp=xp, _centred=True)
        return float(hsic_to_cka(h, names=["X", "Y"])[0, 1])
    T = xp.matrix_transpose

    def cross_sq(A: Any, B: Any) -> Any:  # ‖Aᵀ B‖²_F, products summed over row slabs in float64
        C = gram64(T(A), T(B), xp)
        C = C if C.dtype == xp.float64 else xp.astype(C, xp.float64)
        return xp.sum(C * C)

    hxy, hxx, hyy = cross_sq(Xc, Yc), cross_sq(Xc, Xc), cross_sq(Yc, Yc)
    if debiased:
        def unbiased(t: Any, a: Any, b: Any) -> Any:
            return t - (n / (n - 2)) * xp.sum(a * b) + xp.sum(a) * xp.sum(b) / ((n - 1) * (n - 2))

        hxy, hxx, hyy = unbiased(hxy, k, l_), unbiased(hxx, k, k), unbiased(hyy, l_, l_)
    hxx_f, hyy_f, hxy_f = float(hxx), float(hyy), float(hxy)
    if hxx_f <= 0 or hyy_f <= 0:
        raise ValueError(
            f"self-HSIC is not positive (X: {hxx_f:.3g}, Y: {hyy_f:.3g}); CKA is undefined"
        )
    return hxy_f / math.sqrt(hxx_f * hyy_f)


# ----------------------------------------------------------------------------------------------
# all pairs of one batch
# ----------------------------------------------------------------------------------------------
class _HostScratch(threading.local):
    """Reused NumPy buffers, one set per worker thread, for the duration of one batch.

    Allocating each layer's centred copy and Gram blocks afresh costs more than the arithmetic
    on them when several threads do it: every large temporary is a fresh mapping whose pages
    fault in on first touch and whose release flushes every core's TLB, and both serialise the
    threads (measured: k threads forming fresh Grams ran no faster than one).  ``take`` returns a
    view of a buffer that only grows, so after the first layer no memory is mapped."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def take(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        size = math.prod(shape)
        buf = self.bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self.bufs[key] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)


def _gram_block(Xc: Any, a: int, b: int, c: int, e: int, xp: Any,
                scratch: _HostScratch | None = None, key: str = "gram") -> Any:
    """Block [a:b, c:e] of a layer's centred Gram: from the rows Xc (:func:`gram64`, into
    ``scratch`` when given), or a view of a :class:`CentredGram`'s matrix."""
    if isinstance(Xc, CentredGram):
        return Xc.K[a:b, c:e]
    return gram64(Xc[a:b, :], Xc[c:e, :], xp, scratch, key)


class _BufferCache:
    """The buffer A of the last batch, kept for the next one (NumPy).

    A is the largest temporary of a batch (L × ~n²/2 float64: 111 MB at L = 64, n = 600), and a
    fresh one costs more than filling it: its pages fault in and are zeroed on first touch, and
    freeing it flushes every core's TLB while the worker threads run — about a tenth of a batch's
    time at that size.  So one buffer of at most ``max_bytes`` (default 256 MiB; larger ones are
    freed as before) is kept between batches and handed out to one caller at a time (thread-safe:
    a second concurrent batch allocates its own).  :func:`release_buffers` frees it.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self._buf: np.ndarray | None = None
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        size = math.prod(shape)
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype=np.float64)  # (a smaller cached one is dropped)
        return buf[:size].reshape(shape)

    def give(self, view: np.ndarray) -> None:
        buf = view.base if view.base is not None else view
        if buf.nbytes > self.max_bytes:
            return
        with self._lock:
            if self._buf is None or self._buf.size < buf.size:
                self._buf = buf

    def release(self) -> None:
        with self._lock:
            self._buf = None


_A_CACHE = _BufferCache()


def release_buffers() -> None:
    """Free the buffer that :func:`batch_hsic` / :meth:`MinibatchCKA.update` keep between batches
    (at most 256 MiB; see ``_BufferCache``)."""
    _A_CACHE.release()


_MASK_CACHE: dict[tuple, Any] = {}


def _panel_mask(xp: Any, ref: Any, r: int, width: int) -> Any:
    """(r, width) float64 mask of a row panel K[a:a+r, a:]: 0 on and below the diagonal of its
    leading r × r block (pairs i >= j), 1 elsewhere (the pairs i < j the panel owns)."""
    key = (xp.__name__, str(getattr(ref, "device", "")), r, width)
    mask = _MASK_CACHE.get(key)
    if mask is None:
        m = np.ones((r, width))
        m[:, :r] = np.triu(m[:, :r], 1)
        mask = asarray_like(m, ref, xp, dtype=xp.float64)
        if len(_MASK_CACHE) > 64:
            _MASK_CACHE.clear()
        _MASK_CACHE[key] = mask
    return mask


def _pair_groups(n: int, block_rows: int, cap: int) -> list[list[tuple[int, int, int]]]:
    """Row panels [a, b) with their lengths in A, grouped so each group holds <= ``cap`` values.

    Panel [a, b) is the block K[a:b, a:] of rows a..b-1 from column a on, r (n - a) values
    (r = b - a): it owns the pairs i < j with a <= i < b, which are the whole rectangle
    K[a:b, b:] and the strict upper triangle of its leading r × r block; the rest of that block
    (i >= j) is stored as zeros, so a panel is one contiguous product and one contiguous write,
    and the zeros add nothing to A Aᵀ.
    """
    bounds = list(range(0, n, block_rows)) + [n]
    groups: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = (b - a) * (n - a)
        if groups[-1] and size + m > cap:
            groups.append([])
            size = 0
        groups[-1].append((a, b, m))
        size += m
    return groups


def _write_panels(A: Any, l_: int, Xc: Any, group: list[tuple[int, int, int]], want_sums: bool, xp: Any,
                  scratch: _HostScratch | None = None) -> Any:
    """Write layer l's Gram entries K_ij, i < j, of the panels in ``group`` (:func:`_pair_groups`)
    into row A[l] as float64, and return (``want_sums``) their share of the row sums of K̃ (the
    Gram with its diagonal zeroed), float64 (n,): entry (i, j) adds to r_i and r_j.  ``scratch``
    (NumPy): the Gram is formed in reused buffers, whole (one SYRK) when ``group`` holds every
    panel, else panel by panel."""
    n = Xc.shape[0]
    host = scratch is not None
    whole = None
    if host and not isinstance(Xc, CentredGram) and group[0][0] == 0 and group[-1][1] == n:
        whole = gram64(Xc, Xc, np, scratch, "gram")  # every panel: one SYRK (Xc Xcᵀ of one buffer)
    sums = xp.zeros((n,), dtype=xp.float64) if want_sums else None
    off = 0
    for a, b, k in group:
        r = b - a
        if host:
            G = whole[a:b, a:] if whole is not None else _gram_block(Xc, a, b, a, n, np, scratch, "panel")
            V = A[l_, off:off + k].reshape(r, n - a)
            np.multiply(G[:, :r], _panel_mask(np, V, r, r), out=V[:, :r])  # cast; i >= j -> 0
            V[:, r:] = G[:, r:]
        else:
            V = xp.astype(_gram_block(Xc, a, b, a, n, xp), xp.float64, copy=True)
            V = V * _panel_mask(xp, V, r, n - a)
            A[l_, off:off + k] = xp.reshape(V, (-1,))
        if sums is not None and host:  # float64 GEMVs: ~2x numpy's axis sums here
            sums[a:b] += V @ np.ones(n - a)
            sums[a:] += np.ones(r) @ V
        elif sums is not None:
            sums[a:b] = sums[a:b] + xp.sum(V, axis=1)
            sums[a:] = sums[a:] + xp.sum(V, axis=0)
        off += k
    return sums


def batch_hsic(layers: Sequence[Any], debiased: bool = True, *, xp: Any = None,
               compute_dtype: Any = None, block_bytes: int | None = None, block_rows: int = 128,
               names: Sequence[str] | None = None, _centred: bool = False) -> np.ndarray:
    """HSIC between every pair of ``layers`` (each (n, ...), the same n examples) for one batch.

    Returns an (L, L) float64 NumPy array of HSIC₁ (``debiased``) or HSIC₀ values; algorithm in
    the module docstring. ``block_bytes`` bounds the buffer A (L × the values of a group of
    panels; default 1 GiB on NumPy, 4 GiB on an accelerator, where A holds whole Gram rows and
    one group needs less memory than several: ``kernels/_cka_device.py``); ``block_rows`` is the
    height of a panel (NumPy only).

    ``layers`` is read item by item, in order: when A fits in ``block_bytes`` (one group) every
    layer is read once and dropped after its row of A is written, so a lazy sequence (whose
    ``__getitem__`` loads layer l's batch) keeps at most k + 1 layers' batches in memory (k the
    BLAS thread budget; one without threads). With several groups the centred layers are kept
    for the later groups.
    """
    return _batch_hsic(layers, debiased, xp, compute_dtype, block_bytes, block_rows, names, _centred)[0]


def _layer_input(X: Any) -> Any:
    """A layer's batch as given (an array or a :class:`CentredGram`), nested lists as NumPy arrays."""
    return X if isinstance(X, CentredGram) else as_array(X)


def _batch_hsic(layers: Sequence[Any], debiased: bool, xp: Any, compute_dtype: Any, block_bytes: int | None,
                block_rows: int, names: Sequence[str] | None, centred: bool,
                widths: Sequence[int | None] | None = None) -> tuple[np.ndarray, int, list[int | None]]:
    """(HSIC matrix, n, features per layer: None for a :class:`CentredGram`). ``widths``: the
    features each layer had in earlier batches (None: not known); another width is refused."""
    L = len(layers)
    if L == 0:
        raise ValueError("batch_hsic needs at least one layer")
    names = list(names) if names is not None else [f"layer {i}" for i in range(L)]

    first = _layer_input(layers[0])
    first_ns = array_namespace(first.K if isinstance(first, CentredGram) else first)
    xp = first_ns if xp is None else array_namespace(xp=xp)
    n = first.shape[0]
    _check_n(n, debiased, f"batch of {names[0]}")
    seen: list[int | None] = [None] * L
    if not _is_numpy(xp):  # an accelerator's route: whole Grams, few large operations, one host transfer
        items = _checked_layers(layers, first, first_ns, names, seen, widths)
        H = device_batch_hsic(items, L, n, debiased, xp, lambda X: gram_dtype(X.dtype, xp, compute_dtype),
                              DEVICE_BLOCK_BYTES if block_bytes is None else block_bytes, names, centred, GRAM_SLAB)
        return H, n, seen
    block_bytes = HOST_BLOCK_BYTES if block_bytes is None else int(block_bytes)
    groups = _pair_groups(n, max(int(block_rows), 1), max(block_bytes // (L * 8), 1))
    kept: list[Any] | None = [None] * L if len(groups) > 1 else None
    # one group: each centred layer is dropped after its row of A, so its buffers can be reused
    scratch = _HostScratch() if kept is None else None
    diags: list[Any] = [None] * L  # biased HSIC: the Grams' diagonals
    sums: list[Any] = [None] * L  # debiased HSIC: row sums of K̃, accumulated over groups
    constant = [False] * L  # layers constant over this batch (their rows of H are zeroed)

    def column(l_: int, X: Any, A: Any, group: list[tuple[int, int, int]], first_group: bool) -> None:
        """Layer l's part of group ``group``: prepared on first sight, then its row of A."""
        if first_group:
            if not centred and not isinstance(X, CentredGram) and X.ndim >= 2 and _is_wide(X.shape):
                if X.shape[0] != n:  # p ≫ n: its centred Gram, in one pass
                    raise ValueError(f"{names[l_]} has {X.shape[0]} examples, expected {n} (all layers must share examples)")
                X = centred_gram(X, xp, names[l_], gram_dtype(X.dtype, xp, compute_dtype))
            if isinstance(X, CentredGram):
                Xc, constant[l_] = _prepare_gram(X, xp, n, names[l_])
                d = diagonal(Xc.K, xp) if not debiased else None
            elif centred:
                Xc, d = X, (sq_norms64(X, xp) if not debiased else None)
            else:
                Xc, d, constant[l_] = _prepare(X, xp, gram_dtype(X.dtype, xp, compute_dtype), n, names[l_], scratch)
            if not debiased:
                diags[l_] = d if d.dtype == xp.float64 else xp.astype(d, xp.float64)
            if kept is not None:
                kept[l_] = Xc
        else:
            Xc = kept[l_]
        part = _write_panels(A, l_, Xc, group, debiased, xp, scratch)
        sums[l_] = part if sums[l_] is None else sums[l_] + part

    def source(first_group: bool) -> Any:
        if first_group:
            return _checked_layers(layers, first, first_ns, names, seen, widths)
        return ((l_, None) for l_ in range(L))

    H = None
    for gi, group in enumerate(groups):
        shape = (L, sum(m for _, _, m in group))
        A = _A_CACHE.take(shape)
        _each_column(source(gi == 0), lambda l_, X, A=A, group=group, first_group=gi == 0:
                     column(l_, X, A, group, first_group), parallel=L > 1)
        first = None
        P = _row_products(A)
        H = P if H is None else H + P
        _A_CACHE.give(A)
        del A
    if debiased:  # Song et al.: tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n-1)(n-2)) - 2/(n-2)·(K̃1)ᵀ(L̃1), over n(n-3)
        R = xp.stack(sums)
        t = xp.sum(R, axis=1)
        H = 2 * H + t[:, None] * t[None, :] / ((n - 1) * (n - 2)) - (2 / (n - 2)) * _row_products(R)
        H = H / (n * (n - 3))
    else:
        D = xp.stack(diags)
        H = (2 * H + _row_products(D)) / ((n - 1) ** 2)
    out = np.array(to_numpy(H), dtype=np.float64)
    return zero_constant(out, constant), n, seen


def _checked_layers(layers: Sequence[Any], first: Any, first_ns: Any, names: Sequence[str], seen: list[int | None],
                    widths: Sequence[int | None] | None) -> Any:
    """``(l, X)`` for the layers in order (read once, on the calling thread; ``first`` is layer 0,
    read already), each checked to share layer 0's namespace and to keep its features across
    updates (``widths``); the features of each are recorded in ``seen``."""
    for l_ in range(len(layers)):
        X = first if l_ == 0 else _layer_input(layers[l_])
        gram = isinstance(X, CentredGram)
        if l_ and array_namespace(X.K if gram else X) is not first_ns:
            raise TypeError(f"{names[l_]} comes from another array namespace than {names[0]}")
        if not gram:
            seen[l_] = math.prod(int(d) for d in X.shape[1:])
            before = widths[l_] if widths is not None else None
            if before is not None and seen[l_] != before:
                raise ValueError(f"{names[l_]} has {seen[l_]} features in this batch but {before} in earlier "
                                 "ones; each layer must keep its features across updates")
        yield l_, X


def _row_products(A: np.ndarray) -> np.ndarray:
    """A Aᵀ in float64 (NumPy; the accelerator route forms its own): split along A's long axis into
    k column slabs, one per thread of the BLAS budget, each a single-threaded SYRK, and the k (L, L)
    parts summed — the same sums in another order.  Unlike one k-threaded BLAS call this leaves no
    BLAS worker threads busy-waiting (OpenBLAS spins ~0.1 s after a threaded call) to slow the next
    batch's columns."""
    from repsim._blas import blas_thread_split

    with blas_thread_split() as k:
        m = A.shape[1]
        k = max(1, min(k, m // 4096))
        if k == 1:
            return A @ A.T
        from concurrent.futures import ThreadPoolExecutor

        cuts = [m * i // k for i in range(k + 1)]
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="repsim-hsic") as pool:
            parts = list(pool.map(lambda i: A[:, cuts[i]:cuts[i + 1]] @ A[:, cuts[i]:cuts[i + 1]].T, range(k)))
    return sum(parts[1:], parts[0])


def _each_column(items: Any, work: Any, parallel: bool) -> None:
    """``work(l, X)`` for each ``(l, X)`` of ``items`` (consumed in order on this thread).

    With ``parallel`` (NumPy) the BLAS thread budget is spent across columns: k worker threads,
    each with single-threaded BLAS (:func:`repsim._blas.blas_thread_split`).  At most k + 1
    columns are in flight (the next one is read while k are computed) and a finished column
    frees its slot whichever it is, so no worker waits for a slower neighbour.  After a failure
    no new column starts and the error of the lowest failed column is raised.  Each column
    writes only its own row of A, so the result does not depend on the split.
    """
    if parallel:
        from repsim._blas import blas_thread_split

        with blas_thread_split() as k:
            if k > 1:
                from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

                with ThreadPoolExecutor(max_workers=k, thread_name_prefix="repsim-hsic") as pool:
                    pending: dict[Any, int] = {}
                    failed: list[tuple[int, BaseException]] = []

                    def settle(block: bool) -> None:
                        done, _ = wait(list(pending), return_when=FIRST_COMPLETED) if block else (
                            [f for f in pending if f.done()], None)
                        for f in done:
                            err = f.exception()
                            if err is not None:
                                failed.append((pending[f], err))
                            del pending[f]

                    try:
                        for l_, X in items:
                            pending[pool.submit(work, l_, X)] = l_
                            del X
                            settle(block=len(pending) > k)
                            if failed:
                                break
                        while pending:
                            settle(block=True)
                    finally:
                        for f in pending:
                            f.cancel()
                    if failed:
                        raise min(failed, key=lambda e: e[0])[1]
                return
    for l_, X in items:
        work(l_, X)


def hsic_to_cka(hsic: np.ndarray, names: Sequence[str] | None = None, *, undefined: str = "raise") -> np.ndarray:
    """CKA matrix hsic_ij / sqrt(hsic_ii hsic_jj).  A layer whose self-HSIC is not positive (constant
    features) has no CKA: ``undefined="raise"`` gives a ValueError naming it, ``"nan"`` NaN in its
    row and column (its diagonal too)."""
    if undefined not in ("raise", "nan"):
        raise ValueError(f"undefined must be 'raise' or 'nan', got {undefined!r}")
    d = np.diag(hsic)
    bad = np.flatnonzero(~(d > 0))
    if bad.size and undefined == "nan":
        s = np.sqrt(np.where(d > 0, d, np.nan))
        return hsic / np.outer(s, s)
    if bad.size:
        label = [names[i] if names is not None else f"layer {i}" for i in bad[:5]]
        raise ValueError(
            f"self-HSIC is not positive for {', '.join(label)}"
            f"{' ...' if bad.size > 5 else ''} (constant features or too few examples): CKA is undefined"
        )
    s = np.sqrt(d)
    return hsic / np.outer(s, s)


# ----------------------------------------------------------------------------------------------
# streaming accumulator
# ----------------------------------------------------------------------------------------------
class MinibatchCKA:
    """All-pairs minibatch CKA accumulator (protocol: update / merge / result / to_state / from_state).

    ``update([X_1, ..., X_L])`` adds one minibatch (each X_l (b, ...) on the same b examples; conv
    maps are flattened). The list may be any sequence read item by item (see :func:`batch_hsic`):
    a lazy one lets a driver load one layer's batch at a time. ``.hsic`` holds the float64 (L, L) sums of per-batch HSIC, ``.n_batches``
    the number of batches. With ``keep_batches`` the per-batch upper triangles are kept so that
    ``result(ci=0.95)`` can give percentile-bootstrap intervals over batches.

    Constant layers: NaN or infinity in a layer is refused (``ValueError`` naming it), but a layer
    that is constant over a batch (zero variance to working precision, :func:`constant_tolerance`)
    adds nothing to that batch's sums — its Gram is taken as exactly zero — and a layer constant
    over every batch has no CKA: ``result()`` gives NaN in its row and column, with one
    ``RuntimeWarning`` naming such layers (:meth:`undefined`), while every other pair is computed.

    ``merge`` adds sums and concatenates batch records, so accumulators built on any split of the
    batches combine to the one-shot result (to float64 rounding) in any merge order. The bootstrap
    first sorts the batch records into a canonical (lexicographic) order, so its intervals do not
    depend on the merge order either.

    ``names`` (e.g. "store/layer") label layers in error messages; ``compute_dtype`` None picks
    each layer's Gram precision from its dtype (float32 Grams for float16/float32 layers, float64
    otherwise; module docstring, "Precision and error bound"); ``block_bytes`` bounds the
    per-batch buffer A (L × ≈ n(n + 128)/2 float64, split into groups of panels beyond it).
    Peak extra memory per update: A plus, per BLAS thread, one centred layer and its Gram when A
    fits in ``block_bytes`` (default 1 GiB: e.g. up to 110 layers at n = 1500; 4 GiB on an
    accelerator, whose route is described in ``kernels/_cka_device.py``), else A's group
    plus all centred layers of the batch.  An A of at most 256 MiB is kept for the next update
    (:func:`release_buffers` frees it).
    """

    def __init__(self, n_layers: int, debiased: bool = True, keep_batches: bool = True, *,
                 names: Sequence[str] | None = None, compute_dtype: str | None = None,
                 block_bytes: int | None = None) -> None:
        if int(n_layers) < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.n_layers = int(n_layers)
        self.debiased = bool(debiased)
        self.keep_batches = bool(keep_batches)
        if names is not None and len(names) != self.n_layers:
            raise ValueError(f"names has {len(names)} entries for {self.n_layers} layers")
        self.names = [str(s) for s in names] if names is not None else None
        if compute_dtype not in (None, "float32", "float64"):
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {compute_dtype!r}")
        self.compute_dtype = compute_dtype
        self.block_bytes = None if block_bytes is None else int(block_bytes)
        self.hsic = np.zeros((self.n_layers, self.n_layers), dtype=np.float64)
        self.n_batches = 0
        self.n_examples = 0
        self._batches: list[np.ndarray] = []
        self._iu = np.triu_indices(self.n_layers)
        self._widths: list[int | None] = [None] * self.n_layers  # features per layer, once seen

    # -- protocol ------------------------------------------------------------------------------
    def update(self, layers: Sequence[Any], *, xp: Any = None) -> "MinibatchCKA":
        """Add one minibatch: a list of L arrays (b, ...) of activations on the same b examples."""
        if len(layers) != self.n_layers:
            raise ValueError(f"update got {len(layers)} layers, expected {self.n_layers}")
        h, n, seen = _batch_hsic(layers, self.debiased, xp, self.compute_dtype, self.block_bytes, 128,
                                 self._names(), False, self._widths)
        self._widths = [w if w is not None else s for w, s in zip(self._widths, seen)]
        self.hsic += h
        self.n_batches += 1
        self.n_examples += n
        if self.keep_batches:
            self._batches.append(h[self._iu])
        return self

    def merge(self, other: "MinibatchCKA") -> "MinibatchCKA":
        """Add ``other``'s batches into this accumulator (in place) and return self."""
        if not isinstance(other, MinibatchCKA):
            raise TypeError(f"cannot merge {type(other).__name__} into MinibatchCKA")
        if (other.n_layers, other.debiased) != (self.n_layers, self.debiased):
            raise ValueError(
                f"cannot merge MinibatchCKA(n_layers={other.n_layers}, debiased={other.debiased}) into "
                f"MinibatchCKA(n_layers={self.n_layers}, debiased={self.debiased})"
            )
        names = self._names()
        for i, (a, b) in enumerate(zip(self._widths, other._widths)):
            if a is not None and b is not None and a != b:
                raise ValueError(f"cannot merge: {names[i]} has {b} features there but {a} here")
        self._widths = [a if a is not None else b for a, b in zip(self._widths, other._widths)]
        self.hsic += other.hsic
        self.n_batches += other.n_batches
        self.n_examples += other.n_examples
        if self.keep_batches:
            if not other.keep_batches and other.n_batches:
                raise ValueError("cannot merge an accumulator without per-batch records into one that keeps them")
            self._batches.extend(other._batches)
        return self

    def result(self, ci: float | None = None, *, n_boot: int = 1000, seed: int = 0,
               draws: int | None = None,
               ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(L, L) CKA values; with ``ci`` (e.g. 0.95) also (lower, upper) bootstrap bounds.

        Percentile bootstrap over batches: ``n_boot`` resamples of ``draws`` batch records (default
        all B) drawn with replacement (``numpy.random.default_rng(seed)``, records in canonical
        order), each giving a CKA matrix from its HSIC sums; bounds are the (1-ci)/2 and (1+ci)/2
        quantiles (linear interpolation). Resamples whose self-HSIC sum is not positive are dropped
        for that entry.

        Batches must be independent samples for this to be a confidence interval. Batches of one
        pass over a data set are (disjoint examples); batches of E passes over the *same* n
        examples are not: more epochs average out how the examples are grouped into batches, but
        not which n examples were drawn. Resampling all E·B' records would shrink the interval by
        about √E for no new data, so give ``draws`` = batches per epoch (B'): an m-out-of-n
        bootstrap whose resamples have the size, and so the spread, of a single pass.
        ``CKAResult.ci`` does this.
        """
        if self.n_batches == 0:
            raise ValueError("MinibatchCKA.result() called before any update")
        undefined = self.undefined()
        if undefined:
            warnings.warn(f"CKA is undefined (NaN) for {len(undefined)} layer(s) constant over every batch: "
                          f"{', '.join(undefined[:8])}{' ...' if len(undefined) > 8 else ''}",
                          RuntimeWarning, stacklevel=2)
        values = hsic_to_cka(self.hsic, self._names(), undefined="nan")
        if ci is None:
            return values
        if not 0 < ci < 1:
            raise ValueError(f"ci must lie in (0, 1), got {ci}")
        if not self.keep_batches:
            raise ValueError("confidence intervals need keep_batches=True")
        if draws is not None and not 1 <= int(draws) <= self.n_batches:
            raise ValueError(f"draws must be in [1, {self.n_batches}], got {draws}")
        if (self.n_batches if draws is None else int(draws)) < 2:
            raise ValueError(
                f"a bootstrap interval resamples batches, and {'there is' if draws is None else 'each resample holds'} "
                f"only one ({self.n_examples // max(self.n_batches, 1)} examples): every resample would equal the "
                "estimate (lo = hi). Use a batch size below half the examples for an interval")
        with warnings.catch_warnings():  # undefined layers: all-NaN columns, named above
            warnings.simplefilter("ignore", RuntimeWarning)
            lower, upper = self._bootstrap(ci, n_boot, seed, None if draws is None else int(draws))
        return values, lower, upper

    def to_state(self) -> dict[str, Any]:
        """Plain NumPy arrays and scalars; ``from_state(to_state())`` is an exact round trip."""
        L = self.n_layers
        batches = (np.stack(self._batches) if self._batches
                   else np.zeros((0, L * (L + 1) // 2), dtype=np.float64))
        return {
            "kind": "MinibatchCKA",
            "version": _STATE_VERSION,
            "n_layers": L,
            "debiased": self.debiased,
            "keep_batches": self.keep_batches,
            "names": np.array(self.names if self.names is not None else [], dtype=np.str_),
            "has_names": self.names is not None,
            "compute_dtype": self.compute_dtype or "",
            "block_bytes": 0 if self.block_bytes is None else self.block_bytes,  # 0: the default
            "hsic": self.hsic.copy(),
            "n_batches": self.n_batches,
            "n_examples": self.n_examples,
            "batches": batches,
            "widths": np.array([-1 if w is None else w for w in self._widths], dtype=np.int64),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "MinibatchCKA":
        if str(state.get("kind")) != "MinibatchCKA":
            raise ValueError(f"not a MinibatchCKA state (kind={state.get('kind')!r})")
        names = [str(s) for s in np.asarray(state["names"]).tolist()] if bool(state["has_names"]) else None
        acc = cls(int(state["n_layers"]), debiased=bool(state["debiased"]),
                  keep_batches=bool(state["keep_batches"]), names=names,
                  compute_dtype=str(state["compute_dtype"]) or None,
                  block_bytes=int(state["block_bytes"]) or None)
        acc.hsic = np.array(state["hsic"], dtype=np.float64)
        acc.n_batches = int(state["n_batches"])
        acc.n_examples = int(state["n_examples"])
        acc._batches = [np.array(r, dtype=np.float64) for r in np.asarray(state["batches"])]
        if "widths" in state:  # (states written before widths were recorded have none)
            acc._widths = [None if int(w) < 0 else int(w) for w in np.asarray(state["widths"]).reshape(-1)]
        return acc

    # -- helpers -------------------------------------------------------------------------------
    def undefined(self) -> list[str]:
        """Names of the layers with no CKA: constant over every batch (self-HSIC sum not positive;
        a batch in which a layer is constant adds nothing to its sums, see :func:`zero_constant`)."""
        return [self._names()[l_] for l_ in np.flatnonzero(~(np.diag(self.hsic) > 0))]

    def _names(self) -> list[str]:
        return self.names if self.names is not None else [f"layer {i}" for i in range(self.n_layers)]

    def batch_hsic(self) -> np.ndarray:
        """Per-batch HSIC records, (B, L, L) float64, in canonical order."""
        L = self.n_layers
        rec = self._canonical()
        out = np.zeros((rec.shape[0], L, L))
        out[:, self._iu[0], self._iu[1]] = rec
        out[:, self._iu[1], self._iu[0]] = rec
        return out

    def _canonical(self) -> np.ndarray:
        if not self._batches:
            return np.zeros((0, self.n_layers * (self.n_layers + 1) // 2))
        rec = np.stack(self._batches)
        order = np.lexsort(rec.T[::-1])
        return rec[order]

    def _bootstrap(self, ci: float, n_boot: int, seed: int, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        L = self.n_layers
        rec = self._canonical()  # (B, T)
        B = rec.shape[0]
        m = B if m is None else m
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, B, size=(n_boot, m))
        counts = np.zeros((n_boot, B))
        np.add.at(counts, (np.repeat(np.arange(n_boot), m), draws.ravel()), 1.0)
        iu0, iu1 = self._iu
        diag_cols = np.flatnonzero(iu0 == iu1)  # column of (i, i) in the triangle order
        diag = counts @ rec[:, diag_cols]  # (n_boot, L)
        with np.errstate(invalid="ignore", divide="ignore"):
            root = np.sqrt(np.where(diag > 0, diag, np.nan))
        q = [100 * (1 - ci) / 2, 100 * (1 + ci) / 2]
        lo_t = np.empty(rec.shape[1])
        hi_t = np.empty(rec.shape[1])
        step = max(1, (1 << 24) // max(n_boot, 1))
        for s in range(0, rec.shape[1], step):
            cols = slice(s, s + step)
            sums = counts @ rec[:, cols]
            cka = sums / (root[:, iu0[cols]] * root[:, iu1[cols]])
            lo_t[cols], hi_t[cols] = np.nanpercentile(cka, q, axis=0)
        lower = np.zeros((L, L))
        upper = np.zeros((L, L))
        lower[iu0, iu1] = lo_t
        lower[iu1, iu0] = lo_t
        upper[iu0, iu1] = hi_t
        upper[iu1, iu0] = hi_t
        return lower, upper
