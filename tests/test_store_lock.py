"""One writer per store (repsim/store/lock.py): a second writer of a store path is refused at once,
naming the holder; a killed holder leaves no lock; threads of one process are kept apart too.

Holders are real processes (``python -c`` holding ``lock_store``, forked children, ``python -m
repsim.extract`` stopped with SIGSTOP mid-run); the extraction tests need torch and run on the CPU.
"""
from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from repsim.store import lock as lockmod
from repsim.store.lock import StoreLocked, lock_path, lock_store
from repsim.store.reader import open_store
from repsim.store.writer import save_store
from test_engine_helpers import wait_until_stopped

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

HOLDER = """
import sys
from repsim.store.lock import lock_store
lock = lock_store(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin
lock.release()
"""


class Holder:
    """A process holding the lock of ``path`` until :meth:`stop` (or a SIGKILL)."""

    def __init__(self, path: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        line = self.proc.stdout.readline()
        assert line.strip() == "locked", self.proc.stderr.read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0, self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.returncode == -signal.SIGKILL


def refused_elsewhere(path: Path) -> bool:
    """Whether another process is refused the lock of ``path`` now (True) or gets it (False)."""
    code = ("import sys\nfrom repsim.store.lock import StoreLocked, lock_store\n"
            "try:\n    lock_store(sys.argv[1]).release()\nexcept StoreLocked:\n    sys.exit(9)\n")
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode in (0, 9), run.stderr
    return run.returncode == 9


def _save(path: Path, **kw):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    return save_store(path, {"a": x}, np.zeros(20, np.int32), np.arange(20), meta={"dataset": {"name": "t"}},
                      chunk_rows=8, progress=False, **kw)


# ----------------------------------------------------------------------------------- processes


def test_a_second_process_is_refused_at_once_naming_the_holder(tmp_path, monkeypatch):
    store = tmp_path / "s.zarr"
    holder = Holder(store)
    try:
        assert Path(lock_path(store)) == tmp_path / ".s.zarr.lock" and (tmp_path / ".s.zarr.lock").exists()
        # "at once" without a clock: the one lock attempt is non-blocking (LOCK_NB) and it is the kernel's
        # refusal of that attempt (EAGAIN / EACCES) that is reported, not a wait or a retry loop
        calls: list = []
        real_lockf = lockmod.fcntl.lockf

        def spy(fd, op, *rest):
            calls.append(op)
            try:
                return real_lockf(fd, op, *rest)
            except OSError as exc:
                calls.append(exc.errno)
                raise

        monkeypatch.setattr(lockmod.fcntl, "lockf", spy)
        with pytest.raises(StoreLocked) as info:
            lock_store(store, instead="choose another --out")
        monkeypatch.undo()
        assert len(calls) == 2 and calls[0] == lockmod.fcntl.LOCK_EX | lockmod.fcntl.LOCK_NB, calls
        assert calls[1] in (errno.EAGAIN, errno.EACCES), calls
        msg = str(info.value)
        assert "\n" not in msg
        assert msg.startswith(f"store s: {store} is being written by another process (pid {holder.pid} on host "
                              f"{socket.gethostname()}, since ")
        assert "python -c" in msg and str(store) in msg.split("since", 1)[1]  # its command line
        assert msg.endswith("wait for it to finish (a rerun then resumes it or finds it complete), or choose "
                            "another --out")
        assert not store.exists()  # the lock exists before the store does; nothing else was made
        with pytest.raises(StoreLocked, match=f"pid {holder.pid}"):  # still held: a refusal releases nothing
            lock_store(store)
    finally:
        holder.stop()
    assert not (tmp_path / ".s.zarr.lock").exists()  # released and removed
    with lock_store(store) as lock:
        assert lock.held and lock.file == str(tmp_path / ".s.zarr.lock")
        assert refused_elsewhere(store)
    assert not lock.held and not refused_elsewhere(store)


def test_a_sigkilled_holder_leaves_no_lock(tmp_path):
    store = tmp_path / "s.zarr"
    holder = Holder(store)
    assert refused_elsewhere(store)
    holder.kill()
    assert (tmp_path / ".s.zarr.lock").exists()  # the file stays behind, but nobody holds it
    with lock_store(store) as lock:  # at once: no staleness guess, no timeout
        assert lock.held and refused_elsewhere(store)
    assert not (tmp_path / ".s.zarr.lock").exists()


def test_two_names_of_one_store_share_its_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    holder = Holder(tmp_path / "real" / "s.zarr")
    try:
        with pytest.raises(StoreLocked, match=f"pid {holder.pid}"):
            lock_store(tmp_path / "alias" / "s.zarr")
        with lock_store(tmp_path / "real" / "other.zarr"):  # another store beside it is free
            pass
    finally:
        holder.stop()


def test_the_path_must_still_name_the_locked_file(tmp_path, monkeypatch):
    """A releasing holder unlinks the lock file; a writer that opened it just before and locks it just
    after holds a lock on a file nobody else will open: it must notice and lock the new file."""
    store = tmp_path / "s.zarr"
    file = tmp_path / ".s.zarr.lock"
    real = lockmod.fcntl.lockf
    calls = []

    def lockf(fd, how):  # between this process's open and lock, another one releases and a third recreates
        if not calls:
            os.unlink(file)
            file.write_text("")
        calls.append(fd)
        return real(fd, how)

    monkeypatch.setattr(lockmod.fcntl, "lockf", lockf)
    with lock_store(store) as lock:
        assert len(calls) == 2  # the first lock landed on the unlinked file: tried again
        assert os.stat(file).st_ino == lock._inode[1]
        monkeypatch.setattr(lockmod.fcntl, "lockf", real)
        assert refused_elsewhere(store)  # the file at the path is the locked one


def _child_tries(path: str, out: multiprocessing.Queue) -> None:
    try:
        lock_store(path).release()
        out.put("got it")
    except StoreLocked as exc:
        out.put(str(exc))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_holds_nothing_and_releases_nothing(tmp_path):
    """Record locks are not inherited: a forked child (a DataLoader worker) is refused by the kernel,
    as another process, and its exit (closing the inherited descriptor) leaves the parent's lock held."""
    store = tmp_path / "s.zarr"
    with lock_store(store):
        out: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
        child = multiprocessing.get_context("fork").Process(target=_child_tries, args=(str(store), out))
        child.start()
        msg = out.get(timeout=60)
        child.join(timeout=60)
        assert f"another process (pid {os.getpid()} on host" in msg, msg
        assert refused_elsewhere(store)


# ----------------------------------------------------------------------------------- one process


def test_threads_of_one_process_are_refused_and_release_nothing(tmp_path):
    """POSIX record locks are per process: without the in-process guard a second thread would be granted
    the lock, and its closing the file would drop the first thread's lock."""
    store = tmp_path / "s.zarr"
    got: list[object] = []
    held = threading.Event()
    done = threading.Event()

    def first() -> None:
        with lock_store(store):
            held.set()
            done.wait(60)

    t = threading.Thread(target=first, name="extract-job_0")
    t.start()
    try:
        assert held.wait(60)

        def second() -> None:
            try:
                got.append(lock_store(store))
            except StoreLocked as exc:
                got.append(exc)

        s = threading.Thread(target=second)
        s.start()
        s.join(60)
        assert isinstance(got[0], StoreLocked), got
        assert f"another thread of this process (pid {os.getpid()}, thread 'extract-job_0', since " in str(got[0])
        assert refused_elsewhere(store)  # the refused thread did not drop the holder's lock
    finally:
        done.set()
        t.join(60)
    with lock_store(store):
        pass


def test_not_reentrant_in_one_thread_either(tmp_path):
    store = tmp_path / "s.zarr"
    with lock_store(store):
        with pytest.raises(StoreLocked, match="another thread of this process"):
            lock_store(store)
        assert refused_elsewhere(store)


def test_without_fcntl_processes_are_not_kept_apart_but_nothing_fails(tmp_path, monkeypatch):
    store = tmp_path / "s.zarr"
    monkeypatch.setattr(lockmod, "fcntl", None)
    with lock_store(store) as lock:
        assert lock.file is None and not (tmp_path / ".s.zarr.lock").exists()
        assert not refused_elsewhere(store)  # (the other process has fcntl: nothing here to exclude it)
        with pytest.raises(StoreLocked, match="another thread of this process"):  # the in-process guard stays
            lock_store(store)
    _save(store)
    assert open_store(store).complete


def test_a_directory_where_no_lock_file_can_be_made(tmp_path, monkeypatch):
    """A read-only parent (simulated: the tests may run as root, whom permissions do not stop): an
    existing store is written without a lock, with a warning; a store that does not exist yet gets no
    warning (creating it there fails with its own error)."""
    store = tmp_path / "s.zarr"
    real_open = os.open

    def read_only(path, flags, *args, **kw):
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lock_store(store) as lock:  # no store yet: no warning
            assert lock.file is None
    store.mkdir()
    with pytest.warns(UserWarning, match="cannot lock it .Permission denied.*would not be refused"):
        with lock_store(store) as lock:
            assert lock.file is None
            with pytest.raises(StoreLocked):  # this process's other writers are still refused
                lock_store(store)


def test_a_file_system_without_locks_warns(tmp_path, monkeypatch):
    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lockmod.fcntl, "lockf", no_locks)
    with pytest.warns(UserWarning, match="does not support locks"):
        with lock_store(tmp_path / "s.zarr") as lock:
            assert lock.file is None


