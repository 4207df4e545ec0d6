"""``repsim extract --list-layers``: what a model offers, with shapes, from one forward pass.

Prints the default store layers (name, tap, the module's output shape and the stored per-example
shape after ``--spatial``/``--tokens``), then every other module that ran once, by qualname, with its
output shape (and, by name only, the modules that ran more than once or not at all): ``--layers`` takes store names, module qualnames, or globs over either. The example is
the first of ``--data`` (adapted as extraction would adapt it) or, without ``--data``, a blank image
of the model's input size or a short sentence for a text model.
"""
from __future__ import annotations

from typing import Any

import torch

from .adapt import adapt_dataset
from .capture import Capture, Spatial, Tokens, output_tensor
from .inputs import attention_mask, batch_of_one, check_example, default_tokens, shape_of, to_device
from .layers import layer_modules, model_layout, select_layers
from .models import LoadedModel
from .pipeline import forward_first
from .sources import load_dataset, load_source
from .text import DEFAULT_MAX_LENGTH

SAMPLE_TEXT = "A short example sentence."


def example_input(loaded: LoadedModel, image_size: int | None = None, max_length: int | None = None) -> Any:
    """A stand-in example: a blank image of the model's input size, or a tokenised sentence."""
    if loaded.tokenizer is not None:
        tok = loaded.tokenizer
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        enc = tok(SAMPLE_TEXT, truncation=True, max_length=max_length or DEFAULT_MAX_LENGTH,
                  padding="max_length", return_tensors="pt")
        return {k: v[0] for k, v in enc.items() if isinstance(v, torch.Tensor)}
    size = image_size or loaded.input_size or 224
    return torch.zeros(loaded.channels or 3, size, size)


def _shape(out: Any) -> str:
    try:
        return str(tuple(output_tensor("", out).shape[1:]))
    except TypeError:
        return type(out).__name__


def list_layers(source: Any, data: Any = None, *, split: str | None = "test", data_root: str | None = None,
                spatial: str = "flatten", tokens: str | None = None, layers: Any = None,
                image_size: int | None = None, max_length: int | None = None) -> str:
    """The listing as text (see the module docstring)."""
    loaded = load_source(source)
    net = loaded.model
    if data is not None:
        dataset, dmeta = load_dataset(data, split, data_root, net, loaded.tokenizer, max_length)
        dataset, dmeta = adapt_dataset(dataset, dmeta, loaded, image_size)
        x0, where = dataset[0][0], f"the first example of {dmeta.get('name')} {dmeta.get('split') or ''}".rstrip()
        if dmeta.get("transform"):
            where += f" ({dmeta['transform']})"
    else:
        x0, where = example_input(loaded, image_size, max_length), "a stand-in example (give --data for yours)"
    check_example(x0)
    registry = layer_modules(net)
    modules = [q for q, _ in net.named_modules()]
    chosen = select_layers(registry, layers, modules)
    tokens_ = Tokens.parse(tokens or default_tokens(x0))
    layout = model_layout(net)

    raw: dict[str, Any] = {}
    calls: dict[str, int] = {}
    named = dict(net.named_modules())

    def record(qual: str):
        def hook(module, inputs, out):
            calls[qual] = calls.get(qual, 0) + 1
            raw.setdefault(qual, _shape(out))
        return hook

    handles = [named[q].register_forward_hook(record(q)) for q in modules]
    try:
        with Capture(net, chosen, Spatial.parse(spatial), torch.float32, tokens_, layout) as cap, torch.inference_mode():
            xb = batch_of_one(x0)
            cap.mask = attention_mask(xb)
            cap.begin_batch()
            forward_first(net, to_device(xb, torch.device("cpu")))  # a failure: one line, not a crash
    finally:
        for h in handles:
            h.remove()

    n_params = sum(p.numel() for p in net.parameters())
    lines = [f"{source if isinstance(source, str) else type(net).__name__}: {type(net).__name__}, "
             f"{n_params / 1e6:.2f}M parameters; input {shape_of(xb)}, {where}"]
    lines.append(f"store layers ({'selected' if layers else 'default'}; --tokens {tokens_}, --spatial {spatial}, "
                 f"layout {layout}):")
    rows = [("name", "tap", "module output", "stored (per example)")]
    for name, tap in chosen.items():
        qual = tap.rpartition(":")[0] if tap.endswith(":input") else tap
        out_shape = "(input)" if tap.endswith(":input") else raw.get(qual, "not run")
        stored = tuple(cap.probe[name].shape[1:]) if name in cap.probe else "not run"
        rows.append((name, tap if tap else "(model output)", str(out_shape), str(stored)))
    lines += _table(rows)
    if "logits" in registry and "logits" not in chosen:
        lines.append("  (logits, the model output, are stored at the root of every store)")
    lines.append("modules that ran once (--layers takes these qualnames, or globs over them):")
    lines += _table([("qualname", "output")] + [(q, raw[q]) for q in modules if q and calls.get(q) == 1])
    shared = [q for q in modules if q and calls.get(q, 0) > 1]
    if shared:
        lines.append(f"modules that ran more than once (cannot be captured by a hook): {', '.join(shared)}")
    idle = [q for q in modules if q and q not in calls]
    if idle:
        shown = ", ".join(idle[:20]) + (f", ... ({len(idle) - 20} more)" if len(idle) > 20 else "")
        lines.append(f"modules that forward did not run on this example (not listed above; nothing to capture): {shown}")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]

