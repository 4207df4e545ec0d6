"""Small real inputs for the evaluation tests: random RGB image files and tiny random-init checkpoints."""
from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SIZE = 8  # the networks' input; files are 12 x 12 (resized to 9, centre-cropped to 8)


def write_image(path: Path, rng: np.random.Generator, size: int = 12) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


def tiny_checkpoint(path: Path, num_classes: int, *, data_spec: str = "digits", seed: int = 0,
                    objective: str = "softmax", head_bias: np.ndarray | None = None, zero_head: bool = False) -> Path:
    """A mini ResNet-14 (width 4, RGB, 8 x 8 inputs) with random weights, saved as repsim/train/ saves checkpoints.

    ``zero_head`` zeroes the final layer's weights, so that the logits are ``head_bias`` for every image.
    """
    import torch

    from repsim.train.checkpoint import save_checkpoint
    from repsim.train.config import load_config
    from repsim.train.models import build_network

    cfg = load_config(f"digits-{objective}")
    cfg.update(arch="mini_resnet14", arch_params={"width": 4, "layers": [1, 1, 1, 1]}, in_channels=3,
               num_classes=num_classes, seed=seed)
    cfg["data"] = {**cfg["data"], "spec": data_spec, "image_size": IMAGE_SIZE, "eval_resize": 0}
    torch.manual_seed(seed)
    net = build_network(cfg)
    with torch.no_grad():
        if zero_head:
            net.head.weight.zero_()
        if head_bias is not None:
            net.head.bias.copy_(torch.as_tensor(head_bias, dtype=net.head.bias.dtype))
    state = net.state_dict()
    save_checkpoint({"config": cfg, "model": state, "ema": state, "epoch": 1}, path)
    return path
