"""A CPU stand-in for the CUDA ordering of extract/memory.py's ``MemoryFeed._cuda``: its ring of pinned
staging slots, the host-to-device copies on a side stream and the events that order them.

The real code runs only on a GPU, where a slot reused before the copy out of it has finished would write
wrong data that still passes the store's checksums. Here ``torch.cuda``'s streams and events are stood in
for by a fake device whose copies finish as late as the hardware may let them: a copy issued from a slot
finishes only when an event recorded after it is waited for (``Event.synchronize``, or the compute
stream's ``wait_event``), and not before the gather thread has done all it can meanwhile (it is blocked
on the ring, or done). When a copy finishes, the slot must still hold the bytes it had when the copy was
issued: otherwise the DMA would have read the next batch's rows. The batches yielded are checked against
``dataset[i]``, and a copy of ``_cuda`` with the wait for a slot's last copy removed (a planted bug) is
caught.
"""
from __future__ import annotations

import inspect
import queue as _queue
import re
import textwrap
import threading
import time
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repsim.extract import memory  # noqa: E402

HANG_GUARD_S = 60.0


class Fake:
    """The stand-in: streams, events, the side stream's pending copies, and what went wrong."""

    def __init__(self):
        self.lock = threading.Condition()
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (slot view, its bytes at the copy, seq)
        self.violations: list[str] = []
        self.blocked_on: "_Queue | None" = None  # the ring queue the gather thread waits on
        self.gather_done = False
        self.record_streams: list[tuple[int, object]] = []
        self.compute = FakeStream("compute", self)
        self.waited: list[FakeEvent] = []

    def gather_idle(self) -> bool:
        gather = [t for t in threading.enumerate() if t.name == "extract-gather"]
        if not gather:
            return True
        q = self.blocked_on
        if q is None:
            return False
        with q.mutex:  # blocked_on is cleared under this lock when the wait ends
            return self.blocked_on is q and q._qsize() == 0

    def finish_copies_before(self, event: "FakeEvent") -> None:
        """The copies queued on ``event``'s stream before it was recorded finish now: after the gather
        thread did whatever it could in the meantime (the latest the hardware may finish them)."""
        if threading.current_thread().name != "extract-gather":
            end = time.monotonic() + HANG_GUARD_S
            while not self.gather_idle():
                if time.monotonic() > end:
                    raise AssertionError("hang guard: the gather thread never blocked")
                time.sleep(0.001)
        with self.lock:
            keep = []
            for view, snapshot, seq in self.pending:
                if seq < event.seq:
                    if not torch.equal(view, snapshot):
                        self.violations.append(f"slot reused before its copy (issued as #{seq}) finished")
                else:
                    keep.append((view, snapshot, seq))
            self.pending = keep
            event.done = True


class FakeStream:
    def __init__(self, name: str, fake: Fake):
        self.name, self.fake = name, fake

    def wait_event(self, event: "FakeEvent") -> None:  # the compute stream waits: the copy is done by then
        self.fake.waited.append(event)
        self.fake.finish_copies_before(event)


class FakeEvent:
    counter = 0

    def __init__(self, fake: Fake):
        self.fake, self.done, self.seq = fake, False, None

    def record(self, stream: FakeStream) -> None:
        FakeEvent.counter += 1
        self.seq = FakeEvent.counter

    def synchronize(self) -> None:
        self.fake.finish_copies_before(self)


class _Queue(_queue.Queue):
    """The ring's queues, telling the stand-in when the gather thread waits on one."""

    fake: Fake

    def get(self, block=True, timeout=None):
        if threading.current_thread().name != "extract-gather":
            return super().get(block, timeout)
        with self.not_empty:  # Queue.get, marking the wait under the queue's own lock
            while not self._qsize():
                self.fake.blocked_on = self
                self.not_empty.wait()
            self.fake.blocked_on = None
            item = self._get()
            self.not_full.notify()
            return item


