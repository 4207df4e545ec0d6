"""Architectures: structure the rest of the project relies on, and one SGD step for every
objective × model on CPU (tiny inputs: ResNet-50 at 32 px, Inception v3 at 75 px, batch 2)."""
from __future__ import annotations

import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra
from torch import nn

from repsim.train.loop import _TrainStep, param_groups
from repsim.train.models import ARCHS, Network, build_backbone, build_network
from repsim.train.objectives import OBJECTIVES, make_objective

# arch -> (build params, input channels, input size)
SHAPES = {
    "resnet50": ({}, 3, 32),
    "resnet18": ({}, 3, 32),
    "inception_v3": ({}, 3, 75),
    "allcnn_c": ({}, 3, 32),
    "wrn16_8": ({}, 3, 32),
    "mini_resnet": ({"width": 4, "in_channels": 1}, 1, 8),
}


@pytest.fixture(scope="module")
def backbones():
    torch.manual_seed(0)
    return {a: build_backbone(a, **p) for a, (p, _, _) in SHAPES.items()}


def _blocks(backbone):
    return [b for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(backbone, name)
            for b in getattr(backbone, name)]


def test_resnet50_is_torchvision_v15_with_zero_init_residual(backbones):
    import torchvision

    net, m = backbones["resnet50"]
    assert m == 2048 and isinstance(net, torchvision.models.ResNet) and isinstance(net.fc, nn.Identity)
    blocks = _blocks(net)
    assert len(blocks) == 16
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in blocks)  # last BN γ = 0 (Goyal et al.)
    assert all(torch.all(b.bn1.weight == 1) for b in blocks)
    # v1.5: the stride sits in the 3×3 conv of the first block of a stage
    assert net.layer2[0].conv2.stride == (2, 2) and net.layer2[0].conv1.stride == (1, 1)


def test_resnet18_is_torchvision_with_zero_init_residual(backbones):
    import torchvision

    net, m = backbones["resnet18"]
    assert m == 512 and isinstance(net, torchvision.models.ResNet) and isinstance(net.fc, nn.Identity)
    blocks = _blocks(net)
    assert len(blocks) == 8 and all(torch.count_nonzero(b.bn2.weight) == 0 for b in blocks)
    gray, _ = build_backbone("resnet18", in_channels=1)
    assert gray.conv1.in_channels == 1 and gray(torch.randn(2, 1, 32, 32)).shape == (2, 512)


def test_mini_resnet_has_resnet50_block_structure():
    net, m = build_backbone("mini_resnet", width=8, in_channels=1)
    blocks = _blocks(net)
    assert len(blocks) == 16 and [len(getattr(net, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert m == 8 * 8 * 4 and isinstance(net.fc, nn.Identity) and hasattr(net, "avgpool")
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in blocks)
    # same attribute names as torchvision's Bottleneck
    from torchvision.models.resnet import Bottleneck as TV

    tv = {n for n, _ in TV(32, 8).named_children()}
    assert tv == {n for n, _ in blocks[1].named_children()}
    assert net(torch.randn(3, 1, 8, 8)).shape == (3, m)
    assert build_backbone("mini_resnet14", width=4)[0].layer3.__len__() == 1
    # zero_init_residual=false (the Fashion-MNIST profile): every block's last BN starts at γ = 1, like the others
    plain, _ = build_backbone("mini_resnet", width=8, in_channels=1, zero_init_residual=False)
    assert all(torch.all(b.bn3.weight == 1) for b in _blocks(plain))
    with pytest.raises(ValueError, match="bad parameters"):
        build_backbone("mini_resnet", zero_gamma=False)


def test_wrn16_8_and_allcnn_shapes(backbones):
    wrn, m = backbones["wrn16_8"]
    assert m == 512 and [len(wrn.layer1), len(wrn.layer2), len(wrn.layer3)] == [2, 2, 2]
    assert wrn.layer1[0].conv1.out_channels == 128  # 16 × 8
    cnn, m = backbones["allcnn_c"]
    assert m == 192 and sum(isinstance(x, nn.BatchNorm2d) for x in cnn.modules()) == 8


def test_unknown_arch_and_bad_params():
    with pytest.raises(ValueError, match="unknown arch"):
        build_backbone("resnet51")
    with pytest.raises(ValueError, match="bad parameters"):
        build_backbone("mini_resnet", depth=3)


def test_network_api():
    cfg = {"arch": "mini_resnet", "arch_params": {"width": 4}, "in_channels": 1, "objective": "sigmoid",
           "objective_params": {}, "num_classes": 5}
    net = build_network(cfg)
    assert isinstance(net, Network) and net.arch == "mini_resnet" and net.objective == "sigmoid"
    x = torch.randn(4, 1, 8, 8)
    net.eval()
    feats = net.features(x)
    assert feats.shape == (4, 128)
    assert torch.allclose(net(x), feats @ net.head.weight.T + net.head.bias)
    assert net.head.weight.shape == (5, 128) and net.head.bias.shape == (5,)


def test_param_groups_exclude_bn_unless_asked():
    net = build_network({"arch": "mini_resnet14", "arch_params": {"width": 4}, "objective": "softmax",
                         "num_classes": 3})
    bn = {id(p) for m in net.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    g = param_groups(net, 1e-4, wd_norm=False)
    assert {id(p) for p in g[1]["params"]} == bn and g[1]["weight_decay"] == 0.0
    assert not bn & {id(p) for p in g[0]["params"]} and id(net.head.weight) in {id(p) for p in g[0]["params"]}
    assert len(param_groups(net, 1e-4, wd_norm=True)) == 1


@pytest.mark.parametrize("arch", list(SHAPES))
def test_one_training_step_every_objective(arch, backbones):
    backbone, m = backbones[arch]
    _, c, size = SHAPES[arch]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, c, size, size, generator=g)
    y = torch.tensor([0, 2])
    state = {k: v.clone() for k, v in backbone.state_dict().items()}
    for name in OBJECTIVES:
        backbone.load_state_dict(state)
        torch.manual_seed(2)
        net = Network(backbone, make_objective(name, m, 3), arch=arch, objective=name).train()
        step = _TrainStep(net)
        opt = torch.optim.SGD(param_groups(net, 8e-5, False), lr=0.01, momentum=0.9, nesterov=True)
        w0 = net.head.weight.detach().clone()
        loss, logits = step(x, y)
        assert logits.shape == (2, 3) and torch.isfinite(loss), (arch, name)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads), (arch, name)
        opt.step()
        assert not torch.equal(w0, net.head.weight), (arch, name)
    backbone.load_state_dict(state)


def test_archs_registry_is_complete():
    assert set(SHAPES) <= set(ARCHS)
