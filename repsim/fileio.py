"""Atomic file writes shared by every result file repsim writes (``.npz``, CSV, JSON), and a file's
digest.

:func:`atomic_write` writes to ``PATH.tmp-PID`` next to the target and renames it into place only
once the data is flushed to disk, so readers see the old file or the new one, never a torn one; on
any failure (disk full, a read-only directory, an exception while writing) the temporary file is
removed and the error propagates, naming ``PATH`` (:func:`naming`).

:func:`sha256_file` is a checkpoint's identity: `repsim extract` records it as the stores'
``model.checkpoint_sha256`` (which ``repsim.store.pairing`` compares), `repsim train` as a fine-tuned
run's source and `repsim robustness` per result row. It lives here, torch-free, so that repsim/train/ and
repsim/extract/ both take it from below.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
from typing import IO, Any, Iterator


@contextlib.contextmanager
def naming(path: str | os.PathLike, temporary: str | None = None) -> Iterator[None]:
    """Re-raise an ``OSError`` that names no file (a failed write to an open handle: disk full, file
    too large) or names the ``temporary`` file standing in for ``path`` as the same error naming
    ``path``, so that its message says which output failed."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or exc.filename not in (None, temporary):
            raise
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from exc


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it to read it, racing other
    threads' file creation): Linux's /proc/self/status, else the set-and-restore, done once."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


@functools.lru_cache(maxsize=1)
def file_mode() -> int:
    """The mode ``open`` gives a new file: 0666 less the umask (read once per process)."""
    return 0o666 & ~_umask()


def give_usual_mode(fd: int) -> None:
    """Give a file made by ``tempfile.mkstemp`` (always 0600) the mode ``open`` would have given it
    (:func:`file_mode`), so that a store's chunks or a checkpoint renamed into place are readable by
    whoever may read the files beside it (a lab's group sharing a store), like every other output."""
    os.fchmod(fd, file_mode())


def remove_dead_temporaries(path: str) -> int:
    """Delete ``PATH.tmp-PID`` files of :func:`atomic_write` whose process no longer runs on this
    machine (a writer killed mid-write leaves its temporary; each later writer uses its own PID, so
    nothing else would ever remove it); returns how many."""
    folder, name = os.path.split(os.path.abspath(path))
    removed = 0
    try:
        entries = os.listdir(folder)
    except OSError:
        return 0
    for entry in entries:
        pid = entry[len(name) + 5:] if entry.startswith(name + ".tmp-") else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, entry))
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: it runs, as another user)
        return True
    return True


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary file for writing ``path``; on success it replaces ``path`` atomically and durably
    (the file is fsynced before the rename, its directory after it, so that a power loss leaves the old
    file or the new one). The temporaries of killed writers of the same ``path`` are removed first
    (:func:`remove_dead_temporaries`)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    remove_dead_temporaries(path)
    try:
        with naming(path, tmp):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(tmp, mode, **open_kwargs) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync the directory ``path`` so that a rename into it survives a power loss (POSIX; a no-op where
    directories cannot be opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """The hex sha256 of the file at ``path``.

    The file is mapped and hashed in one call, which lets go of the GIL for the whole file: hashed
    ``block`` bytes at a time, a hash on one thread must win the GIL back after every block from a
    thread running Python (extraction hashes a checkpoint beside its unpickling), and the two ran
    one after the other (64 MB: 0.06 s alone, 0.14 s beside a Python loop of 0.08 s). Files that
    cannot be mapped (empty, special) are read ``block`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
            return h.hexdigest()
        except (ValueError, OSError):
            pass
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