def test_remote_stores_get_the_in_process_guard_only():
    url = "s3://bucket/s.zarr"
    assert lock_path(url) is None
    with lock_store(url) as lock:
        assert lock.file is None
        with pytest.raises(StoreLocked):
            lock_store(url)


# ----------------------------------------------------------------------------------- save_store


def test_save_store_is_refused_while_another_process_writes(tmp_path):
    store = tmp_path / "s.zarr"
    _save(store)
    before = sorted(p.name for p in store.rglob("*"))
    uuid = open_store(store).attrs["store_uuid"]
    holder = Holder(store)
    try:
        with pytest.raises(StoreLocked, match=f"pid {holder.pid}.*or choose another path$"):
            _save(store, overwrite=True)
        with pytest.raises(StoreLocked):
            _save(tmp_path / "s.zarr/../s.zarr", overwrite=True)
    finally:
        holder.stop()
    assert open_store(store).attrs["store_uuid"] == uuid and sorted(p.name for p in store.rglob("*")) == before
    _save(store, overwrite=True)  # free again
    assert open_store(store).attrs["store_uuid"] != uuid


def test_save_store_holds_the_lock_while_writing_and_releases_it(tmp_path):
    store = tmp_path / "s.zarr"
    seen = []
    import dask.array as da

    def probe(block):
        seen.append(refused_elsewhere(store))
        return block

    x = da.from_array(np.ones((20, 2), np.float32), chunks=10).map_blocks(probe, meta=np.empty((0, 2), np.float32))
    save_store(store, {"a": x}, np.zeros(20, np.int32), np.arange(20), chunk_rows=10, progress=False)
    assert seen and all(seen)  # held while the data was computed and written
    assert not (tmp_path / ".s.zarr.lock").exists() and not refused_elsewhere(store)
    bad = da.from_array(np.ones((20, 2), np.float32), chunks=10).map_blocks(
        lambda b: (_ for _ in ()).throw(RuntimeError("boom")), dtype=np.float32)
    with pytest.raises(RuntimeError, match="boom"):  # a failing save releases it too
        save_store(tmp_path / "t.zarr", {"a": bad}, np.zeros(20, np.int32), np.arange(20), progress=False)
    assert not refused_elsewhere(tmp_path / "t.zarr") and not (tmp_path / ".t.zarr.lock").exists()


