"""Many `repsim extract` commands with one torch import: the demo's extract stage.

    python -m analyses.extract_runs '[[extract args...], ...]'                       # one network, in order
    python -m analyses.extract_runs --jobs N '[["name", [[extract args...], ...]], ...]'   # networks

The second form imports torch once, then forks ``N`` workers (one process each, as `repsim extract
--jobs` does) that take the networks in turn, each running its commands in order; a
line ``@@item <name>: <k> store(s); <s> s`` is printed as each network finishes (the demo turns it
into its progress line).  Each network in a process of its own paid ~4.7 s before its first store on
2 cores (the imports, ~1.8 s, then its datasets and first forward passes), 18 times for the digits
demo.  Stops at the first failing network (its exit status).
"""
from __future__ import annotations

import json
import multiprocessing
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

ITEM = "@@item "  # a finished network's line (analyses.pipeline.run_tasks reads it)


def run_commands(commands: list[list[str]]) -> int:
    """Run the `repsim extract` argument lists in order in this process; the first failure's status."""
    from repsim.commands.main import main as repsim_main

    for command in commands:
        rc = repsim_main(["extract", *command])
        if rc:
            return rc
    return 0


def _network(name: str, commands: list[list[str]]) -> tuple[str, int, int, float]:
    t0 = time.perf_counter()
    rc = run_commands(commands)
    sys.stdout.flush()
    sys.stderr.flush()
    return name, rc, len(commands), time.perf_counter() - t0


def run_networks(networks: list[tuple[str, list[list[str]]]], jobs: int) -> int:
    """Each network's commands (in order) on ``jobs`` forked workers; an ``@@item`` line per finished
    network; the first failing network's status (the networks not yet started are not run)."""
    # torch and the store libraries imported before the fork, so the workers share them (the extractor
    # itself each worker imports once, through the `repsim extract` entry point: analyses names no
    # module of extract, docs/architecture.md "Stage order")
    import torch  # noqa: F401
    import zarr  # noqa: F401

    import repsim.commands.main  # noqa: F401

    jobs = max(1, min(jobs, len(networks)))
    if jobs == 1:
        for name, commands in networks:
            name, rc, k, seconds = _network(name, commands)
            if rc:
                return rc
            print(f"{ITEM}{name}: {k} store(s); {seconds:.0f} s", flush=True)
        return 0
    # fork shares the imports (safe while this process runs no other thread, as extract/cli checks)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1 else "spawn"
    sys.stdout.flush()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(method)) as pool:
        pending = {pool.submit(_network, name, commands) for name, commands in networks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                name, rc, k, seconds = future.result()
                if rc:
                    for other in pending:
                        other.cancel()
                    print(f"extract_runs: {name} failed (exit {rc})", file=sys.stderr, flush=True)
                    return rc
                print(f"{ITEM}{name}: {k} store(s); {seconds:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    jobs = None
    if len(args) == 3 and args[0] == "--jobs":
        jobs, args = int(args[1]), args[2:]
    if len(args) != 1:
        print("usage: python -m analyses.extract_runs [--jobs N] JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    t0 = time.perf_counter()
    if jobs is None:
        rc = run_commands(spec)
        if not rc:
            print(f"{len(spec)} store(s) in {time.perf_counter() - t0:.1f} s", flush=True)
        return rc
    return run_networks([(name, commands) for name, commands in spec], jobs)


if __name__ == "__main__":
    sys.exit(main())
