"""`pip install repsim-toolkit` is the analysis core without torch (issue 16): checks that fail while torch (or
any deep-learning framework) is a core dependency or is needed by the analysis commands.

1. pyproject's core dependencies name no framework, and the extras hold them.
2. Every third-party import of the analysis code (``repsim/``, ``repsim/analyses/``) is provided by a core
   dependency (module-level imports), or by a core dependency or an extra that repsim.extras names
   (imports inside functions), mapped through ``importlib.metadata.packages_distributions``; an
   import inside ``try: ... except ImportError`` has a fallback and may be absent.
3. In a subprocess where torch, torchvision, timm and transformers cannot be imported, ``import
   repsim``, ``repsim --help``, ``repsim check`` and ``repsim cka`` work on a store, and ``repsim
   extract``/``train``/``demo`` exit 2 (refused) with one line naming ``repsim-toolkit[torch]`` and no traceback.
   (A real fresh venv with ``pip install .`` takes minutes; `make check-core` runs that one.)
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repsim.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = {"torch", "torchvision", "timm", "transformers", "tensorflow", "jax"}
BLOCKED = ("torch", "torchvision", "timm", "transformers")


def _pyproject() -> dict:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _core() -> set[str]:
    """Core distributions: the dependencies and the extras they ask for (dask[distributed] -> distributed)."""
    out = set()
    for req in _pyproject()["project"]["dependencies"]:
        out.add(_name(req))
        extras = re.search(r"\[([^\]]+)\]", req.split(";")[0])
        out.update(_name(e) for e in extras.group(1).split(",")) if extras else None
    return out


def test_core_dependencies_have_no_framework_and_extras_hold_them():
    project = _pyproject()["project"]
    assert not _core() & FRAMEWORKS, _core() & FRAMEWORKS
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["torch"]} == {"torch", "torchvision"}
    assert "timm" in {_name(r) for r in extras["timm"]} and "transformers" in {_name(r) for r in extras["hf"]}
    dev = " ".join(extras["dev"])
    for extra in ("torch", "timm", "hf", "xarray"):
        assert re.search(rf"repsim-toolkit\[[^\]]*\b{extra}\b", dev), f"[dev] must install [{extra}] for the tests"
    # every extra repsim.extras sends a user to exists
    assert set(EXTRAS.values()) <= set(extras)


def _catches_import_error(node: ast.Try) -> bool:
    names = {n.id for h in node.handlers for n in ast.walk(h.type) if isinstance(n, ast.Name)} if node.handlers else set()
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def _third_party_imports(path: Path) -> list[tuple[str, str]]:
    """(top-level module, how) for every non-stdlib, non-project import; how: ``eager`` (module level),
    ``optional`` (in a try that falls back when it is missing) or ``lazy`` (in a function)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    how: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):  # `if TYPE_CHECKING:` too
            for n in ast.walk(node):
                how.setdefault(id(n), "lazy") if n is not node else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for stmt in node.body:
                for n in ast.walk(stmt):
                    how[id(n)] = "optional"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top and top not in sys.stdlib_module_names and top not in ("repsim", "__future__"):
                out.append((top, how.get(id(node), "eager")))
    return out


def test_every_analysis_import_is_a_core_dependency_or_a_named_extra():
    provided = importlib.metadata.packages_distributions()
    core = _core()
    problems = []
    torch_stages = (ROOT / "repsim" / "train", ROOT / "repsim" / "extract")  # the [torch] extra's packages
    files = [p for p in sorted((ROOT / "repsim").rglob("*.py")) if not any(p.is_relative_to(s) for s in torch_stages)]
    assert len(files) > 40
    for path in files:
        for top, how in _third_party_imports(path):
            dists = {_name(d) for d in provided.get(top, [])}
            where = f"{path.relative_to(ROOT)}: import {top}"
            # (a core dependency behind an environment marker this interpreter does not meet is not
            # installed: its module name is its distribution's)
            if dists & core or how == "optional" or _name(top) in core:
                continue
            if how == "eager":
                problems.append(f"{where} at module level, but {sorted(dists) or 'no installed distribution'} "
                                "is not a core dependency")
            elif top not in EXTRAS:
                problems.append(f"{where}: not a core dependency and no extra in repsim.extras.EXTRAS provides it")
    assert not problems, "\n".join(problems)


RUNNER = textwrap.dedent(f"""
    import sys
    for name in {BLOCKED!r}:
        sys.modules[name] = None  # `import torch` now raises ModuleNotFoundError, as if not installed
    if sys.argv[1] == "-c":
        exec(sys.argv[2])
    else:
        from repsim.commands.main import main
        sys.exit(main(sys.argv[1:]))
""")


def _core_only(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def core_store(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("core")
    made = _core_only("-c", textwrap.dedent("""
        import sys, numpy as np, repsim
        rng = np.random.default_rng(0)
        X = rng.standard_normal((256, 12)).astype(np.float32)
        repsim.save_store("a.zarr", layers={"x": X, "y": X @ rng.standard_normal((12, 8)).astype(np.float32)},
                          labels=rng.integers(0, 3, 256))
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        print(round(float(repsim.linear_cka(X, X)), 6))
    """), cwd=d)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "1.0"
    return d / "a.zarr"


def test_analysis_commands_run_without_torch(core_store):
    d = core_store.parent
    for args in (["--help"], ["check", str(core_store)],
                 ["cka", str(core_store), "--out", "cka.npz", "--batch-size", "64", "--epochs", "1", "--no-progress"]):
        done = _core_only(*args, cwd=d)
        assert done.returncode == 0, (args, done.stderr)
    assert (d / "cka.npz").is_file()


@pytest.mark.parametrize("args", [
    ["extract", "--checkpoint", "torchvision:resnet18", "--data", "digits", "--split", "test", "--out", "x.zarr"],
    ["extract", "--checkpoint", "hf:some/model", "--list-layers"],
    ["train", "--preset", "digits-softmax", "--out", "run"],
    ["robustness", "--checkpoint", "run/best.pt", "--eval-set", "imagenet-a=a", "--out", "r.csv"],
    ["demo", "--out", "demo-out"],
])
def test_torch_commands_name_the_extra_without_a_traceback(core_store, args):
    done = _core_only(*args, cwd=core_store.parent)
    assert done.returncode == 2, (args, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"repsim {args[0]}: error: ") and lines[0].endswith(
        "needs torch, which is not installed: pip install 'repsim-toolkit[torch]'")


def test_distribution_name_is_ours_and_every_hint_uses_it():
    """'repsim' on PyPI is another project: the distribution is repsim-toolkit, and every install hint
    (repsim.extras' messages, README) names it, so `pip install` never fetches the other one."""
    from repsim.extras import missing_message

    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert name == "repsim-toolkit"
    assert f"pip install '{name}[torch]'" in missing_message("torch", "extract")
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {name}" in readme and "pip install repsim[" not in readme and "'repsim[" not in readme


def test_make_check_core_expects_the_message_the_commands_print():
    """`make check-core` (tests/check_core_install.sh, not run by the suite: it builds a venv) greps
    `repsim extract`'s refusal for the install hint; after the distribution's rename it still looked for
    'repsim[torch]' and failed on a correct message. Its pattern must match the message itself."""
    from repsim.extras import missing_message

    script = (ROOT / "tests" / "check_core_install.sh").read_text()
    pattern = re.search(r'grep -q "([^"]*\[torch[^"]*)" err\.txt', script).group(1)
    assert re.search(pattern, missing_message("torch", "extract")), (pattern, missing_message("torch", "extract"))
