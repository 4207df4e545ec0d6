"""Every valid value of the analysis subcommands' options run once (issue 46): ``repsim cka``, ``similarity``,
``separation``, ``sparsity``, ``collapse``, ``plot`` and ``check`` on tiny real stores, through the CLI's
``main()`` in this process, each run's numbers checked against the in-memory API called with that value
(not just exit 0), and, where the value changes what is computed, against the default's numbers too (a flag
that parsed but never reached the computation would equal the default). Their refusals (out-of-range
values): tests/test_engine_cli.py, tests/test_refusals.py; the measure options (--rbf-threshold, --knn-k,
--rsa-max-rows, --ridge-folds): tests/test_similarity.py; the probe's and calibrate's values:
tests/test_probes_cli.py and below.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

import repsim
from repsim.commands.main import main
from repsim.engine.result import CKAResult
from repsim.engine.drivers import DISTANCES, collapse_rows, separation_rows, sparsity_rows
from test_engine_helpers import correlated_layers, make_store

N = 120


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("values")
    rng = np.random.default_rng(0)
    out = []
    for k, name in enumerate(("a", "b")):
        layers = {key: v.astype(np.float32) for key, v in
                  correlated_layers(rng, N, {"f": (4, 3, 3), "pool": (10,)}).items()}
        head = (rng.normal(size=(3, 10)), rng.normal(size=3))
        out.append(make_store(root / f"{name}.zarr", layers, labels=np.arange(N) % 3, chunk_rows=20, head=head,
                              meta={"model": {"objective": name, "seed": k}}).path)
    return out


def _cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


# --------------------------------------------------------------------------- cka (and similarity's shared ones)

BASE = dict(batch_size=30, epochs=1, seed=1)
BASE_ARGS = ["--batch-size", "30", "--epochs", "1", "--seed", "1", "--no-progress"]

# (flags, the API's keywords for them, whether the numbers differ from the default run's)
CKA_VALUES = [
    (["--spatial", "flatten"], {"spatial": "flatten"}, False),
    (["--spatial", "mean"], {"spatial": "mean"}, True),
    (["--method", "minibatch"], {"method": "minibatch"}, False),
    (["--method", "exact"], {"method": "exact"}, True),
    (["--shuffle", "window"], {"shuffle": "window"}, False),
    (["--shuffle", "examples"], {"shuffle": "examples"}, True),
    (["--shuffle", "none"], {"shuffle": "none"}, True),
    (["--no-shuffle"], {"shuffle": False}, True),
    (["--shuffle-window", "40"], {"shuffle_window": 40}, True),
    (["--biased"], {"debiased": False}, True),
    (["--compute-dtype", "float32"], {"compute_dtype": "float32"}, False),
    (["--compute-dtype", "float64"], {"compute_dtype": "float64"}, True),
    (["--layers", "pool"], {"layers": ["pool"]}, True),
    (["--epochs", "2"], {"epochs": 2}, True),
    (["--seed", "3"], {"seed": 3}, True),
    (["--batch-size", "40"], {"batch_size": 40}, True),
    (["--device", "cpu"], {"device": "cpu"}, False),
    (["--device", "auto"], {"device": "cpu"}, False),  # (no GPU here: auto is the CPU, test_options checks why)
    (["--threads", "1"], {"threads": 1}, False),
    (["--memory-budget", "64MiB"], {"max_memory": 64 << 20}, False),
    (["--checkpoint-every", "2"], {"checkpoint_every": 2}, False),
    (["--scheduler", "threads"], {}, False),
]


@pytest.fixture(scope="module")
def cka_default(stores):
    return repsim.cka_matrix(stores, progress=False, **BASE)


@pytest.mark.parametrize("flags, kw, changes", CKA_VALUES, ids=[" ".join(c[0]) for c in CKA_VALUES])
def test_cka_option_values_reach_the_computation(stores, cka_default, tmp_path, flags, kw, changes):
    out = tmp_path / "cka.npz"
    _cli("cka", *stores, *BASE_ARGS, *flags, "--out", out)
    got = CKAResult.load(out)
    api = repsim.cka_matrix(stores, progress=False, **{**BASE, **kw})
    assert got.values.shape == api.values.shape
    np.testing.assert_allclose(got.values, api.values, rtol=0, atol=1e-12, equal_nan=True)
    if changes:
        assert got.values.shape != cka_default.values.shape or not np.allclose(
            got.values, cka_default.values, rtol=0, atol=1e-9), f"{flags} gave the default's numbers"
    else:
        np.testing.assert_allclose(got.values, cka_default.values, rtol=0, atol=1e-6)


SIMILARITY_VALUES = [
    (["--null", "permutation", "--permutations", "20"], {"null": "permutation", "permutations": 20}),
    (["--null", "analytic"], {"null": "analytic"}),
    (["--alpha", "0.2", "--permutations", "20"], {"alpha": 0.2, "permutations": 20}),
]


@pytest.mark.parametrize("flags, kw", SIMILARITY_VALUES, ids=[" ".join(c[0]) for c in SIMILARITY_VALUES])
def test_similarity_null_options_reach_the_p_values(stores, tmp_path, flags, kw):
    """--null, --permutations and --alpha: the p-values and the threshold of the API with those values."""
    out = tmp_path / "s.npz"
    _cli("similarity", *stores, *BASE_ARGS, "--measures", "linear_cka", *flags, "--out", out)
    got = repsim.load_result(out)
    api = repsim.similarity_matrix(stores, ["linear_cka"], progress=False, **BASE, **kw)
    np.testing.assert_allclose(got.matrix("linear_cka"), api.matrix("linear_cka"), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.pvalues("linear_cka"), api.pvalues("linear_cka"), rtol=0, atol=1e-12,
                               equal_nan=True)
    np.testing.assert_allclose(got.threshold("linear_cka"), api.threshold("linear_cka"), rtol=0, atol=1e-12,
                               equal_nan=True)


@pytest.mark.slow  # (every registered measure once: ~10 s on 2 cores)
def test_similarity_runs_every_registered_measure(stores, tmp_path):
    """--measures with every name the registry lists (its --help lists the same): the API's values."""
    from repsim.kernels.measures import measure_names

    measures = list(measure_names())
    out = tmp_path / "all.npz"
    _cli("similarity", *stores, *BASE_ARGS, "--layers", "pool", "--measures", ",".join(measures), "--out", out)
    got = repsim.load_result(out)
    api = repsim.similarity_matrix(stores, measures, layers=["pool"], progress=False,  # (the CLI seeds them by --seed)
                                   options={"rsa_seed": BASE["seed"], "ridge_seed": BASE["seed"]}, **BASE)
    assert list(got.measures) == list(api.measures)
    for m in measures:
        np.testing.assert_allclose(got.matrix(m), api.matrix(m), rtol=0, atol=1e-12, equal_nan=True, err_msg=m)


