"""repsim: representation analysis at scale, torch-free.

Minibatch CKA, class separation (R^2), sparsity, neural-collapse metrics, spectra and transfer
probes, computed from in-memory arrays (NumPy, CuPy, array-api-strict) or streamed out-of-core from
Zarr v3 activation stores with Dask. The science follows Kornblith, Chen, Lee & Norouzi, "Why Do
Better Loss Functions Lead to Less Transferable Features?" (NeurIPS 2021).

Public names are imported lazily so that ``import repsim`` stays cheap and never imports torch.
"""
from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    # kernels
    "linear_cka": "kernels.cka",
    "ucenter": "kernels.hsic",
    "MinibatchCKA": "kernels.minibatch_cka",
    "class_separation": "kernels.separation",
    "ClassSeparation": "kernels.separation",
    "nonzero_fraction": "kernels.sparsity",
    "nonzero_fraction_per_channel": "kernels.sparsity",
    "Sparsity": "kernels.sparsity",
    "collapse_metrics": "kernels.collapse",
    "CollapseStats": "kernels.collapse",
    "batch_hsic": "kernels.hsic",
    "release_buffers": "kernels.hsic",
    "activation_spectrum": "kernels.spectra",
    "ActivationSpectrum": "kernels.spectra",
    "weight_spectrum": "kernels.spectra",
    "centroid_spectrum": "kernels.spectra",
    "angular_visual_hardness": "kernels.spectra",
    "cosine_distance_samples": "kernels.spectra",
    # stores
    "save_store": "store.writer",
    "open_store": "store.reader",
    "ActivationStore": "store.reader",
    "StoreWriter": "store.writer",
    "StoreError": "store.format",
    # out-of-core engine
    "cka_matrix": "engine.minibatch",
    "similarity_matrix": "engine.minibatch",
    "SimilarityResult": "engine.result",
    "load_result": "engine.result",
    "similarity": "kernels.measures.exact",
    "calibrated_similarity": "kernels.measures.exact",
    "calibrated_matrix": "kernels.measures.exact",
    "pairwise": "kernels.measures.exact",
    "CKAResult": "engine.result",
    "set_scheduler": "engine.scheduler",
    "StreamOptions": "engine.options",
    "layer_metrics": "engine.drivers",
    # probes
    "linear_probe": "probes.linear",
    "knn_probe": "probes.knn",
    "ProbeResult": "probes._common",
    "multilabel_probe": "probes.multilabel",
    "binned_auc": "probes.multilabel",
    "relearn_head": "probes.transfer",
    "assignment_accuracy": "probes.transfer",
    "agreement_matrices": "probes.predictions",
    "modal_vote": "probes.predictions",
    "calibration_report": "probes.calibration",
    "fit_temperature": "probes.calibration",
    "mce": "probes.robustness",
    "masked_predictions": "probes.robustness",
    "mean_se": "probes.stats",
    "not_significantly_worse": "probes.stats",
    "spearman": "probes.stats",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
