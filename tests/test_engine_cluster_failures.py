"""A dask.distributed cluster that fails under a run: workers killed, out of memory, not a scheduler at
all, a store one worker cannot see.  Real clusters (a ``LocalCluster`` scheduler, worker processes
started from the ``dask worker`` command line or by the cluster's nannies), real Zarr stores."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

import repsim.engine.scheduler as sched
from repsim.engine.scheduler import scheduler

distributed = pytest.importorskip("distributed")

HANG_GUARD_S = 120.0  # a generous deadline: only a hang comes near it


def run_guarded(fn: Callable[[], Any], deadline: float = HANG_GUARD_S) -> Any:
    """``fn()`` in a daemon thread; its result, or the exception it raised.  Fails the test when it has
    not returned within ``deadline`` seconds (the old code hung forever in these cases)."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        pytest.fail(f"still waiting after {deadline:.0f} s: the run hangs")
    return out.get("error", out.get("result"))


def start_cli_workers(address: str, n: int) -> list[subprocess.Popen]:
    """``n`` ``dask worker --no-nanny`` processes (one thread each): a killed one stays dead, as a node that
    went down does."""
    cmd = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--no-nanny", "--nthreads", "1",
           "--no-dashboard"]
    return [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def wait_for(condition: Callable[[], bool], what: str, deadline: float = HANG_GUARD_S) -> None:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


def test_workers_lost_after_a_task_finished_end_in_cluster_lost(monkeypatch):
    """Every worker dies after its tasks finished but before the client fetched their results: the
    results are rescheduled, and ``fut.result()`` waited for a worker forever (dist audit, finding 1:
    14 minutes at 0 % CPU).  Now the wait runs the worker check and ends in ClusterLost (exit 3)."""
    from distributed import Client, LocalCluster

    monkeypatch.setattr(sched, "NO_WORKERS_S", 2.0)
    with LocalCluster(n_workers=0, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        procs = start_cli_workers(cluster.scheduler_address, 2)
        try:
            wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, "2 workers")
            killed: list[int] = []

            def on_done(i: int, result: Any) -> None:
                if killed:
                    return
                # the other three results are held by the workers (finished, not fetched yet) ...
                wait_for(lambda: sum(len(k) for k in client.has_what().values()) >= 3, "3 finished tasks")
                for p in procs:  # ... when every worker goes down
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                killed.append(i)

            def run() -> list:
                with scheduler(client):
                    return list(sched.run_tasks(abs, [(-k,) for k in range(4)], on_done=on_done))

            outcome = run_guarded(run)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert killed == [0]
    assert isinstance(outcome, sched.ClusterLost), outcome
    assert "no worker for 2 s" in str(outcome) and "rerun the same command" in str(outcome)
