"""Datasets: digits splits (deterministic, disjoint, stratified), source/target classes, ImageFolder
with a deterministic holdout, synthetic, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

from repsim.train.data import SPLITS, build_dataset, load_digits_arrays


def test_digits_arrays_equal_sklearn():
    from sklearn.datasets import load_digits

    x, y = load_digits_arrays()
    d = load_digits()
    np.testing.assert_array_equal(x, d.images)
    np.testing.assert_array_equal(y, d.target)


def test_digits_splits_partition_and_are_deterministic():
    ids = {s: build_dataset("digits", s).example_ids for s in SPLITS}
    allids = np.concatenate(list(ids.values()))
    assert len(allids) == 1797 and len(np.unique(allids)) == 1797
    for s in SPLITS:
        assert np.all(np.diff(ids[s]) > 0)  # increasing original index: a fixed order
        np.testing.assert_array_equal(ids[s], build_dataset("digits", s).example_ids)
    test = build_dataset("digits", "test")
    counts = np.bincount(test.targets)
    assert counts.min() >= 43 and counts.max() <= 46  # 25 % of each class


def test_digits_source_and_target():
    _, labels = load_digits_arrays()
    src, tgt = build_dataset("digits-source", "train"), build_dataset("digits-target", "test")
    assert src.num_classes == tgt.num_classes == 5 and tgt.classes == ["5", "6", "7", "8", "9"]
    assert set(labels[src.example_ids]) == {0, 1, 2, 3, 4}
    np.testing.assert_array_equal(labels[tgt.example_ids], tgt.targets + 5)
    full = build_dataset("digits", "train")
    assert set(src.example_ids) <= set(full.example_ids)
    x, y = src[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)


def test_digits_augmentation_shifts_train_only():
    torch.manual_seed(0)
    aug = build_dataset("digits", "train", augment=True)
    plain = build_dataset("digits", "train")
    diffs = [not torch.equal(aug[i][0], plain[i][0]) for i in range(40)]
    assert any(diffs)
    assert "shift" in aug.transform_desc and "shift" not in build_dataset("digits", "test", augment=True).transform_desc


def test_synthetic_is_deterministic():
    a = build_dataset("synthetic", "train", image_size=16, num_classes=4, n=10)
    b = build_dataset("synthetic", "train", image_size=16, num_classes=4, n=10)
    assert torch.equal(a[3][0], b[3][0]) and a[3][0].shape == (3, 16, 16) and a.num_classes == 4
    assert not torch.equal(a[3][0], build_dataset("synthetic", "test", image_size=16, n=10)[3][0])


def test_image_folder_holdout(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c in ("cat", "dog"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(d / f"{i}.png")
    kw = dict(image_size=16, holdout_size=3)
    tr = build_dataset(str(tmp_path), "train", augment=True, **kw)
    ho = build_dataset(str(tmp_path), "holdout", **kw)
    te = build_dataset(str(tmp_path), "test", **kw)
    assert (len(tr), len(ho), len(te)) == (9, 3, 4) and tr.classes == ["cat", "dog"]
    assert not set(tr.example_ids) & set(ho.example_ids)
    np.testing.assert_array_equal(ho.example_ids, build_dataset(str(tmp_path), "holdout", **kw).example_ids)
    assert tr[0][0].shape == (3, 16, 16) and te[0][0].shape == (3, 16, 16)
    assert "RandomResizedCrop(16, scale=(0.1, 1)" in tr.transform_desc and "CenterCrop(16)" in te.transform_desc


def test_bad_specs():
    with pytest.raises(ValueError, match="does not exist"):
        build_dataset("/no/such/dir", "train")
    with pytest.raises(ValueError, match="unknown split"):
        build_dataset("digits", "val")
    with pytest.raises(ValueError, match="needs --data ROOT"):
        build_dataset("cifar10", "train")


def test_a_holdout_size_the_dataset_would_not_take_is_refused():
    """digits, Fashion-MNIST and synthetic have fixed holdout splits: a holdout_size > 0 asked of them
    (finetune --holdout-size, --set data.holdout_size) was ignored without a word; now it is refused,
    saying what the holdout is. 0 or None (the default) asks nothing and builds as before."""
    from repsim.train.data import FixedHoldoutError

    for spec, how, splits in (("digits-target", "10 % of each class", ("holdout", "train", "train+holdout")),
                              ("synthetic", "data.synthetic_n", ("holdout", "train")),
                              ("fashion", "data.holdout_per_class", ("holdout", "train", "train+holdout"))):
        for split in splits:
            with pytest.raises(FixedHoldoutError, match=f"holdout split of '{spec}' is fixed: .*{how}"):
                build_dataset(spec, split, holdout_size=50)
    for hold in (None, 0):
        assert len(build_dataset("digits", "holdout", holdout_size=hold)) == len(build_dataset("digits", "holdout"))


def test_dataset_from_config_uses_the_run_settings():
    from repsim.train.config import load_config
    from repsim.train.data import dataset_from_config

    cfg = load_config("digits-softmax")
    ds = dataset_from_config(cfg, "test")
    assert ds.name == "digits-source" and ds.transform_desc == "standardise"
    tgt = dataset_from_config(cfg, "test", spec="digits-target")
    np.testing.assert_array_equal(tgt.example_ids, build_dataset("digits-target", "test").example_ids)
    syn = dataset_from_config(load_config(None, ["data.spec=\"synthetic\"", "data.image_size=12", "in_channels=1"]), "train")
    assert syn[0][0].shape == (1, 12, 12)


class _FakeCIFAR10:
    """A stand-in for torchvision's CIFAR10 (nothing downloaded): 32x32 RGB images."""

    def __init__(self, root, train=True, download=False):
        n = 6000 if train else 50
        self.targets = list(np.arange(n) % 10)
        self.classes = [str(i) for i in range(10)]

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        from PIL import Image

        return Image.fromarray(np.full((32, 32, 3), i % 255, np.uint8)), self.targets[i]


