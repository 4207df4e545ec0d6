"""Fashion-MNIST: idx reading (gz and raw), where the files are looked for, the one-line error naming the
three ways to get them, class-balanced fixed splits, and the datasets built from tiny idx files. No
download, no real data: every test writes its own idx files."""
from __future__ import annotations

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

from repsim.train import fashion as fm
from repsim.train.data import build_dataset


def _write_tiny(root, *, gz: bool, n_train_per_class: int = 12, n_test_per_class: int = 4, size: int = 28):
    """Four idx files with every class present; image pixel (0, 0) holds the class, (0, 1) the index."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    for split, per in (("train", n_train_per_class), ("t10k", n_test_per_class)):
        labels = rng.permutation(np.repeat(np.arange(10), per)).astype(np.uint8)
        images = rng.integers(0, 256, (len(labels), size, size), dtype=np.uint8)
        images[:, 0, 0] = labels
        images[:, 0, 1] = np.arange(len(labels)) % 256
        fm.write_idx(root / f"{split}-images-idx3-ubyte{ext}", images)
        fm.write_idx(root / f"{split}-labels-idx1-ubyte{ext}", labels)
    return root


@pytest.fixture(autouse=True)
def _no_cache():
    fm.load_arrays.cache_clear()
    yield
    fm.load_arrays.cache_clear()


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_roundtrip(tmp_path, gz):
    a = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    path = tmp_path / ("a.idx.gz" if gz else "a.idx")
    fm.write_idx(path, a)
    b = fm.read_idx(path)
    assert b.dtype == np.uint8 and b.shape == (2, 3, 5)
    np.testing.assert_array_equal(a, b)


def test_read_idx_rejects_garbage(tmp_path):
    (tmp_path / "x").write_bytes(b"\x01\x02\x03\x04hello")
    with pytest.raises(ValueError, match="not an idx file"):
        fm.read_idx(tmp_path / "x")
    fm.write_idx(tmp_path / "y", np.zeros((4, 4), np.uint8))
    (tmp_path / "y").write_bytes((tmp_path / "y").read_bytes()[:-3])
    with pytest.raises(ValueError, match="expected 16"):
        fm.read_idx(tmp_path / "y")


@pytest.mark.parametrize("gz", [True, False])
def test_locate_explicit_root_and_layouts(tmp_path, gz):
    _write_tiny(tmp_path / "FashionMNIST" / "raw", gz=gz)  # torchvision's layout under the root
    files = fm.locate(tmp_path, debian_dir=tmp_path / "nowhere")
    assert files["train", "images"].name == "train-images-idx3-ubyte" + (".gz" if gz else "")
    arrays = fm.load_arrays(str(tmp_path))
    x, y = arrays["train"]
    assert x.shape == (120, 28, 28) and x.dtype == np.uint8 and y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 0, 0], y)
    assert arrays["test"][0].shape == (40, 28, 28)


def test_root_comes_before_debian_dir(tmp_path):
    _write_tiny(tmp_path / "mine", gz=False)
    _write_tiny(tmp_path / "debian", gz=True)
    assert fm.locate(tmp_path / "mine", debian_dir=tmp_path / "debian")["test", "labels"].parent == tmp_path / "mine"
    # a root without the files falls through to the Debian location
    assert fm.locate(tmp_path / "empty", debian_dir=tmp_path / "debian")["test", "labels"].parent == tmp_path / "debian"


def test_missing_data_error_names_three_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    with pytest.raises(fm.FashionMNISTNotFound) as exc:
        fm.locate(tmp_path / "empty", debian_dir=tmp_path / "no-debian")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "--data-root" in msg and str(tmp_path / "empty") in msg  # the flag (and what was tried)
    assert "dataset-fashion-mnist" in msg and "apt-get install" in msg  # the Debian package
    assert "--download" in msg and "torchvision.datasets.FashionMNIST" in msg  # the downloader


def test_missing_data_through_build_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        build_dataset("fashion-source", "train", root=tmp_path)


def test_download_failure_is_reported_not_raised_raw(tmp_path, monkeypatch):
    """--download with no network: the same one-line error, with the downloader's failure appended."""
    import sys
    import types

    class Offline:
        def __init__(self, *a, **k):
            raise RuntimeError("no network")

    fake = types.ModuleType("torchvision.datasets")
    fake.FashionMNIST = Offline
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))  # no real import (slow)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake)
    with pytest.raises(fm.FashionMNISTNotFound, match="download failed: RuntimeError: no network"):
        fm.locate(tmp_path, download=True, debian_dir=tmp_path / "no-debian")


def test_parse_spec():
    assert fm.parse_spec("fashion") == tuple(range(10))
    assert fm.parse_spec("fashion-source") == fm.SOURCE_CLASSES
    assert fm.parse_spec("fashion-target") == fm.TARGET_CLASSES
    assert not set(fm.SOURCE_CLASSES) & set(fm.TARGET_CLASSES)
    assert fm.parse_spec("fashion:3,1") == (3, 1)
    assert fm.parse_spec("fashion-target@200") == fm.TARGET_CLASSES and fm.spec_train_per_class("fashion-target@200") == 200
    assert fm.spec_train_per_class("fashion-target") is None
    with pytest.raises(ValueError, match="suffix must be @N"):
        fm.spec_train_per_class("fashion-target@x")
    assert fm.parse_spec("digits") is None and fm.parse_spec("fashionmnist") is None
    for bad in ("fashion:1", "fashion:1,1", "fashion:1,10", "fashion:a,b"):
        with pytest.raises(ValueError, match="bad Fashion-MNIST spec"):
            fm.parse_spec(bad)


