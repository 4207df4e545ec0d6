"""Resumable accumulator checkpoints of :func:`repsim.cka_matrix`: state + finished segments, keyed by a
fingerprint of the computation and by the identity of every input store, written atomically.

A checkpoint path names a checkpoint of this run or nothing: :func:`check_checkpoint_path` refuses,
before any work, a path that is the run's output or an existing file that is not a repsim checkpoint
(another result, a truncated file), and :meth:`Checkpoint.load` one that belongs to another
computation — each of them was overwritten, then deleted, by the run that resumed from nothing.
"""
from __future__ import annotations

import json
import os
import sys
import zipfile
from typing import Any, Mapping

import numpy as np

from repsim.engine.result import _STATE_PREFIX, _atomic_savez, _json_default, _unwrap

_KEYS = ("fingerprint", "done")  # what every repsim checkpoint holds (and no results file does)


class CheckpointError(ValueError):
    """A checkpoint path that names no checkpoint of this run: the output, another file, another
    computation's checkpoint, a damaged file."""


class StaleCheckpointError(CheckpointError):
    """A checkpoint of this very computation whose input stores were replaced since it was written."""


def npz_path(path: str | os.PathLike) -> str:
    """``path`` with the ``.npz`` ending ``np.savez`` gives it (a checkpoint's, a result's file name)."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else path + ".npz"


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_checkpoint_path(path: str | os.PathLike, out: str | os.PathLike | None = None, *,
                          flag: str = "--checkpoint") -> str:
    """The file a checkpoint at ``path`` is written to (``.npz`` added), refused with a one-line
    :class:`CheckpointError` when it resolves to the output ``out`` (the run would delete the result it
    just wrote), is a directory, or exists and is not a readable repsim checkpoint (another results
    file, a truncated file: it would be overwritten, then deleted)."""
    path = npz_path(path)
    if out is not None and _same_file(path, npz_path(out)):
        raise CheckpointError(f"{flag} {path} is the output file itself: the run would delete the result it just "
                              f"wrote; choose another {flag} (default: OUT.ckpt.npz)")
    if os.path.isdir(path):
        raise CheckpointError(f"{flag} {path} is a directory; choose a file name")
    if os.path.lexists(path):
        keys = _checkpoint_keys(path, flag)
        if not all(k in keys for k in _KEYS):
            raise CheckpointError(f"{flag} {path} exists and is not a repsim checkpoint (it holds "
                                  f"{', '.join(sorted(keys)[:4]) or 'nothing'}): it would be overwritten, then "
                                  f"deleted; choose another {flag} or move that file away")
    return path


def _checkpoint_keys(path: str, flag: str = "checkpoint") -> list[str]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return list(z.files) if hasattr(z, "files") else []
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{flag} {path} cannot be read as a checkpoint (truncated or damaged: "
                              f"{' '.join(str(exc).split()) or type(exc).__name__}); delete it to start over, or "
                              f"choose another {flag}") from None


class Checkpoint:
    """Accumulator state + number of finished segments, keyed by a fingerprint of the computation.

    ``inputs`` maps each input store's path to its identity (:attr:`ActivationStore.identity`). A
    checkpoint of another computation (other settings, stores, layers) is refused (:class:`CheckpointError`),
    neither resumed nor overwritten; one of the same computation whose stores were replaced in place since (same paths, other
    identities) is refused with :class:`StaleCheckpointError`: resuming would mix two stores' data.
    """

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any],
                 inputs: Mapping[str, str] | None = None) -> None:
        self.path = npz_path(path)
        self.fingerprint = json.dumps(fingerprint, sort_keys=True, default=_json_default)
        self.inputs = dict(inputs or {})
        self._seen: tuple | None = None  # the file as this run last read or wrote it (save's check)

    def load(self) -> tuple[int, dict[str, Any] | None]:
        """``(segments done, state)``; ``(0, None)`` when absent. Another computation's checkpoint, a
        file that is no checkpoint and a damaged one are refused (:class:`CheckpointError`): starting
        over would overwrite, then delete, them."""
        check_checkpoint_path(self.path, flag="checkpoint")
        self._seen = _stat_key(self.path)
        if self._seen is None:
            return 0, None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["fingerprint"]) != self.fingerprint:
                    raise CheckpointError(
                        f"checkpoint {self.path} belongs to a different computation (other stores, layers or "
                        "settings): resuming would mix them and starting over would destroy it; delete it to "
                        "start over, or choose another checkpoint path")
                saved = json.loads(str(z["inputs"])) if "inputs" in z.files else None
                if saved is None:
                    print(f"repsim: checkpoint {self.path} does not record its stores' identities (older repsim); "
                          "starting over", file=sys.stderr)
                    return 0, None
                self._check_inputs(saved)
                state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
                return int(z["done"]), state
        except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise CheckpointError(f"checkpoint {self.path} cannot be read (truncated or damaged: "
                                  f"{' '.join(str(exc).split()) or type(exc).__name__}); delete it to start "
                                  "over") from None

    def _check_inputs(self, saved: Mapping[str, str]) -> None:
        changed = [p for p, ident in self.inputs.items() if saved.get(p) != ident]
        if changed:
            raise StaleCheckpointError(
                f"checkpoint {self.path} was computed from other stores than the ones now at "
                f"{', '.join(changed)} (replaced or rewritten since); resuming would mix their data: "
                f"delete {self.path} to start over, or put the original store(s) back")

    def save(self, done: int, state: dict[str, Any]) -> None:
        """Write the checkpoint — refused (:class:`~repsim.fileio.OutputConflict`) when another run wrote
        the file since this one last read or wrote it: a create that fails when this run found none,
        else a check of the file's identity (inode, size, mtime) before the replace."""
        arrays = {"fingerprint": np.array(self.fingerprint), "done": np.array(done),
                  "inputs": np.array(json.dumps(self.inputs, sort_keys=True))}
        arrays.update({_STATE_PREFIX + k: np.asarray(v) for k, v in state.items()})
        from repsim.fileio import OutputConflict

        now = _stat_key(self.path)
        if now is not None and now != self._seen:
            raise OutputConflict(f"checkpoint {self.path} was written by another run since this one started; "
                                 "two runs must not share a checkpoint: give each its own")
        _atomic_savez(self.path, arrays, exclusive=self._seen is None)
        self._seen = _stat_key(self.path)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def _stat_key(path: str) -> tuple | None:
    """A file's identity for "did someone else write it": (device, inode, size, mtime in ns); None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
