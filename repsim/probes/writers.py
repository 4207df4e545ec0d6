"""The results files of `repsim probe`, `repsim calibrate` and `repsim accuracy`, written from stores: what
those commands do, as library calls (repsim/commands/ parses their flags and calls these; the demo calls
them directly).

- :func:`write_probes`: transfer probes (linear, kNN), multi-label AUC and relearned heads on stored
  features, merged into probes.csv / multilabel.csv and their .json details (paper Table 1, App. A.2;
  Table D.1; Fig. 6; the modes and the pairing rules: :mod:`repsim.commands.probe`);
- :func:`write_calibration`: NLL and ECE before and after temperature scaling from stores' logits,
  merged into calibration.csv (Table C.3; :mod:`repsim.commands.calibrate`);
- :func:`accuracy_rows`: top-1, top-5 and mean per-class accuracy of each network's own head from its
  stores' logits (accuracy.csv rows, Table C.1; :mod:`repsim.commands.accuracy`).

Every pair of stores is verified first (``repsim.store.pairing``); bad input raises ValueError (the
commands report it on one line, exit status 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from repsim.fileio import atomic_write
from repsim.results import KEYS, conform, merge_csv

# --memory-budget of `repsim probe` / `calibrate` (MiB): in memory below it, out of core above. Fixed, not
# sized to the machine, so the route (and with it the last digits of a fit) is the same everywhere.
DEFAULT_BUDGET_MIB = 512
RELEARN_PREFIXES = ("relearn", "source")  # task names the figures treat as relearning the source classes
# the options of :func:`write_probes` (the command's flags, under their ``args`` names) and their defaults
DEFAULTS: dict[str, Any] = {"per_class": 10, "layer": "pool", "probe": ("linear", "knn"), "metric": "top1",
                            "task": None, "val_fraction": 0.2, "lambdas": 45, "ks": (1, 3, 5, 10, 20, 50, 100),
                            "bins": 1000, "same_examples": False, "allow_mixed_datasets": False,
                            "allow_other_classes": False, "memory_budget": DEFAULT_BUDGET_MIB, "seed": 0}


def write_probes(train, test=(), *, out=".", relearn: bool = False, progress: bool = True,
                 **options: Any) -> tuple[list[dict], list[dict]]:
    """What `repsim probe` does, as a library call: probe the ``train`` stores (paired in order with the
    ``test`` stores; none with ``relearn``) and merge the rows into ``out`` (a FILE.csv, or a directory for
    probes.csv / multilabel.csv, with their .json details). ``options`` are the command's other flags
    under their :data:`DEFAULTS` names (``probe=["linear"]``, ``task="cifar10"``, ``layer="pool"``, ...;
    ``memory_budget``: MiB, or a size with units such as ``"4GiB"``).
    Returns the (probes.csv, multilabel.csv) rows written; bad input raises ValueError."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"write_probes() got unknown option(s) {unknown}; known: {sorted(DEFAULTS)}")
    from repsim.units import parse_size

    args = argparse.Namespace(**{**DEFAULTS, **options}, stores=[], train=list(train), test=list(test),
                              relearn=relearn, out=str(out), progress=progress)
    args.memory_budget = parse_size(args.memory_budget)  # MiB (a number) or a size with units -> bytes
    _, _, rows, ml_rows = _probe(args)
    return rows, ml_rows


