"""Each objective's loss against its equation (Kornblith et al. 2021, Eq. 1–9), computed in NumPy
float64 from the head's own W and b on random inputs; gradients finite; composition; bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

from repsim.train.objectives import DEFAULTS, OBJECTIVES, make_objective

N, M, K = 7, 5, 6


def _inputs(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, M, generator=g, dtype=torch.float64) * scale
    t = torch.randint(0, K, (N,), generator=g)
    return x, t


def _np(head):
    return head.weight.detach().double().numpy(), head.bias.detach().double().numpy()


def _lse(z):
    m = z.max(1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]


def _onehot(t):
    return np.eye(K)[t.numpy()]


def _softmax_ce(z, T):  # Eq. 1: -Σ t_k z_k + log Σ e^{z_k}
    return -(T * z).sum(1) + _lse(z)


def _head(name, **hyper):
    torch.manual_seed(1)
    return make_objective(name, M, K, **hyper).double()


def _check(head, x, t, expected_per_example, extra=0.0):
    got = head.loss(x, t).item()
    assert got == pytest.approx(float(np.mean(expected_per_example)) + extra, rel=1e-10, abs=1e-12)


def test_names_and_defaults_follow_table_a1():
    assert set(OBJECTIVES) == set(DEFAULTS) and len(OBJECTIVES) == 9
    assert DEFAULTS["label_smoothing"]["alpha"] == 0.1
    assert DEFAULTS["extra_l2"]["lambda_final"] == 8e-4
    assert DEFAULTS["dropout"]["keep_prob"] == 0.7
    assert DEFAULTS["logit_penalty"]["beta"] == 6e-4
    assert DEFAULTS["logit_norm"]["tau"] == 0.04
    assert DEFAULTS["cosine_softmax"]["tau"] == 0.05
    assert DEFAULTS["squared_error"] == {"kappa": 9.0, "M": 60.0, "loss_scale": 10.0}


def test_softmax_eq1():
    h = _head("softmax")
    x, t = _inputs()
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    _check(h, x, t, _softmax_ce(z, _onehot(t)))
    np.testing.assert_allclose(h(x).detach().numpy(), z, rtol=1e-12)


@pytest.mark.parametrize("alpha", [0.1, 0.3])
def test_label_smoothing_eq2(alpha):
    h = _head("label_smoothing", alpha=alpha)
    x, t = _inputs(1)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    logp = z - _lse(z)[:, None]
    expected = -1.0 / (1 - alpha) * (((1 - alpha) * _onehot(t) + alpha / K) * logp).sum(1)
    _check(h, x, t, expected)


def test_sigmoid_eq8_and_bias_init():
    h = _head("sigmoid")
    np.testing.assert_allclose(_np(h)[1], -math.log(K))
    with torch.no_grad():
        h.bias.normal_()
    x, t = _inputs(2, scale=3.0)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    T = _onehot(t)
    first = -(T * np.log(np.exp(z) / (np.exp(z) + 1)) + (1 - T) * np.log(1 - np.exp(z) / (np.exp(z) + 1))).sum(1)
    second = -(T * z).sum(1) + np.log(np.exp(z) + 1).sum(1)
    np.testing.assert_allclose(first, second, rtol=1e-9)
    _check(h, x, t, second)


def test_extra_l2_eq4_is_added_once_per_batch():
    lam = 0.05
    h = _head("extra_l2", lambda_final=lam)
    x, t = _inputs(3)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    _check(h, x, t, _softmax_ce(z, _onehot(t)), extra=lam * (W**2).sum())
    # a batch of one example gets the same penalty: it is not per example
    one = h.loss(x[:1], t[:1]).item()
    assert one == pytest.approx(_softmax_ce(z[:1], _onehot(t)[:1])[0] + lam * (W**2).sum(), rel=1e-10)


def test_logit_penalty_eq5():
    beta = 0.01
    h = _head("logit_penalty", beta=beta)
    x, t = _inputs(4)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    _check(h, x, t, _softmax_ce(z, _onehot(t)) + beta * (z**2).sum(1))


def test_logit_norm_eq6():
    tau = 0.2
    h = _head("logit_norm", tau=tau)
    x, t = _inputs(5)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    nz = np.linalg.norm(z, axis=1)
    T = _onehot(t)
    expected = -(T * z).sum(1) / (tau * nz) + _lse(z / (tau * nz[:, None]))
    _check(h, x, t, expected)


@pytest.mark.parametrize("scale_by_tau", [False, True])
def test_cosine_softmax_eq7(scale_by_tau):
    tau = 0.1
    h = _head("cosine_softmax", tau=tau, scale_by_tau=scale_by_tau)
    with torch.no_grad():
        h.bias.normal_()
    x, t = _inputs(6)
    W, b = _np(h)
    X = x.numpy()
    sim = (X @ W.T) / (np.linalg.norm(X, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None, :])
    zc = sim / tau + b
    T = _onehot(t)
    expected = -(T * zc).sum(1) + np.log(np.exp(zc).sum(1))
    _check(h, x, t, expected * (tau if scale_by_tau else 1.0))
    np.testing.assert_allclose(h(x).detach().numpy(), zc, rtol=1e-10)  # logits unscaled either way


def test_squared_error_eq9():
    kappa, Mt, s = 9.0, 60.0, 10.0
    h = _head("squared_error", kappa=kappa, M=Mt, loss_scale=s)
    x, t = _inputs(7, scale=20.0)
    W, b = _np(h)
    z = x.numpy() @ W.T + b
    T = _onehot(t)
    expected = s * (1.0 / K) * (kappa * T * (z - Mt) ** 2 + (1 - T) * z**2).sum(1)
    _check(h, x, t, expected)
    # κ = M = 1, scale 1: plain mean squared error between z and t
    h1 = _head("squared_error", kappa=1.0, M=1.0, loss_scale=1.0)
    W, b = _np(h1)
    z = x.numpy() @ W.T + b
    _check(h1, x, t, ((z - T) ** 2).mean(1))


def test_dropout_eq3_train_mode_masks_features_eval_mode_does_not():
    rho = 0.6
    Mbig = 4  # M <= K so the dropped features can be recovered from the logits by least squares
    torch.manual_seed(3)
    h = make_objective("dropout", Mbig, K, keep_prob=rho).double()
    g = torch.Generator().manual_seed(8)
    x = torch.rand(200, Mbig, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, K, (200,), generator=g)
    W, b = _np(h)
    h.train()
    loss, zt = h.loss_and_logits(x, t)
    zt = zt.detach().numpy()
    xt = np.linalg.lstsq(W, (zt - b).T, rcond=None)[0].T  # x̃ = x ⊙ ξ / ρ
    X = x.numpy()
    kept = np.isclose(xt, X / rho, atol=1e-8)
    dropped = np.isclose(xt, 0.0, atol=1e-8)
    assert np.all(kept | dropped)
    assert abs(kept.mean() - rho) < 0.06  # Bernoulli(ρ) keep rate over 800 draws
    assert loss.item() == pytest.approx(np.mean(_softmax_ce(zt, np.eye(K)[t.numpy()])), rel=1e-10)
    h.eval()
    np.testing.assert_allclose(h(x).detach().numpy(), X @ W.T + b, rtol=1e-12)
    _check(h, x[:N], t[:N], _softmax_ce(X[:N] @ W.T + b, np.eye(K)[t[:N].numpy()]))


def test_combinations_compose_loss_and_regularisers():
    x, t = _inputs(9)
    T = _onehot(t)
    # cosine softmax + logit penalty: penalty on the cosine logits (the vector entering the loss)
    h = _head("cosine_softmax+logit_penalty", tau=0.1, beta=0.01)
    W, b = _np(h)
    X = x.numpy()
    zc = (X / np.linalg.norm(X, axis=1, keepdims=True)) @ (W / np.linalg.norm(W, axis=1, keepdims=True)).T / 0.1 + b
    _check(h, x, t, _softmax_ce(zc, T) + 0.01 * (zc**2).sum(1))
    # sigmoid + dropout in eval mode is sigmoid
    h = _head("sigmoid+dropout", keep_prob=0.9).eval()
    W, b = _np(h)
    z = X @ W.T + b
    _check(h, x, t, -(T * z).sum(1) + np.log1p(np.exp(z)).sum(1))
    # label smoothing on normalised logits
    h = _head("label_smoothing+logit_norm", alpha=0.1, tau=0.5)
    W, b = _np(h)
    z = X @ W.T + b
    zn = z / (0.5 * np.linalg.norm(z, axis=1, keepdims=True))
    logp = zn - _lse(zn)[:, None]
    _check(h, x, t, -1 / 0.9 * ((0.9 * T + 0.1 / K) * logp).sum(1))


@pytest.mark.parametrize("name", OBJECTIVES)
def test_gradients_finite_including_extreme_features(name):
    torch.manual_seed(0)
    h = make_objective(name, M, K)
    for scale in (1e-6, 1.0, 1e3):
        x, t = _inputs(10, scale)
        x = x.float().requires_grad_(True)
        h.zero_grad()
        loss = h.loss(x, t)
        loss.backward()
        assert torch.isfinite(loss)
        for g in (x.grad, h.weight.grad, h.bias.grad):
            assert g is not None and torch.isfinite(g).all()
        assert h(x).shape == (N, K)
        assert h.weight.shape == (K, M) and h.bias.shape == (K,)


@pytest.mark.parametrize(
    "name,hyper,match",
    [
        ("softmaxx", {}, "unknown objective"),
        ("softmax", {"alpha": 0.1}, "unknown hyperparameter"),
        ("label_smoothing", {"alpha": 1.0}, "alpha"),
        ("sigmoid+squared_error", {}, "two losses"),
        ("logit_norm+cosine_softmax", {}, "logit_norm and cosine"),
        ("dropout", {"keep_prob": 0.0}, "keep_prob"),
        ("cosine_softmax", {"tau": 0.0}, "tau"),
    ],
)
def test_bad_objectives_raise_clear_errors(name, hyper, match):
    with pytest.raises(ValueError, match=match):
        make_objective(name, M, K, **hyper)


# -- one registry, one table (issue 29) ----------------------------------------------------------------
def _objective_lists(root):
    """file:line of every literal that lists the objectives (a tuple, list or set naming 7 or more) or
    holds per-objective data (a dict keyed by 4 or more); a table's layout naming a few is neither."""
    import ast

    from repsim.study.objectives import OBJECTIVES as names

    out = []
    for pkg in ("repsim", "train", "extract", "analyses"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
                    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
                found = {e.value for e in elts or () if isinstance(e, ast.Constant) and e.value in names}
                if len(found) >= (4 if isinstance(node, ast.Dict) else 7):
                    out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_the_objectives_are_listed_once():
    """repsim/study/objectives.py is the registry (torch-free): train builds heads from it, the analyses order
    and label by it; no other literal lists the objectives."""
    from pathlib import Path

    import repsim.analyses.data
    import repsim.study.objectives as registry

    root = Path(__file__).resolve().parents[1]
    assert _objective_lists(root) == []  # the registry holds one Objective(...) per name, no literal list
    assert OBJECTIVES is registry.OBJECTIVES and repsim.analyses.data.OBJECTIVES is registry.OBJECTIVES
    assert DEFAULTS == {o.name: dict(o.defaults) for o in registry.REGISTRY}
    assert set(OBJECTIVES) <= set(repsim.analyses.data.DISPLAY)


def test_head_dispatches_through_one_table(monkeypatch):
    """Head names no loss or logit map in its methods: LOSSES / LOGIT_MAPS decide, so a new loss is one
    table entry (and a registry entry naming it)."""
    import ast
    import inspect

    import repsim.train.objectives as objectives
    from repsim.study.objectives import BY_NAME, Objective

    tree = ast.parse(inspect.getsource(objectives.Head))
    compared = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
                for side in [n.left, *n.comparators] if isinstance(side, ast.Attribute)
                and side.attr in ("loss_name", "logit_map")]
    assert compared == []
    # a new loss: mean absolute error of the softmax probabilities, biases starting at 0.5
    mae = objectives.Loss(lambda h, z, t: (z.softmax(1) - torch.nn.functional.one_hot(t, h.num_classes)).abs().sum(1),
                          bias_init=lambda K: 0.5)
    monkeypatch.setitem(objectives.LOSSES, "mae", mae)
    monkeypatch.setitem(BY_NAME, "mae", Objective("mae", "MAE", "loss", {}, loss="mae"))
    head = make_objective("mae+dropout", 6, 3, keep_prob=0.9)
    assert head.loss_name == "mae" and torch.all(head.bias == 0.5)
    assert torch.isfinite(head.loss(torch.randn(4, 6), torch.tensor([0, 1, 2, 0])))
