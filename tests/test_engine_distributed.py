"""The same computations on a real dask.distributed LocalCluster (2 worker processes) as in-process."""
from __future__ import annotations

import os

import numpy as np
import pytest

from repsim.engine.drivers import layer_metrics
from repsim.engine.minibatch import cka_matrix
from repsim.engine.scheduler import get_client, scheduler, set_scheduler
from test_engine_helpers import correlated_layers, make_store

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    """``set_scheduler("local:2")``: a LocalCluster of 2 single-threaded worker *processes* (the same
    path as ``repsim cka --scheduler local:2``), closed by ``set_scheduler(None)``."""
    c = set_scheduler("local:2")
    try:
        assert len(c.scheduler_info()["workers"]) == 2
        assert all(w["nthreads"] == 1 for w in c.scheduler_info()["workers"].values())
        yield c
    finally:
        set_scheduler(None)
    assert c.status == "closed"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(0)
    a = make_store(root / "a.zarr", correlated_layers(rng, 180, {"c": (2, 3, 3), "f": (11,)}), chunk_rows=15)
    b = make_store(root / "b.zarr", correlated_layers(rng, 180, {"f": (6,)}), labels=np.arange(180) % 4,
                   chunk_rows=20)
    return [a.path, b.path]


def test_cka_on_local_cluster_equals_threaded(client, stores):
    # b is labelled in 4 classes (for the per-layer metrics below), a in 3: the override says they
    # are the same examples all the same
    kw = dict(batch_size=25, epochs=2, seed=4, progress=False, checkpoint_every=2, allow_mixed_datasets=True)
    assert get_client() is client
    with scheduler("threads"):
        assert get_client() is None
        local = cka_matrix(stores, **kw)
    assert get_client() is client
    remote = cka_matrix(stores, **kw)  # on the cluster set by the fixture
    assert remote.meta["scheduler"].startswith("distributed:") and local.meta["scheduler"] == "threads"
    np.testing.assert_allclose(remote.values, local.values, rtol=1e-12, atol=0)
    # segments are merged in order, so even the per-batch records agree
    np.testing.assert_allclose(remote.state["batches"], local.state["batches"], rtol=1e-12)
    assert remote.meta["n_batches"] == local.meta["n_batches"] == sum(local.meta["batches_per_epoch"])
    assert len(local.meta["batches_per_epoch"]) == 2


def test_drivers_on_local_cluster_equal_threaded(client, stores):
    kw = dict(distances=("cosine", "cosine_centered"), sparsity=True, progress=False, blocks_per_task=3)
    remote = layer_metrics(stores, **kw)
    with scheduler(None):
        local = layer_metrics(stores, **kw)
        with scheduler(client):  # an explicit client object
            again = layer_metrics(stores, ["f"], distances=("cosine",), progress=False)
    assert again[("a", "f")]["separation"]["cosine"] == pytest.approx(local[("a", "f")]["separation"]["cosine"],
                                                                      rel=1e-12)
    assert remote.keys() == local.keys()
    for key in local:
        for d, r2 in local[key]["separation"].items():
            assert remote[key]["separation"][d] == pytest.approx(r2, rel=1e-12)
        assert remote[key]["sparsity"] == local[key]["sparsity"]


