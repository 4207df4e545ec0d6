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


def test_module_env_puts_a_checkout_on_the_path_and_leaves_an_install_alone(tmp_path, monkeypatch):
    """The demo's ``python -m repsim.analyses.command_runs`` and tune's ``python -m repsim train`` run with
    :func:`repsim.subprocesses.module_env`: a checkout run without installing goes first on PYTHONPATH, an
    installed repsim is found in site-packages as usual; a researcher's ``train.py``/``analyses.py`` in the
    current directory is never imported (every stage lives under the one import root ``repsim``)."""
    import os
    import site
    from pathlib import Path

    from repsim.subprocesses import module_env

    root = Path(__file__).resolve().parents[1]
    for name in ("train.py", "analyses.py", "extract.py"):
        (tmp_path / name).write_text(f"print('{name} ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    checkout = module_env()
    assert checkout["PYTHONPATH"].split(os.pathsep) == [str(root)]
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(root)])  # an installed repsim
    assert "PYTHONPATH" not in module_env()
    listed = subprocess.run([sys.executable, "-m", "repsim", "--help"], env=checkout, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0 and "unavailable" not in listed.stdout, listed.stdout + listed.stderr
    runs = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", "[]"], env=checkout,
                          capture_output=True, text=True, timeout=120)
    assert runs.returncode == 0 and "ran" not in runs.stdout + runs.stderr, runs.stdout + runs.stderr


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
