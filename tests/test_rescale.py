"""The objective-settings rule (repsim/study/rescale.py) on the paper's own numbers, and the Fashion-MNIST
presets recording its values for K = 5 classes and base weight decay 0.05 (repsim/analyses/README.md,
"Settings by rule")."""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from repsim.study import rescale
from repsim.study.objectives import OBJECTIVES

PRESETS = Path(__file__).resolve().parents[1] / "repsim" / "train" / "presets"


def _preset(name: str) -> dict:
    return tomllib.loads((PRESETS / f"{name}.toml").read_text())


# the paper's tuned values, typed here from its tables (not read from repsim.rescale): (K, τ) for CIFAR-10
# (ICLR-2021 Table A.2), CIFAR-100 (same) and ImageNet (Table A.1)
PAPER_TAU = {"cosine_softmax": [(10, 0.08), (100, 0.1), (1000, 0.05)],
             "logit_norm": [(10, 0.14), (100, 0.11), (1000, 0.04)]}


def _fit(obj: str) -> tuple[float, float]:
    k, t = np.array(PAPER_TAU[obj]).T
    b, a = np.polyfit(np.log10(k), np.log10(t), 1)  # NumPy's least squares, not the module's sums
    return b, a


def test_tau_fit_is_the_least_squares_line_through_the_papers_values():
    assert {o: [tuple(p) for p in pts] for o, pts in rescale.PAPER_TAU.items()} == PAPER_TAU
    for obj, pts in PAPER_TAU.items():
        assert rescale.tau_fit(obj) == pytest.approx(_fit(obj), rel=1e-12)
        b, a = _fit(obj)
        assert b < 0  # τ rises as K falls, for both normalised objectives
        for k, t in pts:  # the fit stays within ±30 % of each tuned value (docstring: worst −26 %)
            assert abs(10 ** (a + b * np.log10(k)) / t - 1) < 0.3, (obj, k)
            assert rescale.tau(obj, k) == pytest.approx(10 ** (a + b * np.log10(k)), rel=1e-12)
    assert rescale.tau("cosine_softmax", 5) == pytest.approx(0.1000, abs=5e-4)
    assert rescale.tau("logit_norm", 5) == pytest.approx(0.192, abs=1e-3)


def test_extra_l2_is_the_papers_median_multiple_of_the_base_decay():
    ratios = sorted(lam / wd for _, wd, lam in rescale.PAPER_EXTRA_L2)
    assert ratios == pytest.approx([10 ** (-3.33 + 2.75), 10, 10], rel=1e-6)
    assert rescale.extra_l2_ratio() == pytest.approx(10)
    assert rescale.params("extra_l2", 5, 0.05) == {"lambda_final": 0.5}
    assert rescale.params("extra_l2", 1000, 8e-5) == {"lambda_final": pytest.approx(8e-4)}  # ImageNet back


def test_k_free_and_nearest_study_parameters():
    assert rescale.params("label_smoothing", 5, 0.05) == {"alpha": 0.1}
    assert rescale.params("squared_error", 5, 0.05) == {"kappa": 8.0, "M": 0.83, "loss_scale": 1.0}
    assert rescale.params("squared_error", 1000, 8e-5)["M"] == 60.0
    assert rescale.params("softmax", 5, 0.05) == {} and rescale.params("sigmoid", 5, 0.05) == {}
    text = rescale.table(5, 0.05)
    assert "0.05/0.0582" in text and "0.1" in text.splitlines()[1].split()[-1]


def test_fashion_presets_record_the_rules_values():
    """Each fashion preset's objective_params against values worked out here from the paper's numbers
    (K = 5, base decay 0.05), not against repsim.study.rescale.params: τ from NumPy's fit to two significant
    digits, λ_final = 10 × 0.05 (the median of the ratios 10, 10, 0.26), squared error at the nearest
    study (CIFAR-10, K = 10: κ 8, M 0.83), the K-free values of Table A.1."""
    from repsim.train.fashion import SOURCE_CLASSES

    base = _preset("_fashion")
    k, wd = len(SOURCE_CLASSES), base["optim"]["weight_decay"]
    assert (k, wd) == (5, 0.05)
    tau5 = {o: float(f"{10 ** (_fit(o)[1] + _fit(o)[0] * np.log10(5)):.1e}") for o in PAPER_TAU}
    want = {"softmax": {}, "sigmoid": {}, "label_smoothing": {"alpha": 0.1}, "dropout": {"keep_prob": 0.7},
            "logit_penalty": {"beta": 6e-4}, "extra_l2": {"lambda_final": 0.5},
            "squared_error": {"kappa": 8.0, "M": 0.83, "loss_scale": 1.0},
            "cosine_softmax": {"tau": tau5["cosine_softmax"]}, "logit_norm": {"tau": tau5["logit_norm"]}}
    assert tau5 == {"cosine_softmax": 0.1, "logit_norm": 0.19}
    assert sorted(want) == sorted(OBJECTIVES)
    for obj in OBJECTIVES:
        got = _preset(f"fashion-{obj}").get("objective_params", {})
        assert got == pytest.approx(want[obj], rel=1e-12), obj
        assert rescale.params(obj, k, wd) == pytest.approx(want[obj], rel=1e-12), obj


def test_fashion_presets_residual_init():
    """Blocks that do work (repsim/analyses/README.md): every fashion network starts its blocks' last BN at γ = 1,
    except squared error, which diverges there and keeps the zero-γ init."""
    from repsim.train.config import load_config

    for obj in OBJECTIVES:
        want = obj == "squared_error"
        assert load_config(f"fashion-{obj}")["arch_params"]["zero_init_residual"] is want, obj
