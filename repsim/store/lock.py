"""One writer per store: :func:`lock_store`, an exclusive lock that the kernel releases with its holder.

Two writers of one store path at once (the same ``repsim extract`` started in two terminals, a job
array naming one ``--out`` twice, an ``--overwrite`` run while another resumes) would each write
chunks, and the later one's ``finalize`` could mark complete a store whose chunks came from two runs.
``repsim extract`` (rank 0 of a run, from before the store is prepared until it is finalised or the
run fails) and :func:`repsim.store.writer.save_store` hold this lock; a second writer is refused at
once with one line naming the holder (pid, host, since when, its command) and what to do. Readers
take no lock and are never blocked.

The lock is a POSIX record lock (``fcntl.lockf``) on a file beside the store, ``<parent>/.<name>.lock``
(``<name>`` the store's directory name after symlinks are resolved), which exists before the store
does, so that creating, resuming and overwriting are all covered. The kernel drops the lock when its
holder exits in any way (SIGKILL, the OOM killer), so a killed run never blocks the rerun that resumes
its store: the file may stay behind, unlocked, and the next writer takes it. Holding it, the holder
writes one JSON line into the file (who it is), which a refused writer reads for its message. On
release the file is unlinked while still locked; a writer that locked the unlinked file in the
meantime sees that the path now names another file (or none) and tries again.

POSIX record locks belong to a process, not to a thread or a file descriptor: a second thread of the
holder's process would be granted the lock again, and closing any descriptor of the file would drop
it. The holder's process therefore also keeps a registry of the locks it holds (by path and by inode),
consulted before the file is opened: a second writer in the same process (extraction runs several
checkpoints as threads of one process on a GPU) is refused as well, and the file is never opened
twice by one process. The locks are not inherited across ``fork`` (a forked child, such as a
DataLoader worker, holds none, and its copy of the registry is cleared); descriptors are
close-on-exec.

What is not guaranteed:

- Platforms without :mod:`fcntl` (Windows): only the in-process guard; two processes are not kept
  apart (nothing fails either).
- A directory in which the lock file cannot be created or opened for writing (a read-only parent,
  another user's directory): the store is written without a lock, with a warning when it exists.
  Creating or overwriting a store needs that directory to be writable anyway (and fails with its
  own error), so this only concerns resuming an existing store.
- NFS: ``lockf`` locks are forwarded to the server (NFSv4 natively; NFSv3 through the NLM/lockd
  service), so writers on different hosts exclude each other and a SIGKILLed holder's lock is
  released at once by its client. If the holder's *host* dies, the server frees the lock only when
  the client's lease expires (NFSv4, typically 90 s) or the client reboots (NLM). A mount with
  ``nolock`` / ``local_lock=posix|all`` keeps locks local to each host: writers on one host are
  excluded, writers on different hosts are not. A server without lock support (``ENOLCK``) is
  treated like a platform without ``fcntl``, with a warning.
- Remote stores (URLs, ``s3://...``): only the in-process guard.
- A path that reaches the store through a hard link or bind mount under another name is another
  lock (symlinks are resolved).
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import shlex
import socket
import sys
import threading
import time
import warnings
from typing import Any

from repsim.store.format import StoreError, full_path, store_name

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = ".lock"  # the lock file of store ``<parent>/<name>`` is ``<parent>/.<name>.lock``
_RETRIES = 20  # a releasing holder unlinked the file we locked: try again (a race, not a wait)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_CANNOT_CREATE = {errno.EACCES, errno.EPERM, errno.EROFS}


class StoreLocked(StoreError):
    """Another writer (another process, or another thread of this one) holds the store's lock."""


def lock_path(path: str | os.PathLike) -> str | None:
    """The lock file of the store at ``path``: ``<parent>/.<name>.lock`` of the path with symlinks
    resolved (so two names of one store share one lock); None for a remote store (a URL)."""
    path = str(path)
    if "://" in path:
        return None
    parent, base = os.path.split(os.path.realpath(path))
    return os.path.join(parent, f".{base}{LOCK_SUFFIX}")


def _command() -> str | None:
    """This process's command line as a user would type it (``python -m repsim.extract ...`` for ``-m``),
    shortened; None in an interactive interpreter."""
    argv = list(sys.argv)
    if not argv or not argv[0]:
        return None
    head = os.path.basename(argv[0])
    if head == "__main__.py":  # python -m package (dotted: python -m repsim.extract)
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        package = spec.name.rpartition(".")[0] if spec is not None and spec.name else ""
        head = f"python -m {package or os.path.basename(os.path.dirname(argv[0]))}"
    elif head in ("-c", "-m"):
        head = "python " + head
    text = " ".join([head, *map(shlex.quote, argv[1:])])
    return text if len(text) <= 300 else text[:297] + "..."


def _holder_info() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
        "thread": threading.current_thread().name,
    }


def _describe(info: dict[str, Any] | None, here: bool) -> str:
    """Who holds a lock, for the refusal: ``another process (pid 12 on host h, since T: cmd)``, or
    ``another thread of this process (pid 12, thread 'name', since T: cmd)`` (``here``)."""
    if not info:
        return "another process (it has not yet recorded who it is)"
    who = (f"another thread of this process (pid {info.get('pid')}, thread {info.get('thread')!r}"
           if here else f"another process (pid {info.get('pid')} on host {info.get('host')}")
    who += f", since {info.get('since')}"
    if info.get("command"):
        who += f": {' '.join(str(info['command']).split())}"
    return who + ")"


