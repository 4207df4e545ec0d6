"""Presets (every one builds its network), Table A.1 / A.2 values, ``--set`` overrides, bad keys."""
from __future__ import annotations

import pytest
torch = pytest.importorskip("torch")  # repsim/train/ needs the [torch] extra

from repsim.train.config import ConfigError, apply_set, finetune_grid, list_presets, load_config
from repsim.train.models import build_backbone
from repsim.train.objectives import OBJECTIVES, make_objective

NUM_CLASSES = {"imagenet": 1000, "cifar10": 10, "cifar100": 100, "digits": 5, "fashion": 5, "finetune": 10}


def _classes(name: str) -> int:
    for key, k in NUM_CLASSES.items():
        if key in name:
            return k
    raise AssertionError(name)


def test_every_preset_builds():
    names = list_presets()
    for family in ("resnet50-imagenet", "inception_v3-imagenet", "cifar10-allcnn", "cifar100-wrn", "digits", "fashion"):
        assert {f"{family}-{o}" for o in OBJECTIVES} <= set(names), family
    assert {f"resnet50-imagenet-cosine_softmax-tau0.0{i}" for i in range(1, 9)} <= set(names)
    backbones: dict = {}
    for name in names:
        cfg = load_config(name)
        key = (cfg["arch"], repr(sorted(cfg["arch_params"].items())), cfg["in_channels"])
        if key not in backbones:  # ResNet-50 takes ~2 s to build on CPU: build each backbone once
            backbones[key] = build_backbone(cfg["arch"], in_channels=cfg["in_channels"], **cfg["arch_params"])
        _, m = backbones[key]
        head = make_objective(cfg["objective"], m, _classes(name), **cfg["objective_params"])
        assert torch.isfinite(head.loss(torch.randn(2, m), torch.tensor([0, 1]))), name
        assert cfg["epochs"] > 0 or cfg["max_steps"] > 0


# Appendix Table A.1 (bold values, epochs)
TABLE_A1 = {
    "softmax": ({}, 146), "label_smoothing": ({"alpha": 0.1}, 180), "sigmoid": ({}, 166),
    "extra_l2": ({"lambda_final": 8e-4}, 168), "dropout": ({"keep_prob": 0.7}, 172),
    "logit_penalty": ({"beta": 6e-4}, 180), "logit_norm": ({"tau": 0.04}, 152),
    "cosine_softmax": ({"tau": 0.05}, 158),
    "squared_error": ({"kappa": 9.0, "M": 60.0, "loss_scale": 10.0}, 196),
}


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_imagenet_presets_follow_appendix_a1(objective):
    cfg = load_config(f"resnet50-imagenet-{objective}")
    params, epochs = TABLE_A1[objective]
    assert cfg["objective_params"] == params and cfg["epochs"] == epochs
    assert cfg["batch_size"] == 4096 and cfg["optim"]["lr"] == 1.6 and cfg["optim"]["nesterov"]
    assert cfg["optim"]["weight_decay"] == 8e-5 and not cfg["optim"]["wd_norm"]
    assert cfg["schedule"] == {"name": "exponential", "warmup_epochs": 10, "decay": 0.975}
    assert cfg["ema"]["decay"] == 0.9999 and cfg["data"]["holdout_size"] == 50046
    assert cfg["data"]["image_size"] == 224 and cfg["data"]["eval_resize"] == 256
    inc = load_config(f"inception_v3-imagenet-{objective}")
    assert inc["arch"] == "inception_v3" and inc["objective_params"] == params


def test_temperature_sweep_scales_loss_by_tau():
    cfg = load_config("resnet50-imagenet-cosine_softmax-tau0.02")
    assert cfg["objective_params"] == {"tau": 0.02, "scale_by_tau": True}


def test_cifar_presets_follow_iclr_table_a2():
    c10 = load_config("cifar10-allcnn-softmax")
    assert c10["arch"] == "allcnn_c" and c10["batch_size"] == 128 and not c10["optim"]["wd_norm"]
    assert c10["optim"]["lr"] == pytest.approx(10**-0.75) and c10["optim"]["weight_decay"] == pytest.approx(10**-3.75)
    assert c10["schedule"]["name"] == "cosine" and not c10["ema"]["enabled"] and c10["optim"]["wd_over_lr"]
    c100 = load_config("cifar100-wrn-label_smoothing")
    assert c100["arch"] == "wrn16_8" and c100["batch_size"] == 256 and c100["optim"]["wd_norm"]
    assert c100["objective_params"] == {"alpha": 0.18} and c100["optim"]["weight_decay"] == pytest.approx(10**-3.5)


def test_set_overrides_and_inheritance():
    cfg = load_config("digits-cosine_softmax", ["optim.lr=0.2", "objective_params.tau=0.1", "epochs=3",
                                                "arch_params.layers=[1,1,1,1]", "data.spec=digits", "ema.enabled=false"])
    assert cfg["optim"]["lr"] == 0.2 and cfg["objective_params"]["tau"] == 0.1 and cfg["epochs"] == 3
    assert cfg["arch_params"] == {"width": 8, "layers": [1, 1, 1, 1]} and cfg["data"]["spec"] == "digits"
    assert cfg["ema"]["enabled"] is False and cfg["ema"]["decay"] == 0.99  # inherited from _digits
    assert cfg["preset"] == "digits-cosine_softmax"
    cfg2 = load_config("digits-softmax", ["optim.lr=1"])
    assert isinstance(cfg2["optim"]["lr"], float)


