"""The end-to-end demo pipeline behind `repsim demo` (train → extract → analyse → report) on sklearn digits.

Layout of the output directory (each stage reuses what a previous run finished)::

    OUT/runs/<objective>-s<seed>/   `repsim train` output; DONE marks a finished run (keyed on its command);
                                    epoch-EEEE.pt every KEEP_EVERY epochs (training dynamics)
    OUT/stores/<group>/<run>-<group>.zarr   `repsim extract` stores; reused when complete and newer than
                                    the checkpoint
    OUT/stores/<dyn group>/<run>-epoch-EEEE-<dyn group>.zarr   earlier checkpoints of the seed-0 runs,
                                    penultimate layer only (Figs. D.2, E.4)
    OUT/results/                    results files (docs/architecture.md "Results files"); each keyed in
                                    results/fingerprints.json on the stores it was computed from
    OUT/report/                     figures, tables, report.html, findings.md; rewritten when the results
                                    or the analyses code changed (report/.report-key)

Torch work (train, extract) runs in subprocesses through the public command line, two at a time on
a 2-core machine; the analyses run in this process through the torch-free ``repsim`` API, one store at a
time, so memory stays bounded by one store's largest layer.
"""
from __future__ import annotations

import collections
import csv
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from analyses.objectives import OBJECTIVES

# store group -> (dataset spec, split, --layers for extract, what it is for)
GROUPS: dict[str, tuple[str, str, str | None, str]] = {
    "src-test": ("digits-source", "test", None, "every block: CKA, R², sparsity, predictions (Figs. 2–4, C.4–C.7)"),
    "src-train": ("digits-source", "train", "pool", "R², collapse, spectra on the training set (Table 3, E.1, E.2)"),
    "src-holdout": ("digits-source", "holdout", "pool", "relearning the source classes (Fig. 6)"),
    "tgt-train": ("digits-target", "train", "pool", "transfer probes: fit (Table 1)"),
    "tgt-test": ("digits-target", "test", "pool", "transfer probes: score; class overlap (Table 1, F.1)"),
}
# training dynamics (Figs. D.2, E.4): the kept checkpoints before the analysed one, of one network per
# objective (seed 0, as the paper plots "a single ResNet-50 model of each loss function"), penultimate only
KEEP_EVERY = 5
DYNAMICS_GROUPS: dict[str, tuple[str, str, str, str]] = {
    "dyn-src-train": ("digits-source", "train", "pool", "R² over training, training set (Fig. E.4)"),
    "dyn-src-test": ("digits-source", "test", "pool", "R² over training, evaluation set (Fig. E.4)"),
    "dyn-tgt-train": ("digits-target", "train", "pool", "linear transfer over training: fit (Fig. D.2)"),
    "dyn-tgt-test": ("digits-target", "test", "pool", "linear transfer over training: score (Fig. D.2)"),
}
TRANSFER_TASK = "digits-target"
RELEARN_TASK = "source-relearn"
ANALYSIS_VERSION = "3"  # bump when the analysis settings below change, to invalidate old results


class DemoError(RuntimeError):
    """A stage cannot run; the message names the stage and, when it is missing, the upstream piece."""


@dataclass
class Task:
    name: str
    argv: list[str]
    done: Callable[[], None] = lambda: None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))


def _say(msg: str) -> None:
    print(msg, flush=True)


