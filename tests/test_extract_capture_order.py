"""A CPU stand-in for the CUDA ordering of extraction's device-to-host copies: repsim/extract/capture.py's
``Capture.copy_out`` (a cast into a private device tensor, the copy on ``copy_stream`` after
``wait_stream``, ``record_stream``) and repsim/extract/pipeline.py's ``_run`` (the chunk's ``max |y|``
copied on the same stream, an event recorded after the chunk's last copy, the writer thread waiting for it
before it checks the maxima and writes the chunk).

On a GPU a slip in that ordering writes wrong data that still passes the store's checksums. Here the
pipeline runs on the CPU as it would on CUDA (``_run`` is told its device is ``cuda:0``; ``copy_out`` sees
the layer outputs on it, the pinned buffers on the host) with ``torch.cuda``'s streams and events stood
in for by a fake device whose side-stream copies finish as late as the hardware may let them:

* a copy queued on the side stream runs only when an event recorded after it is synchronised (the
  writer's wait), never earlier;
* a copy whose source was computed after the side stream's last ``wait_stream(compute)`` may run before
  that source was written: it reads garbage (NaN);
* a source tensor freed (its last Python reference gone, as the caching allocator sees it) while its copy
  is still queued, without ``record_stream`` on the side stream, is handed to the compute stream's next
  allocation: its bytes are overwritten (NaN) before the copy reads them;
* a chunk handed to the store while copies into its buffers are still queued is flagged.

The stores written so are compared, bit for bit, with the same extraction on the CPU path, and each
planted bug (no ``record_stream`` of the private tensor or of the maxima, no ``wait_stream``, no wait for
the chunk's event in the writer) is caught. The range check on the device maxima is driven through the same
path: a float16 overflow in one chunk is refused naming that chunk's rows.
"""
from __future__ import annotations

import inspect
import re
import sys
import textwrap
import threading
import types
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repsim.extract import capture, pipeline  # noqa: E402
from repsim.extract.errors import ExtractError  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402
from repsim.store.writer import StoreWriter  # noqa: E402

CUDA0 = torch.device("cuda", 0)
_REAL_DEVICE = torch._C.TensorBase.device


class FakeStream:
    def __init__(self, name: str, fake: "Fake"):
        self.name, self.fake = name, fake
        self.waited = 0  # the compute clock at this stream's last wait_stream(compute)

    def wait_stream(self, other: "FakeStream") -> None:
        assert other is self.fake.compute, "the side stream waits for the compute stream only"
        self.waited = self.fake.clock

    def __repr__(self) -> str:
        return f"<fake stream {self.name}>"


class FakeEvent:
    def __init__(self, fake: "Fake"):
        self.fake, self.upto = fake, None

    def record(self, stream: FakeStream) -> None:
        assert stream is self.fake.side, "events are recorded on the copy stream"
        with self.fake.lock:
            self.upto = len(self.fake.ops)  # the side-stream work queued so far

    def synchronize(self) -> None:
        assert self.upto is not None, "synchronize() on an event never recorded"
        self.fake.run_copies(self.upto)


class Op:
    """One queued side-stream copy: ``dest`` (host) <- ``keep`` (the source's storage, held so that the
    stand-in can read it later; the source tensor's own lifetime is watched separately)."""

    def __init__(self, dest: torch.Tensor, keep: torch.Tensor):
        self.dest, self.keep = dest, keep
        self.dest_ptr = dest.untyped_storage().data_ptr()
        self.done = False
        self.recorded = False  # record_stream(side) called on the source
        self.early = False  # may run before its source was computed (no wait_stream)


class Fake:
    """The stand-in device: a compute stream whose work runs at once (the reference order), a side stream
    whose copies wait for an event's synchronize, and what went wrong."""

    def __init__(self):
        self.lock = threading.RLock()
        self.compute = FakeStream("compute", self)
        self.side = FakeStream("copy", self)
        self.local = threading.local()  # the current stream, per thread (torch.cuda.stream is per thread)
        self.clock = 0  # ticks with each value the compute stream produces for a copy (a cast, a stack)
        self.ops: list[Op] = []
        self.by_source: dict[int, Op] = {}  # id(source tensor) -> its queued copy, while the source lives
        self.host: set[int] = set()  # storages of the pinned host buffers
        self.violations: list[str] = []

    def current(self) -> FakeStream:
        return getattr(self.local, "stream", self.compute)

    def queue_copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            op = Op(dest, src.detach())
            if getattr(src, "_fake_tick", self.clock) > self.side.waited:
                op.early = True
                self.violations.append("a copy queued before the side stream waited for its source's computation")
            self.ops.append(op)
            self.by_source[id(src)] = op
            weakref.finalize(src, self.freed, id(src), op)

    def freed(self, key: int, op: Op) -> None:
        """The source tensor's last reference is gone: the caching allocator takes its block back and, unless
        record_stream told it the side stream still uses it, lends it to the compute stream at once."""
        with self.lock:
            if self.by_source.get(key) is op:
                del self.by_source[key]
            if not op.done and not op.recorded:
                self.violations.append("a copy's source freed before the copy ran, without record_stream")
                _poison(op.keep)  # the compute stream's next allocation writes over it

    def recorded(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            op = self.by_source.get(id(tensor))
            if stream is self.side and op is not None:
                op.recorded = True

    def run_copies(self, upto: int) -> None:
        """The side stream's first ``upto`` copies finish now (the latest the hardware may finish them)."""
        with self.lock:
            for op in self.ops[:upto]:
                if not op.done:
                    if op.early:
                        _poison(op.dest)
                    else:
                        _REAL_COPY(op.dest, op.keep)
                    op.done = True

    def pending_into(self, ptr: int) -> bool:
        with self.lock:
            return any(not op.done and op.dest_ptr == ptr for op in self.ops)


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else -7)


