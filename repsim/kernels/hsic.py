"""HSIC of linear kernels: its estimators, the all-pairs HSIC of one batch, and their precision.

The math behind linear CKA (:mod:`repsim.kernels.cka`) and the minibatch accumulator
(:mod:`repsim.kernels.minibatch_cka`); the buffers, panels and threads of the NumPy route are
:mod:`repsim.kernels._gram`, the accelerator route :mod:`repsim.kernels._cka_device`.

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
   centred Gram first (:func:`centered_gram`, slab by slab), and enters as a
   :class:`CenteredGram`.
3. all pairs at once by Song's formula: tr(K̃L̃) = 2 A Aᵀ (symmetric product, a SYRK in NumPy),
   1ᵀK̃L̃1 = R Rᵀ, so H = [2 A Aᵀ + t tᵀ/((n-1)(n-2)) - 2/(n-2) R Rᵀ] / (n(n-3)) with t = R1;
   biased, H = (2 A Aᵀ + diag·diagᵀ) / (n-1)² with the Grams' diagonals. Song's formula holds
   for any symmetric K, so this is ⟨U(K), U(L)⟩ of the Grams exactly as computed — nothing
   assumes that their rows sum to zero.

With NumPy the L layers are spread over the BLAS thread budget (:mod:`repsim.blas`): k threads,
each forming whole layers with single-threaded BLAS in reused buffers; A Aᵀ is likewise split into
k column slabs, so no call runs multi-threaded BLAS (OpenBLAS's idle workers busy-wait ~0.1 s after
one, taking cores from whatever runs next). A itself is kept for the next batch
(``_gram.BufferCache``, :func:`release_buffers`): a fresh one costs page faults and TLB flushes.

Precision and error bound (docs/architecture.md "Numerics")
-------------------------------------------------------------
Each column's Gram precision comes from its dtype (:func:`repsim.array_api.gram_dtype`, also used by the
out-of-core engine): float32 for float16/float32 layers, float64 for float64 (and integer) ones;
``compute_dtype`` overrides it.  A float32 column is computed as

(a) centred with float64 column means, rounded once (:func:`center_rounded`):
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
(``kernels/_cka_device.py``) keeps the same rule (2.3e-9 measured on an H100 and an H200), except on
GPUs with fast float64 products, where its Grams are float64 (1.2e-15 from NumPy float64 on an H100;
:func:`repsim.array_api.gram_dtype`, bench/RESULTS.md "gpu").
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from repsim.array_api import array_namespace, as_array, diagonal, gram_dtype, on_device, to_numpy
from repsim.array_api import astype as _astype
from repsim.kernels._cka_device import centered_gram_slabs as device_centered_gram
from repsim.kernels._cka_device import device_batch_hsic
from repsim.kernels._gram import (A_CACHE, DEVICE_BLOCK_BYTES, HOST_BLOCK_BYTES, HostScratch, centered_gram_slabs,
                                  check_gram, each_column, gram64, is_numpy, is_wide, pair_groups, prepare_gram,
                                  prepare_layer, row_products, sq_norms64, write_panels)
from repsim.kernels._precision import GRAM_SLAB, CenteredGram, ProductOverflow, center_rounded, max_trace, zero_constant

__all__ = ["ucenter", "double_center", "centered_gram", "batch_hsic", "hsic_to_cka", "release_buffers", "max_trace",
           "ProductOverflow"]


def centered_gram(x: Any, xp: Any, what: str = "X", dtype: Any = None) -> CenteredGram:
    """The batch's centred Gram ``K_c = X_c X_cᵀ`` (b × b, float64), which is all that linear HSIC
    sees of a layer: b² numbers instead of b·p, handed to ``MinibatchCKA.update`` as a
    :class:`CenteredGram`.

    ``dtype`` (default :func:`gram_dtype` of ``x``; the engine passes it for the column) is the
    precision of the products, with the rule of this module ("Precision and error bound"): X is
    centred with float64 means and rounded once to ``dtype``, products are summed in ``dtype``
    over feature slabs of at most ``GRAM_SLAB`` and the slabs in float64; K_c is float64.
    NaN or infinite values make tr(K_c) non-finite: ``ValueError`` naming ``what``.  Whether the
    layer is constant over the batch (tr(K_c) within the rounding of the mean,
    :func:`constant_tolerance`) is decided by :func:`batch_hsic` from ``CenteredGram.mean_sq``
    (see :class:`MinibatchCKA` for what a constant layer gives).  On an accelerator (any namespace but NumPy) the rows are centred
    and multiplied as in :func:`batch_hsic`'s accelerator route (``kernels/_cka_device.py``), and
    the check is left to it, which makes it with the batch's one device-to-host copy: the Gram keeps
    ‖x̄‖² on the device (``CenteredGram.mean_sq``) and nothing here waits for the device.
    """
    X = xp.reshape(x, (x.shape[0], -1))
    if dtype is None:
        dtype = gram_dtype(X.dtype, xp)
    if not is_numpy(xp):  # the accelerator route's centring and products (slab by slab when wide); checked with the batch
        K, mean_sq = device_centered_gram(X, xp, dtype, GRAM_SLAB)
        return CenteredGram(K, mean_sq=mean_sq)
    if X.shape[1] > 2 * GRAM_SLAB:
        K, mean_sq = centered_gram_slabs(X, dtype)
    else:
        fresh = X.dtype != dtype
        X = _astype(X, dtype, xp) if fresh else X
        with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN input: reported below, by name
            X, mean = center_rounded(X, xp, dtype, fresh=fresh)
        K = gram64(X, X, xp)
        K = K if K.dtype == xp.float64 else _astype(K, xp.float64, xp)
        mean_sq = float(xp.sum(mean * mean))
        del X
    check_gram(K, xp, mean_sq, what)
    return CenteredGram(K, mean_sq=mean_sq)


def ucenter(K: Any, *, xp: Any = None, overwrite: bool = False) -> Any:
    """U-centering of a symmetric Gram matrix K (n × n, n >= 4), Song et al. (2012), Eq. 5.

    U(K)_ij = K_ij - r_i/(n-2) - r_j/(n-2) + S/((n-1)(n-2)) for i ≠ j and U(K)_ii = 0, where
    r_i = Σ_{l≠i} K_il and S = Σ_{k≠l} K_kl. Then HSIC₁(K, L) = ⟨U(K), U(L)⟩ / (n(n-3)).
    ``overwrite``: centre a floating K in its own memory and return it (NumPy; elsewhere a new array).
    """
    xp = array_namespace(K, xp=xp)
    if K.ndim != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"ucenter needs a square matrix, got shape {K.shape}")
    n = K.shape[0]
    if n < 4:
        raise ValueError(f"U-centering needs n >= 4 examples, got n = {n}")
    if not xp.isdtype(K.dtype, "real floating"):
        K = xp.astype(K, xp.float64)
    # U_ij = K_ij − c_i − c_j off the diagonal, c_i = r_i/(n−2) − S/(2(n−1)(n−2)): two passes over
    # K and one to zero the diagonal (in place on NumPy), not the seven of the formula as written
    r = xp.sum(K, axis=1) - diagonal(K, xp)
    s = xp.sum(r)
    c = r / (n - 2) - s / (2 * (n - 1) * (n - 2))
    if is_numpy(xp):
        U = K if overwrite else K.copy()
        U -= c[:, None]
        U -= c[None, :]
        np.fill_diagonal(U, 0.0)
        return U
    U = (K - c[:, None]) - c[None, :]
    return U * (1 - on_device(xp.eye, n, dtype=K.dtype, device=getattr(K, "device", None)))


def double_center(K: Any, *, xp: Any = None, overwrite: bool = False) -> Any:
    """Double centring of a symmetric n × n matrix K (a Gram): H K H with H = I − 11ᵀ/n, evaluated as
    (K − r1ᵀ − 1rᵀ) + r̄ with r the row means (= the column means, K being symmetric) and r̄ their mean
    (Gretton et al. 2005; HSIC₀(K, L) = ⟨HKH, HLH⟩ / (n − 1)², Kornblith et al. 2019, Eq. 3). Any array
    API namespace; the result has K's dtype. ``overwrite``: centre K in its own memory (no second
    n × n; NumPy and other namespaces with in-place operators) and return it."""
    xp = array_namespace(K, xp=xp)
    if K.ndim != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"double_center needs a square matrix, got shape {K.shape}")
    r = xp.mean(K, axis=1)
    if overwrite:
        K -= r[:, None]
        K -= r[None, :]
        K += xp.mean(r)
        return K
    return ((K - r[:, None]) - r[None, :]) + xp.mean(r)


def check_n(n: int, debiased: bool, what: str = "batch") -> None:
    need = 4 if debiased else 2
    if n < need:
        raise ValueError(
            f"{what} has n = {n} examples; {'debiased (unbiased HSIC)' if debiased else 'biased'} "
            f"CKA needs n >= {need}"
        )


def release_buffers() -> None:
    """Free the buffer that :func:`batch_hsic` / :meth:`MinibatchCKA.update` keep between batches
    (at most 256 MiB; see ``BufferCache``)."""
    A_CACHE.release()


def batch_hsic(layers: Sequence[Any], debiased: bool = True, *, xp: Any = None,
               compute_dtype: Any = None, block_bytes: int | None = None, block_rows: int = 128,
               names: Sequence[str] | None = None, _centered: bool = False) -> np.ndarray:
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
    return batch_hsic_and_widths(layers, debiased, xp, compute_dtype, block_bytes, block_rows, names, _centered)[0]


def _layer_input(X: Any) -> Any:
    """A layer's batch as given (an array or a :class:`CenteredGram`), nested lists as NumPy arrays."""
    return X if isinstance(X, CenteredGram) else as_array(X)