def _probe(args) -> tuple[Path, Path, list[dict], list[dict]]:
    import numpy as np

    from repsim.store.pairing import check_label_space, check_pair
    from repsim.store.reader import open_store

    train = list(args.stores) + list(args.train)
    if not train:
        raise ValueError("give stores (positional or --train)")
    if args.relearn:
        if args.test:
            raise ValueError("--relearn holds out examples of each store itself; it takes no --test")
        task = args.task or "relearn"
        if not task.lower().startswith(RELEARN_PREFIXES):
            raise ValueError(f"--task {task!r}: relearning tasks must start with 'relearn' or 'source' "
                             "(the figures treat such tasks as Fig. 6's)")
        if args.per_class < 1:  # the command's --per-class is a positive int; this is the library call's check
            raise ValueError(f"per_class must be >= 1, got {args.per_class} (held-out examples per class)")
    elif len(train) != len(args.test):
        raise ValueError(f"{len(train)} training stores but {len(args.test)} test stores; they are paired in order")
    csv_path, ml_path = probe_outputs(args.out)
    lambdas = np.logspace(-6, 5, args.lambdas)
    rows, details, ml_rows, ml_details = [], [], [], []
    pairs = []
    for tr_path, te_path in zip(train, args.test if not args.relearn else train):
        tr = open_store(tr_path)
        te = tr if args.relearn else open_store(te_path)
        if not args.relearn:  # one network, one dataset, different examples (repsim.store.pairing)
            check_pair(tr, te, ("train", "test"), same_examples=args.same_examples,
                       mixed_datasets=args.allow_mixed_datasets)
        if tr.multilabel != te.multilabel:
            raise ValueError(f"stores {tr.name} and {te.name}: one holds multi-label targets, the other not")
        if args.relearn and tr.multilabel:
            raise ValueError(f"store {tr.name} holds multi-label targets; --relearn needs one class per example")
        if args.relearn and not tr.has_logits and tr.head is None:
            raise ValueError(f"store {tr.name} has neither logits nor a head: the original classifier is unknown")
        if not tr.multilabel:
            for role, s in (("", tr),) if args.relearn else (("train ", tr), ("test ", te)):
                _require_classes(s, role)
            if not args.relearn:
                _warn_unseen_classes(tr, te)
        if args.relearn:  # the original head is scored on the store's labels: they must be its classes
            check_label_space(tr, allow=args.allow_other_classes)
        pairs.append((tr, te))
    for tr, te in pairs:  # every pair was checked before any is probed
        common = _common(args, tr, te, lambdas)
        # multi-label stores are probed in memory (one binary probe per target; not streamed yet)
        streamed = not tr.multilabel and not _fits(args, tr, None if args.relearn else te)
        if streamed:
            from repsim.probes.rows import Rows

            # the training rows are read once per solver step (linear) or query block (kNN): up to
            # half the budget of them is kept decoded (probes._rows, probes._streamed); test rows are
            # read once or twice and never kept
            Xtr = Rows.from_store(tr, f"layers/{args.layer}", cache_bytes=cache_bytes(args.memory_budget / 2**20))
            Xte = Xtr if args.relearn else Rows.from_store(te, f"layers/{args.layer}")
        else:
            Xtr = _features(tr, args.layer)
            Xte = Xtr if args.relearn else _features(te, args.layer)
        if args.relearn:
            r, d = _relearn(args, tr, Xtr, lambdas, common, task)
        elif tr.multilabel:
            r, d = _multilabel(args, tr, te, Xtr, Xte, lambdas, common)
        else:
            r, d = _single(args, tr, te, Xtr, Xte, lambdas, common)
        (ml_rows if tr.multilabel else rows).extend(r)
        (ml_details if tr.multilabel else details).extend(d)

    rows, ml_rows = conform("probes", rows, fill=True), conform("multilabel", ml_rows, fill=True)
    if rows:
        merge_csv(rows, csv_path, KEYS["probes"])
        _merge_json(csv_path.with_suffix(".json"), details, _key)
    if ml_rows:
        merge_csv(ml_rows, ml_path, KEYS["multilabel"])
        _merge_json(ml_path.with_suffix(".json"), ml_details, _ml_key)
    return csv_path, ml_path, rows, ml_rows


def _meta(store) -> tuple[str, str]:
    model = store.model or {}
    obj = model.get("objective", "")
    seed = model.get("seed", "")
    return ("" if obj is None else str(obj)), ("" if seed is None else str(seed))


def _warn_unseen_classes(tr, te) -> None:
    """One ``WARNING:`` line when test store ``te`` holds classes that train store ``tr`` has no example
    of: a probe never predicts a class it was not fit on, so those examples all count as errors (a
    train store subsampled too far, or stores of other class sets)."""
    import numpy as np

    seen = np.unique(np.asarray(tr.labels))
    test = np.asarray(te.labels)
    unseen = np.setdiff1d(np.unique(test), seen)
    if unseen.size:
        n = int(np.isin(test, unseen).sum())
        shown = ", ".join(map(str, unseen[:10].tolist())) + (" …" if unseen.size > 10 else "")
        print(f"WARNING: test store {te.name}: {n} of its {test.size} examples are of {unseen.size} class(es) that "
              f"train store {tr.name} has no example of ({shown}); the probe cannot predict them, so they count "
              "as errors", file=sys.stderr, flush=True)


