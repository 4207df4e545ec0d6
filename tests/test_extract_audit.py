"""Extraction from your own models and datasets (the BYOM audit's findings), each with a small model:

* text stores whose token layers are kept whole record each example's real-token count (``token_counts``);
* channels-last maps inside channels-first models (ConvNeXt's block internals) are reduced per channel;
* a resume after an ``.npz`` changed, or with a Python ``Dataset`` that names itself nowhere;
* modules forward never calls, outputs that are not one row per example, repeated layers: one-line refusals;
* a caller's module comes back in its own training mode and on its own device.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zarr")

from torch import nn  # noqa: E402

from repsim.extract import ExtractError, extract_store  # noqa: E402
from repsim.extract.capture import output_tensor  # noqa: E402
from repsim.extract.pipeline import _compatible  # noqa: E402
from repsim.commands.main import main as repsim_main  # noqa: E402
from repsim.store.check import check_stores  # noqa: E402
from repsim.store.writer import StoreWriter  # noqa: E402

TESTS = Path(__file__).resolve().parent
FAST = dict(workers=0, progress=False, device="cpu", batch_size=8, chunk_rows=16, dtype="float32")


@pytest.fixture(autouse=True)
def _tiny_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _images(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32))


class Plain(torch.utils.data.Dataset):
    """A Python Dataset without name, split or transform description."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i % 3


# ----------------------------------------------------------------------------------- 1. token counts


def _reviews(path: Path, n: int = 24) -> Path:
    import tiny_models

    return tiny_models.write_reviews(path, n, labels=(0, 1))


def test_flattened_text_tokens_record_real_token_counts(tmp_path):
    transformers = pytest.importorskip("transformers")
    import tiny_models

    ckpt = tiny_models.hf_text_dir(tmp_path / "hf-bert")
    data = _reviews(tmp_path / "reviews.csv")
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    texts = [r["text"] for r in csv.DictReader(open(data))]
    real = tok(texts, truncation=True, max_length=16, padding="max_length", return_tensors="np")["attention_mask"].sum(1)
    assert 0 < real.min() and real.max() < 16  # every row is padded

    kw = dict(workers=0, progress=False, device="cpu", batch_size=8, chunk_rows=16, dtype="float32", max_length=16)
    flat = extract_store(f"hf:{ckpt}", str(data), tmp_path / "flat.zarr", layers="block1", tokens="flatten", **kw)
    mean = extract_store(f"hf:{ckpt}", str(data), tmp_path / "mean.zarr", layers="block1", tokens="mean", **kw)
    counts = flat.token_counts
    assert counts is not None and counts.dtype == np.int32 and counts.shape == (flat.n,)
    np.testing.assert_array_equal(counts, real[np.asarray(flat.example_ids)])  # in store row order
    assert flat.attrs["extraction"]["token_counts"] is True
    x = np.asarray(flat.layer("block1"))  # (N, 16, D)
    pad = np.arange(16)[None, :] >= counts[:, None]
    assert np.all(x[pad] == 0)  # padding positions stay zero
    # the average over real tokens (what `--spatial mean` must compute) is the --tokens mean store's
    np.testing.assert_allclose(x.sum(1) / counts[:, None], np.asarray(mean.layer("block1")), rtol=1e-5, atol=1e-6)
    assert mean.token_counts is None and mean.attrs["extraction"]["token_counts"] is False  # nothing padded stored

    report = check_stores([str(tmp_path / "flat.zarr")])
    assert report.ok, report.problems
    # the engine's --spatial mean divides by them: the flatten store averaged is the --tokens mean store
    # (CKA 0.685 between the two when the padding's zeros were averaged in), on every route
    from repsim.engine.drivers import layer_metrics
    from repsim.engine.minibatch import cka_matrix

    both = [str(tmp_path / "flat.zarr"), str(tmp_path / "mean.zarr")]
    for method, shuffle in (("exact", "none"), ("minibatch", "window"), ("minibatch", "examples")):
        res = cka_matrix(both, spatial="mean", method=method, shuffle=shuffle, batch_size=8, epochs=1,
                         progress=False, allow_mixed_datasets=True)
        assert res.values[0, 1] == pytest.approx(1.0, abs=1e-6), (method, shuffle, res.values)
    sep = layer_metrics(both, ["block1"], distances=["cosine"], spatial="mean", progress=False)
    r2 = [sep[(name, "block1")]["separation"]["cosine"] for name in ("flat", "mean")]
    assert r2[0] == pytest.approx(r2[1], rel=1e-5)
    # a store written before token_counts existed is not resumed without them (a setting change)
    older = {**flat.attrs, "extraction": {k: v for k, v in flat.attrs["extraction"].items() if k != "token_counts"}}
    assert any(d.startswith("token_counts: store False vs now True") for d in _compatible(older, flat.attrs))
    # a layer mapped to another module (the model's extract_layers edited between the two runs) is not resumed
    moved = {**flat.attrs, "extraction": {**flat.attrs["extraction"],
                                          "module_names": {**flat.attrs["extraction"]["module_names"], "block1": "x"}}}
    assert any(d.startswith("module_names: store") for d in _compatible(moved, flat.attrs))


