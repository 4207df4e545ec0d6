"""Chunks decoded on the GPU: the reader threads read and check the compressed objects, the device
decompresses them (issue 26). Opt-in (``REPSIM_GPU_DECODE=1``): slower than the CPU's decoding in the
engine's read schedule on its first measurement (:func:`device_decoder`).

On the CPU route each reader thread reads a chunk object, checks its crc32c and zstd-decodes it
(``repsim.store._chunkio``); with ``--device cuda`` the decoded block is then copied to the GPU
(``engine/upload.py``).  Decoding is most of that read: for bench/gpu.py's 4 stores (1.13 GB of zstd,
1.91 GB of float16) 0.41 s of zstd on 16 CPU threads, against 0.14 s for nvCOMP's GPU zstd decoding of the
same 512 chunks in one batched call with the compressed bytes copied to the device once (H100,
byte-identical; bench/RESULTS.md "gpu").  So, where nvCOMP's Python package is installed
(``nvidia-nvcomp-cu12`` / ``-cu13``), a reader thread

1. reads the objects of the chunks a (batch group, column) needs and checks each crc32c and the
   store's manifest entry on the CPU (:meth:`ActivationStore.chunk_object`);
2. copies the compressed bodies into one pinned buffer, and it to the GPU on its own stream;
3. decodes them in one batched nvCOMP call, views the bytes in the stored dtype (float16 stays
   float16: the kernels widen it), and picks the batch's rows on the device.

A column whose arrays are not repsim's zstd encoding on a local disk, or whose store lacks a chunk
object, is read the CPU way.  :class:`HostZstd` is the same contract with the decoding on the host
(numcodecs) and the result handed to any array namespace: the tests run the whole route with it on
NumPy and array-api-strict.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np

from repsim.array_api import is_cupy_namespace

__all__ = ["HostZstd", "NvcompZstd", "device_decoder"]


class HostZstd:
    """Decode on the host (numcodecs zstd), hand the bytes to ``xp``: the reference of the route."""

    def __init__(self, xp: Any) -> None:
        from numcodecs import Zstd

        self.xp = xp
        self._zstd = Zstd()

    def decode(self, bodies: Sequence[np.ndarray], nbytes: int) -> list[Any]:
        """Each zstd frame of ``bodies`` decoded to ``nbytes`` bytes (uint8, on the host here)."""
        out = []
        for body in bodies:
            raw = np.empty(nbytes, dtype=np.uint8)
            self._zstd.decode(body, out=raw)
            out.append(raw)
        return out

    def view(self, raw: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        """Decoded bytes as an array of ``xp`` of ``dtype`` and ``shape`` (as the CPU route hands a
        block to ``xp``: :func:`repsim.engine.blocks.to_device`)."""
        from repsim.engine.blocks import to_device

        return to_device(raw.view(dtype).reshape(shape), self.xp)


class NvcompZstd:
    """nvCOMP's GPU zstd (``nvidia.nvcomp``) for CuPy: one batched decode per call on the calling
    thread's own CUDA stream, which carries the copy of the compressed bytes and the decode in order;
    every call waits for that stream alone before returning, so the consumer (the default stream)
    never reads an unfinished block and the other threads' decodes and the consumer's Grams run on.
    Where the installed nvCOMP cannot take a stream (``cuda_stream``), its codec decodes on a stream of
    its own and the call waits for the whole device instead."""

    def __init__(self, xp: Any) -> None:
        from nvidia import nvcomp  # noqa: F401 - fails early where it is not installed

        self.xp = xp
        self._local = threading.local()
        self._lock = threading.Lock()
        # every thread's [stream, codec], alive as long as the decoder: a reader thread's exit must not
        # free its stream while nvCOMP may still use it; on release the codecs go first (:meth:`close`)
        self._kept: list[list[Any]] = []

    def _stream_and_codec(self) -> tuple[Any, Any, bool]:
        """This thread's (stream, codec, codec runs on that stream); made once per thread (nvCOMP: a
        Codec is not to be shared between threads)."""
        local = self._local
        if getattr(local, "held", None) is None:
            import cupy
            from nvidia import nvcomp

            stream = cupy.cuda.Stream(non_blocking=True)
            kind = dict(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW)
            try:
                codec, on_stream = nvcomp.Codec(cuda_stream=stream.ptr, **kind), True
            except TypeError:  # an nvCOMP without the argument
                codec, on_stream = nvcomp.Codec(**kind), False
            local.held = [stream, codec, on_stream]
            with self._lock:
                self._kept.append(local.held)
        return local.held[0], local.held[1], local.held[2]

    def _pinned(self, nbytes: int, cupyx: Any) -> np.ndarray:
        """This thread's pinned staging buffer, at least ``nbytes`` long: allocated once and grown by
        doubling, not per call (page-locked allocation costs about a millisecond per megabyte, more than
        the copy it serves). Reusing it is safe: every :meth:`decode` waits for its stream, which
        carries the copy out of the buffer, before it returns."""
        local = self._local
        buf = getattr(local, "pinned", None)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.size), 1 << 20)
            local.pinned = buf = cupyx.empty_pinned((size,), dtype=np.uint8)
        return buf[:nbytes]

    def decode(self, bodies: Sequence[np.ndarray], nbytes: int) -> list[Any]:
        import cupy
        import cupyx
        from nvidia import nvcomp

        sizes = [int(b.size) for b in bodies]
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        stream, codec, on_stream = self._stream_and_codec()
        staged = self._pinned(int(offs[-1]), cupyx)
        for body, a, e in zip(bodies, offs[:-1], offs[1:]):
            staged[a:e] = body
        with stream:
            dev = cupy.empty(staged.shape, dtype=np.uint8)
            dev.set(staged, stream=stream)
            if not on_stream:
                stream.synchronize()  # (the codec's own stream does not wait for ours: the bytes must be there)
            got = codec.decode(nvcomp.as_arrays([nvcomp.as_array(dev[a:e])
                                                 for a, e in zip(offs[:-1], offs[1:])]))
            if not on_stream:
                cupy.cuda.Device().synchronize()  # the codec's stream is not ours to wait for
            # copied into CuPy's own memory on this stream: nothing handed on points into nvCOMP's
            # buffers, which are freed here, with their codec and stream alive
            out, src = [], None
            for g in got:
                src = cupy.asarray(g).view(cupy.uint8).ravel()
                dst = cupy.empty(src.shape, dtype=cupy.uint8)
                dst[...] = src
                out.append(dst)
            del got, src
        stream.synchronize()  # this thread's copy, decode and copies are done; nothing else is waited for
        if any(int(o.size) != nbytes for o in out):
            raise ValueError(f"a chunk object does not decode to {nbytes} bytes on the GPU")
        return out

    def close(self) -> None:
        """Release every thread's codec, then its stream (after the device is idle)."""
        import cupy

        with self._lock:
            kept, self._kept = self._kept, []
        if kept:
            cupy.cuda.Device().synchronize()
        for held in kept:
            held[1] = None
        for held in kept:
            held[0] = None

    def view(self, raw: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        return raw.view(dtype).reshape(shape)


def device_decoder(xp: Any) -> Any:
    """The GPU decoder for ``xp`` (CuPy with ``nvidia.nvcomp`` installed) when ``REPSIM_GPU_DECODE=1``,
    else None (the CPU decodes). Opt-in: on an H200 (2026-11-28, bench/RESULTS.md "gpu") the store-backed
    pass took 1.26 s with it against 0.69 s with the CPU decoding (16 reader threads): one batched
    nvCOMP call per (batch group, column) on small groups costs more than it saves, though nvCOMP
    decodes the same chunks 3x faster than the CPU in one call over all of them."""
    if os.environ.get("REPSIM_GPU_DECODE", "0") != "1" or not is_cupy_namespace(xp):
        return None
    try:
        return NvcompZstd(xp)
    except ImportError:
        return None