def batch_hsic_and_widths(layers: Sequence[Any], debiased: bool, xp: Any, compute_dtype: Any,
                          block_bytes: int | None, block_rows: int, names: Sequence[str] | None, centered: bool,
                          widths: Sequence[int | None] | None = None) -> tuple[np.ndarray, int, list[int | None]]:
    """:func:`batch_hsic` with what :class:`~repsim.kernels.minibatch_cka.MinibatchCKA` also needs:
    (HSIC matrix, n, features per layer: None for a :class:`CenteredGram`). ``widths``: the
    features each layer had in earlier batches (None: not known); another width is refused."""
    L = len(layers)
    if L == 0:
        raise ValueError("batch_hsic needs at least one layer")
    names = list(names) if names is not None else [f"layer {i}" for i in range(L)]

    first = _layer_input(layers[0])
    first_ns = array_namespace(first.K if isinstance(first, CenteredGram) else first)
    xp = first_ns if xp is None else array_namespace(xp=xp)
    n = first.shape[0]
    check_n(n, debiased, f"batch of {names[0]}")
    seen: list[int | None] = [None] * L
    if not is_numpy(xp):  # an accelerator's route: whole Grams, few large operations, one host transfer
        items = _checked_layers(layers, first, first_ns, names, seen, widths)
        H = device_batch_hsic(items, L, n, debiased, xp, lambda X: gram_dtype(X.dtype, xp, compute_dtype),
                              DEVICE_BLOCK_BYTES if block_bytes is None else block_bytes, names, centered, GRAM_SLAB,
                              getattr(first.K if isinstance(first, CenteredGram) else first, "device", None))
        return H, n, seen
    block_bytes = HOST_BLOCK_BYTES if block_bytes is None else int(block_bytes)
    groups = pair_groups(n, max(int(block_rows), 1), max(block_bytes // (L * 8), 1))
    kept: list[Any] | None = [None] * L if len(groups) > 1 else None
    # one group: each centred layer is dropped after its row of A, so its buffers can be reused
    scratch = HostScratch() if kept is None else None
    diags: list[Any] = [None] * L  # biased HSIC: the Grams' diagonals
    sums: list[Any] = [None] * L  # debiased HSIC: row sums of K̃, accumulated over groups
    constant = [False] * L  # layers constant over this batch (their rows of H are zeroed)

    def column(l_: int, X: Any, A: Any, group: list[tuple[int, int, int]], first_group: bool) -> None:
        """Layer l's part of group ``group``: prepared on first sight, then its row of A."""
        if first_group:
            if not centered and not isinstance(X, CenteredGram) and X.ndim >= 2 and is_wide(X.shape):
                if X.shape[0] != n:  # p ≫ n: its centred Gram, in one pass
                    raise ValueError(f"{names[l_]} has {X.shape[0]} examples, expected {n} (all layers must share examples)")
                X = centered_gram(X, xp, names[l_], gram_dtype(X.dtype, xp, compute_dtype))
            if isinstance(X, CenteredGram):
                Xc, constant[l_] = prepare_gram(X, xp, n, names[l_])
                d = diagonal(Xc.K, xp) if not debiased else None
            elif centered:
                Xc, d = X, (sq_norms64(X, xp) if not debiased else None)
            else:
                Xc, d, constant[l_] = prepare_layer(X, xp, gram_dtype(X.dtype, xp, compute_dtype), n, names[l_],
                                                    scratch)
            if not debiased:
                diags[l_] = d if d.dtype == xp.float64 else xp.astype(d, xp.float64)
            if kept is not None:
                kept[l_] = Xc
        else:
            Xc = kept[l_]
        part = write_panels(A, l_, Xc, group, debiased, xp, scratch)
        sums[l_] = part if sums[l_] is None else sums[l_] + part

    def source(first_group: bool) -> Any:
        if first_group:
            return _checked_layers(layers, first, first_ns, names, seen, widths)
        return ((l_, None) for l_ in range(L))

    H = None
    for gi, group in enumerate(groups):
        shape = (L, sum(m for _, _, m in group))
        A = A_CACHE.take(shape)
        each_column(source(gi == 0), lambda l_, X, A=A, group=group, first_group=gi == 0:
                    column(l_, X, A, group, first_group), parallel=L > 1)
        first = None
        P = row_products(A)
        H = P if H is None else H + P
        A_CACHE.give(A)
        del A
    if debiased:  # Song et al.: tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n-1)(n-2)) - 2/(n-2)·(K̃1)ᵀ(L̃1), over n(n-3)
        R = xp.stack(sums)
        t = xp.sum(R, axis=1)
        H = 2 * H + t[:, None] * t[None, :] / ((n - 1) * (n - 2)) - (2 / (n - 2)) * row_products(R)
        H = H / (n * (n - 3))
    else:
        D = xp.stack(diags)
        H = (2 * H + row_products(D)) / ((n - 1) ** 2)
    out = np.array(to_numpy(H), dtype=np.float64)
    return zero_constant(out, constant), n, seen


def _checked_layers(layers: Sequence[Any], first: Any, first_ns: Any, names: Sequence[str], seen: list[int | None],
                    widths: Sequence[int | None] | None) -> Any:
    """``(l, X)`` for the layers in order (read once, on the calling thread; ``first`` is layer 0,
    read already), each checked to share layer 0's namespace and to keep its features across
    updates (``widths``); the features of each are recorded in ``seen``."""
    for l_ in range(len(layers)):
        X = first if l_ == 0 else _layer_input(layers[l_])
        gram = isinstance(X, CenteredGram)
        if l_ and array_namespace(X.K if gram else X) is not first_ns:
            raise TypeError(f"{names[l_]} comes from another array namespace than {names[0]}")
        if not gram:
            seen[l_] = math.prod(int(d) for d in X.shape[1:])
            before = widths[l_] if widths is not None else None
            if before is not None and seen[l_] != before:
                raise ValueError(f"{names[l_]} has {seen[l_]} features in this batch but {before} in earlier "
                                 "ones; each layer must keep its features across updates")
        yield l_, X


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
