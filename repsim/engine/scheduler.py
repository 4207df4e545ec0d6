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

import os

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from repsim.array_api import array_namespace, is_cupy_namespace

_state = threading.local()
_LOCAL = object()  # "run here", set by scheduler(None) inside this thread
_global: dict[str, Any] = {"client": None, "owned": None}


def _is_local(address: Any) -> bool:
    return address is None or (isinstance(address, str) and address in ("threads", "local", ""))


def local_workers(address: str) -> int | None:
    """N of a ``local:N`` address (None for any other address); ``ValueError`` unless N >= 1 (``local:0``
    would wait forever for a worker)."""
    if not address.startswith("local:"):
        return None
    n = address.split(":", 1)[1]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"local:N needs N >= 1 worker processes, got {address!r}")
    return int(n)


def _connect(address: str) -> tuple[Any, Any]:
    """``(client, cluster or None)`` for a scheduler address or ``local:N``."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:  # pragma: no cover - distributed is a dependency
        raise ImportError("a scheduler address needs dask.distributed: pip install 'dask[distributed]'") from exc
    n = local_workers(address)
    if n is not None:
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0")
        return Client(cluster), cluster
    check_scheduler(address)
    client = Client(address, timeout=connect_s())
    check_worker_versions(client)
    return client, None


CONNECT_S: float | None = None  # how long connecting may take, handshake included (None: dask's config)


def connect_s() -> float:
    """Seconds a connection to a scheduler may take: :data:`CONNECT_S` when set, else dask's
    ``distributed.comm.timeouts.connect`` (30 s by default), as ``Client(address)`` uses."""
    if CONNECT_S is not None:
        return float(CONNECT_S)
    import dask
    from dask.utils import parse_timedelta

    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect", "30s"), default="seconds"))


def check_scheduler(address: str, timeout: float | None = None) -> None:
    """Raise ``ConnectionError`` unless ``address`` answers as a dask scheduler within ``timeout``
    seconds (default :func:`connect_s`): distributed's ``Client`` bounds only the TCP connect, so an
    HTTP server on that port (a dashboard's :8787) kept it waiting forever for a handshake, and a
    server that answered with other bytes made it allocate exabytes (MemoryError, exit 70; dist
    audit, finding 3).  An address nothing listens on keeps distributed's own clear message
    ("Timed out trying to connect to ... after 30 s")."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from distributed.comm import connect
    from distributed.security import Security

    timeout = connect_s() if timeout is None else float(timeout)
    # tls:// addresses: the client's TLS settings from dask's config, as Client(address) takes them
    tls = Security().get_connection_args("client")

    async def identity() -> Any:
        comm = await connect(address, timeout=timeout, **tls)  # (its handshake read has no deadline)
        try:
            await comm.write({"op": "identity"})
            return await comm.read()
        finally:
            comm.abort()

    def ask() -> Any:
        return asyncio.run(asyncio.wait_for(identity(), timeout + 1.0))

    # on a thread of its own: a fresh event loop, also when the caller's thread runs one (Jupyter)
    with ThreadPoolExecutor(1, thread_name_prefix="repsim-connect") as pool:
        try:
            info = pool.submit(ask).result()
        except (TimeoutError, asyncio.TimeoutError):
            info = None
        except OSError as exc:
            if str(exc).startswith("Timed out trying to connect"):  # nothing listens there: already clear
                raise
            info = None
        except Exception:  # noqa: BLE001 - bytes that are not dask's protocol (MemoryError, decode errors)
            info = None
    if not (isinstance(info, dict) and "Scheduler" in str(info.get("type", ""))):  # (subclasses: "MyScheduler")
        raise ConnectionError(f"{address} is not a dask scheduler (or did not answer in {timeout:.0f} s): give "
                              "the address `dask scheduler` prints (port 8786 by default; its dashboard, 8787, "
                              "is not it)")


# the workers' repsim version: a lambda, so that cloudpickle sends it by value and a worker without
# repsim answers with its ImportError instead of failing to unpickle the function
_WORKER_REPSIM = lambda: __import__("repsim").__version__  # noqa: E731


def check_worker_versions(client: Any) -> dict[str, str]:
    """Warn (one ``WARNING:`` line from the CLI) when workers of ``client``'s cluster run another repsim
    version than this process, or none: their tasks then fail (a worker without repsim dies unpickling
    one, and the run goes on silently on the others) or compute with other code (dist audit, finding
    10).  Returns ``{worker: what it runs}`` of the mismatching workers.  The package records no git
    commit, so two checkouts of the same version are not told apart."""
    import warnings

    from repsim import __version__

    try:
        found = client.run(_WORKER_REPSIM, on_error="return")
    except Exception:  # noqa: BLE001 - a check only: the run itself reports a cluster that does not answer
        return {}
    bad = {}
    for address, version in found.items():
        if isinstance(version, ImportError):
            bad[address] = "no repsim"
        elif isinstance(version, BaseException):
            bad[address] = f"repsim not importable ({type(version).__name__})"
        elif version != __version__:
            bad[address] = f"repsim {version}"
    if bad:
        listed = "; ".join(f"{a}: {what}" for a, what in sorted(bad.items()))
        warnings.warn(f"{len(bad)} of {len(found)} dask worker(s) do not run this client's repsim {__version__} "
                      f"({listed}): their tasks fail or compute with other code; install the same repsim on every "
                      "node", UserWarning, stacklevel=2)
    return bad


def _close(owned: Any) -> None:
    if owned:
        client, cluster = owned
        client.close()
        if cluster is not None:
            cluster.close()


def set_scheduler(address: Any = None) -> Any:
    """Run the engine's tasks on a ``dask.distributed`` cluster from now on (process-wide).

    ``address``: ``None``/``"threads"`` (in this process, the default), a scheduler address such as
    ``"tcp://10.0.0.1:8786"``, ``"local:N"`` (start a ``LocalCluster`` of N single-threaded worker
    processes), or an existing ``distributed.Client``.  A client or cluster created here is closed
    by the next ``set_scheduler`` call.  Returns the client in use (or ``None``).
    """
    _close(_global["owned"])
    _global["owned"] = None
    if _is_local(address):
        _global["client"] = None
    elif isinstance(address, str):
        client, cluster = _connect(address)
        _global["client"], _global["owned"] = client, (client, cluster)
    else:
        _global["client"] = address
    return _global["client"]


def get_client() -> Any:
    """The client of the innermost :func:`scheduler` block of this thread, else the one set by
    :func:`set_scheduler`; ``None`` means "run in this process"."""
    value = getattr(_state, "client", None)
    if value is None:
        return _global["client"]
    return None if value is _LOCAL else value


@contextlib.contextmanager
def scheduler(address: Any = None) -> Iterator[Any]:
    """``with scheduler(ADDRESS) as client:`` runs the engine's tasks there inside the block (this
    thread only; it overrides :func:`set_scheduler`).  ``ADDRESS`` as for :func:`set_scheduler`;
    a client or cluster made here is closed on exit.  ``scheduler(None)`` runs in this process."""
    previous = getattr(_state, "client", None)
    owned = None
    if _is_local(address):
        client, value = None, _LOCAL
    elif isinstance(address, str):
        client, cluster = _connect(address)
        owned, value = (client, cluster), client
    else:
        client = value = address
    _state.client = value
    try:
        yield client
    finally:
        _state.client = previous
        _close(owned)


def scheduled(stream: Any) -> contextlib.AbstractContextManager:
    """The scheduler block of a run's :class:`~repsim.engine.options.StreamOptions`: ``scheduler(address)``
    for its ``scheduler``, else nothing (the client of an enclosing block or :func:`set_scheduler` stays)."""
    address = getattr(stream, "scheduler", None)
    return contextlib.nullcontext() if address is None else scheduler(address)


def run_tasks(fn: Callable[..., Any], args: Sequence[tuple], *, on_done: Callable[[int, Any], None] | None = None,
              max_in_flight: int | None = None) -> Iterator[tuple[int, Any]]:
    """Run ``fn(*args[i])`` for every i and yield ``(i, result)`` **in index order**.

    Locally the calls run one after the other in this thread.  On a distributed client at most
    ``max_in_flight`` (default ``2 × workers``, recounted as workers join or leave) tasks are
    outstanding; results that arrive early wait until their predecessors are in.  ``on_done(i, result)``
    is called as each task finishes (progress bars).
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

    import uuid

    tag = uuid.uuid4().hex
    futures = {}
    done: dict[int, Any] = {}
    submitted = 0
    next_out = 0
    ac = as_completed()

    def submit() -> None:
        nonlocal submitted
        # 2 × the workers there now: recounted by the watch (once a second), so workers that join a
        # running job (an adaptive cluster, a queue that starts them late) get tasks too
        limit = max_in_flight or 2 * max(1, watch.workers)
        while submitted < len(args) and submitted - next_out < limit:
            fut = client.submit(_on_worker, fn, *args[submitted], pure=False,
                                key=f"repsim-{getattr(fn, '__name__', 'task')}-{tag}-{submitted}")
            futures[fut.key] = submitted
            ac.add(fut)
            submitted += 1

    watch = _WorkerWatch(client)  # (first: it refuses a bad $REPSIM_CLUSTER_LOST_S before any task is sent)
    submit()
    while futures:
        ready = ac.next_batch(block=False) if ac.has_ready() else []
        if not ready:  # poll (Ctrl-C reaches this thread) and notice a cluster that lost every worker
            watch.check(len(futures))
            time.sleep(POLL_S)
            continue
        for fut in ready:
            i = futures.pop(fut.key)
            result = _result(fut, watch, len(futures) + 1)
            fut.release()
            if on_done:
                on_done(i, result)
            done[i] = result
        while next_out in done:
            yield next_out, done.pop(next_out)
            next_out += 1
        watch.check(len(futures))
        submit()


def _on_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` as a task on a dask worker: an expected failure (``OSError``, ``ValueError``,
    ``KeyError``: the one-line errors of the CLI) comes back naming the worker it was raised on
    (:func:`name_worker`), so that a store one node cannot see no longer reads like a refusal of
    the client's own input (dist audit, finding 9)."""
    try:
        return fn(*args)
    except (OSError, ValueError, KeyError) as exc:
        name_worker(exc)
        raise


def name_worker(exc: BaseException) -> BaseException:
    """Add ``(raised on dask worker ADDRESS, host HOST...)`` to ``exc``'s message, in place and so
    that it survives pickling back to the client (an ``OSError``'s ``strerror`` and ``args``, other
    exceptions' first argument when it is a string).  A missing path adds that every worker must see
    the paths the client opens (the stores' were checked there before any task was sent; a missing
    file inside a store is worded so as not to claim the client has it)."""
    import socket

    try:
        from distributed import get_worker

        address = get_worker().address
    except (ImportError, ValueError):  # not on a worker
        address = "?"
    where = f"raised on dask worker {address}, host {socket.gethostname()}"
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc.args[0]) if exc.args else ""
    if isinstance(exc, FileNotFoundError) or "does not exist" in text:
        where += ("; if the client can open this path, that worker cannot: every worker must see the stores at "
                  "the client's paths (a shared file system mounted at the same place)")
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        exc.strerror = f"{exc.strerror} ({where})"
        exc.args = (exc.errno, exc.strerror) + tuple(exc.args[2:])
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({where})",) + tuple(exc.args[1:])
    return exc


