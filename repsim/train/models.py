"""Architectures and the :class:`Network` wrapper (backbone → penultimate features → objective head).

Registry (``build_backbone(arch, **params) -> (backbone, feature_dim)``):

* ``resnet50``      torchvision ResNet-50 v1.5 (stride in the 3×3 conv), last BN γ of every
                    bottleneck zero-initialised (``zero_init_residual``; Goyal et al., App. A.1 fn. 3).
* ``inception_v3``  torchvision Inception v3 without the auxiliary head (App. B), input ≥ 75 px.
* ``allcnn_c``      All-CNN-C (Springenberg et al. 2014) with BN after every conv and the global
                    average pool moved before the last (1×1, classifier) conv — ICLR version App. A.1.
* ``wrn16_8``       Wide ResNet 16-8 (Zagoruyko & Komodakis 2016), pre-activation basic blocks.
* ``mini_resnet``   the ResNet-50 block structure (Bottleneck, ``layers`` per stage, default
                    [3, 4, 6, 3] = 16 blocks) at small width and without stem downsampling, for
                    8×8 digits on a CPU. ``mini_resnet50``/``26``/``14`` are preset layer counts.
                    ``arch_params``: ``width``, ``layers``, ``zero_init_residual`` (default true, as
                    torchvision's ResNet-50 here; false starts every block's last BN at γ = 1).

Every backbone has ``fc = Identity`` semantics: ``backbone(x)`` is the (N, M) penultimate vector.
Residual backbones keep torchvision's attribute names ``layer1`` … ``layer4`` (nn.Sequential of
blocks) and ``avgpool`` so repsim/extract/ can name blocks generically.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .objectives import Head, make_objective


# ------------------------------------------------------------------------------------------------
# mini ResNet: torchvision's Bottleneck layout (conv1/bn1/conv2/bn2/conv3/bn3/relu/downsample),
# written here so that the CPU demo does not pay torchvision's ~2 s import per process.
class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck, attribute-compatible with ``torchvision.models.resnet.Bottleneck``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class MiniResNet(nn.Module):
    """ResNet with Bottleneck blocks, ``layers`` per stage, base width ``width`` (torchvision: 64).

    Stem: 3×3 conv stride 1, no max-pool (8×8 digits keep their resolution); stages 2–4 halve it.
    """

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 8, in_channels: int = 3,
                 zero_init_residual: bool = True):
        super().__init__()
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"mini_resnet needs 4 stage depths >= 1, got {list(layers)}")
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        self.layer1 = self._make_layer(width, layers[0], 1)
        self.layer2 = self._make_layer(width * 2, layers[1], 2)
        self.layer3 = self._make_layer(width * 4, layers[2], 2)
        self.layer4 = self._make_layer(width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity()
        self.num_features = width * 8 * Bottleneck.expansion
        _init_like_torchvision(self, zero_init_residual)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        mods = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        mods += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _init_like_torchvision(model: nn.Module, zero_init_residual: bool) -> None:
    """torchvision ResNet init: Kaiming-normal fan_out convs, BN γ=1 β=0, last BN γ=0 per block."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)