# ----------------------------------------------------------------------------------- extraction


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> list[Path]:
    """Two small digits ResNets saved as repsim/train/ saves them (seeds 0 and 1)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("repsim.train.models")
    from repsim.train.checkpoint import save_checkpoint
    from repsim.train.config import load_config
    from repsim.train.models import build_network

    out = []
    for seed in (0, 1):
        cfg = load_config("digits-label_smoothing")
        cfg["data"]["spec"] = "digits"
        cfg.update(seed=seed, num_classes=10, objective_params={"alpha": 0.1})
        cfg["arch_params"] = {"width": 4, "layers": [3, 4, 6, 3]}
        torch.manual_seed(seed)
        state = build_network(cfg).state_dict()
        path = tmp_path_factory.mktemp("ckpt") / f"seed{seed}.pt"
        save_checkpoint({"config": cfg, "model": state, "ema": state, "epoch": 1}, path)
        out.append(path)
    return out


def _cli(ckpt, out, *extra) -> list[str]:
    return ["--checkpoint", str(ckpt), "--data", "digits", "--split", "test", "--out", str(out), "--chunk-rows", "16",
            "--batch-size", "2", "--workers", "0", "--device", "cpu", "--write-threads", "1", *extra]


def _written(out: Path) -> int:
    import zarr

    try:
        return int(np.count_nonzero(zarr.open_array(str(out / "written"), mode="r")[...]))
    except Exception:  # noqa: BLE001 - not created yet
        return 0


# ``python -m repsim.extract`` that stops itself (SIGSTOP) right after its Nth chunk is written (flag set):
# a known point, the lock held, instead of a parent polling the flags and stopping it some chunks later
STOPPED_AFTER = """
import os, signal, sys
from repsim.store.writer import StoreWriter
write, done, at = StoreWriter.write_chunk, [], int(sys.argv.pop(1))
def write_then_stop(self, *a, **k):
    write(self, *a, **k)
    done.append(1)
    if len(done) == at:
        os.kill(os.getpid(), signal.SIGSTOP)