POLL_S = 0.05
RESULT_WAIT_S = 1.0  # how long one wait for a finished task's result lasts before the workers are checked
NO_WORKERS_S = 120.0  # how long a cluster may have no worker at all before the run is given up
CLUSTER_LOST_ENV = "REPSIM_CLUSTER_LOST_S"  # ... set in seconds by this environment variable


def cluster_lost_s() -> float:
    """Seconds a cluster may have no worker while tasks wait before :class:`ClusterLost`:
    ``$REPSIM_CLUSTER_LOST_S`` when set (shorter for a batch job that should fail fast, longer for
    workers that a queue may take a while to restart), else :data:`NO_WORKERS_S` (120)."""
    text = os.environ.get(CLUSTER_LOST_ENV, "").strip()
    if not text:
        return float(NO_WORKERS_S)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{CLUSTER_LOST_ENV} must be a number of seconds > 0, got {text!r}")
    return value


class ClusterLost(ConnectionError):
    """The dask cluster lost every worker while tasks waited (an I/O failure to the CLI: exit 3)."""


def _result(fut: Any, watch: "_WorkerWatch", waiting: int) -> Any:
    """A finished future's result, waited for in steps of :data:`RESULT_WAIT_S` with the worker check
    between them: a result whose worker died before the client fetched it is recomputed, and when
    every worker is gone that wait never ended (``fut.result()`` at 0 % CPU for 14 minutes, dist
    audit); now :class:`ClusterLost` ends it as it ends a wait for running tasks."""
    from distributed import KilledWorker

    while True:
        try:
            return fut.result(timeout=RESULT_WAIT_S)
        except TimeoutError:  # (an OSError: a task that raised one has status "error")
            if fut.status == "error":  # the task's own error, not this wait's timeout (which may race it)
                return fut.result()
            watch.check(waiting)
        except KilledWorker as exc:
            raise WorkersKilled(killed_message(watch.limits, exc)) from None


