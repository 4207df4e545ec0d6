"""Training options beyond App. A.1: Mixup and AutoAugment (App. C.4), --keep-every (Figs. D.2, E.4),
the train+holdout retraining split, stop_epoch, mean per-class accuracy, the recipe variant."""
from __future__ import annotations

import math

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra
import torch.nn.functional as F

from repsim.train.augment import FloatAutoAugment, mixup_batch, variant_of
from repsim.train.checkpoint import load_checkpoint
from repsim.train.config import load_config
from repsim.train.data import DIGITS_RANGE, build_dataset
from repsim.train.loop import train_run
from repsim.train.objectives import make_objective

SMALL = ['arch="mini_resnet14"', "arch_params.width=4", "batch_size=32", "optim.ref_batch=32",
         "schedule.warmup_epochs=1", "deterministic=true"]


# -- Mixup -----------------------------------------------------------------------------------------
def _soft_reference(name: str, head, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Batch-mean loss of each objective at a soft target t (rows sum to 1), by the paper's equations."""
    K = z.shape[1]
    if name.startswith("label_smoothing"):
        a = head.alpha
        per = -(((1 - a) * t + a / K) * F.log_softmax(z, 1)).sum(1) / (1 - a)
    elif name in ("softmax", "dropout", "logit_penalty", "extra_l2"):
        per = -(t * F.log_softmax(z, 1)).sum(1)
    elif name == "sigmoid":
        per = (-t * z + torch.log1p(torch.exp(z))).sum(1)  # Eq. 8
    elif name == "squared_error":
        per = (head.kappa * t * (z - head.M) ** 2 + (1 - t) * z**2).mean(1) * head.loss_scale  # Eq. 9
    else:
        raise AssertionError(name)
    if head.beta:
        per = per + head.beta * (z**2).sum(1)
    loss = per.mean()
    if head.lambda_final:
        loss = loss + head.lambda_final * (head.weight**2).sum()
    return loss


@pytest.mark.parametrize("name", ["softmax", "label_smoothing", "sigmoid", "squared_error", "dropout", "logit_penalty",
                                  "extra_l2"])
def test_mixup_loss_is_the_loss_at_the_mixed_target(name):
    torch.manual_seed(0)
    head = make_objective(name, 6, 4).double()
    x = torch.randn(10, 6, dtype=torch.float64)
    y, y_b = torch.randint(0, 4, (10,)), torch.randint(0, 4, (10,))
    lam = 0.3
    loss, z = head.loss_and_logits(x, y, (y_b, lam))  # dropout: one mask, z carries it
    t = lam * F.one_hot(y, 4).double() + (1 - lam) * F.one_hot(y_b, 4).double()
    assert torch.allclose(loss, _soft_reference(name, head, z, t), rtol=1e-12, atol=1e-12)
    head.eval()  # no mix == the plain loss
    assert torch.equal(head.loss_and_logits(x, y)[0], head.loss_and_logits(x, y, (y, 0.7))[0])


def test_mixup_batch_mixes_with_a_permutation():
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 2, 2), torch.arange(16)
    xm, y_b, lam = mixup_batch(x, y, 0.4)
    assert 0.0 < lam < 1.0 and sorted(y_b.tolist()) == list(range(16))
    assert torch.allclose(xm, lam * x + (1 - lam) * x[y_b])
    lams = [mixup_batch(x, y, 0.2)[2] for _ in range(400)]  # Beta(0.2, 0.2): mean 1/2, mostly near 0 or 1
    assert abs(np.mean(lams) - 0.5) < 0.06 and np.mean([min(l, 1 - l) < 0.1 for l in lams]) > 0.5
    with pytest.raises(ValueError, match="alpha must be > 0"):
        mixup_batch(x, y, 0.0)


# -- AutoAugment, splits ---------------------------------------------------------------------------
def test_float_autoaugment_on_digits():
    ds = build_dataset("digits-source", "train", augment=True, autoaugment=True)
    plain = build_dataset("digits-source", "train", augment=False)
    assert "AutoAugment (ImageNet policy)" in ds.transform_desc
    lo, hi = DIGITS_RANGE
    torch.manual_seed(0)
    changed = 0
    for i in range(40):
        a, _ = ds[i]
        assert a.shape == (1, 8, 8) and a.dtype == torch.float32
        assert a.min() >= lo - 1e-5 and a.max() <= hi + 1e-5
        changed += not torch.allclose(a, plain[i][0])
    assert changed > 20
    # on 8-bit grid values the quantisation is exact: u8 -> float -> u8 round-trips
    aa = FloatAutoAugment(lo, hi)
    q = torch.arange(256, dtype=torch.float32).reshape(1, 16, 16)
    x = q / (255.0 / (hi - lo)) + lo
    assert torch.equal(((x - lo) * (255.0 / (hi - lo))).round(), q)
    assert aa(x).shape == x.shape
    # the ImageFolder/torchvision transform: policy after crop and flip, before normalisation
    from repsim.train.imaging import image_transforms

    tf, desc = image_transforms("imagenet", 32, 36, autoaugment=True)
    names = [type(t).__name__ for t in tf.transforms]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "AutoAugment", "ToTensor", "Normalize"], names
    assert image_transforms(False, 32, 36, autoaugment=True)[0].transforms[2].__class__.__name__ == "ToTensor"