@pytest.fixture
def fake(monkeypatch):
    fk = Fake()
    side = FakeStream("side", fk)
    cuda = types.SimpleNamespace(Stream=lambda device: side, Event=lambda: FakeEvent(fk),
                                 current_stream=lambda device: fk.compute, stream=lambda s: _nullcontext())
    monkeypatch.setattr(torch, "cuda", _Patched(torch.cuda, cuda))
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*a, pin_memory=False, **k):
        return real_empty(*a, **k)

    def to(self, *a, **k):
        dev = a[0] if a else k.get("device")
        if isinstance(dev, torch.device) and dev.type == "cuda":  # the side stream's host-to-device copy
            snapshot = self.clone()
            with fk.lock:
                FakeEvent.counter += 1
                fk.pending.append((self, snapshot, FakeEvent.counter))
            return snapshot.clone()  # the values the copy reads if the slot is left alone until it finishes
        return real_to(self, *a, **k)

    def record_stream(self, stream):
        fk.record_streams.append((id(self), stream))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    _Queue.fake = fk
    monkeypatch.setattr(memory, "queue", types.SimpleNamespace(Queue=_Queue))
    return fk


class _Patched:
    """torch.cuda with the stand-in's Stream, Event, current_stream and stream."""

    def __init__(self, real, over):
        self._real, self._over = real, over

    def __getattr__(self, name):
        return getattr(self._over, name) if hasattr(self._over, name) else getattr(self._real, name)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _source(n=40):
    rng = np.random.default_rng(0)
    images = torch.as_tensor(rng.integers(0, 256, size=(n, 3, 5, 5), dtype=np.uint8))
    return memory.ImageTensor(images, np.arange(n) % 4)


def _run(feed_cls, fake, rows):
    src = _source()
    spans = [(lo, min(lo + 6, 40)) for lo in range(0, 40, 6)]  # 7 batches through 3 slots
    feed = feed_cls(src, rows, spans, torch.device("cuda", 0), channels_last=False, depth=3)
    got = [(x.clone(), labels) for x, labels in feed]
    order = np.arange(40) if rows is None else np.asarray(rows)
    want = [(torch.stack([src[int(i)][0] for i in order[lo:hi]]), src.labels[order[lo:hi]]) for lo, hi in spans]
    return got, want


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_ring_waits_for_each_slots_copy_before_refilling_it(fake, shuffled):
    rows = np.random.default_rng(1).permutation(40) if shuffled else None
    got, want = _run(memory.MemoryFeed, fake, rows)
    assert fake.violations == []
    assert len(got) == len(want) == 7
    for (x, labels), (wx, wl) in zip(got, want):
        torch.testing.assert_close(x, wx, rtol=0, atol=0)  # what dataset[i] yields, bit for bit
        np.testing.assert_array_equal(labels, wl)
    # every batch waited for on the compute stream and handed to it (record_stream) before it was used
    assert len(fake.waited) == 7 and len(fake.record_streams) == 7
    assert all(stream is fake.compute for _, stream in fake.record_streams)


def test_the_stand_in_catches_a_slot_reused_before_its_copy_finished(fake):
    """A planted bug: ``_cuda`` without the wait for a slot's last copy. The gather thread refills a slot
    as soon as it is handed back, while the copy out of it is still in flight."""
    src = textwrap.dedent(inspect.getsource(memory.MemoryFeed._cuda))
    planted = re.sub(r"\n\s*if copied\[s\] is not None:\n\s*copied\[s\]\.synchronize\(\)", "", src)
    assert planted != src, "the wait this test removes is no longer written this way"
    namespace = dict(vars(memory))
    exec(compile(planted, "<planted _cuda>", "exec"), namespace)  # noqa: S102 - the planted bug

    class Buggy(memory.MemoryFeed):
        _cuda = namespace["_cuda"]

    got, want = _run(Buggy, fake, None)
    assert fake.violations, "the stand-in did not see the slot reused before its copy finished"
