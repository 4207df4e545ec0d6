"""Several `repsim extract` commands in one process (one torch import), e.g. all store groups of one
network: ``python -m analyses.extract_runs ARGV_JSON``, ``ARGV_JSON`` a JSON list of argument lists
for `repsim extract`. Stops at the first failing command (its exit status); prints one summary line.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from repsim.commands.main import main as repsim_main

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m analyses.extract_runs '[[extract args...], ...]'", file=sys.stderr)
        return 2
    commands = json.loads(args[0])
    t0 = time.perf_counter()
    for command in commands:
        rc = repsim_main(["extract", *command])
        if rc:
            return rc
    print(f"{len(commands)} store(s) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