@pytest.mark.parametrize("bad,match", [
    ("optim.lrr=0.1", "unknown config key"), ("nope=1", "unknown config key"), ("optim=1", "unknown config key"),
    ("epochs=many", "expects a number"), ("ema.enabled=1", "true/false"), ("lr", "key=value"),
])
def test_bad_set_raises(bad, match):
    cfg = load_config("digits-softmax")
    with pytest.raises(ConfigError, match=match):
        apply_set(cfg, bad)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'digits-softmaxx'"):
        load_config("digits-softmaxx")


def test_finetune_grid_is_appendix_a3():
    grid = finetune_grid()
    lrs = sorted({g["optim.lr"] for g in grid})
    wds = sorted({g["optim.weight_decay"] for g in grid})
    assert len(grid) == 72 and len(lrs) == 8 and len(wds) == 9 and wds[0] == 0.0
    assert lrs[0] == pytest.approx(10**-5.5) and lrs[-1] == pytest.approx(0.1)
    assert wds[1] == pytest.approx(10**-6.5) and wds[-1] == pytest.approx(1e-3)
    ft = load_config("finetune-resnet50")
    assert ft["max_steps"] == 20000 and ft["schedule"]["name"] == "cosine" and not ft["optim"]["nesterov"]


@pytest.mark.parametrize("bad,match", [
    # audit F5: a misspelt schedule used to pass and crash only after warm-up, with checkpoints written
    ('schedule.name="linear"', "'schedule.name' must be one of 'exponential', 'cosine', got 'linear'"),
    # audit F6: a misspelt augmentation used to train without augmentation (or with the digits shift)
    ('data.augment="imagenett"', "'data.augment' must be one of True, False, 'imagenet', 'cifar', 'digits', 'none'"),
    ('data.augment="random_crop"', "'data.augment' must be one of"),
])
def test_misspelt_names_are_refused_when_the_config_is_loaded(bad, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
        load_config("digits-softmax", [bad])
    for good in ('schedule.name="cosine"', 'data.augment="none"', "data.augment=true", 'data.augment="shift+flip"'):
        load_config("digits-softmax", [good])


def test_an_augmentation_the_image_dataset_lacks_is_refused_not_the_eval_transform(tmp_path):
    """Audit F6: ``image_transforms('shift', ...)`` (a Fashion-MNIST name) gave the evaluation transform."""
    from repsim.train.imaging import image_transforms

    with pytest.raises(ValueError, match="'shift' is not one for image datasets: use imagenet, cifar or none"):
        image_transforms("shift", 32, 36)
    assert "RandomResizedCrop" in image_transforms(True, 32, 36)[1]
    assert image_transforms("none", 32, 36)[1] == image_transforms(False, 32, 36)[1] == "Resize(36) + CenterCrop(32); normalise"


def test_fashion_subsample_sizes_on_another_dataset_are_refused():
    """data.train_per_class subsamples Fashion-MNIST only; on digits it was silently ignored."""
    from repsim.train.data import build_dataset

    with pytest.raises(ValueError, match="data.train_per_class apply to the Fashion-MNIST specs only .*'digits'"):
        build_dataset("digits", "train", per_class={"train_per_class": 5})


def test_a_network_whose_input_channels_do_not_match_the_data_is_one_line(tmp_path, capsys):
    """`repsim train --data digits --set epochs=1` without a preset: the default ResNet-50 takes 3-channel
    images, digits has 1 (a RuntimeError deep in the forward pass, exit 70, before)."""
    from repsim.commands.main import main

    code = main(["train", "--data", "digits", "--out", str(tmp_path / "r"), "--set", "epochs=1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "digits has 1-channel images but the network (resnet50) takes in_channels = 3" in err, err


def test_train_list_presets_and_every_config_flag_in_print_config(capsys):
    """`repsim train --list-presets` lists list_presets(); --print-config shows the config each flag builds
    (--seed, --objective, --data, --keep-every, --init-from, --set), the config load_config builds from
    the same settings (no training run: these flags' values reach the config, which the loop reads)."""
    import json

    from repsim.commands.main import main

    assert main(["train", "--list-presets"]) == 0
    assert capsys.readouterr().out.split() == list(list_presets())
    argv = ["train", "--preset", "digits-softmax", "--seed", "7", "--objective", "sigmoid", "--data", "digits",
            "--keep-every", "2", "--init-from", "/some/checkpoint.pt", "--set", "epochs=3", "--print-config"]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == load_config("digits-softmax", ["epochs=3", "seed=7", 'objective="sigmoid"', 'data.spec="digits"',
                                                   "keep_every=2", 'finetune.init_from="/some/checkpoint.pt"'])
    assert (shown["seed"], shown["objective"], shown["data"]["spec"], shown["keep_every"], shown["epochs"],
            shown["finetune"]["init_from"]) == (7, "sigmoid", "digits", 2, 3, "/some/checkpoint.pt")
    assert shown != load_config("digits-softmax", [])
