"""Out-of-distribution accuracy and ImageNet-C's mean corruption error (paper Table C.2).

- :func:`masked_predictions`: top-1 predictions restricted to a subset of the classifier's classes.
  ImageNet-A and ImageNet-R hold 200 of ImageNet's 1,000 classes, and their benchmarks score a
  1,000-way classifier by taking the arg max over those 200 logits only (``indices_in_1k`` in the
  benchmarks' evaluation code, Hendrycks et al. 2021a, 2021b); V2 and Sketch use all 1,000.
- :func:`corruption_errors` / :func:`mce`: ImageNet-C (Hendrycks & Dietterich, ICLR 2019, §3):
  for a classifier f, corruption c and severity s = 1..5, ``E^f_{s,c}`` is the top-1 error; the
  corruption error ``CE^f_c = (Σ_{s=1}^{5} E^f_{s,c}) / (Σ_{s=1}^{5} E^{AlexNet}_{s,c})`` and the mean
  corruption error ``mCE^f`` is the average of ``CE^f_c`` over the 15 corruptions (reported in %).

``ALEXNET_ERRORS`` holds AlexNet's published per-severity top-1 errors on ImageNet-C, the reference of
the normalisation (the values distributed with the benchmark's evaluation code, hendrycks/robustness,
``ImageNet-C/test.py``, and reused by e.g. timm's ``imagenetc_alexnet_error_rates_list``); their means
over severities are the per-corruption constants quoted by AugMix (Hendrycks et al., ICLR 2020, code
``ALEXNET_ERR``: 0.886428 for Gaussian noise, ...), which ``tests/test_robustness.py`` checks.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

#: The 15 corruptions of the ImageNet-C benchmark, in its order (noise, blur, weather, digital).
CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
    "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
    "jpeg_compression",
)
#: The four held-out corruptions shipped with ImageNet-C; not part of mCE.
EXTRA_CORRUPTIONS: tuple[str, ...] = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)

#: AlexNet's top-1 error on ImageNet-C per corruption, severities 1..5 (see the module docstring).
ALEXNET_ERRORS: dict[str, tuple[float, float, float, float, float]] = {
    "gaussian_noise": (0.69528, 0.82542, 0.93554, 0.98138, 0.99452),
    "shot_noise": (0.71224, 0.85108, 0.93574, 0.98182, 0.99146),
    "impulse_noise": (0.78374, 0.89808, 0.94870, 0.98720, 0.99548),
    "defocus_blur": (0.65624, 0.73202, 0.85036, 0.91364, 0.94714),
    "glass_blur": (0.64308, 0.75054, 0.88806, 0.91622, 0.93344),
    "motion_blur": (0.58430, 0.70048, 0.82108, 0.89750, 0.92638),
    "zoom_blur": (0.70008, 0.76992, 0.80784, 0.84198, 0.87198),
    "snow": (0.71726, 0.88392, 0.86468, 0.91870, 0.94952),
    "frost": (0.61390, 0.79734, 0.88790, 0.89942, 0.93430),
    "fog": (0.67474, 0.76050, 0.84378, 0.87260, 0.94500),
    "brightness": (0.45140, 0.48502, 0.54048, 0.62166, 0.72440),
    "contrast": (0.64548, 0.76150, 0.88874, 0.97760, 0.99270),
    "elastic_transform": (0.52596, 0.70116, 0.55686, 0.64076, 0.80554),
    "pixelate": (0.52218, 0.54620, 0.73728, 0.87092, 0.91262),
    "jpeg_compression": (0.51002, 0.54718, 0.57294, 0.65458, 0.74778),
}


def masked_predictions(logits: np.ndarray, classes: Sequence[int] | None = None) -> np.ndarray:
    """Top-1 predictions (N,) in the classifier's class indices, the arg max taken over ``classes``
    only (all classes when None): ``classes[argmax_j logits[:, classes[j]]]``."""
    z = np.asarray(logits)
    if z.ndim != 2:
        raise ValueError(f"logits must be (N, K), got shape {z.shape}")
    if classes is None:
        return z.argmax(axis=1)
    idx = np.asarray(classes, dtype=np.int64)
    if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= z.shape[1]:
        raise ValueError(f"classes must be a non-empty list of indices in [0, {z.shape[1]})")
    return idx[z[:, idx].argmax(axis=1)]


def corruption_errors(errors: Mapping[str, Sequence[float]],
                      reference: Mapping[str, Sequence[float]] = ALEXNET_ERRORS) -> dict[str, float]:
    """``CE_c = Σ_s E_{s,c} / Σ_s E^{ref}_{s,c}`` for every corruption c in ``errors`` (as a fraction;
    ×100 for the benchmark's %). ``errors[c]`` holds the top-1 errors at severities 1..5, in order."""
    out = {}
    for c, e in errors.items():
        if c not in reference:
            raise ValueError(f"corruption {c!r} has no reference errors (mCE covers {', '.join(reference)})")
        e = np.asarray(e, dtype=np.float64)
        ref = np.asarray(reference[c], dtype=np.float64)
        if e.shape != ref.shape:
            raise ValueError(f"corruption {c!r}: {e.size} severities given, the benchmark has {ref.size}")
        if np.any((e < 0) | (e > 1)):
            raise ValueError(f"corruption {c!r}: errors must be fractions in [0, 1]")
        out[c] = float(e.sum() / ref.sum())
    return out


def mce(errors: Mapping[str, Sequence[float]],
        reference: Mapping[str, Sequence[float]] = ALEXNET_ERRORS) -> float:
    """Mean corruption error in % (ImageNet-C): ``100 · mean_c CE_c`` over the corruptions given
    (the benchmark's mCE when they are the 15 of :data:`CORRUPTIONS`)."""
    ce = corruption_errors(errors, reference)
    if not ce:
        raise ValueError("no corruption errors given")
    return 100.0 * float(np.mean(list(ce.values())))


__all__ = ["CORRUPTIONS", "EXTRA_CORRUPTIONS", "SEVERITIES", "ALEXNET_ERRORS", "masked_predictions",
           "corruption_errors", "mce"]
