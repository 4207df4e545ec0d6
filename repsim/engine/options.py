"""One options object for a streamed run (:class:`StreamOptions`) and the one memory vocabulary.

Every streaming entry point — :func:`repsim.cka_matrix`, :func:`repsim.similarity_matrix` and the
per-layer drivers (:func:`repsim.engine.drivers.layer_metrics`, ``separation_rows``, ``sparsity_rows``,
``collapse_rows``) — takes the same few settings of *how* a run streams, beside its own arguments of
*what* it computes: the device, the reader threads, how many reads run ahead, the memory budget, the
precision of the batch Grams, the progress bar and the scheduler. They travel together as one frozen
:class:`StreamOptions`, built once (from the command line by ``repsim.commands._stream``, or by a Python
caller) and passed down the engine instead of being re-declared layer after layer. The entry points'
former keyword arguments (``device=``, ``threads=``, ``prefetch=``, ``progress=``, ``compute_dtype=``,
``memory_budget=``, ``max_memory=``) still work: they fill the same object (:meth:`StreamOptions.merged`).

**Memory** is one budget in bytes, ``memory_budget``, written with units on the command line
(:func:`parse_size`: ``"512MiB"``, ``"4GiB"``, ``"1.5G"``; a plain number is MiB, the unit
``repsim probe --memory-budget`` always took). What it bounds is what each run holds beyond the
stores' chunks in flight:

- the exact estimators (``method="exact"``, and the measures without a minibatch estimator) hold
  their n x n Grams, cross-covariances or full columns within it (beyond it the run is refused
  before anything is read), and read the stores in panels of at most :func:`panel_bytes` (1/16 of
  the budget, at most 512 MiB);
- the minibatch pass queues reduced columns ahead of the accumulator up to :func:`read_ahead_bytes`
  (the same 1/16, at most 512 MiB);
- the per-layer drivers pack layers into groups whose accumulator state fits it (one pass over a
  store per group; on a cluster capped at a quarter of a worker thread's memory limit);
- ``repsim probe`` / ``calibrate`` load a layer (logits) when its working set fits it, else stream it.

Defaults are the entry point's (:data:`DEFAULT_BUDGETS`): 8 GiB for CKA and the similarity measures
(whose refusal bound it is), 4 GiB for the drivers' accumulator state, 512 MiB for the probes — each
the value the run used before the budget had one name, so results are unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from repsim.units import GiB, MiB, format_size, parse_size

__all__ = ["StreamOptions", "parse_size", "format_size", "panel_bytes", "read_ahead_bytes", "DEFAULT_BUDGETS"]

# the default budget of each kind of run, in bytes (see the module docstring)
DEFAULT_BUDGETS = {"similarity": 8 * GiB, "layers": 4 * GiB, "probe": 512 * MiB}
PANEL_BYTES = 512 * MiB  # the most one panel of the exact estimators' read (and the read-ahead queue) holds
PANEL_SHARE = 16  # ... and at most this fraction of the budget

DTYPES = (None, "float32", "float64")


def panel_bytes(budget: int) -> int:
    """Bytes of one panel of the exact estimators' read (rows of every column kept while their Grams or
    columns are filled): 1/:data:`PANEL_SHARE` of the memory ``budget``, at most :data:`PANEL_BYTES`."""
    return max(1, min(PANEL_BYTES, int(budget) // PANEL_SHARE))


def read_ahead_bytes(budget: int) -> int:
    """Bytes of reduced columns the minibatch pass's host readers may queue ahead of the accumulator:
    the same share of ``budget`` as :func:`panel_bytes`."""
    return panel_bytes(budget)


@dataclass(frozen=True)
class StreamOptions:
    """How a streamed run reads and computes (not what it computes); see the module docstring.

    ``device``: ``"cpu"`` (NumPy; the default of the Python API), ``"cuda"`` (CuPy), ``"auto"`` (cuda
    when a GPU and CuPy are usable, else cpu: the command line's default), or an array-API namespace.
    ``threads``: reader threads (None: 2 on the CPU, one per core up to 16 on a device).
    ``read_ahead``: reads in flight ahead of the consumer (the former ``prefetch``), >= 0.
    ``memory_budget``: bytes (None: the entry point's default, :data:`DEFAULT_BUDGETS`).
    ``panel_bytes``: the exact estimators' read panel, bytes (None: :func:`panel_bytes` of the budget;
    the former ``memory_budget=`` keyword of ``cka_matrix``/``similarity_matrix`` sets it).
    ``dtype``: precision of the batch Grams (None: float32 for float16/float32 layers, float64 for
    float64 ones; the CLI's ``--compute-dtype``).
    ``progress``: a progress bar on stderr (None: when stderr is a terminal).
    ``scheduler``: None (whatever :func:`repsim.set_scheduler` set: this process by default), ``"threads"``,
    ``"local:N"`` or a dask scheduler address; the entry point runs inside ``scheduler(...)`` for it.
    """

    device: Any = "cpu"
    threads: int | None = None
    read_ahead: int = 2
    memory_budget: int | None = None
    panel_bytes: int | None = None
    dtype: str | None = None
    progress: bool | None = None
    scheduler: Any = None

    def __post_init__(self) -> None:
        if self.threads is not None and int(self.threads) < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if int(self.read_ahead) < 0:
            raise ValueError(f"read_ahead (prefetch) must be >= 0, got {self.read_ahead}")
        for name in ("memory_budget", "panel_bytes"):
            value = getattr(self, name)
            if value is not None and int(value) < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {self.dtype!r}")

    def merged(self, **given: Any) -> "StreamOptions":
        """A copy with every field of ``given`` that is not None replaced: the entry points' keyword
        arguments (``device=``, ``threads=``, ...) over the object passed as ``stream=``."""
        changes = {key: value for key, value in given.items() if value is not None}
        return dataclasses.replace(self, **changes) if changes else self

    def budget(self, kind: str) -> int:
        """The memory budget in bytes: the one asked for, else the default of ``kind`` (:data:`DEFAULT_BUDGETS`)."""
        return int(self.memory_budget) if self.memory_budget is not None else DEFAULT_BUDGETS[kind]

    def panel(self, kind: str) -> int:
        """The exact estimators' read panel in bytes (``panel_bytes``, else :func:`panel_bytes` of the budget)."""
        return int(self.panel_bytes) if self.panel_bytes is not None else panel_bytes(self.budget(kind))

    def describe(self) -> dict[str, Any]:
        """The fields as plain data (a namespace device by its name), for logs and result metadata."""
        out = dataclasses.asdict(self)
        if not isinstance(self.device, str):
            out["device"] = getattr(self.device, "__name__", str(self.device))
        if not isinstance(self.scheduler, (str, type(None))):
            out["scheduler"] = type(self.scheduler).__name__
        return out
