"""The ``repsim`` command line: one entry point, one module per subcommand, one error path.

Each subcommand module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``, and
is registered as an entry point of the group ``repsim.commands`` (pyproject.toml; :data:`SUBCOMMANDS`).
Modules are imported only to build their parser; anything heavy (torch, dask, zarr) is imported
inside ``run`` so that ``repsim --help`` is fast and ``import repsim`` never pulls in torch. A subcommand
whose module cannot be imported (a missing optional dependency) is listed as unavailable and refuses with
the reason; the others still work.

Errors (:func:`main`): a subcommand reports an expected failure by raising; :func:`main` turns it
into one line ``repsim COMMAND: error: MESSAGE`` on stderr and an exit status from :data:`EXIT_CODES`.
Expected failures are :class:`CommandError`, bad input (``ValueError`` and its subclasses —
``StoreError``, ``ExtractError``, ``ConfigError``, ``CheckpointError`` … —, ``KeyError``, a missing
optional dependency ``ImportError``, whose message names the pip extra to install: repsim.extras) and I/O failures (``OSError``: permission denied, read-only
file system, disk full). Anything else is a bug: its traceback is printed with exit status 70.
``--debug`` (before or after the subcommand, or ``REPSIM_DEBUG=1``) prints every exception's
traceback too; the exit status stays the one its class documents (a refusal is still 2, never 1,
which means "problems found").
"""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Sequence

# The subcommands are declared, not imported by name here: pyproject.toml's
# [project.entry-points."repsim.commands"] maps each to the module implementing it (repsim/train/, repsim/extract/,
# repsim/analyses/ sit above repsim/ and register themselves; tests/test_layering.py checks that nothing in
# repsim/ names them).
ENTRY_POINTS = "repsim.commands"
DISTRIBUTION = "repsim-toolkit"


def _checkout_commands() -> dict[str, str]:
    """The table in the pyproject.toml of the checkout this repsim runs from, or {} when it runs from an
    installed copy: a command declared there works before the next ``pip install -e``."""
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not path.is_file():
        return {}
    import tomllib
    project = tomllib.loads(path.read_text()).get("project", {})
    if project.get("name") != DISTRIBUTION:
        return {}
    return dict(project.get("entry-points", {}).get(ENTRY_POINTS, {}))


def registered_commands() -> dict[str, str]:
    """subcommand -> module (``HELP``, ``configure(parser)``, ``run(args)``): the checkout's table, in its
    order, when there is one, else the installed entry points (which the metadata keeps sorted by name);
    commands that other installed distributions register under ``repsim.commands`` follow."""
    declared = _checkout_commands()
    installed = importlib.metadata.entry_points(group=ENTRY_POINTS)
    ours = {ep.name for ep in installed if declared and ep.dist is not None and ep.dist.name == DISTRIBUTION}
    out = dict(declared)
    for ep in installed:
        if ep.name not in out and ep.name not in ours:
            out[ep.name] = ep.value
    if not out:
        raise RuntimeError(f"no repsim subcommands registered: reinstall {DISTRIBUTION} (pip install -e .)")
    return out


# subcommand -> module implementing it
SUBCOMMANDS: dict[str, str] = registered_commands()

EXIT_OK = 0
EXIT_PROBLEMS = 1  # the command ran and found problems (`repsim check`, failed figure items)
EXIT_REFUSED = 2  # bad arguments or input, incompatible stores, a resume that does not match (argparse's code too)
EXIT_IO = 3  # a file could not be read or written (permission, read-only file system, disk full)
EXIT_BUG = 70  # an unexpected exception: a bug in repsim (EX_SOFTWARE); the traceback is printed
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_PROBLEMS: "the command ran and found problems (repsim check; repsim figures with failed items)",
    EXIT_REFUSED: "refused: bad arguments or input, incompatible stores, a resume with other settings",
    EXIT_IO: "a file could not be read or written (permission, read-only file system, disk full)",
    EXIT_BUG: "an unexpected error (a bug in repsim: the traceback is printed; please report it)",
    EXIT_INTERRUPTED: "interrupted",
}

_NO_ROOM = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


