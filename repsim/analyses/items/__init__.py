"""Figure and table items, one module per part of the paper; :mod:`repsim.analyses.items.catalog` imports
them all (which registers them) and holds ``ORDER``, the paper's order. This ``__init__`` imports nothing."""