_REAL_COPY = torch.Tensor.copy_


class _Patched:
    """torch.cuda with the stand-in's Stream, Event, current_stream and stream."""

    def __init__(self, real, over):
        self._real, self._over = real, over

    def __getattr__(self, name):
        return getattr(self._over, name) if hasattr(self._over, name) else getattr(self._real, name)


@pytest.fixture
def fake(monkeypatch):
    return install_fake(monkeypatch, pipeline._run)


def install_fake(monkeypatch, run) -> Fake:
    """The stand-in in place of torch.cuda's streams and events, and ``run`` (``pipeline._run`` or a planted
    copy) installed as the pipeline's ``_run``, told that its device is ``cuda:0``."""
    fk = Fake()

    class _On:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.before = fk.current()
            fk.local.stream = self.stream

        def __exit__(self, *exc):
            fk.local.stream = self.before
            return False

    cuda = types.SimpleNamespace(Stream=lambda device: fk.side, Event=lambda: FakeEvent(fk),
                                 current_stream=lambda device: fk.compute, stream=_On)
    monkeypatch.setattr(torch, "cuda", _Patched(torch.cuda, cuda))

    def device(t):
        """Inside ``copy_out`` the layer outputs are on ``cuda:0`` and the pinned buffers on the host."""
        real = _REAL_DEVICE.__get__(t)
        if sys._getframe(1).f_code.co_name == "copy_out" and t.untyped_storage().data_ptr() not in fk.host:
            return CUDA0
        return real

    real_empty, real_to, real_stack = torch.empty, torch.Tensor.to, torch.stack

    def empty(*a, pin_memory=False, **k):
        t = real_empty(*a, **k)
        if pin_memory:
            t.zero_()  # (deterministic: what a buffer holds before its first copy)
            fk.host.add(t.untyped_storage().data_ptr())
        return t

    def tick(t):
        if fk.current() is fk.compute:
            with fk.lock:
                fk.clock += 1
                t._fake_tick = fk.clock
        return t

    def copy_(self, src, non_blocking=False):
        if fk.current() is fk.side:
            fk.queue_copy(self, src)
            return self
        return _REAL_COPY(self, src, non_blocking=non_blocking)

    def record_stream(self, stream):
        fk.recorded(self, stream)

    monkeypatch.setattr(torch.Tensor, "device", property(device))
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: tick(real_to(self, *a, **k)))
    monkeypatch.setattr(torch, "stack", lambda *a, **k: tick(real_stack(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)

    write_chunk = StoreWriter.write_chunk

    def checked_write(self, chunk, layers=None, logits=None, **kw):
        for name, arr in {**(layers or {}), **({"logits": logits} if logits is not None else {})}.items():
            if fk.pending_into(arr.__array_interface__["data"][0]):
                fk.violations.append(f"chunk {chunk} of {name} handed to the store while copies into it were queued")
        return write_chunk(self, chunk, layers=layers, logits=logits, **kw)

    monkeypatch.setattr(StoreWriter, "write_chunk", checked_write)
    _on_cuda(monkeypatch, run)
    return fk


def _on_cuda(monkeypatch, run) -> None:
    """``pipeline._run`` (or a planted copy of it) told that its device is ``cuda:0``; its inputs still
    come from the CPU feed (repsim/extract/memory.py's CUDA ring has its own stand-in: test_extract_ring)."""
    real_inputs = pipeline._inputs

    def cpu_inputs(dataset, batches, dev, *a, **k):
        return real_inputs(dataset, batches, torch.device("cpu"), *a, **k)

    if run.__globals__ is vars(pipeline):
        monkeypatch.setattr(pipeline, "_inputs", cpu_inputs)
    else:  # a planted copy reads its own copy of the module's names
        run.__globals__["_inputs"] = cpu_inputs
    sig = inspect.signature(run)

    def on_cuda(*a, **k):
        bound = sig.bind(*a, **k)
        bound.arguments["dev"] = CUDA0
        return run(*bound.args, **bound.kwargs)

    monkeypatch.setattr(pipeline, "_run", on_cuda)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 10))


KW = dict(split="test", batch_size=16, chunk_rows=48, write_threads=2, overlap=True, progress=False, order="dataset")


