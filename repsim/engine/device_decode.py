"""Chunks decoded on the GPU: the reader threads read and check the compressed objects, the device
decompresses them (issue 26). Opt-in (``REPSIM_GPU_DECODE=1``): slower than the CPU's decoding in the
engine's read schedule on its first measurement, with one call per column (:func:`device_decoder`);
the spans below are not yet measured on a GPU.

On the CPU route each reader thread reads a chunk object, checks its crc32c and zstd-decodes it
(``repsim.store._chunkio``); with ``--device cuda`` the decoded block is then copied to the GPU
(``engine/upload.py``).  Decoding is most of that read: for bench/gpu.py's 4 stores (1.13 GB of zstd,
1.91 GB of float16) 0.41 s of zstd on 16 CPU threads, against 0.14 s for nvCOMP's GPU zstd decoding of the
same 512 chunks in one batched call with the compressed bytes copied to the device once (H100,
byte-identical; bench/RESULTS.md "gpu").  So, where nvCOMP's Python package is installed
(``nvidia-nvcomp-cu12`` / ``-cu13``), a reader thread

1. reads the objects of the chunks a (batch group, span of columns) needs and checks each crc32c and the
   store's manifest entry on the CPU (:meth:`ActivationStore.chunk_object`);
2. copies the compressed bodies into one pinned buffer, and it to the GPU on its own stream;
3. decodes them in one batched nvCOMP call, views the bytes in the stored dtype (float16 stays
   float16: the kernels widen it), and picks the batch's rows on the device.

One call covers a *span* of columns of a batch group (:func:`decode_spans`: consecutive columns up to
:data:`DECODE_CALL_BYTES` of decoded bytes), not one column: a call has fixed costs (nvCOMP reads the
frames' headers back to the host, the thread waits for its stream) that one column's few chunks did
not repay (bench/RESULTS.md "gpu", H200: 1.26 s with one call per column against 0.69 s with the CPU
decoding).

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

__all__ = ["DECODE_CALL_BYTES", "HostZstd", "NvcompZstd", "decode_spans", "device_decoder"]

# decoded bytes one batched decode aims at: a span of columns of a batch group grows until the next
# column would pass it (a wider column alone is one call); 64 MiB is ~8 ms of nvCOMP zstd at the 8 GB/s
# measured for one call over 0.96 GB (H200), against ~1-2 ms of fixed cost per call
DECODE_CALL_BYTES = 64 << 20


def decode_spans(column_bytes: Sequence[int], limit: int | None = None) -> list[range]:
    """Consecutive runs of columns, each decoded in one call: ``column_bytes[c]`` is what column ``c``
    decodes to for one batch group; a run grows while its total stays within ``limit`` (default
    :data:`DECODE_CALL_BYTES`), and a column over the limit is a run of its own.  Every column is in
    exactly one run, in order."""
    limit = DECODE_CALL_BYTES if limit is None else int(limit)
    spans, start, total = [], 0, 0
    for c, nbytes in enumerate(column_bytes):
        if c > start and total + int(nbytes) > limit:
            spans.append(range(start, c))
            start, total = c, 0
        total += int(nbytes)
    if len(column_bytes):
        spans.append(range(start, len(column_bytes)))
    return spans


class HostZstd:
    """Decode on the host (numcodecs zstd), hand the bytes to ``xp``: the reference of the route."""

    def __init__(self, xp: Any) -> None:
        from numcodecs import Zstd

        self.xp = xp
        self._zstd = Zstd()

    def decode(self, bodies: Sequence[np.ndarray], nbytes: Sequence[int]) -> list[Any]:
        """Each zstd frame of ``bodies`` decoded to its ``nbytes`` bytes (uint8, on the host here)."""
        out = []
        for body, size in zip(bodies, nbytes, strict=True):
            raw = np.empty(int(size), dtype=np.uint8)
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
        self._into = True  # nvCOMP decodes into our buffers (``out=``) until it refuses the argument

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

    def decode(self, bodies: Sequence[np.ndarray], nbytes: Sequence[int]) -> list[Any]:
        """Each zstd frame of ``bodies`` decoded to its ``nbytes`` bytes: uint8 views into one CuPy
        buffer, decoded into it by nvCOMP (``out=``) where the installed nvCOMP takes an output batch,
        else decoded into nvCOMP's own buffers and copied into it."""
        import cupy
        import cupyx
        from nvidia import nvcomp

        sizes = [int(b.size) for b in bodies]
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        want = np.concatenate([[0], np.cumsum([int(n) for n in nbytes])]).astype(np.int64)
        if want.size != offs.size:
            raise ValueError(f"{len(bodies)} chunk objects, {want.size - 1} decoded sizes")
        stream, codec, on_stream = self._stream_and_codec()
        staged = self._pinned(int(offs[-1]), cupyx)
        for body, a, e in zip(bodies, offs[:-1], offs[1:]):
            staged[a:e] = body
        with stream:
            dev = cupy.empty(staged.shape, dtype=np.uint8)
            dev.set(staged, stream=stream)
            if not on_stream:
                stream.synchronize()  # (the codec's own stream does not wait for ours: the bytes must be there)
            srcs = nvcomp.as_arrays([nvcomp.as_array(dev[a:e]) for a, e in zip(offs[:-1], offs[1:])])
            # one CuPy buffer for the call's decoded bytes, allocated on this stream (CuPy's pool, no
            # cudaMalloc per chunk); nothing handed on points into nvCOMP's buffers
            buf = cupy.empty(int(want[-1]), dtype=cupy.uint8)
            out = [buf[a:e] for a, e in zip(want[:-1], want[1:])]
            if not self._decode_into(codec, srcs, out, nvcomp):
                got = codec.decode(srcs)
                if not on_stream:
                    cupy.cuda.Device().synchronize()  # the codec's stream is not ours to wait for
                src = None
                for g, dst in zip(got, out):
                    src = cupy.asarray(g).view(cupy.uint8).ravel()
                    if int(src.size) != int(dst.size):
                        raise ValueError(f"a chunk object decodes to {int(src.size)} bytes on the GPU, "
                                         f"not the chunk's {int(dst.size)}")
                    dst[...] = src
                del got, src
            elif not on_stream:
                cupy.cuda.Device().synchronize()
        stream.synchronize()  # this thread's copy and decode are done; nothing else is waited for
        return out

    def _decode_into(self, codec: Any, srcs: Any, out: list[Any], nvcomp: Any) -> bool:
        """Decode ``srcs`` straight into ``out`` (CuPy views, each exactly its chunk's size) when the
        installed nvCOMP takes ``out=`` (6.x: a ``BatchArray`` of fixed capacities, ``ValueError`` when
        one is too small); False to decode into nvCOMP's buffers instead (an nvCOMP without it, from
        then on; a frame larger than its chunk, this once: the copy route then names it)."""
        if not self._into:
            return False
        try:
            codec.decode(srcs, out=nvcomp.as_arrays([nvcomp.as_array(o) for o in out]))
        except TypeError:
            self._into = False
            return False
        except ValueError:
            return False
        return True

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
    nvCOMP call per (batch group, column) on small groups cost more than it saved, though nvCOMP
    decodes the same chunks 3x faster than the CPU in one call over all of them. Calls now cover
    spans of columns (:func:`decode_spans`); the route stays opt-in until a GPU measures them
    (bench/gpu.py's store row times both)."""
    if os.environ.get("REPSIM_GPU_DECODE", "0") != "1" or not is_cupy_namespace(xp):
        return None
    try:
        return NvcompZstd(xp)
    except ImportError:
        return None
