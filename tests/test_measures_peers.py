"""The similarity measures against peer implementations that install as test dependencies
(pyproject's ``[dev]`` extra): ckatorch (linear and RBF CKA, biased and debiased, after the
google-research notebook; Nguyen et al.'s minibatch linear CKA) and rsatoolbox (Kriegeskorte's
RSA: correlation-distance RDMs compared by Spearman's ρ).  tests/test_measures.py checks the same
measures against brute-force references written from their formulas; here the numbers come from
code that is not ours."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.kernels.measures import get_measure
from repsim.kernels.measures.exact import exact_matrix, full_column, similarity

torch = pytest.importorskip("torch")
ckatorch = pytest.importorskip("ckatorch")
rsatoolbox = pytest.importorskip("rsatoolbox")


def pair(seed: int, n: int = 121, p: int = 15, q: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """Two related representations of n examples (Y a noisy nonlinear function of X).

    n is odd for the RBF comparisons: σ² is the median of the n² squared distances, which the
    notebook (and repsim) take with ``np.median`` — for an even count the mean of the two middle
    values — while ckatorch's ``torch.median`` returns the lower one (a 1e-5 difference in CKA at
    n = 120); with n² odd the median is one entry and both conventions agree."""
    rng = np.random.default_rng(seed)
    X = np.maximum(rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 0.5, 0.0)
    Y = np.tanh(X[:, :q] @ rng.normal(size=(q, q))) + 0.3 * rng.normal(size=(n, q))
    return X, Y


@pytest.mark.parametrize("kernel,measure", [("linear", "linear_cka"), ("rbf", "rbf_cka")])
@pytest.mark.parametrize("debiased", [False, True])
def test_exact_cka_equals_ckatorch(kernel, measure, debiased):
    from ckatorch.core import cka_base

    for seed, threshold in ((0, 1.0), (1, 0.5), (2, 2.0)):
        X, Y = pair(seed)
        want = float(cka_base(torch.from_numpy(X), torch.from_numpy(Y), kernel=kernel, unbiased=debiased,
                              threshold=threshold))
        got = similarity(X, Y, measure, debiased=debiased, rbf_threshold=threshold)
        assert abs(got - want) <= 1e-9, (seed, got, want)


def test_minibatch_linear_cka_equals_ckatorch_cka_batch():
    """Nguyen et al. 2021's estimator: Σ_B HSIC₁(K_B, L_B) / sqrt(Σ_B HSIC₁(K_B, K_B) Σ_B HSIC₁(L_B, L_B)),
    over the same batches (ckatorch.core.cka_batch takes them stacked)."""
    from ckatorch.core import cka_batch

    X, Y = pair(3, n=240)
    batches = np.array_split(np.random.default_rng(4).permutation(240), 4)
    acc = get_measure("linear_cka").accumulator(["x", "y"])
    for rows in batches:
        acc.update([X[rows], Y[rows]])
    want = float(cka_batch(torch.from_numpy(np.stack([X[r] for r in batches])),
                           torch.from_numpy(np.stack([Y[r] for r in batches]))))
    assert abs(acc.result()[0, 1] - want) <= 1e-9


@pytest.mark.parametrize("wide", [False, True])
def test_rsa_equals_rsatoolbox(wide):
    from rsatoolbox.data import Dataset
    from rsatoolbox.rdm import calc_rdm, compare

    X, Y = pair(5, n=60)
    if wide:  # p > n: repsim takes Pearson distances from the uncentred Gram and row sums
        X = np.concatenate([X, np.random.default_rng(6).normal(size=(60, 150))], axis=1)
    rdms = [calc_rdm(Dataset(Z), method="correlation") for Z in (X, Y)]
    want = float(compare(rdms[0], rdms[1], method="spearman")[0, 0])
    got = similarity(X, Y, "rsa")
    assert abs(got - want) <= 1e-9, (got, want)


def test_all_pairs_matrices_equal_the_peers_pair_by_pair():
    """The exact all-pairs route (prepare once per column, then every pair) gives each pair's peer value."""
    from ckatorch.core import cka_base
    from rsatoolbox.data import Dataset
    from rsatoolbox.rdm import calc_rdm, compare

    X, Y = pair(7, n=81)
    Z = X[:, ::-1] @ np.random.default_rng(8).normal(size=(X.shape[1], 6))
    data = [X, Y, Z]
    cols = [full_column(c, f"c{i}") for i, c in enumerate(data)]
    rbf = exact_matrix(get_measure("rbf_cka"), cols).values
    rsa = exact_matrix(get_measure("rsa"), cols).values
    rdms = [calc_rdm(Dataset(c), method="correlation") for c in data]
    for i in range(3):
        for j in range(3):
            want = float(cka_base(torch.from_numpy(data[i]), torch.from_numpy(data[j]), kernel="rbf", unbiased=True))
            assert abs(rbf[i, j] - want) <= 1e-9
            assert abs(rsa[i, j] - float(compare(rdms[i], rdms[j], method="spearman")[0, 0])) <= 1e-9
