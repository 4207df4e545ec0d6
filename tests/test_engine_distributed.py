"""The same computations on a real dask.distributed LocalCluster (2 worker processes) as in-process."""
from __future__ import annotations

import numpy as np
import pytest

from repsim.drivers import layer_metrics
from repsim.engine import cka_matrix
from repsim.scheduler import get_client, scheduler, set_scheduler
from test_engine_helpers import correlated_layers, make_store

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       silence_logs=40)
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(0)
    a = make_store(root / "a.zarr", correlated_layers(rng, 180, {"c": (2, 3, 3), "f": (11,)}), chunk_rows=15)
    b = make_store(root / "b.zarr", correlated_layers(rng, 180, {"f": (6,)}), labels=np.arange(180) % 4,
                   chunk_rows=20)
    return [a.path, b.path]


def test_cka_on_local_cluster_equals_threaded(client, stores):
    kw = dict(batch_size=25, epochs=2, seed=4, progress=False, checkpoint_every=2)
    local = cka_matrix(stores, **kw)
    with scheduler(client):
        assert get_client() is client
        remote = cka_matrix(stores, **kw)
    assert get_client() is None
    assert remote.meta["scheduler"].startswith("distributed:") and local.meta["scheduler"] == "threads"
    np.testing.assert_allclose(remote.values, local.values, rtol=1e-12, atol=0)
    # segments are merged in order, so even the per-batch records agree
    np.testing.assert_allclose(remote.state["batches"], local.state["batches"], rtol=1e-12)
    assert remote.meta["n_batches"] == local.meta["n_batches"] == sum(local.meta["batches_per_epoch"])
    assert len(local.meta["batches_per_epoch"]) == 2


def test_drivers_on_local_cluster_equal_threaded(client, stores):
    kw = dict(distances=("cosine", "cosine_centered"), sparsity=True, progress=False, blocks_per_task=3)
    local = layer_metrics(stores, **kw)
    set_scheduler(client)
    try:
        remote = layer_metrics(stores, **kw)
    finally:
        set_scheduler(None)
    assert remote.keys() == local.keys()
    for key in local:
        for d, r2 in local[key]["separation"].items():
            assert remote[key]["separation"][d] == pytest.approx(r2, rel=1e-12)
        assert remote[key]["sparsity"] == local[key]["sparsity"]
