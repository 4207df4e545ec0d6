"""Hyperparameters chosen on the holdout, then retraining on train + holdout: the paper's tuning protocol
behind ``repsim finetune`` (App. A.3, Table 2) and ``repsim tune`` (App. A.1; Mixup α, App. C.4).

The protocol, per *group* of replicates (the pretrained networks of one objective when fine-tuning, App.
A.3: "We averaged the accuracies obtained by hyperparameter tuning over 3 runs starting from 3 different
pretrained ImageNet models and picked the best"; the training seeds of one preset otherwise):

1. **Grid.** Every grid point × every replicate is trained on the ``train`` split and evaluated on the
   ``holdout`` split (never on ``test``). Its score is the holdout accuracy under ``metric`` (``top1`` or
   ``mean_per_class``, App. A.2) at the last epoch (``select_on="last"``: fine-tuning runs a fixed number
   of steps) or as a curve over epochs (``select_on="best"``: the stopping epoch is tuned too, App. A.1).
2. **Selection** (:func:`select_point`): the point with the highest holdout score averaged over the
   group's replicates (with ``"best"``: the highest value of the replicate-averaged curve, and that
   curve's epoch). Ties go to the first point in grid order.
3. **Retraining.** Each replicate is trained again at the selected point on ``train+holdout`` (A.1:
   "After determining the hyperparameters, we trained models on the full training set"; A.3: "We then
   retrained each model on combined training + validation sets and tested on the provided test sets"),
   stopped at the selected epoch with ``"best"``, and evaluated on ``test``.

Every training run is a ``repsim train`` subprocess (``torchrun`` with ``nproc_per_node`` > 1), ``jobs``
at a time, writing its log to ``RUN/train.log``. A run is done when ``RUN/DONE`` holds its key (the
configuration `repsim train` resolves, :attr:`Run.key`: an edited preset is a new run); an interrupted run
resumes from its ``checkpoint.pt``; a rerun of the same command skips what is done, so the whole protocol
resumes. Layout of ``out``::

    out/<group>/grid/<point>-<replicate>/   phase 1 runs (checkpoints removed once done unless kept)
    out/<group>/final/<replicate>/          phase 2 runs (checkpoint.pt kept: Fig. D.3 extracts it)
    out/<group>/grid.csv                    one row per phase-1 run: point, replicate, grid values, score
    out/<group>/selection.json              the rule, every point's mean score, the selected point
    out/results.csv                         one row per retrained replicate (also merged into --results)
"""
from __future__ import annotations

import csv
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from repsim.fileio import atomic_write
from repsim.study.runs import best_epoch

from .placement import DEVICES, Placement, plan_placement, visible_gpus

METRICS = ("top1", "mean_per_class")


class TuneError(ValueError):
    """The protocol cannot run (bad grid, no holdout split, a run without holdout scores); a failed training
    run is a ``repsim.commands.main.CommandError`` (exit status 1) naming its log."""


@dataclass(frozen=True)
class Replicate:
    """One member of a group: a training seed, or a pretrained checkpoint to fine-tune from."""

    name: str
    sets: tuple[tuple[str, Any], ...]
    info: Mapping[str, Any] = field(default_factory=dict)  # objective, params, seed, ... for the results rows


@dataclass
class Group:
    """Replicates whose holdout scores are averaged for selection (one objective)."""

    name: str
    replicates: list[Replicate]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Selection:
    point: int                       # index into the grid
    score: float                     # mean holdout score of that point (at ``epoch`` with "best")
    epoch: int | None                # selected stopping epoch ("best"), None for "last"
    means: list[float]               # every point's mean score (NaN where a run had no score)


