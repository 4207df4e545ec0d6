"""Results you can look at and hand on: one linear CKA at every entry point's defaults (checked against
the debiased CKA written from its formula), ``SimilarityResult``/``CKAResult`` as pandas and xarray
(values equal the matrices), ``plot`` (every column drawn, the declared colour range, NaN marked, store
panels), the repr, ``repsim plot`` and its one-line errors, and ``load_result`` on files that are not
results."""
from __future__ import annotations

import math

import numpy as np
import pytest

import repsim
from repsim.commands.main import main as repsim_main
from repsim.engine.result import NotAResult, SimilarityResult, load_result
from test_engine_helpers import make_store


def debiased_cka_reference(X: np.ndarray, Y: np.ndarray) -> float:
    """Debiased linear CKA from its definition (Song et al. 2012's unbiased HSIC₁ of the linear Grams with
    zeroed diagonals; Kornblith et al. 2019), written out term by term."""
    n = len(X)

    def hsic1(K: np.ndarray, L: np.ndarray) -> float:
        K, L = K.copy(), L.copy()
        np.fill_diagonal(K, 0.0)
        np.fill_diagonal(L, 0.0)
        one = np.ones(n)
        return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * (one @ K @ L @ one)) / (n * (n - 3))

    K, L = X @ X.T, Y @ Y.T
    return hsic1(K, L) / math.sqrt(hsic1(K, K) * hsic1(L, L))


