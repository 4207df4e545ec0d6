"""Fig. 2 under every similarity measure in the results and the measures' agreement item (repsim/analyses/items/
layers.py, repsim/analyses/items/measures.py), on tiny results files with known answers; the analyses read
every results file through `repsim.load_result`."""
from __future__ import annotations

import numpy as np
import pytest

import repsim
from repsim.commands.main import main
from repsim.engine.result import SimilarityResult
from test_analyses_figures import LAYERS, write_results


def _cka_file(res):
    with np.load(res / "cka_all.npz") as z:
        return np.array(z["values"]), list(zip(z["stores"].tolist(), z["layers"].tolist()))


def with_measures(tmp_path, **values):
    """write_results' directory (linear CKA in a cka_*.npz of `repsim cka`'s format) plus one
    similarity_*.npz holding ``values`` {measure: f(linear CKA matrix, index)}."""
    res = write_results(tmp_path)
    v, index = _cka_file(res)
    SimilarityResult({m: f(v, index) for m, f in values.items()}, index,
                     {"method": "exact", "n": 64, "estimators": {m: "exact" for m in values}}
                     ).save(res / "similarity_x.npz")
    return res


def test_every_results_file_is_read_through_load_result(tmp_path, monkeypatch):
    from repsim.analyses.data import Inputs

    res = with_measures(tmp_path, rbf_cka=lambda v, _: v ** 2)
    read = []
    real = repsim.load_result

    def spy(path):
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(repsim, "load_result", spy)
    inputs = Inputs(None, res)
    assert inputs.similarities.measures == ["linear_cka", "rbf_cka"]
    # every .npz is read by content: the two results, and spectra.npz, which is not one and is passed over
    assert [f for f in read if f != "spectra.npz"] == ["cka_all.npz", "similarity_x.npz"]
    assert [f for f, _, _ in inputs.similarities.parts] == ["cka_all.npz", "similarity_x.npz"]
    v, index = _cka_file(res)
    a, b = index[0][0], index[-1][0]
    rows = [i for i, (s, _) in enumerate(index) if s == a]
    cols = [i for i, (s, _) in enumerate(index) if s == b]
    np.testing.assert_array_equal(inputs.cka.block(a, b, LAYERS, LAYERS), v[np.ix_(rows, cols)])
    np.testing.assert_array_equal(inputs.similarity("rbf_cka").block(a, b, LAYERS, LAYERS), v[np.ix_(rows, cols)] ** 2)
    assert inputs.similarity("rbf_cka").range == (0.0, 1.0)  # declared metadata from the registry when unrecorded


