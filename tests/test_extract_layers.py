"""Layer registry and hook capture against hand-written forward passes (real torchvision models)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from repsim.extract import layer_modules, select_layers  # noqa: E402
from repsim.extract.capture import Capture, Spatial  # noqa: E402


def _resnet50_manual(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """ResNet-50 forward written out with out-of-place ops: every bottleneck's output after the
    residual add and the final ReLU, the global-average-pooled features and the logits."""
    out = {}
    x = m.maxpool(F.relu(m.bn1(m.conv1(x))))
    k = 0
    for stage in (m.layer1, m.layer2, m.layer3, m.layer4):
        for b in stage:
            h = F.relu(b.bn1(b.conv1(x)))
            h = F.relu(b.bn2(b.conv2(h)))
            h = b.bn3(b.conv3(h))
            identity = b.downsample(x) if b.downsample is not None else x
            x = F.relu(h + identity)
            k += 1
            out[f"block{k}"] = x
    out["pool"] = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
    out["logits"] = m.fc(out["pool"])
    return out


def _capture(model, x, names=None, spatial="flatten", dtype=torch.float32):
    modules = layer_modules(model)
    if names is not None:
        modules = {k: modules[k] for k in names}
    with Capture(model, modules, Spatial.parse(spatial), dtype) as cap, torch.inference_mode():
        cap.begin_batch()
        logits = model(x)
        cap.end_batch()
    return cap.probe, logits


@pytest.fixture(scope="module")
def resnet50():
    torch.manual_seed(0)
    m = torchvision.models.resnet50().eval()
    # non-trivial BN statistics so that blocks differ from their inputs in scale
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.1, 0.1)
            mod.running_var.uniform_(0.5, 1.5)
    return m


def test_resnet50_registry_names():
    names = list(layer_modules(torchvision.models.resnet50()))
    assert names == [f"block{i}" for i in range(1, 17)] + ["pool", "logits"]
    assert layer_modules(torchvision.models.resnet50())["block4"] == "layer2.0"


def test_resnet50_capture_equals_manual_forward(resnet50):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    got, logits = _capture(resnet50, x)
    with torch.inference_mode():
        want = _resnet50_manual(resnet50, x)
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name
        assert got[name].min() >= 0 or name == "logits"  # post-ReLU blocks and pool
    assert torch.equal(logits, want["logits"])


def test_capture_copies_before_later_inplace_ops():
    """A block output modified in place afterwards is stored as the block returned it."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            x = self.layer1(x)
            x.mul_(-1.0).relu_()  # overwrites layer1's output tensor in place
            return self.fc(torch.flatten(self.avgpool(x), 1))

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(3, 3, 5, 5)
    got, _ = _capture(net, x)
    with torch.inference_mode():
        conv = net.layer1[0](x)
        want = conv.relu()
    # block1 = the conv, whose output the in-place ReLU (block2) overwrites right after
    assert torch.equal(got["block1"], conv) and got["block1"].min() < 0
    assert torch.equal(got["block2"], want) and got["block2"].sum() > 0


def test_spatial_reductions(resnet50):
    torch.manual_seed(2)
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        want = _resnet50_manual(resnet50, x)["block3"]
    mean, _ = _capture(resnet50, x, ["block3", "logits"], "mean")
    assert mean["block3"].shape == (1, 256)
    torch.testing.assert_close(mean["block3"], want.mean(dim=(2, 3)))
    pooled, _ = _capture(resnet50, x, ["block3", "logits"], "pool2")
    assert pooled["block3"].shape == (1, 256, 2, 2)
    h = want.shape[2] // 2
    torch.testing.assert_close(pooled["block3"][0, :, 0, 1], want[0, :, :h, h:].mean(dim=(1, 2)))
    with pytest.raises(ValueError, match="spatial"):
        Spatial.parse("pool0")
    with pytest.raises(ValueError, match="spatial"):
        Spatial.parse("max")


def test_inception_v3_blocks():
    m = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False).eval()
    names = list(layer_modules(m))
    assert names[:3] == ["Mixed_5b", "Mixed_5c", "Mixed_5d"] and names[-3:] == ["Mixed_7c", "pool", "logits"]
    assert len(names) == 13
    got, logits = _capture(m, torch.randn(1, 3, 80, 80), spatial="mean")
    assert got["Mixed_7c"].shape == (1, 2048) and got["pool"].shape == (1, 2048)
    torch.testing.assert_close(got["Mixed_7c"], got["pool"])  # pool is the global mean of Mixed_7c
    assert torch.equal(got["logits"], logits)


