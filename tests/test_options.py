"""One vocabulary across the subcommands (issue 41) and one options object for a streamed run (issue 42).

Walks every subcommand's parser: each option name has one meaning (one row of docs/options.md, which
lists exactly the subcommands that take it), the shared options (--device, --progress/--no-progress,
--memory-budget) are spelled, defaulted and explained by one rule wherever they occur, and the old
spellings still work with a one-line notice. Then checks that --memory-budget reaches the budgets it
names (the exact estimators' Grams and panels, the drivers' accumulator state) on real stores.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest

import repsim
from repsim.commands.args import (DEVICE_HELP, MEMORY_HELP, PROGRESS_HELP, _Deprecated, memory_size)
from repsim.commands.main import build_parser, main
from repsim.engine.options import DEFAULT_BUDGETS, StreamOptions, format_size, panel_bytes, parse_size
from test_engine_helpers import correlated_layers, make_store

ROOT = Path(__file__).resolve().parents[1]
GLOBAL = {"-h", "--help"}
# subcommands with no progress display to turn on or off, and why
NO_PROGRESS = {"runs": "reads a few small CSV/JSON files",
               "calibrate": "one result line per network, on stdout; no bar",
               "robustness": "its per-set log lines are its output",
               "tune": "starts `repsim train` runs (with --no-progress) and prints one line per finished run",
               "finetune": "as tune",
               "demo": "an orchestrator: one line per finished stage; --verbose streams its processes",
               "plot": "draws one figure from one results file"}
# subcommands that hold data in memory up to a bound
MEMORY_BOUNDED = {"cka", "similarity", "separation", "sparsity", "collapse", "probe", "calibrate"}


def parsers() -> dict[str, argparse.ArgumentParser]:
    return dict(build_parser()._subparsers._group_actions[0].choices)


def walk() -> tuple[dict[str, dict[str, argparse.Action]], dict[str, dict[str, argparse.Action]]]:
    """({option: {subcommand: action}}, the same for deprecated spellings); hidden test hooks left out."""
    current: dict[str, dict[str, argparse.Action]] = {}
    old: dict[str, dict[str, argparse.Action]] = {}
    for name, parser in parsers().items():
        for action in parser._actions:
            for opt in action.option_strings:
                if opt in GLOBAL:
                    continue
                if isinstance(action, _Deprecated):
                    old.setdefault(opt, {})[name] = action
                elif action.help != argparse.SUPPRESS:
                    current.setdefault(opt, {})[name] = action
    return current, old


def doc_tables() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """docs/options.md's "Every option" and "Deprecated spellings" tables: {option: subcommands}."""
    text = (ROOT / "docs" / "options.md").read_text()
    every = text.split("## Every option")[1].split("## Deprecated spellings")[0]
    deprecated = text.split("## Deprecated spellings")[1]

    def rows(section: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for line in section.splitlines():
            m = re.match(r"\| `(--[a-z0-9-]+)[^`]*` \|.*\| ([^|]+) \|$", line.strip())
            if m:
                assert m.group(1) not in out, f"docs/options.md lists {m.group(1)} twice: one meaning, one row"
                out[m.group(1)] = {s.strip() for s in m.group(2).split(",")}
        return out

    return rows(every), rows(deprecated)


def test_every_option_has_one_row_in_docs_listing_exactly_the_subcommands_that_take_it():
    current, old = walk()
    documented, documented_old = doc_tables()
    everyone = set(parsers())
    actual = {opt: set(where) for opt, where in current.items()}
    actual["--debug"] = {"every subcommand"} if set(actual.pop("--debug")) == everyone else set()
    actual["--version"] = {"repsim"}
    assert set(documented) == set(actual), (sorted(set(actual) - set(documented)), sorted(set(documented) - set(actual)))
    wrong = {opt: (sorted(documented[opt]), sorted(actual[opt])) for opt in actual if documented[opt] != actual[opt]}
    assert wrong == {}
    assert {opt: set(where) for opt, where in old.items()} == documented_old
    # an old spelling is never also a current option of the same subcommand (it would shadow it)
    assert all(not (set(where) & set(current.get(opt, {}))) for opt, where in old.items())


def test_a_resume_file_is_not_a_model_source():
    """--checkpoint names a model (extract, robustness); in cka/similarity it was a resume file: now
    --resume, the old spelling deprecated and stored where --resume is."""
    current, old = walk()
    assert set(current["--checkpoint"]) == {"extract", "robustness"}
    assert set(old["--checkpoint"]) == {"cka", "similarity"}
    for cmd in ("cka", "similarity"):
        assert old["--checkpoint"][cmd].dest == current["--resume"][cmd].dest


def test_the_shared_options_follow_one_rule_wherever_they_occur():
    current, _ = walk()
    device_head = DEVICE_HELP.split("{package}")[0]
    for cmd, action in current["--device"].items():
        assert action.default == "auto", cmd
        assert action.help.startswith(device_head), (cmd, action.help)
        assert action.choices is None or set(action.choices) >= {"auto", "cpu", "cuda"}, cmd
    for cmd, action in current["--progress"].items():
        assert isinstance(action, argparse.BooleanOptionalAction) and action.default is None, cmd
        assert "--no-progress" in action.option_strings, cmd
        assert action.help.endswith(PROGRESS_HELP.split("}")[-1]), (cmd, action.help)
    head = MEMORY_HELP.split("{bounds}")[0]
    for cmd, action in current["--memory-budget"].items():
        assert action.type is memory_size and action.metavar == "SIZE", cmd
        assert action.help.startswith(head) and "a plain number is MiB" in action.help, cmd
        assert f"default {format_size(action.default).replace(' ', '')}" in action.help, cmd


def test_progress_and_memory_budget_wherever_they_apply():
    current, _ = walk()
    everyone = set(parsers())
    assert set(current["--progress"]) == set(current["--no-progress"]) == everyone - set(NO_PROGRESS)
    assert set(current["--memory-budget"]) == MEMORY_BOUNDED
    defaults = {cmd: a.default for cmd, a in current["--memory-budget"].items()}
    assert defaults == {"cka": 8 << 30, "similarity": 8 << 30, "separation": 4 << 30, "sparsity": 4 << 30,
                        "collapse": 4 << 30, "probe": 512 << 20, "calibrate": 512 << 20}


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30), ("1.5G", 3 * 2**29), ("800MB", 800 * 10**6), ("2kb", 2000),
    ("64KiB", 65536), ("1TiB", 2**40), ("100B", 100), ("0", 0), ("2", 2 * 2**20), ("0.5", 2**19),
    (" 3 gib ", 3 * 2**30), ("1e3KiB", 1000 * 1024), (256, 256 * 2**20), (0.25, 2**18)])
