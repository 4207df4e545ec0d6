"""Every valid value of `repsim extract`'s options run once (issue 46), through the CLI's ``main()`` in this
process on a tiny ``module:`` network over the digits test split, each store checked against a plain forward
pass of the same network (hooked outputs, reduced as the value says) — not only that the run exits 0. The
values' refusals: tests/test_extract_errors.py; the same options on real models: tests/test_extract*.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from repsim.commands.main import main as repsim_main  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402
from repsim.train.data import build_dataset  # noqa: E402

TESTS = Path(__file__).resolve().parent
BASE = ["--checkpoint", "module:tiny_models:conv", "--data", "digits", "--split", "test", "--workers", "0",
        "--device", "cpu", "--batch-size", "64", "--no-progress"]
QUALS = {"block1": "1", "block2": "3"}  # (ReLU outputs: layer_modules of the Sequential)


@pytest.fixture(autouse=True)
def _tiny_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _net(seed: int = 0) -> torch.nn.Module:
    import tiny_models

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # (a module: source named without weights is built under --seed, default 0)
        return tiny_models.conv().eval()


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, np.ndarray]:
    """The test split's images in dataset order, and their example ids."""
    ds = build_dataset("digits", "test")
    return torch.stack([ds[i][0] for i in range(len(ds))]), np.asarray(ds.example_ids)


def _forward(net: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    mods = dict(net.named_modules())
    got: dict[str, torch.Tensor] = {}
    hooks = [mods[q].register_forward_hook(lambda m, a, out, n=n: got.__setitem__(n, out.detach().clone()))
             for n, q in QUALS.items()]
    hooks.append(mods["5"].register_forward_pre_hook(lambda m, a: got.__setitem__("pool", a[0].detach().clone())))
    with torch.inference_mode():
        got["logits"] = net(x)
    for h in hooks:
        h.remove()
    return got


def _reduce(y: torch.Tensor, spatial: str) -> torch.Tensor:
    if y.ndim != 4 or spatial == "flatten":
        return y
    if spatial == "mean":
        return y.mean(dim=(2, 3))
    return torch.nn.functional.adaptive_avg_pool2d(y, int(spatial[4:]))


# (flags, what the store records, how the reference is made)
VALUES = [
    ["--dtype", "float16"], ["--dtype", "float32"],
    ["--compression", "zstd"], ["--compression", "none"],
    ["--order", "shuffled"], ["--order", "dataset"], ["--order-seed", "3"],
    ["--spatial", "flatten"], ["--spatial", "mean"], ["--spatial", "pool2"],
    ["--memory-format", "auto"], ["--memory-format", "channels_last"], ["--memory-format", "contiguous"],
    ["--amp", "auto"], ["--amp", "off"], ["--amp", "bfloat16"],
    ["--tokens", "cls"], ["--tokens", "mean"], ["--tokens", "last"], ["--tokens", "flatten"],
    ["--layers", "block2,pool"], ["--seed", "4"], ["--chunk-rows", "50"], ["--batch-size", "7"],
    ["--write-threads", "0"], ["--write-threads", "2"], ["--no-space-check"],
]


@pytest.mark.parametrize("flags", VALUES, ids=lambda f: " ".join(f))
def test_extract_option_values_store_the_forward_pass(flags, digits, tmp_path):
    out = tmp_path / "s.zarr"
    assert repsim_main(["extract", *BASE, *flags, "--out", str(out)]) == 0
    store = open_store(out)
    opt = dict(zip(flags[::2], flags[1::2]))
    dtype = opt.get("--dtype", "float16")
    spatial = opt.get("--spatial", "flatten")
    settings = store.attrs["extraction"]
    assert settings["dtype"] == dtype and settings["spatial"] == spatial
    if "--tokens" in opt:
        assert settings["tokens"] == opt["--tokens"]  # (recorded; an image network has no token outputs)
    if "--amp" in opt:  # auto is off on the CPU
        assert settings["amp"] == {"auto": "off", "off": "off", "bfloat16": "bfloat16"}[opt["--amp"]]
    if "--compression" in opt:
        assert settings["compression"] == opt["--compression"]
    fmt = opt.get("--memory-format", "auto")
    assert settings["memory_format"] == ("channels_last" if fmt == "auto" else fmt)  # (2-D convolutions: NHWC)
    # the rows: dataset order, or the documented permutation default_rng(order_seed).permutation(n)
    x, ids = digits
    n = x.shape[0]
    order = (np.arange(n) if opt.get("--order") == "dataset"
             else np.random.default_rng(int(opt.get("--order-seed", 0))).permutation(n))
    np.testing.assert_array_equal(np.asarray(store.example_ids), ids[order])
    ref = _forward(_net(int(opt.get("--seed", 0))), x[torch.as_tensor(order)])
    layers = opt["--layers"].split(",") if "--layers" in opt else ["block1", "block2", "pool"]
    # the default is every registry layer, logits among them; with --layers the logits are stored beside
    assert store.layers == (layers if "--layers" in opt else [*layers, "logits"]), store.layers
    # float16 stores: the reference rounded to float16 (a rounding step apart where float32 sums differ);
    # bfloat16 autocast: the network computed with 8-bit mantissas (relative 2^-8 per op, a few ops deep)
    rtol = 3e-2 if opt.get("--amp") == "bfloat16" else 1e-3 if dtype == "float16" else 1e-5
    for name in [*layers, "logits"]:
        want = _reduce(ref[name], spatial if name in QUALS else "flatten").float().numpy()
        got = np.asarray(store.logits if name == "logits" else store.layer(name), dtype=np.float32)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=name)
        if dtype == "float16" and name != "logits":
            assert store.zarr_array(name).dtype == np.float16
