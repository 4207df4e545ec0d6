"""Resumable accumulator checkpoints of :func:`repsim.cka_matrix`: state + finished segments, keyed by a
fingerprint of the computation and by the identity of every input store, written atomically."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

import numpy as np

from repsim.engine.result import _STATE_PREFIX, _atomic_savez, _json_default, _unwrap


class StaleCheckpointError(ValueError):
    """A checkpoint of this very computation whose input stores were replaced since it was written."""


class Checkpoint:
    """Accumulator state + number of finished segments, keyed by a fingerprint of the computation.

    ``inputs`` maps each input store's path to its identity (:attr:`ActivationStore.identity`). A
    checkpoint of another computation (other settings, stores, layers) is ignored and overwritten;
    one of the same computation whose stores were replaced in place since (same paths, other
    identities) is refused with :class:`StaleCheckpointError`: resuming would mix two stores' data.
    """

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any],
                 inputs: Mapping[str, str] | None = None) -> None:
        self.path = os.fspath(path)
        if not self.path.endswith(".npz"):
            self.path += ".npz"
        self.fingerprint = json.dumps(fingerprint, sort_keys=True, default=_json_default)
        self.inputs = dict(inputs or {})

    def load(self) -> tuple[int, dict[str, Any] | None]:
        """``(segments done, state)``; ``(0, None)`` when absent or made by a different computation."""
        if not os.path.exists(self.path):
            return 0, None
        try:
            with np.load(self.path, allow_pickle=False) as z:
                if str(z["fingerprint"]) != self.fingerprint:
                    print(f"repsim: checkpoint {self.path} belongs to a different computation; starting over",
                          file=sys.stderr)
                    return 0, None
                saved = json.loads(str(z["inputs"])) if "inputs" in z.files else None
                if saved is None:
                    print(f"repsim: checkpoint {self.path} does not record its stores' identities (older repsim); "
                          "starting over", file=sys.stderr)
                    return 0, None
                self._check_inputs(saved)
                state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
                return int(z["done"]), state
        except (OSError, ValueError, KeyError) as exc:  # truncated/corrupt: cannot happen with os.replace, but be safe
            if isinstance(exc, StaleCheckpointError):
                raise
            print(f"repsim: ignoring unreadable checkpoint {self.path}: {exc}", file=sys.stderr)
            return 0, None

    def _check_inputs(self, saved: Mapping[str, str]) -> None:
        changed = [p for p, ident in self.inputs.items() if saved.get(p) != ident]
        if changed:
            raise StaleCheckpointError(
                f"checkpoint {self.path} was computed from other stores than the ones now at "
                f"{', '.join(changed)} (replaced or rewritten since); resuming would mix their data: "
                f"delete {self.path} to start over, or put the original store(s) back")

    def save(self, done: int, state: dict[str, Any]) -> None:
        arrays = {"fingerprint": np.array(self.fingerprint), "done": np.array(done),
                  "inputs": np.array(json.dumps(self.inputs, sort_keys=True))}
        arrays.update({_STATE_PREFIX + k: np.asarray(v) for k, v in state.items()})
        _atomic_savez(self.path, arrays)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)
