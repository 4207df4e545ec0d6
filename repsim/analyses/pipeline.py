"""The end-to-end demo pipeline behind `repsim demo` (train → extract → analyse → report) for one study
profile (:mod:`repsim.analyses.profiles`: sklearn digits by default, Fashion-MNIST with ``--profile fashion``).

Layout of the output directory (each stage reuses what a previous run finished)::

    OUT/runs/<objective>-s<seed>/   `repsim train` output (its log lines in train.log); DONE marks a finished run
                                    (keyed on its resolved config);
                                    epoch-EEEE.pt every profile.keep_every epochs (training dynamics)
    OUT/stores/<group>/<run>-<group>.zarr   `repsim extract` stores; reused when complete and newer than
                                    the checkpoint
    OUT/stores/<dyn group>/<run>-epoch-EEEE-<dyn group>.zarr   earlier checkpoints of the seed-0 runs,
                                    penultimate layer only (Figs. D.2, E.4)
    OUT/results/                    results files (docs/architecture.md "Results files"); each keyed in
                                    results/fingerprints.json on the stores it was computed from, with
                                    the sha256 of every file its step wrote ("_outputs"): a step is
                                    reused only while each of them is there, byte for byte
    OUT/report/                     figures, tables, report.html, findings.md; rewritten when the results
                                    or the analyses code changed (report/.report-key)

Torch work (train, extract) runs through the public command line in one subprocess per stage
(:mod:`repsim.analyses.command_runs`: torch imported once, two forked workers on a 2-core machine); the
analyses run in this process through the torch-free ``repsim`` API, one store at a time, so memory
stays bounded by one store's largest layer.

The log has one line per stage and network (``[demo] train 3/18 softmax-s1: ...`` when a network
finishes training, likewise for extraction); ``verbose`` streams every line of the subprocesses.
"""
from __future__ import annotations

import collections
import contextlib
import csv
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from repsim.analyses.command_runs import ITEM  # a network's "finished" line
from repsim.analyses.profiles import DIGITS, Profile
from repsim.study.objectives import OBJECTIVES

TRAIN_LOG = "train.log"  # a network's `repsim train` output, in its run directory
ANALYSIS_VERSION = "4"  # bump when the analysis settings below change, to invalidate old results


_NOT_OUTPUTS = {"fingerprints.json"}


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """``{file name: (size, mtime ns)}`` of the files in ``folder`` (a step's outputs are those it changes)."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}


def _digest(path: Path) -> str:
    from repsim.fileio import sha256_file

    return sha256_file(path)


def _changed_outputs(folder: Path, outputs: dict[str, str]) -> list[str]:
    """The recorded outputs of a step that are missing or whose bytes changed since it wrote them
    (deleted, truncated, edited): the step is recomputed rather than reported "up to date"."""
    return [f for f, digest in outputs.items() if not (folder / f).is_file() or _digest(folder / f) != digest]


class DemoError(RuntimeError):
    """A stage cannot run; the message names the stage and, when it is missing, the upstream piece."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def train_summary(tail) -> str:
    """One line from `repsim train`'s epoch lines: the last epoch's accuracies and the epoch with the best
    holdout accuracy (the checkpoint the demo analyses, best.pt)."""
    epochs = [l.strip() for l in tail if l.strip().startswith("epoch ")]
    if not epochs:
        return ""
    last = re.sub(r" \(.*\)$", "", epochs[-1])  # drop the timing of the last epoch
    hold = [(float(m.group(1)), e.split()[1].split("/")[0]) for e in epochs
            for m in [re.search(r"holdout ([0-9.]+)%", e)] if m]
    if not hold:
        return last
    best = max(hold, key=lambda h: h[0])  # first maximum, as best.pt keeps
    return f"{last}; best holdout {best[0]:.1f}% at epoch {best[1]}"


def split_item(line: str) -> tuple[str, str | None]:
    """(other output, the ``@@item`` JSON or None) of one line of a stage's process. The workers' output
    shares the pipe with the ``@@item`` lines: a write of theirs longer than the pipe's atomic size may be
    cut by an ``@@item`` write (atomic, newline-ended), which then ends a line that it does not start."""
    at = line.find(ITEM)
    if at < 0:
        return line.strip() and line, None
    return line[:at].strip() and line[:at], line[at + len(ITEM):]


