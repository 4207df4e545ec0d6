"""The all-pairs minibatch CKA accumulator (Nguyen, Raghu & Kornblith 2021; paper §3.2):

    CKA_mb(i, j) = Σ_b HSIC₁(K_ib, K_jb) / sqrt(Σ_b HSIC₁(K_ib, K_ib) · Σ_b HSIC₁(K_jb, K_jb)),

the per-batch HSIC matrices from :func:`repsim.kernels.hsic.batch_hsic` (algorithm, precision and
error bound there), summed, merged and bootstrapped here.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np

from repsim.kernels.hsic import batch_hsic_and_widths, hsic_to_cka

__all__ = ["MinibatchCKA"]

_STATE_VERSION = 2  # 2: records carry how many batches each sums (record_batches)
MAX_RECORDS = 512
MIN_CI_BATCHES = 30  # fewer batches per bootstrap resample undercover (MinibatchCKA.ci)


class MinibatchCKA:
    """All-pairs minibatch CKA accumulator (protocol: update / merge / result / to_state / from_state; ci).

    ``update([X_1, ..., X_L])`` adds one minibatch (each X_l (b, ...) on the same b examples; conv
    maps are flattened). The list may be any sequence read item by item (see :func:`~repsim.kernels.hsic.batch_hsic`):
    a lazy one lets a driver load one layer's batch at a time. ``.hsic`` holds the float64 (L, L) sums of per-batch HSIC, ``.n_batches``
    the number of batches. With ``keep_batches`` the per-batch upper triangles are kept so that
    :meth:`ci` can give percentile-bootstrap intervals over batches.

    Bounded records: at most ``max_records`` (default 512) records are kept, whatever the number of
    batches (epochs × n / b). Past that, adjacent records are summed in pairs, so that each record holds
    m = 2, 4, … consecutive batches (batch means; a record may hold fewer: the last one, and those of
    accumulators merged in), and new batches fill the last record up to m. Memory and checkpoint size are then O(max_records · L²) instead of
    O(epochs · n/b · L²) (ImageNet's 1.28 M rows, 306 columns, 10 epochs at b = 1500: 3.0 GiB of
    records, and ~1.6 TiB written by the checkpoints that rewrite them, against 0.18 GiB per save).
    The bootstrap then resamples every record and widens the deviations to the spread of ``draws``
    batches (:meth:`ci`); below the cap nothing changes.

    Constant layers: NaN or infinity in a layer is refused (``ValueError`` naming it), but a layer
    that is constant over a batch (zero variance to working precision, :func:`~repsim.kernels._precision.constant_tolerance`)
    adds nothing to that batch's sums — its Gram is taken as exactly zero — and a layer constant
    over every batch has no CKA: ``result()`` gives NaN in its row and column, with one
    ``RuntimeWarning`` naming such layers (:meth:`undefined`), while every other pair is computed.

    ``merge`` adds sums and concatenates batch records, so accumulators built on any split of the
    batches combine to the one-shot result (to float64 rounding) in any merge order. The bootstrap
    first sorts the batch records into a canonical (lexicographic) order, so its intervals do not
    depend on the merge order either (below ``max_records``; past it, records are formed in the order
    batches and merges arrive, as the engine's are: in segment order).

    ``debiased`` (default True: the paper's unbiased HSIC₁, as every linear-CKA entry point at its
    defaults, :func:`repsim.linear_cka` included); ``names`` (e.g. "store/layer") label layers in error messages; ``compute_dtype`` None picks
    each layer's Gram precision from its dtype (float32 Grams for float16/float32 layers, float64
    otherwise; :mod:`repsim.kernels.hsic`, "Precision and error bound"); ``block_bytes`` bounds the
    per-batch buffer A (L × ≈ n(n + 128)/2 float64, split into groups of panels beyond it).
    Peak extra memory per update: A plus, per BLAS thread, one centred layer and its Gram when A
    fits in ``block_bytes`` (default 1 GiB: e.g. up to 110 layers at n = 1500; 4 GiB on an
    accelerator, whose route is described in ``kernels/_cka_device.py``), else A's group
    plus all centred layers of the batch.  An A of at most 256 MiB is kept for the next update
    (:func:`~repsim.kernels.hsic.release_buffers` frees it).
    """

    def __init__(self, n_layers: int, debiased: bool = True, keep_batches: bool = True, *,
                 names: Sequence[str] | None = None, compute_dtype: str | None = None,
                 block_bytes: int | None = None, max_records: int = MAX_RECORDS) -> None:
        if int(n_layers) < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.n_layers = int(n_layers)
        self.debiased = bool(debiased)
        self.keep_batches = bool(keep_batches)
        if names is not None and len(names) != self.n_layers:
            raise ValueError(f"names has {len(names)} entries for {self.n_layers} layers")
        self.names = [str(s) for s in names] if names is not None else None
        if compute_dtype not in (None, "float32", "float64"):
            raise ValueError(f"compute_dtype must be None, 'float32' or 'float64', got {compute_dtype!r}")
        self.compute_dtype = compute_dtype
        self.block_bytes = None if block_bytes is None else int(block_bytes)
        self.hsic = np.zeros((self.n_layers, self.n_layers), dtype=np.float64)
        self.n_batches = 0
        self.n_examples = 0
        if int(max_records) < 2:
            raise ValueError(f"max_records must be >= 2, got {max_records}")
        self.max_records = int(max_records)
        self._batches: list[np.ndarray] = []  # records: upper triangles of summed per-batch HSIC
        self._counts: list[int] = []  # batches summed in each record
        self._per_record = 1  # m: batches a full record holds
        self._iu = np.triu_indices(self.n_layers)
        self._widths: list[int | None] = [None] * self.n_layers  # features per layer, once seen

    # -- protocol ------------------------------------------------------------------------------
    def update(self, layers: Sequence[Any], *, xp: Any = None) -> "MinibatchCKA":
        """Add one minibatch: a list of L arrays (b, ...) of activations on the same b examples."""
        if len(layers) != self.n_layers:
            raise ValueError(f"update got {len(layers)} layers, expected {self.n_layers}")
        h, n, seen = batch_hsic_and_widths(layers, self.debiased, xp, self.compute_dtype, self.block_bytes, 128,
                                 self._names(), False, self._widths)
        self._widths = [w if w is not None else s for w, s in zip(self._widths, seen)]
        self.hsic += h
        self.n_batches += 1
        self.n_examples += n
        if self.keep_batches:
            self._add_record(h[self._iu], 1)
        return self

    def _add_record(self, record: np.ndarray, batches: int) -> None:
        """Fill the last record up to m batches, else start one; past ``max_records``, pair them up."""
        if self._counts and self._counts[-1] < self._per_record:
            self._batches[-1] = self._batches[-1] + record
            self._counts[-1] += batches
        else:
            self._batches.append(np.array(record, dtype=np.float64))
            self._counts.append(int(batches))
        while len(self._batches) > self.max_records:
            self._pair_up()

    def _pair_up(self) -> None:
        """Sum adjacent records in pairs: a full record now holds twice the batches."""
        self._per_record *= 2
        pairs = range(0, len(self._batches), 2)
        self._batches = [sum(self._batches[i:i + 2]) for i in pairs]
        self._counts = [sum(self._counts[i:i + 2]) for i in pairs]

    def merge(self, other: "MinibatchCKA") -> "MinibatchCKA":
        """Add ``other``'s batches into this accumulator (in place) and return self."""
        if not isinstance(other, MinibatchCKA):
            raise TypeError(f"cannot merge {type(other).__name__} into MinibatchCKA")
        if (other.n_layers, other.debiased) != (self.n_layers, self.debiased):
            raise ValueError(
                f"cannot merge MinibatchCKA(n_layers={other.n_layers}, debiased={other.debiased}) into "
                f"MinibatchCKA(n_layers={self.n_layers}, debiased={self.debiased})"
            )
        names = self._names()
        for i, (a, b) in enumerate(zip(self._widths, other._widths)):
            if a is not None and b is not None and a != b:
                raise ValueError(f"cannot merge: {names[i]} has {b} features there but {a} here")
        self._widths = [a if a is not None else b for a, b in zip(self._widths, other._widths)]
        self.hsic += other.hsic
        self.n_batches += other.n_batches
        self.n_examples += other.n_examples
        if self.keep_batches:
            if not other.keep_batches and other.n_batches:
                raise ValueError("cannot merge an accumulator without per-batch records into one that keeps them")
            for record, batches in zip(other._batches, other._counts):
                self._add_record(record, batches)
        return self

    def result(self) -> np.ndarray:
        """(L, L) CKA values: NaN in the rows and columns of :meth:`undefined` layers, named in one
        ``RuntimeWarning``.  Bootstrap intervals are :meth:`ci`."""
        self._require_batches("result")
        self._warn_undefined()
        return hsic_to_cka(self.hsic, self._names(), undefined="nan")

    def ci(self, level: float = 0.95, *, n_boot: int = 1000, seed: int = 0,
           draws: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) bootstrap bounds, each (L, L), at confidence ``level`` (e.g. 0.95).

        Percentile bootstrap over batches: ``n_boot`` resamples of ``draws`` batch records (default
        all B) drawn with replacement (``numpy.random.default_rng(seed)``, records in canonical
        order), each giving a CKA matrix from its HSIC sums; bounds are the (1-level)/2 and
        (1+level)/2 quantiles (linear interpolation). Resamples whose self-HSIC sum is not positive
        are dropped for that entry.  Undefined layers (all-NaN rows and columns) are named in one
        ``RuntimeWarning``, as by :meth:`result`.

        Batches must be independent samples for this to be a confidence interval. Batches of one
        pass over a data set are (disjoint examples); batches of E passes over the *same* n
        examples are not: more epochs average out how the examples are grouped into batches, but
        not which n examples were drawn. Resampling all E·B' records would shrink the interval by
        about √E for no new data, so give ``draws`` = batches per epoch (B'): an m-out-of-n
        bootstrap whose resamples have the size, and so the spread, of a single pass.
        ``CKAResult.ci`` does this. Past ``max_records`` (records of m batches), every record is
        resampled and the deviations from the estimate are widened by √(B / draws) instead, the same
        spread to first order without resamples of too few records.

        Coverage of a nominal 95 % (``bench/coverage.py``: Gaussian layers with a planted relation, 2,000
        data sets): 94.3 % at 64 batches, 93.0 % at 32, 91.2 % at 16 and 88.0 % at 8, so fewer than
        ``MIN_CI_BATCHES`` batches per resample get a ``RuntimeWarning``; the multi-epoch rule errs on the
        safe side (97.6 % over 3 epochs).
        """
        self._require_batches("ci")
        self._warn_undefined()
        if not 0 < level < 1:
            raise ValueError(f"ci must lie in (0, 1), got {level}")
        if not self.keep_batches:
            raise ValueError("confidence intervals need keep_batches=True")
        if draws is not None and not 1 <= int(draws) <= self.n_batches:
            raise ValueError(f"draws must be in [1, {self.n_batches}], got {draws}")
        if (self.n_batches if draws is None else int(draws)) < 2:
            raise ValueError(
                f"a bootstrap interval resamples batches, and {'there is' if draws is None else 'each resample holds'} "
                f"only one ({self.n_examples // max(self.n_batches, 1)} examples): every resample would equal the "
                "estimate (lo = hi). Use a batch size below half the examples for an interval")
        size = self.n_batches if draws is None else int(draws)
        if size < MIN_CI_BATCHES:
            warnings.warn(f"a bootstrap over {size} batches undercovers: measured about 88 % at 8 batches and 91 % at "
                          f"16 for a nominal 95 % (percentile bootstrap, few resampling units); {MIN_CI_BATCHES} or more "
                          "batches per epoch (a smaller batch size) give it its nominal coverage",
                          RuntimeWarning, stacklevel=2)
        binned = bool(self._counts) and max(self._counts) > 1
        with warnings.catch_warnings():  # undefined layers: all-NaN columns, named above
            warnings.simplefilter("ignore", RuntimeWarning)
            if draws is None or not binned:
                return self._bootstrap(level, n_boot, seed, None if draws is None else int(draws))
            # records of m batches: every record resampled (all of them: a resample of draws/m records is
            # too coarse when there are few — 2-5 of them covered 80-87 % for a nominal 95 %), and the
            # deviations from the estimate widened to the spread of `draws` batches, √(B / draws)
            # (a percentile commutes with this affine map)
            lo, hi = self._bootstrap(level, n_boot, seed, None)
            est = hsic_to_cka(self.hsic, self._names(), undefined="nan")
            R = len(self._batches)  # (≥ max_records / 2 once records are paired; R/(R-1): the bootstrap's
            widen = math.sqrt(self.n_batches / int(draws) * R / (R - 1))  # variance of a mean of R is (R-1)/R short)
            return est + widen * (lo - est), np.minimum(est + widen * (hi - est), 1.0)

    def _require_batches(self, what: str) -> None:
        if self.n_batches == 0:
            raise ValueError(f"MinibatchCKA.{what}() called before any update")

    def _warn_undefined(self) -> None:
        undefined = self.undefined()
        if undefined:
            warnings.warn(f"CKA is undefined (NaN) for {len(undefined)} layer(s) constant over every batch: "
                          f"{', '.join(undefined[:8])}{' ...' if len(undefined) > 8 else ''}",
                          RuntimeWarning, stacklevel=3)

    def to_state(self) -> dict[str, Any]:
        """Plain NumPy arrays and scalars; ``from_state(to_state())`` is an exact round trip."""
        L = self.n_layers
        batches = (np.stack(self._batches) if self._batches
                   else np.zeros((0, L * (L + 1) // 2), dtype=np.float64))
        counts = np.array(self._counts, dtype=np.int64)
        return {
            "kind": "MinibatchCKA",
            "version": _STATE_VERSION,
            "n_layers": L,
            "debiased": self.debiased,
            "keep_batches": self.keep_batches,
            "names": np.array(self.names if self.names is not None else [], dtype=np.str_),
            "has_names": self.names is not None,
            "compute_dtype": self.compute_dtype or "",
            "block_bytes": 0 if self.block_bytes is None else self.block_bytes,  # 0: the default
            "hsic": self.hsic.copy(),
            "n_batches": self.n_batches,
            "n_examples": self.n_examples,
            "batches": batches,
            "record_batches": counts,
            "per_record": self._per_record,
            "max_records": self.max_records,
            "widths": np.array([-1 if w is None else w for w in self._widths], dtype=np.int64),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "MinibatchCKA":
        if str(state.get("kind")) != "MinibatchCKA":
            raise ValueError(f"not a MinibatchCKA state (kind={state.get('kind')!r})")
        names = [str(s) for s in np.asarray(state["names"]).tolist()] if bool(state["has_names"]) else None
        acc = cls(int(state["n_layers"]), debiased=bool(state["debiased"]),
                  keep_batches=bool(state["keep_batches"]), names=names,
                  compute_dtype=str(state["compute_dtype"]) or None,
                  block_bytes=int(state["block_bytes"]) or None,
                  max_records=int(state.get("max_records", MAX_RECORDS)))
        acc.hsic = np.array(state["hsic"], dtype=np.float64)
        acc.n_batches = int(state["n_batches"])
        acc.n_examples = int(state["n_examples"])
        acc._batches = [np.array(r, dtype=np.float64) for r in np.asarray(state["batches"])]
        # (version 1 states kept one record per batch)
        acc._counts = [int(c) for c in np.asarray(state.get("record_batches", np.ones(len(acc._batches))))]
        acc._per_record = int(state.get("per_record", 1))
        while len(acc._batches) > acc.max_records:  # a version-1 state of more batches than records
            acc._pair_up()
        if "widths" in state:  # (states written before widths were recorded have none)
            acc._widths = [None if int(w) < 0 else int(w) for w in np.asarray(state["widths"]).reshape(-1)]
        return acc

    # -- helpers -------------------------------------------------------------------------------
    def undefined(self) -> list[str]:
        """Names of the layers with no CKA: constant over every batch (self-HSIC sum not positive;
        a batch in which a layer is constant adds nothing to its sums, see :func:`~repsim.kernels._precision.zero_constant`)."""
        return [self._names()[l_] for l_ in np.flatnonzero(~(np.diag(self.hsic) > 0))]

    def _names(self) -> list[str]:
        return self.names if self.names is not None else [f"layer {i}" for i in range(self.n_layers)]

    def batch_hsic(self) -> np.ndarray:
        """Per-batch HSIC records, (B, L, L) float64, in canonical order (past ``max_records``, each
        record is the sum of the batches :attr:`record_batches` gives)."""
        L = self.n_layers
        rec = self._canonical()[0]
        out = np.zeros((rec.shape[0], L, L))
        out[:, self._iu[0], self._iu[1]] = rec
        out[:, self._iu[1], self._iu[0]] = rec
        return out

    @property
    def record_batches(self) -> np.ndarray:
        """Batches summed in each record, in :meth:`batch_hsic`'s canonical order."""
        return self._canonical()[1]

    def _canonical(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._batches:
            return np.zeros((0, self.n_layers * (self.n_layers + 1) // 2)), np.zeros(0, dtype=np.int64)
        rec = np.stack(self._batches)
        order = np.lexsort(rec.T[::-1])
        return rec[order], np.asarray(self._counts, dtype=np.int64)[order]

    def _bootstrap(self, ci: float, n_boot: int, seed: int, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        L = self.n_layers
        rec = self._canonical()[0]  # (B, T)
        B = rec.shape[0]
        m = B if m is None else m
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, B, size=(n_boot, m))
        counts = np.zeros((n_boot, B))
        np.add.at(counts, (np.repeat(np.arange(n_boot), m), draws.ravel()), 1.0)
        iu0, iu1 = self._iu
        diag_cols = np.flatnonzero(iu0 == iu1)  # column of (i, i) in the triangle order
        diag = counts @ rec[:, diag_cols]  # (n_boot, L)
        with np.errstate(invalid="ignore", divide="ignore"):
            root = np.sqrt(np.where(diag > 0, diag, np.nan))
        q = [100 * (1 - ci) / 2, 100 * (1 + ci) / 2]
        lo_t = np.empty(rec.shape[1])
        hi_t = np.empty(rec.shape[1])
        step = max(1, (1 << 24) // max(n_boot, 1))
        for s in range(0, rec.shape[1], step):
            cols = slice(s, s + step)
            sums = counts @ rec[:, cols]
            cka = sums / (root[:, iu0[cols]] * root[:, iu1[cols]])
            lo_t[cols], hi_t[cols] = np.nanpercentile(cka, q, axis=0)
        lower = np.zeros((L, L))
        upper = np.zeros((L, L))
        lower[iu0, iu1] = lo_t
        lower[iu1, iu0] = lo_t
        upper[iu0, iu1] = hi_t
        upper[iu1, iu0] = hi_t
        return lower, upper
