"""Augmentations beyond the standard crop/flip: AutoAugment and Mixup (paper App. C.4, Tables C.5, C.6, E.3).

* **AutoAugment** (Cubuk et al. 2019): torchvision's ``AutoAugment`` with the ImageNet policy, applied
  to the training split after the standard random crop and flip (the order of the reference ImageNet
  pipeline: crop, flip, policy, normalise). PIL images go straight through the policy; the digits
  demo's standardised float tensors go through :class:`FloatAutoAugment`, which quantises them to
  uint8 over the dataset's known value range, applies the policy and maps back.
* **Mixup** (Zhang et al. 2018): one λ ~ Beta(α, α) per batch (per process under DDP), the batch mixed
  with a random permutation of itself, x̃ = λ x + (1 − λ) x[π]; the loss is λ L(z, y) + (1 − λ) L(z, y[π]),
  which equals the loss at the mixed one-hot target λ t + (1 − λ) t[π] because every objective of
  :mod:`repsim.train.objectives` is linear in the target (Eqs. 1, 2, 8, 9; the logit penalty and final-layer
  L² do not depend on it). App. C.4 chooses α from {0.1, 0.2, 0.3, 0.4} on the holdout set
  (``repsim tune``; the ``*-mixup`` presets carry that grid in ``tune_grid``).

Both options are off by default (``data.autoaugment = false``, ``mixup.alpha = 0``).
"""
from __future__ import annotations

from typing import Callable

import torch

MIXUP_ALPHAS = (0.1, 0.2, 0.3, 0.4)  # App. C.4 / Table C.5 caption


def variant_of(config: dict) -> str:
    """A run's ``variant`` label: the config's ``variant`` when set, else the augmentation options it
    uses joined by '+' ("autoaugment", "mixup", "autoaugment+mixup"; "" for the standard recipe)."""
    if config.get("variant"):
        return str(config["variant"])
    aa = bool((config.get("data") or {}).get("autoaugment"))
    mix = float((config.get("mixup") or {}).get("alpha", 0.0) or 0.0) > 0
    return "+".join(["autoaugment"] * aa + ["mixup"] * mix)


def autoaugment_policy() -> Callable:
    """torchvision's AutoAugment with the ImageNet policy (PIL images or uint8 tensors)."""
    from torchvision import transforms as T

    return T.AutoAugment(T.AutoAugmentPolicy.IMAGENET)


class FloatAutoAugment:
    """AutoAugment (ImageNet policy) for float tensors whose values lie in ``[lo, hi]``.

    The policy's colour operations (posterize, solarize, equalize) are defined on 8-bit images, so the
    tensor is mapped linearly to uint8 (``lo`` → 0, ``hi`` → 255, rounded), augmented, and mapped back.
    """

    def __init__(self, lo: float, hi: float):
        if not hi > lo:
            raise ValueError(f"FloatAutoAugment needs hi > lo, got [{lo}, {hi}]")
        self.lo, self.hi = float(lo), float(hi)
        self.policy = autoaugment_policy()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = 255.0 / (self.hi - self.lo)
        q = ((x - self.lo) * scale).round().clamp(0, 255).to(torch.uint8)
        return self.policy(q).to(x.dtype) / scale + self.lo

    def __repr__(self) -> str:
        return f"FloatAutoAugment(ImageNet policy, range [{self.lo:.3g}, {self.hi:.3g}])"


def mixup_batch(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mix a batch with a permutation of itself (Zhang et al. 2018): returns (x̃, y[π], λ).

    λ ~ Beta(α, α) and π are drawn from torch's global generator (so ``--resume`` reproduces them, as
    the loop checkpoints the RNG state). The caller's loss is λ L(y) + (1 − λ) L(y[π]).
    """
    if alpha <= 0:
        raise ValueError(f"mixup alpha must be > 0, got {alpha}")
    a = torch.tensor(float(alpha), dtype=torch.float64)
    lam = float(torch.distributions.Beta(a, a).sample())
    perm = torch.randperm(x.shape[0]).to(x.device)
    return lam * x + (1.0 - lam) * x[perm], y[perm], lam