def test_token_counts_are_checksummed_and_checked(tmp_path):
    path = str(tmp_path / "s.zarr")
    w = StoreWriter.create(path, n=6, layers={"t": ((4, 2), "float32", "tokens")}, chunk_rows=3, token_counts=True)
    with pytest.raises(ValueError, match="pass token_counts="):
        w.write_chunk(0, layers={"t": np.zeros((3, 4, 2))}, labels=np.zeros(3, int), example_ids=np.arange(3))
    w.write_chunk(0, layers={"t": np.zeros((3, 4, 2))}, labels=np.zeros(3, int), example_ids=np.arange(3),
                  token_counts=np.array([1, 4, 2]))
    w.write_chunk(1, layers={"t": np.zeros((3, 4, 2))}, labels=np.zeros(3, int), example_ids=np.arange(3, 6),
                  token_counts=np.array([3, 5, 2]))  # 5 > 4 tokens
    store = w.finalize()
    np.testing.assert_array_equal(store.token_counts, [1, 4, 2, 3, 5, 2])
    assert store.attrs["layers"] == ["t"] and "token_counts" in store._group["checksums"].attrs["arrays"]
    report = check_stores([path])
    assert any("token_counts out of range 0..4" in p for p in report.problems), report.problems
    # a chunk object of token_counts swapped for the other one is caught by the manifest
    c0, c1 = (Path(path) / "token_counts" / "c" / str(i) for i in (0, 1))
    b0, b1 = c0.read_bytes(), c1.read_bytes()
    c0.write_bytes(b1)
    c1.write_bytes(b0)
    report = check_stores([path])
    assert any("token_counts" in p and "chunk 0" in p for p in report.problems), report.problems


# ------------------------------------------------------------------------- 2. channels-last inside NCHW


class Mlp(nn.Module):
    """timm-style MLP (not a Sequential) that ends in a Linear and a dropout."""

    def __init__(self, c: int):
        super().__init__()
        self.fc1, self.act, self.fc2, self.drop = nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))


