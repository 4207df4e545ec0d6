"""README.md's recipes, read from README.md and run: what a new user copies must work as written.

A recipe is a fenced block marked by a ``<!-- recipe: NAME -->`` line above it (Markdown comments: the
page shows only the block). Every marked block runs here, in README order, in one directory (so a later
block may use what an earlier one wrote); ``repsim ...`` lines run as the command line does, Python
blocks statement by statement. The README's command table is checked against the parser.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import repsim

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RECIPE = re.compile(r"^<!-- recipe: ([\w-]+) -->\n(?:<!--[^\n]*-->\n)*```(\w+)\n(.*?)^```", re.M | re.S)

# the recipes, in README order, and the test that runs each: a new marked block must be added here
RUN_BY = {"own-models": "test_own_models_recipes", "own-models-python": "test_own_models_recipes",
          "python-api": "test_python_api_recipe", "python-stores": "test_own_models_recipes"}


def _declared() -> dict[str, str]:
    """pyproject.toml's subcommand table (``[project.entry-points."repsim.commands"]``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["repsim.commands"]


def recipes(text: str = README) -> dict[str, tuple[str, str]]:
    """name -> (language, code) of every marked block, in the text's order."""
    found = [(m.group(1), m.group(2), m.group(3)) for m in RECIPE.finditer(text)]
    names = [n for n, _, _ in found]
    assert len(names) == len(set(names)), f"two recipes share a name: {names}"
    return {n: (lang, code) for n, lang, code in found}


