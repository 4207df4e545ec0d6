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


def load(spec: str) -> LoadedModel:
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
        model = timm.create_model(name, pretrained=True)
    else:
        with seeded():
            model = timm.create_model(name, pretrained=False)
    model.eval()
    cfg = resolve_data_config({}, model=model)
    preprocess = None
    if pretrained:
        t = create_transform(**cfg, is_training=False)
        preprocess = Preprocess(t, f"timm transform {cfg}", mode="L" if cfg["input_size"][0] == 1 else "RGB")
    meta = {
        "arch": name, "source": "timm", "init": "pretrained" if pretrained else "random(seed=0)",
        "weights_sha256": weights_sha256(model), "timm": timm.__version__,
    }
    return LoadedModel(
        model, clean(meta), preprocess=preprocess, channels=int(cfg["input_size"][0]),
        input_size=side(cfg["input_size"]), fixed_size=bool(model.pretrained_cfg.get("fixed_input_size")),
    )
