"""Resumable accumulator checkpoints of :func:`repsim.cka_matrix`: state + finished segments, keyed by a
fingerprint of the computation, written atomically."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from repsim.engine.result import _STATE_PREFIX, _atomic_savez, _json_default, _unwrap


class Checkpoint:
    """Accumulator state + number of finished segments, keyed by a fingerprint of the computation."""

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any]) -> None:
        self.path = os.fspath(path)
        if not self.path.endswith(".npz"):
            self.path += ".npz"
        self.fingerprint = json.dumps(fingerprint, sort_keys=True, default=_json_default)

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
                state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
                return int(z["done"]), state
        except (OSError, ValueError, KeyError) as exc:  # truncated/corrupt: cannot happen with os.replace, but be safe
            print(f"repsim: ignoring unreadable checkpoint {self.path}: {exc}", file=sys.stderr)
            return 0, None

    def save(self, done: int, state: dict[str, Any]) -> None:
        arrays = {"fingerprint": np.array(self.fingerprint), "done": np.array(done)}
        arrays.update({_STATE_PREFIX + k: np.asarray(v) for k, v in state.items()})
        _atomic_savez(self.path, arrays)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)