# ------------------------------------------------------------------------------------------------
def _conv_bn_relu(cin: int, cout: int, k: int, stride: int = 1, padding: int | None = None) -> nn.Sequential:
    pad = k // 2 if padding is None else padding
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=pad, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class AllCNNC(nn.Module):
    """All-CNN-C + BN (ICLR version, App. A.1): three stages of 3×3 convs (96, 96, 96/s2 | 192, 192,
    192/s2 | 192 valid 3×3, 192 1×1), global average pool, then the 1×1 classifier conv, which on a
    pooled vector is the objective's linear head. Springenberg's input/pool dropout is not used."""

    def __init__(self, in_channels: int = 3, width: int = 96):
        super().__init__()
        w1, w2 = width, 2 * width
        self.layer1 = nn.Sequential(_conv_bn_relu(in_channels, w1, 3), _conv_bn_relu(w1, w1, 3),
                                    _conv_bn_relu(w1, w1, 3, stride=2))
        self.layer2 = nn.Sequential(_conv_bn_relu(w1, w2, 3), _conv_bn_relu(w2, w2, 3),
                                    _conv_bn_relu(w2, w2, 3, stride=2))
        self.layer3 = nn.Sequential(_conv_bn_relu(w2, w2, 3, padding=0), _conv_bn_relu(w2, w2, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity()
        self.num_features = w2
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class WideBasic(nn.Module):
    """Pre-activation wide basic block (BN-ReLU-conv3×3-BN-ReLU-conv3×3 + shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = (nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
                         if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(o)
        o = self.conv1(o)
        o = self.conv2(self.relu(self.bn2(o)))
        return o + shortcut


class WideResNet(nn.Module):
    """WRN-depth-k: stem conv 16, three stages of (depth−4)/6 blocks with widths 16k, 32k, 64k,
    final BN-ReLU, global average pool. WRN-16-8 (ICLR Table A.2, CIFAR-100) → M = 512."""

    def __init__(self, depth: int = 16, widen: int = 8, in_channels: int = 3):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n+4, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        stages, cin = [], widths[0]
        for i, (w, s) in enumerate(zip(widths[1:], (1, 2, 2))):
            blocks = [WideBasic(cin if j == 0 else w, w, s if j == 0 else 1) for j in range(n)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity()
        self.num_features = cin
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.relu(self.bn(x))), 1))


# ------------------------------------------------------------------------------------------------
def _torchvision_resnet(name: str, in_channels: int = 3) -> tuple[nn.Module, int]:
    """torchvision's ResNet ``name`` (zero-init residual, no fc); conv1 rebuilt for other channel counts."""
    import torchvision.models

    net = getattr(torchvision.models, name)(weights=None, zero_init_residual=True)
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    m = net.fc.in_features
    net.fc = nn.Identity()
    return net, m


def _resnet50(in_channels: int = 3) -> tuple[nn.Module, int]:
    return _torchvision_resnet("resnet50", in_channels)


def _resnet18(in_channels: int = 3) -> tuple[nn.Module, int]:
    """torchvision's ResNet-18 (8 basic blocks), the same way as :func:`_resnet50`."""
    return _torchvision_resnet("resnet18", in_channels)


def _inception_v3(in_channels: int = 3) -> tuple[nn.Module, int]:
    from torchvision.models import inception_v3

    if in_channels != 3:
        raise ValueError("inception_v3 takes 3-channel input")
    net = inception_v3(weights=None, aux_logits=False, init_weights=True, transform_input=False)
    m = net.fc.in_features
    net.fc = nn.Identity()
    return net, m


def _mini(layers: tuple[int, ...]) -> Callable[..., tuple[nn.Module, int]]:
    def build(in_channels: int = 3, width: int = 8, layers: tuple[int, ...] | list[int] = layers,
              zero_init_residual: bool = True):
        net = MiniResNet(tuple(layers), width=width, in_channels=in_channels,
                         zero_init_residual=bool(zero_init_residual))
        return net, net.num_features
    return build


def _allcnn(in_channels: int = 3, width: int = 96) -> tuple[nn.Module, int]:
    net = AllCNNC(in_channels, width)
    return net, net.num_features


def _wrn(in_channels: int = 3, depth: int = 16, widen: int = 8) -> tuple[nn.Module, int]:
    net = WideResNet(depth, widen, in_channels)
    return net, net.num_features


ARCHS: dict[str, Callable[..., tuple[nn.Module, int]]] = {
    "resnet50": _resnet50,
    "resnet18": _resnet18,
    "inception_v3": _inception_v3,
    "allcnn_c": _allcnn,
    "wrn16_8": _wrn,
    "mini_resnet": _mini((3, 4, 6, 3)),
    "mini_resnet50": _mini((3, 4, 6, 3)),
    "mini_resnet26": _mini((2, 2, 2, 2)),
    "mini_resnet14": _mini((1, 1, 1, 1)),
}


def build_backbone(arch: str, **params: Any) -> tuple[nn.Module, int]:
    """Backbone with identity classifier and its feature dimension M."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    try:
        return ARCHS[arch](**params)
    except TypeError as e:  # unexpected keyword
        raise ValueError(f"bad parameters for arch {arch!r}: {e}") from None


class Network(nn.Module):
    """backbone → features (N, M) → head (objective-owned final layer) → logits (N, K)."""

    def __init__(self, backbone: nn.Module, head: Head, *, arch: str, objective: str,
                 config: dict[str, Any] | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.arch = arch
        self.objective = objective
        self.config = dict(config or {})

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def build_network(config: dict[str, Any]) -> Network:
    """Rebuild a network from a run config (keys arch, arch_params, objective, objective_params,
    num_classes, in_channels); this is how checkpoints are turned back into modules."""
    params = dict(config.get("arch_params") or {})
    params.setdefault("in_channels", int(config.get("in_channels", 3)))
    backbone, m = build_backbone(config["arch"], **params)
    head = make_objective(config["objective"], m, int(config["num_classes"]),
                          **dict(config.get("objective_params") or {}))
    return Network(backbone, head, arch=config["arch"], objective=config["objective"], config=config)
