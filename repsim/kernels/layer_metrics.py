"""The per-layer metric protocol and its registry: what the streaming drivers
(:mod:`repsim.engine.drivers`) compute for each layer of a store, declared once.

A *per-layer metric* (:class:`LayerMetric`) is computed from one layer of one store over all of its
examples, by mergeable accumulators fed block by block.  It declares

- ``name``: the key of its request and of its entries in the driver's per-layer result;
- ``needs_labels`` (one class per example), ``keeps_scatter`` (a P × P matrix: the drivers refuse
  layers wider than they allow) and ``reads_head`` (the store's final layer, ``store.head``);
- :meth:`~LayerMetric.stats`: its accumulators, each a :class:`Stat` — a key (metrics that need
  the same statistic name the same key and share one accumulator: collapse and spectra both read
  ``"collapse"``), the accumulator class (``from_state`` restores it from its state), how to make it
  for a layer with K classes, its state size in bytes for P features and C channels, and what it is
  fed (:data:`FEEDS`);
- :meth:`~LayerMetric.next_pass`: the accumulators that need another pass over the store
  (class separation with ``cosine_centered`` needs the global mean first);
- :meth:`~LayerMetric.finish`: its entries of the layer's result from the merged accumulators; a
  value the layer does not define (a constant layer's R², :class:`repsim.array_api.UndefinedMetric`) is
  NaN and recorded by name (:func:`defined`).

:data:`LAYER_METRICS` maps each name to its class, in the order of the drivers' results: class
separation (Eq. 11), sparsity (Fig. 3), neural collapse (Table E.2), spectra (Fig. E.2).  A new
per-layer metric is one more :class:`LayerMetric` subclass here, decorated with :func:`register`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from repsim.array_api import UndefinedMetric
from repsim.kernels.collapse import COLLAPSE_KEYS, CollapseStats
from repsim.kernels.separation import DISTANCES, ClassSeparation
from repsim.kernels.sparsity import Sparsity
from repsim.kernels.spectra import ActivationSpectrum, centered_means_spectrum, weight_spectrum

__all__ = ["Stat", "LayerMetric", "LAYER_METRICS", "FEEDS", "DISTANCES", "register", "defined"]

# what an accumulator's ``update`` is given per block: the stored activations as read ("raw": every
# activation of a conv map counts), the rows after the driver's spatial reduction ("rows"), or those
# rows and the block's class labels ("rows+labels")
FEEDS = ("raw", "rows", "rows+labels")


@dataclass(frozen=True)
class Stat:
    """One accumulator of a per-layer metric (module docstring)."""

    key: str
    kind: type
    feed: str
    make: Callable[[int, str], Any]  # (num_classes, "store/layer") -> a fresh accumulator
    nbytes: Callable[[int, int, int], int]  # (num_classes, features P, channels C) -> bytes of its state


class LayerMetric:
    """Base of the per-layer metrics (module docstring).  ``LayerMetric(option)``: ``option`` is what
    the request gave for it (``True``, or e.g. the distances of class separation)."""

    name: ClassVar[str]
    needs_labels: ClassVar[bool] = False
    keeps_scatter: ClassVar[bool] = False
    reads_head: ClassVar[bool] = False

    def __init__(self, option: Any = True) -> None:
        self.option = option

    def stats(self) -> list[Stat]:  # pragma: no cover - protocol
        raise NotImplementedError

    def passes(self) -> int:
        """Passes over the store this metric needs (one unless :meth:`next_pass` asks for more)."""
        return 1

    def next_pass(self, accs: dict[str, Any]) -> dict[str, Any]:
        """Accumulators (by key) to stream once more, made from the merged ``accs`` of one layer."""
        return {}

    def finish(self, accs: dict[str, Any], head: Any, where: str, undefined: list[str]) -> dict[str, Any]:
        """This metric's entries of one layer's result, from its merged accumulators ``accs`` (by key);
        ``head`` is the store's final layer (W, b) or None."""
        raise NotImplementedError  # pragma: no cover - protocol


LAYER_METRICS: dict[str, type[LayerMetric]] = {}


def register(cls: type[LayerMetric]) -> type[LayerMetric]:
    """Class decorator: add a :class:`LayerMetric` to :data:`LAYER_METRICS` under ``cls.name``."""
    LAYER_METRICS[cls.name] = cls
    return cls


