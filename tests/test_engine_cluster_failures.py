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
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # (not pytest's pipes)
    return [subprocess.Popen(cmd, **quiet) for _ in range(n)]


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
    monkeypatch.delenv("REPSIM_CLUSTER_LOST_S", raising=False)  # (it would override the 2 s)
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
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
    assert len(killed) == 1  # (after the first result fetched, whichever task it was)
    assert isinstance(outcome, sched.ClusterLost), outcome
    assert "no worker for 2 s" in str(outcome) and "rerun the same command" in str(outcome)


WORKER_MEMORY = 600 * 2**20


@pytest.fixture(scope="module")
def small_workers():
    """A LocalCluster of one single-threaded worker process under a nanny with a 600 MiB memory limit;
    the scheduler gives a task up the first time its worker dies (``allowed-failures: 0``, instead of
    3 more workers killed in turn)."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit=WORKER_MEMORY,
                          dashboard_address=":0") as cluster, Client(cluster) as client:
            yield client


def test_a_worker_killed_for_its_memory_is_a_clear_exit_3(small_workers):
    """A task that outgrows its worker's memory limit: the nanny kills the worker and the scheduler
    raises KilledWorker, which ended in exit 70 "internal error; this is a bug in repsim" with a
    traceback (dist audit, finding 2).  Now WorkersKilled, exit 3, naming the limit and what to change."""
    from repsim.commands.main import EXIT_IO, classify

    def greedy() -> float:  # a nested function: pickled by value, nothing to import on the worker
        import time

        import numpy as np

        x = np.ones(2 * WORKER_MEMORY // 8)  # twice the limit, every page written
        time.sleep(60)  # the nanny's memory monitor (every 0.1 s) kills the worker long before
        return float(x[0])

    def run() -> list:
        with scheduler(small_workers):
            return list(sched.run_tasks(greedy, [()]))

    outcome = run_guarded(run)
    assert isinstance(outcome, sched.WorkersKilled), outcome
    code, message = classify(outcome)
    assert code == EXIT_IO
    assert "KilledWorker" in message and "memory limit is 600 MiB" in message
    assert "--memory-limit" in message and "--batch-size" in message


def test_the_drivers_memory_budget_fits_the_workers_memory_limit(small_workers, tmp_path, monkeypatch):
    """The per-layer drivers' accumulator budget (4 GiB by default, chosen on the client) is capped at
    a quarter of the smallest memory limit per worker thread on a cluster (collapse kept a 2 GB scatter
    on 1 GiB workers: dist audit, finding 2); in this process it is unchanged."""
    import numpy as np

    import repsim.engine.drivers as drivers
    from test_engine_helpers import correlated_layers, make_store

    store = make_store(tmp_path / "a.zarr", correlated_layers(np.random.default_rng(0), 60, {"f": (5,), "g": (4,)}),
                       chunk_rows=20)
    budgets: list[int] = []
    original = drivers.group_layers

    def recording(columns, sizes, budget):  # records the budget and groups as ever
        budgets.append(budget)
        return original(columns, sizes, budget)

    monkeypatch.setattr(drivers, "group_layers", recording)
    # (after the test above, the nanny restarts its worker)
    wait_for(lambda: len(small_workers.scheduler_info()["workers"]) == 1, "the worker")
    with scheduler(small_workers):
        remote = drivers.layer_metrics([store.path], distances=("cosine",), progress=False)
    with scheduler(None):
        local = drivers.layer_metrics([store.path], distances=("cosine",), progress=False)
    assert budgets == [WORKER_MEMORY // 4, 4 << 30]
    assert remote[("a", "f")]["separation"]["cosine"] == pytest.approx(local[("a", "f")]["separation"]["cosine"],
                                                                       rel=1e-12)


class _Garbage(__import__("socketserver").BaseRequestHandler):
    """A TCP service that is not dask: it answers every connection with an HTTP error and closes."""

    def handle(self) -> None:
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)


@pytest.fixture(params=["http", "garbage"])
def not_a_scheduler(request, monkeypatch):
    """``tcp://127.0.0.1:PORT`` of a real local server that is not a dask scheduler: an HTTP server
    (it waits for a request line, so the dask handshake waited forever) or one that sends bytes at
    once (read as frame lengths, they made distributed allocate exabytes: MemoryError)."""
    import http.server
    import socketserver

    monkeypatch.setattr(sched, "CONNECT_S", 3.0)
    if request.param == "http":
        server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    else:
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Garbage)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_address_that_is_not_a_scheduler_is_refused_in_time(not_a_scheduler):
    """Connecting to a port where something else listens hung forever (an HTTP server) or crashed with
    MemoryError, exit 70 (dist audit, finding 3); now ConnectionError (exit 3) within the deadline."""
    def connect() -> Any:
        with scheduler(not_a_scheduler):
            return "connected"

    outcome = run_guarded(connect, 60)
    assert isinstance(outcome, ConnectionError), outcome
    assert str(outcome).startswith(f"{not_a_scheduler} is not a dask scheduler (or did not answer in 3 s)")


def test_the_cli_says_which_address_is_not_a_scheduler(not_a_scheduler, tmp_path, capsys):
    """``repsim sparsity --scheduler ADDRESS`` of a non-dask server: one error line, exit 3."""
    import numpy as np

    from repsim.commands.main import EXIT_IO, main
    from test_engine_helpers import correlated_layers, make_store

    store = make_store(tmp_path / "a.zarr", correlated_layers(np.random.default_rng(0), 30, {"f": (4,)}))
    code = run_guarded(lambda: main(["sparsity", store.path, "--scheduler", not_a_scheduler, "--out",
                                     str(tmp_path / "s.csv"), "--no-progress"]), 60)
    err = capsys.readouterr().err
    assert code == EXIT_IO, err
    assert f"repsim sparsity: error: {not_a_scheduler} is not a dask scheduler" in err
    assert "Traceback" not in err and not (tmp_path / "s.csv").exists()


def test_workers_running_another_repsim_are_named_at_connect(tmp_path):
    """A worker whose Python imports another repsim (here a package of another version first on its
    path) was mixed in silently (dist audit, finding 10); connecting now warns, naming it."""
    from distributed import Client, LocalCluster

    other = tmp_path / "other" / "repsim"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('__version__ = "0.0.0+other"\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "other"))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        cmd = [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address, "--no-nanny",
               "--nthreads", "1", "--no-dashboard"]
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            with Client(cluster) as client:
                wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, "2 workers")
                odd = [a for a, pid in client.run(os.getpid).items() if pid == proc.pid]
            with pytest.warns(UserWarning, match=r"^1 of 2 dask worker\(s\) do not run this client's repsim") as rec:
                with scheduler(cluster.scheduler_address):
                    pass
        finally:
            proc.kill()
            proc.wait()
    assert len(odd) == 1 and f"{odd[0]}: repsim 0.0.0+other" in str(rec[0].message)


def test_workers_that_join_a_running_job_get_tasks():
    """The cap on tasks in flight (2 × workers) was fixed from the workers present when the job started
    (dist audit, finding 6): one worker at the start kept it at 2 however many joined.  It now grows
    with the workers: after scaling 1 -> 3, more than 2 tasks are outstanding at once."""
    from distributed import Client, LocalCluster

    def nap(i: int) -> int:
        import time

        time.sleep(0.3)
        return i

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        outstanding: list[int] = []

        def on_done(i: int, result: Any) -> None:
            if i == 0:
                cluster.scale(3)
                wait_for(lambda: len(client.scheduler_info()["workers"]) == 3, "3 workers")
            outstanding.append(sum(1 for k in client.futures if str(k).startswith("repsim-nap-")))

        def run() -> list:
            with scheduler(client):
                return list(sched.run_tasks(nap, [(i,) for i in range(40)], on_done=on_done))

        out = run_guarded(run)
    assert out == [(i, i) for i in range(40)]
    assert max(outstanding) >= 5, outstanding  # (the old cap stayed at 2)


def test_a_tls_scheduler_passes_the_check_with_the_clients_tls_settings(tmp_path):
    """``check_scheduler`` connects with the TLS settings ``Client(address)`` takes from dask's config, so
    a real ``tls://`` scheduler is not refused as 'not a dask scheduler' (review of the connect check)."""
    import shutil

    import dask
    from distributed import Client, LocalCluster
    from distributed.security import Security

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    key, pem = tmp_path / "tls.key", tmp_path / "tls.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(pem)], check=True, capture_output=True, timeout=60)
    tls = {"distributed.comm.tls.ca-file": str(pem),
           **{f"distributed.comm.tls.{role}.{what}": str(path) for role in ("scheduler", "worker", "client")
              for what, path in (("cert", pem), ("key", key))}}
    with dask.config.set(tls), LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tls://",
                                             security=Security(), dashboard_address=":0") as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        run_guarded(lambda: sched.check_scheduler(cluster.scheduler_address, timeout=20))
        with scheduler(cluster.scheduler_address) as client:
            assert isinstance(client, Client) and client.submit(abs, -3).result() == 3


