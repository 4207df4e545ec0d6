"""Inputs of the figure script: results files and activation stores, loaded lazily.

Formats are those of docs/architecture.md "Results files". Every accessor raises :class:`Missing` (with the
reason) when its input is absent, so that a figure whose inputs are not there is skipped with a note
rather than failing the whole report.
"""
from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from repsim.study.objectives import DISPLAY, OBJECTIVES, with_defaults  # noqa: F401  (DISPLAY, OBJECTIVES re-exported)

# Evaluation splits, most preferred first, for "source accuracy" (ImageNet validation in the paper).
EVAL_SPLITS: tuple[str, ...] = ("test", "val", "validation", "holdout")
# probes.csv tasks that relearn the pretraining classes (Fig. 6), not transfer tasks.
SOURCE_TASK = re.compile(r"^(source|relearn)", re.IGNORECASE)


class Missing(Exception):
    """An item's inputs are absent; the message says which."""


def natural_key(name: str) -> tuple:
    """Sort key: block2 < block10; ``pool`` and ``logits`` after every block."""
    tail = {"pool": 1, "logits": 2}.get(name, 0)
    return (tail,) + tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def split_label(label: str) -> tuple[str, str, str]:
    """``"cosine_softmax (tau=0.05) [autoaugment]"`` → ("cosine_softmax", "tau=0.05", "autoaugment")."""
    head, _, variant = str(label).partition(" [")
    objective, _, params = head.partition(" (")
    return objective, params.removesuffix(")"), variant.removesuffix("]")


def compose_label(objective: str, params: str, variant: str, settings: int) -> str:
    """A group label: the objective, its parameters when it appears with ``settings`` > 1 parameter
    settings (a sweep), and the training variant (AutoAugment, Mixup, ...) when not the standard one."""
    label = f"{objective} ({params})" if params and settings > 1 else objective
    return f"{label} [{variant}]" if variant else label


def objective_key(label: str) -> tuple:
    """Sort key for labels: paper order of the objective, then the variant, then its parameter values numerically."""
    objective, params, variant = split_label(label)
    rank = OBJECTIVES.index(objective) if objective in OBJECTIVES else len(OBJECTIVES)
    nums = [float(x) for x in re.findall(r"=([-+]?[0-9.]+(?:[eE][-+]?\d+)?)", params)]
    return (rank, objective, variant, nums, label)


def display(label: str) -> str:
    objective, params, variant = split_label(label)
    return DISPLAY.get(objective, objective) + (f" ({params})" if params else "") + (f" [{variant}]" if variant else "")


def _params_text(params: Any, objective: str = "") -> str:
    """``k=v, ...`` (sorted) of a run's objective parameters with the objective's Table A.1 defaults
    filled in (stores record them so; the training.csv rows of `repsim train` only those given), so
    that a store and its training run carry the same text."""
    if isinstance(params, str):
        try:
            params = json.loads(params) if params else {}
        except json.JSONDecodeError:
            return params
    params = with_defaults(objective, params if isinstance(params, dict) else {})
    if not params:
        return ""
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items()))


def _varying(texts: Iterable[str]) -> set[str]:
    """The parameter names whose values differ between ``k=v, ...`` texts (absent counts as a value)."""
    dicts = [dict(part.split("=", 1) for part in t.split(", ") if "=" in part) for t in texts]
    keys = set().union(*dicts) if dicts else set()
    return {k for k in keys if len({d.get(k) for d in dicts}) > 1}


def _shown_params(text: str, keys: set[str]) -> str:
    """The ``k=v`` parts of ``text`` whose names are in ``keys`` (a sweep's label names what varies)."""
    return ", ".join(part for part in text.split(", ") if part.split("=", 1)[0] in keys)


