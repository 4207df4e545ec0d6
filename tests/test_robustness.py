"""Table C.2: OOD evaluation on ImageFolder-shaped sets (the 200-class mask of ImageNet-A/-R) and ImageNet-C's
mCE, against hand-computed values and brute-force predictions of real (random-init) networks."""
from __future__ import annotations

import csv

import numpy as np
import pytest

pytest.importorskip("torch")  # training and extraction need the [torch] extra

from helpers_eval import IMAGE_SIZE, tiny_checkpoint, write_image
from repsim.probes.robustness import ALEXNET_ERRORS, CORRUPTIONS, corruption_errors, masked_predictions, mce

# the per-corruption AlexNet errors (means over severities) as published with AugMix's code (ALEXNET_ERR)
AUGMIX_ALEXNET_ERR = [0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360, 0.866816, 0.826572,
                      0.819324, 0.564592, 0.853204, 0.646056, 0.717840, 0.606500]


def test_alexnet_reference_matches_published_means():
    assert list(ALEXNET_ERRORS) == list(CORRUPTIONS) and len(CORRUPTIONS) == 15
    means = [np.mean(ALEXNET_ERRORS[c]) for c in CORRUPTIONS]
    np.testing.assert_allclose(means, AUGMIX_ALEXNET_ERR, atol=5e-7)


def test_two_corruption_mce_by_hand():
    errors = {"gaussian_noise": [0.5, 0.6, 0.7, 0.8, 0.9], "contrast": [0.2] * 5}
    # Σ_s AlexNet errors: gaussian noise 0.69528+0.82542+0.93554+0.98138+0.99452 = 4.43214,
    # contrast 0.64548+0.7615+0.88874+0.9776+0.9927 = 4.26602; Σ_s errors 3.5 and 1.0
    ce = corruption_errors(errors)
    assert ce["gaussian_noise"] == pytest.approx(3.5 / 4.43214, rel=1e-12)
    assert ce["contrast"] == pytest.approx(1.0 / 4.26602, rel=1e-12)
    assert mce(errors) == pytest.approx(100 * (3.5 / 4.43214 + 1.0 / 4.26602) / 2, rel=1e-12)  # 51.2048...
    assert mce(errors) == pytest.approx(51.20486, abs=1e-4)
    assert mce({c: ALEXNET_ERRORS[c] for c in CORRUPTIONS}) == pytest.approx(100.0)  # AlexNet itself: 100
    with pytest.raises(ValueError, match="severities"):
        mce({"fog": [0.1, 0.2]})
    with pytest.raises(ValueError, match="no reference"):
        mce({"spatter": [0.1] * 5})


def test_masked_predictions_by_construction():
    z = np.array([[9.0, 1.0, 2.0, 3.0], [0.0, 5.0, 4.0, 9.0]])
    assert masked_predictions(z).tolist() == [0, 3]
    assert masked_predictions(z, [1, 2]).tolist() == [2, 1]   # arg max over classes 1 and 2 only
    with pytest.raises(ValueError, match="indices"):
        masked_predictions(z, [4])


# ---------------------------------------------------------------------------- the command
WNIDS = [f"n{i:08d}" for i in range(1000)]
A_CLASSES = list(range(3, 1000, 5))               # 200 classes, class 0 not among them
C_CLASSES = [5, 11, 700]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("ood")
    rng = np.random.default_rng(0)
    for w in WNIDS:                                # the training set's 1,000 class folders (their order = logits)
        (root / "imagenet" / "train" / w).mkdir(parents=True)
    for c in A_CLASSES:
        write_image(root / "a" / WNIDS[c] / "x.png", rng)
    for c in (0, 17, 999):                         # ImageNetV2: folders named by class index
        for k in range(2):
            write_image(root / "v2" / str(c) / f"{k}.jpeg", rng)
    for c in (0, 2):
        write_image(root / "sketch" / WNIDS[c] / "s.png", rng)
    for corr in ("gaussian_noise", "contrast"):
        for s in range(1, 6):
            for c in C_CLASSES:
                write_image(root / "c" / corr / str(s) / WNIDS[c] / "c.png", rng)
    spec = str(root / "imagenet")
    rand = tiny_checkpoint(root / "rand-s0" / "best.pt", 1000, data_spec=spec, seed=0)
    # zero final-layer weights: logits = bias for every image, largest for class 0, then 1, 2, ...
    planted = tiny_checkpoint(root / "planted-s1" / "best.pt", 1000, data_spec=spec, seed=1, zero_head=True,
                              head_bias=-1e-3 * np.arange(1000), objective="cosine_softmax")
    return root, rand, planted


def _sets(root):
    return ["--eval-set", f"imagenet-a={root / 'a'}", "--eval-set", f"imagenet-r={root / 'a'}", "--eval-set", f"imagenet-v2={root / 'v2'}",
            "--eval-set", f"imagenet-sketch={root / 'sketch'}", "--eval-set", f"imagenet-c={root / 'c'}"]