class PermNet(nn.Module):
    """An NCHW model whose inner modules see (N, H, W, C) maps, as ConvNeXt's blocks do."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.inner = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))
        self.norm = nn.LayerNorm(6)
        self.mlp = Mlp(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.stem(x)  # (N, 6, 8, 8)
        y = self.mlp(self.norm(self.inner(x.permute(0, 2, 3, 1))))  # (N, 8, 8, 6)
        x = x + y.permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


def test_channels_last_maps_inside_a_channels_first_model_are_reduced_per_channel(tmp_path):
    torch.manual_seed(0)
    net = PermNet().eval()
    x = _images()
    taps = {"stem": "stem", "inner.0": "inner.0", "inner.1": "inner.1", "inner.2": "inner.2", "inner": "inner",
            "norm": "norm", "mlp": "mlp", "mlp.act": "mlp.act", "mlp.fc1:input": "mlp.fc1"}
    ref, mods = {}, dict(net.named_modules())
    hooks = [mods[q].register_forward_hook(lambda m, a, o, k=k: ref.__setitem__(k, o.detach().clone()))
             for k, q in taps.items() if not k.endswith(":input")]
    hooks.append(mods["mlp.fc1"].register_forward_pre_hook(lambda m, a: ref.__setitem__("mlp.fc1:input", a[0].clone())))
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()

    store = extract_store(net, Plain(x), tmp_path / "mean.zarr", layers=",".join(t for t in taps if t != "mlp.fc1:input"),
                          spatial="mean", order="dataset", **FAST)
    for k in taps:
        if k == "mlp.fc1:input":
            continue
        want = ref[k].mean((2, 3)) if k == "stem" else ref[k].mean((1, 2))  # per channel
        np.testing.assert_allclose(np.asarray(store.layer(k)), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    # recorded, so that a store written under the per-model rule is not resumed with these
    assert store.attrs["extraction"]["tap_layouts"] == {k: "NHWC" for k in taps if k not in ("stem", "mlp.fc1:input")}
    flat = extract_store(net, Plain(x), tmp_path / "flat.zarr", layers="norm", order="dataset", **FAST)
    # (float32: the reference forward ran the whole set as one batch, extraction in batches, whose conv
    # blocking rounds differently by a few ulps of these O(1) values; a wrong layout differs by O(1))
    np.testing.assert_allclose(np.asarray(flat.layer("norm")), ref["norm"].permute(0, 3, 1, 2).numpy(),
                               rtol=1e-5, atol=5e-6)


def test_torchvision_convnext_block_internals_keep_their_channels(capsys):
    pytest.importorskip("torchvision")
    inner = "features.1.0.block"
    assert repsim_main(["extract", "--checkpoint", "torchvision:convnext_tiny", "--list-layers", "--image-size", "32",
                        "--spatial", "mean", "--layers", ",".join(["block1", "features.0.1", *(f"{inner}.{i}" for i in range(7))])]) == 0
    rows = {line.split()[0]: line.rstrip().rstrip(")").rsplit("(", 1)[1] for line in capsys.readouterr().out.split("modules that ran once")[0].splitlines()
            if line.strip().startswith(("block1 ", "features"))}
    want = {"block1": "96,", "features.0.1": "96,", f"{inner}.0": "96,", f"{inner}.1": "96,", f"{inner}.2": "96,",
            f"{inner}.3": "384,", f"{inner}.4": "384,", f"{inner}.5": "96,", f"{inner}.6": "96,"}
    assert rows == want


# ----------------------------------------------------------------------------------- 3. array files


def test_resume_after_the_npz_changed_is_refused(tmp_path):
    data = tmp_path / "imgs.npz"
    np.savez(data, images=_images(24, seed=1).numpy(), labels=np.arange(24) % 3)
    torch.manual_seed(0)
    net = PermNet().eval()
    store = extract_store(net, str(data), tmp_path / "a.zarr", layers="stem", **FAST)
    assert store.attrs["dataset"]["fingerprint"].startswith("file sha256 ")
    extract_store(net, str(data), tmp_path / "a.zarr", layers="stem", **FAST)  # the same file: nothing to do
    np.savez(data, images=_images(24, seed=2).numpy(), labels=np.arange(24) % 3)  # same shape, other images
    with pytest.raises(ExtractError, match="dataset.fingerprint"):
        extract_store(net, str(data), tmp_path / "a.zarr", layers="stem", **FAST)
    # a store written before the digest was recorded is refused too: its file cannot be shown to be the same
    older = {**store.attrs, "dataset": {k: v for k, v in store.attrs["dataset"].items() if k != "fingerprint"}}
    assert any(d.startswith("dataset.fingerprint: store None") for d in _compatible(older, store.attrs))


# ------------------------------------------------------------------------------- 4. Python datasets


def test_a_python_dataset_without_name_resumes_in_another_process(tmp_path):
    torch.manual_seed(0)
    net = PermNet().eval()
    x = _images()
    store = extract_store(net, Plain(x), tmp_path / "p.zarr", layers="stem", **FAST)
    assert store.attrs["dataset"]["name"] == "Plain"  # not "<... object at 0x...>"
    assert "fingerprint" in store.attrs["dataset"]
    extract_store(net, Plain(x.clone()), tmp_path / "p.zarr", layers="stem", **FAST)  # another object, same data
    with pytest.raises(ExtractError, match="dataset.fingerprint"):
        extract_store(net, Plain(x + 1), tmp_path / "p.zarr", layers="stem", **FAST)


# --------------------------------------------------------------------- 5, 6, 8, 9. refusals, one line


class Unusual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.unused = nn.Conv2d(4, 4, 1)
        self.shared_map = nn.Parameter(torch.randn(1, 4, 8, 8))
        self.bias = nn.Identity()  # returns the (1, 4, 8, 8) map: one row for any batch
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x) + self.bias(self.shared_map)
        return self.head(x.mean((2, 3)))


def test_layers_forward_never_runs_are_one_line_and_listed(tmp_path, capsys):
    with pytest.raises(ExtractError, match=r"layers \['unused'\].*were not computed by model.forward.*--list-layers"):
        extract_store(Unusual().eval(), Plain(_images()), tmp_path / "u.zarr", layers="unused", **FAST)
    assert not (tmp_path / "u.zarr").exists()
    from repsim.extract.listing import list_layers

    listing = list_layers(Unusual().eval(), layers="stem", image_size=8)
    assert "modules that forward did not run on this example (not listed above; nothing to capture): unused" in listing


def test_cli_unused_layer_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mods.py").write_text("from test_extract_audit import Unusual\n\ndef unusual():\n    return Unusual()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(TESTS))
    np.save(tmp_path / "x.npy", _images().numpy())
    rc = repsim_main(["extract", "--device", "cpu", "--checkpoint", "module:mods:unusual", "--data", "x.npy",
                      "--layers", "unused", "--out", "u.zarr", "--workers", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith("repsim extract: error: layers ['unused']")


def test_outputs_that_are_not_one_row_per_example_are_refused_before_the_store(tmp_path):
    with pytest.raises(ExtractError, match=r"layer 'bias' .*gives shape \(1, 4, 8, 8\) for a batch of shape \(2, 3, 8, 8\)"):
        extract_store(Unusual().eval(), Plain(_images()), tmp_path / "b.zarr", layers="bias", **FAST)
    assert not (tmp_path / "b.zarr").exists()


def test_position_embeddings_of_a_text_model_are_refused_at_the_probe(tmp_path):
    pytest.importorskip("transformers")
    import tiny_models

    ckpt = tiny_models.hf_text_dir(tmp_path / "hf-bert")
    data = _reviews(tmp_path / "reviews.csv")
    with pytest.raises(ExtractError, match=r"embeddings.position_embeddings.*gives shape \(1, 16, 16\) for a batch "
                                           r"of shape input_ids \(2, 16\)"):
        extract_store(f"hf:{ckpt}", str(data), tmp_path / "pe.zarr", layers="embeddings.position_embeddings",
                      max_length=16, **FAST)
    assert not (tmp_path / "pe.zarr").exists()


def test_a_module_named_twice_is_refused(tmp_path):
    from repsim.extract import layer_modules

    torch.manual_seed(0)
    net = PermNet().eval()
    assert layer_modules(net)["block1"] == "inner.2"  # (no repeated blocks: the activations)
    with pytest.raises(ExtractError, match=r"'block1' and 'inner.2' name the same module \('inner.2'\)"):
        extract_store(net, Plain(_images()), tmp_path / "d.zarr", layers="block1,inner.2", **FAST)


def test_a_dict_output_whose_first_value_is_not_a_tensor_says_dict():
    with pytest.raises(TypeError, match="returned a dict whose first value is int, not a tensor"):
        output_tensor("x", {"n": 3, "y": torch.zeros(1)})


# ------------------------------------------------------------------------------ 7. the caller's module


def test_the_caller_s_module_keeps_its_training_mode(tmp_path):
    torch.manual_seed(0)
    net = PermNet().train()
    net.norm.eval()  # a mixed state comes back mixed
    extract_store(net, Plain(_images()), tmp_path / "t.zarr", layers="stem", **FAST)
    assert net.training and net.mlp.training and not net.norm.training
    assert next(net.parameters()).device.type == "cpu"
