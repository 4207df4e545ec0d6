"""One import root (docs/architecture.md "One import root"): the wheel installs ``repsim`` and nothing
else at the top level, and the packaging audit's three reproducers — a researcher's own ``extract.py`` or
``train.py`` in the working directory, another distribution's top-level ``train/`` on the path — leave
repsim's stages alone."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, extra_path: list[Path] | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` run in ``cwd`` (first on ``sys.path``, as for any script or ``-c``), with repsim's
    checkout importable after ``extra_path``."""
    path = [str(p) for p in extra_path or []] + [str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wheel_holds_one_top_level_package(tmp_path):
    """Built from this checkout (setuptools, no isolation: what `pip install .` builds), the wheel's only
    top-level import package is ``repsim``; the presets and the stages travel inside it."""
    pytest.importorskip("setuptools")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("repsim_toolkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"repsim"}
    for inner in ("repsim/train/loop.py", "repsim/extract/pipeline.py", "repsim/analyses/render.py",
                  "repsim/train/presets/_digits.toml"):
        assert inner in names, inner


def test_a_users_extract_py_does_not_hide_the_extraction_api(tmp_path):
    """The audit's first case: ``from extract import extract_store`` found the user's file; the documented
    import now names repsim's package, and the user's own module stays theirs."""
    pytest.importorskip("torch")
    (tmp_path / "extract.py").write_text("WHO = 'the user'\nprint('user extract.py ran')\n")
    run = _python("""
        from repsim.extract import extract_store
        import extract
        print(extract_store.__module__, extract.WHO)
    """, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["user extract.py ran", "repsim.extract.pipeline the user"]


def test_a_users_train_py_is_not_run_by_an_extraction(tmp_path):
    """The audit's second case: extracting a model on digits executed the user's ``train.py`` (as
    ``train``) and then failed on ``train.data``; it now runs repsim's ``repsim.train.data``."""
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text("print('user train.py ran')\nraise SystemExit(3)\n")
    run = _python("""
        import torch
        from repsim.extract import extract_store
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(72, 10))
        store = extract_store(model, "digits", "s.zarr", split="test", batch_size=128, progress=False)
        print("rows", len(store.labels))
    """, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "user train.py ran" not in run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("rows ")


def test_another_distributions_top_level_train_package_changes_nothing(tmp_path):
    """The audit's third case: a second installed package with a top-level ``train/`` overwrote
    ``site-packages/train/__init__.py``. Such a package, earlier on the path, is now simply another
    package: repsim's stages and the ``repsim`` command are found under ``repsim``."""
    other = tmp_path / "other_site"
    (other / "train").mkdir(parents=True)
    (other / "train" / "__init__.py").write_text("OWNER = 'someone else'\n")
    run = _python("""
        import train
        import repsim.train, repsim.train.config
        from repsim.commands.main import SUBCOMMANDS
        print(train.OWNER)
        print(repsim.train.config.__name__, SUBCOMMANDS["train"])
    """, tmp_path, extra_path=[other])
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["someone else", "repsim.train.config repsim.train.cli"]


@pytest.mark.parametrize("package", ["repsim", "repsim.train", "repsim.extract"])
def test_every_lazy_export_resolves(package):
    """Each public name a package exports lazily (:func:`repsim.lazy.lazy_exports`) is found in the module
    its table names (a renamed module left ``repsim.similarity`` raising ModuleNotFoundError)."""
    import importlib

    if package != "repsim":
        pytest.importorskip("torch")
    pkg = importlib.import_module(package)
    missing = []
    for name in pkg.__all__:
        if name.startswith("__"):
            continue
        try:
            getattr(pkg, name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []
