"""Probes and run statistics on fixed features: linear (with its L-BFGS solver), kNN, multi-label,
head relearning and class matching, predictions, calibration, and seed statistics (Table 1's bold rule).

May import only :mod:`repsim.array_api`, the kernels and each other — never the store, the engine or the commands.
"""