def _require_classes(store, role: str) -> None:
    """Refuse a single-label store holding a label below 0 (``role``: ``"train "``, ``"test "`` or ``""``,
    how the message names the store): ``-1`` marks an unlabelled example (a text file without labels,
    ``save_store`` of unlabelled data), which a probe would fit or score as a class of its own (a test
    store of them scored top-1 0.0, exit 0)."""
    import numpy as np

    y = np.asarray(store.labels)
    if y.size and y.min() < 0:
        bad = int(np.count_nonzero(y < 0))
        raise ValueError(f"{role}store {store.name}: labels must lie in [0, K) (class indices), but {bad} of its "
                         f"{y.size} labels are negative (min {int(y.min())}; -1 marks an unlabelled example); a probe "
                         "can neither fit nor score unlabelled examples: give a store of labelled examples")


def probe_outputs(out: str | Path) -> tuple[Path, Path]:
    """(probes CSV, multi-label CSV) for ``--out``: a ``FILE.csv`` names the CSV itself — the convention
    of ``cka``, ``separation``, ``calibrate`` — and takes the rows of either kind of store; anything else
    is a directory (made if missing) that receives ``probes.csv`` and ``multilabel.csv``."""
    path = Path(out)
    if path.suffix.lower() == ".csv" and not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, path
    path.mkdir(parents=True, exist_ok=True)
    return path / "probes.csv", path / "multilabel.csv"


def _features(store, layer: str):
    """Layer ``layer`` of ``store`` in memory; NaN/Inf refused naming the store (no probe fits them)."""
    from repsim.store.finite import require_finite

    return require_finite(store.layer(layer).compute(), store, f"layer {layer!r}")


def _fits(args, tr, te) -> bool:
    """Does the in-memory probe of ``args.layer`` fit ``--memory-budget`` (``repsim.probes.rows.nbytes_in_memory``
    of the training and test rows)?"""
    import numpy as np

    from repsim.probes.rows import nbytes_in_memory

    tr._check_layer(args.layer)
    p = int(np.prod(tr.zarr_array(f"layers/{args.layer}").shape[1:], dtype=np.int64))
    return nbytes_in_memory(tr.n + (te.n if te is not None else 0), p) <= args.memory_budget  # bytes


def cache_bytes(budget_mib: float) -> int:
    """Bytes of decoded training rows the out-of-core route keeps between passes: half of
    ``--memory-budget`` (the budget bounds the route's data, whatever n; 0 keeps none)."""
    return int(budget_mib * 2**20) // 2


def _common(args, tr, te, lambdas) -> dict[str, Any]:
    """Estimator metadata carried by every row (docs/architecture.md "Results files")."""
    objective, seed = _meta(tr)
    return {"store": tr.name, "objective": objective, "seed": seed, "layer": args.layer,
            "split": (te.dataset or {}).get("split", ""), "n": int(te.n),
            "train_split": (tr.dataset or {}).get("split", ""), "train_n": int(tr.n),
            "spatial": (tr.attrs.get("extraction") or {}).get("spatial", ""),
            "val_fraction": args.val_fraction, "n_lambdas": len(lambdas), "estimator_seed": args.seed}


