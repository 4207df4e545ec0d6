"""Which batch columns the engine reduces to their centred b × b Gram (all that linear HSIC sees of
them): :data:`REDUCE_FACTOR`; the reduction itself (:func:`~repsim.kernels.hsic.centered_gram`) and its
precision (:func:`~repsim.array_api.gram_dtype`) are the kernels', re-exported here."""
from __future__ import annotations

from repsim.array_api import gram_dtype
from repsim.kernels.hsic import centered_gram

__all__ = ["REDUCE_FACTOR", "centered_gram", "gram_dtype"]

REDUCE_FACTOR = 4  # columns wider than this many times the batch are reduced to their b × b Gram