def _arrays(path) -> dict[str, np.ndarray]:
    store = open_store(path)
    out = {name: np.asarray(store.layer(name)) for name in store.attrs["layers"]}
    out["labels"] = np.asarray(store.labels)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same extraction on the CPU path (no stand-in): the values a correct CUDA run stores."""
    path = tmp_path_factory.mktemp("ref") / "cpu.zarr"
    pipeline.extract_store(_net(), "digits", path, **KW)
    return _arrays(path)


def _assert_same(path, reference) -> None:
    got = _arrays(path)
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_the_cuda_ordering_stores_what_the_cpu_path_stores(fake, reference, tmp_path):
    pipeline.extract_store(_net(), "digits", tmp_path / "cuda.zarr", **KW)
    assert fake.violations == []
    assert fake.ops and all(op.done for op in fake.ops)  # every copy went through the side stream, and ran
    n = len(reference["labels"])
    chunks, per_chunk = -(-n // KW["chunk_rows"]), KW["chunk_rows"] // KW["batch_size"]
    batches = (n // KW["chunk_rows"]) * per_chunk + -(-(n % KW["chunk_rows"]) // KW["batch_size"])
    # one copy per layer (block1, block2, pool, logits) per batch, and each chunk's maxima
    assert len(fake.ops) == 4 * batches + chunks, (len(fake.ops), batches, chunks)
    _assert_same(tmp_path / "cuda.zarr", reference)


def _planted(fn, pattern: str, what: str):
    """``fn``'s source with the lines matching ``pattern`` removed, compiled in its module's namespace."""
    src = textwrap.dedent(inspect.getsource(fn))
    planted = re.sub(pattern, "", src)
    assert planted != src, f"the {what} this test removes is no longer written this way"
    namespace = dict(vars(sys.modules[fn.__module__]))
    exec(compile(planted, f"<planted: no {what}>", "exec"), namespace)  # noqa: S102 - the planted bug
    return namespace[fn.__name__]


PLANTED_COPY_OUT = {
    "record_stream": r"\n\s*private\.record_stream\(self\.copy_stream\)",
    "wait_stream": r"\n\s*self\.copy_stream\.wait_stream\(compute\)",
}


def _extract_goes_wrong(out, reference) -> None:
    """A planted ordering bug shows in the extraction: a NaN that reached the chunk's maxima is refused as
    non-finite, or else the store differs from the reference."""
    try:
        pipeline.extract_store(_net(), "digits", out, **KW)
    except ExtractError as exc:
        assert "non-finite" in str(exc)
    else:
        with pytest.raises(AssertionError):
            _assert_same(out, reference)


@pytest.mark.parametrize("bug", sorted(PLANTED_COPY_OUT))
def test_the_stand_in_catches_a_copy_out_without(bug, fake, reference, tmp_path, monkeypatch):
    """The private tensor not handed to the copy stream (its block lent to the compute stream's next
    allocation before the copy read it), or the copy not ordered after the cast: wrong values, and the
    stand-in says which."""
    monkeypatch.setattr(capture.Capture, "copy_out", _planted(capture.Capture.copy_out, PLANTED_COPY_OUT[bug], bug))
    _extract_goes_wrong(tmp_path / "bad.zarr", reference)
    want = "without record_stream" if bug == "record_stream" else "before the side stream waited"
    assert any(want in v for v in fake.violations), fake.violations


PLANTED_RUN = {
    "event wait": r"\n\s*if buf\.event is not None:\n\s*buf\.event\.synchronize\(\)",
    "maxima record_stream": r"\n\s*stacked\.record_stream\(cap\.copy_stream\)",
}


@pytest.mark.parametrize("bug", sorted(PLANTED_RUN))
def test_the_stand_in_catches_a_run_without(bug, reference, tmp_path, monkeypatch):
    """The writer thread not waiting for the chunk's event (it reads buffers whose copies are still queued)
    or the chunk's maxima freed before their copy ran: caught."""
    fk = install_fake(monkeypatch, _planted(pipeline._run, PLANTED_RUN[bug], bug))
    _extract_goes_wrong(tmp_path / "bad.zarr", reference)
    want = "handed to the store while copies" if bug == "event wait" else "without record_stream"
    assert any(want in v for v in fk.violations), fk.violations


def test_a_float16_overflow_in_one_chunk_is_refused_naming_its_rows(fake, tmp_path):
    """The device maxima, copied beside the chunk and checked by the writer after the chunk's event: an
    output beyond float16's range in row 60 only (chunk 1: rows 48..95) is refused naming those rows, as
    the CPU path refuses it; the chunk before it is written."""
    import zarr

    x = torch.as_tensor(np.random.default_rng(0).normal(size=(120, 1, 8, 8)), dtype=torch.float32)
    x[60] *= 1e6
    data = torch.utils.data.TensorDataset(x, torch.zeros(120, dtype=torch.int64))
    kw = {**KW, "split": None, "meta": {"dataset": {"name": "noise"}}}
    refused = r"layer 'block1' overflows float16 \(max \|value\| .*\) in examples 48\.\.95"
    with pytest.raises(ExtractError, match=refused):
        pipeline.extract_store(_net(), data, tmp_path / "o.zarr", **kw)
    assert fake.violations == []
    written = zarr.open_group(str(tmp_path / "o.zarr"))["written"][...]
    assert written[0] and not written[1]
