"""Every similarity measure of repsim.kernels.measures against a brute-force reference written from its
formula (or a peer: SciPy, scikit-learn), with its known answers: identical -> its maximum, the
invariances it claims, independent noise -> near its null; and the protocol (registry, metadata, states)."""
from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
from scipy.linalg import orthogonal_procrustes
from scipy.spatial.distance import pdist
from scipy.stats import spearmanr

from repsim.kernels.measures import MEASURES, get_measure, measure_names, parse_measures
from repsim.kernels.measures.exact import exact_matrix, full_column, similarity
from repsim.kernels.measures.rbf_cka import MinibatchRBFCKA

N = 150


def data(seed=0, n=N, p=12, q=9):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 3.0
    Y = np.tanh(X[:, :q] @ rng.normal(size=(q, q))) + 0.5 * rng.normal(size=(n, q))
    return X, Y, rng


def rotate(X, rng, scale=2.5, shift=1.0):
    Q, _ = np.linalg.qr(rng.normal(size=(X.shape[1], X.shape[1])))
    return scale * X @ Q + shift


# ---------------------------------------------------------------------------------- brute-force references
def nb_center_gram(gram, unbiased):  # the google-research CKA notebook's center_gram
    gram = gram.copy()
    n = gram.shape[0]
    if unbiased:
        np.fill_diagonal(gram, 0)
        means = np.sum(gram, 0) / (n - 2)
        means -= np.sum(means) / (2 * (n - 1))
        gram -= means[:, None]
        gram -= means[None, :]
        np.fill_diagonal(gram, 0)
    else:
        means = np.mean(gram, 0)
        means -= np.mean(means) / 2
        gram -= means[:, None]
        gram -= means[None, :]
    return gram


def nb_gram_rbf(x, threshold=1.0):  # the notebook's gram_rbf
    dot = x @ x.T
    sq = np.diag(dot)
    d2 = -2 * dot + sq[:, None] + sq[None, :]
    return np.exp(-d2 / (2 * threshold ** 2 * np.median(d2)))


def nb_cka(gx, gy, debiased):
    gx, gy = nb_center_gram(gx, debiased), nb_center_gram(gy, debiased)
    return gx.ravel() @ gy.ravel() / (np.linalg.norm(gx) * np.linalg.norm(gy))


def ref_cca(X, Y):
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    def inv_sqrt(C):
        w, V = np.linalg.eigh(C)
        return V @ np.diag(w ** -0.5) @ V.T
    M = inv_sqrt(Xc.T @ Xc) @ Xc.T @ Yc @ inv_sqrt(Yc.T @ Yc)
    U, rho, _ = np.linalg.svd(M, full_matrices=False)
    return rho[:min(X.shape[1], Y.shape[1])], Xc @ inv_sqrt(Xc.T @ Xc) @ U[:, :min(X.shape[1], Y.shape[1])]


def ref_svd_reduce(X, keep=0.99):
    Xc = X - X.mean(0)
    U, s, _ = np.linalg.svd(Xc, full_matrices=False)
    k = next(i + 1 for i in range(s.size) if np.sum(s[:i + 1] ** 2) / np.sum(s ** 2) >= keep)
    return U[:, :k] * s[:k]


def ref_knn(X, Y, k):
    def nn(Z):
        Zn = Z / np.linalg.norm(Z, axis=1, keepdims=True)
        S = Zn @ Zn.T
        np.fill_diagonal(S, -np.inf)
        return [set(np.argsort(-S[i], kind="stable")[:k].tolist()) for i in range(Z.shape[0])]
    a, b = nn(X), nn(Y)
    return np.mean([len(a[i] & b[i]) / k for i in range(X.shape[0])])


# ---------------------------------------------------------------------------------- protocol
def test_registry_names_and_metadata():
    names = measure_names()
    assert names[:2] == ["linear_cka", "rbf_cka"] and len(names) >= 9  # listing order: MeasureInfo.order
    assert [MEASURES[m].info.order for m in names] == sorted(MEASURES[m].info.order for m in names)
    assert len(names) >= 8
    for name in names:
        m = get_measure(name)
        assert MEASURES[name] is type(m) and m.info.name == name and m.info.formula and m.info.source
        lo, hi = m.info.range
        assert m.info.identical == hi and isinstance(m.info.null, str) and m.info.null
    assert parse_measures("rbf_cka, linear_cka,rbf_cka") == ["rbf_cka", "linear_cka"]
    with pytest.raises(ValueError, match="unknown measure 'nope'"):
        parse_measures("nope")
    assert not get_measure("pwcca").info.symmetric and not get_measure("ridge_r2").info.symmetric