@pytest.fixture
def fake_cifar(monkeypatch):
    import torchvision.datasets as tvd

    monkeypatch.setattr(tvd, "CIFAR10", _FakeCIFAR10)


def test_cifar_under_an_imagenet_network_is_resized_in_every_split(fake_cifar):
    # App. A.2/A.3: CIFAR goes into an ImageNet network at 224, at evaluation (probe features, the
    # fine-tuning holdout and test) as in training -- it was fed at 32x32 with CIFAR's normalisation
    from repsim.train.config import load_config
    from repsim.train.data import dataset_from_config

    cfg = load_config("finetune-resnet50", ['data.spec="cifar10"', 'data.root="/nonexistent"',
                                            "data.holdout_size=500"])
    for split, aug in (("train", cfg["data"]["augment"]), ("holdout", False), ("test", False)):
        ds = dataset_from_config(cfg, split, augment=aug)
        assert ds[0][0].shape == (3, 224, 224), (split, ds.transform_desc)
    assert dataset_from_config(cfg, "test").transform_desc == "Resize(256) + CenterCrop(224); normalise"
    # probe features of CIFAR through an ImageNet run: A.2's resize-224 + centre-crop-224
    run = load_config("resnet50-imagenet-softmax", ['data.root="/nonexistent"'])
    te = dataset_from_config(run, "test", spec="cifar10")
    assert te[0][0].shape == (3, 224, 224) and te.transform_desc == "Resize(224) + CenterCrop(224); normalise"
    # a CIFAR run at its native 32x32 is unchanged: no resize, CIFAR normalisation, pad-4 crops
    own = build_dataset("cifar10", "test", root="/nonexistent", image_size=32)
    assert own[0][0].shape == (3, 32, 32) and own.transform_desc == "none; normalise"
    assert torch.allclose(own[0][0], (torch.zeros(3, 32, 32) - 0.5) / 0.25)
    assert "RandomCrop(32, pad 4)" in build_dataset("cifar10", "train", root="/x", image_size=32,
                                                    augment=True).transform_desc


def test_transfer_extraction_of_cifar_keeps_the_whole_training_set(fake_cifar):
    # A.2: the probe's own validation split comes from the training set, then it refits on all of it;
    # the 5,000-image holdout of a CIFAR run is not taken out of a transfer task's training store
    from repsim.train.config import load_config
    from repsim.train.data import dataset_from_config

    run = load_config("resnet50-imagenet-softmax", ['data.root="/nonexistent"'])
    assert len(dataset_from_config(run, "train", spec="cifar10")) == 6000
    assert len(build_dataset("cifar10", "train", root="/nonexistent")) == 1000  # a run's own: 5,000 held out
    cifar_run = load_config("cifar10-allcnn-softmax", ['data.root="/nonexistent"'])
    assert len(dataset_from_config(cifar_run, "train")) == 1000  # the run's own dataset: its holdout


def _image_tree(root, splits, size=(300, 400)):
    from PIL import Image

    for split, n in splits:
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.zeros((*size, 3), np.uint8)).save(root / split / c / f"{split}{i}.png")


def test_transfer_extraction_uses_the_probe_transform_of_a2(tmp_path):
    from repsim.train.config import load_config
    from repsim.train.data import dataset_from_config

    _image_tree(tmp_path / "t", (("train", 1), ("test", 1)))
    run = load_config("resnet50-imagenet-softmax")
    for split in ("train", "test"):
        assert dataset_from_config(run, split, spec=str(tmp_path / "t")).transform_desc == \
            "Resize(224) + CenterCrop(224); normalise"
    # the run's own dataset keeps the run's evaluation transform
    own = load_config("resnet50-imagenet-softmax", [f'data.spec="{tmp_path / "t"}"'])
    assert dataset_from_config(own, "test").transform_desc == "Resize(256) + CenterCrop(224); normalise"


def test_image_folder_with_val_and_test_is_tested_on_test(tmp_path):
    _image_tree(tmp_path, (("train", 2), ("val", 1), ("test", 3)), size=(20, 24))
    te = build_dataset(str(tmp_path), "test", image_size=16)
    assert len(te) == 6 and all("/test/" in p for p, _ in te.base.samples)
    import shutil

    shutil.rmtree(tmp_path / "test")  # the ImageNet layout: val/ is the test split
    assert len(build_dataset(str(tmp_path), "test", image_size=16)) == 2


def test_threads_share_one_image_stack():
    """Extraction jobs run as threads (`repsim extract --job-mode threads`) and ask one dataset for its
    image stack at once: one of them builds it, the others wait and get the same tensor (each built its
    own before: 4 threads, 4 stacks of the split). The build waits until all four have asked."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    ds = build_dataset("synthetic", "test", image_size=8, n=64)
    entered, calls = [], []
    all_in = threading.Event()
    real = ds._loader

    def loader(base, i):
        if not calls:
            all_in.wait(timeout=30)  # every thread is inside image_tensor before the first image is made
        calls.append(i)
        return real(base, i)

    ds._loader = loader

    def ask(_):
        entered.append(1)
        if len(entered) == 4:
            all_in.set()
        return ds.image_tensor()

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, range(4)))
    assert all(g is got[0] for g in got) and len(calls) == len(ds) + 1  # (the first image, then the stack)
    assert torch.equal(got[0][0][5], ds[5][0])