# ---------------------------------------------------------------------------------- the per-layer drivers


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _same_rows(csv_rows: list[dict], api_rows: list[dict], value_columns: list[str]) -> None:
    assert len(csv_rows) == len(api_rows) > 0
    key = ("store", "layer", "distance")
    got = {tuple(r.get(k) for k in key): r for r in csv_rows}
    for row in api_rows:
        mine = got[tuple(None if row.get(k) is None else str(row[k]) for k in key)]
        for col in value_columns:
            assert float(mine[col]) == pytest.approx(float(row[col]), rel=1e-12, abs=1e-15, nan_ok=True), col


@pytest.mark.parametrize("distance", [*DISTANCES, "all", "cosine,sqeuclidean"])
def test_separation_distance_values(stores, tmp_path, distance):
    out = tmp_path / "sep.csv"
    _cli("separation", *stores, "--distance", distance, "--no-progress", "--out", out)
    distances = DISTANCES if distance == "all" else tuple(distance.split(","))
    api = separation_rows(stores, distances=distances, progress=False)
    assert {r["distance"] for r in _rows(out)} == set(distances)
    _same_rows(_rows(out), api, ["r2"])


@pytest.mark.parametrize("spatial", ["flatten", "mean"])
def test_sparsity_and_collapse_spatial_values(stores, tmp_path, spatial):
    sp, co, spectra = tmp_path / "sp.csv", tmp_path / "co.csv", tmp_path / "spectra.npz"
    _cli("sparsity", *stores, "--spatial", spatial, "--no-progress", "--out", sp)
    _cli("collapse", *stores, "--layers", "f,pool", "--spatial", spatial, "--spectra", spectra, "--no-progress",
         "--out", co)
    api_sp = sparsity_rows(stores, spatial=spatial, progress=False)
    value_cols = [k for k, v in api_sp[0].items() if isinstance(v, float)]
    assert value_cols
    _same_rows(_rows(sp), api_sp, value_cols)
    api_co, api_spectra = collapse_rows(stores, ["f", "pool"], spectra=True, spatial=spatial, progress=False)
    value_cols = [k for k, v in api_co[0].items() if isinstance(v, float)]
    _same_rows(_rows(co), api_co, value_cols)
    with np.load(spectra) as z:
        assert set(z.files) == set(api_spectra)
        for k, v in api_spectra.items():
            np.testing.assert_allclose(z[k], v, rtol=1e-12, atol=0, err_msg=k)
    if spatial == "mean":  # the flag reached the computation: f's (4, 3, 3) maps averaged to 4 features
        flat = collapse_rows(stores, ["f"], spatial="flatten", progress=False)[0]
        cols = [k for k, v in flat[0].items() if isinstance(v, float)]
        assert any(r[c] != pytest.approx(f[c], rel=1e-9) for r, f in zip(api_co, flat) for c in cols)


