"""The in-memory source path of repsim/extract/ (repsim/extract/memory.py): no DataLoader, the same store bytes.

A dataset whose images are one tensor (``ImageTensor``, a float ``TensorDataset``, ``--data x.npz``)
is sliced directly; the stores must equal, byte for byte, those written through a DataLoader from the
same examples, and the range check, refusals and resume must behave as on the DataLoader path.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")
pytest.importorskip("repsim.train.models")

from repsim.extract import ExtractError, extract_store  # noqa: E402
from repsim.extract.memory import ImageTensor, MemoryFeed  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402
from repsim.train.models import build_network  # noqa: E402

FAST = dict(workers=0, progress=False, device="cpu", batch_size=16, chunk_rows=32)


def _net(in_channels: int = 3) -> torch.nn.Module:
    """The mini ResNet of repsim/train/ (16 bottlenecks, a head), narrow: a conv net, so channels-last."""
    torch.manual_seed(0)
    cfg = {"arch": "mini_resnet", "arch_params": {"width": 4, "layers": [3, 4, 6, 3]}, "in_channels": in_channels,
           "objective": "softmax", "objective_params": {}, "num_classes": 10, "seed": 0}
    return build_network(cfg).eval()


class Opaque(torch.utils.data.Dataset):
    """``dataset`` item by item, its images out of sight: forces the DataLoader path."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.name, self.split = dataset.name, dataset.split
        self.transform_desc = dataset.transform_desc

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


def _arrays(path) -> dict[str, bytes]:
    g = zarr.open_group(str(path), mode="r")
    out = {name: np.asarray(g[name][...]).tobytes() for name in ("example_ids", "labels", "logits", "written")}
    out.update({f"layers/{k}": np.asarray(g[f"layers/{k}"][...]).tobytes() for k in g["layers"].array_keys()})
    return out