def _brute(ckpt, paths, mask, crop_only):
    """Each image through the network one at a time, the transform written out by hand."""
    import torch
    from PIL import Image
    from torchvision import transforms as T

    from repsim.train.checkpoint import load_model

    net = load_model(ckpt)
    tf = [T.CenterCrop(IMAGE_SIZE)] if crop_only else [T.Resize(round(IMAGE_SIZE * 256 / 224)), T.CenterCrop(IMAGE_SIZE)]
    tf = T.Compose(tf + [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    preds = []
    with torch.no_grad():
        for p in paths:
            z = net(tf(Image.open(p).convert("RGB"))[None]).numpy()[0]
            preds.append(mask[int(np.argmax(z[mask]))] if mask is not None else int(np.argmax(z)))
    return np.array(preds)


def test_robustness_command(bench, tmp_path, capsys):
    from repsim.commands.main import main

    root, rand, planted = bench
    out = tmp_path / "robustness.csv"
    assert main(["robustness", "--checkpoint", str(rand), "--checkpoint", str(planted), *_sets(root),
                 "--out", str(out), "--device", "cpu", "--workers", "0", "--batch-size", "64"]) == 0
    rows = list(csv.DictReader(open(out)))
    from repsim.results import COLUMNS

    assert tuple(rows[0]) == COLUMNS["robustness"]  # the declared columns, in their order
    get = {(r["store"], r["benchmark"], r["subset"], r["metric"]): r for r in rows}
    # planted network: every image is predicted as the highest-bias class the arg max may choose
    a = get[("planted-s1", "imagenet-a", "", "top1")]
    assert float(a["value"]) == 1 / 200 and a["classes"] == "200" and a["masked"] == "True" and a["n"] == "200"
    assert get[("planted-s1", "imagenet-r", "", "top1")]["value"] == a["value"]               # ImageNet-R: the same mask
    assert float(get[("planted-s1", "imagenet-v2", "", "top1")]["value"]) == 2 / 6          # class 0's two images
    assert float(get[("planted-s1", "imagenet-sketch", "", "top1")]["value"]) == 1 / 2
    assert get[("planted-s1", "imagenet-sketch", "", "top1")]["masked"] == "False"
    for corr in ("gaussian_noise", "contrast"):                                             # class 0 never present
        assert all(float(get[("planted-s1", "imagenet-c", f"{corr}/{s}", "error")]["value"]) == 1.0 for s in range(1, 6))
    m = get[("planted-s1", "imagenet-c", "2 of 15 corruptions: gaussian_noise, contrast", "mce")]
    assert float(m["value"]) == pytest.approx(100 * (5 / 4.43214 + 5 / 4.26602) / 2, rel=1e-12)
    assert get[("planted-s1", "imagenet-a", "", "top1")]["objective"] == "cosine_softmax"
    # random network: the command's predictions are the brute-force ones, masked and unmasked
    import torch

    from repsim.train.checkpoint import load_checkpoint, load_model
    from repsim.train.robustness import folder_set, predict

    es = folder_set(root / "a", "imagenet-a", 1000, WNIDS)
    assert es.paths == [str(root / "a" / WNIDS[c] / "x.png") for c in A_CLASSES]
    assert es.mask.tolist() == A_CLASSES and es.targets.tolist() == A_CLASSES
    ref = _brute(rand, es.paths, np.array(A_CLASSES), False)
    got = predict([load_model(rand)], es, load_checkpoint(rand)["config"], device=torch.device("cpu"), batch_size=64)[0]
    assert np.array_equal(got, ref) and len(set(ref)) > 10 and set(ref) <= set(A_CLASSES)
    assert np.any(_brute(rand, es.paths, None, False) != ref)   # the mask changes predictions
    assert float(get[("rand-s0", "imagenet-a", "", "top1")]["value"]) == np.mean(ref == np.array(A_CLASSES))
    errs = {}
    for corr in ("gaussian_noise", "contrast"):
        errs[corr] = []
        for s in range(1, 6):
            paths = [str(root / "c" / corr / str(s) / WNIDS[c] / "c.png") for c in C_CLASSES]
            e = 1 - np.mean(_brute(rand, paths, None, True) == np.array(C_CLASSES))
            assert float(get[("rand-s0", "imagenet-c", f"{corr}/{s}", "error")]["value"]) == pytest.approx(e)
            errs[corr].append(e)
    assert float(get[("rand-s0", "imagenet-c", "gaussian_noise", "ce")]["value"]) == pytest.approx(
        sum(errs["gaussian_noise"]) / 4.43214)
    assert float(get[("rand-s0", "imagenet-c", "2 of 15 corruptions: gaussian_noise, contrast", "mce")]["value"]) \
        == pytest.approx(mce(errs))
    # a rerun resumes: nothing is evaluated again, the file is unchanged
    capsys.readouterr()
    before = out.read_text()
    assert main(["robustness", "--checkpoint", str(rand), "--checkpoint", str(planted), *_sets(root),
                 "--out", str(out), "--device", "cpu", "--workers", "0"]) == 0
    assert out.read_text() == before and "already in" in capsys.readouterr().err


def test_robustness_refusals(bench, tmp_path, capsys):
    from repsim.commands.main import main

    root, rand, _ = bench
    args = ["robustness", "--checkpoint", str(rand), "--out", str(tmp_path / "r.csv"), "--device", "cpu"]
    assert main(args + ["--eval-set", f"imagenet-v2={root / 'a'}"]) == 2
    assert "folders must be class indices" in capsys.readouterr().err
    assert main(args + ["--eval-set", f"imagenet-a={root / 'a'}", "--classes", str(root / "sketch")]) == 2
    assert "class list has 2 names but the networks have 1000" in capsys.readouterr().err
    assert main(args + ["--eval-set", f"imagenet-c={root / 'a'}"]) == 2
    assert "unknown corruption folder" in capsys.readouterr().err
    assert main(args + ["--eval-set", "imagenet-a"]) == 2
    err = capsys.readouterr().err   # one line through the CLI's one error path
    assert err.startswith("repsim robustness: error: --eval-set 'imagenet-a': expected NAME=DIR") and err.count("\n") == 1
    # a --checkpoint pattern that matches nothing names this command's option, not extract's
    assert main(["robustness", "--checkpoint", str(tmp_path / "none*.pt"), "--eval-set", f"imagenet-a={root / 'a'}",
                 "--out", str(tmp_path / "r.csv"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("repsim robustness: error: --checkpoint") and "matches no file" in err and "extract" not in err


def test_table_c2_item(bench, tmp_path):
    from repsim.analyses.cli import make_figures
    from repsim.results import write_csv

    rows = []
    for obj, base in (("softmax", 0.60), ("cosine_softmax", 0.65)):
        for seed in range(2):
            common = dict(store=f"{obj}-s{seed}", objective=obj, seed=seed, checkpoint_sha256=f"{obj}{seed}")
            for b, off in (("imagenet-v2", 0.0), ("imagenet-a", -0.5), ("imagenet-sketch", -0.3), ("imagenet-r", -0.2)):
                rows.append(dict(common, benchmark=b, subset="", metric="top1", value=base + off + 0.004 * seed, n=10,
                                 classes=200 if b in ("imagenet-a", "imagenet-r") else 1000,
                                 masked=b in ("imagenet-a", "imagenet-r")))
            rows.append(dict(common, benchmark="imagenet-c", subset="all 15 corruptions", metric="mce",
                             value=80 - 10 * (obj == "cosine_softmax") + seed))
    res = tmp_path / "res"
    write_csv(rows, res / "robustness.csv")
    outcomes, _ = make_figures(None, res, tmp_path / "fig", only=["tableC2"], progress=False)
    assert outcomes[0].status == "done", outcomes[0].note
    t = outcomes[0].table
    assert list(t.shown.columns) == ["Objective", "ImageNet-V2 (%)", "ImageNet-A (%)", "IN-Sketch (%)",
                                     "ImageNet-R (%)", "ImageNet-C (mCE)"]
    assert t.shown.iloc[0].tolist()[:2] == ["Softmax", "60.2 ± 0.2"]
    assert t.numeric.set_index("objective").loc["cosine_softmax", "ImageNet-C (mCE)"] == pytest.approx(70.5)
    assert t.bold["ImageNet-C (mCE)"].tolist() == [False, True]        # lower mCE is better
    assert "imagenet-a (200 classes)" in outcomes[0].caption


def test_runs_sharing_one_csv_keep_each_others_rows(bench, tmp_path):
    """Two `repsim robustness` runs (a job array) writing one CSV: each rewrote the file from the rows it
    had read at its start, so the other run's rows were lost. The write merges under the results lock."""
    from repsim.train.robustness import evaluate

    root, rand, planted = bench
    out = tmp_path / "robustness.csv"
    sets = {"imagenet-sketch": root / "sketch", "imagenet-v2": root / "v2"}
    fired = []

    def meanwhile(_message):  # the other run finishes while this one evaluates its first set
        if not fired:
            fired.append(True)
            evaluate([rand], sets, out, device="cpu", log=lambda _m: None)

    evaluate([planted], sets, out, device="cpu", log=meanwhile)
    rows = list(csv.DictReader(open(out)))
    assert sorted((r["store"], r["benchmark"]) for r in rows) == sorted(
        (s, b) for s in ("planted-s1", "rand-s0") for b in sets)
    evaluate([planted], {"imagenet-v2": root / "v2"}, out, device="cpu", overwrite=True, log=lambda _m: None)
    assert [(r["store"], r["benchmark"]) for r in csv.DictReader(open(out))] == [("planted-s1", "imagenet-v2")]