# -- the rule ------------------------------------------------------------------------------------------
def select_point(curves: Sequence[Sequence[Mapping[int, float]]], select_on: str = "last") -> Selection:
    """Choose a grid point from holdout curves ``curves[point][replicate] = {epoch: score}``.

    ``"last"``: a run's score is its value at its last evaluated epoch; the point with the highest mean
    over replicates wins. ``"best"``: the replicates' curves are averaged at the epochs all of them
    evaluated; the point whose averaged curve reaches the highest value wins, at the first epoch where
    it does. NaN scores (a diverged run) count as −∞; ties go to the lowest point index.
    """
    if select_on not in ("last", "best"):
        raise ValueError(f"select_on must be 'last' or 'best', not {select_on!r}")
    if not curves:
        raise ValueError("empty grid")
    n_rep = {len(c) for c in curves}
    if len(n_rep) != 1 or 0 in n_rep:
        raise ValueError(f"every grid point needs the same, non-zero number of replicates, got {sorted(n_rep)}")
    means, epochs = [], []
    for point, runs in enumerate(curves):
        if any(not c for c in runs):
            raise ValueError(f"grid point {point}: a replicate has no holdout score")
        if select_on == "last":
            vals = [c[max(c)] for c in runs]
            means.append(_mean(vals))
            epochs.append(None)
        else:
            common = sorted(set.intersection(*(set(c) for c in runs)))
            if not common:
                raise ValueError(f"grid point {point}: the replicates share no evaluated epoch")
            curve = {e: _mean([c[e] for c in runs]) for e in common}
            e = best_epoch(curve)
            e = common[0] if e is None else e  # every value NaN: the point scores NaN (−∞ below)
            means.append(curve[e])
            epochs.append(e)
    key = [-math.inf if math.isnan(v) else v for v in means]
    best = key.index(max(key))
    if key[best] == -math.inf:
        raise ValueError("every grid point has a NaN holdout score")
    return Selection(best, means[best], epochs[best], means)


def _mean(values: Sequence[float]) -> float:
    vals = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in vals) else sum(vals) / len(vals)