def bash_steps(code: str) -> list[str]:
    """The command lines of a bash block: continuation lines joined, comments and blank lines dropped."""
    lines = code.replace("\\\n", " ").splitlines()
    return [ln.split(" #")[0].strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def python_steps(code: str) -> list[str]:
    """The top-level statements of a Python block, as source."""
    return [ast.get_source_segment(code, node) for node in ast.parse(code).body]


def run_recipe(name: str, cwd: Path, env: dict) -> dict:
    """Run recipe ``name`` in ``cwd`` (Python: in namespace ``env``, which it updates, from ``cwd`` as the
    working directory, which stays so for what the test does with the results: relative store paths).
    Returns ``env``; each expression statement's value is
    kept in ``env["_values"]`` (source -> value)."""
    lang, code = recipes()[name]
    if lang == "bash":
        pypath = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        for step in bash_steps(code):
            argv = shlex.split(step)
            assert argv[0] == "repsim", f"recipe {name}: a step that is not a repsim command: {step}"
            r = subprocess.run([sys.executable, "-m", "repsim", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": pypath}, timeout=900)
            assert r.returncode == 0, f"recipe {name}: `{step}` exited {r.returncode}:\n{r.stderr[-3000:]}"
        return env
    assert lang == "python", f"recipe {name}: language {lang!r}"
    assert Path.cwd() == Path(cwd).resolve(), "run Python recipes from their directory (monkeypatch.chdir)"
    for step in python_steps(code):
        tree = ast.parse(step)
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
            env.setdefault("_values", {})[step] = eval(compile(ast.Expression(tree.body[0].value), name, "eval"), env)
        else:
            exec(compile(tree, name, "exec"), env)
    return env


def test_every_recipe_is_run_and_the_own_models_path_is_one_of_them():
    assert list(recipes()) == list(RUN_BY), "a marked README block no test runs (or one that is gone): update RUN_BY"
    assert recipes()["own-models"][0] == "bash"
    steps = bash_steps(recipes()["own-models"][1])
    assert [s.split()[1] for s in steps] == ["extract", "extract", "extract", "similarity", "plot"]
    # on the first screen: the recipe ends within the README's first 30 lines, before installing
    end = README[:README.index("repsim plot sim.npz")].count("\n") + 1
    assert end <= 30 and README.index("repsim plot sim.npz") < README.index("## Installing")


def _unbiased_hsic(K: np.ndarray, L: np.ndarray) -> float:
    """HSIC₁ of Song et al. (2012), Eq. 5: (tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1) / (n(n−3)),
    K̃, L̃ the Grams with zeroed diagonals."""
    n = K.shape[0]
    K, L = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))
    one = np.ones(n)
    return float((np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
                  - 2 / (n - 2) * (one @ K @ L @ one)) / (n * (n - 3)))


def test_python_api_recipe(tmp_path, monkeypatch):
    """The in-memory recipe runs as written, and the number it shows for linear CKA is the paper's
    debiased CKA, computed here from its formula."""
    monkeypatch.chdir(tmp_path)
    env = run_recipe("python-api", tmp_path, {})
    X, Y = env["X"], env["Y"]
    K, L = X @ X.T, Y @ Y.T
    want = _unbiased_hsic(K, L) / np.sqrt(_unbiased_hsic(K, K) * _unbiased_hsic(L, L))
    values = env["_values"]
    cka = next(v for s, v in values.items() if '"linear_cka"' in s)
    assert cka == pytest.approx(want, rel=1e-9) and 0 < cka < 1
    assert 0 < next(v for s, v in values.items() if '"procrustes"' in s) <= 1
    store = repsim.open_store(tmp_path / "mine.zarr")
    assert sorted(store.layers) == ["x", "y"] and store.n == 500


@pytest.mark.slow
def test_own_models_recipes(tmp_path, monkeypatch):
    """The first screen's three commands with random-init torchvision, timm and `module:` models, then the
    Python that reads their result, then the store recipe: stores of one dataset aligned row by row, a
    result with both measures over every column of the three stores, and (with `repsim plot`) a PNG."""
    pytest.importorskip("torch")
    pytest.importorskip("timm")
    monkeypatch.chdir(tmp_path)
    run_recipe("own-models", tmp_path, {})
    stores = [repsim.open_store(tmp_path / f"{s}.zarr") for s in "abc"]
    assert all(s.n == stores[0].n for s in stores) and stores[0].n > 0
    for s in stores[1:]:
        np.testing.assert_array_equal(s.example_ids, stores[0].example_ids)
    res = repsim.load_result(tmp_path / "sim.npz")
    assert res.measures == ["linear_cka", "rbf_cka"]
    assert {store for store, _ in res.index} == {"a", "b", "c"}
    assert len(res.index) == sum(len(s.layers) for s in stores)
    for m in res.measures:
        M = res.matrix(m)
        assert M.shape == (len(res.index),) * 2 and np.isfinite(M).all()
        np.testing.assert_allclose(np.diag(M), 1.0, atol=1e-6)
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    env = run_recipe("own-models-python", tmp_path, {})
    np.testing.assert_array_equal(env["cka"], res.matrix("linear_cka"))
    assert env["fig"].axes
    assert set(env["df"]["measure"]) == set(res.measures)
    np.testing.assert_array_equal(env["da"].sel(measure="linear_cka").values, res.matrix("linear_cka"))

    env = run_recipe("python-stores", tmp_path, {})
    pool = repsim.load_result(tmp_path / "pool.npz")
    assert pool.index == [("a", "pool"), ("b", "pool")] and env["res"].index == pool.index
    assert env["da"].dims[0] == "example" and env["da"].shape[0] == stores[0].n
    np.testing.assert_array_equal(env["da"].values, np.asarray(stores[0].layer("block1")))
    np.testing.assert_array_equal(env["da"]["example"].values, stores[0].example_ids)  # the stores' coords
    np.testing.assert_array_equal(env["da"]["label"].values, stores[0].labels)


def _table_commands(text: str = README) -> list[str]:
    """The subcommands the README's command table (below ``<!-- commands -->``) lists, in its order."""
    table = text.split("<!-- commands -->", 1)[1].strip().split("\n\n", 1)[0]
    rows = [ln for ln in table.splitlines()[2:] if ln.startswith("|")]
    cells = [re.match(r"\| `repsim ([\w-]+)` \|", ln) for ln in rows]
    assert all(cells), [ln for ln, c in zip(rows, cells) if not c]
    return [c.group(1) for c in cells]


def test_readme_command_table_lists_every_subcommand_and_nothing_else():
    """One row per subcommand the parser offers (pyproject.toml's entry-point table), none twice, none
    that does not exist."""
    from repsim.commands.main import build_parser

    table = _table_commands()
    assert len(table) == len(set(table)), f"a command listed twice: {table}"
    declared = set(_declared())
    parser = set(build_parser().get_default("_subparsers"))
    assert declared <= parser, f"declared but not in the parser: {declared - parser}"
    assert set(table) == declared, (f"missing from the README's table: {sorted(declared - set(table))}; "
                                    f"listed but not a subcommand: {sorted(set(table) - declared)}")


def test_extract_recipe_names_a_checkpoint_training_writes():
    """The README's extraction line names a file that `repsim train` writes (repsim/train/loop.py)."""
    line = next(ln for ln in README.splitlines() if ln.startswith("repsim extract --checkpoint runs/"))
    name = Path(re.search(r"--checkpoint (\S+\.pt)", line).group(1)).name
    loop = ROOT / "repsim" / "train" / "loop.py"
    assert f'"{name}"' in loop.read_text(), f"README extracts {name}, which {loop} never writes"


def test_check_exit_status_of_a_missing_store_is_as_documented(tmp_path):
    refusals = (ROOT / "docs" / "refusals.md").read_text()
    row = next(ln for ln in refusals.splitlines() if ln.startswith("| a missing, incomplete, corrupted or misaligned store"))
    documented = int(re.search(r"`check`: (\d)", row).group(1))
    r = subprocess.run([sys.executable, "-m", "repsim", "check", str(tmp_path / "nope.zarr")],
                       capture_output=True, text=True)
    assert r.returncode == documented, r.stderr
    assert "does not exist" in r.stdout + r.stderr
