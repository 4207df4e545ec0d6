"""The demo's analysis stage: results files (docs/architecture.md "Results files") from activation stores, through the
torch-free ``repsim`` engine drivers and the library calls behind `repsim probe` / `repsim calibrate`
(no argv lists: the commands are thin layers over the same functions), in the calling process.

Every function takes the stores (or run directories) it reads explicitly; :mod:`repsim.analyses.pipeline`
decides which those are. Failures raise :class:`AnalysisError`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


class AnalysisError(RuntimeError):
    """A results file could not be computed; the message names the step."""


def training_csv(runs: Sequence[tuple[str, Path, Path]], path: Path) -> None:
    """training.csv from each run's metrics.csv (`repsim runs`), up to the epoch of best.pt when the run
    saved one (App. A.1 early stopping: ``repsim.study.runs.best_epoch``), as in Figs. C.1–C.3.

    ``runs``: (name ``<objective>-s<seed>``, run directory, extracted checkpoint) per run.
    """
    from repsim.results import write_csv
    from repsim.study.runs import training_rows

    write_csv(training_rows([d for _, d, _ in runs], [n for n, _, _ in runs]), path)


NONULL_SUFFIX = "_nonull"  # the results file of the measures computed without the null


def similarity(paths: Sequence[str], path: Path, measures: Sequence[str] = ("linear_cka",),
               batch_size: int | None = None, permutations: int | None = None,
               calibrated: Sequence[str] = ()) -> None:
    """The similarity measures ``measures`` across every (network, layer) of the given stores (one split),
    in one `repsim similarity` results file (``repsim.similarity_matrix``). Linear and RBF CKA by minibatch
    CKA (paper §3.2), one epoch over consecutive batches of ``batch_size`` rows (stores are written in a
    fixed shuffled order, so each batch is a random sample); ``None``: one batch holding every example —
    on the digits demo's 225 examples, the unbiased-HSIC CKA of the whole split (the engine's
    method="exact" gives the same numbers, to 2e-8, in ~1.5x the time there). The other measures have
    no minibatch estimator and run exact on the full data.

    ``permutations=K``: the measures of ``measures`` that are in ``calibrated`` get K permutation-null draws
    (``similarity_matrix(permutations=K)``, seed 0, α = 0.05: the within-batch null of the same pass) and go
    to ``path``; the others are computed without one into ``<path stem>_nonull.npz``, removed otherwise."""
    from repsim.engine.minibatch import similarity_matrix
    from repsim.store.reader import open_store

    first = open_store(paths[0])
    layers = [l for l in first.layers if l != "logits"]
    with_null = [m for m in measures if permutations and m in calibrated]
    groups = [(with_null, permutations, path)] if with_null else []
    rest = [m for m in measures if m not in with_null]
    nonull = path.with_name(path.stem + NONULL_SUFFIX + path.suffix)
    if rest:
        groups.append((rest, None, nonull if with_null else path))
    if not (with_null and rest):
        nonull.unlink(missing_ok=True)  # a stale file of another setting would be read beside this one
    for names, K, out in groups:
        result = similarity_matrix(list(paths), names, layers=layers,
                                   batch_size=min(batch_size or first.n, first.n), epochs=1, shuffle=False,
                                   debiased=True, progress=False, permutations=K)
        result.save(str(out))


def layer_metrics(test: Sequence[str], train: Sequence[str], res: Path, dynamics: Sequence[str] = ()) -> None:
    """separation.csv (every layer of the ``test`` stores, cosine; every layer the ``train`` stores hold,
    cosine (Fig. 4 on the training set when they hold every block); the penultimate layer under all
    three distances on the ``test`` and ``train`` stores; the penultimate layer, cosine, of the
    ``dynamics`` stores of earlier checkpoints, Fig. E.4), sparsity.csv (every layer, ``test``),
    collapse.csv and spectra.npz (penultimate layer, ``train``), by the engine's streaming drivers."""
    from repsim.engine.drivers import DISTANCES, collapse_rows, separation_rows, sparsity_rows
    from repsim.results import write_csv
    from repsim.store.reader import open_store

    blocks = [l for l in open_store(test[0]).layers if l != "logits"]
    kw = dict(progress=False, threads=1)
    sep = separation_rows(test, blocks, distances=("cosine",), **kw)
    sep += [r for r in separation_rows(test, ["pool"], distances=DISTANCES, **kw) if r["distance"] != "cosine"]
    train_blocks = [l for l in open_store(train[0]).layers if l not in ("logits", "pool")] if train else []
    if train_blocks:
        sep += separation_rows(train, train_blocks, distances=("cosine",), **kw)
    sep += separation_rows(train, ["pool"], distances=DISTANCES, **kw)
    if dynamics:
        sep += separation_rows(dynamics, ["pool"], distances=("cosine",), **kw)
    write_csv(sep, res / "separation.csv")
    write_csv(sparsity_rows(test, blocks, **kw), res / "sparsity.csv")
    rows, spectra = collapse_rows(train, ["pool"], spectra=True, **kw)
    write_csv(rows, res / "collapse.csv")
    tmp = res / "spectra.tmp.npz"
    np.savez(tmp, **spectra)
    tmp.replace(res / "spectra.npz")


def accuracy(paths: Sequence[str], path: Path) -> None:
    """accuracy.csv (`repsim accuracy`): each network's own top-1 / top-5 on the stores' split (the
    training split: Table C.1)."""
    from repsim.probes.writers import accuracy_rows
    from repsim.results import write_csv

    write_csv(accuracy_rows(list(paths)), path)


def probes(tasks: Sequence[tuple[str, Sequence[str], Sequence[str], Sequence[str]]], path: Path,
           relearn: Sequence[str] = (), relearn_task: str = "relearn") -> None:
    """probes.csv by `repsim probe`'s library call (``repsim.probes.writers.write_probes``) on the
    penultimate layer: for each task ``(name, fit stores, evaluation stores, probe kinds)`` one call (e.g.
    linear and kNN transfer fit on the target's train split and scored on its test split); then, for the
    ``relearn`` stores (the source task's evaluation split), Fig. 6's protocol (`repsim probe --relearn`:
    10 held-out examples per class of each store, the probe fit on the rest, and the network's own head
    scored on the same examples)."""
    from repsim.probes.writers import write_probes

    if path.exists():
        path.unlink()  # `repsim probe` merges into an existing file; start from the current run set only
    calls = [(task, dict(train=fit, test=ev, probe=list(kinds))) for task, fit, ev, kinds in tasks]
    if relearn:
        calls.append((relearn_task, dict(train=relearn, relearn=True)))
    for task, kw in calls:
        try:
            write_probes(**kw, task=task, layer="pool", out=path.parent, progress=False)
        except (ValueError, OSError) as e:
            raise AnalysisError(f"`repsim probe` failed for task {task}: {e}") from e


def calibration(test: Sequence[str], holdout: Sequence[str], path: Path) -> None:
    """calibration.csv by `repsim calibrate`'s library call (``repsim.probes.writers.write_calibration``):
    NLL and ECE of each network on the ``test`` stores, before and after a temperature fit on its
    ``holdout`` store (Table C.3)."""
    from repsim.probes.writers import write_calibration

    try:
        write_calibration(test, holdout, path)
    except (ValueError, OSError) as e:
        raise AnalysisError(f"`repsim calibrate` failed: {e}") from e
