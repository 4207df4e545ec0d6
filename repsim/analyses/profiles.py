"""Study profiles of `repsim demo`: which data, presets, store groups and settings one end-to-end run uses.

``digits`` (the default) runs in minutes on scikit-learn's digits and needs no download, but its 8×8
source task saturates (every objective reaches 96–98 %), so the paper's findings mostly do not show.
``fashion`` runs the same study on Fashion-MNIST, where the source task has headroom; its data
comes from ``--data-root``, the Debian package ``dataset-fashion-mnist`` or torchvision's downloader
(:mod:`repsim.train.fashion`). Its sizes were chosen by measurement (repsim/analyses/README.md, search record).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# store group -> (dataset spec, split, --layers for extract (None: every layer), what it is for)
Groups = dict[str, tuple[str, str, "str | None", str]]


def _groups(source: str, target: str, target_fit: str, train_layers: str | None = "pool") -> Groups:
    """The store groups; ``train_layers``: the source training split's --layers (None: every block, so that
    Fig. 4's per-layer R² is on the training set as in the paper; "pool": the penultimate layer only, and
    Fig. 4 falls back to the test split, its caption says so)."""
    train_use = ("R² per layer (Fig. 4), " if train_layers is None else "R², ") + \
        "collapse, spectra on the training set (Table 3, E.1, E.2)"
    return {
        "src-test": (source, "test", None, "every block: CKA, R², sparsity, predictions, relearned heads, "
                     "calibration (Figs. 2, 3, 6, C.4–C.7, Table C.3" + (")" if train_layers is None else
                                                                       "; Fig. 4, the training split's blocks not extracted)")),
        "src-train": (source, "train", train_layers, train_use),
        "src-holdout": (source, "holdout", "pool", "temperature scaling (Table C.3)"),
        "tgt-train": (target_fit, "train", "pool", "transfer probes: fit (Table 1)"),
        "tgt-test": (target, "test", "pool", "transfer probes: score; class overlap (Table 1, F.1)"),
    }


def _dynamics(source: str, target_fit: str, target: str) -> Groups:
    """Training dynamics (Figs. D.2, E.4): the kept checkpoints before the analysed one of one network per
    objective (seed 0, as the paper plots "a single ResNet-50 model of each loss function"), penultimate only."""
    return {
        "dyn-src-train": (source, "train", "pool", "R² over training, training set (Fig. E.4)"),
        "dyn-src-test": (source, "test", "pool", "R² over training, evaluation set (Fig. E.4)"),
        "dyn-tgt-train": (target_fit, "train", "pool", "linear transfer over training: fit (Fig. D.2)"),
        "dyn-tgt-test": (target, "test", "pool", "linear transfer over training: score (Fig. D.2)"),
    }


@dataclass(frozen=True)
class Profile:
    """One study: presets ``preset.format(objective=...)``, store groups, transfer task, and prose.

    ``target_fit``: the dataset spec the transfer probes are fit on (default: ``target``; e.g. a spec
    with more training images than the pretraining run's). ``cka_batch``: examples per minibatch of the CKA step (None: the whole split in one batch, i.e.
    the unbiased-HSIC CKA of the split). ``measures``: the similarity measures of that step (one results
    file, ``similarity_demo.npz``; the report's Fig. 2 panels per measure and the measures' agreement);
    ``permutations``: K draws of the permutation null for the measures of ``calibrated`` (calibrated Fig. 2,
    finding 2's calibration), which then are ``similarity_demo.npz`` and the rest ``similarity_demo_nonull.npz``. ``check_data``: called before training with the demo's
    data options; raises ``FileNotFoundError`` with a message saying how to get the data.
    """
    name: str
    preset: str
    source: str
    target: str
    title: str
    source_text: str
    target_text: str
    seeds: int = 2
    cka_batch: int | None = None
    measures: tuple[str, ...] = ("linear_cka", "rbf_cka", "procrustes", "mutual_knn")
    # the permutation null of the similarity step (issue 44: Figs. 2a/2b calibrated, finding 2's calibration):
    # K draws for the measures of `calibrated` (None: no null); the other measures go to a second results
    # file without one (similarity_demo_nonull.npz)
    permutations: int | None = None
    calibrated: tuple[str, ...] = ("linear_cka", "rbf_cka")
    check_data: Callable[[str | None, bool], None] | None = None
    relearn_task: str = "relearn"  # Fig. 6 by the paper's protocol (`repsim probe --relearn` on src-test)
    target_fit: str = ""
    # said in the report when fewer than 2 findings are reproduced: why, where to read more; "{source_range}"
    # is replaced by this run's lowest–highest mean source top-1 (repsim.analyses.findings.source_span)
    shortfall: str = ""
    # the lowest mean source top-1 (%) at which the profile's `shortfall` (which says the source task
    # saturates) is true of a run; below it the report says the networks are short of it instead
    # (repsim.analyses.pipeline.shortfall). None: the shortfall text states no accuracy.
    saturated_at: float | None = None
    keep_every: int = 0  # keep a checkpoint every K epochs (0: none) for the dynamics groups
    groups: Groups = field(default_factory=dict)
    dynamics: Groups = field(default_factory=dict)
    # runs other than one per objective: run-name stem -> extra `repsim train --set` (e.g. one cosine-softmax
    # temperature each, preset without "{objective}"); the demo's --objectives then name these stems
    settings: dict[str, tuple[str, ...]] = field(default_factory=dict)
    findings: str = "paper"  # "paper": the three findings; "tau": the temperature sweep's verdict
    # --layers of the source training split's stores (None: every block, Fig. 4 on the training set as in
    # the paper; "pool": penultimate only, Fig. 4 on the test split); the default groups only
    train_layers: str | None = "pool"

    def __post_init__(self) -> None:
        if not self.groups:
            object.__setattr__(self, "groups", _groups(self.source, self.target, self.target_fit or self.target,
                                                       self.train_layers))
        if not self.dynamics:
            object.__setattr__(self, "dynamics", _dynamics(self.source, self.target_fit or self.target, self.target))

    @property
    def transfer_task(self) -> str:
        return self.target

    @property
    def run_kinds(self) -> tuple[str, ...]:
        """What the demo trains one network per seed of: the settings' stems, else the nine objectives."""
        from repsim.study.objectives import OBJECTIVES

        return tuple(self.settings) or OBJECTIVES


def _check_fashion(root: str | None, download: bool) -> None:
    from repsim.train.fashion import locate

    locate(root, download)


DIGITS = Profile(
    name="digits", preset="digits-{objective}", source="digits-source", target="digits-target",
    title="repsim demo: sklearn digits, 9 objectives",
    source_text="sklearn digits 0–4 (digits-source)", target_text="digits 5–9 (digits-target)",
    keep_every=5,  # Figs. D.2 and E.4 render from the kept checkpoints
    # K = 19, the fewest that can reach α = 0.05, for linear and RBF CKA (their null is in the minibatch pass):
    # measured on the 18 networks' 306 columns (2026-11-28, shared 2-core box), CKA 6.0 s without a null,
    # 29.0 s with K = 19, 59.1 s with K = 49 (the results file 4, 39, 83 MB); Procrustes' and mutual k-NN's
    # exact nulls take minutes per draw at this size (K = 19 on 4 of the 18 stores: > 300 s for Procrustes),
    # so they stay uncalibrated. The demo's whole similarity step on those stores (the four measures;
    # 2026-11-28/29, load average ~6 on the 2 cores, back to back): 379 s before, 452 s with the null (+19 %)
    permutations=19,
    # every block of the training split (586 images): Fig. 4 on the training set, as the paper's; measured
    # +0.5 s extraction and +0.25 s separation per network (7.7 vs 7.2 s, 0.29 vs 0.05 s), 14 MB vs 0.5 MB
    train_layers=None,
    shortfall="Digits saturates (the objectives reach {source_range} source accuracy), leaving them "
              "little to differ on; `repsim demo --profile fashion` runs the study on Fashion-MNIST.",
    saturated_at=90.0,  # every objective ≥ 90 %: the presets' epochs give 96–99 % (analyses/README.md)
)

FASHION = Profile(
    name="fashion", preset="fashion-{objective}", source="fashion-source", target="fashion-target",
    title="repsim demo --profile fashion: Fashion-MNIST, 9 objectives",
    source_text="Fashion-MNIST T-shirt/top, pullover, coat, shirt and bag (fashion-source)",
    target_text="the other five classes: trouser, dress, sandal, sneaker, ankle boot (fashion-target)",
    seeds=2, cka_batch=1000, check_data=_check_fashion,
    # the streamed measures only: the exact ones hold every column's full data (n · min(p, n) float64 each,
    # docs/measures.md "Full columns"), beyond --memory-budget on this split's every-block stores
    measures=("linear_cka", "rbf_cka"),
    # 2,000 images per class to fit the probes: with 500, the λ chosen on the 20 % validation split moved
    # linear transfer by up to 1.5 points between validation seeds of one network (search record)
    target_fit="fashion-target@2000",
    # the seed-0 networks keep epochs 5 and 10 (Figs. D.2, E.4: App. E.4's softmax R² peaking early): their
    # penultimate-layer stores cost minutes of the hour's budget (repsim/analyses/README.md)
    keep_every=5,
    shortfall="The configurations tried for this profile within its budget (one hour on 2 CPU cores) and the "
              "verdicts each reached are in repsim/analyses/README.md (section 'The Fashion-MNIST profile', 'Search record').",
)

def _tau_settings(k: int, weight_decay: float) -> dict[str, tuple[str, ...]]:
    """Cosine softmax at τ*·{¼, ½, 1, 2, 4}, τ* the rule's temperature (repsim/study/rescale.py) for ``k`` classes."""
    from repsim.study.rescale import rounded, tau

    star = tau("cosine_softmax", k)
    taus = [rounded(star * f) for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
    return {f"tau{t:g}": (f"objective_params.tau={t:g}",) for t in taus}


# The paper's controlled experiment (Table 4, Fig. 5b) at Fashion-MNIST scale: the fashion profile's networks
# and data, cosine softmax only, 5 temperatures × 2 seeds = 10 networks (3 seeds do not fit 40 minutes:
# 290-306 s per network two at a time measured, ≈ 41 min estimated). Only the penultimate layer is
# extracted (no CKA across objectives here), so a run is training plus a few minutes (repsim/analyses/README.md).
FASHION_TAU = Profile(
    name="fashion-tau", preset="fashion-cosine_softmax", source="fashion-source", target="fashion-target",
    title="repsim demo --profile fashion-tau: Fashion-MNIST, cosine softmax temperature sweep",
    source_text="Fashion-MNIST T-shirt/top, pullover, coat, shirt and bag (fashion-source)",
    target_text="the other five classes: trouser, dress, sandal, sneaker, ankle boot (fashion-target)",
    seeds=2, cka_batch=1000, check_data=_check_fashion, measures=("linear_cka",),
    target_fit="fashion-target@2000", findings="tau",
    groups={**_groups("fashion-source", "fashion-target", "fashion-target@2000"),
            "src-test": ("fashion-source", "test", "pool", "R², predictions, relearned heads, calibration "
                         "(penultimate only: one objective, no CKA across objectives)")},
    settings=_tau_settings(5, 0.05),
)

PROFILES: dict[str, Profile] = {p.name: p for p in (DIGITS, FASHION, FASHION_TAU)}