# -------------------------------------------------------------------------------------------- plot, check


@pytest.fixture(scope="module")
def drawn(stores, tmp_path_factory):
    """A similarity result of two measures and its plot with every default."""
    root = tmp_path_factory.mktemp("plot")
    res, default = root / "s.npz", root / "default.png"
    _cli("similarity", *stores, *BASE_ARGS, "--measures", "linear_cka,procrustes", "--out", res)
    _cli("plot", res, "--out", default)
    return res, default


@pytest.mark.parametrize("flags", [["--layout", "matrix"], ["--layout", "grid"], ["--measure", "linear_cka"],
                                   ["--only-stores", "a"], ["--layers", "pool"], ["--title", "T"], ["--dpi", "40"]],
                         ids=lambda f: " ".join(f))
def test_plot_option_values(drawn, tmp_path, flags):
    """Each value draws a PNG that differs from the default one (the default layout: the same); --dpi sets
    its pixel size (40 dpi: 40/150 of the default's width)."""
    from PIL import Image

    res, default = drawn
    png = tmp_path / "fig.png"
    _cli("plot", res, *flags, "--out", png)
    with Image.open(png) as got, Image.open(default) as ref:
        assert got.format == "PNG" and min(got.size) > 20
        same = got.size == ref.size and np.asarray(got).tobytes() == np.asarray(ref).tobytes()
        if flags[0] == "--dpi":
            assert got.size[0] == pytest.approx(ref.size[0] * 40 / 150, rel=0.05)
        else:
            assert same == (flags == ["--layout", "matrix"]), flags


@pytest.mark.parametrize("flags", [[], ["--no-values"], ["--compare"], ["--compare", "--allow-mixed-datasets"]],
                         ids=lambda f: " ".join(f) or "default")
def test_check_option_values(stores, flags, capsys):
    _cli("check", *stores, *flags, "--no-progress")
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "2 store(s) OK" in text, text
    assert ("--no-values read no layer chunks" in text) == ("--no-values" in flags), text
