"""The results of :func:`repsim.cka_matrix` (:class:`CKAResult`) and :func:`repsim.similarity_matrix`
(:class:`SimilarityResult`, read back by :func:`load_result`), saved and loaded as ``.npz``; atomic
``.npz`` writes shared by every result file the engine writes."""
from __future__ import annotations

import contextlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from repsim.fileio import atomic_write


_STATE_PREFIX = "state__"
_CALIB_PREFIX = "calibration__"  # SimilarityResult: "calibration__<measure>__<observed|null|pvalues|threshold|calibrated>"
_JACK_PREFIX = "jackknife__"  # SimilarityResult: "jackknife__<measure>": (G, L, L) delete-a-group replicates


@dataclass
class CKAResult:
    """CKA between every pair of columns.

    ``values`` (L, L) float64; ``index`` [(store, layer)] labels rows and columns; ``meta`` the
    estimator settings (method, debiased, batch_size, epochs, seed, shuffle scheme, n, spatial,
    device) and ``meta["stores"]``, the provenance of every store (path, attrs, example-id digest);
    ``state`` the ``MinibatchCKA.to_state()`` dict with the per-batch HSIC statistics used for
    bootstrap confidence intervals (``None`` for ``method="exact"``).
    """

    values: np.ndarray
    index: list[tuple[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] | None = None

    @property
    def stores(self) -> list[str]:
        """Store names in index order, each once."""
        return list(dict.fromkeys(s for s, _ in self.index))

    def layers(self, store: str | None = None) -> list[str]:
        """Layer names of ``store`` (default: the first store) in index order."""
        store = self.stores[0] if store is None else store
        return [layer for s, layer in self.index if s == store]

    def position(self, store: str, layer: str) -> int:
        try:
            return self.index.index((store, layer))
        except ValueError:
            raise KeyError(f"({store!r}, {layer!r}) is not in this result; stores: {self.stores}") from None

    def get(self, store_a: str, layer_a: str, store_b: str, layer_b: str) -> float:
        return float(self.values[self.position(store_a, layer_a), self.position(store_b, layer_b)])

    def block(self, store_a: str, store_b: str | None = None) -> np.ndarray:
        """The (layers of a) × (layers of b) sub-matrix: one panel of paper Fig. 2a."""
        store_b = store_a if store_b is None else store_b
        rows = [i for i, (s, _) in enumerate(self.index) if s == store_a]
        cols = [i for i, (s, _) in enumerate(self.index) if s == store_b]
        if not rows or not cols:
            raise KeyError(f"unknown store {store_a if not rows else store_b!r}; stores: {self.stores}")
        return self.values[np.ix_(rows, cols)]

    def ci(self, level: float = 0.95, *, n_boot: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Bootstrap confidence interval (lower, upper), each (L, L), from the per-batch statistics.

        Resamples have the size of one epoch (``meta["batches_per_epoch"][0]`` batches, drawn
        from the records of all epochs): every epoch re-reads the same n examples, so E epochs do
        not make the estimate E times more certain about the data; see ``MinibatchCKA.ci``.
        """
        if self.state is None:
            raise ValueError("this result has no per-batch statistics (method='exact' or saved without them)")
        from repsim.kernels.minibatch_cka import MinibatchCKA

        acc = MinibatchCKA.from_state(self.state)
        per_epoch = self.meta.get("batches_per_epoch")
        draws = min(int(per_epoch[0]), acc.n_batches) if per_epoch else None
        return acc.ci(level, n_boot=n_boot, seed=seed, draws=draws)

    def save(self, path: str | os.PathLike, *, overwrite: bool = True) -> str:
        """Write ``.npz`` (docs/architecture.md "Results files"): ``values``, ``stores``, ``layers``, ``meta``
        (JSON string) and ``state__<key>`` for every per-batch statistic.  Atomic; ``overwrite=False``:
        a create that fails (:class:`~repsim.fileio.OutputConflict`, this result kept beside it) when the
        file exists."""
        arrays: dict[str, Any] = {
            "values": np.asarray(self.values, dtype=np.float64),
            "stores": np.array([s for s, _ in self.index], dtype=str),
            "layers": np.array([layer for _, layer in self.index], dtype=str),
            "meta": np.array(json.dumps(self.meta, sort_keys=True, default=_json_default)),
        }
        for key, value in (self.state or {}).items():
            arrays[_STATE_PREFIX + key] = np.asarray(value)
        return _atomic_savez(path, arrays, exclusive=not overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CKAResult":
        with _opened_result(path) as z:
            state = {k[len(_STATE_PREFIX):]: _unwrap(z[k]) for k in z.files if k.startswith(_STATE_PREFIX)}
            return cls(values=np.array(z["values"]), index=list(zip(z["stores"].tolist(), z["layers"].tolist())),
                       meta=json.loads(str(z["meta"])), state=state or None)

    def as_similarity(self) -> "SimilarityResult":
        """This result as a :class:`SimilarityResult` holding the one measure ``linear_cka``."""
        meta = dict(self.meta, measures=["linear_cka"], estimators={"linear_cka": self.meta.get("method")})
        return SimilarityResult({"linear_cka": self.values}, list(self.index), meta,
                                {"linear_cka": self.state} if self.state else {})

    def to_pandas(self, *, wide: bool = False) -> Any:
        """As :meth:`SimilarityResult.to_pandas` (measure ``linear_cka``)."""
        return self.as_similarity().to_pandas(wide=wide)

    def to_xarray(self) -> Any:
        """As :meth:`SimilarityResult.to_xarray` (measure ``linear_cka``); needs ``repsim-toolkit[xarray]``."""
        return self.as_similarity().to_xarray()

    def plot(self, *, stores: Sequence[str] | None = None, layers: Any = None, kind: str = "matrix",
             title: str | None = None) -> Any:
        """As :meth:`SimilarityResult.plot` (measure ``linear_cka``): a matplotlib Figure."""
        return self.as_similarity().plot("linear_cka", stores=stores, layers=layers, kind=kind, title=title)

    def __repr__(self) -> str:
        from repsim.engine.result_views import describe

        return describe(self.as_similarity(), "CKAResult")


_MEASURE_KEYS = ("measures", "estimators", "measure_info", "undefined")  # SimilarityResult's own meta


@dataclass
class SimilarityResult:
    """Several similarity measures between every pair of columns (:func:`repsim.similarity_matrix`).

    ``values`` {measure: (L, L) float64} (row = first argument for asymmetric measures); ``index``
    [(store, layer)] labels rows and columns; ``meta`` the estimator settings as in
    :class:`CKAResult`, plus ``measures`` (in order), ``estimators`` {measure: "minibatch" | "exact"},
    ``measure_info`` {measure: declared metadata and options} and ``undefined`` {measure: columns,
    pairs}; ``states`` {measure: accumulator state} of the minibatch measures (bootstrap CIs).
    Saved as ``.npz``: ``measures``, ``values__<measure>``, ``stores``, ``layers``, ``meta`` (JSON),
    ``state__<measure>__<key>``, and with a null ``calibration__<measure>__<key>`` (``observed``, ``pvalues``,
    ``threshold``, ``calibrated``; ``null`` (K, L, L) for a permutation null, ``null_mean``/``null_var``/
    ``null_mu3`` for the analytic one), and with ``jackknife=G`` ``jackknife__<measure>`` (G, L, L);
    :func:`load_result` reads it (and ``cka_*.npz`` files).
    """

    values: dict[str, np.ndarray]
    index: list[tuple[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    # {measure: {"observed", "pvalues", "threshold", "calibrated", "null" (K, L, L) | "null_mean", ...}}
    calibration: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # {measure: (G, L, L) delete-a-group jackknife replicates} of the exact estimators (jackknife=G)
    jackknife: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def measures(self) -> list[str]:
        return list(self.values)

    # -- calibration (Gröger et al. 2026; repsim.kernels.permutation) ----------------------------------
    def _calibrated(self, measure: str, key: str) -> np.ndarray:
        self.matrix(measure)
        if measure not in self.calibration:
            raise ValueError(f"{measure} has no null in this result: compute it with permutations=K "
                             "(repsim similarity --permutations K) or null='analytic'")
        return self.calibration[measure][key]

    def pvalues(self, measure: str) -> np.ndarray:
        """(L, L) permutation p-values (1 + #{null ≥ observed}) / (K + 1) (analytic null: Pearson III)."""
        return self._calibrated(measure, "pvalues")

    def threshold(self, measure: str) -> np.ndarray:
        """(L, L) thresholds τ: the ⌈(1 − α)(K + 1)⌉-th order statistic of the observed and null scores."""
        return self._calibrated(measure, "threshold")

    def calibrated(self, measure: str) -> np.ndarray:
        """(L, L) calibrated scores clip((s − τ)/(s_max − τ), 0, 1) (ReLU(s − τ) without an upper bound):
        0 where the score does not exceed chance at level α."""
        return self._calibrated(measure, "calibrated")

    def null(self, measure: str) -> np.ndarray:
        """(K, L, L) null scores of a permutation null (draw k, entry (i, j): column j's store permuted)."""
        arrays = self.calibration.get(measure, {})
        if arrays and "null" not in arrays:
            raise ValueError(f"{measure}'s null is analytic (moments, no draws): a layer aggregate needs "
                             "permutation draws (permutations=K)")
        return self._calibrated(measure, "null")

    def aggregate(self, measure: str, store_a: str, store_b: str | None = None, agg: str = "max",
                  alpha: float | None = None) -> dict[str, float]:
        """Layer-aggregate calibration (Gröger et al. 2026, Algorithm 2; ``calibrate_layers``): the
        aggregate (``"max"`` or ``"mean"``) of the (layers of a) × (layers of b) block and its
        calibration against the same aggregate of every draw's block — valid because one permutation
        serves every layer of a store within a draw.  ``{"value", "pvalue", "threshold", "calibrated"}``."""
        from repsim.kernels.measures import get_measure
        from repsim.kernels.measures.exact import aggregate_calibration, smax_of

        nulls = self.null(measure)
        store_b = store_a if store_b is None else store_b
        rows = [i for i, (s, _) in enumerate(self.index) if s == store_a]
        cols = [i for i, (s, _) in enumerate(self.index) if s == store_b]
        if not rows or not cols:
            raise KeyError(f"unknown store {store_a if not rows else store_b!r}; stores: {self.stores}")
        a = float(self.meta.get("calibration", {}).get("alpha", 0.05)) if alpha is None else float(alpha)
        return aggregate_calibration(self.calibration[measure]["observed"][np.ix_(rows, cols)],
                                     nulls[:, rows][:, :, cols], a, agg, smax_of(get_measure(measure)))

    @property
    def stores(self) -> list[str]:
        """Store names in index order, each once."""
        return list(dict.fromkeys(s for s, _ in self.index))

    def matrix(self, measure: str) -> np.ndarray:
        """The (L, L) matrix of ``measure``."""
        if measure not in self.values:
            raise KeyError(f"{measure!r} was not computed; measures: {', '.join(self.values)}")
        return self.values[measure]

    def info(self, measure: str) -> dict[str, Any]:
        """The declared metadata of ``measure`` (formula, source, range, ...) and its options."""
        self.matrix(measure)
        return dict(self.meta.get("measure_info", {}).get(measure, {}))

    def as_cka(self, measure: str = "linear_cka") -> CKAResult:
        """One minibatch or exact CKA measure as a :class:`CKAResult` (per-batch statistics included)."""
        meta = {k: v for k, v in self.meta.items() if k not in _MEASURE_KEYS}
        return CKAResult(values=self.matrix(measure), index=list(self.index), meta=meta,
                         state=self.states.get(measure))

    def cka(self) -> CKAResult:
        return self.as_cka("linear_cka")

    def ci(self, measure: str, level: float = 0.95, *, n_boot: int = 1000,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) interval of every entry of ``measure``, each shaped like :meth:`matrix`:

        - a minibatch measure: the percentile bootstrap over batches of :meth:`CKAResult.ci`
          (``n_boot`` resamples from ``seed``, each one epoch's batches);
        - an exact measure computed with ``jackknife=G`` (``repsim similarity --jackknife G``): the
          delete-a-group jackknife over examples, θ̂ ± t_{G−1} · se clipped to the measure's range
          (:func:`repsim.kernels.jackknife.jackknife_interval`; ``n_boot``/``seed`` unused).

        Both are intervals for what the estimator estimates at this n: a biased estimator's interval
        covers the population value less often than ``level`` (docs/measures.md "Intervals")."""
        self.matrix(measure)
        if measure in self.jackknife:
            from repsim.kernels.jackknife import jackknife_interval

            info_range = self.info(measure).get("range")
            bounds = (float(info_range[0]), float(info_range[1])) if info_range else (-np.inf, np.inf)
            return jackknife_interval(self.values[measure], self.jackknife[measure], level, bounds)
        if measure not in self.states:
            estimator = self.meta.get("estimators", {}).get(measure, "exact")
            raise ValueError(f"{measure} has no interval in this result (estimator: {estimator}): "
                             + ("compute it with jackknife=G (repsim similarity --jackknife G)" if estimator == "exact"
                                else "its per-batch statistics were not saved"))
        from repsim.kernels.measures import get_measure

        acc = get_measure(measure).accumulator_from_state(dict(self.states[measure]))
        per_epoch = self.meta.get("batches_per_epoch")  # resamples of one epoch's size (CKAResult.ci)
        draws = min(int(per_epoch[0]), acc.n_batches) if per_epoch else None
        return acc.ci(level, n_boot=n_boot, seed=seed, draws=draws)

    def save(self, path: str | os.PathLike, *, overwrite: bool = True) -> str:
        """Write ``.npz`` (class docstring). Atomic; ``overwrite`` as :meth:`CKAResult.save`."""
        arrays: dict[str, Any] = {
            "measures": np.array(self.measures, dtype=str),
            "stores": np.array([s for s, _ in self.index], dtype=str),
            "layers": np.array([layer for _, layer in self.index], dtype=str),
            "meta": np.array(json.dumps(self.meta, sort_keys=True, default=_json_default)),
        }
        for name, values in self.values.items():
            arrays[f"values__{name}"] = np.asarray(values, dtype=np.float64)
        for name, state in self.states.items():
            for key, value in state.items():
                arrays[f"{_STATE_PREFIX}{name}__{key}"] = np.asarray(value)
        for name, arrs in self.calibration.items():
            for key, value in arrs.items():
                arrays[f"{_CALIB_PREFIX}{name}__{key}"] = np.asarray(value, dtype=np.float64)
        for name, reps in self.jackknife.items():
            arrays[f"{_JACK_PREFIX}{name}"] = np.asarray(reps, dtype=np.float64)
        return _atomic_savez(path, arrays, exclusive=not overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SimilarityResult":
        return load_result(path)

    def to_pandas(self, *, wide: bool = False) -> Any:
        """A pandas DataFrame: tidy, one row per (store_a, layer_a, store_b, layer_b, measure) with its
        ``value`` (row a = the first argument of asymmetric measures); ``wide=True``: one row per pair
        (indexed by the four names), one column per measure (:func:`repsim.engine.result_views.to_pandas`)."""
        from repsim.engine.result_views import to_pandas

        return to_pandas(self, wide=wide)

    def to_xarray(self) -> Any:
        """An xarray DataArray of dims (measure, a, b), ``a`` indexed by ``store_a``/``layer_a`` and ``b``
        by ``store_b``/``layer_b`` (:func:`repsim.engine.result_views.to_xarray`); needs the extra
        ``pip install 'repsim-toolkit[xarray]'``."""
        from repsim.engine.result_views import to_xarray

        return to_xarray(self)

    def plot(self, measure: str | Sequence[str] | None = None, *, stores: Sequence[str] | None = None,
             layers: Any = None, kind: str = "matrix", title: str | None = None, calibrated: bool = False) -> Any:
        """A matplotlib Figure: ``kind="matrix"`` the store × layer heatmap of every column (one panel per
        measure; default every measure), store boundaries drawn, layer ticks thinned; ``kind="grid"`` one
        panel per (store A, store B) pair for one measure (default the first), as the paper's Fig. 2a.
        Colours span the measure's declared range; NaN cells are grey and hatched, with a legend note.
        ``stores``: names (in the order to draw); ``layers``: names kept in every store, or {store: names}
        ``calibrated``: the calibrated scores of the result's null (:meth:`calibrated`), cells with p > α dotted;
        refused without a null (:mod:`repsim.engine.heatmap`)."""
        from repsim.engine.heatmap import plot

        return plot(self, measure, stores=stores, layers=layers, kind=kind, title=title, calibrated=calibrated)

    def __repr__(self) -> str:
        from repsim.engine.result_views import describe

        return describe(self)


class NotAResult(ValueError):
    """A file that is not a results file of ``repsim cka`` or ``repsim similarity``."""


def load_result(path: str | os.PathLike) -> SimilarityResult:
    """A results file of ``repsim similarity`` or ``repsim cka`` as a :class:`SimilarityResult`
    (a CKA file holds the one measure ``linear_cka``).  A file that is not one (another ``.npz``, a
    resume checkpoint, not an ``.npz`` at all) raises :class:`NotAResult` (a ``ValueError``) saying so,
    a damaged result (arrays missing, shapes that disagree) a plain ``ValueError``, a missing file
    ``FileNotFoundError``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = set(z.files)
            if not {"stores", "layers", "meta"} <= files or not ({"measures"} & files or {"values"} & files):
                raise NotAResult(f"{path} is not a result of repsim cka/similarity (it holds "
                                 f"{', '.join(sorted(files)[:6]) or 'no arrays'}{' ...' if len(files) > 6 else ''})")
            if "measures" not in files:
                return CKAResult.load(path).as_similarity()
            measures = z["measures"].tolist()
            states: dict[str, dict[str, Any]] = {}
            calibration: dict[str, dict[str, np.ndarray]] = {}
            jackknife: dict[str, np.ndarray] = {}
            for k in z.files:
                if k.startswith(_STATE_PREFIX):
                    name, key = k[len(_STATE_PREFIX):].split("__", 1)
                    states.setdefault(name, {})[key] = _unwrap(z[k])
                elif k.startswith(_CALIB_PREFIX):
                    name, key = k[len(_CALIB_PREFIX):].split("__", 1)
                    calibration.setdefault(name, {})[key] = np.array(z[k])
                elif k.startswith(_JACK_PREFIX):
                    jackknife[k[len(_JACK_PREFIX):]] = np.array(z[k])
            result = SimilarityResult(values={m: np.array(z[f"values__{m}"]) for m in measures},
                                      index=list(zip(z["stores"].tolist(), z["layers"].tolist())),
                                      meta=json.loads(str(z["meta"])), states=states, calibration=calibration,
                                      jackknife=jackknife)
    except NotAResult:
        raise
    except (KeyError, json.JSONDecodeError) as exc:  # a result's arrays, but not all of them: damaged
        raise ValueError(f"{path}: a damaged result of repsim cka/similarity ({type(exc).__name__}: {exc})") from exc
    except ResultFileError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        if _is_zip(path):  # an .npz that does not read: truncated or damaged, whatever it held
            raise ResultFileError(f"{path} is a truncated or damaged .npz ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())}); rerun the command that wrote it, or move it "
                                  "away") from None
        what = "a directory" if os.path.isdir(path) else "not an .npz file"
        raise NotAResult(f"{path} is not a result of repsim cka/similarity ({what})") from exc
    L = len(result.index)
    for m in result.measures:
        if result.values[m].shape != (L, L):
            raise ValueError(f"{path}: a damaged result: {m} values {result.values[m].shape} do not match its "
                             f"{L} columns")
    return result


def _is_zip(path: str) -> bool:
    """Whether ``path`` is a file that starts as a zip archive (an ``.npz``) does."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"PK\x03\x04"
    except OSError:
        return False


class ResultFileError(ValueError):
    """A results file that cannot be read: truncated, damaged, or not a repsim result."""


@contextlib.contextmanager
def _opened_result(path: str | os.PathLike) -> Iterator[Any]:
    """``np.load`` of results file ``path``; a truncated or damaged file, or one missing a results
    array, is a :class:`ResultFileError` naming the file (numpy's ``BadZipFile`` names none)."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single array, not a results archive")
            yield z
    except (EOFError, zipfile.BadZipFile, ValueError, KeyError, json.JSONDecodeError) as exc:
        if isinstance(exc, ResultFileError):
            raise
        what = f"no {exc.args[0]}" if isinstance(exc, KeyError) and exc.args else " ".join(str(exc).split())
        raise ResultFileError(f"{path} is not a readable repsim results file (truncated or damaged: "
                              f"{what or type(exc).__name__}); rerun the command that wrote it") from None
    except OSError as exc:
        if exc.filename is None:  # a read error inside the archive (a truncated member)
            raise ResultFileError(f"{path} is not a readable repsim results file (truncated or damaged: "
                                  f"{' '.join(str(exc).split())}); rerun the command that wrote it") from None
        raise


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _unwrap(value: np.ndarray) -> Any:
    """0-d arrays back to Python scalars (state dicts hold ints, bools, floats and arrays)."""
    return value.item() if value.ndim == 0 else np.array(value)


def _atomic_savez(path: str | os.PathLike, arrays: dict[str, Any], *, exclusive: bool = False) -> str:
    """Write ``arrays`` to ``path`` (``.npz`` added) atomically; ``exclusive``: a create that fails when
    the file exists (:func:`repsim.fileio.atomic_write`)."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    with atomic_write(path, exclusive=exclusive) as fh:
        np.savez(fh, **arrays)
    return path


# --------------------------------------------------------------------------------------------------
# checkpoints