StoreWriter.write_chunk = write_then_stop
import runpy
runpy.run_module("repsim.extract", run_name="__main__", alter_sys=True)  # as `python -m repsim.extract`
"""


def _extract_until(out: Path, chunks: int, *args: str) -> subprocess.Popen:
    """``python -m repsim.extract`` into ``out``, stopped (SIGSTOP, by itself) right after its ``chunks``-th
    chunk is written; returns once it is stopped (waitpid WUNTRACED: no poll, no timing guess)."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_AFTER, str(chunks), *args], env=ENV, cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    wait_until_stopped(proc, before=lambda: f"{chunks} chunks were written (got {_written(out)})")
    assert _written(out) == chunks
    return proc


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("extract: ")]  # (progress notes)
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow  # (30-40 s on 2 cores: 29 chunks of a ResNet-18 on the CPU)
def test_a_running_extraction_refuses_a_resume_and_an_overwrite(ckpts, tmp_path, capsys):
    """The reproduction: a second `repsim extract` of a store another one is writing, resuming it or
    replacing it (--overwrite, other --layers, another checkpoint), used to write into it too (a
    complete store of two models' chunks); now it is refused, and the first run's store is its own."""
    from repsim.commands.main import main as repsim_main

    out = tmp_path / "s.zarr"
    first = _extract_until(out, 3, *_cli(ckpts[0], out))
    try:
        uuid = open_store(out, allow_incomplete=True).attrs["store_uuid"]
        for extra in ((), ("--overwrite", "--layers", "block1,block2"), ("--overwrite",)):
            ckpt = ckpts[1] if extra == ("--overwrite",) else ckpts[0]
            capsys.readouterr()
            assert repsim_main(["extract", *_cli(ckpt, out, *extra)]) == 2
            line = _one_line(capsys.readouterr().err)
            assert line.startswith(f"repsim extract: error: store s: {out} is being written by another process "
                                   f"(pid {first.pid} on host "), line
            assert "python -m repsim.extract --checkpoint" in line and line.endswith("or choose another --out")
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    store = open_store(out)
    assert store.complete and store.attrs["store_uuid"] == uuid and len(store.attrs["layers"]) == 18
    assert store.attrs["model"]["checkpoint"] == str(ckpts[0])
    assert not (tmp_path / ".s.zarr.lock").exists()
    capsys.readouterr()
    assert repsim_main(["extract", *_cli(ckpts[0], out)]) == 0  # free again: a complete store, nothing to do
    assert "already complete" in capsys.readouterr().err