def test_generic_resnet_style_and_declared_blocks():
    class WRNLike(nn.Module):  # three stages, as a WRN-16-8 for CIFAR
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Identity(), nn.Identity())
            self.layer2 = nn.Sequential(nn.Identity(), nn.Identity())
            self.layer3 = nn.Sequential(nn.Identity(), nn.Identity())
            self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(3, 2)

    assert list(layer_modules(WRNLike())) == [f"block{i}" for i in range(1, 7)] + ["pool", "logits"]

    class Backbone(nn.Module):  # an All-CNN-style backbone that lists its blocks
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1))

    from repsim.train.models import Network as TrainNetwork

    def Network(backbone):  # a train Network: its backbone(x) is the penultimate (N, M)
        return TrainNetwork(backbone, nn.Linear(4, 2), arch="test", objective="softmax")

    assert layer_modules(Network(Backbone())) == {
        "block1": "backbone.blocks.0", "block2": "backbone.blocks.1", "block3": "backbone.blocks.2",
        "pool": "backbone", "logits": "head",
    }
    bb = Backbone()
    bb.extract_layers = {"conv_a": "blocks.0", "conv_b": "blocks.2"}
    assert list(layer_modules(Network(bb))) == ["conv_a", "conv_b", "pool", "logits"]
    # no blocks by any rule: the penultimate and final layers remain
    assert layer_modules(Network(nn.Linear(3, 4))) == {"pool": "backbone", "logits": "head"}


def test_lookalikes_of_the_classic_models_take_the_generic_rule(tmp_path):
    """`.backbone` + `.head`, or `.avgpool` + `.fc`, on a model that is neither a train Network nor a
    torchvision classifier: its backbone may return a map (pooled in forward), or a layer may sit between
    avgpool and fc; pool was the backbone's flattened map, or avgpool's output, with the head stored beside
    it, silently. Now pool is the input of the classifier, checked against the logits."""
    from repsim.extract import extract_store
    from repsim.extract.layers import is_classic

    class MapBackbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return F.relu(self.conv(x))  # (N, 8, H, W): not yet pooled

    class BackboneHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = MapBackbone(), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.backbone(x).mean(dim=(2, 3)))

    class Embedded(nn.Module):  # avgpool, then an embedding, then fc
        def __init__(self):
            super().__init__()
            self.conv, self.avgpool = nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1)
            self.embed, self.fc = nn.Linear(8, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(self.embed(torch.flatten(self.avgpool(self.conv(x)), 1)))

    torch.manual_seed(0)
    x = torch.randn(12, 3, 6, 6)
    data = torch.utils.data.TensorDataset(x, torch.arange(12) % 3)
    for model, penultimate in ((BackboneHead(), lambda m: m.backbone(x).mean(dim=(2, 3))),
                               (Embedded(), lambda m: m.embed(torch.flatten(m.avgpool(m.conv(x)), 1)))):
        model.eval()
        assert not is_classic(model) and layer_modules(model)["pool"] == ("head" if isinstance(model, BackboneHead) else "fc") + ":input"
        store = extract_store(model, data, str(tmp_path / f"{type(model).__name__}.zarr"), layers="pool,logits",
                              dtype="float32", batch_size=4, workers=0, order="dataset", progress=False)
        with torch.no_grad():
            want = penultimate(model)
        np.testing.assert_allclose(np.asarray(store.layer("pool")), want.numpy(), rtol=1e-5, atol=1e-6)
        W, b = store.head  # the classifier's weights map the stored pool to the stored logits
        np.testing.assert_allclose(np.asarray(store.layer("pool")) @ np.asarray(W).T + np.asarray(b),
                                   np.asarray(store.logits), rtol=1e-4, atol=1e-5)
    assert is_classic(torchvision.models.resnet18(num_classes=3))


def test_a_model_with_several_classifier_heads_has_logits_and_no_pool():
    """timm's distilled DeiT: get_classifier() is (head, head_dist) on different tokens, so no layer is
    the penultimate one; pool used to be the model's output (the averaged logits) and the store said it
    had no logits."""
    timm = pytest.importorskip("timm")
    from repsim.extract.layers import describe_pool

    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    taps = layer_modules(model)
    assert "pool" not in taps and taps["logits"] == "" and list(taps)[:2] == ["block1", "block2"]
    assert describe_pool(model).startswith("no pool: the model has several classifier heads")


def test_select_layers():
    reg = layer_modules(torchvision.models.resnet50())
    assert list(select_layers(reg, "pool,block2")) == ["block2", "pool"]  # registry order
    assert list(select_layers(reg, ["block1?"])) == [f"block1{i}" for i in range(7)]
    assert select_layers(reg, None) == reg
    with pytest.raises(ValueError, match="unknown layer 'block17'.*block16"):
        select_layers(reg, "block17")
