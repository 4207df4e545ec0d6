"""What every image dataset of ``repsim.train.data`` and ``repsim.train.csvdata`` shares: the fixed holdout split and
the App. A.1 transforms. (Both import it; ``repsim.train.data`` also dispatches to ``repsim.train.csvdata``, so these
live below both rather than in either.)"""
from __future__ import annotations

from typing import Callable

import numpy as np

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SPLIT_SEED = 0  # fixed: holdout/test membership never depends on the run seed


def holdout_split(n: int, holdout: int, split: str) -> np.ndarray:
    """Indices (sorted) of ``split`` when ``holdout`` of ``n`` items are held out deterministically."""
    if not 0 <= holdout < n:
        raise ValueError(f"holdout size {holdout} must be in [0, {n})")
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    if split == "holdout":
        return np.sort(perm[:holdout])
    return np.sort(perm[holdout:])


def image_transforms(augment: str | bool, image_size: int, eval_resize: int | None,
                     mean=IMAGENET_MEAN, std=IMAGENET_STD, autoaugment: bool = False) -> tuple[Callable, str]:
    """App. A.1: RandomResizedCrop(size, 0.1–1, 3/4–4/3) + flip for training; resize to
    ``eval_resize`` (256 for 224) on the short side + centre crop for evaluation. ``augment='cifar'``:
    pad-4 random crop + flip (ICLR App. A.1 standard CIFAR augmentation). ``autoaugment`` (training
    only): torchvision's AutoAugment ImageNet policy after the crop and flip (App. C.4)."""
    from torchvision import transforms as T

    norm = [T.ToTensor(), T.Normalize(mean, std)]
    if augment == "none":
        augment = False
    if augment not in (True, False, None, "imagenet", "cifar"):  # else it would be the eval transform, silently
        raise ValueError(f"augmentation {augment!r} is not one for image datasets: use imagenet, cifar or none")
    if augment in (True, "imagenet"):
        t = [T.RandomResizedCrop(image_size, scale=(0.1, 1.0), ratio=(3 / 4, 4 / 3)), T.RandomHorizontalFlip()]
        desc = f"RandomResizedCrop({image_size}, scale=(0.1, 1), ratio=(3/4, 4/3)) + flip"
    elif augment == "cifar":
        t = [T.RandomCrop(image_size, padding=4), T.RandomHorizontalFlip()]
        desc = f"RandomCrop({image_size}, pad 4) + flip"
    elif eval_resize:
        t = [T.Resize(eval_resize), T.CenterCrop(image_size)]
        desc = f"Resize({eval_resize}) + CenterCrop({image_size})"
    else:
        t, desc = [], "none"
    if autoaugment and augment:
        from .augment import autoaugment_policy

        t, desc = t + [autoaugment_policy()], desc + " + AutoAugment (ImageNet policy)"
    return T.Compose(t + norm), desc + "; normalise"