def test_the_docs_table_shows_each_measures_declared_null():
    """docs/measures.md says its table is the declared metadata: its "range, identical, null" cell ends
    with MeasureInfo.null (it said ≈ k/(n−1) for mutual k-NN while the metadata said 0.0)."""
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "measures.md")).read()
    rows = {cells[1].strip("` "): cells for cells in (re.split(r"(?<!\\)\|", line) for line in text.splitlines())
            if len(cells) > 5 and cells[1].strip().startswith("`")}
    assert sorted(rows) == sorted(measure_names())
    for name in measure_names():
        assert rows[name][5].strip().endswith(", " + get_measure(name).info.null), (name, rows[name][5])


@pytest.mark.parametrize("name", ["linear_cka", "rbf_cka", "procrustes", "cca", "svcca", "pwcca", "rsa",
                                  "mutual_knn", "ridge_r2"])
def test_identical_gives_the_maximum_and_noise_the_null(name):
    X, _, rng = data(1, n=300, p=8, q=6)
    assert similarity(X, X, name) == pytest.approx(1.0, abs=1e-6 if name != "ridge_r2" else 2e-3)
    # the declared null (MeasureInfo.null), from 40 independent noise layers, to within 4 standard errors of
    # their mean: "0" (linear/RBF CKA, RSA: centred, unbiased at independence), "≈ k/(n−1)" (mutual k-NN,
    # k = 10: the overlap of two random neighbour sets), "≤ 0" (ridge R²: a held-out fit of noise),
    # "small > 0" (the CCA family, Procrustes: positive, a bias that shrinks as 1/√n, so about half at 4n)
    reps = 40
    noise = np.array([similarity(X, rng.normal(size=(300, 6)), name) for _ in range(reps)])
    mean, se = noise.mean(), noise.std(ddof=1) / np.sqrt(reps)
    null = get_measure(name).info.null
    if null == "0":
        assert abs(mean) < 4 * se, (mean, se)
    elif null == "≈ k/(n−1)":
        assert abs(mean - 10 / 299) < 4 * se, (mean, se)
    elif null == "≤ 0":
        assert mean < 4 * se and np.all(noise < 0.02), (mean, se, noise.max())
    else:
        assert null == "small > 0" and np.all(noise > 0), noise.min()
        X4, _, _ = data(1, n=1200, p=8, q=6)
        big = np.array([similarity(X4, rng.normal(size=(1200, 6)), name) for _ in range(reps)])
        ratio = mean / big.mean()  # 1/√n: 2 at 4n (measured 1.8-2.1)
        assert 1.5 < ratio < 2.5, (mean, big.mean())


@pytest.mark.parametrize("name", ["linear_cka", "rbf_cka", "procrustes", "cca", "svcca", "ridge_r2"])
def test_orthogonal_scaling_translation_invariance(name):
    X, Y, rng = data(2)
    assert similarity(rotate(X, rng), Y, name) == pytest.approx(similarity(X, Y, name), abs=1e-9)