class StoreLock:
    """A held store lock; :meth:`release` it (or use it as a context manager). ``file`` is the lock
    file, None where processes are not kept apart (no ``fcntl``, a remote store, a directory where
    the file could not be created)."""

    def __init__(self, path: str, key: str, file: str | None, fd: int | None, inode: tuple[int, int] | None,
                 info: dict[str, Any]):
        self.path, self.file, self.info = path, file, info
        self._key, self._fd, self._inode = key, fd, inode

    @property
    def held(self) -> bool:
        """Whether this process still holds it (False once released)."""
        return self._key in _HELD and _HELD[self._key] is self

    def release(self) -> None:
        """Unlink the lock file and drop the lock (idempotent)."""
        with _GUARD:
            if _HELD.get(self._key) is self:
                del _HELD[self._key]
            fd, self._fd = self._fd, None
            if fd is None:
                return
            try:
                # unlinked while still locked: a writer that locks the old file after this sees that the
                # path names another file (or none) and tries again
                if self.file is not None and _inode_of(self.file) == self._inode:
                    os.unlink(self.file)
            except OSError:
                pass
            finally:
                os.close(fd)

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"StoreLock({self.path!r}, file={self.file!r}, held={self.held})"


_GUARD = threading.Lock()  # serialises acquisition and release within this process
_HELD: dict[str, StoreLock] = {}  # the locks this process holds, by lock file (or URL)


def _inode_of(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's record locks: forget them (closing the inherited
    descriptors releases nothing of the parent's)."""
    global _GUARD
    _GUARD = threading.Lock()
    for lock in list(_HELD.values()):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_info(fd: int) -> dict[str, Any] | None:
    """The holder's JSON line from its lock file (None until it has written it)."""
    for _ in range(10):  # the holder writes it right after locking
        try:
            raw = os.pread(fd, 4096, 0)
            info = json.loads(raw.decode("utf-8", "replace") or "null")
            if isinstance(info, dict):
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return None


def _refuse(path: str, holder: str, instead: str) -> StoreLocked:
    return StoreLocked(f"store {store_name(path)}: {full_path(path)} is being written by {holder}; wait for it "
                       f"to finish (a rerun then resumes it or finds it complete), or {instead}")


def _unlocked(path: str, key: str, file: str | None, why: str | None) -> StoreLock:
    """A lock that keeps only this process's writers apart (``why``: warn that processes are not)."""
    if why:
        warnings.warn(f"store {store_name(path)}: {why}, so another process writing {full_path(path)} at the "
                      "same time would not be refused", UserWarning, stacklevel=4)
    lock = StoreLock(path, key, None, None, None, _holder_info())
    _HELD[key] = lock
    return lock


def lock_store(path: str | os.PathLike, *, instead: str = "choose another path") -> StoreLock:
    """Take the writer lock of the store at ``path`` (which need not exist yet; its parent directory
    is created) without waiting, or raise :class:`StoreLocked` naming the holder and telling the
    user to wait or to ``instead`` (e.g. ``"choose another --out"``). Hold it for as long as the
    store is written, then :meth:`StoreLock.release` it (or ``with lock_store(path): ...``).

    Not re-entrant: a second ``lock_store`` of the same store in the holder's process (any thread)
    is refused too. See the module docstring for what is and is not guaranteed."""
    path = str(path)
    file = lock_path(path)
    key = file if file is not None else path
    with _GUARD:
        held = _HELD.get(key)
        if held is None and file is not None:  # the same file under another name (a hard link)
            inode = _inode_of(file)
            held = next((h for h in _HELD.values() if inode is not None and h._inode == inode), None)
        if held is not None:
            raise _refuse(path, _describe(held.info, here=True), instead)
        if file is None:
            return _unlocked(path, key, None, None)
        if fcntl is None:
            return _unlocked(path, key, None, None)  # (documented: no inter-process lock on this platform)
        for _ in range(_RETRIES):
            try:
                os.makedirs(os.path.dirname(file), exist_ok=True)
                fd = os.open(file, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as exc:
                if exc.errno in _CANNOT_CREATE:  # (creating the store there fails anyway: warn only for a resume)
                    why = f"cannot lock it ({exc.strerror}: {file})" if os.path.isdir(path) else None
                    return _unlocked(path, key, None, why)
                raise
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                info = _read_info(fd) if exc.errno in (errno.EACCES, errno.EAGAIN) else None
                os.close(fd)
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    raise _refuse(path, _describe(info, here=False), instead) from None
                if exc.errno in _NO_LOCKS:
                    return _unlocked(path, key, None, f"the file system does not support locks ({exc.strerror}: "
                                     f"{file})")
                raise
            st = os.fstat(fd)
            if _inode_of(file) != (st.st_dev, st.st_ino):  # unlinked by a releasing holder meanwhile
                os.close(fd)
                continue
            info = _holder_info()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            except OSError:
                pass  # (a full disk: the lock holds all the same; a refused writer names no holder)
            lock = StoreLock(path, key, file, fd, (st.st_dev, st.st_ino), info)
            _HELD[key] = lock
            return lock
    raise StoreError(f"store {store_name(path)}: could not take the lock {file}: it was replaced {_RETRIES} times "
                     "while this process tried to lock it")
