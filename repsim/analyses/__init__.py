"""Figures and tables of the paper, regenerated from stores and results."""
