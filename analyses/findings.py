"""The paper's three findings, each with a criterion fixed in code before any run, checked on results files.

1. Better objectives transfer worse (Table 1, Fig. 1). Linear transfer accuracy per run, source top-1
   per run. (a) softmax transfers best: its mean linear transfer accuracy is the best or not
   significantly different from the best (Table 1's bold rule: t-test over seeds, p ≥ 0.05);
   (b) better objectives transfer worse: at least one objective beats softmax's mean source accuracy,
   and every such objective has a lower mean transfer accuracy than softmax. REPRODUCED when (a) and
   (b); PARTIAL when one holds; else NOT REPRODUCED. Spearman ρ(source top-1, transfer) across
   objectives is reported but is not the criterion (in the paper, squared error is low on both).
2. Objectives differ only in late blocks (Fig. 2). Per corresponding layer l, the CKA gap
   g(l) = mean CKA between different seeds of one objective − mean CKA between networks of different
   objectives. Early = the first two thirds of the blocks, late = the last third plus the penultimate
   layer. REPRODUCED when mean early gap ≤ 0.02 and mean late gap ≥ mean early gap + 0.05; PARTIAL when
   the late gap exceeds the early gap but a threshold fails; else NOT REPRODUCED.
3. Class separation rises and predicts worse transfer (Table 3, Fig. 5). (a) rises: at least 7 of the
   8 other objectives have a higher penultimate R² than softmax (all other objectives present, if fewer
   than 9); (b) predicts worse transfer: Spearman ρ(R², mean linear transfer) < 0 with p < 0.05 across
   objectives. REPRODUCED when (a) and (b); PARTIAL when one holds; else NOT REPRODUCED.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np

from analyses.data import Inputs, Missing, display
from analyses.items.common import mean_transfer, one_r2_per_run, penultimate_r2, probe_rows
from repsim import spearman

from analyses.summary import as_percent, bold_set

EARLY_GAP_MAX = 0.02
LATE_MINUS_EARLY_MIN = 0.05
ALPHA = 0.05


@dataclass
class Finding:
    name: str
    verdict: str  # "reproduced" | "partial" | "not reproduced" | "not evaluated"
    evidence: str


def finding_transfer(inputs: Inputs) -> Finding:
    name = "Better objectives transfer worse"
    lin = probe_rows(inputs, "linear")
    per_run = mean_transfer(lin)
    transfer = per_run.groupby("label")["transfer"].mean()
    src = inputs.source_accuracy()
    acc = as_percent(src["top1"]).groupby(src["label"]).mean()
    common = sorted(set(acc.index) & set(transfer.index))
    if "softmax" not in common or len(common) < 2:
        raise Missing("softmax and ≥ 1 other objective need both source and transfer accuracy")
    groups = {l: per_run.loc[per_run["label"] == l, "transfer"].to_numpy(float) for l in common}
    softmax_best = "softmax" in bold_set(groups)
    beat = [l for l in common if l != "softmax" and acc[l] > acc["softmax"]]
    worse = [l for l in beat if transfer[l] < transfer["softmax"]]
    better_worse = bool(beat) and len(worse) == len(beat)
    verdict = ("reproduced" if softmax_best and better_worse else
               "partial" if softmax_best or better_worse else "not reproduced")
    best = transfer[common].idxmax()
    rho, p = spearman(acc[common], transfer[common]) if len(common) >= 3 else (float("nan"), float("nan"))
    ev = (f"Softmax: {acc['softmax']:.1f}% source top-1, {transfer['softmax']:.1f}% mean linear transfer; best "
          f"transfer {display(best)} ({transfer[best]:.1f}%); softmax "
          f"{'is' if softmax_best else 'is not'} best or tied with the best (t-test over seeds). "
          f"{len(beat)} of {len(common) - 1} objectives beat softmax on source accuracy"
          + (f", {len(worse)} of them transfer worse ({', '.join(display(l) for l in beat)})" if beat else "")
          + f". Descriptive: Spearman ρ(source top-1, transfer) = {rho:.2f} (p = {p:.3g}, n = {len(common)}).")
    return Finding(name, verdict, ev)


def cka_gaps(inputs: Inputs) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Per corresponding layer: (layers, mean same-objective CKA, mean cross-objective CKA)."""
    from analyses.items.layers import _cka_groups

    cka, groups, layers = _cka_groups(inputs)
    label_of = {s: l for l, ss in groups.items() for s in ss}
    stores = sorted(label_of)
    same, cross = np.zeros(len(layers)), np.zeros(len(layers))
    for k, layer in enumerate(layers):
        s_vals, c_vals = [], []
        for i, a in enumerate(stores):
            for b in stores[i + 1:]:
                v = cka.block(a, b, [layer], [layer])
                if v is not None:
                    (s_vals if label_of[a] == label_of[b] else c_vals).append(float(v[0, 0]))
        if not s_vals or not c_vals:
            raise Missing("CKA needs ≥ 2 seeds of one objective and ≥ 2 objectives")
        same[k], cross[k] = np.mean(s_vals), np.mean(c_vals)
    return layers, same, cross


