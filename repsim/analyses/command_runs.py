"""Many `repsim` commands with one torch import: the demo's train and extract stages.

    python -m repsim.analyses.command_runs '[[command args...], ...]'                 # in order, in this process
    python -m repsim.analyses.command_runs --jobs N '[{"name": ..., "commands": [[command args...], ...],
                                                "log": FILE or null}, ...]'     # networks

Each argument list is a `repsim` command line (``["train", "--preset", ...]``, ``["extract", ...]``).
The second form imports torch once, then forks ``N`` workers (one process each, as `repsim extract
--jobs` does) that take the networks in turn, each running its commands in order; as each network
finishes, a line ``@@item {"name": ..., "commands": k, "seconds": s}`` (JSON) is printed, which the
demo turns into its progress line.  A network with a ``log`` writes its output (file descriptors 1 and
2) to that file instead of this process's, so that two workers' lines do not interleave; when it fails,
the file's last lines follow the failure line on stderr.  A network in a process of its own paid
~4.7 s before its first store on 2 cores (the imports, ~1.8 s, then its datasets and first forward
passes), 18 times for the digits demo, and again to train it.  Stops at the first failing network (its
exit status).
"""
from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

ITEM = "@@item "  # a finished network's line, then its JSON (repsim.analyses.pipeline.run_stage reads it)
FAILURE_TAIL = 15  # lines of a failed network's log repeated on stderr


def run_commands(commands: list[list[str]]) -> int:
    """Run the `repsim` argument lists in order in this process; the first failure's status."""
    from repsim.commands.main import main as repsim_main

    for command in commands:
        rc = repsim_main(list(command))
        if rc:
            return rc
    return 0


@contextlib.contextmanager
def _output_to(log: str | None):
    """File descriptors 1 and 2 (Python's and the C libraries' output) into ``log`` meanwhile."""
    if not log:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _network(name: str, commands: list[list[str]], log: str | None) -> tuple[str, int, int, float]:
    t0 = time.perf_counter()
    with _output_to(log):
        try:
            rc = run_commands(commands)
        except BaseException:  # noqa: BLE001 - reported like a failing command, with its traceback in the log
            import traceback

            traceback.print_exc()
            rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return name, rc, len(commands), time.perf_counter() - t0


def _log_tail(log: str | None) -> str:
    if not log or not os.path.isfile(log):
        return ""
    with open(log, errors="replace") as f:
        return "".join(collections.deque(f, maxlen=FAILURE_TAIL))


def run_networks(networks: list[dict], jobs: int) -> int:
    """Each network's commands (in order) on ``jobs`` forked workers; an ``@@item`` line per finished
    network; the first failing network's status (the networks not yet started are not run)."""
    # torch and the store libraries imported before the fork, so the workers share them (the trainer and
    # extractor themselves each worker imports once, through the `repsim` entry points: analyses names no
    # module of train or extract, docs/architecture.md "Stage order")
    import torch  # noqa: F401
    import zarr  # noqa: F401

    import repsim.commands.main  # noqa: F401

    def finished(name: str, rc: int, k: int, seconds: float, log: str | None) -> bool:
        """Print the network's ``@@item`` line (True), or its failure and its log's last lines (False)."""
        if rc:
            print(f"command_runs: {name} failed (exit {rc})" + (f"; the end of {log}:" if log else ""),
                  file=sys.stderr, flush=True)
            tail = _log_tail(log)
            if tail:
                print(tail.rstrip("\n"), file=sys.stderr, flush=True)
            return False
        print(ITEM + json.dumps({"name": name, "commands": k, "seconds": round(seconds, 1)}), flush=True)
        return True

    jobs = max(1, min(jobs, len(networks)))
    if jobs == 1:
        for net in networks:
            name, rc, k, seconds = _network(net["name"], net["commands"], net.get("log"))
            if not finished(name, rc, k, seconds, net.get("log")):
                return rc
        return 0
    # fork shares the imports (safe while this process runs no other thread, as repsim/extract/cli checks)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1 else "spawn"
    sys.stdout.flush()
    logs = {net["name"]: net.get("log") for net in networks}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method)) as pool:
        pending = {pool.submit(_network, net["name"], net["commands"], net.get("log")) for net in networks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                name, rc, k, seconds = future.result()
                if not finished(name, rc, k, seconds, logs[name]):
                    for other in pending:
                        other.cancel()
                    return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    jobs = None
    if len(args) == 3 and args[0] == "--jobs":
        jobs, args = int(args[1]), args[2:]
    if len(args) != 1:
        print("usage: python -m repsim.analyses.command_runs [--jobs N] JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    t0 = time.perf_counter()
    if jobs is None:
        rc = run_commands(spec)
        if not rc:
            print(f"{len(spec)} command(s) in {time.perf_counter() - t0:.1f} s", flush=True)
        return rc
    return run_networks(spec, jobs)


if __name__ == "__main__":
    sys.exit(main())
