"""``timm:<name>[:pretrained]``: any model of timm (``pip install 'repsim-toolkit[timm]'``).

Built with ``timm.create_model(name, pretrained=...)``: random weights (seeded) unless ``:pretrained``
is given, in which case timm loads them through its own cache (Hugging Face hub cache). timm's data
config for the model (``resolve_data_config`` / ``create_transform``: resize, crop, mean/std,
interpolation) is its preprocessing when weights are loaded, and gives the input size otherwise.
Models whose ``output_fmt`` is ``NHWC`` (Swin, ...) produce channels-last maps, which extraction
reads as such.
"""
from __future__ import annotations

from repsim.extras import require

from .common import LoadedModel, Preprocess, clean, seeded, side, weights_sha256

PREFIX = "timm:"


def load(spec: str, *, seed: int = 0) -> LoadedModel:
    require("timm", f"model source {spec!r}")
    import timm
    from timm.data import create_transform, resolve_data_config

    name, _, flag = spec[len(PREFIX):].partition(":")
    if flag not in ("", "pretrained"):
        raise ValueError(f"extract: {spec!r}: the only option after the name is ':pretrained'")
    if not timm.is_model(name):
        raise ValueError(f"extract: {spec!r}: timm has no model {name!r} (see timm.list_models())")
    pretrained = flag == "pretrained"
    if pretrained:
        model = _pretrained(spec, name, timm)
    else:
        with seeded(seed):
            model = timm.create_model(name, pretrained=False)
    model.eval()
    cfg = resolve_data_config({}, model=model)
    preprocess = None
    if pretrained:
        t = create_transform(**cfg, is_training=False)
        preprocess = Preprocess(t, f"timm transform {cfg}", mode="L" if cfg["input_size"][0] == 1 else "RGB")
    meta = {
        "arch": name, "source": "timm", "init": "pretrained" if pretrained else f"random(seed={seed})",
        "seed": None if pretrained else seed,
        "weights_sha256": weights_sha256(model), "timm": timm.__version__,
    }
    return LoadedModel(
        model, clean(meta), preprocess=preprocess, channels=int(cfg["input_size"][0]),
        input_size=side(cfg["input_size"]), fixed_size=bool(model.pretrained_cfg.get("fixed_input_size")),
    )


def _pretrained(spec: str, name: str, timm):
    """timm's pretrained model, from the Hugging Face cache or downloaded: with the file cached and the hub
    out of reach, in offline mode (no retries); with neither, one line naming the file, the cache and a
    local route (extract/models/offline.py)."""
    from .offline import host_of, hub_offline, reachable, unavailable

    cfg = timm.models.get_pretrained_cfg(name)
    hub_id = getattr(cfg, "hf_hub_id", None)
    if not hub_id:  # weights from a URL (torch.hub's cache), not the hub
        return timm.create_model(name, pretrained=True)
    from huggingface_hub import constants, try_to_load_from_cache

    names = [cfg.hf_hub_filename] if getattr(cfg, "hf_hub_filename", None) else ["model.safetensors", "pytorch_model.bin"]
    cached = any(isinstance(try_to_load_from_cache(hub_id, f), str) for f in names)
    if reachable(constants.ENDPOINT):
        return timm.create_model(name, pretrained=True)
    if not cached:
        raise unavailable(spec, f"{names[0]} of {hub_id}", constants.HF_HUB_CACHE, host_of(constants.ENDPOINT),
                          "HF_HOME", f"module:<your module>:<factory returning timm.create_model({name!r})>:"
                                     f"/path/to/{names[0]}")
    with hub_offline():
        return timm.create_model(name, pretrained=True)