def finding_late_blocks(inputs: Inputs) -> Finding:
    name = "Objectives differ only in late blocks"
    layers, same, cross = cka_gaps(inputs)
    blocks = [i for i, l in enumerate(layers) if l.startswith("block")]
    if len(blocks) < 3:
        raise Missing("fewer than 3 blocks with CKA values")
    n_early = int(np.ceil(2 * len(blocks) / 3))
    early = blocks[:n_early]
    late = [i for i in range(len(layers)) if i not in early]
    gap = same - cross
    e, l = float(gap[early].mean()), float(gap[late].mean())
    if e <= EARLY_GAP_MAX and l >= e + LATE_MINUS_EARLY_MIN:
        verdict = "reproduced"
    elif l > e:
        verdict = "partial"
    else:
        verdict = "not reproduced"
    ev = (f"CKA gap (same objective − different objectives) at corresponding layers: early "
          f"({layers[early[0]]}–{layers[early[-1]]}) {e:.3f}, late ({layers[late[0]]}–{layers[late[-1]]}) {l:.3f}; "
          f"cross-objective CKA early {cross[early].mean():.3f}, late {cross[late].mean():.3f}; "
          f"largest gap at {layers[int(np.argmax(gap))]} ({gap.max():.3f}). Criterion: early ≤ {EARLY_GAP_MAX} and "
          f"late ≥ early + {LATE_MINUS_EARLY_MIN}.")
    return Finding(name, verdict, ev)


def finding_separation(inputs: Inputs) -> Finding:
    name = "Class separation rises and predicts worse transfer"
    sep = penultimate_r2(inputs)
    r2 = one_r2_per_run(sep).groupby("label")["r2"].mean()
    transfer = mean_transfer(probe_rows(inputs, "linear")).groupby("label")["transfer"].mean()
    if "softmax" not in r2:
        raise Missing("no softmax R²")
    others = [l for l in r2.index if l != "softmax"]
    higher = [l for l in others if r2[l] > r2["softmax"]]
    need = len(others) - 1 if len(others) >= 8 else len(others)
    rises = len(higher) >= need
    common = sorted(set(r2.index) & set(transfer.index))
    if len(common) < 3:
        raise Missing("fewer than 3 objectives with both R² and transfer accuracy")
    rho, p = spearman(r2[common], transfer[common])
    predicts = rho < 0 and p < ALPHA
    verdict = "reproduced" if rises and predicts else "partial" if rises or predicts else "not reproduced"
    lower = [display(l) for l in others if l not in higher]
    ev = (f"{len(higher)} of {len(others)} objectives have higher penultimate R² than softmax "
          f"({r2['softmax']:.3f})" + (f"; not higher: {', '.join(lower)}" if lower else "")
          + f". Spearman ρ(R², mean linear transfer) = {rho:.2f} (p = {p:.3g}, n = {len(common)}); "
          f"paper: ρ = −0.93, p = 0.002.")
    return Finding(name, verdict, ev)


def evaluate(inputs: Inputs) -> list[Finding]:
    out = []
    for fn, name in ((finding_transfer, "Better objectives transfer worse"),
                     (finding_late_blocks, "Objectives differ only in late blocks"),
                     (finding_separation, "Class separation rises and predicts worse transfer")):
        try:
            out.append(fn(inputs))
        except Missing as exc:
            out.append(Finding(name, "not evaluated", f"inputs missing: {exc}"))
    return out


def findings_html(findings: list[Finding], preamble: str = "") -> str:
    colour = {"reproduced": "#070", "partial": "#a60", "not reproduced": "#b00", "not evaluated": "#777"}
    items = "".join(
        f"<li><b>{html.escape(f.name)}</b>: <b style='color:{colour[f.verdict]}'>{f.verdict.upper()}</b>. "
        f"{html.escape(f.evidence)}</li>" for f in findings)
    criteria = html.escape(__doc__.split("\n\n", 1)[1]).replace("\n", "<br>")
    return (f"<div class='findings'><h2>Does this run reproduce the paper's findings?</h2>{preamble}<ul>{items}</ul>"
            f"<details><summary>Criteria (fixed in analyses/findings.py before the run)</summary>"
            f"<p class='caption'>{criteria}</p></details></div>")


def findings_text(findings: list[Finding]) -> str:
    return "\n".join(f"- {f.name}: {f.verdict.upper()}. {f.evidence}" for f in findings)