def _attrs_row(name: str, attrs: dict, n: int | None) -> dict:
    """One row of :attr:`Inputs.runs` from a store's attrs (docs/architecture.md "The activation store")."""
    model, dataset = attrs.get("model") or {}, attrs.get("dataset") or {}
    source = model.get("finetuned_from") or {}
    return dict(store=name, objective=model.get("objective") or "", seed=model.get("seed"),
                params=_params_text(model.get("params"), model.get("objective") or ""), arch=model.get("arch") or "",
                epoch=model.get("epoch"), dataset=dataset.get("name") or "",
                split=dataset.get("split") or "", n=dataset.get("n", n),
                spatial=(attrs.get("extraction") or {}).get("spatial") or "",
                variant=model.get("variant") or "", sha256=model.get("checkpoint_sha256") or "",
                finetuned_from=source.get("sha256") or "" if isinstance(source, dict) else "")


def _text(values: pd.Series) -> pd.Series:
    """A column as strings, missing values as "" (CSV columns of empty strings read as float NaN)."""
    return values.astype(object).where(values.notna(), "").astype(str)


RUN_COLUMNS = ["store", "objective", "seed", "params", "arch", "epoch", "dataset", "split", "n", "spatial",
               "variant", "sha256", "finetuned_from"]


def _one_network_per_store(df: pd.DataFrame, what: str) -> None:
    """``ValueError`` when ``what``'s rows give one store name to several networks (objective, seed):
    stores of equal names in different directories, whose rows the figures cannot tell apart."""
    if "objective" not in df:
        return
    nets = df.assign(_o=df["objective"].fillna("").astype(str),
                     _s=pd.to_numeric(df["seed"], errors="coerce") if "seed" in df else np.nan)
    counts = nets.drop_duplicates(["store", "_o", "_s"]).groupby("store").size()
    clash = counts[counts > 1].index.tolist()
    if clash:
        name = clash[0]
        seen = nets[nets["store"] == name].drop_duplicates(["_o", "_s"])
        which = ", ".join(f"{o} seed {'' if pd.isna(sd) else int(sd)}".strip() for o, sd in zip(seen["_o"], seen["_s"]))
        raise ValueError(f"{what} names store {name!r} for several networks ({which}): stores of equal names "
                         "(in different directories) cannot be told apart; give every store a name of its own "
                         f"and recompute {what}")


