"""Linear CKA of two representations (Kornblith et al. 2019; paper Eq. 10):

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)),    K = X Xᵀ,  L = Y Yᵀ,

with the biased HSIC₀ (Eq. 10 itself) or Song et al.'s unbiased HSIC₁.  The HSIC estimators, the
all-pairs batch kernel and the precision rule with its error bound are :mod:`repsim.kernels.hsic`;
the all-pairs minibatch accumulator (paper §3.2) is :class:`repsim.kernels.minibatch_cka.MinibatchCKA`.
"""
from __future__ import annotations

import math
from typing import Any

from repsim.array_api import array_namespace, as_array, gram_dtype
from repsim.kernels._gram import gram64, prepare_layer
from repsim.kernels.hsic import batch_hsic, check_n, hsic_to_cka

__all__ = ["linear_cka"]


def _constant_error(what: str) -> ValueError:
    return ValueError(f"{what} is constant over the examples (zero variance): CKA is undefined")


def linear_cka(X: Any, Y: Any, debiased: bool = True, *, xp: Any = None,
               compute_dtype: Any = None) -> float:
    """Linear CKA of X (n, p1) and Y (n, p2) (paper Eq. 10); inputs with more axes are flattened.

    Default: the debiased estimator (``debiased=True``, Song et al.'s unbiased HSIC₁, n >= 4), the
    paper's and that of every other linear-CKA entry point at its defaults (``repsim.similarity(X, Y,
    "linear_cka")``, :class:`MinibatchCKA`, :func:`repsim.cka_matrix`, ``repsim cka``/``similarity``),
    so that all give the same number on the same arrays.

    ``debiased=False``: Eq. 10 itself (biased HSIC₀), ‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F ‖Ycᵀ Yc‖_F) with column-centred
    features. ``debiased=True``: the same ratio with Song et al.'s unbiased HSIC₁ (:mod:`repsim.kernels.hsic`
    docstring). The cheaper of the feature-space form (cost ~ n(p1 p2 + p1² + p2²)) and the Gram
    form (cost ~ n²(p1 + p2)) is used; the debiased feature-space form
    n(n-3)·HSIC₁ = ‖Ycᵀ Xc‖² - (n/(n-2)) Σ_i ‖x_i‖²‖y_i‖² + tr K · tr L / ((n-1)(n-2))
    (rows of centred data) is used only in float64, where its cancellation is harmless.
    Precision as in :class:`MinibatchCKA` (:mod:`repsim.kernels.hsic`): the feature-space products of
    float32 layers are summed over slabs of ``GRAM_SLAB`` rows in float64.
    """
    X, Y = as_array(X), as_array(Y)
    xp = array_namespace(X, Y, xp=xp)
    n = X.shape[0]
    check_n(n, debiased, "X")
    Xc, k, const_x = prepare_layer(X, xp, gram_dtype(X.dtype, xp, compute_dtype), None, "X")
    if const_x:
        raise _constant_error("X")
    Yc, l_, const_y = prepare_layer(Y, xp, gram_dtype(Y.dtype, xp, compute_dtype), n, "Y")
    if const_y:
        raise _constant_error("Y")
    p1, p2 = Xc.shape[1], Yc.shape[1]
    feature_cost = p1 * p2 + p1 * p1 + p2 * p2
    gram_cost = n * (p1 + p2) + 3 * n
    exact64 = Xc.dtype == xp.float64 and Yc.dtype == xp.float64
    use_features = feature_cost <= gram_cost and (not debiased or exact64)
    if not use_features:
        h = batch_hsic([Xc, Yc], debiased=debiased, xp=xp, _centered=True)
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
    if not all(map(math.isfinite, (hxx_f, hyy_f, hxy_f))):  # ‖XᵀY‖² overflowed even float64: not a CKA of 0
        raise ValueError(f"HSIC overflows (X: {hxx_f:.3g}, Y: {hyy_f:.3g}, XY: {hxy_f:.3g}); rescale the layers "
                         "(CKA does not change)")
    if hxx_f <= 0 or hyy_f <= 0:
        raise ValueError(
            f"self-HSIC is not positive (X: {hxx_f:.3g}, Y: {hyy_f:.3g}); CKA is undefined"
        )
    return hxy_f / math.sqrt(hxx_f * hyy_f)
