"""``hf:<model id or local directory>``: Hugging Face ``transformers`` vision and text encoders
(``pip install 'repsim-toolkit[hf]'``).

The class is the one the checkpoint's config declares when it is an image or sequence classifier
(``*ForImageClassification``, ``*ForSequenceClassification``: blocks, ``pool`` = the classifier's
input, ``logits``); anything else (a base model, or a masked/causal language model, whose head
predicts tokens) is loaded as ``AutoModel``: blocks and ``pool`` = the last hidden state, no logits.
Weights come from ``from_pretrained`` (the hub cache, or the directory); a local directory that holds
only a ``config.json`` gives random weights (seeded). Vision models bring their image processor
(``AutoImageProcessor``) when the checkpoint has one; text models their tokenizer (``AutoTokenizer``),
which tokenises a text dataset (repsim/extract/text.py). Models run in float32 (AMP still applies on GPU).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from repsim.extras import require

from .common import LoadedModel, Preprocess, clean, seeded, side, weights_sha256

PREFIX = "hf:"
HEADS = ("ForImageClassification", "ForSequenceClassification")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_vocabulary(spec: str, tokens: int, vocab_size: int | None) -> None:
    """Refuse a tokenizer that cannot cover the model's vocabulary: a directory holding only a
    ``config.json`` makes ``AutoTokenizer`` build one with just its special tokens (5 for BERT), which
    turns every word into ``[UNK]`` — every example would then be the same sequence.  The rule: fewer
    tokens than half the config's ``vocab_size``."""
    if vocab_size and tokens < int(vocab_size) // 2:
        raise ValueError(
            f"extract: {spec!r}: its tokenizer has {tokens} tokens but the model's config declares vocab_size "
            f"{vocab_size}, so nearly every word would become the unknown token; put the tokenizer's files "
            "(tokenizer.json, or vocab.txt/merges.txt) in the directory, or use a hub id")


class ImageProcessorTransform:
    """A Hugging Face image processor as a per-image transform (picklable for DataLoader workers)."""

    def __init__(self, processor: Any):
        self.processor = processor

    def __call__(self, image: Any):
        return self.processor(images=image, return_tensors="pt")["pixel_values"][0]

    def __repr__(self) -> str:
        return f"{type(self.processor).__name__}({self.processor.to_dict()})"


def _is_vision(config: Any) -> bool:
    return getattr(config, "num_channels", None) is not None and getattr(config, "image_size", None) is not None


def load(spec: str, *, seed: int = 0) -> LoadedModel:
    require("transformers", f"model source {spec!r}")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel

    source = spec[len(PREFIX):]
    if not source:
        raise ValueError("extract: hf: needs a model id or a local directory, e.g. hf:google/vit-base-patch16-224")
    local = Path(source)
    if local.is_dir():
        source = str(local.resolve())
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"extract: {spec!r}: no Hugging Face model config found ({' '.join(str(exc).split())[:300]})") from None
    declared = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, declared, None) if declared and declared.endswith(HEADS) else None
    cls = cls or AutoModel
    pretrained = not local.is_dir() or any((local / f).exists() for f in WEIGHT_FILES)
    if pretrained:
        model = cls.from_pretrained(source)
    else:
        with seeded(seed):
            model = cls.from_config(config) if cls is AutoModel else cls(config)
    model = model.float().eval()

    preprocess, tokenizer = None, None
    if _is_vision(config):
        if not local.is_dir() or (local / "preprocessor_config.json").exists():
            from transformers import AutoImageProcessor

            t = ImageProcessorTransform(AutoImageProcessor.from_pretrained(source))
            preprocess = Preprocess(t, f"Hugging Face image processor {' '.join(repr(t).split())}",
                                    mode="L" if int(config.num_channels) == 1 else "RGB")
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"extract: {spec!r}: no tokenizer for this text model ({' '.join(str(exc).split())[:200]})") from None
        check_vocabulary(spec, len(tokenizer), getattr(config, "vocab_size", None))
    meta = {
        "arch": type(model).__name__, "source": "hf", "model_id": source,
        "init": "pretrained" if pretrained else f"random(seed={seed})",
        "seed": None if pretrained else seed, "weights_sha256": weights_sha256(model),
        "transformers": transformers.__version__, "torch_dtype": str(torch.float32).removeprefix("torch."),
    }
    vision = _is_vision(config)
    return LoadedModel(
        model, clean(meta), preprocess=preprocess, tokenizer=tokenizer,
        channels=int(config.num_channels) if vision else None,
        input_size=side(config.image_size) if vision else None, fixed_size=vision,
    )