@pytest.mark.parametrize("name", ["linear_cka", "rbf_cka", "procrustes", "ridge_r2", "rsa", "mutual_knn"])
def test_rows_far_from_the_origin_keep_their_digits(name, tmp_path):
    """A wide column (p > n: held as a Gram) 1e5-1e6 times its spread from the origin: the uncentred
    Gram X Xᵀ lost ~1e-5 of the value at 1e5 and called the column constant at 1e6 (NaN); the Gram of
    rows shifted by a mean keeps float64's digits, in memory and through the engine. RSA and mutual kNN,
    which are not translation invariant, see the same uncentred rows as before."""
    import repsim

    rng = np.random.default_rng(6)
    X = rng.standard_normal((40, 300))
    Y = X[:, :50] @ rng.standard_normal((50, 60)) + rng.standard_normal((40, 60))
    invariant = name not in ("rsa", "mutual_knn")
    for offset in (1e5, 1e6):
        Xo = X + offset
        want = similarity(X, Y, name) if invariant else similarity(Xo, Y, name)
        assert similarity(Xo, Y, name) == pytest.approx(want, rel=1e-9, abs=1e-12), (name, offset)
        if not invariant:  # the Gram route against the rows route (X kept whole: p <= n)
            assert similarity(Xo[:, :30], Y, name) == pytest.approx(
                exact_matrix(get_measure(name), [full_column(Xo[:, :30]), full_column(Y)]).values[0, 1], rel=1e-9)
    store = repsim.save_store(str(tmp_path / "far.zarr"), {"x": X + 1e6, "y": Y}, np.arange(40) % 2, dtype="float64",
                              chunk_rows=16, meta={"dataset": {"name": "t", "split": "test"}})
    res = repsim.similarity_matrix(store, measures=[name], method="exact", progress=False)
    got = res.values[name][0, 1]
    assert got == pytest.approx(similarity(X + 1e6, Y, name), rel=1e-9), name


def test_constant_column_is_nan_in_the_matrix_not_an_error():
    X, Y, _ = data(3)
    cols = [full_column(X, "x"), full_column(np.ones((N, 4)), "flat"), full_column(Y, "y")]
    for name in measure_names():
        out = exact_matrix(get_measure(name), cols)
        assert out.undefined_columns == ["flat"], name
        assert np.isnan(out.values[1]).all() and np.isfinite(out.values[0, 2]), name


# ---------------------------------------------------------------------------------- each measure
@pytest.mark.parametrize("debiased", [True, False])
@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_rbf_cka_exact_matches_the_notebook(debiased, t):
    X, Y, _ = data(4)
    want = nb_cka(nb_gram_rbf(X, t), nb_gram_rbf(Y, t), debiased)
    got = similarity(X, Y, "rbf_cka", debiased=debiased, rbf_threshold=t)
    assert abs(got - want) <= 1e-9


def test_rbf_cka_minibatch_is_the_sum_over_batch_hsic_and_merges():
    X, Y, rng = data(5, n=240)
    W = rng.normal(size=(240, 300))  # wide (p >= 4b): enters as its centred Gram in the engine too
    cols = [X, Y, W]
    batches = np.array_split(rng.permutation(240), 4)
    m = get_measure("rbf_cka")
    acc = m.accumulator(["x", "y", "w"])
    parts = [m.accumulator(["x", "y", "w"]) for _ in range(2)]
    H = np.zeros((3, 3))
    for i, rows in enumerate(batches):
        acc.update([c[rows] for c in cols])
        parts[i % 2].update([c[rows] for c in cols])
        G = [nb_center_gram(nb_gram_rbf(c[rows]), True) for c in cols]
        H += np.array([[a.ravel() @ b.ravel() for b in G] for a in G]) / (rows.size * (rows.size - 3))
    want = H / np.sqrt(np.outer(np.diag(H), np.diag(H)))
    np.testing.assert_allclose(acc.result(), want, atol=1e-9)
    merged = parts[0].merge(MinibatchRBFCKA.from_state(parts[1].to_state()))
    np.testing.assert_allclose(merged.result(), acc.result(), atol=1e-12)


