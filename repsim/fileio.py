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
import errno
import functools
import hashlib
import mmap
import os
import threading
from typing import IO, Any, Iterator


class OutputConflict(ValueError):
    """Another run holds, or made, an output file this run was to write (a refusal: nothing is replaced)."""


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
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, exclusive: bool = False,
                 **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary file for writing ``path``; on success it replaces ``path`` atomically and durably
    (the file is fsynced before the rename, its directory after it, so that a power loss leaves the old
    file or the new one). The temporaries of killed writers of the same ``path`` are removed first
    (:func:`remove_dead_temporaries`).

    ``exclusive``: ``path`` is created, never replaced — a create that fails when the file exists (a
    hard link of the temporary, atomic on POSIX file systems): when another run made ``path`` since
    this one looked, this run's data is kept beside it as :func:`kept_name` and :class:`OutputConflict`
    names both files, so that neither run's result is lost."""
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
            if exclusive:
                _create_from(tmp, path)
            else:
                os.replace(tmp, path)
            fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def kept_name(path: str) -> str:
    """Where :func:`atomic_write` keeps this run's data when an exclusive create of ``path`` finds another
    run's file there: ``NAME.run-PID.EXT`` beside it."""
    root, ext = os.path.splitext(path)
    return f"{root}.run-{os.getpid()}{ext}"


def _create_from(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` only if ``path`` does not exist (:func:`atomic_write`'s ``exclusive``)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        kept = kept_name(path)
        os.replace(tmp, kept)
        raise OutputConflict(f"{path} was written by another run after this one started; this run's result is "
                             f"kept as {kept} (nothing was replaced)") from None
    except OSError as exc:  # a file system without hard links: check, then rename (a narrow race remains)
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(path):
            kept = kept_name(path)
            os.replace(tmp, kept)
            raise OutputConflict(f"{path} was written by another run after this one started; this run's result "
                                 f"is kept as {kept} (nothing was replaced)") from None
        os.replace(tmp, path)
        return
    os.remove(tmp)


_LOCKS_HELD = threading.Lock()  # flock belongs to an open file: this process's threads are kept apart here


def lock_file_of(path: str | os.PathLike) -> str:
    """The lock file of output ``path``: ``<dir>/.<name>.lock`` (left in place; a lock dies with its holder)."""
    head, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(head, f".{name}.lock")


@contextlib.contextmanager
def claim_output(path: str | os.PathLike, *, overwrite: bool = False, what: str = "--out") -> Iterator[str]:
    """Hold output ``path`` for the whole run: the one rule for every file a run writes at its end
    (a results ``.npz``, a checkpoint). Refused in one line (:class:`OutputConflict`), before any work,
    when ``path`` exists and ``overwrite`` is false, or when another run holds it — an exclusive,
    non-blocking ``flock`` of :func:`lock_file_of`, which :func:`repsim.engine.drivers.results_lock`'s
    read-merge-replace writers take too. Where locks cannot be taken (a read-only directory, no
    ``fcntl``) the run goes on unlocked; the final write should then be ``atomic_write(exclusive=not
    overwrite)``, a create that fails when another run made the file since."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputConflict(f"{what} {path} is a directory; choose a file name")
    if os.path.lexists(path) and not overwrite:
        raise OutputConflict(f"{what} {path} already exists; pass --overwrite to replace it or choose another {what}")
    fd = _try_lock(path)
    if fd == -1:
        raise OutputConflict(f"{what} {path} is being written by another running repsim command; wait for it to "
                             f"finish or choose another {what}")
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


def _try_lock(path: str) -> int | None:
    """An open descriptor holding an exclusive ``flock`` of ``path``'s lock file; -1 when another holds
    it; None when no lock can be taken here."""
    try:
        import fcntl
    except ImportError:
        return None
    with _LOCKS_HELD:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fd = os.open(lock_file_of(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -1
        except OSError:  # a file system without locks
            os.close(fd)
            return None
        return fd


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
