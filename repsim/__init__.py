"""repsim: representation analysis at scale, torch-free.

Minibatch CKA, class separation (R^2), sparsity, neural-collapse metrics, spectra and transfer
probes, computed from in-memory arrays (NumPy, CuPy, array-api-strict) or streamed out-of-core from
Zarr v3 activation stores with Dask. The science follows Kornblith, Chen, Lee & Norouzi, "Why Do
Better Loss Functions Lead to Less Transferable Features?" (NeurIPS 2021).

Public names are imported lazily so that ``import repsim`` stays cheap and never imports torch.
"""
from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    # kernels
    "linear_cka": "cka",
    "ucenter": "cka",
    "MinibatchCKA": "cka",
    "class_separation": "separation",
    "ClassSeparation": "separation",
    "nonzero_fraction": "sparsity",
    "nonzero_fraction_per_channel": "sparsity",
    "Sparsity": "sparsity",
    "collapse_metrics": "collapse",
    "CollapseStats": "collapse",
    "batch_hsic": "cka",
    "activation_spectrum": "spectra",
    "ActivationSpectrum": "spectra",
    "weight_spectrum": "spectra",
    "centroid_spectrum": "spectra",
    "angular_visual_hardness": "spectra",
    "cosine_distance_samples": "spectra",
    # stores
    "save_store": "store",
    "open_store": "store",
    "ActivationStore": "store",
    "StoreWriter": "store",
    "StoreError": "store",
    # out-of-core engine
    "cka_matrix": "engine",
    "CKAResult": "engine",
    "set_scheduler": "scheduler",
    "layer_metrics": "drivers",
    # probes
    "linear_probe": "probes",
    "knn_probe": "probes",
    "ProbeResult": "probes",
    "multilabel_probe": "probes",
    "binned_auc": "probes",
    "relearn_head": "transfer",
    "assignment_accuracy": "transfer",
    "agreement_matrices": "predictions",
    "modal_vote": "predictions",
    "calibration_report": "calibration",
    "fit_temperature": "calibration",
    "mean_se": "stats",
    "not_significantly_worse": "stats",
    "spearman": "stats",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