def defined(value: Callable[[], Any], undefined: list[str], what: str, nan: Any = float("nan")) -> Any:
    """``value()``, or ``nan`` when the metric has no value on this layer (:class:`UndefinedMetric`,
    e.g. a constant layer), recording ``what`` in ``undefined``."""
    try:
        return value()
    except UndefinedMetric:
        undefined.append(what)
        return nan


def _collapse_stat() -> Stat:
    """Class means and within-class scatter (K·P + P² floats), read by collapse and spectra."""
    return Stat("collapse", CollapseStats, "rows+labels", lambda k, what: CollapseStats(k, name=what),
                lambda k, p, c: 8 * (k * p + p * p))


def _matching_head(head: Any, collapse: CollapseStats) -> Any:
    """The final layer's weights W when the store has a head whose shape is (classes, features)."""
    if head is None:
        return None
    P = collapse.class_means().shape[1]
    return head[0] if tuple(head[0].shape) == (collapse.num_classes, P) else None


@register
class Separation(LayerMetric):
    """Class separation R² (paper Eq. 11; Table E.1 distances), one accumulator per distance
    (``option``: the distances)."""

    name = "separation"
    needs_labels = True

    def __init__(self, option: Any = ("cosine",)) -> None:
        distances = tuple(option)
        bad = [d for d in distances if d not in DISTANCES]
        if bad:
            raise ValueError(f"unknown distance(s) {bad}; choose from {DISTANCES}")
        super().__init__(distances)

    def stats(self) -> list[Stat]:
        return [Stat(f"separation:{d}", ClassSeparation, "rows+labels",
                     lambda k, what, d=d: ClassSeparation(k, d, name=what), lambda k, p, c: 8 * k * p)
                for d in self.option]

    def passes(self) -> int:
        return 1 + ("cosine_centered" in self.option)

    def next_pass(self, accs: dict[str, Any]) -> dict[str, Any]:
        key = "separation:cosine_centered"
        return {key: accs[key].next_pass()} if key in accs else {}

    def finish(self, accs: dict[str, Any], head: Any, where: str, undefined: list[str]) -> dict[str, Any]:
        return {"separation": {d: float(defined(accs[f"separation:{d}"].result, undefined, f"R² ({d}) of {where}"))
                               for d in self.option}}


@register
class SparsityMetric(LayerMetric):
    """Fraction of non-zero activations (Fig. 3), overall and per channel; counts every activation."""

    name = "sparsity"

    def stats(self) -> list[Stat]:
        return [Stat("sparsity", Sparsity, "raw", lambda k, what: Sparsity(name=what), lambda k, p, c: 8 * c)]

    def finish(self, accs: dict[str, Any], head: Any, where: str, undefined: list[str]) -> dict[str, Any]:
        return {"sparsity": float(accs["sparsity"].result()),
                "sparsity_per_channel": np.asarray(accs["sparsity"].result_per_channel())}


@register
class Collapse(LayerMetric):
    """Neural-collapse statistics (Table E.2), with the weight keys when the store's head matches."""

    name = "collapse"
    needs_labels = True
    keeps_scatter = True
    reads_head = True

    def stats(self) -> list[Stat]:
        return [_collapse_stat()]

    def finish(self, accs: dict[str, Any], head: Any, where: str, undefined: list[str]) -> dict[str, Any]:
        W = _matching_head(head, accs["collapse"])
        keys = [k for k in COLLAPSE_KEYS if W is not None or not (k.endswith("_weights") or k == "self_duality")]
        return {"collapse": defined(lambda: accs["collapse"].result(W=W), undefined, f"collapse of {where}",
                                    {k: float("nan") for k in keys})}


@register
class Spectra(LayerMetric):
    """Singular values (Fig. E.2) of the centred activations, the centred class centroids and, when
    the store's head matches, the final-layer weights."""

    name = "spectra"
    needs_labels = True
    keeps_scatter = True
    reads_head = True

    def stats(self) -> list[Stat]:
        return [_collapse_stat(), Stat("spectrum", ActivationSpectrum, "rows",
                                       lambda k, what: ActivationSpectrum(name=what), lambda k, p, c: 8 * p * p)]

    def finish(self, accs: dict[str, Any], head: Any, where: str, undefined: list[str]) -> dict[str, Any]:
        spec = {"activations": accs["spectrum"].result(),
                "centroids": centered_means_spectrum(accs["collapse"].centered_means())}
        W = _matching_head(head, accs["collapse"])
        if W is not None:
            spec["weights"] = weight_spectrum(np.asarray(W, dtype=np.float64))
        return {"spectra": spec}
