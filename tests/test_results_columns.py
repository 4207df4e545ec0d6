"""Each results file's columns are declared once, in ``repsim/results.py``: its writers conform their rows
to the declaration and its readers take the names from there. A literal list of a results file's column
names anywhere else in the tree (a writer's own ``COLUMNS``, a reader's ``["store", "objective", ...]``,
a merge key) fails here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from repsim.results import COLUMNS, KEYS, PARAMETERS, columns, conform

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("repsim",)  # every stage lives under the one import root
HOME = "repsim/results.py"
MIN_NAMES = 3  # shorter literals ("store",), ("dataset", "split") are too common to mean a file's columns
# a network's and its data's metadata, shared by many files (and by readers joining store attrs on
# ``store``): a list of these alone (a reader's ("epoch", "dataset", "split", "n"), tune.csv's merge key)
# does not name one results file's columns
SHARED = {"store", "objective", "seed", "params", "variant", "epoch", "dataset", "split", "n", "spatial",
          "layer", "preset"}


def column_lists(root: Path) -> list[str]:
    """One line per list/tuple/set literal of >= MIN_NAMES strings, all columns of one results file and
    not all :data:`SHARED` (or exactly a declared merge key, :data:`KEYS`), outside :data:`HOME`."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or len(node.elts) < MIN_NAMES:
                    continue
                if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                    continue
                names = {e.value for e in node.elts}
                keys = [f for f, key in KEYS.items() if names == set(key)]
                if names <= SHARED and not keys:
                    continue
                files = keys or [f for f, cols in COLUMNS.items() if names <= set(cols)]
                if files:
                    bad.append(f"{rel}:{node.lineno}: columns of {', '.join(f + '.csv' for f in files)}")
    return bad


def test_no_results_columns_listed_outside_repsim_results():
    assert column_lists(ROOT) == []


def test_the_check_finds_a_writers_own_column_list(tmp_path):
    (tmp_path / "repsim" / "commands").mkdir(parents=True)
    (tmp_path / "repsim" / "commands" / "probe.py").write_text(
        'COLUMNS = ["store", "objective", "seed", "task", "probe"]\nKEY = ("store", "task", "probe", "metric")\n'
        'OTHER = ("train", "holdout", "test")\nMETA = ("epoch", "dataset", "split", "n")\n')
    assert column_lists(tmp_path) == ["repsim/commands/probe.py:1: columns of probes.csv",
                                      "repsim/commands/probe.py:2: columns of probes.csv"]


def test_the_check_finds_the_old_local_lists_of_robustness_and_tune(tmp_path):
    """robustness.py's merge key and summary base, and tune's and finetune's merge keys, as they were
    before robustness/tune/finetune.csv were declared (tune.csv's key is all SHARED names: caught as a
    declared merge key)."""
    (tmp_path / "repsim" / "train").mkdir(parents=True)
    (tmp_path / "repsim" / "train" / "robustness.py").write_text(
        'KEY = ("store", "checkpoint_sha256", "benchmark", "subset", "metric")\n'
        'base = {k: r[k] for k in ("store", "objective", "seed", "checkpoint_sha256", "checkpoint")}\n')
    (tmp_path / "repsim" / "train" / "tune_cli.py").write_text(
        'write_rows(p, rows, key=("preset", "objective", "params", "variant", "seed"))\n'
        'write_rows(p, rows, key=("objective", "params", "variant", "seed", "task", "source_checkpoint"))\n'
        'grid = ("point", "replicate", "holdout_last")\n')
    assert sorted(column_lists(tmp_path)) == ["repsim/train/robustness.py:1: columns of robustness.csv",
                                      "repsim/train/robustness.py:2: columns of robustness.csv",
                                      "repsim/train/tune_cli.py:1: columns of tune.csv",
                                      "repsim/train/tune_cli.py:2: columns of finetune.csv",
                                      "repsim/train/tune_cli.py:3: columns of grid.csv"]


def test_conform_puts_a_grids_parameter_columns_at_their_declared_position():
    rows = [{"run": "r", "point": 0, "optim.lr": 0.1, "replicate": "s0", "optim.weight_decay": 0.0}]
    got = conform("grid", rows, parameters=["optim.lr", "optim.weight_decay"])
    assert list(got[0]) == ["point", "replicate", "optim.lr", "optim.weight_decay", "run"]
    at = PARAMETERS["grid"]
    assert columns("grid", ["x"]) == (*COLUMNS["grid"][:at], "x", *COLUMNS["grid"][at:])
    with pytest.raises(ValueError, match="undeclared column.*'optim.lr'"):
        conform("grid", rows)  # the writer must name the parameter columns
    with pytest.raises(ValueError, match="repeat a column"):
        columns("grid", ["run"])
    with pytest.raises(ValueError, match="no parameter columns"):
        conform("tune", [], parameters=["x"])


def test_merge_keys_are_declared_columns():
    for name, key in KEYS.items():
        assert set(key) <= set(COLUMNS[name]), name


def test_conform_orders_fills_and_refuses_undeclared_columns():
    rows = [{"r2": 0.5, "store": "a", "layer": "pool"}, {"store": "b", "distance": "cosine"}]
    assert [list(r) for r in conform("separation", rows)] == [["store", "layer", "distance", "r2"]] * 2
    assert list(conform("probes", [{"store": "a"}], fill=True)[0]) == list(COLUMNS["probes"])
    with pytest.raises(ValueError, match="undeclared column.*'r3'"):
        conform("separation", [{"store": "a", "r3": 1}])


def test_the_docs_table_lists_the_declared_columns():
    """docs/architecture.md "Results files" names every declared column of each file, in order."""
    doc = (ROOT / "docs" / "architecture.md").read_text().split("## Results files")[1].split("\n## ")[0]
    for name, cols in COLUMNS.items():
        line = next(l for l in doc.splitlines() if l.startswith(f"| `{name}.csv`"))
        text = line.split("|")[3]
        if name == "collapse":
            text = text.replace("the Table E.2 keys (`repsim.kernels.collapse.COLLAPSE_KEYS`)",
                                ", ".join(COLUMNS["collapse"][4:-6]))
        text = text.replace("+ M", ", ".join(("dataset", "split", "n", "spatial", "method", "engine_spatial")))
        pos = [text.find(c) for c in cols]
        assert -1 not in pos, (name, [c for c, p in zip(cols, pos) if p < 0])