@pytest.mark.parametrize("device", ["CPU_DEVICE", "device1"])
@pytest.mark.parametrize("debiased", [True, False])
def test_rbf_cka_minibatch_on_a_device_equals_the_host(device, debiased, monkeypatch):
    """The device route of MinibatchRBFCKA (array-api-strict: its CPU device, and device1, where
    any array made without ``device=`` fails) gives the host's numbers to 1e-9 — rows and centred
    Grams in, a constant column and one whose median distance is 0 (most rows zero) undefined on
    both — copies nothing to the host per column (one transfer per batch: the inner update's), and
    reports a NaN under the column's name."""
    xs = pytest.importorskip("array_api_strict")
    from repsim.kernels.hsic import centered_gram

    dev = xs.Device(device)
    X, Y, rng = data(7, n=200)
    W = rng.normal(size=(200, 300))
    C = np.full((200, 4), 2.5)  # constant
    Z = np.zeros((200, 5))
    Z[::8] = rng.normal(size=(25, 5))  # 7/8 of the rows coincide: median distance 0
    cols = [X, Y, W, C, Z]
    names = ["x", "y", "w", "c", "z"]
    batches = np.array_split(rng.permutation(200), 4)
    m = get_measure("rbf_cka", debiased=debiased)
    host, onto = m.accumulator(names), m.accumulator(names)
    syncs = []
    cls = type(xs.asarray(0.0))
    for meth in ("__dlpack__", "__array__", "__float__", "__bool__", "__int__", "__index__"):
        orig = getattr(cls, meth, None)
        if orig is not None:
            monkeypatch.setattr(cls, meth, lambda self, *a, _o=orig, **k: syncs.append(1) or _o(self, *a, **k))
    with pytest.warns(RuntimeWarning):
        for rows in batches:
            host.update([c[rows] for c in cols])
            # the engine's inputs: rows for narrow columns, a centred Gram for the wide one
            batch = [xs.asarray(c[rows], device=dev) for c in cols]
            batch[2] = centered_gram(batch[2], xs, "w")
            before = len(syncs)
            onto.update(batch)
            assert len(syncs) - before == 1  # the inner update's one transfer; none per column
        want, got = host.result(), onto.result()
    np.testing.assert_allclose(got, want, atol=1e-9, rtol=0)
    assert np.isnan(got[3]).all() and np.isnan(got[4]).all() and sorted(onto.undefined()) == ["c", "z"]
    bad = X[batches[0]].copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="y contains NaN"):
        m.accumulator(["x", "y"]).update([xs.asarray(X[batches[0]], device=dev), xs.asarray(bad, device=dev)])


def test_procrustes_matches_the_nuclear_norm_and_scipy_and_its_wide_route():
    X, Y, rng = data(6)
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    want = np.linalg.norm(Xc.T @ Yc, "nuc") / (np.linalg.norm(Xc) * np.linalg.norm(Yc))
    assert abs(similarity(X, Y, "procrustes") - want) <= 1e-12
    _, scale = orthogonal_procrustes(Xc, np.pad(Yc, ((0, 0), (0, 3))))  # max_Q tr(Qᵀ XcᵀYc), Q orthogonal
    assert abs(similarity(X, Y, "procrustes") - scale / (np.linalg.norm(Xc) * np.linalg.norm(Yc))) <= 1e-12
    W = rng.normal(size=(N, 400)) + X[:, :1]  # p > n: the n × n route
    Wc = W - W.mean(0)
    want = np.linalg.norm(Wc.T @ Yc, "nuc") / (np.linalg.norm(Wc) * np.linalg.norm(Yc))
    assert abs(similarity(W, Y, "procrustes") - want) <= 1e-9


def test_cca_family_against_the_covariance_formulas():
    X, Y, _ = data(7)
    rho, H = ref_cca(X, Y)
    assert abs(similarity(X, Y, "cca") - rho.mean()) <= 1e-9
    Xr, Yr = ref_svd_reduce(X), ref_svd_reduce(Y)
    assert abs(similarity(X, Y, "svcca") - ref_cca(Xr, Yr)[0].mean()) <= 1e-9
    alpha = np.abs(H.T @ (X - X.mean(0))).sum(axis=1)  # Morcos et al.: αᵢ = Σⱼ |⟨hᵢ, xⱼ⟩|
    assert abs(similarity(X, Y, "pwcca") - (alpha * rho).sum() / alpha.sum()) <= 1e-9
    assert similarity(X, Y, "pwcca") != pytest.approx(similarity(Y, X, "pwcca"), abs=1e-6)  # asymmetric


