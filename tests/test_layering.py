"""The package layout is the architecture (docs/architecture.md): ``repsim`` is the one import root; each
layer of the core imports only the layers below it, nothing in the core imports torch, each stage (the
core ← ``repsim.train`` ← ``repsim.extract`` ← ``repsim.analyses``) imports only the stages below it, no
stage names a module of a stage above it (the ``repsim`` command finds its subcommands through the entry
points pyproject.toml declares), no package has an import circle (counting the imports a package's
``__init__`` runs), and no module imports another package's private (underscore) module or name.
Imports are read from the source (module level and inside functions alike)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers it may import (itself included). "base" is repsim/array_api.py, repsim/lazy.py, the other root modules and
# the package root (``from repsim import __version__``).
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "study": {"base", "study"},  # the paper study's registry, rescale rule and run directories
    "kernels": {"base", "kernels"},
    "store": {"base", "store"},
    "probes": {"base", "kernels", "store", "probes"},  # out-of-core probes read store layers chunk by chunk
    "engine": {"base", "study", "kernels", "probes", "store", "engine"},
    "commands": {"base", "study", "kernels", "probes", "store", "engine", "commands"},
}
FORBIDDEN_TOP = {"torch", "torchvision", "timm", "transformers"}  # the core stays torch-free

# The stages, from the ground up (docs/architecture.md "Stages"): each may import the ones before it.
# "repsim" is the torch-free core: every module of repsim/ outside the three stage packages.
STAGES: tuple[str, ...] = ("repsim", "repsim.train", "repsim.extract", "repsim.analyses")


def stage_of(module: str) -> str | None:
    """The stage of a repsim module (the longest stage prefix), or None outside repsim."""
    hits = [s for s in STAGES if module == s or module.startswith(s + ".")]
    return max(hits, key=len) if hits else None


def stage_files(root: Path, stage: str) -> list[Path]:
    """The source files of one stage (the core: repsim/ less the stage packages)."""
    base = root / Path(*stage.split("."))
    files = sorted(base.rglob("*.py"))
    if stage == "repsim":
        inner = [root / Path(*s.split(".")) for s in STAGES[1:]]
        files = [f for f in files if not any(f.is_relative_to(i) for i in inner)]
    return files


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path``; ``from pkg import name`` counts as
    ``pkg.name`` when that is a module of the tree, else as ``pkg``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    is_pkg = path.name == "__init__.py"
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                as_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                    (root / Path(*sub.split(".")) / "__init__.py").is_file()
                out.append((node.lineno, sub if as_module else mod))
    return out


def layer_of(module: str) -> str | None:
    """The layer of a module of the core, or None for modules outside it (other packages, the stages)."""
    parts = module.split(".")
    if parts[0] != "repsim" or stage_of(module) != "repsim":
        return None
    if len(parts) == 1 or parts[1] in ("array_api", "lazy", "__main__", "__version__"):
        return "commands" if parts[1:2] == ["__main__"] else "base"
    return parts[1] if parts[1] in ALLOWED else "base"


def layering_violations(root: Path) -> list[str]:
    """One line per import that breaks :data:`ALLOWED` or imports a deep-learning framework."""
    bad = []
    for path in stage_files(root, "repsim"):
        mod = module_name(path, root)
        mine = layer_of(mod)
        for line, target in imports_of(path, root):
            where = f"{path.relative_to(root)}:{line}"
            if target.split(".")[0] in FORBIDDEN_TOP:
                bad.append(f"{where}: imports {target} (repsim/ must stay torch-free)")
            theirs = layer_of(target)
            if theirs is not None and theirs not in ALLOWED[mine]:
                bad.append(f"{where}: {mine} module {mod} imports {target} ({theirs})")
    return bad


def import_cycles(root: Path, packages: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected components (size > 1) of the module import graph of ``packages`` (dotted
    names: "repsim.analyses"). Importing ``a.b.c`` runs the ``__init__`` of ``a.b`` first, so an import
    also counts as an edge to each package above its target that is not a package of the importer's own
    (those are running already); the root ``repsim``, whose ``__init__`` imports nothing eagerly, is left
    out."""
    def inside(mod: str) -> bool:
        return any(mod == p or mod.startswith(p + ".") for p in packages)

    graph: dict[str, set[str]] = {}
    for pkg in packages:
        for path in stage_files(root, pkg) if pkg in STAGES else sorted((root / Path(*pkg.split("."))).rglob("*.py")):
            mod = module_name(path, root)
            own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 2)}
            deps = graph.setdefault(mod, set())
            for _, target in imports_of(path, root):
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the target and the packages above it, root left out
                    t_ = ".".join(parts[:i])
                    if inside(t_) and t_ != mod and (t_ == target or t_ not in own):
                        deps.add(t_)
    for deps in graph.values():
        deps.discard("repsim")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def test_repsim_layers_import_only_downwards():
    assert layering_violations(ROOT) == []