def test_agreement_known_answers(tmp_path):
    """Monotone transforms of one matrix rank the layer pairs alike (ρ = 1), a decreasing one reverses
    them (ρ = −1); an affine transform scales finding 2's gaps by its factor, and RSA's thresholds by
    its range width, so RSA = 2·CKA − 1 reaches CKA's verdict."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.findings import finding_late_blocks, late_blocks
    from repsim.analyses.items.measures import agreement

    res = with_measures(tmp_path, rbf_cka=lambda v, _: v ** 3, rsa=lambda v, _: 2 * v - 1,
                        mutual_knn=lambda v, _: 1 - v)
    inputs = Inputs(None, res)
    t = agreement(inputs)
    num = t.numeric.set_index("measure")
    assert list(num.index) == ["linear_cka", "rbf_cka", "rsa", "mutual_knn"]
    for a in ("linear_cka", "rbf_cka", "rsa"):
        for b in ("linear_cka", "rbf_cka", "rsa"):
            assert num.loc[a, f"rho_{b}"] == pytest.approx(1.0)
        assert num.loc[a, "rho_mutual_knn"] == pytest.approx(-1.0)
    cka, rsa = late_blocks(inputs, "linear_cka"), late_blocks(inputs, "rsa")
    assert rsa.early_gap == pytest.approx(2 * cka.early_gap) and rsa.late_gap == pytest.approx(2 * cka.late_gap)
    assert num.loc["rsa", "verdict"] == num.loc["linear_cka", "verdict"] == finding_late_blocks(inputs).verdict
    assert num.loc["linear_cka", "early_gap"] == pytest.approx(cka.early_gap)
    assert num.loc["mutual_knn", "verdict"] == "not reproduced"  # 1 − CKA: the gap changes sign
    L = len(_cka_file(res)[1])
    assert f"{L * (L - 1) // 2} pairs" in t.caption
    shown = t.shown.set_index("Measure")
    assert shown.loc["RSA", "Range"] == "[-1, 1]" and shown.loc["RBF CKA", "ρ vs mutual k-NN"] == "-1.000"


def test_agreement_needs_two_measures_and_drops_undefined_pairs(tmp_path):
    from repsim.analyses.data import Inputs, Missing
    from repsim.analyses.items.measures import agreement_matrix

    res = write_results(tmp_path)
    with pytest.raises(Missing, match="one measure"):
        agreement_matrix(Inputs(None, res))

    def nan_column(v, index):  # a constant layer: NaN row and column (the engine's policy)
        w = v.copy()
        w[3, :] = w[:, 3] = np.nan
        return w

    (tmp_path / "b").mkdir()
    res2 = with_measures(tmp_path / "b", procrustes=nan_column)
    measures, rho, n = agreement_matrix(Inputs(None, res2))
    L = len(_cka_file(res2)[1])
    assert n[0, 1] == (L - 1) * (L - 2) // 2 and rho[0, 1] == pytest.approx(1.0)


def test_per_measure_fig2_items(tmp_path):
    """`repsim figures` renders Fig. 2a/2b once per measure: linear CKA under fig2a/fig2b, the others as
    fig2a_<measure>; colour scale = the declared range (ridge R²'s open end from the data); an asymmetric
    measure's rows are its first argument."""
    from repsim.analyses.data import Inputs
    from repsim.analyses.items.layers import fig2a

    def by_row_layer(v, index):  # asymmetric: depends on the row's (first argument's) layer only
        depth = np.array([LAYERS.index(l) for _, l in index], float)
        return np.repeat(depth[:, None] / 4 - 0.37, len(index), axis=1)

    res = with_measures(tmp_path, rsa=lambda v, _: 2 * v - 1, ridge_r2=by_row_layer)
    out = tmp_path / "out"
    assert main(["figures", "--results", str(res), "--out", str(out), "--no-progress", "--only", "fig2a", "fig2b"]) == 0
    report = (out / "report.html").read_text()
    for f in ("fig2a", "fig2b", "fig2a_rsa", "fig2b_rsa", "fig2a_ridge_r2", "fig2b_ridge_r2"):
        assert (out / f"{f}.png").stat().st_size > 0 and f"<img src='{f}.png'" in report, f
    assert "Fig. 2a: block × block RSA between softmax" in report
    assert not (out / "agreement.csv").exists()  # --only keeps to the named items and their variants

    inputs = Inputs(None, res)
    rsa = fig2a(inputs, measure="rsa")
    assert rsa.fig.axes[0].images[0].get_clim() == (-1.0, 1.0)
    ridge = fig2a(inputs, measure="ridge_r2")
    img = ridge.fig.axes[0].images[0]
    assert img.get_clim() == (-0.4, 1.0)  # declared (−∞, 1]: the low end is the data's −0.37, rounded out
    panel = img.get_array()
    np.testing.assert_allclose(panel, np.repeat(np.arange(5)[:, None] / 4 - 0.37, 5, axis=1))  # rows: softmax net
    assert "1st argument" in ridge.fig.axes[0].get_ylabel() and "row = first argument" in ridge.caption
    assert "first argument" not in rsa.caption
    assert "similarity_x.npz: method=exact, n=64" in rsa.caption  # the measure's own estimator settings
    for f in (rsa, ridge):
        f.fig.clf()


def test_figures_list_names_the_per_measure_items(capsys):
    assert main(["figures", "--list"]) == 0
    text = capsys.readouterr().out
    line = next(l for l in text.splitlines() if l.startswith("fig2a "))
    assert "block × block linear CKA" in line and "fig2a_<measure>" in line
    assert any(l.startswith("agreement ") for l in text.splitlines())
