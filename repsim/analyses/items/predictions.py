"""Items computed from stores' logits and penultimate activations: Figs. C.4–C.7 (prediction
similarity, ensembles), E.1 (angular visual hardness), E.3 (cosine distances), and E.2 (spectra)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from repsim.analyses.data import Inputs, Missing, display
from repsim.analyses.items.common import labels_in_order, legend_outside, pyplot
from repsim.analyses.item import Figure, item
from repsim.analyses.style import color


def _on_training_dataset(dataset: str, store) -> bool:
    """Whether ``store`` holds its network's own training dataset: the store's dataset and the
    network's ``model.train_dataset.name`` denote one dataset up to an ``@N`` size suffix
    (:func:`repsim.store.pairing.dataset_family`); False when either name is not recorded."""
    from repsim.store.pairing import dataset_family

    train = (getattr(store, "model", None) or {}).get("train_dataset")
    name = (train.get("name") or train.get("spec")) if isinstance(train, dict) else train
    a = dataset_family(dataset if isinstance(dataset, str) and dataset else None)
    b = dataset_family(name if isinstance(name, str) and name else None)
    return a is not None and a == b


class Models:
    """Networks evaluated on one (dataset, split), ordered by objective: labels ``y``, top-1 predictions
    ``pred`` (M, N) and their softmax probabilities ``conf`` (M, N), read chunk by chunk."""

    def __init__(self, inputs: Inputs, *, need_head: bool = False, prefer_split: str | None = None):
        stores = inputs.require_stores("logits of every network on one dataset split")
        runs = inputs.runs.set_index("store")
        cands = [s for s in stores.values() if s.logits is not None and (s.head is not None or not need_head)]
        if not cands:
            raise Missing("no store with logits" + (" and a final-layer head" if need_head else ""))
        cands = [s for s in cands if runs.loc[s.name, "label"]]
        if not cands:
            raise Missing("these figures compare the networks of each training objective, and the objective of no "
                          "store with logits is known (random-init and own models record none; "
                          "`repsim plot RESULT.npz` draws their similarity)")
        cands, foreign = _own_classes(cands)
        if not cands:
            raise Missing(f"the logits of {foreign} are not over their data's classes, so no prediction can be "
                          "right or wrong (a classifier head of another dataset)")
        # networks are compared class by class, so one group holds one class count (a 5-class and a
        # 1000-class network on the same images have no common classes to agree on)
        key = lambda s: (runs.loc[s.name, "dataset"], runs.loc[s.name, "split"], int(s.logits.shape[1]))
        groups: dict[tuple, list] = {}
        for s in cands:
            groups.setdefault(key(s), []).append(s)
        # first the networks' own training dataset (the pretraining task the paper's figures are of, not a
        # transfer task's images under other classes); then ``prefer_split`` when ≥ 2 networks have it; else
        # the split with most networks; ties: the one with most layers (the main evaluation stores), then test
        own = lambda kv: all(_on_training_dataset(runs.loc[s.name, "dataset"], s) for s in kv[1])
        (self.dataset, self.split, self.n_classes), chosen = max(
            groups.items(), key=lambda kv: (own(kv), kv[0][1] == prefer_split and len(kv[1]) >= 2, len(kv[1]),
                                            len(kv[1][0].layers), kv[0][1] == "test", kv[0]))
        if len(chosen) < 2:
            raise Missing("fewer than 2 stores with logits on one dataset split")
        chosen.sort(key=lambda s: (labels_in_order(runs["label"]).index(runs.loc[s.name, "label"]),
                                   runs.loc[s.name, "seed"], s.name))
        ids = chosen[0].example_ids
        for s in chosen[1:]:
            if not np.array_equal(s.example_ids, ids):
                raise ValueError(f"stores {chosen[0].name} and {s.name} hold different examples")
        self.stores = chosen
        self.names = [s.name for s in chosen]
        self.labels = [runs.loc[s.name, "label"] for s in chosen]
        self.seeds = [runs.loc[s.name, "seed"] for s in chosen]
        self.y = np.asarray(chosen[0].labels)
        # top-1 prediction and its softmax probability per network, read chunk by chunk: (M, N) each
        self.pred = np.empty((len(chosen), len(self.y)), dtype=np.int64)
        self.conf = np.empty((len(chosen), len(self.y)), dtype=np.float32)
        for m, s in enumerate(chosen):
            start = 0
            for block in s.logits.blocks:
                z = np.asarray(block.compute(), dtype=np.float64)
                stop = start + len(z)
                self.pred[m, start:stop] = z.argmax(1)
                self.conf[m, start:stop] = 1.0 / np.exp(z - z.max(1, keepdims=True)).sum(1)
                start = stop
        self.n = len(self.y)
        self.describe = inputs.describe(self.names)

    def tick_names(self) -> list[str]:
        """"<objective> s<seed>", or "<objective> (<store>)" where the seed is not recorded."""
        return [f"{display(l)} s{int(s)}" if pd.notna(s) else f"{display(l)} ({name})"
                for l, s, name in zip(self.labels, self.seeds, self.names)]

    def by_label(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, l in enumerate(self.labels):
            out.setdefault(l, []).append(i)
        return out


def _own_classes(stores: list) -> tuple[list, str]:
    """The stores whose logits have as many classes as their dataset records (``dataset.num_classes``;
    kept when it records none), and a text naming the others with both counts ("" when none)."""
    keep, other = [], []
    for s in stores:
        k = ((s.attrs or {}).get("dataset") or {}).get("num_classes")
        width = int(s.logits.shape[1])
        if k is None or int(k) == width:
            keep.append(s)
        else:
            other.append(f"{s.name} ({width} classes; its data {int(k)})")
    return keep, ", ".join(other)


def agreement(pred: np.ndarray, y: np.ndarray, kind: str) -> np.ndarray:
    """Pairwise prediction similarity in % (App. C.3; :func:`repsim.agreement_matrices`)."""
    from repsim import agreement_matrices

    return 100.0 * agreement_matrices(pred, y)[kind]


def modal(pred: np.ndarray, conf: np.ndarray, n_classes: int, rows: int = 8192) -> np.ndarray:
    """Ensemble prediction (M, N) -> (N,): the modal top-1 class (App. C.3); ties go to the class whose
    voters' top-1 probabilities sum highest (:func:`repsim.modal_vote` with ``confidence``)."""
    from repsim import modal_vote

    return modal_vote(pred, n_classes, confidence=conf, rows=rows)