def stage_violations(root: Path) -> list[str]:
    """One line per import of a stage above the importing one (:data:`STAGES`)."""
    bad = []
    for i, pkg in enumerate(STAGES):
        for path in stage_files(root, pkg):
            for line, target in imports_of(path, root):
                if stage_of(target) in STAGES[i + 1:]:
                    bad.append(f"{path.relative_to(root)}:{line}: {pkg} imports {target} (a stage above it)")
    return bad


def named_upper_modules(root: Path) -> list[str]:
    """One line per string constant that names a module of a stage above the file's own (``"repsim.train.cli"``,
    ``"repsim.analyses.demo:run"``): an import by name (importlib) that :func:`stage_violations` cannot see."""
    bad = []
    for i, pkg in enumerate(STAGES):
        for path in stage_files(root, pkg):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                    continue
                name = node.value.split(":")[0]
                parts = name.split(".")
                if stage_of(name) not in STAGES[i + 1:] or len(parts) < 3 or not all(p.isidentifier() for p in parts):
                    continue
                target = root / Path(*parts)
                if target.with_suffix(".py").is_file() or (target / "__init__.py").is_file():
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {pkg} names {node.value!r} (a stage above it)")
    return bad


def test_stages_import_only_downwards():
    assert stage_violations(ROOT) == []


def test_no_stage_names_a_module_above_it():
    """e.g. a command table in repsim/ that importlib-loads repsim.train.cli: the ground floor calling the top."""
    assert named_upper_modules(ROOT) == []


def declared_commands(root: Path) -> dict[str, str]:
    """pyproject.toml's ``[project.entry-points."repsim.commands"]``: subcommand -> module."""
    import tomllib
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return dict(project.get("entry-points", {}).get("repsim.commands", {}))


def test_every_command_is_a_declared_entry_point_with_its_three_names():
    """The dispatch the stage checks cannot see is declared in pyproject.toml: each module there exists
    and defines HELP, configure and run at module level (read from the source, nothing imported)."""
    declared = declared_commands(ROOT)
    assert {"train", "extract", "cka", "figures", "demo"} <= set(declared)
    for name, module in declared.items():
        path = ROOT / Path(*module.split(":")[0].split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        assert path.is_file(), (name, module)
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
            t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        assert {"HELP", "configure", "run"} <= defined, (name, module)


def test_no_import_circles_in_any_package():
    for pkg in STAGES:
        assert import_cycles(ROOT, (pkg,)) == [], pkg
    assert import_cycles(ROOT, ("repsim",)) == []


# library helpers that had copies or lived in the wrong stage: each is defined in one module only
ONE_HOME: dict[str, str] = {
    # results files read, merged and written beside their declared columns (were in repsim/engine/drivers.py)
    "merge_csv": "repsim/results.py",  # results CSVs merged by key (repsim probe had its own)
    "merge_npz": "repsim/results.py",
    "write_csv": "repsim/results.py",
    "results_lock": "repsim/results.py",
    # what `repsim probe` / `calibrate` / `accuracy` write, as library calls (were in repsim/commands/)
    "write_probes": "repsim/probes/writers.py",
    "write_calibration": "repsim/probes/writers.py",
    "accuracy_rows": "repsim/probes/writers.py",
    "store_names": "repsim/store/reader.py",  # (was repsim.engine.blocks', which the probes layer cannot import)
    "best_epoch": "repsim/study/runs.py",  # the early-stopping rule (was in repsim/commands/runs.py, repsim/train/)
    "sha256_file": "repsim/fileio.py",  # a checkpoint's identity (was in repsim/extract/, imported by repsim/train/)
    "holdout_split": "repsim/train/imaging.py",  # (was repsim.train.data's, imported back by repsim.train.csvdata)
}


def test_shared_helpers_have_one_home():
    bad = []
    for pkg in STAGES:
        for path in stage_files(ROOT, pkg):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ONE_HOME \
                        and ONE_HOME[node.name.lstrip("_")] != rel:
                    bad.append(f"{rel}:{node.lineno}: {node.name} (its home is {ONE_HOME[node.name.lstrip('_')]})")
    assert bad == []


# what code outside repsim/commands/ may import from it: the entry point and its one error path (main),
# and the argument types a stage's own CLI shares (args); the rest of commands/ is the CLI only
COMMANDS_SHARED = ("repsim.commands.main", "repsim.commands.args")


def command_imports(root: Path) -> list[str]:
    """One line per import of a module of ``repsim.commands`` other than :data:`COMMANDS_SHARED` from a
    module outside it (a library function living in a command module: the demo imported
    ``write_probes`` from ``repsim.commands.probe``)."""
    bad = []
    for path in sorted((root / "repsim").rglob("*.py")):
        mod = module_name(path, root)
        if mod == "repsim.commands" or mod.startswith("repsim.commands.") or mod == "repsim.__main__":
            continue
        for line, target in imports_of(path, root):
            if target.startswith("repsim.commands.") and target not in COMMANDS_SHARED:
                bad.append(f"{path.relative_to(root)}:{line}: imports {target} (commands/ is the CLI only)")
    return bad


def test_commands_are_the_cli_only():
    assert command_imports(ROOT) == []


def test_command_check_catches_a_library_call_from_a_command_module(tmp_path):
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/commands/__init__.py": "",
                            "repsim/commands/probe.py": "def write_probes():\n    pass\n",
                            "repsim/commands/main.py": "", "repsim/analyses/__init__.py": "",
                            "repsim/analyses/demo.py": "def f():\n    from repsim.commands.probe import write_probes\n"
                                                       "    from repsim.commands.main import main\n"})
    assert command_imports(root) == [
        "repsim/analyses/demo.py:2: imports repsim.commands.probe (commands/ is the CLI only)"]


