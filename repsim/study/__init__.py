"""The paper's study (Kornblith et al., NeurIPS 2021) as data the stages share: the objective registry
(:mod:`~repsim.study.objectives`), the rule that rescales the objectives' settings to a study's classes
and weight decay (:mod:`~repsim.study.rescale`) and ``repsim train``'s run directories
(:mod:`~repsim.study.runs`). The general-purpose base (array namespaces, file I/O, results columns) is at
the package root; nothing here imports torch."""
