"""The out-of-core engine: metrics streamed from stores — minibatch and exact CKA, batch plans and the
block reader, per-layer drivers (R², sparsity, collapse, spectra), the Dask scheduler.

May import the kernels, the probes, the store and :mod:`repsim.array_api` — never the commands.
"""