@pytest.mark.parametrize("p", [64, 400])  # the rows route and the Gram / factor route (n = 300)
def test_cca_of_low_rank_layers_stored_in_float32_or_float16_ignores_their_rounding(p):
    """Two read-outs of one 8-d code span the same space: every canonical correlation is 1. Stored in
    float32/float16, each has p − 8 further directions of rounding noise (≤ u ‖X‖_F); counted as rank,
    they pulled ρ̄ to 0.40. Full-rank data keep every direction: ρ̄ as in float64."""
    rng = np.random.default_rng(21)
    Z = rng.normal(size=(300, 8))
    A, B = Z @ rng.normal(size=(8, p)), Z @ rng.normal(size=(8, p)) + 5.0
    for dtype in (np.float64, np.float32, np.float16):
        a, b = A.astype(dtype), B.astype(dtype)
        for name in ("cca", "svcca"):
            assert similarity(a, b, name) == pytest.approx(1.0, abs=1e-6), (name, dtype)  # float16: 2e-8 off
        if p <= 300:
            assert similarity(a, b, "pwcca") == pytest.approx(1.0, abs=1e-3), dtype
    X, Y, _ = data(22, n=300, p=40, q=30)
    ref = similarity(X, Y, "cca")
    for dtype, tol in ((np.float32, 1e-6), (np.float16, 2e-3)):
        assert similarity(X.astype(dtype), Y.astype(dtype), "cca") == pytest.approx(ref, abs=tol)
        assert full_column(X.astype(dtype)).source_eps == np.finfo(dtype).eps


def test_unknown_options_are_refused_not_ignored():
    X, Y, _ = data(23)
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'k' for mutual_knn; the options: knn_k \(default 10\)"):
        similarity(X, Y, "mutual_knn", k=5)
    with pytest.raises(ValueError, match="'threshold'.*rbf_threshold"):
        similarity(X, Y, "rbf_cka", threshold=0.5)
    with pytest.raises(ValueError, match="'unbiased'"):
        similarity(X, Y, "rbf_cka", unbiased=False)
    assert similarity(X, Y, "mutual_knn", knn_k=5) != similarity(X, Y, "mutual_knn")


def test_cca_with_too_few_rows_is_undefined_and_pwcca_refuses_wide_columns():
    rng = np.random.default_rng(8)
    X, Y = rng.normal(size=(20, 12)), rng.normal(size=(20, 12))
    out = exact_matrix(get_measure("cca"), [full_column(X, "x"), full_column(Y, "y")])
    assert np.isnan(out.values).all() and ("x", "y") in out.undefined_pairs and not out.undefined_columns
    with pytest.raises(ValueError, match="pwcca needs the features of X .*--spatial mean"):
        similarity(rng.normal(size=(20, 50)), X, "pwcca")



@pytest.mark.parametrize("stack_bytes", [None, 1])
@pytest.mark.parametrize("name", ["procrustes", "cca", "svcca", "pwcca"])
def test_a_row_of_stacked_pairs_equals_its_pairs_one_by_one(name, stack_bytes, monkeypatch):
    """Measure.pairs (the engine's row: Procrustes' and CCA's SVDs stacked by width, in chunks of
    PAIR_BATCH, or one by one when a stack would exceed STACK_BYTES) gives each pair's own value,
    undefined pairs (CCA with r_a + r_b > n - 1) included."""
    from repsim.kernels.measures import _batched

    if stack_bytes is not None:
        monkeypatch.setattr(_batched, "STACK_BYTES", stack_bytes)
    rng = np.random.default_rng(11)
    n = 40
    widths = [3, 5, 5, 30, 5, 3, 60] + [5] * (_batched.PAIR_BATCH + 3)  # mixed widths; one width > a stack
    cols = [rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) for p in widths]
    m = get_measure(name)
    prepared = [m.prepare(full_column(c, f"c{i}")) for i, c in enumerate(cols) if name != "pwcca" or c.shape[1] <= n]
    for a in prepared[:4]:
        got = m.pairs(a, prepared)
        want = [m.pair(a, b) for b in prepared]
        assert len(got) == len(want)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)  # (NaN where undefined, in both)
    if name == "cca":  # r = 30 beside r = 30 (wide column's rank) exceeds n - 1 rows: undefined
        assert math.isnan(m.pairs(prepared[3], [prepared[3]])[0])


def test_cross_singular_values_are_those_of_each_product():
    from repsim.kernels.measures._batched import cross_singular_values

    rng = np.random.default_rng(12)
    A = rng.normal(size=(30, 7))
    Bs = [rng.normal(size=(30, w)) for w in (4, 9, 4, 0, 7)]
    got = cross_singular_values(A, Bs)
    for B, s in zip(Bs, got):
        want = np.linalg.svd(A.T @ B, compute_uv=False) if B.shape[1] else np.zeros(0)
        np.testing.assert_allclose(s, want, rtol=1e-12)