@pytest.mark.slow  # (30-40 s on 2 cores: 29 chunks of a ResNet-18 on the CPU)
def test_a_killed_extraction_leaves_no_lock_and_resumes(ckpts, tmp_path, capsys):
    from repsim.commands.main import main as repsim_main

    out = tmp_path / "s.zarr"
    killed = _extract_until(out, 2, *_cli(ckpts[0], out))
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert (tmp_path / ".s.zarr.lock").exists() and not refused_elsewhere(out)  # left behind, unlocked
    assert repsim_main(["extract", *_cli(ckpts[0], out)]) == 0
    assert f"resuming {out}: 2 of 29 chunks already written" in capsys.readouterr().err
    assert open_store(out).complete and not (tmp_path / ".s.zarr.lock").exists()


def test_an_extraction_thread_is_refused_by_another_of_the_same_process(ckpts, tmp_path):
    """Extraction runs several checkpoints as threads of one process (repsim/extract/cli.py on a GPU): two of
    them on one --out, one is refused, the other writes the store as a lone run does."""
    from repsim.extract import cli
    from repsim.extract.pipeline import extract_store

    out = tmp_path / "s.zarr"
    options = dict(split="test", layers="block1,pool", batch_size=16, chunk_rows=32, workers=0, device="cpu",
                   progress=False)
    with pytest.raises(StoreLocked, match=f"another thread of this process \\(pid {os.getpid()}, thread 'extract-job"):
        cli._extract_in_threads([str(ckpts[0]), str(ckpts[0])], [out, out], "digits", options, 2)
    lone = extract_store(str(ckpts[0]), "digits", tmp_path / "lone.zarr", **options)
    got = open_store(out)
    assert got.complete and not (tmp_path / ".s.zarr.lock").exists()
    for name in ("block1", "pool"):
        assert np.array_equal(got.layer(name).compute(), lone.layer(name).compute())
    with lock_store(out):  # held in this thread: a call in the same process is refused, before any work
        with pytest.raises(StoreLocked, match="another thread of this process"):
            extract_store(str(ckpts[0]), "digits", out, overwrite=True, **options)
        assert refused_elsewhere(out)


@pytest.mark.slow  # (a torchrun of two processes)
def test_torchrun_rank0_refused_tells_every_rank(ckpts, tmp_path):
    """Under torchrun only rank 0 takes the lock (the sharded run works: the other ranks would be
    refused otherwise); when rank 0 is refused, every rank stops with the reason instead of hanging."""
    pytest.importorskip("torch.distributed")
    args = ["--checkpoint", str(ckpts[1]), "--data", "digits", "--split", "test", "--chunk-rows", "32",
            "--batch-size", "16", "--workers", "0", "--device", "cpu", "--layers", "block1,pool"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "repsim.extract"]
    out = tmp_path / "s.zarr"
    holder = Holder(out)
    try:
        run = subprocess.run([*torchrun, *args, "--out", str(out)], env=ENV, cwd=ROOT, capture_output=True,
                             text=True, timeout=240)
    finally:
        holder.stop()
    assert run.returncode != 0
    assert f"is being written by another process (pid {holder.pid}" in run.stderr
    assert "rank 0 could not prepare" in run.stderr  # rank 1 heard of it
    # the refused ranks left no lock behind: with the holder gone, the next run takes it and completes (one
    # process: a sharded run completing is tests/test_extract.py's torchrun test)
    assert not (tmp_path / ".s.zarr.lock").exists()
    from repsim.commands.main import main

    assert main(["extract", *args, "--out", str(out), "--no-progress"]) == 0
    assert open_store(out).complete and not (tmp_path / ".s.zarr.lock").exists()