def test_sizes_with_units_are_read_as_written(text, expected):
    assert parse_size(text) == expected
    assert parse_size(format_size(expected).replace(" ", "")) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("bad", ["-1", "4XB", "GiB", "4 GiB 2", "", "nan", "inf", True])
def test_a_size_that_is_not_one_is_refused(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(bad)


def test_a_bad_memory_budget_is_one_argparse_line(capsys, tmp_path):
    for cmd in sorted(MEMORY_BOUNDED):
        args = {"probe": ["probe", "--train", "x.zarr", "--test", "y.zarr"],
                "calibrate": ["calibrate", "--test", "x.zarr", "--holdout", "y.zarr"]}.get(cmd, [cmd, "x.zarr", "--out", "o"])
        with pytest.raises(SystemExit) as exc:
            main([*args, "--memory-budget", "4 gigs"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "argument --memory-budget" in err and "512MiB" in err, err


def test_old_spellings_work_with_a_one_line_notice(capsys):
    sub = parsers()
    args = sub["cka"].parse_args(["s.zarr", "--out", "o.npz", "--max-memory", "2", "--checkpoint", "r.npz"])
    assert args.memory_budget == 2 * 2**30 and args.checkpoint == "r.npz"
    err = capsys.readouterr().err.splitlines()
    assert err == ["repsim cka: --max-memory is deprecated and will be removed; write --memory-budget 2GiB",
                   "repsim cka: --checkpoint is deprecated and will be removed; write --resume r.npz"]
    assert sub["similarity"].parse_args(["s.zarr", "--out", "o.npz", "--resume", "r.npz"]).checkpoint == "r.npz"
    assert capsys.readouterr().err == ""
    assert sub["figures"].parse_args(["--quiet"]).progress is False
    assert capsys.readouterr().err == "repsim figures: --quiet is deprecated and will be removed; write --no-progress\n"
    got = sub["robustness"].parse_args(["--checkpoint", "c.pt", "--set", "a=/d1", "--eval-set", "b=/d2",
                                        "--set", "c=/d3"])
    assert got.sets == ["a=/d1", "b=/d2", "c=/d3"]
    assert capsys.readouterr().err.count("write --eval-set a=/d1\n") == 1
    assert sub["demo"].parse_args(["--seeds", "3"]).seeds == 3
    assert "write --num-seeds 3" in capsys.readouterr().err
    old = sub["plot"].parse_args(["r.npz", "--out", "f.png", "--kind", "grid", "--stores", "a", "b"])
    assert (old.kind, old.stores) == ("grid", ["a", "b"])
    assert capsys.readouterr().err.splitlines() == [
        "repsim plot: --kind is deprecated and will be removed; write --layout grid",
        "repsim plot: --stores is deprecated and will be removed; write --only-stores a b"]
    assert sub["cka"].parse_args(["s.zarr", "--out", "o"]).memory_budget == DEFAULT_BUDGETS["similarity"]
    with pytest.raises(SystemExit):
        sub["cka"].parse_args(["s.zarr", "--out", "o", "--max-memory", "-1"])
    assert "argument --max-memory: must be a finite number > 0" in capsys.readouterr().err


def test_progress_default_is_auto_and_both_spellings_set_it():
    for name, parser in parsers().items():
        if name in NO_PROGRESS:
            continue
        dest = next(a.dest for a in parser._actions if "--progress" in a.option_strings)
        base = {"cka": ["s", "--out", "o"], "similarity": ["s", "--out", "o"], "separation": ["s", "--out", "o"],
                "sparsity": ["s", "--out", "o"], "collapse": ["s", "--out", "o"], "check": ["s"],
                "accuracy": ["s", "--out", "o"], "extract": ["--checkpoint", "c.pt"]}.get(name, [])
        assert getattr(parser.parse_args(base), dest) is None, name
        assert getattr(parser.parse_args([*base, "--progress"]), dest) is True, name
        assert getattr(parser.parse_args([*base, "--no-progress"]), dest) is False, name


def test_similarity_help_lists_every_registered_measure_on_a_line_and_its_own_out(capsys):
    from repsim.kernels.measures import MEASURES, measure_names

    with pytest.raises(SystemExit):
        main(["similarity", "--help"])
    text = capsys.readouterr().out
    listing = text.split("measures (--measures")[1]
    for name in measure_names():
        line = next(line for line in listing.splitlines() if line.split()[:1] == [name])
        assert MEASURES[name].info.formula in line
    assert "CKAResult" not in text.split("--out FILE")[1].split("--layers")[0]
    assert "SimilarityResult" in text


# ---------------------------------------------------------------------------------------------------
# StreamOptions: one object, the old keywords fill it, and the budget reaches what it bounds


def test_stream_options_are_one_frozen_object_and_the_old_keywords_fill_it():
    opts = StreamOptions(device="cpu", threads=3, memory_budget=2**30)
    with pytest.raises(Exception):
        opts.threads = 4  # frozen
    assert opts.merged(threads=None, read_ahead=5) == StreamOptions(device="cpu", threads=3, read_ahead=5,
                                                                     memory_budget=2**30)
    assert opts.budget("layers") == 2**30 and StreamOptions().budget("layers") == 4 << 30
    assert opts.panel("similarity") == panel_bytes(2**30) == 64 << 20
    assert StreamOptions().panel("similarity") == 512 << 20  # the former constant at the default budget
    for bad in ({"threads": 0}, {"read_ahead": -1}, {"memory_budget": -1}, {"dtype": "float16"}):
        with pytest.raises(ValueError):
            StreamOptions(**bad)
    assert repsim.StreamOptions is StreamOptions


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(4)
    layers = correlated_layers(rng, 96, {"wide": (8, 4, 4), "mid": (120,), "pool": (8,)})
    return make_store(tmp_path_factory.mktemp("opts") / "m.zarr", layers, chunk_rows=8)


def test_memory_budget_reaches_the_exact_estimators_grams_and_panels(store, tmp_path, capsys):
    """Grams 3 x 96 x 96 float64 (+1 while U-centring) = 288 KiB; rows of a 8-row block of the three
    Gram columns 8 x 256 x 8 B = 16 KiB. --memory-budget 1MiB: panels of 64 KiB = 4 blocks, 3 panels;
    512KiB: 2 blocks, 6 panels; a byte less than the three Grams: fewer of them, the same values."""
    from repsim.engine.exact import route_bytes

    ref = repsim.cka_matrix(store, method="exact", progress=False)
    passes = {}
    fewer = f"{route_bytes([128, 120, 8], 96, 3) - 1}B"
    for budget in ("1MiB", "512KiB", fewer):
        out = tmp_path / f"{budget}.npz"
        assert main(["cka", store.path, "--method", "exact", "--memory-budget", budget, "--out", str(out)]) == 0
        res = repsim.CKAResult.load(out)
        np.testing.assert_allclose(res.values, ref.values, rtol=1e-10)
        passes[budget] = res.meta["exact_passes"]
        assert res.meta["exact_gram_bytes"] <= parse_size(budget)
    assert passes["512KiB"] > passes["1MiB"] >= 3
    routes = repsim.CKAResult.load(tmp_path / f"{fewer}.npz").meta["exact_routes"]
    assert "cross" in routes.values() and "cross" not in repsim.CKAResult.load(tmp_path / "1MiB.npz").meta["exact_routes"].values()
    with_python = repsim.cka_matrix(store, method="exact", progress=False,
                                    stream=StreamOptions(memory_budget=parse_size("512KiB")))
    assert with_python.meta["exact_passes"] == passes["512KiB"]
    # a keyword argument fills the object over stream's field (here the former max_memory=: the budget)
    keyword = repsim.cka_matrix(store, method="exact", progress=False, max_memory=parse_size("1MiB"),
                                stream=StreamOptions(memory_budget=parse_size("512KiB")))
    assert keyword.meta["exact_passes"] == passes["1MiB"]
    capsys.readouterr()
    assert main(["cka", store.path, "--method", "exact", "--memory-budget", "20KiB", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "over the limit of" in err and "raise --memory-budget" in err and err.count("\n") == 1


def test_memory_budget_reaches_the_drivers_accumulator_state(store, tmp_path, monkeypatch):
    """The state budget the drivers group layers by (engine.drivers.group_layers) is --memory-budget's,
    not the former fixed 4 GiB; the rows are the same whatever the grouping."""
    from repsim.engine import drivers

    seen = []
    group = drivers.group_layers
    monkeypatch.setattr(drivers, "group_layers", lambda cols, sizes, budget: seen.append(budget) or group(cols, sizes, budget))
    for budget in ("4GiB", "1B"):
        assert main(["separation", store.path, "--memory-budget", budget, "--out", str(tmp_path / f"{budget}.csv")]) == 0
    assert seen == [4 << 30, 1]
    assert (tmp_path / "4GiB.csv").read_text() == (tmp_path / "1B.csv").read_text()


def test_device_auto_is_the_cpu_without_a_usable_gpu(store):
    from repsim.engine.scheduler import cuda_usable, resolve_device

    expected = "cuda" if cuda_usable() else "cpu"
    assert resolve_device("auto") == expected and resolve_device("cpu") == "cpu"
    res = repsim.cka_matrix(store, epochs=1, batch_size=48, layers=["pool"], stream=StreamOptions(device="auto"))
    assert res.meta["device"] == expected