class CommandError(Exception):
    """An expected failure a subcommand reports as one line with exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_REFUSED):
        super().__init__(message)
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr, like every other refusal (exit status 2):
    ``repsim cka: error: argument --batch-size: must be >= 1, got -5 (repsim cka --help lists the
    options)`` instead of the usage block first. Subparsers are built with the same class."""

    def error(self, message: str):  # type: ignore[override] - argparse's signature, NoReturn
        text = " ".join(message.split())
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {text} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from repsim import __version__

    parser = OneLineParser(
        prog="repsim",
        description="Train, extract, and analyse neural-network representations "
        "(CKA, class separation, sparsity, neural collapse, transfer probes).",
        epilog="exit status: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items()),
    )
    parser.add_argument("--version", action="version", version=f"repsim {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.set_defaults(_subparsers=sub.choices)
    for name, module_name in SUBCOMMANDS.items():
        reason, module = "", None
        try:
            module = importlib.import_module(module_name.split(":")[0])
        except ImportError as exc:  # this one command says why when run; the others still work
            reason = (f"cannot import {module_name.split(':')[0]} ({exc}); reinstall repsim-toolkit "
                      "(pip install -e . in a checkout)")
        if module is None:
            _add_unimportable(sub, name, module_name.split(":")[0], reason)
            continue
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(sp)
        # SUPPRESS: given only after the subcommand, it must not reset a --debug given before it
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of any error")
        sp.set_defaults(_run=module.run)
    return parser


def _add_unimportable(sub, name: str, module_name: str, reason: str) -> None:
    """Register subcommand ``name`` whose module cannot be imported: listed as unavailable, and running
    it (with any arguments) ends in ``reason`` as one line, exit 2."""
    def run(args: argparse.Namespace) -> int:
        raise CommandError(reason)

    sp = sub.add_parser(name, help=f"(unavailable: cannot import {module_name})", description=reason,
                        add_help=False, prefix_chars="\0")  # every argument, options too, lands in `rest`
    sp.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    sp.set_defaults(_run=run)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a ``KeyError``'s without the quotes ``str`` adds)."""
    text = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else str(exc)
    return " ".join(str(text).split()) or type(exc).__name__


def describe_os_error(exc: OSError) -> str:
    """``cannot write PATH: No space left on device (free some space ...)`` and the like."""
    what = exc.strerror or one_line(exc)
    path = exc.filename if exc.filename is not None else None
    text = f"{path}: {what}" if path is not None else what
    if exc.filename2 is not None:
        text += f" (-> {exc.filename2})"
    if exc.errno in _NO_ROOM:
        text += "; free some space or choose another output location"
    elif exc.errno in _NOT_WRITABLE:
        text += "; check the permissions or choose another location"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        text += " (a file stands where a directory is needed)"
    return text


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit status, one-line message) for an expected failure, None for a bug."""
    if isinstance(exc, CommandError):
        return exc.code, one_line(exc)
    if isinstance(exc, OSError):
        return EXIT_IO, describe_os_error(exc)
    if isinstance(exc, ImportError):  # a missing optional part names the extra that installs it
        from repsim.extras import explain

        return EXIT_REFUSED, explain(exc) or one_line(exc)
    if isinstance(exc, (ValueError, KeyError)):
        return EXIT_REFUSED, one_line(exc)
    return None


def _strip_prefix(message: str, command: str) -> str:
    """Messages raised as ``extract: ...`` need no second command name after ``repsim extract: error:``."""
    for prefix in (f"repsim {command}: ", f"{command}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


_OUR_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # repsim/, every stage included


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - showwarning's
    """repsim's own warnings as one ``WARNING: ...`` line on stderr, like the commands' printed ones;
    other libraries' warnings keep Python's format (file, line and source), which names their origin."""
    if not str(filename).startswith(_OUR_PACKAGE):
        return _python_show_warning(message, category, filename, lineno, file, line)
    stream = sys.stderr if file is None else file
    try:
        stream.write(f"WARNING: {' '.join(str(message).split())}\n")
    except OSError:  # as Python's own: a closed stderr loses the warning, not the run
        pass


_python_show_warning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser, whose --help lists what it takes
        args._subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = bool(getattr(args, "debug", False)) or os.environ.get("REPSIM_DEBUG", "") not in ("", "0")
    command = args.command
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"repsim {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout's reader stopped reading (`repsim train --print-config | head`): not an error
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the one place where errors become exit statuses
        known = classify(exc)
        if debug or known is None:
            traceback.print_exc()
        if known is None:
            print(f"repsim {command}: internal error ({type(exc).__name__}); this is a bug in repsim, "
                  "please report it with the traceback above", file=sys.stderr)
            return EXIT_BUG
        code, message = known
        print(f"repsim {command}: error: {_strip_prefix(message, command)}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
