"""Calibrated similarity in the report (issue 44): Fig. 2a/2b on calibrated scores with the non-significant
cells dotted, finding 2's calibration paragraph and the agreement table's calibrated gap, on small real Zarr
stores with a planted structure computed by `repsim.similarity_matrix(..., permutations=K)`:

- ``real``: every network's early blocks share one signal; its late blocks share a signal with the other seed
  of its objective only (independent across objectives): a late-block gap far above chance;
- ``chance``: the same early blocks; the late blocks are independent noise in every network, wide (2,000
  features) in four objectives and narrow (2) in four, so that biased linear CKA's chance level, about
  √(r_a r_b) with r = p/(n + p), is higher between seeds of one objective (equal widths) than between
  objectives (the arithmetic over the geometric mean): a raw late-block gap, consistent over the
  objectives' bootstrap, that is chance alone (Murphy, Zylberberg & Fyshe 2024)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from repsim import save_store, similarity_matrix
from repsim.analyses.data import Inputs

OBJS = ["softmax", "sigmoid", "cosine_softmax", "squared_error", "label_smoothing", "dropout", "extra_l2",
        "logit_penalty"]
BLOCKS = [f"block{i}" for i in range(1, 7)]  # early: block1-4, the paper's last third: block5-6
N, K = 60, 99
LATE_WIDTH = {o: 2000 if i < 4 else 2 for i, o in enumerate(OBJS)}


def _write(root, late: str, seed: int = 0):
    """Stores of 8 objectives × 2 seeds (module docstring), their similarity result with a permutation null
    (exact route, biased linear CKA, K draws) in results/; returns (stores dir, results dir, result)."""
    rng = np.random.default_rng(seed)
    stores, res = root / "stores", root / "results"
    stores.mkdir()
    res.mkdir()
    shared = rng.normal(size=(N, 8))
    own = {o: rng.normal(size=(N, 8)) for o in OBJS}
    y = np.arange(N) % 3
    paths = []
    for o in OBJS:
        for s in (0, 1):
            layers = {}
            for i, b in enumerate(BLOCKS):
                if i < 4:
                    x = shared @ rng.normal(size=(8, 16)) + 0.3 * rng.normal(size=(N, 16))
                elif late == "real":
                    x = own[o] @ rng.normal(size=(8, 16)) + 0.3 * rng.normal(size=(N, 16))
                else:
                    x = rng.normal(size=(N, LATE_WIDTH[o]))
                layers[b] = x.astype(np.float32)
            meta = {"model": {"arch": "mlp", "objective": o, "seed": s, "epoch": 1},
                    "dataset": {"name": "planted", "split": "test"}}
            p = stores / f"{o}-s{s}-test.zarr"
            save_store(p, layers, y, meta=meta, progress=False)
            paths.append(str(p))
    result = similarity_matrix(paths, ["linear_cka"], layers=BLOCKS, method="exact", debiased=False,
                               permutations=K, seed=1, progress=False)
    result.save(res / "similarity_planted.npz")
    return stores, res, result


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("real"), "real")


@pytest.fixture(scope="module")
def chance(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("chance"), "chance")


def _brute_max_p(result, pairs, layers_a, layers_b):
    """Brute force from the result's arrays: per cell the largest p-value over ``pairs``, each pair's
    (1 + #{null ≥ observed}) / (K + 1) from its draws (a cell is significant when every pair is)."""
    obs = result.calibration["linear_cka"]["observed"]
    null = result.null("linear_cka")
    pos = {key: i for i, key in enumerate(result.index)}
    p = np.zeros((len(layers_a), len(layers_b)))
    for a, b in pairs:
        for i, la in enumerate(layers_a):
            for j, lb in enumerate(layers_b):
                o, d = obs[pos[(a, la)], pos[(b, lb)]], null[:, pos[(a, la)], pos[(b, lb)]]
                p[i, j] = max(p[i, j], (1 + np.sum(d >= o)) / (null.shape[0] + 1))
    return p


def _dots(ax) -> set[tuple[int, int]]:
    """(row, column) of the dotted cells of a panel (the gid "not-significant" collection)."""
    out = set()
    for c in ax.collections:
        if c.get_gid() == "not-significant":
            out |= {(int(round(y)), int(round(x))) for x, y in c.get_offsets()}
    return out


def test_fig2a_calibrated_dots_exactly_the_non_significant_cells(real):
    from repsim.analyses.items.layers import fig2a_calibrated

    stores, res, result = real
    fig = fig2a_calibrated(Inputs(stores, res))
    axes = [ax for ax in fig.fig.axes if ax.get_title().startswith("Softmax vs.")]
    titles = [ax.get_title().split("\n")[0] for ax in axes]
    assert "Softmax vs. Sigmoid" in titles and "Softmax vs. Softmax" in titles
    marked_late_cross = 0
    for ax, title in zip(axes, titles):
        other = {"Softmax": "softmax", "Sigmoid": "sigmoid", "Cosine softmax": "cosine_softmax",
                 "Squared error": "squared_error", "Label smoothing": "label_smoothing",
                 "Dropout": "dropout", "More final layer L²": "extra_l2",
                 "Logit penalty": "logit_penalty"}[title.removeprefix("Softmax vs. ")]
        pairs = [(f"softmax-s{a}-test", f"{other}-s{b}-test") for a in (0, 1) for b in (0, 1)
                 if (other, b) != ("softmax", a)]
        p = _brute_max_p(result, pairs, BLOCKS, BLOCKS)
        want = {(i, j) for i, j in zip(*np.nonzero(p > 0.05))}
        assert _dots(ax) == want, title
        # the colours: the mean of the pairs' calibrated scores
        cal, pos = result.calibrated("linear_cka"), {key: i for i, key in enumerate(result.index)}
        mean = np.mean([[[cal[pos[(a, la)], pos[(b, lb)]] for lb in BLOCKS] for la in BLOCKS] for a, b in pairs], axis=0)
        np.testing.assert_allclose(np.asarray(ax.get_images()[0].get_array()), mean)
        # planted truth: the early blocks share a signal in every pair (significant); the late blocks only
        # within an objective (Softmax vs. Softmax significant, softmax vs. any other at chance)
        assert not any(i < 4 and j < 4 for i, j in want), title
        if other == "softmax":
            assert not want & {(4, 4), (5, 5), (4, 5), (5, 4)}
        else:
            marked_late_cross += len(want & {(4, 4), (5, 5), (4, 5), (5, 4)})
    assert marked_late_cross >= 24  # of 7 panels × 4 late cells: nearly all at chance
    assert "Dot: some pair of networks in the cell is not significant" in fig.caption and "K = 99" in fig.caption


def test_fig2b_calibrated_dots_the_cross_objective_late_entries(real):
    from repsim.analyses.items.layers import fig2b_calibrated

    stores, res, result = real
    fig = fig2b_calibrated(Inputs(stores, res))
    axes = {ax.get_title(): ax for ax in fig.fig.axes if ax.get_title() in BLOCKS}
    labels = [t.get_text() for t in axes["block6"].get_yticklabels()]
    order = {"Softmax": "softmax", "Sigmoid": "sigmoid", "Cosine softmax": "cosine_softmax",
             "Squared error": "squared_error", "Label smoothing": "label_smoothing", "Dropout": "dropout",
             "More final layer L²": "extra_l2", "Logit penalty": "logit_penalty"}
    objs = [order[t] for t in labels]
    for layer, ax in axes.items():
        want = set()
        for i, a in enumerate(objs):
            for j, b in enumerate(objs):
                pairs = [(f"{a}-s{s}-test", f"{b}-s{t}-test") for s in (0, 1) for t in (0, 1) if (a, s) != (b, t)]
                p = _brute_max_p(result, pairs, [layer], [layer])
                if p[0, 0] > 0.05:
                    want.add((i, j))
        assert _dots(ax) == want, layer
        if layer == "block1":
            assert not want
        if layer == "block6":  # the diagonal (seeds of one objective) significant, most of the rest not
            # (independent objectives: a cell is significant only when all 4 of its pairs are)
            assert not any(i == j for i, j in want) and len(want) >= 52  # of 56


def test_calibrated_items_are_skipped_without_a_null(tmp_path):
    from repsim.analyses.data import Missing
    from repsim.analyses.items.layers import fig2a_calibrated, fig2b_calibrated
    from test_analyses_figures import write_results

    inputs = Inputs(None, write_results(tmp_path))
    for fn in (fig2a_calibrated, fig2b_calibrated):
        with pytest.raises(Missing, match="--permutations K"):
            fn(inputs)


@pytest.mark.slow
def test_finding2_says_a_real_late_gap_survives_calibration(real):
    from repsim.analyses import findings as F

    stores, res, _ = real
    inputs = Inputs(stores, res)
    f = F.finding_late_blocks(inputs)
    r = F.late_blocks(inputs)
    cal = F.calibrated_gap(inputs, r)
    assert cal.status(r) == "survives" and cal.ci["late"][0] > 0.5
    assert f.calibration.startswith("The late-block gap survives calibration: ")
    # the layer-aggregate null: every pair of seeds of one objective above chance, few pairs across objectives
    assert f"{len(OBJS)} of {len(OBJS)} same-objective pairs of networks" in f.calibration
    n_cross = 4 * len(OBJS) * (len(OBJS) - 1) // 2
    assert cal.significant("cross") <= 0.15 * n_cross
    assert f"{cal.significant('cross')} of {n_cross} different-objective pairs" in f.calibration
    assert "K = 99" in f.calibration
    md = F.findings_text([f])
    assert "Calibration: The late-block gap survives calibration" in md


@pytest.mark.slow
def test_finding2_says_a_chance_late_gap_does_not_survive_calibration(chance):
    from repsim.analyses import findings as F

    stores, res, _ = chance
    inputs = Inputs(stores, res)
    r = F.late_blocks(inputs)
    assert r.ci["late"][0] > 0.05  # the raw gap: biased CKA's chance levels alone
    cal = F.calibrated_gap(inputs, r)
    assert cal.ci["late"][0] <= 0 and cal.status(r) == "does not survive"
    f = F.Finding("", "", "", calibration=F.calibration_text(r, cal))
    assert f.calibration.startswith("The late-block gap does not survive calibration: ")
    assert cal.significant("same") <= 1 and cal.significant("cross") <= 0.15 * len(cal.pair_p["cross"])
    assert f"{cal.significant('same')} of {len(OBJS)} same-objective pairs" in f.calibration


@pytest.mark.slow
def test_layer_aggregate_p_against_brute_force(real):
    """Each pair's late-third p is the mean over the last third's corresponding layers against the same mean
    of each draw."""
    from repsim.analyses import findings as F

    stores, res, result = real
    inputs = Inputs(stores, res)
    cal = F.calibrated_gap(inputs, F.late_blocks(inputs))
    labels = sorted(OBJS)
    cross = [(f"{a}-s{s}-test", f"{b}-s{t}-test") for a, b in itertools.combinations(labels, 2)
             for s in (0, 1) for t in (0, 1)]
    want = []
    for x, y in cross:
        obs = result.calibration["linear_cka"]["observed"]
        null = result.null("linear_cka")
        pos = {key: i for i, key in enumerate(result.index)}
        diag_o = np.mean([obs[pos[(x, l)], pos[(y, l)]] for l in ("block5", "block6")])
        diag_d = np.mean([null[:, pos[(x, l)], pos[(y, l)]] for l in ("block5", "block6")], axis=0)
        want.append((1 + np.sum(diag_d >= diag_o)) / (K + 1))
    np.testing.assert_allclose(cal.pair_p["cross"], want)


def test_finding2_without_a_null_says_so(tmp_path):
    from repsim.analyses import findings as F
    from test_analyses_figures import write_results

    f = F.finding_late_blocks(Inputs(None, write_results(tmp_path)))
    assert f.calibration.startswith("Not calibrated: the results hold no permutation null")


@pytest.mark.slow
def test_agreement_gives_the_calibrated_gap(chance, tmp_path):
    from repsim.analyses.items.measures import agreement

    stores, res, result = chance
    # a second measure beside linear CKA (RBF CKA without a null) for the table to have two rows
    other = similarity_matrix([str(p) for p in sorted(stores.glob("*.zarr"))], ["rbf_cka"], layers=BLOCKS,
                              method="exact", progress=False)
    res2 = tmp_path / "results"
    res2.mkdir()
    result.save(res2 / "similarity_planted.npz")
    other.save(res2 / "similarity_rbf.npz")
    t = agreement(Inputs(stores, res2))
    row = t.numeric.set_index("measure")
    assert row.loc["linear_cka", "calibration"] == "does not survive"
    assert row.loc["linear_cka", "calibrated_late_lo"] <= 0
    shown = t.shown.set_index("Measure")
    assert shown.loc["linear CKA", "Calibrated late-third gap"].endswith("†")
    assert shown.loc["RBF CKA", "Survives calibration"] == "no null"