# -- running -------------------------------------------------------------------------------------------
def toml_literal(value: Any) -> str:
    """``value`` as the TOML literal ``--set`` parses (:func:`repsim.train.config.parse_value`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


@dataclass
class Run:
    """One ``repsim train`` invocation: its output directory and ``--set`` assignments."""

    dir: Path
    preset: str
    sets: list[tuple[str, Any]]
    label: str
    phase: str  # "grid" | "final"

    def argv(self, nproc: int = 1, device: str = "auto") -> list[str]:
        args = ["--preset", self.preset, "--out", str(self.dir), "--no-progress"]
        if device != "auto":
            args += ["--device", device]
        for k, v in self.sets:
            args += ["--set", f"{k}={toml_literal(v)}"]
        if nproc > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "repsim.train", *args]
        return [sys.executable, "-m", "repsim", "train", *args]

    @property
    def key(self) -> str:
        """What makes two runs the same, independent of how they are launched: the configuration `repsim
        train` resolves (the preset files, then the ``--set`` assignments; :func:`repsim.train.config.load_config`),
        so an edited preset is a new run and a value set to what the preset has is the same run. A fine-tuning
        run's key also holds the sha256 of its ``finetune.init_from`` checkpoint (``init_from_sha256``): a
        checkpoint replaced at the same path (retrained, resumed) makes its runs new ones, not done ones."""
        from .config import load_config

        cfg = load_config(self.preset, [f"{k}={toml_literal(v)}" for k, v in self.sets])
        init = (cfg.get("finetune") or {}).get("init_from")
        if init:
            cfg = {**cfg, "init_from_sha256": source_sha256(init)}
        return json.dumps(cfg, sort_keys=True, default=str)


_SHA_CACHE: dict[tuple, str] = {}


def source_sha256(path: str) -> str | None:
    """The sha256 of a checkpoint (``repsim.fileio.sha256_file``; None when it is missing), computed once per
    (path, size, modification time) in this process."""
    from repsim.fileio import sha256_file

    try:
        st = os.stat(path)
    except OSError:
        return None
    sig = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if sig not in _SHA_CACHE:
        _SHA_CACHE[sig] = sha256_file(path)
    return _SHA_CACHE[sig]


def changed_source(run_dir: Path, key: str) -> str | None:
    """Why a run whose DONE was written for the same configuration is not done after all: its
    ``finetune.init_from`` checkpoint has other content now (or the DONE predates the sha256), else None."""
    old = _read_json(run_dir / "DONE").get("key")
    if not old or old == key:
        return None
    try:
        old_cfg, new_cfg = json.loads(old), json.loads(key)
    except ValueError:
        return None
    init = (new_cfg.get("finetune") or {}).get("init_from")
    if not init or (old_cfg.get("finetune") or {}).get("init_from") != init:
        return None
    strip = lambda c: {k: v for k, v in c.items() if k != "init_from_sha256"}  # noqa: E731
    if strip(old_cfg) != strip(new_cfg):
        return None
    if "init_from_sha256" not in old_cfg:
        return f"its finished run records no sha256 of its source checkpoint {init} (an older repsim)"
    return f"its source checkpoint {init} has changed since the run finished (another sha256)"


def run_state(run_dir: Path, key: str) -> str:
    """``"done"`` (DONE holds ``key``), ``"resume"`` (a checkpoint of this configuration) or ``"fresh"`` (anything
    else there is removed). Writes ``RUN/run-key.json`` for a fresh or resumed run."""
    done, keyfile = run_dir / "DONE", run_dir / "run-key.json"
    if done.is_file() and _read_json(done).get("key") == key:
        return "done"
    if (run_dir / "checkpoint.pt").is_file() and keyfile.is_file() and _read_json(keyfile).get("key") == key:
        return "resume"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    keyfile.write_text(json.dumps({"key": key}))
    return "fresh"


def mark_done(run_dir: Path, key: str) -> None:
    (run_dir / "DONE").write_text(json.dumps({"key": key, "finished": time.time()}))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_all(runs: Sequence[Run], *, jobs: int = 1, nproc: int = 1, keep_checkpoints: bool = True,
            say: Callable[[str], None] = print, on_done: Callable[[Run], None] | None = None,
            device: str = "auto", placement: Placement | None = None) -> None:
    """Run every run not yet done, ``jobs`` at a time; stop at the first failure (its log tail in the
    error). Phase-1 checkpoints are deleted once a run is done unless ``keep_checkpoints``. Where the
    runs go: ``placement``, else :func:`repsim.train.placement.plan_placement` for ``device`` on the visible
    GPUs (a request that cannot be placed raises before any run starts; a fallback says one line)."""
    if placement is None:
        placement = plan_placement(jobs, nproc, visible_gpus(), device)
        if placement.note:
            say(f"[tune] {placement.note}")
    todo = []
    for r in runs:
        key = r.key
        src = changed_source(r.dir, key)
        if src is not None:
            say(f"[tune] {r.label}: {src}; running it again")
        state = run_state(r.dir, key)
        if state != "done":
            todo.append((r, state))
    if not todo:
        say(f"[tune] {len(runs)} of {len(runs)} runs already done; nothing to run")
        return
    say(f"[tune] {len(runs) - len(todo)} of {len(runs)} runs already done; running {len(todo)} "
        f"({jobs} at a time{f', {nproc} processes each' if nproc > 1 else ''})")
    slots: queue.Queue = queue.Queue()
    for env in placement.slots:
        slots.put(env)
    from repsim.subprocesses import module_env

    base_env = module_env()  # `python -m repsim train` / torchrun `-m repsim.train`: not a train.py in the current directory
    if jobs > 1:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            base_env.setdefault(var, "1")
    failed: list[str] = []
    live: set[subprocess.Popen] = set()
    lock = threading.Lock()
    counter = [0]

    def work(run: Run, state: str) -> None:
        env = slots.get()
        try:
            with lock:
                if failed:
                    return
            argv = run.argv(nproc, placement.device) + (["--resume"] if state == "resume" else [])
            t0 = time.perf_counter()
            with open(run.dir / "train.log", "a") as log:
                p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**base_env, **env})
                with lock:
                    live.add(p)
                rc = p.wait()
                with lock:
                    live.discard(p)
            if rc != 0:
                tail = (run.dir / "train.log").read_text(errors="replace").strip().splitlines()[-12:]
                with lock:
                    if not failed:
                        say(f"[tune] {run.label} failed; the end of {run.dir / 'train.log'}:\n" + "\n".join(tail))
                    failed.append(f"training run {run.label} failed (exit {rc}); its log: {run.dir / 'train.log'}; "
                                  "a rerun of the command resumes")
                return
            mark_done(run.dir, run.key)
            if not keep_checkpoints:
                for f in ("checkpoint.pt", "best.pt"):
                    (run.dir / f).unlink(missing_ok=True)
            with lock:
                counter[0] += 1
                n = counter[0]
            try:
                note = on_done(run) if on_done else None
            except (OSError, ValueError, KeyError) as e:  # reported again, as an error, when the scores are read
                note = f"no score ({e})"
            say(f"[tune] {n}/{len(todo)} {run.label}" + (f": {note}" if note else "")
                + f" ({time.perf_counter() - t0:.0f} s)")
        finally:
            slots.put(env)

    threads: list[threading.Thread] = []
    pending = list(todo)
    try:
        while pending or threads:
            threads = [t for t in threads if t.is_alive()]
            if failed:  # stop the others; their checkpoints let a rerun resume them
                pending.clear()
                with lock:
                    for p in live:
                        p.terminate()
            while pending and len(threads) < jobs:
                t = threading.Thread(target=work, args=pending.pop(0), daemon=True)
                t.start()
                threads.append(t)
            time.sleep(0.05)
    finally:
        with lock:
            for p in live:  # only processes started here
                p.terminate()
    if failed:
        from repsim.commands.main import EXIT_PROBLEMS, CommandError

        raise CommandError(failed[0], EXIT_PROBLEMS)


def add_run_arguments(parser) -> None:
    """The options of ``repsim tune`` and ``repsim finetune`` about running the grid."""
    parser.add_argument("--jobs", type=int, default=1, help="training runs at a time (default 1)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes per run (torchrun; default 1)")
    from repsim.commands.args import add_device_option

    add_device_option(parser, package="PyTorch", choices=DEVICES,
                      cuda="cuda: the GPUs, refused when the runs cannot be placed there (the runs share the GPUs "
                           "when jobs outnumber them; auto takes the CPU when a run has more processes than there "
                           "are GPUs, and one line says so)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the grid runs' checkpoints")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every run (as in repsim train)")


def check_jobs(args) -> Placement:
    """The placement of the command's runs (:mod:`repsim.train.placement`), before anything starts: a request
    that cannot be placed raises :class:`repsim.train.placement.PlacementError` (one line, exit 2)."""
    return plan_placement(args.jobs, args.nproc_per_node, visible_gpus(), getattr(args, "device", "auto"))


def parse_sets(sets: Sequence[str], data: str | None = None) -> list[tuple[str, Any]]:
    """``--set key=value`` strings (TOML literals, :func:`repsim.train.config.parse_value`) and ``--data`` as
    (dotted key, value) pairs for :class:`Run`; ValueError on a malformed one."""
    from .config import parse_value

    out: list[tuple[str, Any]] = []
    for s in sets:
        if "=" not in s:
            raise ValueError(f"--set expects key=value, got {s!r}")
        k, v = s.split("=", 1)
        out.append((k.strip(), parse_value(v)))
    if data:
        out.append(("data.spec", data))
    return out


# -- scores --------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def holdout_curve(run_dir: Path, metric: str) -> dict[int, float]:
    """{epoch: holdout accuracy (%) under ``metric``} of a finished run."""
    col = f"holdout_{metric}"
    curve = {int(m["epoch"]): m[col] for m in read_metrics(run_dir) if col in m}
    if not curve:
        raise TuneError(f"{run_dir}/metrics.csv has no {col} column: the run evaluated no holdout split")
    return curve


# -- the protocol --------------------------------------------------------------------------------------
def grid_label(point: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items())


def tune(*, preset: str, base_sets: Sequence[tuple[str, Any]], grid: Sequence[Mapping[str, Any]],
         groups: Sequence[Group], out: Path, metric: str = "top1", select_on: str = "last", jobs: int = 1,
         nproc: int = 1, keep_checkpoints: bool = False, grid_sets: Sequence[tuple[str, Any]] = (),
         say: Callable[[str], None] = print, placement: Placement | None = None,
         results: str = "tune") -> list[dict[str, Any]]:
    """Run the protocol of the module docstring for every group; returns one row per retrained replicate
    (also written to ``out/results.csv``): the group's ``info``, the replicate's ``info``, the selected
    point, its mean holdout score, and the retrained network's test accuracies (%). ``placement``: where
    the runs train (default: :func:`repsim.train.placement.plan_placement` on the visible GPUs). ``results``: the
    results file (``repsim.results.COLUMNS``) whose columns the rows have, ``tune`` or ``finetune``."""
    if placement is None:
        placement = plan_placement(jobs, nproc, visible_gpus())
    if placement.note:
        say(f"[tune] {placement.note}")
    if metric not in METRICS:
        raise TuneError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
    if not grid:
        raise TuneError("the grid is empty")
    out = Path(out)
    phase1 = [("data.train_split", "train"), ("data.eval_holdout", True), ("data.eval_test", False),
              ("save_best", False), *grid_sets]
    # the retrained networks are evaluated once, at their last (or selected stopping) epoch
    phase2 = [("data.train_split", "train+holdout"), ("data.eval_test", True), ("save_best", False),
              ("eval_every", 10**9)]
    grid_runs: dict[str, list[list[Run]]] = {}
    for g in groups:
        grid_runs[g.name] = [[Run(out / g.name / "grid" / f"p{i:03d}-{rep.name}", preset,
                                  [*base_sets, *rep.sets, *point.items(), *phase1],
                                  f"{g.name} p{i:03d} {rep.name} ({grid_label(point)})", "grid")
                              for rep in g.replicates] for i, point in enumerate(grid)]

    def score_note(run: Run) -> str:
        if run.phase == "grid":
            curve = holdout_curve(run.dir, metric)
            return f"holdout {metric} {curve[max(curve)]:.2f}%" + (
                f" (best {max(curve.values()):.2f}%)" if select_on == "best" else "")
        last = read_metrics(run.dir)[-1]
        return f"test {metric} {last.get(f'test_{metric}', math.nan):.2f}%"

    n_grid = sum(len(p) for runs in grid_runs.values() for p in runs)
    say(f"[tune] phase 1: {len(grid)} grid point(s) x {', '.join(str(len(g.replicates)) for g in groups)} "
        f"replicate(s) in {len(groups)} group(s) = {n_grid} runs on the train split, scored on the holdout")
    run_all([r for runs in grid_runs.values() for p in runs for r in p], jobs=jobs, nproc=nproc,
            keep_checkpoints=keep_checkpoints, say=say, on_done=score_note, placement=placement)

    finals: list[tuple[Group, Replicate, Run, Selection]] = []
    for g in groups:
        curves = [[holdout_curve(r.dir, metric) for r in point_runs] for point_runs in grid_runs[g.name]]
        sel = select_point(curves, select_on)
        _write_grid(out / g.name, grid, g, curves, grid_runs[g.name])
        selection = {"metric": metric, "select_on": select_on,
                     "rule": "highest holdout score averaged over replicates; ties to the first grid point",
                     "selected": dict(grid[sel.point]), "point": sel.point, "score": sel.score, "epoch": sel.epoch,
                     "means": sel.means, "replicates": [r.name for r in g.replicates], "grid": [dict(p) for p in grid]}
        with atomic_write(out / g.name / "selection.json", "w") as f:
            f.write(json.dumps(selection, indent=1, default=str))
        say(f"[tune] {g.name}: selected {grid_label(grid[sel.point])} (mean holdout {metric} {sel.score:.2f}%"
            + (f" at epoch {sel.epoch}" if sel.epoch is not None else "") + f" over {len(g.replicates)} replicate(s))")
        stop = [("stop_epoch", int(sel.epoch))] if sel.epoch is not None else []
        for rep in g.replicates:
            run = Run(out / g.name / "final" / rep.name, preset,
                      [*base_sets, *rep.sets, *grid[sel.point].items(), *phase2, *stop],
                      f"{g.name} final {rep.name}", "final")
            finals.append((g, rep, run, sel))
    say(f"[tune] phase 2: retraining {len(finals)} network(s) on train+holdout at the selected points")
    run_all([f[2] for f in finals], jobs=jobs, nproc=nproc, keep_checkpoints=True, say=say, on_done=score_note,
            placement=placement)

    rows = []
    for g, rep, run, sel in finals:
        last = read_metrics(run.dir)[-1]
        rows.append({**g.info, **rep.info, "metric": metric,
                     "accuracy": last.get(f"test_{metric}", math.nan),
                     "top1": last.get("test_top1", math.nan), "top5": last.get("test_top5", math.nan),
                     "mean_per_class": last.get("test_mean_per_class", math.nan),
                     "holdout_accuracy": sel.score, "select_on": select_on,
                     "selected": json.dumps(dict(grid[sel.point]), default=str),
                     "selected_epoch": "" if sel.epoch is None else sel.epoch,
                     "epochs_trained": int(last["epoch"]), "steps": int(last["step"]),
                     "grid_points": len(grid), "replicates": len(g.replicates),
                     "checkpoint": str((run.dir / "checkpoint.pt").resolve()), "run": str(run.dir)})
    write_rows(out / "results.csv", rows, results)
    return rows


def _write_grid(gdir: Path, grid: Sequence[Mapping[str, Any]], g: Group, curves, runs) -> None:
    """``gdir/grid.csv``: ``repsim.results.COLUMNS["grid"]`` with the grid's parameters after replicate."""
    rows = []
    for i, point in enumerate(grid):
        for rep, curve, run in zip(g.replicates, curves[i], runs[i]):
            best = best_epoch(curve)
            rows.append({"point": i, "replicate": rep.name, **point, "last_epoch": max(curve),
                         "holdout_last": curve[max(curve)], "holdout_best": math.nan if best is None else curve[best],
                         "best_epoch": best, "run": str(run.dir)})
    write_rows(gdir / "grid.csv", rows, "grid", parameters=list(dict.fromkeys(k for p in grid for k in p)))


def write_rows(path: Path, rows: Sequence[Mapping[str, Any]], name: str, *, merge: bool = False,
               parameters: Sequence[str] = ()) -> None:
    """Write ``rows`` of results file ``name`` (``repsim.results.conform``: its declared columns, with a
    grid's ``parameters``) to the CSV ``path`` atomically; with ``merge``, merge into the file on the
    declared key ``repsim.results.KEYS[name]`` (rows with the same key values replaced, others kept):
    :func:`repsim.results.merge_csv`."""
    from repsim.results import KEYS, conform, merge_csv, write_csv

    rows = conform(name, rows, parameters=parameters)
    path.parent.mkdir(parents=True, exist_ok=True)
    if merge:
        merge_csv(rows, path, KEYS[name])
    else:
        write_csv(rows, path)
