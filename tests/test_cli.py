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