def run_stage(stage: str, networks: list[dict], jobs: int, item: Callable[[dict], str], verbose: bool = False) -> None:
    """Run the stage's ``networks`` (:mod:`repsim.analyses.command_runs` specs) in one ``python -m
    repsim.analyses.command_runs`` process with ``jobs`` forked workers; a line ``[demo] STAGE k/n <item(info)>``
    as each network finishes (``item`` also marks it done), every other output line too when ``verbose``;
    fail on an error with the process's last lines."""
    from repsim.subprocesses import module_env

    env = module_env()  # (a train.py in the current directory must not shadow repsim/train/)
    if jobs > 1:  # the workers run one thread each
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
    argv = [sys.executable, "-m", "repsim.analyses.command_runs", "--jobs", str(jobs), json.dumps(networks)]
    tail: collections.deque = collections.deque(maxlen=40)
    finished = 0
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    try:
        for line in iter(p.stdout.readline, ""):
            before, payload = split_item(line.rstrip("\r\n").split("\r")[-1])
            if before:
                tail.append(before)
                if verbose:
                    print(f"  [{stage}] {before}", flush=True)
            if payload is not None:
                try:
                    text = item(json.loads(payload))
                except Exception as exc:  # noqa: BLE001 - keep reading, or the subprocess blocks on a full pipe
                    text = f"{payload} (its progress line failed: {exc!r})"
                finished += 1
                _say(f"[demo] {stage} {finished}/{len(networks)} {text}")
        p.stdout.close()
        rc = p.wait()
    finally:
        if p.poll() is None:  # interrupted here: stop the stage's process
            p.terminate()
            p.wait()
    if rc != 0:
        command = " ".join(argv)  # (it holds every network's command lines)
        command = command if len(command) <= 400 else command[:400] + " …"
        raise DemoError(f"{stage}: {stage} failed (exit {rc}): {command}\n" + "\n".join(list(tail)[-15:]))


def shortfall(findings, profile: Profile, source: tuple[float, float] | None = None, epochs: int | None = None) -> str:
    """The report's sentence when fewer than 2 of the 3 findings are reproduced (the issue's bar for a
    study profile): how many, and why, in this run's own numbers ('' otherwise). ``source``: this run's
    lowest and highest mean source top-1 (%) over the objectives (:func:`repsim.analyses.findings.source_span`);
    ``epochs``: the demo's ``--epochs``, if given. The profile's explanation is given only when the run
    bears it out: a profile whose text says the source task saturates (``saturated_at``) says so only
    when every objective reached ``saturated_at``; below it the sentence says the networks fall short of
    it (too few epochs, when ``--epochs`` set them), which is what keeps the findings from showing."""
    from repsim.analyses.findings import format_span

    n = sum(f.verdict == "reproduced" for f in findings)
    if n >= 2 or profile.findings != "paper":
        return ""
    head = f"This run reproduces {n} of the paper's 3 findings."
    if profile.saturated_at is not None and source is not None and source[0] < profile.saturated_at:
        short = f" after {epochs} epoch{'s' if epochs != 1 else ''} (--epochs)" if epochs else ""
        return (f"{head} The objectives reach only {format_span(source)} source accuracy{short}, below the "
                f"{profile.saturated_at:.0f} % at which this profile's source task counts as saturated: the networks are undertrained, so "
                "these verdicts say little about the paper's findings"
                + ("; rerun without --epochs to train them as the presets do." if epochs else "."))
    why = profile.shortfall.replace("{source_range}", format_span(source) if source else "similar")
    return f"{head} {why}".strip()


