"""Your own models to a heatmap, as docs/own_models_recipe.txt gives it: `repsim extract` of a random-init
torchvision ResNet-18, a timm ResNet-18 (when timm is installed) and a ``module:`` model on the digits
test split, `repsim similarity --measures linear_cka,rbf_cka`, `repsim plot` -> a PNG; then the same
in Python (``res.plot()``, ``res.to_xarray()``, ``res.to_pandas()``), checked against the result's
matrices and against the measures computed in memory from the stores."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import repsim
from repsim.commands.main import main as repsim_main

TESTS = Path(__file__).resolve().parent
RECIPE = TESTS.parent / "docs" / "own_models_recipe.txt"

pytest.importorskip("torchvision")

MODELS = [("resnet18", "torchvision:resnet18", ["--spatial", "mean"]),
          ("vit", "module:tiny_models:vit", ["--layers", "block*,pool"])]
if importlib.util.find_spec("timm") is not None:
    MODELS.insert(1, ("timm_resnet18", "timm:resnet18", ["--spatial", "mean"]))


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """The three commands, run in-process as the recipe gives them (plus --workers 0: no DataLoader
    processes in the suite)."""
    root = tmp_path_factory.mktemp("own")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(TESTS))  # module:tiny_models:<factory>, as a user's own module on the path
    mp.chdir(root)
    try:
        for name, spec, extra in MODELS:
            assert repsim_main(["extract", "--checkpoint", spec, "--data", "digits", "--split", "test",
                                "--out", f"stores/{name}.zarr", "--workers", "0", "--no-progress", *extra]) == 0
        stores = [f"stores/{name}.zarr" for name, _, _ in MODELS]
        assert repsim_main(["similarity", *stores, "--measures", "linear_cka,rbf_cka",
                            "--out", "results/similarity.npz", "--no-progress"]) == 0
        assert repsim_main(["plot", "results/similarity.npz", "--out", "figs/similarity.png"]) == 0
    finally:
        mp.undo()
    return root


def test_the_recipe_file_names_these_commands():
    text = RECIPE.read_text()
    for needle in ("repsim extract --checkpoint torchvision:resnet18 --data digits --split test",
                   "repsim similarity stores/*.zarr --measures linear_cka,rbf_cka --out results/similarity.npz",
                   "repsim plot results/similarity.npz --out figs/similarity.png"):
        assert needle in text, needle


def test_cli_recipe_gives_a_png_of_every_column(own):
    import matplotlib.image

    png = own / "figs" / "similarity.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800  # two panels, each a readable size
    res = repsim.load_result(own / "results" / "similarity.npz")
    assert res.measures == ["linear_cka", "rbf_cka"]
    stores = list(dict.fromkeys(s for s, _ in res.index))
    assert stores == [name for name, _, _ in MODELS]
    for name in stores:  # every layer of every store is a column of the result
        assert res.index.count((name, "pool")) == 1
        assert [l for s, l in res.index if s == name] == repsim.open_store(str(own / "stores" / f"{name}.zarr")).layers


def test_python_views_hold_the_results_matrices(own):
    import matplotlib

    matplotlib.use("Agg")
    res = repsim.load_result(own / "results" / "similarity.npz")
    L = len(res.index)
    for m in res.measures:
        values = res.matrix(m)
        assert values.shape == (L, L) and np.isfinite(values).all()
        np.testing.assert_allclose(np.diag(values), 1.0, atol=1e-5)
    # the minibatch estimate with the default batch size holds every example: the full-data debiased CKA
    a = repsim.open_store(str(own / "stores" / f"{MODELS[0][0]}.zarr"))
    b = repsim.open_store(str(own / "stores" / "vit.zarr"))
    X = np.asarray(a.zarr_array("pool")[...], dtype=np.float64)
    Y = np.asarray(b.zarr_array("pool")[...], dtype=np.float64)
    i, j = res.index.index((a.name, "pool")), res.index.index(("vit", "pool"))
    assert res.matrix("linear_cka")[i, j] == pytest.approx(repsim.linear_cka(X, Y), rel=1e-4, abs=1e-6)
    assert res.matrix("rbf_cka")[i, j] == pytest.approx(repsim.similarity(X, Y, "rbf_cka"), rel=1e-4, abs=1e-6)

    fig = res.plot()
    panels = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert len(panels) == 2
    for ax, m in zip(panels, res.measures):
        np.testing.assert_array_equal(np.ma.filled(ax.images[0].get_array(), np.nan), res.matrix(m))
    grid = res.plot("rbf_cka", kind="grid")
    assert len([ax for ax in grid.axes if ax.images]) == len(MODELS) ** 2

    tidy = res.to_pandas()
    assert len(tidy) == 2 * L * L
    row = tidy[(tidy.measure == "rbf_cka") & (tidy.store_a == a.name) & (tidy.layer_a == "pool")
               & (tidy.store_b == "vit") & (tidy.layer_b == "pool")]
    assert row["value"].item() == res.matrix("rbf_cka")[i, j]
    wide = res.to_pandas(wide=True)
    np.testing.assert_array_equal(wide["linear_cka"].to_numpy().reshape(L, L), res.matrix("linear_cka"))

    pytest.importorskip("xarray")
    da = res.to_xarray()
    np.testing.assert_array_equal(da.sel(measure="linear_cka").values, res.matrix("linear_cka"))
    assert float(da.sel(measure="rbf_cka", store_a=a.name, layer_a="pool", store_b="vit", layer_b="pool")) == \
        res.matrix("rbf_cka")[i, j]


def test_figures_over_own_models_draw_heatmaps_and_skip_what_has_no_meaning(own, capfd):
    """`repsim figures` finds the result by content (similarity.npz matches no name pattern; a non-result
    .npz beside it is passed over), draws one heatmap per measure, and skips every item that compares
    objectives — none known here — with its reason, instead of empty, all-zero or "s?"-labelled figures."""
    np.savez(own / "results" / "notes.npz", x=np.arange(3))  # not a result
    out = own / "figs_all"
    items = ["heatmap", "fig2a", "fig2b", "figC4", "figC5", "figC6", "figC7", "figE1", "figE3"]
    assert repsim_main(["figures", "--stores", str(own / "stores"), "--results", str(own / "results"),
                        "--out", str(out), "--progress", "--only", *items]) == 0  # the per-item lines
    printed = capfd.readouterr()
    assert "No artists with labels" not in printed.out + printed.err
    report = (out / "report.html").read_text()
    for m in ("linear_cka", "rbf_cka"):
        assert (out / f"heatmap_similarity_{m}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"<h2 id='heatmap_similarity_{m}'>" in report and f"<img src='heatmap_similarity_{m}.png'" in report
    assert not list(out.glob("heatmap_notes*"))
    for it in items[1:]:
        assert f"id='{it}' class='skipped'" in report, it
        assert not (out / f"{it}.png").exists(), it
        line = next(l for l in printed.out.splitlines() if l.startswith(f"[figures] {it} "))
        assert "skipped: " in line and "objective" in line, line


def test_extract_seed_draws_other_random_weights_and_records_the_seed(tmp_path, monkeypatch):
    """`repsim extract --seed S` for a model named without weights: S draws the weights (another S,
    another network; the same S, the same one) and is recorded as the store's model.seed and init."""
    monkeypatch.syspath_prepend(str(TESTS))
    stores = {}
    for name, seed in (("s0", None), ("s3", "3"), ("s3b", "3")):
        argv = ["extract", "--checkpoint", "module:tiny_models:vit", "--data", "digits", "--split", "test",
                "--layers", "pool", "--out", str(tmp_path / f"{name}.zarr"), "--workers", "0", "--no-progress"]
        assert repsim_main(argv + (["--seed", seed] if seed else [])) == 0
        stores[name] = repsim.open_store(str(tmp_path / f"{name}.zarr"))
    assert stores["s0"].attrs["model"]["seed"] == 0 and stores["s0"].attrs["model"]["init"] == "factory(seed=0)"
    assert stores["s3"].attrs["model"]["seed"] == 3 and stores["s3"].attrs["model"]["init"] == "factory(seed=3)"
    sha = {k: s.attrs["model"]["weights_sha256"] for k, s in stores.items()}
    assert sha["s3"] == sha["s3b"] != sha["s0"]
    pool = {k: np.asarray(s.zarr_array("pool")[...], dtype=np.float32) for k, s in stores.items()}
    np.testing.assert_array_equal(pool["s3"], pool["s3b"])
    assert not np.array_equal(pool["s0"], pool["s3"])
