"""Shared builders for the engine/driver tests (real Zarr stores on disk, no mocks)."""
from __future__ import annotations

import numpy as np

import repsim


def correlated_layers(rng: np.random.Generator, n: int, shapes: dict[str, tuple[int, ...]], offset: float = 3.0
                      ) -> dict[str, np.ndarray]:
    """Layers that share a latent factor (so CKA values are far from 0 and 1) with large means
    (post-ReLU-like), the case where uncentred float32 Grams cancel badly."""
    z = rng.normal(size=(n, 6))
    out = {}
    for name, shape in shapes.items():
        p = int(np.prod(shape))
        x = z @ rng.normal(size=(6, p)) + 0.7 * rng.normal(size=(n, p))
        out[name] = np.maximum(x + offset, 0.0).reshape((n,) + shape)
    return out


def make_store(path, layers: dict[str, np.ndarray], labels=None, *, dtype=None, chunk_rows=None, example_ids=None,
               head=None, meta=None):
    n = next(iter(layers.values())).shape[0]
    labels = np.arange(n) % 3 if labels is None else labels
    return repsim.save_store(str(path), layers=layers, labels=labels, example_ids=example_ids, dtype=dtype,
                             chunk_rows=chunk_rows, head=head, meta=meta)


def stored(store, layer: str) -> np.ndarray:
    """The layer exactly as stored (e.g. float16), read back in memory."""
    return np.asarray(store.zarr_array(layer)[...])


def minibatch_reference(arrays: list[np.ndarray], batches: list[np.ndarray], debiased: bool = True,
                        compute_dtype: str | None = "float64") -> np.ndarray:
    """In-memory MinibatchCKA over the given row batches, arrays as given (float64 by default)."""
    acc = repsim.MinibatchCKA(len(arrays), debiased=debiased, compute_dtype=compute_dtype)
    for rows in batches:
        acc.update([a[rows] for a in arrays])
    return acc.result()


def consecutive_batches(n: int, b: int) -> list[np.ndarray]:
    """[0:b], [b:2b], ...; a trailing batch of fewer than 4 rows is dropped (docs/architecture.md, engine.blocks)."""
    out = [np.arange(s, min(n, s + b)) for s in range(0, n, b)]
    return [r for r in out if r.size >= 4]


def checkpoint_segments(path) -> int:
    """Segments done in a ``cka_matrix`` checkpoint file, -1 while it does not exist or is being replaced."""
    try:
        with np.load(path) as z:
            return int(z["done"])
    except (OSError, ValueError, KeyError, EOFError):
        return -1


# ``python -m repsim ARGV`` that signals itself right after its checkpoint of ``AT`` segments is saved (a known
# point: SIGKILL for a crash, SIGSTOP for a run still holding its files), not wherever a poll found it
SIGNAL_AFTER_CHECKPOINT = """
import os, sys
from repsim.engine.checkpoint import Checkpoint
at, sig = int(sys.argv.pop(1)), int(sys.argv.pop(1))
save = Checkpoint.save
def save_then_signal(self, done, state):
    save(self, done, state)
    if done == at:
        os.kill(os.getpid(), sig)
Checkpoint.save = save_then_signal
from repsim.commands.main import main
sys.exit(main(sys.argv[1:]))
"""


def signalled_at_checkpoint(argv, at: int, sig: int) -> list[str]:
    """The command line of ``repsim ARGV`` that sends itself ``sig`` right after saving its checkpoint of
    ``at`` segments (see :data:`SIGNAL_AFTER_CHECKPOINT`)."""
    import sys

    return [sys.executable, "-c", SIGNAL_AFTER_CHECKPOINT, str(at), str(int(sig)), *map(str, argv)]


def wait_until_stopped(proc, before: "Callable[[], str] | None" = None) -> None:
    """Return once ``proc`` (a Popen) has stopped itself (waitpid WUNTRACED: no poll); fail if it ended,
    saying ``before()`` (what it had not done yet) when given."""
    import os

    import pytest

    import threading

    guard = threading.Timer(300, proc.kill)  # a hang guard, not a speed check: a run that never stops is killed
    guard.start()
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
    finally:
        guard.cancel()
    if not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read()[-2000:] if proc.stderr else ""
        what = before() if before is not None else "it stopped itself"
        pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {err}")


def strict_device(monkeypatch, device=None) -> dict[str, int]:
    """Run the engine's device route on array-api-strict as a GPU would see it: every block the engine
    uploads (:func:`repsim.engine.blocks.to_device`, also behind ``DeviceUploader`` and the decoders)
    lands on ``device`` (``array_api_strict.Device("device1")``: any array made elsewhere fails to mix
    with it), ``np.asarray`` on a strict array raises ``TypeError`` as it does for CuPy, and the
    returned counts grow by one per upload (``"upload"``) and per way a strict array reaches the host
    (``"host"``: DLPack, ``float``/``bool``/``int``/``index``)."""
    import array_api_strict as xs

    from repsim.engine import blocks, drivers

    count = {"upload": 0, "host": 0}
    cls = type(xs.asarray(0.0))
    for name in ("__dlpack__", "__float__", "__bool__", "__int__", "__index__"):
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, **k):
            count["host"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)

    def no_array(self, *a, **k):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (as for CuPy arrays)")

    monkeypatch.setattr(cls, "__array__", no_array)
    real = blocks.to_device

    def upload(x, xp):
        count["upload"] += 1
        y = real(x, xp)
        return y.to_device(device) if device is not None and isinstance(y, cls) else y

    monkeypatch.setattr(blocks, "to_device", upload)
    monkeypatch.setattr(drivers, "to_device", upload)
    return count