def test_the_docs_state_what_these_tests_enforce():
    """docs/architecture.md's listing of repsim/ names every module (kernels' accuracy, extras, ... were
    missing); README and the doc say the same about the layering and the stages; every .md file they
    name exists (DESIGN.md did not)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    readme = (ROOT / "README.md").read_text()
    listing = doc.split("## The layers of `repsim/`")[1].split("```")[1]
    words = set(re.findall(r"[A-Za-z_]\w*", listing))
    unlisted = [str(p.relative_to(ROOT)) for p in stage_files(ROOT, "repsim")
                if not p.stem.startswith("__") and p.stem not in words
                and not (p.parent.name == "commands" and not p.stem.startswith("_"))]  # "one module per subcommand"
    assert unlisted == []
    for text in (doc, readme):
        assert "imports only layers listed before it" in " ".join(text.split())
        assert "`repsim` ← `repsim.train` ← `repsim.extract` ← `repsim.analyses`" in " ".join(text.split())
    assert " ".join(STAGES) == "repsim repsim.train repsim.extract repsim.analyses"
    for where, text in (("README.md", readme), ("docs/architecture.md", doc)):
        for name in set(re.findall(r"[\w./-]*\w\.md\b", text)) - {"demo-out/report/findings.md", "findings.md"}:  # the demo writes them
            assert (ROOT / name).exists() or (ROOT / where).parent.joinpath(name).exists(), (where, name)
    kernels = (ROOT / "repsim" / "kernels" / "__init__.py").read_text()
    assert "May import only :mod:`repsim.array_api` and" not in kernels  # they use _blas too (base)


# ------------------------------------------------------------------------ the seams inside the kernels
# The CKA family, in the order in which each may import the ones before it (never a later one): the
# precision rule, the accelerator route, the private Gram machinery, the HSIC math, the accumulator,
# one-shot linear CKA.
CKA_ORDER = ("repsim.kernels._precision", "repsim.kernels._cka_device", "repsim.kernels._gram",
             "repsim.kernels.hsic", "repsim.kernels.minibatch_cka", "repsim.kernels.cka")
def repsim_imports(root: Path) -> dict[str, list[tuple[int, str]]]:
    """module -> its imports of repsim modules (line, module), for every module of repsim/."""
    return {module_name(p, root): [(line, t) for line, t in imports_of(p, root) if t.split(".")[0] == "repsim"]
            for p in sorted((root / "repsim").rglob("*.py"))}


def private_imports(root: Path) -> list[str]:
    """One line per import of a private (underscore) module or name of repsim from outside the package
    that owns it. ``pkg._mod`` and ``pkg.mod._name`` are owned by ``pkg`` and by ``pkg.mod``'s package
    ``pkg``: its modules and its subpackages' may use them; the root's own (``repsim._x``) only the root's
    modules, since every stage lives under the root. Whatever another package needs has a public name."""
    bad = []
    for path in sorted((root / "repsim").rglob("*.py")):
        mod = module_name(path, root)
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for full in names:
                parts = full.split(".")
                if parts[0] != "repsim":
                    continue
                private = [i for i, p_ in enumerate(parts) if p_.startswith("_") and not p_.startswith("__")]
                if not private:
                    continue
                owner_parts = parts[: private[0]]
                leaf = root / Path(*owner_parts)
                if not (leaf / "__init__.py").is_file():  # pkg.mod._name: owned by mod's package
                    owner_parts = owner_parts[:-1]
                owner = ".".join(owner_parts)
                ok = pkg == owner or (owner != "repsim" and pkg.startswith(owner + "."))
                if not ok:
                    bad.append(f"{mod}:{node.lineno}: imports {full}, private to {owner}")
    return bad


def test_no_module_imports_another_packages_private_module_or_name():
    assert private_imports(ROOT) == []


def test_the_cka_modules_import_only_the_ones_below_them():
    """kernels/cka.py was split by job (docs/architecture.md): the math never reaches up to the
    accumulator or the one-shot formula, the machinery never to the math."""
    graph = repsim_imports(ROOT)
    assert set(CKA_ORDER) <= set(graph)
    bad = [f"{mod} imports {t}" for i, mod in enumerate(CKA_ORDER) for _, t in graph[mod] if t in CKA_ORDER[i + 1:]]
    assert bad == []


def test_a_measure_module_is_a_registered_measure_on_the_protocol_and_the_kernels():
    """Each public module of kernels/measures/ registers its measures with @register and imports, of
    repsim, only the registry and protocol, other measure modules, the kernels' math and the base
    layer (not the engine, stores, probes or commands, nor the exact route's column driver); and the
    registry finds every one of them without a list to edit (docs/architecture.md "Adding a measure")."""
    from repsim.kernels.measures import MEASURES, measure_names

    graph = repsim_imports(ROOT)
    names = set(measure_names())
    modules = sorted(p for p in (ROOT / "repsim" / "kernels" / "measures").glob("*.py")
                     if not p.stem.startswith("_") and p.stem != "exact")  # exact.py: the all-pairs driver
    assert len(modules) >= 7
    for path in modules:
        mod = module_name(path, ROOT)
        for line, t in graph[mod]:
            assert layer_of(t) in ("base", "kernels") and t != "repsim.kernels.measures.exact", (mod, line, t)
        tree = ast.parse(path.read_text())
        registered = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
                      and any(isinstance(d, ast.Name) and d.id == "register" for d in n.decorator_list)]
        assert registered, f"{mod} registers no measure"
        assert {MEASURES[m].__name__ for m in names if MEASURES[m].__module__ == mod} == set(registered), mod
    assert {MEASURES[m].__module__ for m in names} == {module_name(p, ROOT) for p in modules}
    assert "_MODULES" not in (ROOT / "repsim" / "kernels" / "measures" / "__init__.py").read_text()


def test_per_layer_metrics_are_declared_in_their_registry_and_reached_through_it():
    """The per-layer metrics (class separation, sparsity, collapse, spectra) are declared once, in
    kernels/layer_metrics.py's registry; the streaming driver reaches their kernels only through it
    (no hand dispatch on their accumulators)."""
    from repsim.kernels.layer_metrics import LAYER_METRICS, LayerMetric

    assert list(LAYER_METRICS) == ["separation", "sparsity", "collapse", "spectra"]
    assert all(issubclass(c, LayerMetric) and c.__module__ == "repsim.kernels.layer_metrics"
               for c in LAYER_METRICS.values())
    homes = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "repsim").rglob("*.py"))
             if re.search(r"^LAYER_METRICS\b.*=", p.read_text(), re.M)]
    assert homes == ["repsim/kernels/layer_metrics.py"]
    kernels = {t for _, t in repsim_imports(ROOT)["repsim.engine.drivers"] if layer_of(t) == "kernels"}
    assert kernels == {"repsim.kernels.layer_metrics"}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("source, culprit", [
    ("from repsim.engine.minibatch import cka_matrix\n", "imports repsim.engine.minibatch"),
    ("def f():\n    from ..engine import minibatch\n", "imports repsim.engine.minibatch"),
    ("def f():\n    import torch\n", "imports torch"),
])
def test_checks_catch_a_kernel_importing_upwards(tmp_path, source, culprit):
    """The checks can fail: a kernel importing the engine (module level or lazily) or torch is named."""
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/kernels/__init__.py": "",
                            "repsim/kernels/cka.py": source, "repsim/engine/__init__.py": "",
                            "repsim/engine/minibatch.py": "from repsim.kernels.cka import x\n"})
    bad = layering_violations(root)
    assert len(bad) == 1 and "repsim/kernels/cka.py" in bad[0] and culprit in bad[0]


def test_cycle_check_finds_a_lazy_circle(tmp_path):
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/analyses/__init__.py": "",
                            "repsim/analyses/a.py": "from repsim.analyses.b import f\n",
                            "repsim/analyses/b.py": "def f():\n    from repsim.analyses import a\n"})
    assert import_cycles(root, ("repsim.analyses",)) == [["repsim.analyses.a", "repsim.analyses.b"]]


def test_cycle_check_sees_the_imports_a_package_init_runs(tmp_path):
    """findings imports items.common, which runs items/__init__, which imports items.measures, which imports
    findings: a circle through an ``__init__`` (the loop the old check missed)."""
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/analyses/__init__.py": "",
                            "repsim/analyses/findings.py": "from repsim.analyses.items.common import f\n",
                            "repsim/analyses/items/__init__.py": "from repsim.analyses.items import measures\n",
                            "repsim/analyses/items/common.py": "def f():\n    pass\n",
                            "repsim/analyses/items/measures.py": "from repsim.analyses import findings\n"})
    assert import_cycles(root, ("repsim.analyses",)) == [
        ["repsim.analyses.findings", "repsim.analyses.items", "repsim.analyses.items.measures"]]
    (root / "repsim/analyses/items/__init__.py").write_text("")  # no eager import: no circle
    assert import_cycles(root, ("repsim.analyses",)) == []


def test_stage_checks_catch_train_importing_extract(tmp_path):
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/train/__init__.py": "", "repsim/extract/__init__.py": "",
                            "repsim/extract/cli.py": "def f():\n    from repsim.train.loop import g\n",
                            "repsim/train/loop.py": "def g():\n    from repsim.extract.cli import f\n",
                            "repsim/main.py": "TABLE = {'x': 'repsim.extract.cli'}\n"})
    assert stage_violations(root) == ["repsim/train/loop.py:2: repsim.train imports repsim.extract.cli (a stage above it)"]
    assert named_upper_modules(root) == ["repsim/main.py:1: repsim names 'repsim.extract.cli' (a stage above it)"]
    assert import_cycles(root, STAGES) == [["repsim.extract.cli", "repsim.train.loop"]]


def test_private_check_catches_imports_across_packages(tmp_path):
    root = _tree(tmp_path, {"repsim/__init__.py": "", "repsim/_base.py": "", "repsim/top.py": "from repsim import _base\n",
                            "repsim/kernels/__init__.py": "", "repsim/kernels/_gram.py": "def g():\n    pass\n",
                            "repsim/kernels/hsic.py": "from repsim.kernels import _gram\n",
                            "repsim/kernels/measures/__init__.py": "",
                            "repsim/kernels/measures/rbf.py": "from repsim.kernels._gram import g\n",
                            "repsim/kernels/open.py": "def _helper():\n    pass\n",
                            "repsim/engine/__init__.py": "",
                            "repsim/engine/grams.py": "def f():\n    from repsim.kernels._gram import g\n"
                                                      "    from repsim.kernels.open import _helper\n"
                                                      "    from repsim import _base\n"})
    assert private_imports(root) == [
        "repsim.engine.grams:2: imports repsim.kernels._gram.g, private to repsim.kernels",
        "repsim.engine.grams:3: imports repsim.kernels.open._helper, private to repsim.kernels",
        "repsim.engine.grams:4: imports repsim._base, private to repsim"]
