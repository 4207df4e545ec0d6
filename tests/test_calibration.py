"""NLL, ECE (15 bins) and temperature scaling against hand-computed values (Table C.3)."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.probes.calibration import (calibration_report, ece, ece_from_probabilities, fit_temperature, nll,
                                       probabilities)


def test_nll_by_hand():
    z = np.log(np.array([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]))
    y = np.array([0, 1])
    assert nll(z, y) == pytest.approx(-(np.log(0.7) + np.log(0.25)) / 2, rel=1e-12)


def test_ece_by_hand():
    # confidences 0.7 (right), 0.5 (wrong), 0.95 (right), 0.72 (wrong) with 15 bins:
    # 0.7 and 0.72 share bin (0.6667, 0.7333]; 0.5 in (0.4667, 0.5333]; 0.95 in (0.9333, 1]
    p = np.array([[0.7, 0.3], [0.5, 0.5], [0.05, 0.95], [0.72, 0.28]])
    y = np.array([0, 1, 1, 1])
    # argmax of [0.5, 0.5] is class 0 -> wrong
    expected = (2 * abs(0.5 - (0.7 + 0.72) / 2) + abs(0.0 - 0.5) + abs(1.0 - 0.95)) / 4
    assert ece_from_probabilities(p, y) == pytest.approx(expected, abs=1e-12)
    assert ece(np.log(p), y) == pytest.approx(expected, abs=1e-12)
    # bin edges: confidence exactly 2/3 goes to bin (0.6, 0.6667], not with 0.7
    q = np.array([[2 / 3, 1 / 3], [0.7, 0.3]])
    assert ece_from_probabilities(q, np.array([0, 1])) == pytest.approx(
        (abs(1 - 2 / 3) + abs(0 - 0.7)) / 2)


def test_sigmoid_probabilities_normalised_by_sum():
    z = np.array([[2.0, -1.0, 0.5]])
    s = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(probabilities(z, "sigmoid"), s / s.sum(), rtol=1e-12)
    np.testing.assert_allclose(probabilities(z / 2, "sigmoid"), probabilities(z, "sigmoid", 2.0))
    assert nll(z, np.array([2]), "sigmoid") == pytest.approx(-np.log(s[0, 2] / s.sum()))


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_temperature_scaling_minimises_holdout_nll(kind):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 400)
    z = rng.normal(size=(400, 5)) + 2.0 * np.eye(5)[y]
    z *= 3.0                                                   # overconfident
    T = fit_temperature(z, y, kind)
    grid = np.exp(np.linspace(np.log(0.05), np.log(20), 2001))
    brute = grid[np.argmin([nll(z, y, kind, t) for t in grid])]
    assert T == pytest.approx(brute, rel=5e-3)
    assert nll(z, y, kind, T) <= nll(z, y, kind) + 1e-12
    rep = calibration_report(z, y, z, y, kind)
    assert rep["nll_ts"] <= rep["nll"] and rep["temperature"] == pytest.approx(T)
    if kind == "softmax":
        assert T > 1.5 and rep["ece_ts"] < rep["ece"]


def test_bad_input():
    with pytest.raises(ValueError, match="labels"):
        nll(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="kind"):
        nll(np.zeros((2, 3)), np.array([0, 1]), kind="tanh")


# ------------------------------------------------------------------------ `repsim calibrate`
def _ref_probs(z, kind, T):
    """Probabilities by the definition, one example at a time (Table C.3: sigmoid nets normalised)."""
    import math

    out = []
    for row in z:
        e = [math.exp(v / T) for v in row] if kind == "softmax" else [1 / (1 + math.exp(-v / T)) for v in row]
        out.append([v / sum(e) for v in e])
    return np.array(out)


def _ref_nll(z, y, kind, T=1.0):
    import math

    p = _ref_probs(z, kind, T)
    return -sum(math.log(p[i, y[i]]) for i in range(len(y))) / len(y)


def _ref_ece(z, y, kind, T=1.0, bins=15):
    """Σ_b |B_b|/N |acc(B_b) − conf(B_b)|, bin b = ((b−1)/B, b/B], written out bin by bin."""
    p = _ref_probs(z, kind, T)
    conf, pred = p.max(1), p.argmax(1)
    total = 0.0
    for b in range(1, bins + 1):
        members = [i for i in range(len(y)) if (b - 1) / bins < conf[i] <= b / bins or (b == 1 and conf[i] == 0)]
        if members:
            acc = np.mean([pred[i] == y[i] for i in members])
            total += len(members) / len(y) * abs(acc - np.mean(conf[members]))
    return total


def _logit_stores(tmp_path, objective, seed, sha="abc"):
    from repsim.store.writer import save_store

    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("test", 120), ("holdout", 80)):
        y = rng.integers(0, 4, n)
        z = 4.0 * (rng.normal(size=(n, 4)) + 1.5 * np.eye(4)[y])   # overconfident
        out[split] = save_store(tmp_path / f"{objective}-s{seed}-{split}.zarr", {"pool": np.zeros((n, 2), np.float32)}, y,
                                logits=z, chunk_rows=32, meta={"model": {"objective": objective, "seed": seed, "checkpoint_sha256": sha},
                                                "dataset": {"name": "toy", "split": split}})
    return out


@pytest.mark.parametrize("budget", ["512", "0"])  # 0: logits streamed chunk by chunk (issue 31)
def test_calibrate_command_matches_definitions(tmp_path, capsys, budget):
    import csv

    from repsim.commands.main import main

    nets = [_logit_stores(tmp_path, o, s, sha=f"{o}{s}") for o in ("softmax", "sigmoid") for s in (0, 1)]
    out = tmp_path / "res" / "calibration.csv"
    assert main(["calibrate", "--test", *(n["test"].path for n in nets), "--holdout",
                 *(n["holdout"].path for n in nets), "--memory-budget", budget, "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["kind"] for r in rows] == ["softmax", "softmax", "sigmoid", "sigmoid"]  # auto: by the objective
    for r, net in zip(rows, nets):
        z, y = np.asarray(net["test"].logits.compute(), np.float64), np.asarray(net["test"].labels)
        zh, yh = np.asarray(net["holdout"].logits.compute(), np.float64), np.asarray(net["holdout"].labels)
        kind, T = r["kind"], float(r["temperature"])
        assert float(r["nll"]) == pytest.approx(_ref_nll(z, y, kind), rel=1e-9)
        assert float(r["ece"]) == pytest.approx(_ref_ece(z, y, kind), abs=1e-9)
        assert float(r["nll_ts"]) == pytest.approx(_ref_nll(z, y, kind, T), rel=1e-9)
        assert float(r["ece_ts"]) == pytest.approx(_ref_ece(z, y, kind, T), abs=1e-9)
        grid = np.exp(np.linspace(np.log(0.2), np.log(20), 801))   # T minimises the *holdout* NLL
        assert T == pytest.approx(grid[np.argmin([_ref_nll(zh, yh, kind, t) for t in grid])], rel=1e-2)
        assert T > 1.2 and float(r["top1"]) == pytest.approx(np.mean(z.argmax(1) == y))
        assert float(r["holdout_top1"]) == pytest.approx(np.mean(zh.argmax(1) == yh))
        assert (r["split"], r["n"], r["holdout_split"], r["holdout_n"], r["bins"]) == ("test", "120", "holdout", "80", "15")
    # --kind overrides; pairs from different networks and stores without logits are refused in one line
    assert main(["calibrate", "--test", nets[2]["test"].path, "--holdout", nets[2]["holdout"].path, "--kind", "softmax",
                 "--out", str(tmp_path / "k.csv")]) == 0
    assert next(csv.DictReader(open(tmp_path / "k.csv")))["kind"] == "softmax"
    # the command is a thin layer over write_calibration (the demo calls it): the same file either way
    from repsim.probes.writers import write_calibration

    lib_rows, _ = write_calibration([n["test"].path for n in nets], [n["holdout"].path for n in nets],
                                    tmp_path / "lib.csv", memory_budget=float(budget))
    assert (tmp_path / "lib.csv").read_bytes() == out.read_bytes() and len(lib_rows) == 4
    capsys.readouterr()
    assert main(["calibrate", "--test", nets[0]["test"].path, "--holdout", nets[1]["holdout"].path,
                 "--out", str(tmp_path / "x.csv")]) == 2
    assert "different networks" in capsys.readouterr().err
    from repsim.store.writer import save_store

    bare = save_store(tmp_path / "bare.zarr", {"pool": np.zeros((5, 2), np.float32)}, np.arange(5) % 2)
    assert main(["calibrate", "--test", bare.path, "--holdout", bare.path, "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err   # one line through the CLI's one error path
    assert err.startswith("repsim calibrate: error: store ") and "has no logits" in err and err.count("\n") == 1


def test_table_c3_item(tmp_path):
    import csv

    from repsim.analyses.cli import make_figures
    from repsim.commands.main import main

    nets = [_logit_stores(tmp_path, o, s, sha=f"{o}{s}") for o in ("softmax", "label_smoothing") for s in (0, 1)]
    res = tmp_path / "res"
    assert main(["calibrate", "--test", *(n["test"].path for n in nets), "--holdout",
                 *(n["holdout"].path for n in nets), "--out", str(res / "calibration.csv")]) == 0
    rows = list(csv.DictReader(open(res / "calibration.csv")))
    outcomes, _ = make_figures(None, res, tmp_path / "fig", only=["tableC3"], progress=False)
    assert outcomes[0].status == "done", outcomes[0].note
    t = outcomes[0].table
    assert list(t.shown.columns) == ["Objective", "NLL", "ECE", "NLL (TS)", "ECE (TS)", "T"]
    assert t.shown["Objective"].tolist() == ["Softmax", "Label smoothing"]
    soft = t.numeric.set_index("objective").loc["softmax"]
    assert soft["ECE (TS)"] == pytest.approx(np.mean([float(r["ece_ts"]) for r in rows[:2]]))
    assert soft["NLL n"] == 2 and "15 equal-width" in outcomes[0].caption
    assert "classify their holdout perfectly" not in outcomes[0].caption
    import pandas as pd

    df = pd.read_csv(res / "calibration.csv")
    df.loc[0, "holdout_top1"] = 1.0          # a perfectly classified holdout: no finite best T, said in the caption
    df.loc[0, "temperature"] = 0.01          # (its NLL falls as T -> 0: the fit stops at the search bound)
    df.to_csv(res / "calibration.csv", index=False)
    outcomes, _ = make_figures(None, res, tmp_path / "fig", only=["tableC3"], progress=False)
    cap = outcomes[0].caption
    assert "for 1 of 4 networks T stopped at the search bound" in cap and "classify their holdout perfectly" in cap


def test_calibrate_refuses_logits_scored_on_other_classes(tmp_path, capsys):
    """A digits-target test/holdout pair of a digits-source network passed every check (one network, one
    dataset) and calibrated the head on another label space (NLL 3.73, T 8.85, exit 0): refused as `repsim
    accuracy` refuses it, unless --allow-other-classes."""
    from repsim.commands.main import main
    from repsim.store.writer import save_store

    train = {"name": "digits-source", "spec": "digits-source", "classes": ["0", "1", "2", "3", "4"]}
    paths = {}
    for name, split, n in (("tgt-test", "test", 60), ("tgt-holdout", "holdout", 40)):
        rng = np.random.default_rng(n)
        y = np.arange(n) % 5
        paths[name] = save_store(tmp_path / f"{name}.zarr", {"pool": np.zeros((n, 2), np.float32)}, y,
                                 logits=rng.normal(size=(n, 5)) + 2 * np.eye(5)[y], example_ids=np.arange(n),
                                 meta={"model": {"objective": "softmax", "seed": 0, "checkpoint_sha256": "ab" * 32,
                                                 "train_dataset": train},
                                       "dataset": {"name": "digits-target", "split": split, "num_classes": 5}}).path
    out = tmp_path / "cal.csv"
    argv = ["calibrate", "--test", paths["tgt-test"], "--holdout", paths["tgt-holdout"], "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists()
    assert "error: store tgt-test: it holds dataset 'digits-target' but its network was trained on 'digits-source'" in err
    assert main(argv + ["--allow-other-classes"]) == 0 and out.exists()
    assert "WARNING: store tgt-holdout:" in capsys.readouterr().err


def test_a_temperature_run_to_the_search_bound_is_warned_about(tmp_path, capsys):
    """A holdout classified perfectly (the digits demo's 90 images) drives the fit to T -> 0.01: the
    command says so instead of reporting a 60x worse scaled NLL as a calibration."""
    import csv

    from repsim.commands.main import main
    from repsim.probes.calibration import TEMPERATURE_BOUNDS, temperature_at_bound, temperature_grid_step
    from repsim.store.writer import save_store

    rng = np.random.default_rng(5)
    stores = {}
    for split, n in (("test", 60), ("holdout", 40)):
        y = np.arange(n) % 4
        z = rng.normal(size=(n, 4)) + (8.0 if split == "holdout" else 1.0) * np.eye(4)[y]  # holdout: no error
        stores[split] = save_store(tmp_path / f"{split}.zarr", {"pool": np.zeros((n, 2), np.float32)}, y, logits=z,
                                   meta={"model": {"objective": "softmax", "seed": 0, "checkpoint_sha256": "ab"},
                                         "dataset": {"name": "toy", "split": split}})
    out = tmp_path / "c.csv"
    assert main(["calibrate", "--test", stores["test"].path, "--holdout", stores["holdout"].path, "--out", str(out)]) == 0
    T = float(next(csv.DictReader(open(out)))["temperature"])
    assert temperature_at_bound(T)
    out_text = capsys.readouterr().out  # beside the pair's result line
    assert "WARNING: test: the temperature fit on holdout store holdout ran to the end of its search range" in out_text
    step = np.exp(temperature_grid_step())
    lo, hi = TEMPERATURE_BOUNDS
    assert temperature_at_bound([lo, lo * step, hi / step, hi]).all()
    assert not temperature_at_bound([lo * step ** 1.5, 1.0, np.nan]).any()


@pytest.mark.parametrize("flags, kind, bins", [
    (["--kind", "auto"], "softmax", 15), (["--kind", "softmax"], "softmax", 15),
    (["--kind", "sigmoid"], "sigmoid", 15), (["--bins", "5"], "softmax", 5), (["--bins", "40"], "softmax", 40),
])
def test_every_calibrate_option_value_reaches_the_numbers(tmp_path, flags, kind, bins):
    """Each valid --kind and a --bins other than 15 once, on a softmax network's stores: NLL and ECE before
    and after scaling are the definitions' (written out above) with that kind and that many bins."""
    import csv

    from repsim.commands.main import main

    net = _logit_stores(tmp_path, "softmax", 0)
    out = tmp_path / "c.csv"
    assert main(["calibrate", "--test", net["test"].path, "--holdout", net["holdout"].path, *flags,
                 "--out", str(out)]) == 0
    (row,) = list(csv.DictReader(open(out)))
    z, y = np.asarray(net["test"].logits.compute(), np.float64), np.asarray(net["test"].labels)
    T = float(row["temperature"])
    assert row["kind"] == kind and row["bins"] == str(bins)
    assert float(row["nll"]) == pytest.approx(_ref_nll(z, y, kind), rel=1e-9)
    assert float(row["ece"]) == pytest.approx(_ref_ece(z, y, kind, bins=bins), abs=1e-9)
    assert float(row["nll_ts"]) == pytest.approx(_ref_nll(z, y, kind, T), rel=1e-9)
    assert float(row["ece_ts"]) == pytest.approx(_ref_ece(z, y, kind, T, bins=bins), abs=1e-9)
    if bins != 15:  # the value changed the number (a flag that never reached the ECE would give 15 bins')
        assert float(row["ece"]) != pytest.approx(_ref_ece(z, y, kind), abs=1e-9)