class WorkersKilled(ConnectionError):
    """A task's workers died while running it, as many times as the scheduler allows (distributed's
    ``KilledWorker``; most often the nanny killed them for exceeding their memory limit).  An I/O /
    cluster failure to the CLI, as :class:`ClusterLost`: exit 3, not "a bug in repsim"."""


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _workers(client: Any) -> dict[str, dict[str, Any]] | None:
    """The scheduler's ``{address: worker info}`` now (None when it does not answer)."""
    try:
        try:  # every worker: distributed 2025.4-2026.6 list 5 by default
            info = client.scheduler_info(n_workers=-1)
        except TypeError:  # before 2025.4: every worker, and no such argument
            info = client.scheduler_info()
        return dict(info.get("workers", {}))
    except Exception:  # noqa: BLE001 - a scheduler that does not answer: the callers decide
        return None


def worker_memory_limits(workers: dict[str, dict[str, Any]] | None) -> dict[str, tuple[int, int]]:
    """``{worker address: (memory limit in bytes, threads)}`` of the scheduler's ``workers``
    (:func:`_workers`); a limit of 0 means none (``dask worker --memory-limit 0``)."""
    return {addr: (int(w.get("memory_limit") or 0), max(1, int(w.get("nthreads") or 1)))
            for addr, w in (workers or {}).items()}