def test_drivers_send_every_stores_tasks_to_the_cluster_at_once(client, stores, monkeypatch):
    """The per-layer metrics submit the tasks of all stores (and both passes' worth of layers) as one list
    per pass, so that a store of a few tasks does not leave the other workers idle (dist audit, finding 5:
    one store at a time, at most 2 tasks ran on 3 workers); the results are unchanged, and within a
    memory budget too small for both stores' state they go one store at a time again."""
    from repsim.engine import drivers

    submitted: list[list[str]] = []
    real = drivers.run_tasks

    def spy(fn, args, **kw):
        submitted.append([spec["columns"][0]["store"] for spec, *_ in args])
        return real(fn, args, **kw)

    monkeypatch.setattr(drivers, "run_tasks", spy)
    kw = dict(distances=("cosine", "cosine_centered"), sparsity=True, progress=False, blocks_per_task=4)
    remote = layer_metrics(stores, **kw)
    # a: 12 blocks -> 3 tasks, b: 9 blocks -> 3 tasks; cosine_centered re-reads every layer in a second pass
    assert submitted == [["a"] * 3 + ["b"] * 3, ["a"] * 3 + ["b"] * 3]
    with scheduler(None):
        local = layer_metrics(stores, **kw)
    for key in local:
        for d, r2 in local[key]["separation"].items():
            assert remote[key]["separation"][d] == pytest.approx(r2, rel=1e-12)
        assert remote[key]["sparsity"] == local[key]["sparsity"]
    submitted.clear()
    layer_metrics(stores, **kw, memory_budget=1)  # each layer's state alone is over it
    assert [set(s) for s in submitted] == [{"a"}, {"a"}, {"a"}, {"a"}, {"b"}, {"b"}]


def test_tasks_on_a_cluster_size_their_reader_threads_on_their_worker(client, stores, monkeypatch):
    """Reader threads not asked for are left to each worker (a GPU node's cores, not the client's: dist
    audit, finding 7); asked for, they travel in the spec. The results do not depend on it."""
    import numpy

    from repsim.engine import drivers, minibatch
    from repsim.engine.scheduler import reader_threads, task_threads

    sent: list = []
    for module in (drivers, minibatch):
        real = module.run_tasks
        monkeypatch.setattr(module, "run_tasks", lambda fn, args, _real=real, **kw: (
            sent.append(args[0][0]["threads"]), _real(fn, args, **kw))[1])
    layer_metrics(stores, distances=("cosine",), progress=False)
    cka_matrix(stores, batch_size=30, epochs=1, progress=False, allow_mixed_datasets=True)
    layer_metrics(stores, distances=("cosine",), progress=False, threads=3)
    assert sent == [None, None, 3]
    assert task_threads({"threads": None}, numpy) == reader_threads(None, numpy)
    assert task_threads({"threads": 3}, numpy) == 3


def test_a_cluster_without_workers_is_given_up_with_a_clear_error(monkeypatch):
    """A run whose workers had all died (killed, out of memory) waited forever at 0 % CPU, deaf to
    Ctrl-C; it now polls, and after NO_WORKERS_S without a worker raises ClusterLost (exit 3) saying
    that a rerun continues from the checkpoint."""
    from distributed import Client, LocalCluster

    import repsim.engine.scheduler as sched

    monkeypatch.setattr(sched, "NO_WORKERS_S", 1.5)
    monkeypatch.delenv("REPSIM_CLUSTER_LOST_S", raising=False)  # (it would override the 1.5 s)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
        with scheduler(c):
            with pytest.raises(sched.ClusterLost, match=r"no worker for 2 s while 2 task\(s\) wait.*rerun the same"):
                list(sched.run_tasks(abs, [(-1,), (-2,), (-3,)]))  # (2 in flight: twice the one worker counted)
    from repsim.commands.main import EXIT_IO, classify

    assert classify(sched.ClusterLost("x"))[0] == EXIT_IO


def test_exact_estimators_run_in_this_process_and_the_meta_says_so(client, stores):
    """``cka --method exact`` and similarity's exact measures read every column on the client whatever
    ``--scheduler`` says; the meta said the run was distributed (or nothing) and no line told the user
    (dist audit, finding 4).  Now a warning and per-estimator meta."""
    from repsim.engine.minibatch import similarity_matrix

    address = client.scheduler.address
    with pytest.warns(UserWarning, match=r"exact estimator of linear_cka runs in this process, not on the dask"):
        exact = cka_matrix(stores, method="exact", progress=False, allow_mixed_datasets=True)
    assert exact.meta["scheduler"] == "threads" and exact.meta["estimator_schedulers"] == {"exact": "threads"}
    with pytest.warns(UserWarning, match=r"exact estimator of procrustes runs in this process"):
        mixed = similarity_matrix(stores, ["linear_cka", "procrustes"], batch_size=25, epochs=1, progress=False,
                                  allow_mixed_datasets=True)
    assert mixed.meta["scheduler"] == f"distributed:{address}"
    assert mixed.meta["estimator_schedulers"] == {"minibatch": f"distributed:{address}", "exact": "threads"}
    with scheduler(None):
        local = similarity_matrix(stores, ["linear_cka", "procrustes"], batch_size=25, epochs=1, progress=False,
                                  allow_mixed_datasets=True)
    assert local.meta["estimator_schedulers"] == {"minibatch": "threads", "exact": "threads"}