def _pump(stream, prefix: str, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        line = line.rstrip("\r\n")
        tail.append(line)
        if line.strip():
            print(f"  [{prefix}] {line.split(chr(13))[-1]}", flush=True)
    stream.close()


def run_tasks(tasks: list[Task], jobs: int, stage: str) -> None:
    """Run subprocesses ``jobs`` at a time, streaming their output with a prefix; fail on the first error."""
    env = dict(os.environ)
    if jobs > 1:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
    pending, running = list(tasks), {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                t = pending.pop(0)
                p = subprocess.Popen(t.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, bufsize=1)
                th = threading.Thread(target=_pump, args=(p.stdout, t.name, t.tail), daemon=True)
                th.start()
                running[p] = (t, th)
            time.sleep(0.1)
            for p in [p for p in running if p.poll() is not None]:
                t, th = running.pop(p)
                th.join()
                if p.returncode != 0:
                    tail = list(t.tail)
                    raise DemoError(f"{stage}: {t.name} failed (exit {p.returncode}): {' '.join(t.argv)}\n"
                                    + "\n".join(tail[-15:]))
                t.done()
    finally:
        for p in running:  # only the processes started here
            p.terminate()
        for p in running:
            p.wait()


def _repsim(*args: str) -> list[str]:
    return [sys.executable, "-m", "repsim", *args]


@dataclass
class Demo:
    out: Path
    objectives: tuple[str, ...] = OBJECTIVES
    seeds: int = 2
    epochs: int | None = None
    jobs: int = 2
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds (OUT/timings.json)

    @property
    def run_names(self) -> list[str]:
        return [f"{o}-s{s}" for o in self.objectives for s in range(self.seeds)]

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    # ------------------------------------------------------------------ train
    def train_argv(self, objective: str, seed: int) -> list[str]:
        argv = _repsim("train", "--preset", f"digits-{objective}", "--seed", str(seed),
                       "--out", str(self.run_dir(f"{objective}-s{seed}")), "--no-progress",
                       "--keep-every", str(KEEP_EVERY))
        if self.epochs is not None:
            argv += ["--set", f"epochs={self.epochs}"]
        return argv

    def stage_train(self) -> bool:
        tasks = []
        for o in self.objectives:
            for s in range(self.seeds):
                name, argv = f"{o}-s{s}", self.train_argv(o, s)
                d = self.run_dir(name)
                key = json.dumps(argv[3:])
                done = d / "DONE"
                if done.is_file() and json.loads(done.read_text()).get("key") == key:
                    continue
                resume = (d / "checkpoint.pt").is_file() and (d / "demo-key.json").is_file() \
                    and json.loads((d / "demo-key.json").read_text()).get("key") == key
                if not resume and d.exists():
                    shutil.rmtree(d)
                d.mkdir(parents=True, exist_ok=True)
                (d / "demo-key.json").write_text(json.dumps({"key": key}))

                def mark(done=done, key=key):
                    done.write_text(json.dumps({"key": key, "finished": time.time()}))

                tasks.append(Task(f"train {name}", argv + (["--resume"] if resume else []), mark))
        _say(f"[demo] train: {len(self.run_names) - len(tasks)} of {len(self.run_names)} networks already "
             f"trained; training {len(tasks)} ({self.jobs} at a time)")
        run_tasks(tasks, self.jobs, "train")
        return bool(tasks)

    def checkpoint(self, name: str) -> Path:
        d = self.run_dir(name)
        for f in ("best.pt", "checkpoint.pt"):
            if (d / f).is_file():
                return d / f
        raise DemoError(f"train: no checkpoint in {d} (expected best.pt or checkpoint.pt)")

    def dynamics_checkpoints(self) -> list[tuple[str, Path]]:
        """(``<run>-epoch-EEEE``, kept checkpoint) of the seed-0 runs, for the epochs before the analysed
        checkpoint (best.pt: curves end there, as in Figs. D.2 and E.4)."""
        from repsim.commands.runs import best_epoch

        out = []
        for name in self.run_names:
            if not name.endswith("-s0"):
                continue
            d = self.run_dir(name)
            with (d / "metrics.csv").open(newline="") as f:
                last = best_epoch(list(csv.DictReader(f))) if (d / "best.pt").is_file() else math.inf
            for ck in sorted(d.glob("epoch-*.pt")):
                if int(ck.stem.split("-")[1]) < last:
                    out.append((f"{name}-{ck.stem}", ck))
        return out

    def group_members(self, group: str) -> list[tuple[str, Path]]:
        """(store name stem, checkpoint) of every store of ``group``."""
        if group in DYNAMICS_GROUPS:
            return self.dynamics_checkpoints()
        return [(n, self.checkpoint(n)) for n in self.run_names]

    # ---------------------------------------------------------------- extract
    def store_path(self, group: str, name: str) -> Path:
        return self.out / "stores" / group / f"{name}-{group}.zarr"

    def group_paths(self, group: str) -> list[str]:
        return [str(self.store_path(group, n)) for n, _ in self.group_members(group)]

    def _store_ok(self, path: Path, ckpt: Path) -> bool:
        from repsim import open_store

        try:
            open_store(path)
        except (ValueError, FileNotFoundError, OSError):
            return False
        return (path / "zarr.json").stat().st_mtime >= ckpt.stat().st_mtime

    def stage_extract(self) -> bool:
        tasks, n_todo, n_all = [], 0, 0
        for group, (spec, split, layers, _) in {**GROUPS, **DYNAMICS_GROUPS}.items():
            todo = []
            members = self.group_members(group)
            n_all += len(members)
            for name, ckpt in members:
                path = self.store_path(group, name)
                if self._store_ok(path, ckpt):
                    continue
                if path.exists():
                    shutil.rmtree(path)
                todo.append(str(ckpt))
            if not todo:
                continue
            n_todo += len(todo)
            (self.out / "stores" / group).mkdir(parents=True, exist_ok=True)
            template = ("{parent}-{stem}-" if group in DYNAMICS_GROUPS else "{parent}-") + group
            argv = _repsim("extract", "--data", spec, "--split", split, "--out-dir", str(self.out / "stores" / group),
                           "--name", template, "--no-progress", "--workers", "0")
            if layers:
                argv += ["--layers", layers]
            for c in todo:
                argv += ["--checkpoint", c]
            tasks.append(Task(f"extract {group} ({len(todo)})", argv))
        _say(f"[demo] extract: {n_all - n_todo} of {n_all} stores already complete; writing {n_todo}")
        run_tasks(tasks, self.jobs, "extract")
        return bool(tasks)

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
        """Results files, each recomputed only when the stores it reads changed. BLAS runs one thread
        per library (numpy's and scipy's OpenBLAS): on a busy 2-core machine multi-threaded BLAS on
        these small problems spins and ran the probes ~50x slower."""
        import scipy.linalg  # noqa: F401  (load scipy's BLAS so that the limit below covers it)
        import scipy.optimize  # noqa: F401
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1):
            return self._analyse()

    def _analyse(self) -> bool:
        from analyses import demo_analysis as A

        res = self.out / "results"
        res.mkdir(parents=True, exist_ok=True)
        fp_path = res / "fingerprints.json"
        fps = json.loads(fp_path.read_text()) if fp_path.is_file() else {}
        worked = False
        paths = self.group_paths
        runs = [(n, self.run_dir(n), self.checkpoint(n)) for n in self.run_names]
        probe_tasks = [(TRANSFER_TASK, paths("tgt-train"), paths("tgt-test"), ["linear", "knn"]),
                       (RELEARN_TASK, paths("src-holdout"), paths("src-test"), ["linear"])]
        if paths("dyn-tgt-train"):  # Fig. D.2: linear transfer at the earlier checkpoints
            probe_tasks.append((TRANSFER_TASK, paths("dyn-tgt-train"), paths("dyn-tgt-test"), ["linear"]))
        steps = [
            ("training.csv", [], lambda: A.training_csv(runs, res / "training.csv")),
            ("cka_demo.npz", ["src-test"], lambda: A.cka(paths("src-test"), res / "cka_demo.npz")),
            ("separation.csv", ["src-test", "src-train", "dyn-src-train", "dyn-src-test"],
             lambda: A.layer_metrics(paths("src-test"), paths("src-train"), res,
                                     dynamics=paths("dyn-src-train") + paths("dyn-src-test"))),
            ("accuracy.csv", ["src-train"], lambda: A.accuracy(paths("src-train"), res / "accuracy.csv")),
            ("probes.csv", ["src-holdout", "src-test", "tgt-train", "tgt-test", "dyn-tgt-train", "dyn-tgt-test"],
             lambda: A.probes(probe_tasks, res / "probes.csv")),
        ]
        for fname, groups, fn in steps:
            extra = json.dumps([self.run_names, self.epochs]) if not groups else ""
            fp = self._fingerprint(groups, extra) if groups else hashlib.sha256(
                (extra + "".join(str((self.run_dir(n) / "DONE").stat().st_mtime) for n in self.run_names)).encode()
            ).hexdigest()[:16]
            if fps.get(fname) == fp and (res / fname).is_file():
                _say(f"[demo] analyse: {fname} up to date")
                continue
            t0 = time.perf_counter()
            _say(f"[demo] analyse: computing {fname} ...")
            try:
                fn()
            except A.AnalysisError as exc:
                raise DemoError(f"analyse: {exc}") from exc
            worked = True
            fps[fname] = fp
            fp_path.write_text(json.dumps(fps, indent=1))
            _say(f"[demo] analyse: {fname} done in {time.perf_counter() - t0:.1f} s")
        return worked

    # ----------------------------------------------------------------- report
    def stage_report(self):
        from analyses.cli import make_figures
        from analyses.data import Inputs
        from analyses.findings import evaluate, findings_html, findings_text

        # not stores of earlier, larger runs
        names = {Path(p).name.removesuffix(".zarr") for g in (*GROUPS, *DYNAMICS_GROUPS) for p in self.group_paths(g)}
        findings = evaluate(Inputs(self.out / "stores", self.out / "results", names))
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items())
        import html

        epochs = f"{self.epochs} epochs (--epochs)" if self.epochs else "the presets' epochs"
        stores = "".join(f"<li><code>{g}</code>: {spec} {split}, {'every layer' if layers is None else layers}"
                         f" — {html.escape(why)}</li>" for g, (spec, split, layers, why) in GROUPS.items())
        stores += "".join(f"<li><code>{g}</code>: {spec} {split}, {layers}, seed-0 networks' checkpoints every "
                          f"{KEEP_EVERY} epochs before the analysed one — {html.escape(why)}</li>"
                          for g, (spec, split, layers, why) in DYNAMICS_GROUPS.items())
        pre = (f"<p class='caption'>{len(self.objectives)} objectives × {self.seeds} seed(s) = "
               f"{len(self.run_names)} mini-ResNets (train/presets/digits-&lt;objective&gt;.toml, {epochs}; "
               f"the checkpoint with the best holdout accuracy is analysed) pretrained on sklearn digits 0–4 "
               f"(digits-source); transfer task: digits 5–9 (digits-target). Stage times (last run that did "
               f"the stage's work): {timing}. "
               f"Stores per network:</p><ul class='caption'>{stores}</ul>")
        outcomes, report = make_figures(self.out / "stores", self.out / "results", self.out / "report",
                                        title="repsim demo: sklearn digits, 9 objectives",
                                        intro_html=findings_html(findings, pre), progress=True,
                                        only_stores=names)
        (self.out / "report" / "findings.md").write_text(findings_text(findings) + "\n")
        return findings, outcomes, report

    def report_key(self) -> str:
        """What the report depends on: the results (their fingerprints), the analyses code, the run set."""
        h = hashlib.sha256(json.dumps([self.run_names, self.epochs]).encode())
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
            _say(f"[demo] report: {rep / 'report.html'} up to date\n[demo] findings:\n"
                 + (rep / "findings.md").read_text().rstrip())
            return 0
        t0 = time.perf_counter()
        findings, outcomes, report = self.stage_report()
        self.timings["report"] = time.perf_counter() - t0
        timing_file.write_text(json.dumps(self.timings))
        from analyses.findings import findings_text

        _say("[demo] findings:\n" + findings_text(findings))
        failed = [o for o in outcomes if o.status == "failed"]
        _say(f"[demo] report: {report} ({sum(o.status == 'done' for o in outcomes)} items, "
             f"{len(failed)} failed); this run {time.perf_counter() - t_all:.0f} s; stage times (last run that "
             "did each stage's work): " + ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items()))
        if failed:
            return 1
        key_file.write_text(key)
        return 0


def fresh(out: Path) -> None:
    """Remove what the demo wrote under ``out`` (only its own subdirectories)."""
    for sub in ("runs", "stores", "results", "report"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    (out / "timings.json").unlink(missing_ok=True)

