"""Kernels: the paper's metrics on in-memory arrays of any array-API namespace (NumPy, CuPy, array-api-strict).

CKA, class separation R², sparsity, neural-collapse metrics, spectra, and the per-class moments they
share. May import only the base modules (:mod:`repsim.array_api`, :mod:`repsim.blas`, …) and each other — never
the probes, the store, the engine or the commands.
"""