class Inputs:
    """Everything under ``--stores`` and ``--results``; each piece read at most once."""

    def __init__(self, stores_dir: str | Path | None, results_dir: str | Path | None,
                 only_stores: set[str] | None = None):
        self.stores_dir = Path(stores_dir) if stores_dir else None
        self.results_dir = Path(results_dir) if results_dir else None
        self.only_stores = only_stores  # store names to use (None: every complete store found)

    # ----------------------------------------------------------------- stores
    @cached_property
    def stores(self) -> dict[str, Any]:
        """The stores of the end-of-training items: every complete store except those of fine-tuned
        networks (``model.finetuned_from``) and those of earlier checkpoints of a run that has a later
        one on the same data (training dynamics, Figs. D.2, E.4); :attr:`all_stores` has them all."""
        final = self.runs.loc[self.runs["final"] & (self.runs["finetuned_from"] == ""), "store"]
        keep = set(final)
        return {k: v for k, v in self.all_stores.items() if k in keep}

    @cached_property
    def all_stores(self) -> dict[str, Any]:
        """Complete stores under the stores directory, by name (incomplete ones are ignored)."""
        if self.stores_dir is None or not self.stores_dir.is_dir():
            return {}
        from repsim import open_store

        found: dict[str, Any] = {}
        for path in _zarr_dirs(self.stores_dir):
            if self.only_stores is not None and path.name.removesuffix(".zarr") not in self.only_stores:
                continue
            try:
                store = open_store(path)
            except ValueError:
                continue
            if store.name in found:
                raise ValueError(
                    f"two stores under --stores are both named {store.name!r} ({found[store.name].path} and "
                    f"{store.path}): the results files name a store by its name, so their rows cannot be told "
                    "apart; give every store a name of its own (e.g. <network>-<data>.zarr) and recompute the "
                    "results that name them")
            found[store.name] = store
        return found

    def require_stores(self, why: str) -> dict[str, Any]:
        if not self.stores:
            raise Missing(f"no complete activation stores under --stores ({why})")
        return self.stores

    @cached_property
    def runs(self) -> pd.DataFrame:
        """One row per known store: store, objective, seed, params, arch, epoch, dataset, split, n, label.

        From the stores' attrs when available, else from the (store, objective, seed) columns of
        the results CSVs. ``label`` is the objective, with its parameters appended when one objective
        appears with several parameter settings (e.g. a temperature sweep).
        """
        rows = [_attrs_row(name, store.attrs, store.n) for name, store in self.all_stores.items()]
        known = {r["store"] for r in rows}
        try:  # the results' meta["stores"] records every store's attrs (engine provenance)
            for name, prov in self.similarities.provenance().items():
                if name not in known:
                    known.add(name)
                    rows.append(_attrs_row(name, prov.get("attrs") or {}, None))
        except Missing:
            pass
        for name in ("separation", "sparsity", "collapse", "probes"):
            df = self._raw_csv(name)
            if df is None or "store" not in df:
                continue
            _one_network_per_store(df, f"{name}.csv")
            for rec in df.drop_duplicates("store").to_dict("records"):
                if rec["store"] not in known:
                    known.add(rec["store"])
                    rows.append(dict(store=rec["store"], objective=rec.get("objective", ""),
                                     seed=rec.get("seed"), params=rec.get("params", "") or "",
                                     arch="", epoch=rec.get("epoch"), dataset="", split="", n=None, spatial="",
                                     variant=rec.get("variant", "") or ""))
        runs = pd.DataFrame(rows, columns=RUN_COLUMNS)
        for col in ("objective", "params", "variant", "sha256", "finetuned_from"):
            runs[col] = _text(runs[col])
        runs["params"] = [_params_text(p, o) for p, o in zip(runs["params"], runs["objective"])]
        runs["seed"] = pd.to_numeric(runs["seed"], errors="coerce")
        runs["epoch"] = pd.to_numeric(runs["epoch"], errors="coerce")
        n_settings = runs.groupby("objective")["params"].nunique()
        varying = {o: _varying(g.unique()) for o, g in runs.groupby("objective")["params"]}
        shown = [_shown_params(p, varying.get(o, set())) for o, p in zip(runs["objective"], runs["params"])]
        runs["label"] = [compose_label(o, p, v, n_settings.get(o, 0))
                         for o, p, v in zip(runs["objective"], shown, runs["variant"])]
        runs["base_label"] = [compose_label(o, p, "", n_settings.get(o, 0)) for o, p in zip(runs["objective"], shown)]
        # the last checkpoint of each run on each dataset split (earlier ones: training dynamics)
        keys = ["objective", "params", "variant", "seed", "arch", "dataset", "split", "finetuned_from"]
        last = runs.fillna({"seed": -1}).groupby(keys, dropna=False)["epoch"].transform("max")
        runs["final"] = runs["epoch"].isna() | last.isna() | (runs["epoch"] >= last)
        return runs

    # --------------------------------------------------------------- results
    def _raw_csv(self, name: str) -> pd.DataFrame | None:
        if self.results_dir is None:
            return None
        path = self.results_dir / f"{name}.csv"
        if not path.is_file():
            return None
        return pd.read_csv(path, keep_default_na=False, na_values=[""])

    def csv(self, name: str, *, all_epochs: bool = False) -> pd.DataFrame:
        """A results CSV with ``label`` (and store metadata) joined on; raises Missing when absent.

        Rows carry the store's epoch (from its attrs, or an ``epoch`` column). Unless ``all_epochs``,
        only each run's final checkpoint is kept, so that training-dynamics stores (App. D.2, E.4) do
        not leak into the end-of-training figures. training.csv is returned whole.
        """
        df = self._raw_csv(name)
        if df is None:
            raise Missing(f"{name}.csv not found in --results")
        if df.empty:
            raise Missing(f"{name}.csv in --results has no rows")
        df = df.copy()
        if "seed" in df:
            df["seed"] = pd.to_numeric(df["seed"], errors="coerce")
        if "objective" in df:
            df["objective"] = df["objective"].fillna("").astype(str)
        if "store" in df:
            meta = self.runs[["store", "label", "base_label", "epoch", "dataset", "split", "n", "spatial",
                              "finetuned_from"] + (["variant"] if "variant" not in df else [])]
            df = df.merge(meta, on="store", how="left", suffixes=("", "_store"))
            for col in ("epoch", "dataset", "split", "n"):
                if f"{col}_store" in df:
                    extra = df.pop(f"{col}_store")
                    if col in ("epoch", "n"):
                        df[col] = pd.to_numeric(df[col], errors="coerce").fillna(pd.to_numeric(extra, errors="coerce"))
                    else:  # a blank CSV column reads as float NaN: fill it as text (filled by hand:
                        # pandas 2.2's fillna/where on object columns warn that they will stop downcasting)
                        values = df[col].astype(object).to_numpy(copy=True)
                        missing = pd.isna(values)
                        values[missing] = extra.astype(object).to_numpy()[missing]
                        df[col] = values
            df[["label", "base_label"]] = df[["label", "base_label"]].astype(object)  # all-NaN columns are float
            known = df["label"].notna()
            df.loc[~known, ["label", "base_label"]] = self._csv_labels(df[~known]).to_numpy()
            df["finetuned_from"] = _text(df["finetuned_from"])
            if name not in ("finetune",):
                df = df[df["finetuned_from"] == ""]  # fine-tuned networks only enter Table 2 / Fig. D.3
        elif "objective" in df:
            df[["label", "base_label"]] = self._csv_labels(df).to_numpy()
        if "variant" in df:
            df["variant"] = _text(df["variant"])
        if not all_epochs and name != "training" and "epoch" in df and df["epoch"].notna().any():
            last = df.groupby(["label", "seed"], dropna=False)["epoch"].transform("max")
            df = df[df["epoch"].isna() | (df["epoch"] == last)]
        return df

    def _csv_labels(self, df: pd.DataFrame) -> pd.DataFrame:
        """(label, base_label) of CSV rows naming no known store, from their objective, params (JSON
        or k=v text) and variant columns, with the sweep rule of :attr:`runs` over runs and rows alike."""
        if df.empty:
            return pd.DataFrame({"label": [], "base_label": []})
        blank = pd.Series("", index=df.index)
        obj = _text(df["objective"]) if "objective" in df else df["store"].astype(str)
        params = (pd.Series([_params_text(p, o) for p, o in zip(_text(df["params"]), obj)], index=df.index)
                  if "params" in df else blank)
        variant = _text(df["variant"]) if "variant" in df else blank
        settings: dict[str, set] = {}
        for o, p in list(zip(self.runs["objective"], self.runs["params"])) + list(zip(obj, params)):
            settings.setdefault(o, set()).add(p)
        shown = [_shown_params(p, _varying(settings[o])) for o, p in zip(obj, params)]
        return pd.DataFrame({
            "label": [compose_label(o, p, v, len(settings[o])) for o, p, v in zip(obj, shown, variant)],
            "base_label": [compose_label(o, p, "", len(settings[o])) for o, p in zip(obj, shown)]}, index=df.index)

    @cached_property
    def similarities(self) -> "Similarities":
        """Every results file of `repsim cka` / `repsim similarity` in --results, found by content: each
        ``*.npz`` that :func:`repsim.load_result` reads (whatever its name; resume checkpoints
        ``*.ckpt.npz`` and other arrays such as spectra.npz are not results and are passed over)."""
        from repsim import load_result
        from repsim.engine.result import NotAResult

        if self.results_dir is None:
            raise Missing("no --results directory")
        results, others = [], []
        for f in sorted(self.results_dir.glob("*.npz")):
            if f.name.endswith(".ckpt.npz"):  # a killed run's resume checkpoint, not a result
                continue
            try:
                results.append((f, load_result(f)))
            except NotAResult:
                others.append(f.name)
        if not results:
            seen = f" (the .npz files there, {', '.join(others)}, are not results)" if others else ""
            raise Missing("no results file of repsim cka or repsim similarity in --results" + seen)
        return Similarities(results)

    def similarity(self, measure: str) -> "MeasureMatrices":
        """One measure's matrices over the results files holding it; Missing when none does."""
        return self.similarities.measure(measure)

    @property
    def cka(self) -> "MeasureMatrices":
        return self.similarity("linear_cka")

    @cached_property
    def spectra(self) -> dict[tuple[str, str, str], np.ndarray]:
        path = self.results_dir / "spectra.npz" if self.results_dir else None
        if path is None or not path.is_file():
            raise Missing("spectra.npz not found in --results")
        import zipfile

        try:
            with np.load(path) as z:
                out = {}
                for key in z.files:
                    store, layer, kind = key.rsplit("/", 2)
                    out[(store, layer, kind)] = np.asarray(z[key], dtype=np.float64)
        except (EOFError, zipfile.BadZipFile, ValueError) as exc:
            raise ValueError(f"{path} is not a readable spectra file (truncated or damaged: "
                             f"{' '.join(str(exc).split()) or type(exc).__name__}); rerun repsim collapse --spectra") from None
        return out

    # ---------------------------------------------------------------- helpers
    def label_of(self, store: str) -> str:
        hit = self.runs.loc[self.runs["store"] == store, "label"]
        if hit.empty or not hit.iloc[0]:
            raise Missing(f"objective of store {store!r} unknown (pass --stores or a results CSV naming it)")
        return str(hit.iloc[0])

    def pixel_baseline(self) -> dict[str, float]:
        """{transfer task: linear-probe accuracy (%) on raw input pixels} from pixels.csv (the demo's
        repsim.analyses.pixel_baseline); raises Missing when absent."""
        df = self._raw_csv("pixels")
        if df is None or df.empty:
            raise Missing("pixels.csv (the pixel baseline) not found in --results")
        acc = pd.to_numeric(df["accuracy"], errors="coerce")
        acc = acc * 100 if acc.max() <= 1.0 else acc
        return dict(zip(df["task"].astype(str), acc))

    def source_accuracy(self) -> pd.DataFrame:
        """Final-epoch accuracy on the source task per (label, seed): columns top1, top5, split.

        From training.csv, on the most preferred evaluation split present (test > val > holdout).
        """
        tr = self.csv("training")
        if "run" in tr and "store" not in tr:
            tr = tr.rename(columns={"run": "store"})
        split = next((s for s in EVAL_SPLITS if (tr["split"] == s).any()), None)
        if split is None:
            raise Missing(f"training.csv has no evaluation split ({', '.join(EVAL_SPLITS)})")
        ev = tr[tr["split"] == split]
        last = ev.loc[ev.groupby(["label", "seed"], dropna=False)["epoch"].idxmax()]
        cols = ["label", "base_label", "variant", "seed", "epoch", "top1", "top5"]
        out = last[[c for c in cols if c in last]].copy()
        out["split"] = split
        return out.reset_index(drop=True)

    def penultimate(self, layers: Iterable[str]) -> str:
        """The penultimate layer: ``pool`` when present, else the last non-logits layer."""
        layers = sorted(set(layers), key=natural_key)
        if "pool" in layers:
            return "pool"
        rest = [l for l in layers if l != "logits"]
        if not rest:
            raise Missing("no penultimate layer (only logits)")
        return rest[-1]

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-example shape of each layer, from the store with most layers (used for stage boundaries)."""
        if not self.stores:
            return {}
        store = max(self.stores.values(), key=lambda s: len(s.layers))
        return {name: tuple(store.layer(name).shape[1:]) for name in store.layers}

    def describe(self, stores: Iterable[str]) -> str:
        """Caption fragment naming the data, n and seeds behind a set of stores (their names)."""
        names = list(stores)
        bad = [type(s).__name__ for s in names if not isinstance(s, str)]
        if bad:  # e.g. matplotlib axes passed by mistake: a wrong caption with pandas 2, ArrowInvalid with 3
            raise TypeError(f"describe() takes store names, got {', '.join(sorted(set(bad)))}")
        runs = self.runs[self.runs["store"].isin(names)]
        if runs.empty:
            return "data: not recorded"
        parts = []
        data = runs[runs["dataset"] != ""].groupby(["dataset", "split"], dropna=False)["n"].first()
        if len(data):
            parts.append("data: " + "; ".join(
                f"{d}/{s} (n={int(n) if pd.notna(n) else '?'})" for (d, s), n in data.items()))
        seeds = sorted({int(s) for s in runs["seed"].dropna()})
        parts.append(f"{groups_text(runs['label'])}, {len(runs)} stores, seeds "
                     + (", ".join(map(str, seeds)) if seeds else "unrecorded"))
        return "; ".join(parts)


def groups_text(labels: Iterable[str]) -> str:
    """"9 objectives", or "5 settings of 1 objective" when labels name parameter settings (a sweep)."""
    labels = set(labels)
    objectives = {split_label(label)[0] for label in labels}
    if len(objectives) == len(labels):
        return f"{len(labels)} objectives"
    return f"{len(labels)} settings of {len(objectives)} objective{'s' if len(objectives) > 1 else ''}"


def describe_rows(df: pd.DataFrame) -> str:
    """Caption fragment for rows of a results CSV (seeds, number of runs, stores' data)."""
    seeds = sorted({int(s) for s in df["seed"].dropna()}) if "seed" in df else []
    parts = [groups_text(df["label"])]
    parts.append("seeds " + (", ".join(map(str, seeds)) if seeds else "unrecorded"))
    if "dataset" in df and "split" in df:
        data = df[_text(df["dataset"]) != ""].groupby(["dataset", "split"])["n"].first()
        if len(data):
            parts.append("data: " + "; ".join(
                f"{d}/{s} (n={int(n) if pd.notna(n) else '?'})" for (d, s), n in data.items()))
    if "spatial" in df and _text(df["spatial"]).ne("").any():
        parts.append("conv maps extracted with spatial=" + ", ".join(sorted(set(_text(df["spatial"])) - {""})))
    return "; ".join(parts)


def measure_display(name: str) -> str:
    """The measure's display name for titles and labels (its registry entry's ``MeasureInfo.label``;
    an unknown name as it is)."""
    from repsim.kernels.measures import measure_label

    return measure_label(name)


def measure_order(names: Iterable[str]) -> list[str]:
    """Measure names, each once, in the registry's documented order (linear CKA first); unknown names last."""
    from repsim.kernels.measures import measure_names

    known = measure_names()
    return sorted(dict.fromkeys(names), key=lambda m: (known.index(m) if m in known else len(known), m))


class Similarities:
    """Every results file of pairwise measures in a results directory (of `repsim cka` or `repsim
    similarity`, whatever their names), each read by :func:`repsim.load_result`; queried by
    measure name through :meth:`measure`. A (store, layer) pair in several files is read from the first."""

    def __init__(self, files: list[Path] | list[tuple[Path, Any]]):
        from repsim import load_result
        from repsim.engine.result import NotAResult

        self.parts: list[tuple[str, Any, dict[tuple[str, str], int]]] = []
        for entry in files:
            f, result = entry if isinstance(entry, tuple) else (entry, None)
            if result is None:
                try:
                    result = load_result(f)
                except NotAResult:  # names the file and what is wrong with it
                    raise
                except (ValueError, KeyError, OSError) as exc:
                    raise ValueError(f"{f}: not a readable result of repsim cka/similarity ({exc})") from exc
            index = [(str(s), str(l)) for s, l in result.index]
            self.parts.append((Path(f).name, result, {key: i for i, key in enumerate(index)}))

    @property
    def measures(self) -> list[str]:
        """Every measure of any file, linear CKA first, then the registry's order."""
        return measure_order(m for _, r, _ in self.parts for m in r.measures)

    def measure(self, name: str) -> "MeasureMatrices":
        parts = [(f, r, pos) for f, r, pos in self.parts if name in r.measures]
        if not parts:
            raise Missing(f"no results file in --results holds {measure_display(name)} ({name}); files: "
                          + ", ".join(f for f, _, _ in self.parts))
        return MeasureMatrices(name, parts)

    def provenance(self) -> dict[str, dict]:
        """meta["stores"] of every file: store name -> {path, attrs, layers} (engine provenance)."""
        out: dict[str, dict] = {}
        for _, result, _ in self.parts:
            stores = result.meta.get("stores")
            if isinstance(stores, dict):
                out.update({k: v for k, v in stores.items() if isinstance(v, dict)})
        return out


class MeasureMatrices:
    """One measure's matrices over the files that hold it, queried by (store, layer): the view behind
    Fig. 2 and the items that read CKA (``Inputs.cka`` is ``Inputs.similarity("linear_cka")``)."""

    def __init__(self, name: str, parts: list[tuple[str, Any, dict[tuple[str, str], int]]]):
        self.name = name
        self.parts = [(f, r.matrix(name), pos, r) for f, r, pos in parts]

    @property
    def display(self) -> str:
        return measure_display(self.name)

    @cached_property
    def info(self) -> dict:
        """The declared metadata (range, symmetric, formula, source, ...): as recorded in the first file
        that records it, else the registry's (a cka_*.npz records none)."""
        for _, _, _, r in self.parts:
            info = r.meta.get("measure_info", {}).get(self.name)
            if info:
                return dict(info)
        try:
            from repsim.kernels.measures import measure_class

            return measure_class(self.name).info.as_dict()
        except ValueError:
            return {}

    @property
    def range(self) -> tuple[float, float]:
        lo, hi = self.info.get("range", (float("nan"), float("nan")))
        return float(lo), float(hi)

    @property
    def range_text(self) -> str:
        lo, hi = self.range
        return (f"[{lo:g}" if np.isfinite(lo) else "(−∞") + ", " + (f"{hi:g}]" if np.isfinite(hi) else "∞)")

    @property
    def symmetric(self) -> bool:
        return bool(self.info.get("symmetric", True))

    @property
    def stores(self) -> list[str]:
        return sorted({s for _, _, pos, _ in self.parts for s, _ in pos})

    def layers(self, store: str) -> list[str]:
        return sorted({l for _, _, pos, _ in self.parts for s, l in pos if s == store}, key=natural_key)

    def block(self, a: str, b: str, layers_a: list[str], layers_b: list[str]) -> np.ndarray | None:
        """The measure between every layer of store a (rows: the first argument) and of store b
        (columns), or None if absent."""
        found = self._holding(a, b, layers_a, layers_b)
        if found is None:
            return None
        values, _, ia, ib = found
        return values[np.ix_(ia, ib)]

    def _holding(self, a: str, b: str, layers_a: list[str],
                 layers_b: list[str]) -> tuple[np.ndarray, Any, list[int], list[int]] | None:
        """(values, result, row positions of ``layers_a`` of store a, of ``layers_b`` of store b) of the
        first file that holds every one of those columns, or None."""
        for _, values, pos, r in self.parts:
            try:
                return values, r, [pos[(a, l)] for l in layers_a], [pos[(b, l)] for l in layers_b]
            except KeyError:
                continue
        return None

    @cached_property
    def null(self) -> dict[str, Any] | None:
        """The permutation null the results files hold for this measure (``repsim similarity --permutations
        K``): ``{"permutations": K, "alpha": α, "files": [...]}`` when every file holding the measure has
        one with the same K and α; None when none has (or a file holds only the analytic null, whose
        moments give no draws to average over pairs of networks). A ``ValueError`` when the files' K or α
        differ (draws of different nulls cannot be averaged)."""
        got = []
        for f, _, _, r in self.parts:
            arrays = r.calibration.get(self.name, {})
            if "null" not in arrays:
                return None
            cal = r.meta.get("calibration", {})
            got.append((f, int(arrays["null"].shape[0]), float(cal.get("alpha", 0.05))))
        if len({(k, a) for _, k, a in got}) > 1:
            raise ValueError(f"the {self.display} nulls of the results files differ: "
                             + ", ".join(f"{f} K = {k}, α = {a:g}" for f, k, a in got))
        return {"permutations": got[0][1], "alpha": got[0][2], "files": [f for f, _, _ in got]}

    def null_block(self, a: str, b: str, layers_a: list[str],
                   layers_b: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """(observed (La, Lb), null draws (K, La, Lb)) of the block of :meth:`block` from the file's
        permutation null (``SimilarityResult.null``: draw k permutes the rows of store b; the observed
        values are those the null was drawn for, the first epoch's on the minibatch route), or None."""
        found = self._holding(a, b, layers_a, layers_b)
        if found is None or "null" not in found[1].calibration.get(self.name, {}):
            return None
        _, r, ia, ib = found
        return r.calibration[self.name]["observed"][np.ix_(ia, ib)], r.null(self.name)[:, ia][:, :, ib]

    def calibrated_block(self, a: str, b: str, layers_a: list[str],
                         layers_b: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """(calibrated scores, p-values), each (La, Lb), of one pair of networks (``SimilarityResult.calibrated``
        and ``.pvalues``: Gröger et al. 2026), or None without a null."""
        found = self._holding(a, b, layers_a, layers_b)
        if found is None or self.name not in found[1].calibration:
            return None
        _, r, ia, ib = found
        return r.calibrated(self.name)[np.ix_(ia, ib)], r.pvalues(self.name)[np.ix_(ia, ib)]

    def keys(self) -> set[tuple[str, str]]:
        """Every (store, layer) column the measure has values for."""
        return {key for _, _, pos, _ in self.parts for key in pos}

    def matrix(self, keys: list[tuple[str, str]]) -> np.ndarray:
        """(C, C) values between the columns ``keys`` (NaN where no one file holds both)."""
        out = np.full((len(keys), len(keys)), np.nan)
        filled = np.zeros(out.shape, bool)
        for _, values, pos, _ in self.parts:
            here = np.array([k in pos for k in keys])
            idx = np.array([pos.get(k, 0) for k in keys])
            take = np.outer(here, here) & ~filled
            out[take] = values[np.ix_(idx, idx)][take]
            filled |= take
        return out

    def meta_text(self) -> str:
        """Caption fragment with the estimator settings recorded in each file: the measure's own estimator
        (minibatch or exact; a minibatch's batch settings) and options."""
        keys = ("method", "batch_size", "epochs", "debiased", "spatial", "shuffle", "seed", "n", "n_batches")
        texts = []
        for name, _, _, r in self.parts:
            meta = dict(r.meta)
            if meta.get("estimators", {}).get(self.name) is not None:
                meta["method"] = meta["estimators"][self.name]
            recorded = meta.get("measure_info", {}).get(self.name, {}).get("options")
            drop = {"batch_size", "epochs", "shuffle", "n_batches"} if meta.get("method") == "exact" else set()
            if recorded is not None and "debiased" not in recorded:
                drop.add("debiased")  # a file-wide setting of the CKA measures only
            options = {k: v for k, v in (recorded or {}).items()
                       if k not in keys and k != "compute_dtype" and v is not None}
            shown = ", ".join([f"{k}={meta[k]}" for k in keys if k in meta and k not in drop]
                              + [f"{k}={v}" for k, v in options.items()])
            texts.append(f"{name}: {shown or 'settings not recorded'}")
        what = ("linear CKA (unbiased HSIC when debiased)" if self.name == "linear_cka" else
                f"{self.display}, {self.info.get('formula', self.name)} ({self.info.get('source', 'source not recorded')})")
        return f"estimator: {what}; " + "; ".join(texts)


def _zarr_dirs(root: Path) -> list[Path]:
    """Every ``*.zarr`` directory under ``root``, sorted, following symlinked directories (a stores
    directory assembled from links to other runs' stores) but never into a store, nor twice into one
    directory (a link cycle)."""
    import os

    found, seen = [], set()
    for here, dirs, _ in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        found += [Path(here) / d for d in dirs if d.endswith(".zarr")]
        dirs[:] = [d for d in dirs if not d.endswith(".zarr")]
    return sorted(found)

