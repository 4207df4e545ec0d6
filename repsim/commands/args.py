"""Argument types and flags shared by the commands: integers with a lower bound; the pairing overrides.

A value out of range is an argparse error (one line naming the option, exit 2), never an exception
deep inside the computation (``--seed -1`` reached NumPy's "expected non-negative integer", naming no
option) nor a value silently clamped (``--shuffle-window -5`` ran with another window).
"""
from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its messages
    return parse


non_negative = int_at_least(0)
positive = int_at_least(1)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """An argparse ``type`` accepting finite floats > 0."""
    value = _number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


positive_float.__name__ = "number > 0"


def fraction(text: str) -> float:
    """An argparse ``type`` accepting numbers strictly between 0 and 1."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


fraction.__name__ = "fraction in (0, 1)"


def scheduler_address(text: str) -> str:
    """An argparse ``type`` for ``--scheduler``: ``local:N`` (N >= 1 worker processes, the rule of
    :func:`repsim.engine.scheduler.local_workers`), ``threads``, or an address (``tcp://host:8786``)."""
    from repsim.engine.scheduler import local_workers

    try:
        local_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


scheduler_address.__name__ = "scheduler address"


def add_pairing_flags(parser: argparse.ArgumentParser, first: str, second: str, *, same_examples_use: str,
                      mixed_datasets_risk: str, other_classes_scope: str = "") -> None:
    """The overrides of ``repsim.store.pairing``'s refusals for a command that pairs a ``first`` and a
    ``second`` store (probe: training/test; calibrate: test/holdout): ``--same-examples``,
    ``--allow-mixed-datasets`` and ``--allow-other-classes``, each used on purpose with a warning."""
    parser.add_argument("--same-examples", action="store_true",
                        help=f"allow a {second} store that shares examples with its {first} store ({same_examples_use}; "
                             "a warning says so)")
    parser.add_argument("--allow-mixed-datasets", action="store_true",
                        help=f"allow a {second} store of another dataset than its {first} store (dataset.name differs; "
                             f"default: refused, {mixed_datasets_risk}; a warning says so)")
    parser.add_argument("--allow-other-classes", action="store_true",
                        help=f"{other_classes_scope}score the network's own head on a store whose metadata say its "
                             "labels number other classes than the head's outputs (default: refused; a warning says so)")


# --------------------------------------------------------------------------------------------------
# The options every command that has them spells and means the same way (docs/options.md; checked by
# tests/test_options.py): --device, --progress/--no-progress, --memory-budget, and the notice an old
# spelling prints.


def memory_size(text: str) -> int:
    """An argparse ``type`` for ``--memory-budget``: bytes of a size with units (``512MiB``, ``4GiB``,
    ``1.5G``, ``800MB``; a plain number is MiB), :func:`repsim.units.parse_size`."""
    from repsim.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


memory_size.__name__ = "memory size"

MEMORY_HELP = ("the most memory the run may hold: {bounds}; a size with units (512MiB, 4GiB, 1.5G; a plain "
               "number is MiB); default {default}")


def add_memory_budget_option(parser: argparse.ArgumentParser, *, default: int, bounds: str) -> None:
    """``--memory-budget SIZE`` (bytes in ``args.memory_budget``): what it bounds in this command
    (``bounds``) and its default (bytes)."""
    from repsim.engine.options import format_size

    parser.add_argument("--memory-budget", type=memory_size, default=default, metavar="SIZE",
                        help=MEMORY_HELP.format(bounds=bounds, default=format_size(default).replace(" ", "")))


PROGRESS_HELP = "show {what}, or not (default: when stderr is a terminal)"


def add_progress_option(parser: argparse.ArgumentParser, *, what: str = "a progress bar on stderr") -> None:
    """``--progress`` / ``--no-progress`` (``args.progress``: True, False, or None for "when stderr is a
    terminal", :func:`show_progress`)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help=PROGRESS_HELP.format(what=what))


def show_progress(progress: bool | None) -> bool:
    """``--progress``'s value resolved: None (neither flag) means "when stderr is a terminal"."""
    import sys

    return sys.stderr.isatty() if progress is None else bool(progress)


DEVICE_HELP = "auto (default): cuda when a GPU and {package} are usable, else cpu; cpu; {cuda}"


def add_device_option(parser: argparse.ArgumentParser, *, package: str, cuda: str = "cuda: the GPU", **kwargs) -> None:
    """``--device`` with the one default rule, ``auto``: the GPU when one and ``package`` (the library
    the command computes with there: CuPy, PyTorch) are usable, else the CPU. ``cuda``: what the
    command's GPU choices are and do; ``kwargs``: argparse's (``choices`` or ``type``)."""
    if "type" not in kwargs:
        kwargs.setdefault("choices", ("auto", "cpu", "cuda"))
    parser.add_argument("--device", default="auto", help=DEVICE_HELP.format(package=package, cuda=cuda), **kwargs)


class _Deprecated(argparse.Action):
    """An old spelling of an option: stores what the new one would (``convert``ed), and says once on
    stderr what to write instead. Hidden from ``--help``; docs/options.md lists it."""

    def __init__(self, option_strings, dest, *, instead: str, convert: Callable | None = None,
                 append: bool = False, **kwargs) -> None:
        self.instead, self.convert, self.append = instead, convert, append
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import sys

        value = self.const if self.nargs == 0 else values
        if self.convert is not None:
            try:
                value = self.convert(value)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"argument {option_string}: {exc}")
        if self.append:
            value = [*(getattr(namespace, self.dest, None) or []), value]
        shown = values if isinstance(values, str) else " ".join(map(str, values or []))
        print(f"{parser.prog}: {option_string} is deprecated and will be removed; write "
              f"{self.instead.format(value=shown)}", file=sys.stderr)
        setattr(namespace, self.dest, value)


def add_deprecated(parser: argparse.ArgumentParser, old: str, *, dest: str, instead: str, takes_value: bool = True,
                   const=None, convert: Callable | None = None, append: bool = False, metavar: str | None = None,
                   nargs: str | None = None) -> None:
    """Accept ``old`` as a deprecated spelling: it sets ``dest`` (to its value, ``convert``ed, or to
    ``const`` when it takes none) and prints ``PROG: OLD is deprecated ...; write INSTEAD`` (``{value}``
    in ``instead``: the value given)."""
    parser.add_argument(old, dest=dest, action=_Deprecated, instead=instead, convert=convert, append=append,
                        nargs=(nargs if takes_value else 0), const=const, metavar=metavar, default=argparse.SUPPRESS)


def gib_to_bytes(text: str) -> int:
    """``--max-memory``'s old value (GiB, a number > 0) in bytes."""
    return int(positive_float(text) * 2**30)
