"""Host blocks to the GPU from the reader threads, overlapped with the consumer's compute.

``repsim cka --device cuda`` reads and decodes blocks on the CPU (``BlockReader`` threads) and
computes on the GPU.  Copying a block from ordinary (pageable) host memory on CuPy's default
stream would make the copy wait for every kernel queued before it and make those kernels wait for
the copy: reading could not run ahead of the Grams.  So, with CuPy, each reader thread

1. copies the decoded block into page-locked (pinned) host memory (``cupyx.empty_pinned``, from
   CuPy's pinned pool), in parallel with the other reader threads;
2. starts the host-to-device copy on its own non-blocking stream — in the stored dtype (float16
   stays float16: half the bytes; the kernels widen it on the device);
3. waits for that copy (its own thread only: the consumer is not blocked) and hands the device
   array over.

The consumer then computes on the default stream.  CuPy's memory pool is stream-aware: a block a
reader thread allocated returns, when freed, to that thread's stream, where the next copy may reuse
it while default-stream kernels still read it.  :class:`HeldUploads` therefore keeps every
uploaded array alive until the consumer has synchronised with the device after using it (each
``MinibatchCKA.update`` ends with its one device-to-host copy, which does).

Any other namespace (NumPy, array-api-strict) goes through :func:`repsim.engine.blocks.to_device`.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from repsim.array_api import is_cupy_namespace

__all__ = ["DeviceUploader", "HeldUploads"]


class DeviceUploader:
    """``upload(x)``: host block ``x`` as an array of ``xp`` (module docstring); thread-safe, one
    CUDA stream per calling thread."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.cupy = is_cupy_namespace(xp)
        self._local = threading.local()

    def __call__(self, x: np.ndarray) -> Any:
        if not self.cupy:
            from repsim.engine.blocks import to_device

            return to_device(x, self.xp)
        import cupy
        import cupyx

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = cupy.cuda.Stream(non_blocking=True)
        x = np.ascontiguousarray(x)
        pinned = cupyx.empty_pinned(x.shape, dtype=x.dtype)
        np.copyto(pinned, x)
        with stream:
            out = cupy.empty(x.shape, dtype=x.dtype)
            out.set(pinned, stream=stream)
        stream.synchronize()  # this reader thread waits for its copy; pinned is then free again
        return out


class HeldUploads:
    """Uploaded arrays kept alive until the consumer has synchronised with the device after using
    them (module docstring): ``hold(x)`` returns ``x``; ``release()`` drops everything held."""

    def __init__(self) -> None:
        self._held: list[Any] = []

    def hold(self, x: Any) -> Any:
        self._held.append(x)
        return x

    def release(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
