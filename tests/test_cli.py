"""The command line: every subcommand has --help, and importing repsim never imports torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from repsim.commands.main import SUBCOMMANDS, build_parser


def test_import_repsim_is_torch_free():
    code = "import sys, repsim, repsim.commands.main; repsim.commands.main.build_parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    assert command in capsys.readouterr().out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "repsim", "--help"], capture_output=True, text=True, check=True)
    for command in SUBCOMMANDS:
        assert command in out.stdout


def test_subcommands_are_the_declared_entry_points(monkeypatch):
    """pyproject.toml's [project.entry-points."repsim.commands"] is the one table: read from the checkout
    (current before a reinstall), and the installed metadata gives the same commands."""
    import repsim.commands.main as main

    declared = main._checkout_commands()
    assert declared and SUBCOMMANDS == declared
    monkeypatch.setattr(main, "_checkout_commands", lambda: {})
    assert main.registered_commands() == dict(sorted(declared.items()))  # the installed copy's view


def test_a_reader_that_stops_reading_stdout_is_no_error(tmp_path):
    """`repsim check STORE | head -1`: the pipe closes before the table is written; exit 0, no message."""
    import numpy as np

    from repsim.store.writer import save_store

    store = save_store(str(tmp_path / "s.zarr"), {f"l{i}": np.zeros((8, 2), np.float32) + i for i in range(40)},
                       np.arange(8) % 2)
    proc = subprocess.Popen([sys.executable, "-m", "repsim", "check", "--no-progress", str(store.path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Exception ignored" not in err


def test_a_train_py_in_the_current_directory_does_not_break_python_m_repsim(tmp_path):
    """``python -m repsim`` puts the current directory first on sys.path, where a researcher's own
    ``train.py`` shadows repsim's ``train`` package: every other subcommand still works, the shadowed
    ones say so in one line (exit 2), and the user's script is never run (the packaging audit's case)."""
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    (tmp_path / "train.py").write_text("print('the user script ran')\n")
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def repsim(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "repsim", *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)

    ok = repsim("check", "--help")
    assert ok.returncode == 0 and "usage: repsim check" in ok.stdout, ok.stderr
    listed = repsim("--help")
    assert listed.returncode == 0 and "(unavailable: cannot import train.cli)" in listed.stdout
    refused = repsim("train", "--preset", "digits-softmax", "--out", "x")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"repsim train: error: cannot import train.cli: {tmp_path / 'train.py'} shadows repsim's package 'train' "
        f"({Path(repo) / 'train'}): run the `repsim` command instead of `python -m repsim`, run it from another "
        "directory, or rename that file")
    assert "the user script ran" not in ok.stdout + listed.stdout + refused.stdout


def test_repsims_own_module_subprocesses_do_not_import_a_train_py_from_the_current_directory(tmp_path,
                                                                                              monkeypatch):
    """The demo's ``python -m analyses.command_runs`` and tune's ``python -m repsim train`` run with
    :func:`repsim._subprocess.module_env`: nothing puts the current directory, where a researcher's
    ``train.py``/``analyses.py`` would be imported in place of repsim's packages, on their path — with
    repsim run from a checkout (its folder goes first on PYTHONPATH) and installed (found as usual; a
    PYTHONPATH entry for the current directory would come before site-packages: review of this change)."""
    import os
    import site
    from pathlib import Path

    from repsim._subprocess import module_env

    root = Path(__file__).resolve().parents[1]
    for name in ("train.py", "analyses.py"):
        (tmp_path / name).write_text(f"print('{name} ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", str(tmp_path)]))  # the cwd, twice
    checkout = module_env()
    assert checkout["PYTHONSAFEPATH"] == "1" and checkout["PYTHONPATH"].split(os.pathsep) == [str(root)]
    # an installed repsim (its folder a site-packages folder): nothing of ours on PYTHONPATH, the cwd neither
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(root)])
    installed = module_env()
    assert "PYTHONPATH" not in installed and installed["PYTHONSAFEPATH"] == "1"
    for env in (checkout, installed):
        listed = subprocess.run([sys.executable, "-m", "repsim", "--help"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert listed.returncode == 0 and "unavailable" not in listed.stdout, listed.stdout + listed.stderr
        runs = subprocess.run([sys.executable, "-m", "analyses.command_runs", "[]"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert runs.returncode == 0 and "ran" not in runs.stdout + runs.stderr, runs.stdout + runs.stderr
        where = subprocess.run([sys.executable, "-c", "import train; print(train.__file__)"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert where.stdout.strip() == str(root / "train" / "__init__.py"), where.stdout + where.stderr


def test_a_subcommand_whose_module_cannot_be_imported_refuses_alone(monkeypatch, capsys):
    """A subcommand module that raises ImportError is listed as unavailable and refuses in one line; the
    subcommands before and after it keep their own parsers (the fallback once reused the previous module,
    or crashed when the first one failed: review of this change)."""
    import repsim.commands.main as m

    items = list(m.SUBCOMMANDS.items())
    for where in (0, 2):
        table = dict(items[:where] + [("broken", "repsim_no_such_module_xyz")] + items[where:])
        monkeypatch.setattr(m, "SUBCOMMANDS", table)
        parser = m.build_parser()
        broken = parser.parse_args(["broken", "--x", "1"])
        assert broken.command == "broken"
        with pytest.raises(m.CommandError, match=r"^cannot import repsim_no_such_module_xyz \(No module named "):
            broken._run(broken)
        check = parser.parse_args(["check", "some.zarr"])
        assert check._run.__module__ == "repsim.commands.check"
