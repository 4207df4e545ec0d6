"""Where the engine's tasks run: in this process (default) or on a ``dask.distributed`` cluster.

The engine cuts every computation into independent *tasks* (a range of minibatches of one epoch,
or a range of example blocks of one store); each task opens the stores itself, builds a fresh
accumulator and returns its ``to_state()`` dict.  The caller merges the states **in task order**,
so the result does not depend on where or in which order tasks ran:

- default (``set_scheduler(None)`` / ``"threads"``): tasks run one after the other in this process;
  inside a task, reads run on a thread pool ahead of compute (the engine's threaded mode);
- ``set_scheduler("tcp://host:8786")`` or ``set_scheduler(client)``: tasks are submitted to that
  ``dask.distributed`` cluster (e.g. ``dask_cuda.LocalCUDACluster`` / ``dask cuda worker`` for GPUs),
  at most ``2 × workers`` at a time so that memory stays bounded, and merged as they return.

``repsim cka --scheduler ADDRESS`` and ``--device cuda`` map onto :func:`scheduler` and
:func:`array_module`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

_state = threading.local()
_global: dict[str, Any] = {"client": None}


def set_scheduler(address: Any = None) -> Any:
    """Use a ``dask.distributed`` cluster for the engine's tasks.

    ``address``: ``None``/``"threads"``/``"local"`` (run in this process, the default), a scheduler
    address such as ``"tcp://10.0.0.1:8786"``, or an existing ``distributed.Client``.
    Returns the client in use (or ``None``).
    """
    if _is_local(address):
        _global["client"] = None
        return None
    if isinstance(address, str):
        try:
            from distributed import Client
        except ImportError as exc:  # pragma: no cover - distributed is a dependency
            raise ImportError("--scheduler needs dask.distributed: pip install 'dask[distributed]'") from exc
        client = Client(address)
    else:
        client = address
    _global["client"] = client
    return client


def get_client() -> Any:
    """The ``distributed.Client`` set by :func:`set_scheduler` (or by :func:`scheduler`), else ``None``."""
    return getattr(_state, "client", None) or _global["client"]


def _is_local(address: Any) -> bool:
    return address is None or (isinstance(address, str) and address in ("threads", "local", ""))


@contextlib.contextmanager
def scheduler(address: Any = None) -> Iterator[Any]:
    """``with scheduler(ADDRESS) as client:`` runs the engine's tasks on that cluster inside the
    block (this thread only).  ``ADDRESS``: ``None``/``"threads"`` (local), a scheduler address
    (``tcp://host:8786``; the client made here is closed on exit), ``"local:N"`` (start a
    ``LocalCluster`` of N single-threaded worker processes for the block), or a ``Client``."""
    previous = getattr(_state, "client", None)
    cluster = client = None
    owned = False
    if _is_local(address):
        client = None
    elif isinstance(address, str):
        from distributed import Client, LocalCluster

        if address.startswith("local:"):
            cluster = LocalCluster(n_workers=int(address.split(":", 1)[1]), threads_per_worker=1, processes=True,
                                   dashboard_address=None)
            client = Client(cluster)
        else:
            client = Client(address)
        owned = True
    else:
        client = address
    _state.client = client
    try:
        yield client
    finally:
        _state.client = previous
        if owned:
            client.close()
            if cluster is not None:
                cluster.close()


def run_tasks(fn: Callable[..., Any], args: Sequence[tuple], *, on_done: Callable[[int, Any], None] | None = None,
              max_in_flight: int | None = None) -> Iterator[tuple[int, Any]]:
    """Run ``fn(*args[i])`` for every i and yield ``(i, result)`` **in index order**.

    Locally the calls run one after the other in this thread.  On a distributed client at most
    ``max_in_flight`` (default ``2 × workers``) tasks are outstanding; results that arrive early wait
    until their predecessors are in.  ``on_done(i, result)`` is called as each task finishes
    (progress bars).
    """
    client = get_client()
    if client is None:
        for i, a in enumerate(args):
            result = fn(*a)
            if on_done:
                on_done(i, result)
            yield i, result
        return
    from distributed import as_completed

    n_workers = max(1, len(client.scheduler_info().get("workers", {})))
    limit = max_in_flight or 2 * n_workers
    import uuid

    tag = uuid.uuid4().hex
    futures = {}
    done: dict[int, Any] = {}
    submitted = 0
    next_out = 0
    ac = as_completed()

    def submit() -> None:
        nonlocal submitted
        while submitted < len(args) and submitted - next_out < limit:
            fut = client.submit(fn, *args[submitted], pure=False, key=f"repsim-{getattr(fn, '__name__', 'task')}-{tag}-{submitted}")
            futures[fut.key] = submitted
            ac.add(fut)
            submitted += 1

    submit()
    for fut in ac:
        i = futures.pop(fut.key)
        result = fut.result()
        fut.release()
        if on_done:
            on_done(i, result)
        done[i] = result
        while next_out in done:
            yield next_out, done.pop(next_out)
            next_out += 1
        submit()


def array_module(device: Any = "cpu") -> Any:
    """The array namespace for ``device``: ``"cpu"``/``None`` -> NumPy, ``"cuda"``/``"gpu"`` -> CuPy
    (clear ImportError when CuPy is missing), or an array-API namespace module passed as is
    (e.g. ``array_api_strict``, which the tests use to check that the engine is namespace-agnostic)."""
    if device is None or device == "cpu":
        import numpy

        return numpy
    if isinstance(device, str):
        if device in ("cuda", "gpu"):
            try:
                import cupy
            except ImportError as exc:
                raise ImportError("device='cuda' needs CuPy: pip install 'repsim[gpu]' (cupy-cuda12x)") from exc
            return cupy
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return device


def device_name(xp: Any) -> str:
    name = getattr(xp, "__name__", str(xp))
    return {"numpy": "cpu", "cupy": "cuda"}.get(name, name)
