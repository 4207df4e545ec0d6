"""Per-block activation extraction into Zarr v3 stores. Uses torch."""
