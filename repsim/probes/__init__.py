"""Probes and run statistics on fixed features: linear (with its L-BFGS solver), kNN, multi-label,
head relearning and class matching, predictions, calibration, and seed statistics (Table 1's bold rule).

May import only the base (:mod:`repsim.array_api`, :mod:`repsim.results`, ...), the kernels, the store and
each other — never the engine or the commands. :mod:`repsim.probes.writers` writes the results files of
`repsim probe`, `calibrate` and `accuracy` (the commands' library calls).
"""