def _heatmap(ax, m, names, title, fmt="{:.0f}", cmap="viridis", vmin=None, vmax=None, blank_diagonal=False,
             groups=None):
    """Annotated heatmap; ``blank_diagonal`` hides trivial self-similarity so the colours span the pairs.
    ``groups`` (one name per row, in contiguous runs, e.g. each network's objective): one tick label per
    run at its centre and a thin white line between runs, instead of one small label per row."""
    if blank_diagonal:
        m = m.astype(float).copy()
        np.fill_diagonal(m, np.nan)
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=vmin, vmax=vmax)
    runs = _runs(groups) if groups is not None else None
    if runs is not None and len(runs) < len(names):
        centers = [(a + b - 1) / 2 for _, a, b in runs]
        ax.set_xticks(centers, [g for g, _, _ in runs], rotation=90, fontsize=8)
        ax.set_yticks(centers, [g for g, _, _ in runs], fontsize=8)
        for _, a, _ in runs[1:]:
            ax.axhline(a - 0.5, color="white", lw=0.8)
            ax.axvline(a - 0.5, color="white", lw=0.8)
    else:
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_title(title, fontsize=10)
    if len(names) <= 12:
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=6.5,
                        color="white" if v < np.nanmean(m) else "black")
    return im


def _runs(groups) -> list[tuple[str, int, int]] | None:
    """[(name, start, stop)] of the contiguous runs of ``groups``; None when a name recurs after another."""
    out: list[tuple[str, int, int]] = []
    for i, g in enumerate(groups):
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1], i + 1)
        elif any(g == o for o, _, _ in out):
            return None
        else:
            out.append((g, i, i + 1))
    return out


@item("figC4", "Fig. C.4: agreement of predictions on examples both models get wrong, with dendrogram",
      "figure", ("stores with logits",))