@dataclass
class Demo:
    """One end-to-end run of ``profile``. ``sets``: extra ``--set key=value`` for every `repsim train`
    (e.g. smaller data for a quick run); ``data_root``/``download``: where the profile's data is."""
    out: Path
    objectives: tuple[str, ...] = OBJECTIVES
    seeds: int = 2
    epochs: int | None = None
    jobs: int = 2
    profile: Profile = DIGITS
    sets: tuple[str, ...] = ()
    data_root: str | None = None
    download: bool = False
    verbose: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds (OUT/timings.json)

    @property
    def groups(self) -> dict[str, tuple[str, str, str | None, str]]:
        return self.profile.groups

    @property
    def dynamics_groups(self) -> dict[str, tuple[str, str, str | None, str]]:
        """Store groups of the seed-0 runs' earlier checkpoints (none when the profile keeps none)."""
        return self.profile.dynamics if self.profile.keep_every else {}

    @property
    def run_names(self) -> list[str]:
        return [f"{o}-s{s}" for o in self.objectives for s in range(self.seeds)]

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    # ------------------------------------------------------------------ train
    def train_sets(self, objective: str) -> list[str]:
        """The ``--set`` overrides of one objective's runs: epochs, data location, the profile's setting
        for ``objective`` (a sweep's), the caller's ``--set``s, in that order (later ones win)."""
        sets = [f"epochs={self.epochs}"] if self.epochs is not None else []
        if self.data_root:
            sets.append("data.root=" + json.dumps(str(self.data_root)))
        if self.download:
            sets.append("data.download=true")
        return sets + [*self.profile.settings.get(objective, ()), *self.sets]

    def train_argv(self, objective: str, seed: int) -> list[str]:
        """The `repsim train` arguments (after ``repsim``) of one network."""
        argv = ["train", "--preset", self.profile.preset.format(objective=objective), "--seed", str(seed),
                       "--out", str(self.run_dir(f"{objective}-s{seed}")), "--no-progress"]
        if self.profile.keep_every:
            argv += ["--keep-every", str(self.profile.keep_every)]
        for s in self.train_sets(objective):
            argv += ["--set", s]
        return argv

    def train_key(self, objective: str, seed: int) -> str:
        """What a finished network is reused by: its configuration as `repsim train` resolves it (the
        preset files, then the ``--set``s; :func:`repsim.train.config.load_config`), not the command line, so
        that an edited preset retrains its networks and a value given by ``--set`` or by the preset is
        the same run."""
        from repsim.train.config import load_config

        sets = [f"seed={seed}", *([f"keep_every={self.profile.keep_every}"] if self.profile.keep_every else []),
                *self.train_sets(objective)]
        return json.dumps(load_config(self.profile.preset.format(objective=objective), sets), sort_keys=True)

    def check_data(self) -> None:
        """Fail before any training when the profile's data cannot be found (the message says how)."""
        if self.profile.check_data is None:
            return
        try:
            self.profile.check_data(self.data_root, self.download)
        except FileNotFoundError as exc:
            raise DemoError(f"data: {exc}") from None

    def stage_train(self) -> bool:
        """Every network not yet trained (or trained with another configuration): one
        `repsim.analyses.command_runs` process, which imports torch once and forks ``jobs`` workers that take the
        networks in turn, each writing its output to ``runs/<name>/train.log``; a network's DONE is
        written, and its progress line printed, as it finishes."""
        self.check_data()
        networks, marks = [], {}
        for o in self.objectives:
            for s in range(self.seeds):
                name, argv = f"{o}-s{s}", self.train_argv(o, s)
                d = self.run_dir(name)
                key = self.train_key(o, s)
                done = d / "DONE"
                if done.is_file() and json.loads(done.read_text()).get("key") == key:
                    continue
                resume = (d / "checkpoint.pt").is_file() and (d / "demo-key.json").is_file() \
                    and json.loads((d / "demo-key.json").read_text()).get("key") == key
                if not resume and d.exists():
                    shutil.rmtree(d)
                d.mkdir(parents=True, exist_ok=True)
                (d / "demo-key.json").write_text(json.dumps({"key": key}))
                marks[name] = (done, key)
                networks.append({"name": name, "commands": [argv + (["--resume"] if resume else [])],
                                 "log": str(d / TRAIN_LOG)})
        _say(f"[demo] train: {len(self.run_names) - len(networks)} of {len(self.run_names)} networks already "
             f"trained; training {len(networks)} ({self.jobs} at a time)")

        def finished(info: dict) -> str:
            done, key = marks[info["name"]]
            done.write_text(json.dumps({"key": key, "finished": time.time()}))
            log = done.parent / TRAIN_LOG
            text = train_summary(log.read_text(errors="replace").splitlines()) if log.is_file() else ""
            if self.verbose and log.is_file():
                for line in log.read_text(errors="replace").splitlines():
                    _say(f"  [{info['name']}] {line}")
            return f"{info['name']}: {text + '; ' if text else ''}{info['seconds']:.0f} s"

        if networks:
            run_stage("train", networks, self.jobs, finished, self.verbose)
        return bool(networks)

    def checkpoint(self, name: str) -> Path:
        d = self.run_dir(name)
        for f in ("best.pt", "checkpoint.pt"):
            if (d / f).is_file():
                return d / f
        raise DemoError(f"train: no checkpoint in {d} (expected best.pt or checkpoint.pt)")

    def dynamics_checkpoints(self) -> list[tuple[str, Path]]:
        """(``<run>-epoch-EEEE``, kept checkpoint) of the seed-0 runs, for the epochs before the analysed
        checkpoint (best.pt: curves end there, as in Figs. D.2 and E.4)."""
        from repsim.study.runs import best_epoch, holdout_curve

        out = []
        for name in self.run_names if self.profile.keep_every else ():
            if not name.endswith("-s0"):
                continue
            d = self.run_dir(name)
            with (d / "metrics.csv").open(newline="") as f:
                curve = holdout_curve(list(csv.DictReader(f)))
            last = (best_epoch(curve) if (d / "best.pt").is_file() else None) or math.inf
            for ck in sorted(d.glob("epoch-*.pt")):
                if int(ck.stem.split("-")[1]) < last:
                    out.append((f"{name}-{ck.stem}", ck))
        return out

    def group_members(self, group: str) -> list[tuple[str, Path]]:
        """(store name stem, checkpoint) of every store of ``group``."""
        if group in self.profile.dynamics:  # empty when the profile keeps no checkpoints
            return self.dynamics_checkpoints()
        return [(n, self.checkpoint(n)) for n in self.run_names]

    # ---------------------------------------------------------------- extract
    def store_path(self, group: str, name: str) -> Path:
        return self.out / "stores" / group / f"{name}-{group}.zarr"

    def group_paths(self, group: str) -> list[str]:
        return [str(self.store_path(group, n)) for n, _ in self.group_members(group)]

    def _store_ok(self, path: Path, ckpt: Path, layers: str | None) -> bool:
        """A complete store newer than its checkpoint that holds the group's ``layers`` (None: every block;
        a store of the penultimate layer alone, from a profile that extracted only that, is rewritten)."""
        from repsim import open_store

        try:
            store = open_store(path)
        except (ValueError, FileNotFoundError, OSError):
            return False
        held = [l for l in store.layers if l != "logits"]
        if layers is None and len(held) <= 1 or layers is not None and not set(layers.split(",")) <= set(held):
            return False
        return (path / "zarr.json").stat().st_mtime >= ckpt.stat().st_mtime

    def extract_args(self, group: str, name: str, ckpt: Path) -> list[str]:
        """`repsim extract` arguments of one store (store name stem ``name``, store group ``group``)."""
        spec, split, layers, _ = {**self.groups, **self.dynamics_groups}[group]
        args = ["--checkpoint", str(ckpt), "--data", spec, "--split", split,
                "--out", str(self.store_path(group, name)), "--no-progress", "--workers", "0"]
        if self.data_root:
            args += ["--data-root", str(self.data_root)]
        return args + (["--layers", layers] if layers else [])

    def stage_extract(self) -> bool:
        """Every network's missing stores (its store groups, and for the seed-0 runs the dynamics groups'
        stores of its earlier checkpoints): one `repsim.analyses.command_runs` process, which imports torch once
        and forks ``jobs`` workers that take the networks in turn (a progress line per network)."""
        networks, n_todo, n_all = [], 0, 0
        dynamics = self.dynamics_checkpoints()
        for name in self.run_names:
            todo = []
            members = [(g, name, self.checkpoint(name)) for g in self.groups]
            members += [(g, n, ck) for n, ck in dynamics if n.startswith(name + "-epoch-") for g in self.dynamics_groups]
            n_all += len(members)
            for group, store, ckpt in members:
                path = self.store_path(group, store)
                if self._store_ok(path, ckpt, {**self.groups, **self.dynamics_groups}[group][2]):
                    continue
                if path.exists():
                    shutil.rmtree(path)
                path.parent.mkdir(parents=True, exist_ok=True)
                todo.append(["extract", *self.extract_args(group, store, ckpt)])
            if todo:
                n_todo += len(todo)
                networks.append({"name": name, "commands": todo})
        _say(f"[demo] extract: {n_all - n_todo} of {n_all} stores already complete; writing {n_todo} "
             f"({self.jobs} networks at a time)")
        if networks:
            run_stage("extract", networks, self.jobs, lambda info: f"{info['name']}: {info['commands']} store(s); "
                                                                   f"{info['seconds']:.0f} s", self.verbose)
        return bool(networks)

    # ---------------------------------------------------------------- analyse
    def stores(self, group: str) -> list:
        from repsim import open_store

        return [open_store(p) for p in self.group_paths(group)]

    def _fingerprint(self, groups: list[str], extra: str = "") -> str:
        h = hashlib.sha256((ANALYSIS_VERSION + extra).encode())
        for g in groups:
            for s in self.stores(g):
                h.update(f"{s.name}:{s.attrs.get('created')}".encode())
        return h.hexdigest()[:16]

    def stage_analyse(self) -> bool:
        """Results files, each recomputed only when the stores it reads changed."""
        import scipy.linalg  # noqa: F401  (load scipy's BLAS so that the limits in _analyse cover it)
        import scipy.optimize  # noqa: F401

        return self._analyse()

    # The steps that spread their work over the cores themselves: the similarity engine hands the BLAS
    # thread budget to that many threads of single-threaded BLAS (repsim.blas.blas_thread_split),
    # which a limit of one thread would make one thread (the digits demo's Procrustes SVDs: 183 s on
    # one core of two). Every other step runs with BLAS at one thread per library (numpy's and
    # scipy's OpenBLAS): on a busy 2-core machine multi-threaded BLAS on their small problems spins
    # and ran the probes ~50x slower.
    OWN_THREADS = ("similarity_demo.npz",)

    def _analyse(self) -> bool:
        from threadpoolctl import threadpool_limits

        from repsim.analyses import demo_analysis as A

        res = self.out / "results"
        res.mkdir(parents=True, exist_ok=True)
        fp_path = res / "fingerprints.json"
        fps = json.loads(fp_path.read_text()) if fp_path.is_file() else {}
        worked = False
        paths = self.group_paths
        runs = [(n, self.run_dir(n), self.checkpoint(n)) for n in self.run_names]
        probe_tasks = [(self.profile.transfer_task, paths("tgt-train"), paths("tgt-test"), ["linear", "knn"])]
        if paths("dyn-tgt-train"):  # Fig. D.2: linear transfer at the earlier checkpoints
            probe_tasks.append((self.profile.transfer_task, paths("dyn-tgt-train"), paths("dyn-tgt-test"), ["linear"]))
        steps = [
            ("training.csv", [], lambda: A.training_csv(runs, res / "training.csv")),
            ("similarity_demo.npz", ["src-test"],
             lambda: A.similarity(paths("src-test"), res / "similarity_demo.npz", self.profile.measures,
                                  batch_size=self.profile.cka_batch, permutations=self.profile.permutations,
                                  calibrated=self.profile.calibrated)),
            ("separation.csv", ["src-test", "src-train", "dyn-src-train", "dyn-src-test"],
             lambda: A.layer_metrics(paths("src-test"), paths("src-train"), res,
                                     dynamics=paths("dyn-src-train") + paths("dyn-src-test"))),
            ("accuracy.csv", ["src-train"], lambda: A.accuracy(paths("src-train"), res / "accuracy.csv")),
            ("probes.csv", ["src-test", "tgt-train", "tgt-test", "dyn-tgt-train", "dyn-tgt-test"],
             lambda: A.probes(probe_tasks, res / "probes.csv", relearn=paths("src-test"),
                                       relearn_task=self.profile.relearn_task)),
            ("calibration.csv", ["src-test", "src-holdout"],
             lambda: A.calibration(paths("src-test"), paths("src-holdout"), res / "calibration.csv")),
            ("pixels.csv", [], lambda: self.pixel_baseline(res / "pixels.csv")),
        ]
        # the CKA-only file of earlier demos: the similarity file holds its measure now, and a stale copy
        # would be read first (repsim.analyses.data.Similarities)
        (res / "cka_demo.npz").unlink(missing_ok=True)
        for fname, groups, fn in steps:
            extra = json.dumps([self.run_names, self.epochs, list(self.sets)]) if not groups else ""
            if fname == "similarity_demo.npz":  # the measures and their null: another setting recomputes
                extra = ",".join(self.profile.measures) + (
                    f";K={self.profile.permutations}:{','.join(self.profile.calibrated)}" if self.profile.permutations
                    else "")
            fp = self._fingerprint(groups, extra) if groups else hashlib.sha256(
                (extra + "".join(str((self.run_dir(n) / "DONE").stat().st_mtime) for n in self.run_names)).encode()
            ).hexdigest()[:16]
            outputs = fps.setdefault("_outputs", {}).get(fname)
            stale = _changed_outputs(res, outputs) if outputs else [fname]
            if fps.get(fname) == fp and not stale:
                _say(f"[demo] analyse: {fname} up to date")
                continue
            if fps.get(fname) == fp:
                _say(f"[demo] analyse: {fname}: {', '.join(stale)} changed or missing since it was written; "
                     "recomputing")
            before = _listing(res)
            t0 = time.perf_counter()
            _say(f"[demo] analyse: computing {fname} ...")
            log = res / f"{Path(fname).stem}.log"  # the commands' per-store lines: one line here, the rest there
            try:
                with open(log, "w") as f, contextlib.redirect_stdout(f), (
                        contextlib.nullcontext() if fname in self.OWN_THREADS else threadpool_limits(limits=1)):
                    fn()
            except A.AnalysisError as exc:
                raise DemoError(f"analyse: {exc} (details: {log})") from exc
            worked = True
            fps[fname] = fp
            after = _listing(res)  # every file the step made or rewrote, with its digest: what reuse checks
            fps["_outputs"][fname] = {f: _digest(res / f) for f, stamp in after.items()
                                      if before.get(f) != stamp and f not in _NOT_OUTPUTS and not f.endswith(".log")}
            fp_path.write_text(json.dumps(fps, indent=1))
            lines = sum(1 for line in log.read_text().splitlines() if line.strip())
            _say(f"[demo] analyse: {fname} done in {time.perf_counter() - t0:.1f} s"
                 + (f" ({lines} line(s) of per-store results in {log})" if lines else ""))
            if not lines:
                log.unlink()
        return worked

    def pixel_baseline(self, path: Path) -> None:
        """pixels.csv: the linear probe on raw pixels of the transfer task (:mod:`repsim.analyses.pixel_baseline`,
        a subprocess: it builds the target's splits from the first run's config, which imports torch)."""
        from repsim.analyses.demo_analysis import AnalysisError

        fit, test = self.groups["tgt-train"][0], self.groups["tgt-test"][0]
        argv = [sys.executable, "-m", "repsim.analyses.pixel_baseline", str(self.run_dir(self.run_names[0])), fit, test,
                self.profile.transfer_task, str(path)]
        from repsim.subprocesses import module_env

        r = subprocess.run(argv, capture_output=True, text=True, env=module_env())
        if r.returncode != 0:
            raise AnalysisError(f"pixel baseline failed: {(r.stderr or r.stdout).strip()[-2000:]}")
        print(r.stdout.strip())

    # ----------------------------------------------------------------- report
    def stage_report(self):
        from repsim.analyses.cli import make_figures
        from repsim.analyses.data import Inputs
        from repsim.analyses.findings import evaluate, evaluate_tau, findings_html, findings_text, source_span

        # not stores of earlier, larger runs
        names = {Path(p).name.removesuffix(".zarr") for g in (*self.groups, *self.dynamics_groups)
                 for p in self.group_paths(g)}
        inputs = Inputs(self.out / "stores", self.out / "results", names)
        findings = evaluate_tau(inputs) if self.profile.findings == "tau" else evaluate(inputs)
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items())
        import html

        epochs = f"{self.epochs} epochs (--epochs)" if self.epochs else "the presets' epochs"
        stores = "".join(f"<li><code>{g}</code>: {spec} {split}, {'every layer' if layers is None else layers}"
                         f" — {html.escape(why)}</li>" for g, (spec, split, layers, why) in self.groups.items())
        stores += "".join(f"<li><code>{g}</code>: {spec} {split}, {layers}, seed-0 networks' checkpoints every "
                          f"{self.profile.keep_every} epochs before the analysed one — {html.escape(why)}</li>"
                          for g, (spec, split, layers, why) in self.dynamics_groups.items())
        p = self.profile
        preset = html.escape(p.preset.format(objective="<objective>"))
        sets = f" with --set {html.escape(' '.join(self.sets))}" if self.sets else ""
        pre = (f"<p class='caption'>Profile <code>{p.name}</code>: {len(self.objectives)} objectives × "
               f"{self.seeds} seed(s) = {len(self.run_names)} mini-ResNets (repsim/train/presets/{preset}.toml, "
               f"{epochs}{sets}; the checkpoint with the best holdout accuracy is analysed) pretrained on "
               f"{html.escape(p.source_text)}; transfer task: {html.escape(p.target_text)}. Stage times (last "
               f"run that did the stage's work): {timing}. "
               f"Stores per network:</p><ul class='caption'>{stores}</ul>")
        short = shortfall(findings, p, source_span(inputs), self.epochs)
        if short:
            pre += f"<p class='caption'><b>{html.escape(short)}</b></p>"
        outcomes, report = make_figures(self.out / "stores", self.out / "results", self.out / "report",
                                        title=p.title,
                                        intro_html=findings_html(findings, pre), progress=True,
                                        only_stores=names)
        (self.out / "report" / "findings.md").write_text(findings_text(findings) + (f"\n\n{short}" if short else "") + "\n")
        return findings, outcomes, report

    def report_key(self) -> str:
        """What the report depends on: the results (their fingerprints), the analyses code, the run set."""
        h = hashlib.sha256(json.dumps([self.profile.name, self.run_names, self.epochs, self.sets]).encode())
        h.update((self.out / "results" / "fingerprints.json").read_bytes())
        for f in sorted(Path(__file__).parent.rglob("*.py")):
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    # -------------------------------------------------------------------- all
    def run(self) -> int:
        t_all = time.perf_counter()
        timing_file = self.out / "timings.json"  # seconds of the last run in which each stage did work
        self.timings = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
        for stage in ("train", "extract", "analyse"):
            t0 = time.perf_counter()
            _say(f"[demo] === {stage} ===")
            if getattr(self, f"stage_{stage}")():
                self.timings[stage] = time.perf_counter() - t0
                timing_file.write_text(json.dumps(self.timings))
        _say("[demo] === report ===")
        rep = self.out / "report"
        key, key_file = self.report_key(), rep / ".report-key"
        if key_file.is_file() and key_file.read_text() == key and (rep / "findings.md").is_file():
            _say(f"[demo] report: {rep / 'report.html'} up to date\n" + findings_log(rep / "findings.md"))
            return 0
        t0 = time.perf_counter()
        findings, outcomes, report = self.stage_report()
        self.timings["report"] = time.perf_counter() - t0
        timing_file.write_text(json.dumps(self.timings))
        _say(findings_log(rep / "findings.md"))  # as a rerun prints it
        failed = [o for o in outcomes if o.status == "failed"]
        _say(f"[demo] report: {report} ({sum(o.status == 'done' for o in outcomes)} items, "
             f"{len(failed)} failed); this run {time.perf_counter() - t_all:.0f} s; stage times (last run that "
             "did each stage's work): " + ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items()))
        if failed:
            return 1
        key_file.write_text(key)
        return 0


def findings_log(path: Path) -> str:
    """What the demo's log says of findings.md: one '- NAME: VERDICT' line per finding, the closing
    sentence when there is one (findings.md's last paragraph when it is not a finding's), and where the
    conditions and the evidence are."""
    from repsim.analyses.findings import verdict_lines

    text = path.read_text().rstrip()
    lines = [f"- {v}" for v in verdict_lines(text)]
    last = text.rsplit("\n\n", 1)[-1]
    if last.startswith("This run reproduces"):
        lines.append(last)
    return "\n".join([f"[demo] findings (each with its conditions, intervals and evidence in {path}):", *lines])


def fresh(out: Path) -> None:
    """Remove what the demo wrote under ``out`` (only its own subdirectories)."""
    for sub in ("runs", "stores", "results", "report"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    (out / "timings.json").unlink(missing_ok=True)