@pytest.fixture(scope="module")
def arrays():
    """200 × 300 arrays sharing a latent factor: biased (0.6+) and debiased linear CKA differ by far more
    than any rounding."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 300))
    Y = X[:, :100] @ rng.standard_normal((100, 300)) + 2 * rng.standard_normal((200, 300))
    return X, Y


@pytest.mark.filterwarnings("ignore:one batch holds all")  # the defaults' one batch of every example
def test_every_linear_cka_entry_point_gives_the_debiased_value_at_its_defaults(arrays, tmp_path):
    X, Y = arrays
    want = debiased_cka_reference(X, Y)
    biased = repsim.linear_cka(X, Y, debiased=False)
    assert abs(biased - want) > 0.1  # the two estimators are told apart on these arrays
    store = make_store(tmp_path / "xy.zarr", {"x": X, "y": Y}, dtype="float32")
    got = {
        "repsim.linear_cka": repsim.linear_cka(X, Y),
        "repsim.similarity": repsim.similarity(X, Y, "linear_cka"),
        "MinibatchCKA (one batch)": repsim.MinibatchCKA(2).update([X, Y]).result()[0, 1],
        # defaults: batch_size 1500 > n, so one batch of every example (the full-data estimate)
        "cka_matrix": repsim.cka_matrix(store, progress=False).values[0, 1],
        "similarity_matrix": repsim.similarity_matrix(store, progress=False).matrix("linear_cka")[0, 1],
        "cka_matrix exact": repsim.cka_matrix(store, method="exact", progress=False).values[0, 1],
    }
    assert repsim_main(["cka", store.path, "--out", str(tmp_path / "cli.npz"), "--no-progress"]) == 0
    got["repsim cka"] = load_result(tmp_path / "cli.npz").matrix("linear_cka")[0, 1]
    assert repsim_main(["similarity", store.path, "--out", str(tmp_path / "sim.npz"), "--no-progress"]) == 0
    got["repsim similarity"] = load_result(tmp_path / "sim.npz").matrix("linear_cka")[0, 1]
    for where, value in got.items():  # stores hold float32: the stored arrays differ from X, Y by 6e-8
        assert value == pytest.approx(want, rel=1e-5), where


def test_every_entry_point_states_its_default_in_its_docstring():
    from repsim.kernels.measures.exact import similarity

    for fn in (repsim.linear_cka, repsim.MinibatchCKA, repsim.cka_matrix, repsim.similarity_matrix, similarity):
        doc = " ".join((fn.__doc__ or "").split())
        assert "debiased=True" in doc or "debiased`` (default True" in doc, fn.__name__


# ------------------------------------------------------------------------------------------- views


def toy_result() -> SimilarityResult:
    """Two stores of 3 and 2 layers, two measures (one asymmetric, unbounded below) and a NaN column."""
    rng = np.random.default_rng(1)
    index = [("a", "l1"), ("a", "l2"), ("a", "l3"), ("b", "x"), ("b", "y")]
    A = rng.uniform(0, 1, (5, 5))
    A = (A + A.T) / 2
    np.fill_diagonal(A, 1.0)
    A[4, :] = A[:, 4] = np.nan
    R = rng.uniform(-3, 1, (5, 5))  # ridge R² is not symmetric and may be far below 0
    meta = {"n": 50, "method": "exact", "measures": ["linear_cka", "ridge_r2"],
            "estimators": {"linear_cka": "exact", "ridge_r2": "exact"},
            "undefined": {"linear_cka": {"columns": ["b/y"]}}}
    return SimilarityResult({"linear_cka": A, "ridge_r2": R}, index, meta)


def test_to_pandas_tidy_and_wide_hold_the_matrices():
    res = toy_result()
    tidy = res.to_pandas()
    assert list(tidy.columns) == ["store_a", "layer_a", "store_b", "layer_b", "measure", "value"]
    assert len(tidy) == 2 * 25
    pos = {key: i for i, key in enumerate(res.index)}
    for row in tidy.itertuples(index=False):
        want = res.matrix(row.measure)[pos[(row.store_a, row.layer_a)], pos[(row.store_b, row.layer_b)]]
        assert (np.isnan(want) and np.isnan(row.value)) or row.value == want
    wide = res.to_pandas(wide=True)
    assert list(wide.columns) == ["linear_cka", "ridge_r2"] and len(wide) == 25
    assert wide.loc[("a", "l1", "b", "x"), "ridge_r2"] == res.matrix("ridge_r2")[0, 3]
    assert wide.loc[("b", "x", "a", "l1"), "ridge_r2"] == res.matrix("ridge_r2")[3, 0]  # row = first argument


def test_to_xarray_names_store_and_layer_on_both_sides():
    pytest.importorskip("xarray")
    res = toy_result()
    da = res.to_xarray()
    assert da.dims == ("measure", "a", "b")
    block = da.sel(measure="ridge_r2", store_a="a", store_b="b")
    np.testing.assert_array_equal(block.values, res.matrix("ridge_r2")[:3, 3:])
    assert list(block["layer_a"].values) == ["l1", "l2", "l3"] and list(block["layer_b"].values) == ["x", "y"]
    assert float(da.sel(measure="linear_cka", store_a="a", layer_a="l2", store_b="b", layer_b="x")) == \
        res.matrix("linear_cka")[1, 3]
    assert da.attrs["n"] == 50 and da.attrs["range_linear_cka"] == [0.0, 1.0]


def test_to_xarray_without_xarray_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xarray", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'repsim-toolkit\[xarray\]'"):
        toy_result().to_xarray()


def test_matrix_plot_draws_every_column_in_the_declared_range_and_marks_nan():
    import matplotlib

    matplotlib.use("Agg")
    res = toy_result()
    fig = res.plot()
    panels = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["linear CKA", "ridge R²"]
    for ax, m in zip(panels, ["linear_cka", "ridge_r2"]):
        img = ax.images[0]
        data = img.get_array()
        assert data.shape == (5, 5)
        np.testing.assert_array_equal(np.ma.filled(data, np.nan), res.matrix(m))
        assert [t.get_text() for t in ax.get_xticklabels()] == ["l1", "l2", "l3", "x", "y"]
    assert panels[0].images[0].get_clim() == (0.0, 1.0)  # the declared range, not the data's
    lo, hi = panels[1].images[0].get_clim()  # ridge R²: (-inf, 1]: the data's minimum below
    assert hi == 1.0 and lo == pytest.approx(np.nanmin(res.matrix("ridge_r2")))
    cmap = panels[0].images[0].get_cmap()
    assert not any(np.allclose(cmap.get_bad(), cmap(x)) for x in np.linspace(0, 1, 256))  # NaN: no value's colour
    legend = " ".join(t.get_text() for lg in fig.legends for t in lg.get_texts())
    assert "NaN: undefined" in legend and "9 cells" in legend
    assert any(p.get_hatch() for p in panels[0].patches)  # the NaN cells are hatched
    only = res.plot("linear_cka", stores=["b"], layers=["x", "y"])
    assert only.axes[0].images[0].get_array().shape == (2, 2)


def test_grid_plot_has_one_panel_per_store_pair():
    import matplotlib

    matplotlib.use("Agg")
    res = toy_result()
    fig = res.plot(kind="grid")  # the first measure: linear CKA
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 4
    shapes = [ax.images[0].get_array().shape for ax in panels]
    assert shapes == [(3, 3), (3, 2), (2, 3), (2, 2)]
    np.testing.assert_array_equal(np.ma.filled(panels[1].images[0].get_array(), np.nan),
                                  res.matrix("linear_cka")[:3, 3:])
    with pytest.raises(ValueError, match="one measure"):
        res.plot(["linear_cka", "ridge_r2"], kind="grid")


@pytest.mark.parametrize("kw, match", [({"measure": "cca"}, "unknown measure 'cca'; this result holds: linear_cka, ridge_r2"),
                                       ({"stores": ["c"]}, "unknown store.*c; this result's stores: a, b"),
                                       ({"layers": ["zz"]}, "unknown layer.*zz"),
                                       ({"kind": "bars"}, "kind must be one of matrix, grid")])
def test_plot_refuses_unknown_names_naming_the_known_ones(kw, match):
    with pytest.raises((KeyError, ValueError), match=match):
        toy_result().plot(**kw)


def test_repr_says_what_the_result_holds_in_a_few_lines():
    text = repr(toy_result())
    lines = text.splitlines()
    assert 4 <= len(lines) <= 8
    assert "2 measure(s) over 5 columns" in lines[0]
    assert "a (3 layers), b (2 layers)" in text and "linear_cka (exact)" in text and "undefined" in text
    cka = repsim.CKAResult(np.eye(2), [("s", "l1"), ("s", "l2")], {"method": "exact", "n": 9})
    assert repr(cka).startswith("CKAResult: 1 measure(s) over 2 columns")
    assert cka.to_pandas()["measure"].unique().tolist() == ["linear_cka"]


# --------------------------------------------------------------------------------------- the files


def test_load_result_says_when_a_file_is_not_a_result(tmp_path):
    (tmp_path / "text.npz").write_text("hello")
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    with pytest.raises(NotAResult, match="text.npz is not a result of repsim cka/similarity \\(not an .npz file\\)"):
        load_result(tmp_path / "text.npz")
    with pytest.raises(NotAResult, match="other.npz is not a result.*holds a\\)"):
        load_result(tmp_path / "other.npz")
    with pytest.raises(NotAResult, match="a directory"):
        load_result(tmp_path)
    res = toy_result()
    path = res.save(tmp_path / "ok.npz")
    back = load_result(path)
    assert back.index == res.index and back.measures == res.measures


def test_repsim_plot_writes_the_figure_and_refuses_in_one_line(tmp_path, capsys):
    path = toy_result().save(tmp_path / "res.npz")
    for ext, magic in (("png", b"\x89PNG"), ("pdf", b"%PDF")):
        out = tmp_path / f"fig.{ext}"
        assert repsim_main(["plot", path, "--out", str(out)]) == 0
        assert out.read_bytes()[:4] == magic
    assert repsim_main(["plot", path, "--out", str(tmp_path / "g.png"), "--layout", "grid",
                        "--measure", "ridge_r2", "--only-stores", "b,a"]) == 0
    capsys.readouterr()
    for argv, message in [
        (["--measure", "cca"], "--measure: cca not in"),
        (["--only-stores", "zz"], "unknown store(s) zz; this result's stores: a, b"),
        (["--layout", "grid", "--measure", "linear_cka", "ridge_r2"], "--layout grid draws one measure"),
    ]:
        assert repsim_main(["plot", path, "--out", str(tmp_path / "x.png"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert repsim_main(["plot", path, "--out", str(tmp_path / "x.jpg")]) == 2
    assert "the extension picks the format" in capsys.readouterr().err
    (tmp_path / "junk.npz").write_text("x")
    assert repsim_main(["plot", str(tmp_path / "junk.npz"), "--out", str(tmp_path / "x.png")]) == 2
    assert "is not a result of repsim cka/similarity" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
