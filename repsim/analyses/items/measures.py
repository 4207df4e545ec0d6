"""The measures' agreement (no paper or peer gives it): how far the similarity measures in the results
files agree on which layer pairs are similar, and whether the Fig. 2 verdict (finding 2: objectives
differ only in the late blocks) depends on the measure."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from repsim.analyses.data import Inputs, Missing, measure_display
from repsim.analyses.item import Table, item
from repsim import spearman


def agreement_matrix(inputs: Inputs) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(measures, ρ, n): Spearman ρ[i, j] between measures i and j over the layer pairs every measure
    has a finite value for — the off-diagonal entries of the (store, layer) × (store, layer) matrices,
    each unordered pair once when both measures are symmetric, both orders otherwise — and n[i, j], the
    number of pairs behind it."""
    sims = inputs.similarities
    measures = sims.measures
    if len(measures) < 2:
        raise Missing(f"the results hold one measure ({measure_display(measures[0])}); compute several with "
                      "`repsim similarity STORE... --measures linear_cka,rbf_cka,...`")
    views = [sims.measure(m) for m in measures]
    keys = sorted(set.intersection(*(v.keys() for v in views)))
    if len(keys) < 3:
        raise Missing("the measures share fewer than 3 (store, layer) columns")
    mats = [v.matrix(keys) for v in views]
    ok = ~np.eye(len(keys), dtype=bool) & np.logical_and.reduce([np.isfinite(m) for m in mats])
    upper = np.triu(np.ones_like(ok), 1)
    rho, n = np.eye(len(measures)), np.zeros((len(measures),) * 2, int)
    for (i, a), (j, b) in itertools.combinations(enumerate(views), 2):
        use = ok & (upper if a.symmetric and b.symmetric else True)
        n[i, j] = n[j, i] = int(use.sum())
        rho[i, j] = rho[j, i] = spearman(mats[i][use], mats[j][use])[0] if use.sum() >= 3 else np.nan
    for i in range(len(measures)):
        n[i, i] = int((ok & (upper if views[i].symmetric else True)).sum())
    return measures, rho, n


@item("agreement", "Measures' agreement: rank correlation between measures and the Fig. 2 verdict under each",
      "table", ("results of repsim similarity holding ≥ 2 measures over the same stores",))
def agreement(inputs: Inputs) -> Table:
    from repsim.analyses.findings import EARLY_GAP_MAX, LATE_MINUS_EARLY_MIN, calibrated_gap, late_blocks

    measures, rho, n = agreement_matrix(inputs)
    names = [measure_display(m) for m in measures]
    rows, shown, notes = [], [], []
    for i, m in enumerate(measures):
        row = {"measure": m, **{f"rho_{b}": rho[i, j] for j, b in enumerate(measures)}}
        text = {"Measure": names[i], "Range": inputs.similarity(m).range_text,
                **{f"ρ vs {names[j]}": f"{rho[i, j]:.3f}" for j in range(len(measures))}}
        try:
            r = late_blocks(inputs, m)
            pe, pl = r.paper_gaps
            row.update(early_gap=r.early_gap, late_gap=r.late_gap, verdict=r.verdict, old_verdict=r.old_verdict,
                       paper_early_gap=pe, paper_late_gap=pl)
            text.update({"Early gap": f"{pe:.3f}", "Late-third gap": f"{pl:.3f}",
                         "Fig. 2 verdict": r.verdict.upper(), "Old rule": r.old_verdict.upper()})
            cal = calibrated_gap(inputs, r)
            if cal is None:
                row.update(calibrated_late_gap=np.nan, calibrated_late_lo=np.nan, calibration="no null")
                text.update({"Calibrated late-third gap": "no null", "Survives calibration": "no null"})
            else:
                cl = float((cal.same - cal.cross)[r.paper_late].mean())
                lo, hi = cal.ci["late"] if cal.ci else (np.nan, np.nan)
                mark = "" if lo > 0 else " †"  # its interval reaches 0 (or no bootstrap): not significant
                row.update(calibrated_late_gap=cl, calibrated_late_lo=lo, calibrated_late_hi=hi,
                           calibration=cal.status(r), permutations=cal.permutations)
                text.update({"Calibrated late-third gap": f"{cl:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if cal.ci else "")
                             + mark, "Survives calibration": cal.status(r)})
            if not notes:
                notes.append(f"early = {r.layers[r.early[0]]}–{r.layers[r.early[-1]]}, late third = "
                             f"{r.layers[r.paper_late[0]]}–{r.layers[r.paper_late[-1]]}; the old rule's late = "
                             f"{r.layers[r.late[0]]}–{r.layers[r.late[-1]]}")
        except Missing as exc:
            row.update(early_gap=np.nan, late_gap=np.nan, verdict="not evaluated", old_verdict="not evaluated",
                       paper_early_gap=np.nan, paper_late_gap=np.nan)
            text.update({"Early gap": "–", "Late-third gap": "–", "Fig. 2 verdict": "NOT EVALUATED",
                         "Old rule": "NOT EVALUATED", "Calibrated late-third gap": "–",
                         "Survives calibration": "not evaluated"})
            notes.append(f"{names[i]} not evaluated: {exc}")
        rows.append(row)
        shown.append(text)
    pairs = sorted({int(v) for v in n[~np.eye(len(measures), dtype=bool)]})
    cap = (f"ρ: Spearman rank correlation between two measures' values over the same layer pairs (every pair of "
           f"(store, layer) columns both hold, the diagonal excluded, pairs where any measure is undefined dropped; "
           f"each unordered pair once, both orders when a measure is asymmetric): "
           f"{' or '.join(map(str, pairs))} pairs. Early / late gap: finding 2's gap (mean value between seeds of one "
           f"objective − mean value between networks of different objectives, at corresponding layers; "
           f"{'; '.join(notes) or 'no measure evaluated'}). Fig. 2 verdict: the paper-words criterion of "
           f"repsim/analyses/findings.py (95 % bootstrap intervals, objectives resampled: late-third gap > 0, late − early "
           f"> 0, early reaching 0; scale-free). Old rule: REPRODUCED when the early gap ≤ {EARLY_GAP_MAX}·w and "
           f"the late gap ≥ early + {LATE_MINUS_EARLY_MIN}·w, w the measure's declared range width (1 for the "
           f"[0, 1] measures, 2 for RSA's [−1, 1]; 1 when unbounded); PARTIAL when late > early. Calibrated "
           f"late-third gap: the same gap of each pair of networks' calibrated score (Gröger et al. 2026: the score "
           f"above its permutation threshold τ, 0 = not above chance; `repsim similarity --permutations K`) with its "
           f"95 % bootstrap interval; † marks a gap whose interval reaches 0 (not significant). Survives calibration: "
           f"'survives' when both the raw and the calibrated late-third intervals lie above 0, 'does not survive' "
           f"when only the raw one does, 'no raw gap' when the raw one reaches 0, 'no null' when the results hold "
           f"no permutation null of the measure (finding 2's calibration paragraph gives the numbers). The report's "
           f"finding 2 is linear CKA's row.")
    numeric = pd.DataFrame(rows)
    return Table(numeric, pd.DataFrame(shown), cap)