def test_split_indices_balanced_disjoint_fixed():
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 30))
    kw = dict(train_per_class=20, holdout_per_class=5)
    tr = fm.split_indices(labels, (0, 2, 4), "train", **kw)
    ho = fm.split_indices(labels, (0, 2, 4), "holdout", **kw)
    assert np.bincount(labels[tr], minlength=10)[[0, 2, 4]].tolist() == [20, 20, 20]
    assert np.bincount(labels[ho], minlength=10)[[0, 2, 4]].tolist() == [5, 5, 5]
    assert not set(tr) & set(ho) and np.all(np.diff(tr) > 0)
    np.testing.assert_array_equal(tr, fm.split_indices(labels, (0, 2, 4), "train", **kw))
    # a class's images do not depend on which other classes the spec holds
    only0 = fm.split_indices(labels, (0,), "train", **kw)
    np.testing.assert_array_equal(only0, tr[labels[tr] == 0])
    # 0 train per class: everything not held out; smaller train sets are nested in larger ones
    everything = fm.split_indices(labels, (0,), "train", train_per_class=0, holdout_per_class=5)
    assert len(everything) == 25 and set(only0) <= set(everything)
    with pytest.raises(ValueError, match="class 0 has 30 training images"):
        fm.split_indices(labels, (0,), "train", train_per_class=30, holdout_per_class=5)
    assert len(fm.split_indices(labels, (1, 3), "test", test_per_class=7)) == 14


def test_datasets_from_tiny_files(tmp_path):
    root = _write_tiny(tmp_path, gz=True)
    per = dict(train_per_class=8, holdout_per_class=2, test_per_class=3)
    src = build_dataset("fashion-source", "train", root=root, image_size=14, per_class=per)
    ho = build_dataset("fashion-source", "holdout", root=root, image_size=14, per_class=per)
    tgt = build_dataset("fashion-target", "test", root=root, image_size=14, per_class=per)
    assert (len(src), len(ho), len(tgt)) == (40, 10, 15)
    assert src.num_classes == 5 and src.classes[0] == "T-shirt/top" and tgt.classes[0] == "Trouser"
    assert src.name == "fashion-source" and tgt.split == "test"
    assert tgt.example_ids.min() >= fm.N_TRAIN_OFFICIAL  # test ids never collide with training ids
    assert not set(src.example_ids) & set(ho.example_ids)
    raw = fm.load_arrays(str(root))
    np.testing.assert_array_equal(np.array(fm.SOURCE_CLASSES)[src.targets], raw["train"][1][src.example_ids])
    x, y = src[0]
    assert x.shape == (1, 14, 14) and x.dtype == torch.float32 and isinstance(y, int)
    # 14 px = exact 2×2 means of the 28 px image, standardised
    img = raw["train"][0][src.example_ids[0]].astype(np.float32) / 255
    expect = (img.reshape(14, 2, 14, 2).mean(axis=(1, 3)) - fm.MEAN) / fm.STD
    np.testing.assert_allclose(x[0].numpy(), expect, rtol=1e-5, atol=1e-5)
    assert build_dataset("fashion", "test", root=root, image_size=28, per_class=per)[0][0].shape == (1, 28, 28)
    assert build_dataset("fashion", "test", root=root, image_size=10, per_class=per)[0][0].shape == (1, 10, 10)


def test_augmentation_train_split_only(tmp_path):
    root = _write_tiny(tmp_path, gz=False)
    per = dict(train_per_class=8, holdout_per_class=2)
    torch.manual_seed(0)
    aug = build_dataset("fashion-source", "train", root=root, augment="shift+flip", image_size=14, per_class=per)
    plain = build_dataset("fashion-source", "train", root=root, image_size=14, per_class=per)
    assert any(not torch.equal(aug[i][0], plain[i][0]) for i in range(20))
    assert "shift ±1 px" in aug.transform_desc and "flip" in aug.transform_desc
    test = build_dataset("fashion-source", "test", root=root, augment="shift+flip", image_size=14, per_class=per)
    assert "shift" not in test.transform_desc
    with pytest.raises(ValueError, match="shift, flip or shift\\+flip"):
        build_dataset("fashion-source", "train", root=root, augment="rotate", per_class=per)


def test_run_config_sizes_reach_the_dataset(tmp_path):
    from repsim.train.config import load_config
    from repsim.train.data import dataset_from_config

    root = _write_tiny(tmp_path, gz=True)
    cfg = load_config("fashion-softmax", [f'data.root="{root}"', "data.train_per_class=6",
                                          "data.holdout_per_class=3", "data.test_per_class=2"])
    assert len(dataset_from_config(cfg, "train")) == 30 and len(dataset_from_config(cfg, "holdout")) == 15
    assert len(dataset_from_config(cfg, "test", spec="fashion-target")) == 10
    assert len(dataset_from_config(cfg, "train", spec="fashion-target@8")) == 40  # the suffix wins
    assert len(dataset_from_config(cfg, "train", spec="fashion-target@100")) == 5 * 9  # at most: 12 − 3 held out
    assert dataset_from_config(cfg, "train", spec="fashion-target@8").name == "fashion-target@8"