def test_a_rerun_after_a_lost_cluster_computes_the_uninterrupted_numbers(tmp_path, monkeypatch):
    """Every worker dies right after the client checkpointed its second segment (a known point: inside
    that save): the run ends in ClusterLost with the finished segments in its checkpoint, and a rerun in
    this process continues from them to the same values and per-batch records as a run never
    interrupted (workers without a nanny inherit this process's BLAS threads: the same sums)."""
    import numpy as np
    from distributed import Client, LocalCluster

    import repsim
    from repsim.engine.checkpoint import Checkpoint
    from test_engine_helpers import checkpoint_segments, correlated_layers, make_store

    rng = np.random.default_rng(4)
    stores = [make_store(tmp_path / f"{name}.zarr", {k: v.astype(np.float32) for k, v in
                                                     correlated_layers(rng, 240, {"a": (12,), "b": (30,)}).items()},
                         chunk_rows=20) for name in ("x", "y")]
    kw = dict(batch_size=20, epochs=3, seed=5, progress=False, checkpoint_every=1)
    whole = repsim.cka_matrix(stores, checkpoint=tmp_path / "whole.ckpt.npz", **kw)
    segments = checkpoint_segments(tmp_path / "whole.ckpt.npz")
    # run_tasks keeps at most 2 × workers = 4 segments in flight beyond the last one handed on, so when
    # the second is saved at most 5 were ever sent: with 6 or more, some segment is certainly left for
    # the dead cluster (with 4, all had been fetched at times, and the run ended normally)
    assert segments >= 6, segments
    ckpt = tmp_path / "lost.ckpt.npz"
    monkeypatch.setattr(sched, "NO_WORKERS_S", 2.0)
    monkeypatch.delenv("REPSIM_CLUSTER_LOST_S", raising=False)
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster, Client(cluster) as client:
        procs = start_cli_workers(cluster.scheduler_address, 2)
        try:
            wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, "2 workers")
            save = Checkpoint.save

            def save_then_lose_the_cluster(self, done, state):
                save(self, done, state)
                if done == 2:
                    for p in procs:
                        p.send_signal(signal.SIGKILL)
                        p.wait()

            monkeypatch.setattr(Checkpoint, "save", save_then_lose_the_cluster)

            def run():
                with scheduler(client):
                    return repsim.cka_matrix(stores, checkpoint=ckpt, **kw)

            outcome = run_guarded(run)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    monkeypatch.setattr(Checkpoint, "save", save)
    # Which error ends the run depends on whether a segment was running when the workers died (then
    # dask counts a killed worker: WorkersKilled) or not (no workers within NO_WORKERS_S: ClusterLost);
    # both keep the finished segments, which is what this test is about.
    assert isinstance(outcome, (sched.ClusterLost, sched.WorkersKilled)), outcome
    done = checkpoint_segments(ckpt)
    assert 2 <= done < segments, done  # (results already fetched when the workers died are saved too)
    resumed = repsim.cka_matrix(stores, checkpoint=ckpt, **kw)
    np.testing.assert_array_equal(resumed.values, whole.values)
    np.testing.assert_array_equal(resumed.state["batches"], whole.state["batches"])