def killed_message(limits: dict[str, tuple[int, int]], exc: BaseException) -> str:
    """One line for distributed's ``KilledWorker``: what happened, the memory limits of the workers
    seen during the run (``limits``, :func:`worker_memory_limits`; the killed ones may not be back
    yet), and what to change."""
    task = getattr(exc, "task", "?")
    tries = getattr(exc, "allowed_failures", None)
    tries = "" if tries is None else f" {tries + 1} time(s)"
    sizes = sorted({lim for lim, _ in limits.values() if lim})
    limit = (f"the workers' memory limit is {' / '.join(_size(v) for v in sizes)}" if sizes
             else "the workers report no memory limit")
    return (f"dask workers died{tries} while running task {task} (KilledWorker: most likely killed for exceeding "
            f"their memory limit, which their logs would say); {limit}: start the workers with more "
            "memory (dask worker --memory-limit, fewer --nworkers or --nthreads per node), or make the tasks "
            "smaller (a smaller --batch-size, --spatial mean, fewer --layers per run); a cka run's finished "
            "segments are in its checkpoint: rerunning the same command continues from them")


MEMORY_SHARE = 0.25  # of a worker thread's memory limit that one task's accumulator state may take


def capped_budget(budget: int) -> int:
    """``budget`` (bytes of accumulator state a task may hold, chosen on the client), at most
    :data:`MEMORY_SHARE` of the smallest memory limit per worker thread of the cluster in use: a task
    holds that state about three times over (the empty templates it is sent, the filled accumulators,
    their serialised result), next to its input blocks.  Unchanged in this process or when no worker
    reports a limit."""
    client = get_client()
    if client is None:
        return int(budget)
    shares = [lim // threads for lim, threads in worker_memory_limits(_workers(client)).values() if lim]
    if not shares:
        return int(budget)
    return max(1, min(int(budget), int(MEMORY_SHARE * min(shares))))


class _WorkerWatch:
    """Raise when the cluster has had no worker for :func:`cluster_lost_s` seconds while tasks wait:
    a run whose workers all died (killed, out of memory) waited forever at 0 % CPU (resume audit);
    finished segments are in the checkpoint, so a rerun continues from them."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.since: float | None = None
        self.last = 0.0
        info = _workers(client)
        self.workers = len(info or {})  # the workers there at the last check
        self.limits = worker_memory_limits(info)  # every worker seen: (memory limit, threads)
        self.give_up_s = cluster_lost_s()

    def check(self, waiting: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:  # (the scheduler is asked once a second)
            return
        self.last = now
        info = _workers(self.client)  # a scheduler that does not answer is a failure too
        workers = self.workers = len(info or {})
        self.limits.update(worker_memory_limits(info))
        if workers:
            self.since = None
            return
        self.since = self.since if self.since is not None else now
        if now - self.since >= self.give_up_s:
            raise ClusterLost(
                f"the dask cluster has had no worker for {self.give_up_s:.0f} s while {waiting} task(s) wait "
                "(workers killed or out of memory?); finished segments are in the checkpoint: rerun the same "
                f"command to continue from them ({CLUSTER_LOST_ENV} sets how long to wait)")


# the extras of pyproject.toml that install CuPy: its wheels are built per CUDA major version
CUDA_NEEDS_CUPY = ("device='cuda' needs CuPy, which is not installed: pip install 'repsim-toolkit[gpu-cuda13]' "
                   "on CUDA 13, 'repsim-toolkit[gpu-cuda12]' (or '[gpu]') on CUDA 12 (`nvidia-smi` prints the "
                   "driver's CUDA Version)")


def cuda_usable() -> bool:
    """Can the engine run on a GPU here: CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no"
        return False


def resolve_device(device: Any) -> Any:
    """``"auto"`` -> ``"cuda"`` when :func:`cuda_usable`, else ``"cpu"`` (the ``--device`` default of every
    command, repsim.commands.args.add_device_option); any other value as it is."""
    if isinstance(device, str) and device == "auto":
        return "cuda" if cuda_usable() else "cpu"
    return device


def array_module(device: Any = "cpu") -> Any:
    """The array namespace for ``device``: ``"cpu"``/``None`` -> NumPy, ``"cuda"``/``"gpu"`` -> CuPy
    (through :func:`repsim.array_api.array_namespace`, which fills CuPy <= 13's missing array-API names;
    clear ImportError naming the extras when CuPy is missing), ``"auto"`` -> CuPy when
    :func:`cuda_usable`, else NumPy, or an array-API namespace module passed as is
    (e.g. ``array_api_strict``, which the tests use to check that the engine is namespace-agnostic)."""
    device = resolve_device(device)
    if device is None or device == "cpu":
        import numpy

        return numpy
    if isinstance(device, str):
        if device in ("cuda", "gpu"):
            try:
                import cupy
            except ImportError as exc:
                raise ImportError(CUDA_NEEDS_CUPY) from exc
            # CuPy <= 13 lacks a few array-API names the engine calls (concat, astype, ...):
            # hand out the same filled namespace as its arrays get (repsim.array_api._cupy_namespace)
            return array_namespace(xp=cupy)
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return device


def reader_threads(threads: int | None, xp: Any) -> int:
    """Reader threads of a streaming run: ``threads`` when given, else 2 on the CPU (where the reader
    threads are also the compute parallelism and the BLAS budget is shared with them) and one per
    core, at most 16, when the kernels run on a device: decoding the stores' chunks on the CPU is
    then what bounds the run (bench/RESULTS.md "gpu")."""
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return int(threads)
    if getattr(xp, "__name__", "") == "numpy":
        return 2
    return max(2, min(16, os.cpu_count() or 2))


def spec_threads(threads: int | None, xp: Any) -> int | None:
    """The reader threads a task spec carries: :func:`reader_threads` resolved here, except on a
    ``dask.distributed`` cluster when none were asked for: then None, which each task resolves on its
    own worker (:func:`task_threads`; a GPU node's cores, not the client's)."""
    if threads is None and get_client() is not None:
        return None
    return reader_threads(threads, xp)


def task_threads(spec: dict[str, Any], xp: Any) -> int:
    """A task's reader threads: its spec's, else :func:`reader_threads` of the machine it runs on."""
    return reader_threads(spec.get("threads"), xp)


def device_name(xp: Any) -> str:
    if is_cupy_namespace(xp):  # cupy, array_api_compat.cupy, repsim.array_api.cupy
        return "cuda"
    name = getattr(xp, "__name__", str(xp))
    return "cpu" if name == "numpy" else name