def _single(args, tr, te, Xtr, Xte, lambdas, common) -> tuple[list[dict], list[dict]]:
    from repsim.probes.rows import Rows
    from repsim.probes.knn import knn_probe, knn_probe_rows
    from repsim.probes.linear import linear_probe, linear_probe_rows

    task = args.task or (te.dataset or {}).get("name") or te.name
    streamed = isinstance(Xtr, Rows)
    rows, details = [], []
    for kind in args.probe:
        if kind == "linear":
            r = (linear_probe_rows if streamed else linear_probe)(
                Xtr, tr.labels, Xte, te.labels, lambdas=lambdas, val_fraction=args.val_fraction,
                metric=args.metric, seed=args.seed, progress=args.progress is not False)
        else:
            r = (knn_probe_rows if streamed else knn_probe)(Xtr, tr.labels, Xte, te.labels, ks=args.ks,
                                                             metric=args.metric)
        row = {**common, "task": task, "probe": kind, "metric": args.metric, "accuracy": r.accuracy,
               "best_param": r.best_param, "protocol": "train/test stores"}
        if kind == "knn":
            row.update(val_fraction="", n_lambdas="")  # k by leave-one-out on the training store
        rows.append(row)
        details.append({**row, "train_store": tr.path, "test_store": te.path,
                        **{k: v for k, v in r.to_dict().items() if k in ("curve", "info")}})
        print(f"{tr.name} {task} {kind}: {args.metric} {r.accuracy:.4f} "
              f"({'λ' if kind == 'linear' else 'k'}={r.best_param:g})", flush=True)
    return rows, details


def _relearn(args, store, X, lambdas, common, task) -> tuple[list[dict], list[dict]]:
    """Fig. 6: relearned head and original head on the same ``per_class`` held-out examples per class."""
    from repsim.probes.rows import Rows
    from repsim.probes.transfer import relearn_head, relearn_head_rows
    from repsim.store.finite import require_finite

    kw = dict(head=None if store.has_logits else store.head, per_class=args.per_class, seed=args.seed,
              lambdas=lambdas, val_fraction=args.val_fraction, metric=args.metric,
              progress=args.progress is not False)
    if isinstance(X, Rows):
        r = relearn_head_rows(X, store.labels, logits=Rows.from_store(store, "/logits") if store.has_logits
                              else None, **kw)
    else:
        logits = require_finite(store.logits.compute(), store, "logits") if store.has_logits else None
        r = relearn_head(X, store.labels, logits=logits, **kw)
    n_test = int(r.test_index.size)
    base = {**common, "task": task, "metric": args.metric, "n": n_test, "train_n": int(store.n) - n_test,
            "train_split": common["split"],
            "protocol": f"heldout {args.per_class} per class of the store; probe fit on the rest (Fig. 6)"}
    rows = [{**base, "probe": "linear", "accuracy": r.relearned_accuracy, "best_param": r.best_lambda},
            {**base, "probe": "original_head", "accuracy": r.original_accuracy, "best_param": "",
             "val_fraction": "", "n_lambdas": ""}]
    if args.metric != "top1":  # relearn_head scores the original head by top-1 only
        rows[1]["metric"] = "top1"
    details = [{**rows[0], "train_store": store.path, "test_index": r.test_index.tolist(),
                **{k: v for k, v in r.probe.to_dict().items() if k in ("curve", "info")}}, dict(rows[1])]
    print(f"{store.name} {task}: relearned {r.relearned_accuracy:.4f} (λ={r.best_lambda:g}), original head "
          f"{r.original_accuracy:.4f} on {n_test} held-out examples", flush=True)
    return rows, details


def _multilabel(args, tr, te, Xtr, Xte, lambdas, common) -> tuple[list[dict], list[dict]]:
    """Table D.1: per-target λ and binned AUC (``repsim.probes.multilabel.multilabel_probe``)."""
    import numpy as np

    from repsim.probes.multilabel import multilabel_probe

    Ytr, Yte = tr.labels, te.labels
    if Ytr.shape[1] != Yte.shape[1]:
        raise ValueError(f"stores {tr.name} and {te.name} hold {Ytr.shape[1]} and {Yte.shape[1]} targets")
    names = list((te.dataset or {}).get("classes") or (tr.dataset or {}).get("classes") or [])
    if len(names) != Yte.shape[1]:
        names = [f"target{k}" for k in range(Yte.shape[1])]
    task = args.task or (te.dataset or {}).get("name") or te.name
    r = multilabel_probe(Xtr, Ytr, Xte, Yte, lambdas=lambdas, val_fraction=args.val_fraction, seed=args.seed,
                         bins=args.bins)
    rows, details = [], []
    for k, name in enumerate(names):
        row = {**common, "task": task, "target": name, "auc": float(r.auc[k]), "best_lambda": float(r.best_lambda[k]),
               "positives": int(np.sum(Yte[:, k])), "bins": args.bins}
        rows.append(row)
        details.append({**row, "train_store": tr.path, "test_store": te.path,
                        "val_auc": dict(zip(map(float, r.lambdas), map(float, r.val_auc[:, k])))})
    shown = ", ".join(f"{n} {a:.3f}" for n, a in zip(names, r.auc))
    print(f"{tr.name} {task}/{common['split']}: AUC {shown} (mean {r.mean_auc:.3f})", flush=True)
    return rows, details