@pytest.mark.parametrize("wide", [False, True])
def test_rsa_matches_scipy_pdist_and_spearman(wide):
    X, Y, rng = data(9, n=80)
    if wide:  # p > n: Pearson from the uncentred Gram and row sums
        X = np.concatenate([X, rng.normal(size=(80, 200))], axis=1)
    want = spearmanr(pdist(X, "correlation"), pdist(Y, "correlation")).statistic
    assert abs(similarity(X, Y, "rsa") - want) <= 1e-9
    # a seeded subsample of rows beyond rsa_max_rows: the same rows for both
    idx = np.sort(np.random.default_rng(3).choice(80, size=50, replace=False))
    sub = spearmanr(pdist(X[idx], "correlation"), pdist(Y[idx], "correlation")).statistic
    assert abs(similarity(X, Y, "rsa", rsa_max_rows=50, rsa_seed=3) - sub) <= 1e-9


@pytest.mark.parametrize("wide", [False, True])
def test_mutual_knn_matches_brute_force_neighbour_sets(wide):
    X, Y, rng = data(10, n=200)
    if wide:
        X = np.concatenate([X, rng.normal(size=(200, 300))], axis=1)
    for k in (1, 10):
        assert abs(similarity(X, Y, "mutual_knn", knn_k=k) - ref_knn(X, Y, k)) <= 1e-12
    assert similarity(X, 3 * X @ np.linalg.qr(rng.normal(size=(X.shape[1],) * 2))[0], "mutual_knn") == 1.0


@pytest.mark.parametrize("shape", ["narrow", "wide low-rank"])
def test_ridge_r2_matches_scikit_learn_ridgecv_per_fold(shape):
    """On the features themselves, λ grid ALPHAS × X̃_tr's mean squared singular value; a wide column
    (its n × r factor, r = 8 here) gives the same R² as ridge on its p = 400 features."""
    from sklearn.linear_model import RidgeCV

    from repsim.kernels.measures.ridge import ALPHAS, folds

    X, Y, rng = data(11, n=120)
    if shape != "narrow":
        X = X[:, :8] @ rng.normal(size=(8, 400))
    sse = sst = 0.0
    for test in folds(120, 5, 0):
        train = np.setdiff1d(np.arange(120), test)
        s = np.linalg.svd(X[train] - X[train].mean(0), compute_uv=False)
        model = RidgeCV(alphas=ALPHAS * np.mean(s ** 2)).fit(X[train], Y[train])
        sse += np.sum((Y[test] - model.predict(X[test])) ** 2)
        sst += np.sum((Y[test] - Y[train].mean(0)) ** 2)
    assert abs(similarity(X, Y, "ridge_r2") - (1 - sse / sst)) <= 1e-6
    assert similarity(X, Y, "ridge_r2") != pytest.approx(similarity(Y, X, "ridge_r2"), abs=1e-3)


@pytest.mark.parametrize("kind", ["normal", "few values", "sorted", "zeros", "reversed"])
def test_rbf_median_by_bracketing_is_numpys_median_exactly(kind):
    """rbf_cka's σ² median (bracketed by a strided sample, then a partial partition) equals
    np.median of all entries exactly, also for orders that defeat the sample (it falls back)."""
    from repsim.kernels.measures.rbf_cka import median_all

    rng = np.random.default_rng(11)
    for b in (2, 3, 37, 150, 301):
        D = {"normal": lambda: rng.normal(size=(b, b)),
             "few values": lambda: rng.integers(0, 3, size=(b, b)).astype(float),
             "sorted": lambda: np.sort(rng.normal(size=b * b)).reshape(b, b),
             "zeros": lambda: np.zeros((b, b)),
             "reversed": lambda: np.sort(rng.exponential(size=b * b))[::-1].reshape(b, b).copy()}[kind]()
        for sample in (4, 16, 4096):
            assert median_all(D, sample=sample) == np.median(D), (b, sample)