def figC4(inputs: Inputs) -> Figure:
    from scipy.cluster.hierarchy import dendrogram

    from repsim.probes.predictions import prediction_linkage

    M = Models(inputs)
    a = agreement(M.pred, M.y, "both_wrong")
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5.4), gridspec_kw={"width_ratios": [1.15, 1]})
    im = _heatmap(ax, a, M.tick_names(), "a: same prediction among examples both get wrong", blank_diagonal=True,
                  groups=[display(l) for l in M.labels])
    fig.colorbar(im, ax=ax, shrink=0.8, label="% agreement")
    filled, n_undefined, fill = clustering_similarity(a / 100.0)
    Z = prediction_linkage(filled)
    dendrogram(Z, labels=M.tick_names(), ax=ax2,
               orientation="right", leaf_font_size=7)
    ax2.set_title("b: average-linkage dendrogram (distance 1 − agreement)", fontsize=10)
    ax2.set_xlabel("distance")
    fig.tight_layout()
    undefined = (f" {n_undefined} pair(s) of networks have no example both get wrong, so their agreement is "
                 f"undefined: blank in a, and in b given the mean agreement of the other pairs "
                 f"({100 * fill:.1f} %), neither close nor far." if n_undefined else "")
    return Figure(fig, f"Networks evaluated on {M.dataset}/{M.split} (n = {M.n}); predictions are argmax logits; "
                       f"diagonal (a network with itself) left blank.{undefined} "
                       f"{M.describe}.")


def clustering_similarity(s: np.ndarray) -> tuple[np.ndarray, int, float]:
    """Fig. C.4's similarity (M, M, in [0, 1], NaN where undefined) for the dendrogram: an off-diagonal
    pair with no common error (NaN) takes the mean of the defined off-diagonal pairs — a neutral value,
    where 0 would place two networks that rarely err far apart — and the diagonal is 1. Returns the
    filled matrix, the number of undefined pairs and the value they were given (0.5 when none is defined)."""
    S = np.array(s, dtype=np.float64)
    off = ~np.eye(len(S), dtype=bool)
    defined = S[off & np.isfinite(S)]
    fill = float(defined.mean()) if defined.size else 0.5
    undefined = off & ~np.isfinite(S)
    S[undefined] = fill
    np.fill_diagonal(S, 1.0)
    return S, int(np.triu(undefined | undefined.T, k=1).sum()), fill


@item("figC5", "Fig. C.5: three measures of prediction similarity", "figure", ("stores with logits",))
def figC5(inputs: Inputs) -> Figure:
    M = Models(inputs)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2))
    titles = {"all": "same top-1 prediction (all examples)", "correctness": "both right or both wrong",
              "both_wrong": "same prediction | both wrong"}
    groups = [display(l) for l in M.labels]
    for ax, (kind, title) in zip(axes, titles.items()):
        im = _heatmap(ax, agreement(M.pred, M.y, kind), M.tick_names(), title, blank_diagonal=True, groups=groups)
        fig.colorbar(im, ax=ax, shrink=0.7, label="% of examples")
    fig.tight_layout()
    per = "; one labelled block per objective, its networks (seeds) in order within it" if _runs(groups) else ""
    return Figure(fig, f"Pairwise similarity of single-network predictions on {M.dataset}/{M.split} "
                       f"(n = {M.n}); diagonal left blank{per}. {M.describe}.")


@item("figC6", "Fig. C.6: agreement of ensemble predictions between objectives", "figure",
      ("stores with logits, ≥ 2 seeds per objective",))
def figC6(inputs: Inputs) -> Figure:
    M = Models(inputs)
    groups = M.by_label()
    if max(len(v) for v in groups.values()) < 2:
        raise Missing("ensembles need ≥ 2 networks (seeds) per objective")
    if len(groups) < 2:
        raise Missing(f"one objective ({display(next(iter(groups)))}): agreement between ensembles needs ≥ 2")
    labels = labels_in_order(groups)
    ens = np.stack([modal(M.pred[groups[l]], M.conf[groups[l]], M.n_classes) for l in labels])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    im = _heatmap(ax, agreement(ens, M.y, "all"), [display(l) for l in labels],
                  "Same ensemble prediction (% of examples)", fmt="{:.1f}", blank_diagonal=True)
    fig.colorbar(im, ax=ax, shrink=0.8, label="% agreement")
    fig.tight_layout()
    sizes = ", ".join(f"{display(l)} {len(groups[l])}" for l in labels)
    return Figure(fig, f"Ensemble = modal top-1 class of all networks of one objective (ties to the class whose "
                       f"voters' top-1 probabilities sum highest); networks per ensemble: {sizes}; diagonal left blank. {M.dataset}/{M.split} (n = {M.n}).")