def _key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in KEYS["probes"])


def _ml_key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in KEYS["multilabel"])


def _merge_json(path: Path, details: list[dict], key) -> None:
    old = json.loads(path.read_text()) if path.exists() else []
    keys = {key(d) for d in details}
    with atomic_write(path, "w") as fh:
        fh.write(json.dumps([d for d in old if key(d) not in keys] + details, indent=1))


def kind_for(objective: str | None) -> str:
    """``sigmoid`` when the objective's loss is sigmoid cross-entropy (also in a ``+`` combination)."""
    return "sigmoid" if "sigmoid" in str(objective or "").split("+") else "softmax"


def write_calibration(test, holdout, out="calibration.csv", *, kind: str = "auto", bins: int = 15,
                      same_examples: bool = False, memory_budget: float | str = DEFAULT_BUDGET_MIB,
                      allow_mixed_datasets: bool = False, allow_other_classes: bool = False) -> tuple[list[dict], str]:
    """What `repsim calibrate` does, as a library call: one calibration.csv row per (test, holdout) pair
    of stores, written to ``out``; returns the rows and the path. Each pair is checked by
    ``repsim.store.pairing.check_pair`` (one network, one dataset unless ``allow_mixed_datasets``,
    different examples unless ``same_examples``), each store by ``check_label_space`` (its labels are the
    head's classes, unless ``allow_other_classes``). ``memory_budget``: MiB, or a size with units such as
    ``"4GiB"`` (``--memory-budget``). Bad input raises ValueError."""
    import numpy as np

    from repsim.units import parse_size
    from repsim.probes.rows import Rows
    from repsim.probes.calibration import calibration_report, calibration_report_rows, temperature_at_bound
    from repsim.store.finite import require_finite
    from repsim.store.pairing import check_label_space, check_pair
    from repsim.store.reader import open_store

    # expected failures raise ValueError: one line and exit status 2 (repsim.commands.main)
    if len(test) != len(holdout):
        raise ValueError(f"{len(test)} test stores but {len(holdout)} holdout stores; they are paired in order")
    if bins < 1:
        raise ValueError(f"--bins must be >= 1, got {bins}")
    budget = parse_size(memory_budget)  # bytes
    rows = []
    for te_path, ho_path in zip(test, holdout):
        te, ho = open_store(te_path), open_store(ho_path)
        for s in (te, ho):
            if not s.has_logits:
                raise ValueError(f"store {s.name} has no logits (extract them with `repsim extract`)")
            if s.multilabel:
                raise ValueError(f"store {s.name} holds multi-label targets; calibration needs one class per example")
        check_pair(te, ho, ("test", "holdout"), same_examples=same_examples, mixed_datasets=allow_mixed_datasets)
        for s in (te, ho):  # the head's probabilities are scored on each store's labels
            check_label_space(s, allow=allow_other_classes)
        objective = (te.model or {}).get("objective", "")
        net_kind = kind_for(objective) if kind == "auto" else kind
        # each store's values are checked on their own, so an error names the store that holds them
        y, yh = np.asarray(te.labels), np.asarray(ho.labels)
        k = int(te.zarr_array("/logits").shape[1])
        in_memory = (te.n + ho.n) * k * 32 <= budget
        try:
            if in_memory:
                z = require_finite(te.logits.compute(), te, "logits")
                zh = require_finite(ho.logits.compute(), ho, "logits")
                rep = {**calibration_report(z, y, zh, yh, kind=net_kind, bins=bins),
                       "top1": float(np.mean(z.argmax(1) == y)), "holdout_top1": float(np.mean(zh.argmax(1) == yh))}
            else:
                rep = calibration_report_rows(Rows.from_store(te, "/logits"), y, Rows.from_store(ho, "/logits"),
                                              yh, kind=net_kind, bins=bins)
        except ValueError as e:
            if str(e).startswith("store "):      # a finiteness refusal already names its store
                raise
            raise ValueError(f"test store {te.name} / holdout store {ho.name}: {e}") from e
        seed = (te.model or {}).get("seed", "")
        rows.append({"store": te.name, "objective": objective or "", "seed": "" if seed is None else seed,
                     "kind": net_kind, "top1": rep.pop("top1"), **rep,
                     "holdout_top1": rep["holdout_top1"],
                     "dataset": (te.dataset or {}).get("name", ""), "split": (te.dataset or {}).get("split", ""),
                     "n": te.n, "holdout_store": ho.name, "holdout_split": (ho.dataset or {}).get("split", ""),
                     "holdout_n": ho.n, "bins": bins})
        print(f"{te.name} ({net_kind}): NLL {rep['nll']:.4f} ECE {rep['ece']:.4f} | T={rep['temperature']:.3f}: "
              f"NLL {rep['nll_ts']:.4f} ECE {rep['ece_ts']:.4f}", flush=True)
        if temperature_at_bound(rep["temperature"]):
            print(f"WARNING: {te.name}: the temperature fit on holdout store {ho.name} ran to the end of its search "
                  f"range (T = {rep['temperature']:.3g}; holdout top-1 {100 * rep['holdout_top1']:.1f}%: a holdout "
                  "classified (almost) perfectly has its lowest NLL as T -> 0), so the scaled NLL/ECE are no "
                  "calibration; Table C.3 leaves them blank. A larger holdout with errors gives a temperature.",
                  flush=True)  # beside the pair's result line (stdout: the demo keeps both in calibration.log)
    rows = conform("calibration", rows)
    return rows, merge_csv(rows, out, KEYS["calibration"], unique=True)


