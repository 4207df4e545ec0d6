"""The generic heatmap of a results file whose stores' objectives are unknown (own models, random-init
networks): every (store, layer) column against every other, one figure per file and measure
(:meth:`repsim.SimilarityResult.plot`), where the paper's items (Fig. 2a/2b), which group networks by
objective, have nothing to draw."""
from __future__ import annotations

from repsim.analyses.data import Inputs, Missing, measure_display
from repsim.analyses.item import Figure, item


@item("heatmap", "{measure} between every (store, layer) column of {file}", "figure",
      ("results of repsim cka/similarity over stores of unknown objective",), per_result=True)
def heatmap(inputs: Inputs, file: str | None = None, measure: str | None = None) -> Figure:
    if file is None:  # no variant: nothing of unknown objective (Item.result_variants)
        inputs.similarities  # noqa: B018 - Missing when there is no results file at all
        raise Missing("every store of the results files has a known objective: Figs. 2a and 2b draw them "
                      "(`repsim plot RESULT.npz` draws any results file)")
    result = next(r for f, r, _ in inputs.similarities.parts if f == file)
    fig = result.plot(measure)
    stores = list(dict.fromkeys(s for s, _ in result.index))
    meta = result.meta
    settings = ", ".join(f"{k}={meta[k]}" for k in ("method", "n", "batch_size", "epochs", "debiased", "spatial")
                         if k in meta)
    undefined = (meta.get("undefined") or {}).get(measure) or {}
    nan = (f" Undefined (NaN, grey hatched): {', '.join(undefined.get('columns', []))}."
           if undefined.get("columns") else "")
    return Figure(fig, f"{measure_display(measure)} between every (store, layer) column of {file}: "
                       f"{len(stores)} store(s) ({', '.join(stores)}), {len(result.index)} columns, in blocks "
                       f"per store; colour scale the measure's declared range. Estimator: "
                       f"{meta.get('estimators', {}).get(measure, meta.get('method', 'not recorded'))}"
                       f"{'; ' + settings if settings else ''}.{nan} The objectives of these stores are not "
                       f"known, so the paper's figures, which compare objectives, are skipped.")