@item("figC7", "Fig. C.7: accuracy of ensembles mixing two objectives", "figure", ("stores with logits",))
def figC7(inputs: Inputs) -> Figure:
    M = Models(inputs)
    groups = M.by_label()
    labels = labels_in_order(groups)
    m = min(len(v) for v in groups.values())
    acc = np.zeros((len(labels), len(labels)))
    for i, a in enumerate(labels):
        for j, b in enumerate(labels):
            idx = groups[a][:m] if a == b else groups[a][: max(1, m // 2)] + groups[b][: max(1, m - m // 2)]
            acc[i, j] = 100.0 * np.mean(modal(M.pred[idx], M.conf[idx], M.n_classes) == M.y)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.6, 5.6))
    im = _heatmap(ax, acc, [display(l) for l in labels], "Ensemble top-1 accuracy (%)", fmt="{:.1f}", cmap="magma")
    ax.set_xlabel("objective B")
    ax.set_ylabel("objective A")
    fig.colorbar(im, ax=ax, shrink=0.8, label="top-1 accuracy (%)")
    fig.tight_layout()
    return Figure(fig, f"Off-diagonal: ensembles of {max(1, m // 2)} network(s) of A and {max(1, m - m // 2)} of B; "
                       f"diagonal: {m} network(s) of one objective; modal prediction, ties to the class whose "
                       f"voters' top-1 probabilities sum highest. {M.dataset}/{M.split} (n = {M.n}). {M.describe}.")


def _penultimate_blocks(inputs: Inputs, store):
    """(row offset, float32 (rows, P) block) of the penultimate layer, one store chunk at a time."""
    arr = store.layer(inputs.penultimate(store.layers))
    start = 0
    for block in arr.blocks:
        X = np.asarray(block.compute(), dtype=np.float32).reshape(block.shape[0], -1)
        yield start, X
        start += X.shape[0]


MAX_ROWS_E3 = 10_000  # Fig. E.3 samples pairs; a seeded subset of rows bounds memory on ImageNet-size stores


# Fig. E.1's caption: "a Gaussian kernel of bandwidth 5×10^-6" for AVH scores of a 1,000-class network.
# AVH scales as 1/K (each example's angle to its class over the sum of K angles), so for K classes the
# kernel is rescaled to 5×10^-6 · 1000/K: the paper's bandwidth on ImageNet, the same relative
# smoothing elsewhere. (App. E states no bandwidth for Fig. E.3; it uses Scott's rule.)
AVH_BANDWIDTH_1000 = 5e-6


def avh_bandwidth(num_classes: int) -> float:
    """The Gaussian-kernel bandwidth (standard deviation, AVH units) of Fig. E.1 for ``num_classes``."""
    return AVH_BANDWIDTH_1000 * 1000.0 / num_classes


def kde_density(values: np.ndarray, xs: np.ndarray, bandwidth: float | None = None) -> np.ndarray:
    """Gaussian KDE ``f(x) = (1/n) Σ_i φ((x − v_i)/h) / h`` at ``xs``: ``h = bandwidth`` (the kernel's
    standard deviation, in the values' units) or Scott's rule ``h = sd · n^(−1/5)`` when None
    (``scipy.stats.gaussian_kde``, whose factor multiplies the sample sd with ddof=1)."""
    from scipy.stats import gaussian_kde

    if bandwidth is None:
        return gaussian_kde(values)(xs)
    return gaussian_kde(values, bw_method=bandwidth / np.std(values, ddof=1))(xs)


def _kde(ax, values, bandwidth: float | None = None, **kw) -> bool:
    """Draw the KDE of the finite ``values``; False (nothing drawn) when they have no spread."""
    values = values[np.isfinite(values)]
    if len(values) < 2 or np.ptp(values) == 0:
        return False
    xs = np.linspace(values.min(), values.max(), 300)
    ax.plot(xs, kde_density(values, xs, bandwidth), **kw)
    return True