def test_the_lock_spans_prepare_to_finalise_and_a_failed_run_releases_it(ckpts, tmp_path, monkeypatch):
    from repsim.extract import pipeline
    from repsim.store.writer import StoreWriter

    out = tmp_path / "s.zarr"
    options = dict(split="test", layers="block1,pool", batch_size=16, chunk_rows=32, workers=0, device="cpu",
                   progress=False)
    held_at: dict[str, bool] = {}
    prepare, run, finalize = pipeline._prepare, pipeline._run, StoreWriter.finalize

    def failing_run(*args, **kw):
        held_at["run"] = refused_elsewhere(out)
        raise RuntimeError("the run fails")

    monkeypatch.setattr(pipeline, "_prepare", lambda *a, **kw: held_at.setdefault("prepare", refused_elsewhere(out))
                        and prepare(*a, **kw))
    monkeypatch.setattr(pipeline, "_run", failing_run)
    with pytest.raises(RuntimeError, match="the run fails"):
        pipeline.extract_store(str(ckpts[0]), "digits", out, **options)
    assert held_at == {"prepare": True, "run": True}
    assert not refused_elsewhere(out) and not (tmp_path / ".s.zarr.lock").exists()  # released by the failure

    def finalizing(self):
        held_at["finalize"] = refused_elsewhere(out)
        return finalize(self)

    monkeypatch.setattr(pipeline, "_run", run)
    monkeypatch.setattr(StoreWriter, "finalize", finalizing)
    assert pipeline.extract_store(str(ckpts[0]), "digits", out, **options).complete  # resumes the failed run's store
    assert held_at["finalize"] is True
    assert not refused_elsewhere(out) and not (tmp_path / ".s.zarr.lock").exists()


def test_killed_writers_temporaries_are_removed(tmp_path):
    """A writer killed mid-write leaves ``NAME.tmp-PID`` (atomic_write) or zarr's ``*.<uuid>.partial``
    (a metadata write): nothing removed them (each writer has its own PID), and zarr warned about the
    partial file at every open. The next write of that file / the store's finalize removes them; a live
    process's temporary is kept."""
    import subprocess
    import sys

    from repsim.fileio import atomic_write
    from repsim.store._chunkio import remove_stale_parts

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    out = tmp_path / "r.csv"
    (tmp_path / f"r.csv.tmp-{dead_pid}").write_text("torn")
    (tmp_path / "r.csv.tmp-1").write_text("pid 1 runs")  # (init: alive)
    (tmp_path / f"other.csv.tmp-{dead_pid}").write_text("another file's")
    with atomic_write(out, "w") as fh:
        fh.write("a,b\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.csv.tmp-%d" % dead_pid, "r.csv", "r.csv.tmp-1"]
    store = tmp_path / "s.zarr"
    store.mkdir()
    (store / "zarr.51e09c52546a419181cae6dbd5baa451.partial").write_text("{")
    (store / ".repsim-tmp-x.part").write_text("")
    (store / "zarr.json").write_text("{}")
    assert remove_stale_parts(str(store)) == 2 and [p.name for p in store.iterdir()] == ["zarr.json"]


def test_figures_skip_a_killed_cka_runs_checkpoint(tmp_path):
    """`repsim cka` killed mid-run leaves RES/cka_X.ckpt.npz, which the figures' cka_*.npz glob took for a
    result: `repsim figures` failed with "values is not a file in the archive", naming no file."""
    from repsim.analyses.data import Inputs, Missing

    res = tmp_path / "results"
    res.mkdir()
    np.savez(res / "cka_x.ckpt.npz", done=np.zeros(1))
    with pytest.raises(Missing, match="no results file of repsim cka or repsim similarity"):
        Inputs(None, res).similarities
    np.savez(res / "cka_bad.npz", junk=np.zeros(1))  # results are read by content: an npz that is none is named
    with pytest.raises(Missing, match=r"cka_bad.npz, are not results"):
        Inputs(None, res).similarities


def test_atomic_write_fsyncs_the_file_and_then_its_directory(tmp_path, monkeypatch):
    """A rename is durable only once the directory holding it is synced: atomic_write syncs the file's
    data before the rename and the directory after it (the crash audit's power-loss case)."""
    import os
    import stat

    from repsim import fileio

    synced: list[tuple[bool, bool]] = []  # (a directory?, the final name already there?)
    real_fsync = os.fsync
    out = tmp_path / "sub" / "results.json"

    def spy(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), out.exists()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with fileio.atomic_write(out, "w") as fh:
        fh.write("{}")
    assert out.read_text() == "{}"
    assert synced == [(False, False), (True, True)]