def test_cka_exact_with_a_scheduler_prints_one_warning_line(client, stores, tmp_path, capsys):
    """The CLI through a real scheduler address (the fixture's cluster): one ``WARNING:`` line, exit 0."""
    from repsim.commands.main import main

    out = tmp_path / "cka.npz"
    code = main(["cka", "--method", "exact", *stores, "--allow-mixed-datasets", "--scheduler",
                 client.scheduler.address, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and out.is_file(), err
    lines = [line for line in err.splitlines() if line.startswith("WARNING:")]
    assert len(lines) == 1 and "exact estimator of linear_cka runs in this process" in lines[0], err


@pytest.mark.skipif(not os.path.isdir("/proc/self/cwd"), reason="needs /proc/self/cwd (Linux)")
def test_a_store_a_worker_cannot_see_names_the_worker(client, stores, tmp_path, monkeypatch):
    """``/proc/self/cwd/a.zarr`` is the store on the client (its cwd moved to the store's directory after
    the workers started) and a missing path on the workers (their cwd stayed): a node without the
    shared file system.  The error said ``store a: PATH does not exist`` like a refusal of the client's
    own input (dist audit, finding 9); it now names the worker, and the CLI still exits 2."""
    from repsim.commands.main import EXIT_REFUSED, classify
    from repsim.store.format import StoreError

    worker_cwds = set(client.run(os.getcwd).values())
    monkeypatch.chdir(os.path.dirname(stores[0]))
    assert os.getcwd() not in worker_cwds and not any(os.path.exists(os.path.join(d, "a.zarr")) for d in worker_cwds)
    seen_here = "/proc/self/cwd/a.zarr"
    with pytest.raises(StoreError) as info:
        cka_matrix([seen_here, stores[1]], batch_size=25, epochs=1, progress=False, allow_mixed_datasets=True)
    workers = list(client.scheduler_info()["workers"])
    message = str(info.value)
    assert message.startswith(f"store a: {seen_here} does not exist (raised on dask worker tcp://"), message
    assert any(w in message for w in workers)
    assert "if the client can open this path, that worker cannot" in message
    assert classify(info.value) == (EXIT_REFUSED, message)


def test_the_cluster_lost_wait_is_set_by_an_environment_variable(monkeypatch):
    """``REPSIM_CLUSTER_LOST_S`` shortens (or lengthens) the 120 s without a worker after which a run
    is given up (dist audit, finding 12: a module constant only); a bad value is refused (exit 2)."""
    from distributed import Client, LocalCluster

    import repsim.engine.scheduler as sched

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
        with scheduler(c):
            monkeypatch.setenv("REPSIM_CLUSTER_LOST_S", "1.5")
            with pytest.raises(sched.ClusterLost, match=r"no worker for 2 s while 2 task\(s\) wait.*"
                                                         r"REPSIM_CLUSTER_LOST_S sets how long"):
                list(sched.run_tasks(abs, [(-1,), (-2,)]))
            monkeypatch.setenv("REPSIM_CLUSTER_LOST_S", "soon")
            before = set(c.futures)
            with pytest.raises(ValueError, match=r"^REPSIM_CLUSTER_LOST_S must be a number of seconds > 0, "
                                                 r"got 'soon'$"):
                list(sched.run_tasks(abs, [(-1,)]))
            assert set(c.futures) <= before  # refused before any task was sent
