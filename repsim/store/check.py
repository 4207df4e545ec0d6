"""Validation of activation stores (behind `repsim check`).

Checks, per store: the schema (repsim store version, required arrays, shapes and chunking along
examples only, dimension names, dtypes — labels (N,) int32, or (N, K) bool in a multi-label store —,
head/logits consistency), completeness (every ``written``
flag set and ``complete`` true), unique example ids, the checksum of every chunk of ``example_ids``,
``labels``, ``token_counts`` (text stores with token layers; counts within the token axis) and ``head``, and NaN/Inf counts per layer and in the logits (streamed chunk by chunk, so
memory is one chunk whatever the store size; a chunk that fails its crc32c checksum, or whose object is
intact but not the one the store's checksum manifest recorded for that array and index — moved,
swapped or copied from elsewhere — is reported by array and chunk; a version-1 store, written before
the manifest, gets a note that this second check is not possible). Across stores: the same dataset name and split where both record them, and equal
``example_ids`` (and labels) row by row, compared with the first store given. Problems are one line
each, naming the store.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class ArrayReport:
    store: str
    layer: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    stored: int
    nan: int | None = None
    inf: int | None = None

    @property
    def ratio(self) -> float:
        return self.nbytes / self.stored if self.stored else float("nan")


@dataclass
class CheckReport:
    arrays: list[ArrayReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth knowing, not a problem

    @property
    def ok(self) -> bool:
        return not self.problems


def _first_mismatch(a, b) -> int:
    """Index of the first row where ``a`` and ``b`` differ, or -1."""
    import numpy as np

    diff = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(diff[0]) if diff.size else -1


def _display_names(paths: Sequence[str]) -> list[str]:
    """Store names (basename without .zarr), or the paths as given where names collide."""
    from repsim.store.format import store_name

    names = [store_name(p) for p in paths]
    return [n if names.count(n) == 1 else p for n, p in zip(names, paths)]


def _schema_problems(label: str, store: Any) -> list[str]:
    """Checks beyond what open_store enforces (dtypes, dimension names, metadata consistency)."""
    import numpy as np

    from repsim.store.format import dimension_names

    out: list[str] = []
    g = store._group
    multilabel = g["labels"].ndim == 2  # multi-label targets (N, K) bool, else one int32 class per example
    expect = {"example_ids": (np.int64, ("example",)),
              "labels": (np.bool_, ("example", "class")) if multilabel else (np.int32, ("example",)),
              "written": (np.bool_, ("chunk",))}
    if "token_counts" in g:  # real tokens per example (text stores with token layers)
        expect["token_counts"] = (np.int32, ("example",))
    for name, (dtype, dims) in expect.items():
        arr = g[name]
        if arr.dtype != np.dtype(dtype):
            out.append(f"store {label}: {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
        if tuple(arr.metadata.dimension_names or ()) != dims:
            out.append(f"store {label}: {name} has dimension names {arr.metadata.dimension_names}, expected {dims}")
    for layer in store.layers:
        arr = store.zarr_array(layer)
        if arr.dtype not in (np.float16, np.float32, np.float64):
            out.append(f"store {label}: layer {layer}: dtype {arr.dtype} is not float16/32/64")
        dims = tuple(arr.metadata.dimension_names or ())
        if dims != dimension_names(arr.ndim) and not (arr.ndim == 3 and dims == dimension_names(3, "tokens")):
            out.append(f"store {label}: layer {layer}: dimension names {dims or None}, expected {dimension_names(arr.ndim)}")
    k = None
    if store.has_logits:
        logits = g["logits"]
        k = logits.shape[1] if logits.ndim == 2 else None
        if logits.ndim != 2 or tuple(logits.chunks[1:]) != tuple(logits.shape[1:]):
            out.append(f"store {label}: logits has shape {logits.shape} / chunks {logits.chunks}, expected (N, K) chunked along examples")
    if "head" in g:
        try:
            W, b = store.head
        except Exception as exc:  # missing weight/bias or corrupted
            out.append(f"store {label}: head unreadable: {exc}")
        else:
            if W.ndim != 2 or b.shape != (W.shape[0],):
                out.append(f"store {label}: head weight {W.shape} and bias {b.shape} do not match")
            elif k is not None and W.shape[0] != k:
                out.append(f"store {label}: head has {W.shape[0]} classes but logits have {k}")
    n_meta = store.dataset.get("n")
    if n_meta is not None and n_meta != store.n:
        out.append(f"store {label}: attrs dataset.n = {n_meta} but the store has {store.n} examples")
    return out


def check_stores(paths: Sequence[str], *, scan_values: bool = True, progress: bool | None = None,
                 allow_mixed_datasets: bool = False, compare: bool = False) -> CheckReport:
    """Validate stores; returns the per-array table and the list of one-line problems.

    Each store is checked on its own (a model's train, holdout and test stores are three good stores).
    ``compare``: the stores are meant to be compared (one ``repsim cka``/``similarity``): every store must
    then hold the first one's examples, labels and (unless ``allow_mixed_datasets``) dataset, else a
    problem; without it such differences are one note."""
    from repsim.store.format import StoreError, store_name
    from repsim.store.reader import open_store

    report = CheckReport()
    opened: list[tuple[str, Any]] = []
    for label, path in zip(_display_names([str(p) for p in paths]), paths):
        try:
            opened.append((label, open_store(path, allow_incomplete=True)))
        except StoreError as exc:
            report.problems.append(_relabel(exc, store_name(path), label))
    show = sys.stderr.isatty() if progress is None else bool(progress)
    rows_ok = {label: _check_one(label, store, report, scan_values=scan_values, show=show) for label, store in opened}
    found: list[str] = []
    _check_alignment(opened, rows_ok, found, allow_mixed_datasets, hint=compare)
    if compare:
        report.problems.extend(found)
    elif found:
        report.notes.append(f"the stores hold different examples or data ({found[0]}{'; ...' if len(found) > 1 else ''}): "
                            "fine, each was checked on its own; `repsim check --compare` checks stores meant to be "
                            "compared in one `repsim cka`/`similarity`")
    return report


def _relabel(exc: Exception, name: str, label: str) -> str:
    """An error message with the store's name replaced by its display label."""
    return str(exc).replace(f"store {name}", f"store {label}", 1)


def _check_one(label: str, store: Any, report: CheckReport, *, scan_values: bool, show: bool):
    """Schema, completeness, unique ids and the streamed NaN/Inf scan of one store.

    Returns the boolean mask of rows that were written (unwritten rows hold fill values)."""
    import numpy as np
    from tqdm.auto import tqdm

    from repsim.store.finite import ConstantLayers
    from repsim.store.format import StoreError

    report.problems.extend(_schema_problems(label, store))
    if store.version < 2:
        report.notes.append(f"store {label}: store version {store.version} (written before repsim recorded where each "
                            "chunk belongs): every chunk's own checksum is verified, but a chunk file moved or swapped "
                            "on disk cannot be detected; rewrite the store to get that check")
    try:
        written = store.written()
    except StoreError as exc:
        report.problems.append(_relabel(exc, store.name, label))
        written = np.zeros(store.n_chunks, bool)
    if not store.complete:
        report.problems.append(
            f"store {label}: incomplete: {int(written.sum())} of {written.size} chunks written and not "
            f"finalized (interrupted writer? resume with StoreWriter.open)"
        )
    rows_ok = np.repeat(written, store.chunk_rows)[: store.n]
    ids = _read_rows(label, store, "example_ids", written, report)
    _read_rows(label, store, "labels", written, report)  # (only their checksums matter here)
    _check_token_counts(label, store, written, report)
    if ids is not None:
        duplicates = ids.size - np.unique(ids).size
        if duplicates:
            report.problems.append(f"store {label}: example_ids are not unique ({duplicates} duplicates)")

    # (table label, array): every layer, then the top-level logits
    arrays = [(layer, f"layers/{layer}") for layer in store.layers]
    if store.has_logits:  # the top-level logits (probes, predictions): listed once, as "logits", when the
        # store also keeps them as a layer; both copies are read, so that either one's damage is found
        arrays.append((None if "logits" in store.layers else "logits", "/logits"))
    counts = {key: [0, 0] for _, key in arrays}
    flat = ConstantLayers([key for _, key in arrays])
    chunks = np.flatnonzero(written) if scan_values else np.array([], int)
    with tqdm(total=int(chunks.size) * len(arrays), desc=f"check {label}", unit="chunk", disable=not show) as bar:
        for i in chunks:  # chunk-major: one chunk of one array in memory at a time
            for _, key in arrays:
                try:
                    x = store.read_chunk(key, int(i))
                except StoreError as exc:
                    report.problems.append(_relabel(exc, store.name, label))
                else:
                    counts[key][0] += int(np.count_nonzero(np.isnan(x)))
                    counts[key][1] += int(np.count_nonzero(np.isinf(x)))
                    flat.see({key: x})
                bar.update(1)
    twin = "layers/logits" if any(layer is None for layer, _ in arrays) else None
    for layer, key in arrays:
        if layer is None:
            continue  # the top-level copy of the logits layer: its counts are in that layer's row
        arr = store.zarr_array(key)
        nan, inf = counts[key] if scan_values else (None, None)
        if key == twin and scan_values:
            nan, inf = max(nan, counts["/logits"][0]), max(inf, counts["/logits"][1])
        report.arrays.append(ArrayReport(label, layer, tuple(arr.shape), str(arr.dtype), int(arr.nbytes), int(arr.nbytes_stored()), nan, inf))
        if nan or inf:
            report.problems.append(f"store {label}: layer {layer}: {nan} NaN and {inf} Inf values")
        elif scan_values and key in flat.constant():
            report.notes.append(
                f"store {label}: layer {layer} holds the same value in every example: CKA, R² and collapse "
                "are undefined for it (NaN)" + (" — float16 storage rounds variation below its resolution to zero: "
                                                "re-extract with --dtype float32 if it should vary"
                                                if arr.dtype == np.float16 else ""))
    return rows_ok


def _check_token_counts(label: str, store: Any, written: Any, report: CheckReport) -> None:
    """``token_counts`` (real tokens per example of a text store with token layers): every chunk's
    checksum, and counts within 0..T of the store's token layers; a text store with token layers and
    without them (written before they existed) gets a note: an average over its tokens counts padding."""
    import numpy as np

    from repsim.store.format import TOKEN_DIMS

    token_len = {store.zarr_array(layer).shape[1] for layer in store.layers
                 if tuple(store.zarr_array(layer).metadata.dimension_names or ()) == TOKEN_DIMS}
    if "token_counts" not in store._group:
        text = "padding to" in str(store.dataset.get("transform") or "")
        if token_len and text:
            report.notes.append(f"store {label}: token layers of padded text without token_counts (written before "
                                "repsim recorded them): their padded positions hold zeros, so an average over tokens "
                                "counts padding as tokens; re-extract to record them")
        return
    counts = _read_rows(label, store, "token_counts", written, report)
    if counts is None or not counts.size:
        return
    top = max(token_len) if token_len else None
    bad = np.flatnonzero((counts < 0) | ((counts > top) if top is not None else False))
    if bad.size:
        report.problems.append(f"store {label}: token_counts out of range 0..{top} (first at written row "
                               f"{int(bad[0])}: {int(counts[bad[0]])})")


def _read_rows(label: str, store: Any, array: str, written: Any, report: CheckReport):
    """The written chunks of a per-example array (``example_ids``, ``labels``), read chunk by chunk
    so that each checksum is verified and a bad chunk is named; None when a chunk fails (reported)."""
    import numpy as np

    from repsim.store.format import StoreError

    parts, ok = [], True
    for i in np.flatnonzero(written):
        try:
            parts.append(store.read_chunk(f"/{array}", int(i)))
        except StoreError as exc:
            report.problems.append(_relabel(exc, store.name, label))
            ok = False
    if not ok:
        return None
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _check_alignment(opened: Sequence[tuple[str, Any]], rows_ok: dict[str, Any], found: list[str],
                     allow_mixed_datasets: bool = False, *, hint: bool = True) -> None:
    """Append to ``found`` one line per store that does not hold the first store's example_ids (and
    labels) row by row, or (unless ``allow_mixed_datasets``) names another dataset or split where both
    record them; ``hint``: the dataset line names --allow-mixed-datasets."""
    import numpy as np

    from repsim.store.format import StoreError, dataset_difference

    if not opened:
        return
    ref_label, ref = opened[0]
    for label, store in opened[1:]:
        diff = None if allow_mixed_datasets else dataset_difference(store.dataset, ref.dataset)
        if diff:
            found.append(f"store {label}: other data than store {ref_label} ({diff})"
                         + ("; pass --allow-mixed-datasets if they hold the same examples in the same order" if hint else ""))
            continue
        try:
            a, b = ref.example_ids, store.example_ids
        except StoreError:
            continue  # already reported
        if a.size != b.size:
            found.append(f"store {label}: {b.size} examples but store {ref_label} has {a.size}; example_ids differ")
            continue
        both = rows_ok[ref_label] & rows_ok[label]  # compare rows written in both stores
        row = _first_mismatch(np.where(both, a, 0), np.where(both, b, 0))
        if row >= 0:
            found.append(f"store {label}: example_ids differ from store {ref_label} (first mismatch at row {row})")
            continue
        try:
            la, lb = ref.labels, store.labels
        except StoreError:
            continue
        if la.shape != lb.shape:
            found.append(f"store {label}: labels have shape {lb.shape} but store {ref_label} has {la.shape}")
            continue
        mask = both.reshape((-1,) + (1,) * (la.ndim - 1))  # multi-label targets: whole rows
        row = _first_mismatch(np.where(mask, la, 0), np.where(mask, lb, 0))  # flat index for (N, K)
        row = row if la.ndim == 1 or row < 0 else row // la.shape[1]
        if row >= 0:
            found.append(f"store {label}: labels differ from store {ref_label} (first mismatch at row {row})")
