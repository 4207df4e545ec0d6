"""Every figure and table item, registered by importing its module here; ``ORDER`` is the paper's order
(main text, then appendix). :mod:`repsim.analyses.render` imports this module; the item modules and
:mod:`repsim.analyses.findings` import only what they need (``repsim.analyses.items`` itself imports
nothing, so ``findings`` can use the items' helpers without a circle through this registry)."""
from repsim.analyses.items import evaluation, finetune, heatmaps, layers, measures, predictions, recipes, training, transfer  # noqa: F401

ORDER = ("fig1", "table1", "table2", "fig2a", "fig2b", "fig2a_calibrated", "fig2b_calibrated", "agreement", "blocks", "heatmap", "fig3", "table3", "fig4", "fig5", "table4", "fig5b", "fig6",
         "tableC1", "figC1", "figC2", "figC3", "tableC2", "tableC3", "figC4", "figC5", "figC6", "figC7",
         "tableC4", "tableC5", "tableC6",
         "figD1", "figD2", "tableD1", "figD3",
         "tableE1", "tableE2", "figE1", "figE2", "figE3", "tableE3", "figE4", "tableF1")
