"""Activation stores: the Zarr v3 format, its reader and writer, direct chunk I/O, and validation.

May import only :mod:`repsim.array_api` and each other — never the kernels, the probes, the engine or the commands.
"""