def test_train_plus_holdout_split():
    tr, ho, te = (build_dataset("digits-target", s) for s in ("train", "holdout", "test"))
    both = build_dataset("digits-target", "train+holdout", augment=True)
    assert sorted(both.indices.tolist()) == sorted(tr.indices.tolist() + ho.indices.tolist())
    assert not set(both.indices.tolist()) & set(te.indices.tolist())
    lookup = dict(zip(tr.indices.tolist() + ho.indices.tolist(), tr.targets.tolist() + ho.targets.tolist()))
    assert [lookup[i] for i in both.indices.tolist()] == both.targets.tolist()
    assert both.split == "train+holdout" and "shift" in both.transform_desc
    x, y = both[len(both) - 1]
    assert x.shape == (1, 8, 8) and 0 <= y < 5
    with pytest.raises(ValueError, match="no train\\+holdout"):
        build_dataset("synthetic", "train+holdout")


def test_variant_of():
    assert variant_of({"data": {"autoaugment": False}, "mixup": {"alpha": 0.0}}) == ""
    assert variant_of({"data": {"autoaugment": True}, "mixup": {"alpha": 0.2}}) == "autoaugment+mixup"
    assert variant_of({"variant": "long", "data": {"autoaugment": True}}) == "long"


# -- the loop --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """4 epochs with Mixup + AutoAugment, keeping every 2nd epoch."""
    out = tmp_path_factory.mktemp("recipe")
    cfg = load_config("digits-softmax", SMALL + ["epochs=4", "mixup.alpha=0.2", "data.autoaugment=true", "keep_every=2"])
    return cfg, out, train_run(cfg, out, progress=False, log=lambda s: None)


def test_keep_every_and_stop_epoch_and_variant(recipe_run, tmp_path):
    cfg, out, metrics = recipe_run
    assert sorted(p.name for p in out.glob("epoch-*.pt")) == ["epoch-0002.pt", "epoch-0004.pt"]
    kept = load_checkpoint(out / "epoch-0002.pt")
    assert kept["epoch"] == 2 and kept["config"]["variant"] == "autoaugment+mixup"
    final = load_checkpoint(out / "checkpoint.pt")
    assert final["epoch"] == 4 and not torch.equal(kept["model"]["head.weight"], final["model"]["head.weight"])
    # stop_epoch=2 of the 4-epoch run: the same schedule, so exactly the kept epoch-2 weights
    short = tmp_path / "short"
    m2 = train_run({**cfg, "stop_epoch": 2}, short, progress=False, log=lambda s: None)
    assert [m["epoch"] for m in m2] == [1, 2] and m2[-1]["lr"] == metrics[1]["lr"]
    got = load_checkpoint(short / "checkpoint.pt")
    assert all(torch.equal(got["model"][k], kept["model"][k]) for k in kept["model"])
    # killed between saving epoch 2 and keeping it: --resume keeps it
    (short / "epoch-0002.pt").unlink(missing_ok=True)
    train_run({**cfg, "stop_epoch": 2, "keep_every": 2}, short, resume=True, progress=False, log=lambda s: None)
    assert load_checkpoint(short / "epoch-0002.pt")["epoch"] == 2


def test_mean_per_class_matches_brute_force(recipe_run):
    from repsim.train import load_model

    cfg, out, metrics = recipe_run
    net = load_model(out / "checkpoint.pt")
    ds = build_dataset("digits-source", "test")
    with torch.no_grad():
        pred = net(torch.stack([ds[i][0] for i in range(len(ds))])).argmax(1).numpy()
    y = ds.targets
    mpc = 100 * np.mean([np.mean(pred[y == c] == c) for c in np.unique(y)])
    assert metrics[-1]["test_mean_per_class"] == pytest.approx(mpc, abs=1e-9)
    assert metrics[-1]["test_top1"] == pytest.approx(100 * np.mean(pred == y), abs=1e-9)
    assert not math.isclose(mpc, 100 * np.mean(pred == y))  # unequal classes: the two measures differ


def test_retrain_on_train_plus_holdout(tmp_path):
    cfg = load_config("digits-softmax", SMALL + ["epochs=1", 'data.train_split="train+holdout"'])
    metrics = train_run(cfg, tmp_path / "all", progress=False, log=lambda s: None)
    ck = load_checkpoint(tmp_path / "all" / "checkpoint.pt")
    assert ck["config"]["dataset"]["n_train"] == len(build_dataset("digits-source", "train+holdout"))
    assert "holdout_top1" not in metrics[-1] and "test_top1" in metrics[-1]
    assert ck["config"]["variant"] == ""


def test_fine_tuning_run_resumes(recipe_run, tmp_path):
    """--resume of a fine-tuning run: finetune.source (a table the run fills in) is not a config difference,
    nor is a changed keep_every; the source's sha256 is recorded for Fig. D.3."""
    import hashlib

    _, src, _ = recipe_run
    cfg = load_config("finetune-digits", SMALL + ["max_steps=30", f'finetune.init_from="{src / "checkpoint.pt"}"'])
    out = tmp_path / "ft"
    train_run(cfg, out, progress=False, stop_after_epoch=1, log=lambda s: None)
    train_run({**cfg, "keep_every": 1}, out, resume=True, progress=False, log=lambda s: None)
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck["scheduler"]["step"] == 30 and (out / "epoch-0002.pt").is_file()
    assert ck["config"]["finetune"]["source"]["sha256"] == hashlib.sha256((src / "checkpoint.pt").read_bytes()).hexdigest()
