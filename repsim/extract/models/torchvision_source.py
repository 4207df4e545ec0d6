"""``torchvision:<name>[:<weights>]``: any torchvision classification model (``list_models(module=
torchvision.models)``: ResNet, ViT, Swin, ConvNeXt, EfficientNet, MobileNet, RegNet, ...).

Built with ``torchvision.models.get_model``; without ``:<weights>`` the weights are random (seeded,
so a rerun builds the same model), with ``:DEFAULT`` or a weight name (``IMAGENET1K_V1``,
``ResNet50_Weights.IMAGENET1K_V2``) torchvision loads them through its own cache (``TORCH_HOME``).
Loaded weights bring their own preprocessing (``weights.transforms()``), which extraction applies to
raw images.
"""
from __future__ import annotations

import difflib

from .common import LoadedModel, Preprocess, clean, seeded, side, weights_sha256

PREFIX = "torchvision:"


def load(spec: str, *, seed: int = 0) -> LoadedModel:
    import torchvision
    from torchvision.models import get_model, get_model_weights, list_models

    name, _, weights = spec[len(PREFIX):].partition(":")
    names = list_models(module=torchvision.models)
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see torchvision.models.list_models()"
        raise ValueError(f"extract: {spec!r} is not a torchvision classification model{hint}")
    enum = get_model_weights(name)
    try:
        chosen = enum.verify(weights) if weights else None
    except (ValueError, KeyError):
        raise ValueError(
            f"extract: {spec!r}: unknown weights {weights!r}; choose DEFAULT or one of "
            f"{', '.join(w.name for w in enum)}"
        ) from None
    if chosen is None:
        with seeded(seed):
            model = get_model(name, weights=None)
    else:
        model = _pretrained(spec, name, chosen, get_model)
    model.eval()
    default = enum.DEFAULT  # every torchvision classifier has weights; their transform gives the usual size
    crop = side(getattr(default.transforms(), "crop_size", None))
    fixed = getattr(model, "image_size", None)  # VisionTransformer takes exactly this size
    preprocess = None
    if chosen is not None:
        t = chosen.transforms()
        preprocess = Preprocess(t, f"torchvision {type(chosen).__name__}.{chosen.name} transforms: "
                                   + " ".join(repr(t).split()))
    meta = {
        "arch": name, "source": "torchvision", "weights": f"{type(chosen).__name__}.{chosen.name}" if chosen else None,
        "init": "pretrained" if chosen else f"random(seed={seed})",
        "seed": None if chosen else seed, "weights_sha256": weights_sha256(model),
        "torchvision": torchvision.__version__,
    }
    return LoadedModel(
        model, clean(meta), preprocess=preprocess, channels=3,
        input_size=int(fixed) if fixed else crop, fixed_size=bool(fixed),
        min_size=side((chosen or default).meta.get("min_size")),
    )


def _pretrained(spec: str, name: str, weights, get_model):
    """torchvision's model with ``weights``, from torch.hub's cache or downloaded; without network and
    without the cached file, one line naming the file, the cache and a local route (extract/models/offline.py)."""
    import os
    import urllib.error
    from urllib.parse import urlparse

    import torch

    from .offline import host_of, reachable, unavailable

    filename = os.path.basename(urlparse(weights.url).path)
    cache = os.path.join(torch.hub.get_dir(), "checkpoints")

    def error(reason: str = "cannot be reached (no network?)") -> ValueError:
        return unavailable(spec, filename, cache, host_of(weights.url), "TORCH_HOME",
                           f"module:torchvision.models:{name}:/path/to/{filename}", reason)

    if not os.path.isfile(os.path.join(cache, filename)) and not reachable(weights.url):
        raise error()
    try:
        return get_model(name, weights=weights)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise error(f"did not give it ({getattr(exc, 'reason', exc)})") from None