def accuracy_rows(paths: list[str], progress: bool = False, allow_other_classes: bool = False) -> list[dict]:
    """One accuracy.csv row per store: store, objective, seed, epoch, dataset, split, n, top1, top5,
    mean_per_class (fractions; :mod:`repsim.kernels.accuracy`), the logits read chunk by chunk. Each
    store's labels must number the head's K outputs (``repsim.store.pairing.check_label_space``, unless
    ``allow_other_classes``: ``--allow-other-classes``); every store is checked before any is scored."""
    from repsim.kernels.accuracy import TopKAccuracy
    from repsim.store.finite import require_finite
    from repsim.store.pairing import check_label_space
    from repsim.store.reader import open_store, store_names

    stores = [open_store(path) for path in paths]
    for s in stores:  # every store is checked before any is scored
        if not s.has_logits:
            raise ValueError(f"store {s.name} ({s.path}) holds no logits")
        check_label_space(s, allow=allow_other_classes)
    rows = []
    for s, name in zip(stores, store_names(stores)):  # two stores of one name: their paths
        K = int(s.zarr_array("/logits").shape[1])
        acc = TopKAccuracy(K, ks=(1, 5))
        labels = s.labels
        for i in range(s.n_chunks):
            lo = i * s.chunk_rows
            z = require_finite(s.read_chunk("/logits", i), s, "logits", lo)
            acc.update(z, labels[lo:lo + len(z)])
        r = acc.result()
        model, data = s.model, s.dataset
        rows.append({"store": name, "objective": model.get("objective", "") or "",
                     "seed": "" if model.get("seed") is None else model.get("seed"),
                     "epoch": "" if model.get("epoch") is None else model.get("epoch"),
                     "dataset": data.get("name", ""), "split": data.get("split", ""), "n": s.n, **r})
        if progress:
            print(f"{s.name}: top-1 {r['top1']:.4f} top-5 {r['top5']:.4f} (n={s.n})", file=sys.stderr, flush=True)
    return conform("accuracy", rows)
