"""Any PyTorch model into the same stores (issue 16 acceptance): torchvision ViT and Swin, a timm model,
a Hugging Face ViT and a Hugging Face text transformer, each with random weights from a small config.

Every store is compared with a direct forward pass of an independently built copy of the model with
plain forward hooks, reduced by hand as the docs say (``--tokens``, channels-last maps, masked
means), on inputs adapted by hand as repsim/extract/adapt.py documents (channel repeat, bilinear resize).
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
pytest.importorskip("repsim.train.data")

import torch.nn.functional as F  # noqa: E402

from repsim.extract import layer_modules  # noqa: E402
from repsim.extract.sources import weights_sha256  # noqa: E402
from repsim.commands.main import main as repsim_main  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402
from repsim.train.data import build_dataset  # noqa: E402

TESTS = Path(__file__).resolve().parent
RUN = ["--split", "test", "--workers", "0", "--device", "cpu", "--dtype", "float32", "--order", "dataset",
       "--batch-size", "64"]


@pytest.fixture(autouse=True)
def _tiny_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # module:tiny_models:<factory>, as a user's own module


@pytest.fixture(scope="module")
def digits_x() -> tuple[torch.Tensor, np.ndarray]:
    ds = build_dataset("digits", "test")
    return torch.stack([ds[i][0] for i in range(len(ds))]), np.asarray(ds.targets)


def _adapted(x: torch.Tensor, size: int) -> torch.Tensor:
    """The documented default: grayscale repeated to RGB, bilinear antialiased resize."""
    x = x.repeat(1, 3, 1, 1)
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def _seeded(factory):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return factory().eval()


def _hooked(model, x, quals: dict[str, str], *, inputs: tuple[str, ...] = (), call=None) -> dict[str, torch.Tensor]:
    """{name: module output (or first input for names in ``inputs``)} from one plain forward pass."""
    mods = dict(model.named_modules())
    got: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(m, args, out):
            t = args[0] if name in inputs else out
            got[name] = (t[0] if isinstance(t, tuple) else t).detach().clone()
        return hook

    handles = [mods[q].register_forward_pre_hook(lambda m, a, k=keep(n): k(m, a, None)) if n in inputs
               else mods[q].register_forward_hook(keep(n)) for n, q in quals.items()]
    with torch.inference_mode():
        out = call(model, x) if call else model(x)
    for h in handles:
        h.remove()
    got["__output__"] = out
    return got


def _extract(spec: str, out: Path, *args: str) -> "object":
    assert repsim_main(["extract", "--checkpoint", spec, "--out", str(out), *RUN, *args]) == 0
    return open_store(str(out))


def _close(store, layer: str, ref: torch.Tensor, atol: float = 2e-5) -> None:
    got = np.asarray(store.layer(layer))
    assert got.shape == tuple(ref.shape), (layer, got.shape, tuple(ref.shape))
    np.testing.assert_allclose(got, ref.float().numpy(), rtol=1e-4, atol=atol, err_msg=layer)


# --------------------------------------------------------------------------------------- torchvision


def test_torchvision_vit_tokens_equal_hooked_forward(digits_x, tmp_path, capsys):
    import tiny_models

    x, y = digits_x
    ref_model = _seeded(tiny_models.vit)
    quals = {"block1": "encoder.layers.encoder_layer_0", "block2": "encoder.layers.encoder_layer_1",
             "pool": "heads.head"}
    ref = _hooked(ref_model, _adapted(x, 32), quals, inputs=("pool",))

    flat = _extract("module:tiny_models:vit", tmp_path / "vit.zarr", "--data", "digits")
    assert flat.layers == ["block1", "block2", "pool", "logits"]
    assert flat.attrs["model"]["weights_sha256"] == weights_sha256(ref_model)
    assert flat.attrs["extraction"]["tokens"] == "flatten"  # images: every token kept, as conv maps
    assert "1 -> 3 channels (repeat), resize 8x8 -> 32x32" in flat.attrs["dataset"]["transform"]
    for b in ("block1", "block2"):
        _close(flat, b, ref[b])  # (N, 17, 32): CLS + 16 patch tokens
    assert tuple(flat.zarr_array("block1").metadata.dimension_names) == ("example", "token", "feature")
    assert repsim_main(["check", flat.path]) == 0
    _close(flat, "pool", ref["pool"])  # the classifier's input: the CLS token after the final LayerNorm
    _close(flat, "logits", ref["__output__"])
    np.testing.assert_array_equal(np.asarray(flat.labels), y)
    W, b = flat.head
    np.testing.assert_array_equal(W, ref_model.heads.head.weight.detach().numpy())

    cls = _extract("module:tiny_models:vit", tmp_path / "vit-cls.zarr", "--data", "digits", "--tokens", "cls",
                   "--layers", "block*")
    assert cls.attrs["extraction"]["tokens"] == "cls" and cls.layers == ["block1", "block2"]
    _close(cls, "block2", ref["block2"][:, 0])

    capsys.readouterr()
    assert repsim_main(["extract", "--checkpoint", "module:tiny_models:vit", "--list-layers"]) == 0
    listing = " ".join(capsys.readouterr().out.split())  # whitespace-insensitive
    assert "block1 encoder.layers.encoder_layer_0 (17, 32) (17, 32)" in listing  # a stand-in 32-px image
    assert "pool heads.head:input (input) (32,)" in listing and "logits (model output) (10,) (10,)" in listing
    assert "encoder.layers.encoder_layer_1.mlp" in listing and "encoder.ln" in listing  # other modules


def test_swin_channels_last_maps_equal_hooked_forward(digits_x, tmp_path, capsys):
    import tiny_models

    x, _ = digits_x
    ref_model = _seeded(tiny_models.swin)
    quals = {f"block{i + 1}": q for i, q in enumerate(["features.1.0", "features.1.1", "features.3.0", "features.3.1"])}
    ref = _hooked(ref_model, _adapted(x, 32), quals)
    assert ref["block1"].shape == (450, 8, 8, 16)  # torchvision's Swin stages are (N, H, W, C)

    store = _extract("module:tiny_models:swin", tmp_path / "swin.zarr", "--data", "digits", "--image-size", "32")
    assert store.attrs["extraction"]["layout"] == "NHWC"
    for name in quals:
        _close(store, name, ref[name].permute(0, 3, 1, 2))  # stored as (N, C, H, W)
    _close(store, "logits", ref["__output__"])
    mean = _extract("module:tiny_models:swin", tmp_path / "swin-mean.zarr", "--data", "digits", "--image-size", "32",
                    "--spatial", "mean", "--layers", "block4")
    _close(mean, "block4", ref["block4"].mean(dim=(1, 2)))

    capsys.readouterr()
    assert repsim_main(["extract", "--checkpoint", "module:tiny_models:swin", "--image-size", "32", "--list-layers"]) == 0
    listing = " ".join(capsys.readouterr().out.split())  # whitespace-insensitive
    assert "block4 features.3.1 (4, 4, 32) (32, 4, 4)" in listing  # the module output, then as stored

    # modules whose outputs are (N, C, H, W) in a channels-last model too (the patch-embedding convolution,
    # the pooling after the final permute) are stored as they are: they were transposed with the rest
    nchw = _hooked(ref_model, _adapted(x, 32), {"stem": "features.0.0", "avg": "avgpool"})
    assert nchw["stem"].shape == (450, 16, 8, 8) and nchw["avg"].shape == (450, 32, 1, 1)
    taps = _extract("module:tiny_models:swin", tmp_path / "swin-taps.zarr", "--data", "digits", "--image-size", "32",
                    "--spatial", "mean", "--layers", "features.0.0,avgpool,block1")
    _close(taps, "features.0.0", nchw["stem"].mean(dim=(2, 3)))
    _close(taps, "avgpool", nchw["avg"].mean(dim=(2, 3)))
    _close(taps, "block1", ref["block1"].mean(dim=(1, 2)))


# ------------------------------------------------------------------------------------------------ timm


def test_timm_model_equals_hooked_forward(digits_x, tmp_path, capsys):
    timm = pytest.importorskip("timm")
    x, _ = digits_x
    ref_model = _seeded(lambda: timm.create_model("test_vit", pretrained=False))
    blocks = {f"block{i + 1}": f"blocks.{i}" for i in range(len(ref_model.blocks))}
    ref = _hooked(ref_model, _adapted(x, 32), {**blocks, "pool": "head"}, inputs=("pool",))

    store = _extract("timm:test_vit", tmp_path / "timm.zarr", "--data", "digits", "--image-size", "32", "--tokens", "mean")
    assert store.layers == [*blocks, "pool", "logits"]
    assert store.attrs["model"]["weights_sha256"] == weights_sha256(ref_model)
    assert store.attrs["model"]["source"] == "timm"
    for name in blocks:
        _close(store, name, ref[name].mean(dim=1))  # --tokens mean: over all tokens (images have no padding)
    _close(store, "pool", ref["pool"])
    _close(store, "logits", ref["__output__"], atol=1e-4)

    capsys.readouterr()
    assert repsim_main(["extract", "--checkpoint", "timm:test_vit", "--list-layers", "--image-size", "32"]) == 0
    listing = " ".join(capsys.readouterr().out.split())  # whitespace-insensitive
    assert "blocks.0.attn.qkv" in listing and "pool head:input" in listing


# -------------------------------------------------------------------------------------------- Hugging Face


def test_hf_vit_classifier_equals_hooked_forward(digits_x, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import tiny_models

    x, _ = digits_x
    ckpt = tiny_models.hf_vit_dir(tmp_path / "hf-vit")
    ref_model = _seeded(lambda: transformers.ViTForImageClassification(transformers.AutoConfig.from_pretrained(ckpt)))
    layers = "vit.layers" if hasattr(ref_model.vit, "layers") else "vit.encoder.layer"  # transformers 5 / 4
    quals = {"block1": f"{layers}.0", "block2": f"{layers}.1", "pool": "classifier"}
    ref = _hooked(ref_model, _adapted(x, 32), quals, inputs=("pool",))

    store = _extract(f"hf:{ckpt}", tmp_path / "hf-vit.zarr", "--data", "digits", "--tokens", "cls")
    assert store.layers == ["block1", "block2", "pool", "logits"]
    assert store.attrs["model"]["weights_sha256"] == weights_sha256(ref_model)
    assert store.attrs["model"]["init"] == "random(seed=0)"
    for name in ("block1", "block2"):
        _close(store, name, ref[name][:, 0])  # --tokens cls
    _close(store, "pool", ref["pool"])
    _close(store, "logits", ref["__output__"].logits)  # a ModelOutput's logits

    capsys.readouterr()
    assert repsim_main(["extract", "--checkpoint", f"hf:{ckpt}", "--list-layers"]) == 0
    listing = " ".join(capsys.readouterr().out.split())  # whitespace-insensitive
    assert "pool classifier:input" in listing and quals["block2"] in listing


def _reviews(path: Path, n: int = 48) -> Path:
    import tiny_models

    return tiny_models.write_reviews(path, n)


def test_hf_text_model_masked_tokens_equal_hooked_forward(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import tiny_models

    ckpt = tiny_models.hf_text_dir(tmp_path / "hf-bert")
    data = _reviews(tmp_path / "reviews.csv")
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    rows = list(csv.DictReader(open(data)))
    enc = tok([r["text"] for r in rows], truncation=True, max_length=16, padding="max_length", return_tensors="pt")
    ref_model = _seeded(lambda: transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(ckpt)))
    quals = {"block1": "encoder.layer.0", "block2": "encoder.layer.1"}
    ref = _hooked(ref_model, dict(enc), quals, call=lambda m, x: m(**x))
    mask = enc["attention_mask"].float().unsqueeze(-1)
    assert 0 < mask.mean() < 1  # rows have padding

    mean = _extract(f"hf:{ckpt}", tmp_path / "bert.zarr", "--data", str(data), "--max-length", "16")
    assert mean.layers == ["block1", "block2", "pool"] and not mean.has_logits  # a base model: no head
    assert mean.attrs["extraction"]["tokens"] == "mean"  # text default: mean over real tokens
    assert mean.attrs["model"]["weights_sha256"] == weights_sha256(ref_model)
    np.testing.assert_array_equal(np.asarray(mean.labels), [("bad", "good").index(r["label"]) for r in rows])
    assert mean.attrs["dataset"]["classes"] == ["bad", "good"]
    for name in quals:
        _close(mean, name, (ref[name] * mask).sum(1) / mask.sum(1))  # padding left out
    _close(mean, "pool", (ref["__output__"].last_hidden_state * mask).sum(1) / mask.sum(1))

    flat = _extract(f"hf:{ckpt}", tmp_path / "bert-flat.zarr", "--data", str(data), "--max-length", "16",
                    "--tokens", "flatten", "--layers", "block2")
    _close(flat, "block2", ref["block2"] * mask)  # padded positions zeroed
    last = _extract(f"hf:{ckpt}", tmp_path / "bert-last.zarr", "--data", str(data), "--max-length", "16",
                    "--tokens", "last", "--layers", "block2,encoder.layer.1.output.dense")
    idx = enc["attention_mask"].sum(1) - 1  # right padding: the last real token ([SEP])
    _close(last, "block2", ref["block2"][torch.arange(len(rows)), idx])
    assert last.layers == ["block2", "encoder.layer.1.output.dense"]  # a module qualname as a layer

    capsys.readouterr()
    assert repsim_main(["extract", "--checkpoint", f"hf:{ckpt}", "--list-layers", "--max-length", "16"]) == 0
    listing = " ".join(capsys.readouterr().out.split())  # whitespace-insensitive
    assert "block1 encoder.layer.0 (16, 16) (16,)" in listing and "pool (model output) (16, 16) (16,)" in listing


# ------------------------------------------------------------------------------------- across families


def test_cka_between_resnet_and_vit_stores(tmp_path):
    """The issue's failing command (a torchvision ResNet on 8x8 grayscale digits) now works, and its
    store meets a ViT store of the same dataset in `repsim cka`."""
    r18 = tmp_path / "r18.zarr"
    assert repsim_main(["extract", "--checkpoint", "torchvision:resnet18", "--data", "digits", "--split", "test",
                        "--out", str(r18), "--workers", "0", "--spatial", "mean"]) == 0
    # (torchvision initialises a ViT's head to zeros, so random-init logits are constant: not a CKA column)
    vit = _extract("module:tiny_models:vit", tmp_path / "vit.zarr", "--data", "digits", "--order", "shuffled",
                   "--layers", "block*,pool")
    res18 = open_store(str(r18))
    assert res18.attrs["dataset"]["transform"] == "standardise; adapt: 1 -> 3 channels (repeat)"
    np.testing.assert_array_equal(np.asarray(res18.example_ids), np.asarray(vit.example_ids))
    out = tmp_path / "cka.npz"
    assert repsim_main(["cka", str(r18), vit.path, "--out", str(out), "--batch-size", "150", "--epochs", "2",
                        "--no-progress"]) == 0
    with np.load(out, allow_pickle=False) as z:
        values = z["values"]
    L = len(res18.layers) + len(vit.layers)
    assert values.shape == (L, L) and np.isfinite(values).all()
    np.testing.assert_allclose(np.diag(values), 1.0, atol=1e-6)


# -------------------------------------------------------------------------------------- layer registry


FAMILIES = [
    ("resnet50", 16, "layer1.0", "Bottleneck"),
    ("vit_b_16", 12, "encoder.layers.encoder_layer_0", "EncoderBlock"),
    ("swin_t", 12, "features.1.0", "SwinTransformerBlock"),
    ("convnext_tiny", 18, "features.1.0", "CNBlock"),
    ("efficientnet_b0", 16, "features.1.0", "MBConv"),
    ("mobilenet_v3_small", 11, "features.1", "InvertedResidual"),
    ("regnet_y_400mf", 16, "trunk_output.block1.block1-0", "ResBottleneckBlock"),
    ("densenet121", 4, "features.denseblock1", "_DenseBlock"),
    ("googlenet", 9, "inception3a", "Inception"),
    ("shufflenet_v2_x0_5", 16, "stage2.0", "InvertedResidual"),
    ("squeezenet1_1", 8, "features.3", "Fire"),
    ("maxvit_t", 11, "blocks.0.layers.0", "MaxVitLayer"),
    ("vgg11", 10, "features.1", "ReLU"),  # no repeated blocks: every activation (8 conv + 2 fc)
    ("alexnet", 7, "features.1", "ReLU"),
    ("mobilenet_v2", 17, "features.1", "InvertedResidual"),
    ("mnasnet0_5", 16, "layers.8.0", "_InvertedResidual"),
    ("inception_v3", 11, "Mixed_5b", "Inception"),  # TF-slim's end points (App. B)
]


@pytest.mark.parametrize("name, blocks, first, kind", FAMILIES)
def test_default_layers_of_torchvision_families(name, blocks, first, kind):
    """Each residual / transformer / dense / inception block, then pool (the classifier's input) and
    logits (the model output); built on the meta device (structure only, no weights)."""
    from torchvision.models import get_model

    with torch.device("cpu" if name.startswith("regnet") else "meta"):  # regnet computes widths with tensors
        model = get_model(name)
    reg = layer_modules(model)
    mods = dict(model.named_modules())
    names = list(reg)[:-2]
    assert len(names) == blocks and reg[names[0]] == first
    assert all(type(mods[reg[k]]).__name__.startswith(kind) for k in names)
    assert list(reg)[-2:] == ["pool", "logits"]
    assert reg["logits"] in ("", "fc") and (reg["pool"] == "avgpool" or reg["pool"].endswith(":input"))


def test_families_cover_every_torchvision_classifier_module():
    """Every torchvision classification builder's module (one per family) has a case above, so a family
    added by a later torchvision shows up here."""
    from torchvision.models import get_model_builder, list_models

    def family(name):
        return get_model_builder(name).__module__

    assert {family(n) for n in list_models(module=torchvision.models)} == {family(n) for n, *_ in FAMILIES}


# ------------------------------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "torchvision:resnet17", "--list-layers"],
     "repsim extract: error: 'torchvision:resnet17' is not a torchvision classification model; did you mean resnet18"),
    (["--checkpoint", "torchvision:resnet18:FOO", "--list-layers"], "unknown weights 'FOO'; choose DEFAULT or one of"),
    (["--checkpoint", "module:tiny_models:nope", "--list-layers"], "tiny_models has no callable 'nope'"),
    (["--checkpoint", "timm:test_convnext", "--data", "digits", "--out", "x.zarr"],  # 8 px is too small for it
     "repsim extract: error: the model failed on the first example (input (1, 3, 8, 8)): "),
    (["--checkpoint", "module:tiny_models:vit", "--data", "digits"], "one of --out or --out-dir is required"),
])
def test_extract_errors_are_one_line(args, message, tmp_path, monkeypatch, capsys):
    pytest.importorskip("timm")
    monkeypatch.chdir(tmp_path)
    assert repsim_main(["extract", *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "".join(err)


@pytest.mark.parametrize("spec, module, extra", [("timm:resnet18", "timm", "timm"), ("hf:org/model", "transformers", "hf")])
def test_missing_optional_library_names_its_extra(spec, module, extra, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # as if not installed
    assert repsim_main(["extract", "--checkpoint", spec, "--list-layers"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"repsim extract: error: model source {spec!r} needs {module}, which is not installed: "
                   f"pip install 'repsim-toolkit[{extra}]'")


def test_text_data_and_image_models_do_not_mix(tmp_path, capsys):
    pytest.importorskip("transformers")
    import tiny_models

    ckpt = tiny_models.hf_text_dir(tmp_path / "bert")
    assert repsim_main(["extract", "--checkpoint", f"hf:{ckpt}", "--data", "digits", "--out", str(tmp_path / "a.zarr")]) == 2
    assert "the model is a text model; --data must be a .txt, .csv or .tsv file" in capsys.readouterr().err
    data = _reviews(tmp_path / "r.csv")
    assert repsim_main(["extract", "--checkpoint", "module:tiny_models:vit", "--data", str(data),
                        "--out", str(tmp_path / "b.zarr")]) == 2
    assert "is a text dataset; it needs a text model with a tokenizer" in capsys.readouterr().err


# ------------------------------------------------------------------------- weights' own preprocessing, state dicts


def _image_folder(root: Path, n: int = 12) -> Path:
    """root/test/<class>/*.png: small grayscale images (PIL), as an ImageFolder dataset reads them."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / "test" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 24), dtype=np.uint8), mode="L").save(d / f"{i}.png")
    return root


def test_weights_preprocessing_replaces_the_dataset_transform_on_raw_images(tmp_path):
    """torchvision weights' transforms (as torchvision:<name>:<weights> hands them over) run on the raw
    PIL images, after RGB conversion, instead of the dataset's own transform."""
    from PIL import Image

    from repsim.extract.adapt import adapt_dataset
    from repsim.extract.models import LoadedModel, Preprocess

    folder = _image_folder(tmp_path / "imgs")
    ds = build_dataset(str(folder), "test")
    preset = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()  # a transform object: nothing downloads
    loaded = LoadedModel(torch.nn.Identity(), {}, preprocess=Preprocess(preset, "ResNet18_Weights.IMAGENET1K_V1"),
                         channels=3, input_size=224)
    adapted, meta = adapt_dataset(ds, {"transform": ds.transform_desc}, loaded)
    assert meta["transform"].startswith("model preprocessing: RGB; ResNet18_Weights.IMAGENET1K_V1 (replaces the dataset's: ")
    path = Path(ds.base.samples[int(ds.indices[3])][0])
    want = preset(Image.open(path).convert("RGB"))
    got, label = adapted[3]
    assert got.shape == (3, 224, 224) and label == ds[3][1]
    torch.testing.assert_close(got, want)
    assert ds.transform is not None and ds[3][0].shape == (3, 224, 224)  # the original dataset is untouched

    # --image-size keeps the model's preprocessing (its normalisation) and resizes what it gives (it used to
    # drop it for the dataset's transform, silently)
    sized, meta = adapt_dataset(ds, {"transform": ds.transform_desc}, loaded, image_size=64)
    assert meta["transform"].startswith("model preprocessing: RGB; ResNet18_Weights.IMAGENET1K_V1; then resize to 64x64")
    small = F.interpolate(want[None], size=(64, 64), mode="bilinear", align_corners=False, antialias=True)[0]
    torch.testing.assert_close(sized[3][0], small)


def test_hf_image_processor_and_module_state_dict(tmp_path):
    transformers = pytest.importorskip("transformers")
    import tiny_models
    from PIL import Image

    folder = _image_folder(tmp_path / "imgs")
    ckpt = tiny_models.hf_vit_dir(tmp_path / "hf-vit", num_labels=2)
    processor = transformers.AutoImageProcessor.from_pretrained(ckpt) if (ckpt / "preprocessor_config.json").exists() \
        else transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(ckpt)
    store = _extract(f"hf:{ckpt}", tmp_path / "p.zarr", "--data", str(folder), "--layers", "pool")
    assert "Hugging Face image processor" in store.attrs["dataset"]["transform"]
    ds = build_dataset(str(folder), "test")
    x = torch.stack([processor(images=Image.open(ds.base.samples[int(i)][0]).convert("RGB"), return_tensors="pt")
                     ["pixel_values"][0] for i in ds.indices])
    ref_model = _seeded(lambda: transformers.ViTForImageClassification(transformers.AutoConfig.from_pretrained(ckpt)))
    ref = _hooked(ref_model, x, {"pool": "classifier"}, inputs=("pool",))
    _close(store, "pool", ref["pool"])
    np.testing.assert_allclose(np.asarray(store.logits), ref["__output__"].logits.numpy(), rtol=1e-4, atol=2e-5)

    # module:<module>:<factory>:<state dict>: the saved weights, not the factory's
    net = _seeded(tiny_models.vit)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01)
    torch.save(net.state_dict(), tmp_path / "vit.pt")
    mine = _extract(f"module:tiny_models:vit:{tmp_path / 'vit.pt'}", tmp_path / "mine.zarr", "--data", "digits",
                    "--layers", "pool")
    assert mine.attrs["model"]["weights_sha256"] == weights_sha256(net)
    assert mine.attrs["model"]["init"] == "state dict" and mine.attrs["model"]["checkpoint_sha256"]


def test_hf_text_model_without_tokenizer_files_is_refused(tmp_path, capsys):
    """A config-only directory gets a 5-token tokenizer from AutoTokenizer (every word [UNK]): refused."""
    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / "cfg-only"
    transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32).save_pretrained(ckpt)
    data = _reviews(tmp_path / "reviews.csv")
    assert repsim_main(["extract", "--checkpoint", f"hf:{ckpt}", "--data", str(data),
                        "--out", str(tmp_path / "t.zarr")]) == 2
    assert "tokenizer has 5 tokens but the model's config declares vocab_size 30522" in capsys.readouterr().err
    assert not (tmp_path / "t.zarr").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_sha256_of_a_device_module_equals_the_host_one():
    """The device route (one bulk copy to the host) hashes the same bytes as the host route."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 6 * 6, 5)).eval()
    net[3].bias.data = net[3].bias.data.to(torch.bfloat16)
    host = weights_sha256(net)
    assert weights_sha256(net.cuda().to(memory_format=torch.channels_last)) == host