@pytest.fixture()
def no_dataloader(monkeypatch):
    """Extraction must not build a DataLoader (the in-memory path was taken)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a DataLoader was built for an in-memory source")

    monkeypatch.setattr(torch.utils.data, "DataLoader", refuse)


def _uint8_nhwc(n: int = 100, size: int = 12) -> ImageTensor:
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g)
    return ImageTensor(images, np.arange(n) % 10, layout="NHWC", name="noise", split="test")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("order", ["shuffled", "dataset"])
def test_uint8_nhwc_source_writes_the_dataloaders_bytes(tmp_path, monkeypatch, dtype, order):
    net, data = _net(), _uint8_nhwc()
    kw = dict(layers="block*,pool,logits", spatial="pool2", dtype=dtype, order=order, **FAST)
    ref = extract_store(net, Opaque(data), tmp_path / "loader.zarr", **kw)
    with monkeypatch.context() as m:
        m.setattr(torch.utils.data, "DataLoader", lambda *a, **k: pytest.fail("DataLoader built"))
        fast = extract_store(net, data, tmp_path / "memory.zarr", **kw)
    assert fast.attrs["dataset"] == ref.attrs["dataset"]
    assert "in-memory uint8 NHWC / 255; normalise" in fast.attrs["dataset"]["transform"]
    assert fast.attrs["extraction"]["memory_format"] == "channels_last"
    a, b = _arrays(tmp_path / "loader.zarr"), _arrays(tmp_path / "memory.zarr")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_float_tensor_dataset_and_npz_take_the_fast_path(tmp_path, no_dataloader):
    data = _uint8_nhwc(48)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.as_tensor(data.labels)
    net = _net()
    a = extract_store(net, torch.utils.data.TensorDataset(x, y), tmp_path / "td.zarr", layers="pool,logits", **FAST)
    np.testing.assert_array_equal(np.asarray(a.labels), data.labels[np.asarray(a.example_ids)])
    np.savez(tmp_path / "noise.npz", images=data.images.numpy(), labels=data.labels)
    b = extract_store(net, str(tmp_path / "noise.npz"), tmp_path / "npz.zarr", layers="pool,logits", **FAST)
    assert b.attrs["dataset"]["name"] == "noise.npz"
    for name in ("logits", "layers/pool", "labels", "example_ids"):
        assert _arrays(tmp_path / "td.zarr")[name] == _arrays(tmp_path / "npz.zarr")[name], name


def test_feed_slices_in_store_row_order():
    data = _uint8_nhwc(10, size=2)
    rows = np.array([3, 1, 4, 0, 5, 9, 2, 6, 8, 7])
    feed = MemoryFeed(data, rows, [(0, 4), (4, 8), (8, 10)], torch.device("cpu"), channels_last=True)
    got = list(feed)
    assert [len(y) for _, y in got] == [4, 4, 2]
    x = torch.cat([b for b, _ in got])
    assert x.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(x, torch.stack([data[int(i)][0] for i in rows]), rtol=0, atol=0)
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), data.labels[rows])


def test_nan_rows_are_refused_naming_layer_and_rows_then_resume_matches(tmp_path, no_dataloader):
    """The range check runs once per chunk in the writer thread (no sync per batch), still naming the
    layer and the chunk's rows; the chunks before it stay written, and a rerun resumes to the bytes of
    an uninterrupted run."""
    data = _uint8_nhwc(100)
    x = torch.stack([data[i][0] for i in range(len(data))])
    bad = x.clone()
    bad[70, 0, 3, 3] = float("nan")  # row 70 (dataset order): chunk 2 = examples 64..95
    labels = torch.as_tensor(data.labels)
    net, kw = _net(), dict(layers="block1,block16,pool,logits", order="dataset", write_threads=1,
                           meta={"dataset": {"name": "noise"}}, **FAST)
    out = tmp_path / "resumed.zarr"
    with pytest.raises(ExtractError, match=r"layer 'block1' has non-finite values \(NaN/inf\) in examples 64\.\.95"):
        extract_store(net, torch.utils.data.TensorDataset(bad, labels), out, **kw)
    written = zarr.open_group(str(out))["written"][...]
    assert not written[2] and not open_store(out, allow_incomplete=True).complete
    extract_store(net, torch.utils.data.TensorDataset(x, labels), out, **kw)
    whole = extract_store(net, torch.utils.data.TensorDataset(x, labels), tmp_path / "whole.zarr", **kw)
    assert whole.complete and open_store(out).complete
    assert _arrays(out) == _arrays(tmp_path / "whole.zarr")


def test_float16_overflow_on_the_fast_path_names_the_layer(tmp_path, no_dataloader):
    net = _net()
    with torch.no_grad():
        net.backbone.layer2[1].bn3.bias.fill_(1e6)  # block5 = layer2.1 exceeds float16's range
    with pytest.raises(ExtractError, match=r"layer 'block5' overflows float16 .* in examples 0\.\.31.*--dtype float32"):
        extract_store(net, _uint8_nhwc(64), tmp_path / "o.zarr", order="dataset", **FAST)


def test_image_tensor_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="must be 4-D"):
        ImageTensor(torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="uint8 or floating"):
        ImageTensor(torch.zeros(2, 3, 4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 images but labels"):
        ImageTensor(torch.zeros(2, 3, 4, 4), np.zeros(3))
    with pytest.raises(ValueError, match="3 values for 1 channels"):
        ImageTensor(torch.zeros(2, 1, 4, 4), mean=(0, 0, 0), std=(1, 1, 1))


def test_digits_and_synthetic_splits_take_the_in_memory_path(tmp_path, monkeypatch):
    """repsim.train.data's digits and synthetic splits hand extraction their images as one tensor
    (SplitDataset.image_tensor): the stores equal the DataLoader path's, bit for bit."""
    from repsim.train.data import SplitDataset, build_dataset

    from repsim.extract import extract_store
    from repsim.extract.memory import as_image_tensor

    for spec, kw in (("digits", {}), ("synthetic", {"image_size": 8, "n": 40})):
        ds = build_dataset(spec, "test", **kw)
        got = as_image_tensor(ds)
        assert got is not None and len(got) == len(ds)
        for i in (0, len(ds) - 1):
            assert torch.equal(got[i][0], ds[i][0]) and int(got[i][1]) == ds[i][1]
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10))
    torch.manual_seed(0)
    extract_store(model, "digits", tmp_path / "fast.zarr", split="test", batch_size=64, progress=False)
    monkeypatch.setattr(SplitDataset, "image_tensor", lambda self, max_bytes=0: None)  # the DataLoader path
    extract_store(model, "digits", tmp_path / "slow.zarr", split="test", batch_size=64, progress=False)
    a, b = open_store(tmp_path / "fast.zarr"), open_store(tmp_path / "slow.zarr")
    assert a.layers == b.layers
    for layer in a.layers:
        np.testing.assert_array_equal(np.asarray(a.layer(layer)), np.asarray(b.layer(layer)))
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))


def test_an_adapted_split_keeps_its_per_item_adaptation():
    """A digits split adapted to a 3-channel model (repsim/extract/adapt.py forwards attributes to the split)
    is not taken for an in-memory tensor: its per-item channel repeat must run."""
    from repsim.train.data import build_dataset

    from repsim.extract.adapt import AdaptedDataset, Chain, ChannelRepeat
    from repsim.extract.memory import as_image_tensor

    ds = build_dataset("digits", "test")
    adapted = AdaptedDataset(ds, Chain(ChannelRepeat(3)), "repeat")
    assert adapted[0][0].shape[0] == 3
    assert as_image_tensor(ds) is not None and as_image_tensor(adapted) is None


def test_a_split_stacks_its_images_once():
    from repsim.train.data import build_dataset

    ds = build_dataset("synthetic", "test", image_size=8, n=16)
    a, b = ds.image_tensor(), ds.image_tensor()
    assert a[0] is b[0] and a[0].shape == (16, 3, 8, 8)