@item("figE1", "Fig. E.1: angular visual hardness", "figure", ("stores with logits, head and penultimate layer",))
def figE1(inputs: Inputs) -> Figure:
    from repsim import angular_visual_hardness

    M = Models(inputs, need_head=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    drawn = 0
    for label, idx in sorted(M.by_label().items(), key=lambda kv: labels_in_order(M.labels).index(kv[0])):
        s = M.stores[idx[0]]
        W, _ = s.head
        if W.shape[0] <= int(M.y.max()):
            raise Missing(f"head of {s.name} has fewer rows than the labels' classes")
        W = np.asarray(W, np.float64)
        avh = np.concatenate([angular_visual_hardness(X, M.y[i:i + len(X)], W)
                              for i, X in _penultimate_blocks(inputs, s)])  # per example: chunk by chunk
        acc = 100 * np.mean(M.pred[idx] == M.y)
        drawn += _kde(ax, avh, avh_bandwidth(M.n_classes), color=color(label), label=f"{display(label)} ({acc:.1f}%)")
    if not drawn:
        plt.close(fig)
        raise Missing("no network's angular visual hardness has any spread")
    ax.set_xlabel("Angular visual hardness")
    ax.set_ylabel("Density")
    legend_outside(ax, title="objective (top-1)")
    h = avh_bandwidth(M.n_classes)
    return Figure(fig, f"Gaussian KDE of AVH over the {M.n} examples of {M.dataset}/{M.split}, kernel bandwidth "
                       f"{h:.3g} (the paper's 5×10⁻⁶ for 1,000 classes × 1000/K, K = {M.n_classes}: AVH scales as "
                       f"1/K), first seed of each objective; legend: mean top-1 over seeds. {M.describe}.")


@item("figE3", "Fig. E.3: distribution of cosine distances within and between classes", "figure",
      ("stores with a penultimate layer",))
def figE3(inputs: Inputs) -> Figure:
    from repsim import cosine_distance_samples

    M = Models(inputs, prefer_split="train")  # App. E: "10,000 training set examples"
    n_pairs = 20_000
    rows = np.sort(np.random.default_rng(0).choice(M.n, min(M.n, MAX_ROWS_E3), replace=False))
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(6.8, 6.2), sharex=True)
    drawn = 0
    for label, idx in sorted(M.by_label().items(), key=lambda kv: labels_in_order(M.labels).index(kv[0])):
        X = np.concatenate([X[np.isin(np.arange(i, i + len(X)), rows)] for i, X in
                            _penultimate_blocks(inputs, M.stores[idx[0]])])
        within, between = cosine_distance_samples(X, M.y[rows], n_pairs, seed=0)
        for ax in axes:
            drawn += _kde(ax, within, color=color(label), ls="-", label=display(label))
            _kde(ax, between, color=color(label), ls="--")
    if not drawn:
        plt.close(fig)
        raise Missing("no network's penultimate layer gives cosine distances with any spread")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("Cosine distance (penultimate layer)")
    for ax in axes:
        ax.set_ylabel("Density")
    legend_outside(axes[0], title="solid: same class\ndashed: different")
    fig.tight_layout()
    return Figure(fig, f"Gaussian KDE (Scott's rule: App. E gives a bandwidth only for Fig. E.1's AVH, none for "
                       f"this figure) over {n_pairs} within-class and {n_pairs} between-class example pairs "
                       f"(repsim.cosine_distance_samples, seed 0) among {len(rows)} examples (seeded subset when "
                       f"n > {MAX_ROWS_E3}) of {M.dataset}/{M.split} (n = {M.n}); "
                       f"first seed of each objective; bottom: log density. {M.describe}.")


SPECTRUM_FLOOR = 1e-10  # Fig. E.2: relative singular values below this are zero to float64 rounding


@item("figE2", "Fig. E.2: singular value spectra", "figure", ("spectra.npz",))
def figE2(inputs: Inputs) -> Figure:
    spectra = inputs.spectra
    kinds = sorted({k for _, _, k in spectra})
    layer = inputs.penultimate({l for _, l, _ in spectra})
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(kinds), figsize=(4.3 * len(kinds) + 2, 3.8), squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        curves: dict[str, list[np.ndarray]] = {}
        for (store, l, k), sv in spectra.items():
            if k == kind and (l == layer or kind not in ("activations",)):
                try:
                    curves.setdefault(inputs.label_of(store), []).append(np.sort(sv)[::-1] / max(sv.max(), 1e-300))
                except Missing:
                    continue
        lowest = np.inf
        for label in labels_in_order(curves):
            n = min(len(c) for c in curves[label])
            mean = np.mean([c[:n] for c in curves[label]], axis=0)
            lowest = min(lowest, float(mean.min()))
            ax.plot(np.arange(1, n + 1), np.maximum(mean, SPECTRUM_FLOOR), color=color(label), label=display(label))
        ax.set_yscale("log")
        if lowest < SPECTRUM_FLOOR:
            ax.set_ylim(bottom=SPECTRUM_FLOOR / 3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # singular values are counted, not measured
        ax.set_xlabel("Index")
        ax.set_ylabel("Singular value / largest")
        ax.set_title(kind.replace("_", " "))
    legend_outside(axes.flat[-1])
    fig.tight_layout()
    return Figure(fig, f"Singular values from spectra.npz (kinds: {', '.join(kinds)}; activations of layer {layer}), "
                       f"normalised by the largest, averaged over seeds. Values below {SPECTRUM_FLOOR:g} — zero to "
                       "rounding, e.g. the last direction of C centred class means, which span at most C − 1 — "
                       "are drawn at the bottom edge.")
