"""repsim/extract/ end to end on the digits set with the small ResNet of repsim/train/ (issue 6 acceptance).

Real checkpoints (repsim.train.checkpoint format), real Zarr stores on disk, real subprocesses for the
SIGKILL/resume and torchrun/gloo tests.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")
pytest.importorskip("repsim.train.models")

from repsim.extract import ExtractError, extract_store, layer_modules  # noqa: E402
from repsim.commands.main import main as repsim_main  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402
from repsim.train.checkpoint import load_model, save_checkpoint  # noqa: E402
from repsim.train.config import load_config  # noqa: E402
from repsim.train.data import build_dataset  # noqa: E402
from repsim.train.models import build_network  # noqa: E402

BLOCKS = [f"block{i}" for i in range(1, 17)]
FAST = dict(workers=0, progress=False, device="cpu")


def _config(seed: int) -> dict:
    """The digits preset's run config (mini ResNet, 16 bottlenecks), narrower, on all ten digits."""
    cfg = load_config("digits-label_smoothing")
    cfg["data"]["spec"] = "digits"
    cfg.update(seed=seed, num_classes=10, objective_params={"alpha": 0.1})
    cfg["arch_params"] = {"width": 4, "layers": [3, 4, 6, 3]}
    return cfg


def _make_checkpoint(path: Path, seed: int) -> Path:
    """A small ResNet (16 bottlenecks) with non-trivial BN statistics, saved as repsim/train/ saves it."""
    torch.manual_seed(seed)
    net = build_network(_config(seed))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    state = net.state_dict()
    save_checkpoint({"config": _config(seed), "model": state, "ema": state, "epoch": 7 + seed}, path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("ckpt")
    return [_make_checkpoint(d / f"seed{s}" / "last.pt", s) for s in (0, 1)]


@pytest.fixture(scope="module")
def digits():
    return build_dataset("digits", "test")


def _reference(model, dataset, batch_size: int, channels_last: bool = False) -> dict[str, np.ndarray]:
    """Direct forward passes with plain hooks, batches [0:b], [b:2b], ...: every registry layer
    (``channels_last``: weights and batches in NHWC memory, as extraction runs conv nets by default)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    modules = dict(model.named_modules())
    got: dict[str, list] = {name: [] for name in layer_modules(model)}
    handles = [
        modules[qual].register_forward_hook(lambda m, i, o, name=name: got[name].append(o.detach().clone()))
        for name, qual in layer_modules(model).items()
    ]
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.inference_mode():
        for lo in range(0, len(x), batch_size):
            model(x[lo: lo + batch_size].contiguous(memory_format=fmt))
    for h in handles:
        h.remove()
    return {name: torch.cat(v).numpy() for name, v in got.items()}


def _arrays(path) -> dict[str, bytes]:
    """Every array of a store as raw bytes (the byte-identity the resume and sharding tests need)."""
    g = zarr.open_group(str(path), mode="r")
    out = {}
    for name in ("example_ids", "labels", "logits", "written", "head/weight", "head/bias"):
        out[name] = np.asarray(g[name][...]).tobytes()
    for name in g["layers"].array_keys():
        out[f"layers/{name}"] = np.asarray(g[f"layers/{name}"][...]).tobytes()
    return out


def _chunk_files(path) -> dict[str, bytes]:
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("c/*")) if p.is_file()}


# ----------------------------------------------------------------------------------- schema, values


def test_schema_and_values_equal_direct_forward(ckpts, digits, tmp_path):
    model = load_model(ckpts[0])
    n = len(digits)
    perm = np.random.default_rng(0).permutation(n)  # default row order: fixed seeded permutation
    refs = {fmt: _reference(model, torch.utils.data.Subset(digits, perm), 32, channels_last=fmt == "channels_last")
            for fmt in ("contiguous", "channels_last")}
    s32 = extract_store(ckpts[0], "digits", tmp_path / "f32.zarr", split="test", dtype="float32",
                        batch_size=32, chunk_rows=64, memory_format="contiguous", **FAST)
    s16 = extract_store(ckpts[0], digits, tmp_path / "f16.zarr", split="test", batch_size=32, chunk_rows=64, **FAST)
    assert s32.attrs["extraction"]["memory_format"] == "contiguous"
    assert s16.attrs["extraction"]["memory_format"] == "channels_last"  # the default for a conv net
    for store, dt in ((s32, np.float32), (s16, np.float16)):
        ref = refs[store.attrs["extraction"]["memory_format"]]
        assert store.complete and store.n == n and store.chunk_rows == 64
        assert store.layers == BLOCKS + ["pool", "logits"]
        np.testing.assert_array_equal(store.example_ids, np.asarray(digits.example_ids)[perm])
        np.testing.assert_array_equal(store.labels, np.asarray(digits.targets)[perm])
        assert store.labels.dtype == np.int32 and store.example_ids.dtype == np.int64
        for name in store.layers:
            arr = store.zarr_array(name)
            assert arr.chunks[0] == 64 and arr.chunks[1:] == arr.shape[1:], name  # chunked along N only
            assert arr.shape == ref[name].shape, name
            want_dt = np.float32 if name == "logits" else dt
            assert arr.dtype == want_dt, name
            got = store.layer(name).compute()
            # float32: bit-exact; float16: exactly the float32 values rounded to nearest float16
            np.testing.assert_array_equal(got, ref[name].astype(want_dt), err_msg=name)
        assert store.zarr_array("block1").metadata.dimension_names == ("example", "channel", "y", "x")
        np.testing.assert_array_equal(store.logits.compute(), ref["logits"])
        assert store.zarr_array("logits").dtype == np.float32
        W, b = store.head
        np.testing.assert_array_equal(W, model.head.weight.detach().numpy())
        np.testing.assert_array_equal(b, model.head.bias.detach().numpy())
        assert zarr.open_group(store.path)["written"][...].all()
    attrs = s16.attrs
    assert attrs["repsim_store_version"] == 2 and attrs["complete"] is True and attrs["repsim_version"]
    m = attrs["model"]
    assert (m["arch"], m["objective"], m["params"], m["seed"], m["epoch"]) == (
        "mini_resnet", "label_smoothing", {"alpha": 0.1}, 0, 7)
    import hashlib

    assert m["checkpoint_sha256"] == hashlib.sha256(ckpts[0].read_bytes()).hexdigest()
    assert attrs["dataset"] == {"name": "digits", "split": "test", "n": n, "transform": "standardise",
                                "num_classes": 10, "order": "shuffled(seed=0)"}
    ex = attrs["extraction"]
    assert (ex["dtype"], ex["spatial"], ex["amp"], ex["batch_size"]) == ("float16", "flatten", "off", 32)
    assert ex["module_names"]["block16"] == "backbone.layer4.2" and ex["module_names"]["pool"] == "backbone"


def test_dataset_order_keeps_rows_in_dataset_order(ckpts, digits, tmp_path):
    model = load_model(ckpts[0])
    ref = _reference(model, digits, 32, channels_last=True)  # extraction's default for a conv net
    store = extract_store(ckpts[0], digits, tmp_path / "ordered.zarr", split="test", dtype="float32",
                          batch_size=32, chunk_rows=64, layers="pool", order="dataset", **FAST)
    np.testing.assert_array_equal(store.example_ids, digits.example_ids)
    np.testing.assert_array_equal(store.labels, digits.targets)
    np.testing.assert_array_equal(store.layer("pool").compute(), ref["pool"])
    assert store.attrs["dataset"]["order"] == "dataset"
    with pytest.raises(ValueError, match="--order"):
        extract_store(ckpts[0], digits, tmp_path / "bad.zarr", split="test", order="random", **FAST)


def test_spatial_reduction_and_layer_subset(ckpts, digits, tmp_path):
    model = load_model(ckpts[0])
    ref = _reference(model, digits, 50, channels_last=True)  # extraction's default for a conv net
    common = dict(split="test", dtype="float32", batch_size=50, chunk_rows=100, order="dataset", **FAST)
    mean = extract_store(ckpts[0], digits, tmp_path / "mean.zarr", layers="block1,block1?,pool", spatial="mean", **common)
    assert mean.layers == ["block1"] + [f"block1{i}" for i in range(7)] + ["pool"]
    np.testing.assert_allclose(mean.layer("block1").compute(), ref["block1"].mean(axis=(2, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean.layer("block16").compute(), ref["pool"], rtol=1e-6, atol=1e-6)
    pooled = extract_store(ckpts[0], digits, tmp_path / "pool.zarr", layers=["block2"], spatial="pool2", **common)
    got = pooled.layer("block2").compute()
    r = ref["block2"]  # (N, C, 8, 8) -> 2x2 cells of 4x4
    assert got.shape == (len(digits), r.shape[1], 2, 2)
    np.testing.assert_allclose(got, r.reshape(*r.shape[:2], 2, 4, 2, 4).mean(axis=(3, 5)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pooled.logits.compute(), ref["logits"])  # logits are always stored


def test_autocast_maps_are_averaged_in_float32_and_older_stores_are_not_resumed(ckpts, digits, tmp_path):
    """Under ``--amp bfloat16`` a block's map is bfloat16; its spatial mean and pool<k> are taken and
    kept in float32 (bfloat16 averages round to 8 bits: ~0.3 % off in a float32 store). A store
    written before (averages in the autocast dtype) is not resumed; one written without autocast is."""
    model = load_model(ckpts[0]).eval()
    modules = dict(model.named_modules())
    got: dict[str, list] = {"block5": [], "block9": []}
    hooks = [modules[layer_modules(model)[name]].register_forward_hook(
        lambda m, i, o, name=name: got[name].append(o.detach().clone())) for name in got]
    x = torch.stack([digits[i][0] for i in range(len(digits))])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for lo in range(0, len(x), 50):
            model(x[lo: lo + 50])
    for h in hooks:
        h.remove()
    raw = {name: torch.cat(v) for name, v in got.items()}
    assert raw["block5"].dtype == torch.bfloat16
    common = dict(split="test", dtype="float32", batch_size=50, chunk_rows=100, order="dataset", amp="bfloat16",
                  memory_format="contiguous", **FAST)
    mean = extract_store(ckpts[0], digits, tmp_path / "mean.zarr", layers="block5,block9", spatial="mean", **common)
    for name, r in raw.items():
        want = r.double().mean(dim=(2, 3)).numpy()
        np.testing.assert_allclose(mean.layer(name).compute(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        rounded = r.mean(dim=(2, 3)).double().numpy()  # what the bfloat16 average stored
        assert np.abs(rounded - want).max() > 1e-4 * np.abs(want).max()  # the test can tell them apart
    pooled = extract_store(ckpts[0], digits, tmp_path / "pool.zarr", layers="block5", spatial="pool2", **common)
    r = raw["block5"].double().numpy()
    want = r.reshape(*r.shape[:2], 2, r.shape[2] // 2, 2, r.shape[3] // 2).mean(axis=(3, 5))
    np.testing.assert_allclose(pooled.layer("block5").compute(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert mean.attrs["extraction"]["reductions"] == "float32"

    def drop_reductions(path):  # a store from before the setting
        g = zarr.open_group(str(path), mode="r+")
        g.attrs["extraction"] = {k: v for k, v in g.attrs["extraction"].items() if k != "reductions"}

    drop_reductions(tmp_path / "mean.zarr")
    with pytest.raises(ExtractError, match="reductions: store 'autocast dtype' vs now 'float32'"):
        extract_store(ckpts[0], digits, tmp_path / "mean.zarr", layers="block5,block9", spatial="mean", **common)
    plain = {**common, "amp": "off"}
    extract_store(ckpts[0], digits, tmp_path / "off.zarr", layers="block5", spatial="mean", **plain)
    drop_reductions(tmp_path / "off.zarr")
    assert extract_store(ckpts[0], digits, tmp_path / "off.zarr", layers="block5", spatial="mean", **plain).complete


def test_write_modes_give_identical_bytes(ckpts, digits, tmp_path):
    """Inline, overlapped and burst writing produce the same store (only the scheduling differs)."""
    common = dict(split="test", layers="block1,block9,pool", batch_size=32, chunk_rows=64, **FAST)
    stores = {
        "inline": extract_store(ckpts[0], digits, tmp_path / "inline.zarr", write_threads=0, **common),
        "overlap": extract_store(ckpts[0], digits, tmp_path / "overlap.zarr", write_threads=2, overlap=True, **common),
        "burst": extract_store(ckpts[0], digits, tmp_path / "burst.zarr", write_threads=3, overlap=False, **common),
    }
    ref = _arrays(stores["inline"].path)
    for mode in ("overlap", "burst"):
        assert _arrays(stores[mode].path) == ref, mode


def test_uncompressed_store_holds_the_same_values(ckpts, digits, tmp_path):
    """--compression none: same arrays as zstd, chunks are raw bytes + crc32c, and resuming with
    another compression is refused."""
    common = dict(split="test", layers="block1,pool", batch_size=64, chunk_rows=128, **FAST)
    z = extract_store(ckpts[0], digits, tmp_path / "z.zarr", **common)
    raw = extract_store(ckpts[0], digits, tmp_path / "raw.zarr", compression="none", **common)
    assert raw.attrs["compression"] == "none" and z.attrs["compression"] == "zstd"
    assert raw.attrs["extraction"]["compression"] == "none"
    for name in ("block1", "pool"):
        np.testing.assert_array_equal(raw.layer(name).compute().view(np.uint16), z.layer(name).compute().view(np.uint16))
        codecs = [c["name"] for c in raw.zarr_array(name).metadata.to_dict()["codecs"]]
        assert codecs == ["bytes", "crc32c"]
    size = lambda p: sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())  # noqa: E731
    assert size(raw.path) > size(z.path)
    with pytest.raises(ExtractError, match="compression"):
        extract_store(ckpts[0], digits, tmp_path / "raw.zarr", **common)  # exists with other settings
    with pytest.raises(ExtractError, match="--compression"):
        extract_store(ckpts[0], digits, tmp_path / "bad.zarr", compression="lz4", **common)


def test_two_networks_stores_align_batch_cli(ckpts, tmp_path):
    rc = repsim_main([  # no --data: the runs' own dataset (digits), with their evaluation transform
        "extract", "--checkpoint", str(ckpts[0]), "--checkpoint", str(ckpts[1]), "--name", "{parent}",
        "--split", "test", "--out-dir", str(tmp_path / "stores"),
        "--layers", "block16,pool", "--spatial", "mean", "--workers", "0", "--device", "cpu",
    ])
    assert rc == 0
    a, b = open_store(tmp_path / "stores" / "seed0.zarr"), open_store(tmp_path / "stores" / "seed1.zarr")
    np.testing.assert_array_equal(a.example_ids, b.example_ids)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert a.layers == b.layers == ["block16", "pool"] and a.n == b.n
    assert a.dataset["name"] == "digits" and a.dataset["split"] == "test"
    assert (a.model["seed"], b.model["seed"]) == (0, 1)
    assert a.model["checkpoint_sha256"] != b.model["checkpoint_sha256"]
    assert not np.array_equal(a.layer("pool").compute(), b.layer("pool").compute())
    # two checkpoints named alike need a template that tells them apart
    rc = repsim_main(["extract", "--checkpoint", str(ckpts[0]), "--checkpoint", str(ckpts[1]), "--data", "digits",
                      "--out-dir", str(tmp_path / "x")])
    assert rc == 2


@contextmanager
def torch_threads(k: int):
    before = torch.get_num_threads()
    torch.set_num_threads(k)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_checkpoints_side_by_side_write_the_stores_one_at_a_time_writes(ckpts, tmp_path):
    """--jobs 2 (one forked process per checkpoint) writes byte-identical stores to --jobs 1."""
    common = ["--checkpoint", str(ckpts[0]), "--checkpoint", str(ckpts[1]), "--name", "{parent}", "--split", "test",
              "--layers", "block1,block16,pool", "--batch-size", "64", "--workers", "0", "--device", "cpu"]
    with torch_threads(max(1, (os.cpu_count() or 1) // 2)):  # as each of the 2 jobs gets: same intra-op threads
        assert repsim_main(["extract", *common, "--out-dir", str(tmp_path / "one"), "--jobs", "1"]) == 0
        assert repsim_main(["extract", *common, "--out-dir", str(tmp_path / "two"), "--jobs", "2"]) == 0
    for name in ("seed0.zarr", "seed1.zarr"):
        one, two = tmp_path / "one" / name, tmp_path / "two" / name
        assert _chunk_files(one) == _chunk_files(two) and _chunk_files(one)
        a, b = open_store(one).attrs, open_store(two).attrs
        own = ("created", "store_uuid")  # when and which store: differ between any two writes
        assert {k: v for k, v in a.items() if k not in own} == {k: v for k, v in b.items() if k not in own}
    assert repsim_main(["extract", *common, "--out-dir", str(tmp_path / "bad"), "--jobs", "0"]) == 2


def test_a_failing_side_by_side_job_is_one_line(ckpts, tmp_path, capsys):
    """An error in a forked job reaches the one CLI error path as the lone run would raise it."""
    fake = tmp_path / "fake" / "checkpoint.pt"
    fake.parent.mkdir()
    fake.write_bytes(b"not a checkpoint at all")
    argv = ["extract", "--checkpoint", str(ckpts[0]), "--checkpoint", str(fake), "--name", "{parent}",
            "--split", "test", "--layers", "pool", "--batch-size", "64", "--workers", "0", "--device", "cpu",
            "--out-dir", str(tmp_path / "out"), "--jobs", "2"]
    assert repsim_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a readable repsim checkpoint" in err[0], err


# ----------------------------------------------------------------------------------- resume


def _cli(ckpt, out, *extra) -> list[str]:
    return ["--checkpoint", str(ckpt), "--data", "digits", "--split", "test", "--out", str(out),
            "--chunk-rows", "32", "--batch-size", "16", "--workers", "0", "--device", "cpu",
            "--write-threads", "1", *extra]


# ``repsim extract`` that SIGKILLs itself right after its second chunk is written (flag set): a known point
KILLED_AFTER_2_CHUNKS = """
import os, signal, sys
from repsim.store.writer import StoreWriter
write, done = StoreWriter.write_chunk, []
def write_then_die(self, *a, **k):
    write(self, *a, **k)
    done.append(1)
    if len(done) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
StoreWriter.write_chunk = write_then_die
from repsim.commands.main import main
sys.exit(main(["extract", *sys.argv[1:]]))
"""


def _killed_mid_run(ckpt, out, *extra) -> np.ndarray:
    """Run ``repsim extract`` into ``out``, killed (SIGKILL) right after its second chunk; the flags."""
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_2_CHUNKS, *_cli(ckpt, out, *extra)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)  # a hang guard, not a speed check
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill: {proc.stderr[-2000:]}"
    flags = zarr.open_array(str(out / "written"), mode="r")[...]
    assert flags.sum() == 2 < flags.size, "the kill must land mid-run, after 2 chunks"
    with pytest.raises(ValueError, match="incomplete"):
        open_store(out)
    return flags


def test_sigkill_then_rerun_is_byte_identical(ckpts, tmp_path, capsys):
    whole, killed = tmp_path / "whole.zarr", tmp_path / "killed.zarr"
    flags = _killed_mid_run(ckpts[0], killed)

    # the same command again (in this process, same thread count) resumes; a fresh run for reference
    assert repsim_main(["extract", *_cli(ckpts[0], killed)]) == 0
    assert f"resuming {killed}: {flags.sum()} of {flags.size} chunks already written" in capsys.readouterr().err
    assert repsim_main(["extract", *_cli(ckpts[0], whole)]) == 0
    assert open_store(killed).complete
    a, b = _arrays(whole), _arrays(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name
    assert _chunk_files(whole) == _chunk_files(killed)  # even the compressed chunk objects

    # rerunning a complete store does nothing; other settings are refused, not mixed in
    capsys.readouterr()
    assert repsim_main(["extract", *_cli(ckpts[0], whole)]) == 0
    assert "already complete" in capsys.readouterr().err
    assert repsim_main(["extract", *_cli(ckpts[0], killed, "--dtype", "float32")]) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "dtype: store 'float16' vs now 'float32'" in err


def test_resume_in_another_row_order_is_refused_not_mixed(ckpts, tmp_path, capsys):
    """Issue 15, reproduction 1: a rerun with another --order-seed used to finish the store with rows of
    two permutations (297 duplicate ids) and exit 0."""
    out = tmp_path / "b.zarr"
    flags = _killed_mid_run(ckpts[0], out)
    before = _chunk_files(out)
    capsys.readouterr()
    assert repsim_main(["extract", *_cli(ckpts[0], out, "--order-seed", "3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0], err
    assert "order: store 'shuffled(seed=0)' vs now 'shuffled(seed=3)'" in err[0]
    assert "dataset.order: store 'shuffled(seed=0)' vs now 'shuffled(seed=3)'" in err[0]
    assert _chunk_files(out) == before and not open_store(out, allow_incomplete=True).complete
    # a store from before the order was recorded (no attribute) is checked on its rows instead
    g = zarr.open_group(str(out), mode="r+")
    g.attrs.update({"extraction": {k: v for k, v in g.attrs["extraction"].items() if k != "order"},
                    "dataset": {k: v for k, v in g.attrs["dataset"].items() if k != "order"}})
    assert repsim_main(["extract", *_cli(ckpts[0], out, "--order", "dataset")]) == 2
    err = capsys.readouterr().err
    assert "was written in another row order" in err and "but this run puts example" in err, err
    assert np.array_equal(zarr.open_array(str(out / "written"), mode="r")[...], flags)


def test_overwrite_never_deletes_a_file_that_is_not_a_store(ckpts, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    assert repsim_main(["extract", *_cli(ckpts[0], notes, "--overwrite")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("extract: ")]  # (notes)
    assert len(err) == 1 and "refusing to overwrite" in err[0] and "not a directory" in err[0], err
    assert notes.read_text() == "precious"


@pytest.mark.parametrize("content", [b"not a checkpoint at all", bytes(range(256)) * 8])
def test_a_fake_checkpoint_is_one_line_without_torch_advice(tmp_path, capsys, content):
    fake = tmp_path / "fake.pt"
    fake.write_bytes(content)
    assert repsim_main(["extract", *_cli(fake, tmp_path / "s.zarr")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a readable repsim checkpoint" in err[0], err
    assert "file an issue" not in err[0] and "weights_only" not in err[0]


def test_a_full_disk_is_one_line_and_the_store_stays_resumable(ckpts, tmp_path):
    import resource

    out = tmp_path / "full" / "s.zarr"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # noqa: E731
    run = subprocess.run([sys.executable, "-m", "repsim.extract", *_cli(ckpts[0], out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240, preexec_fn=limit)
    err = [line for line in run.stderr.splitlines() if not line.startswith("extract: ")]  # (progress notes)
    assert run.returncode == 3 and len(err) == 1, run.stderr
    assert err[0].startswith(f"repsim extract: error: {out}/") and "File too large" in err[0], err
    assert not list(out.rglob("*.part"))  # no temporary chunk file left behind


# ----------------------------------------------------------------------------------- refusals


class _ViewNet(torch.nn.Module):
    """A conv net that flattens with ``.view`` (as older model code does): NHWC strides break it."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.fc(h.view(h.shape[0], -1))


def test_memory_format_default_fallback_refusal_and_resume(ckpts, digits, tmp_path):
    """channels_last by default for conv nets (values equal up to float rounding); a model that
    cannot run NHWC falls back to contiguous under ``auto`` and is refused when it is asked for;
    a store resumes only with its own memory format (stores from before the setting: contiguous)."""
    cl = extract_store(ckpts[0], digits, tmp_path / "cl.zarr", batch_size=64, dtype="float32", **FAST)
    co = extract_store(ckpts[0], digits, tmp_path / "co.zarr", batch_size=64, dtype="float32",
                       memory_format="contiguous", **FAST)
    assert (cl.attrs["extraction"]["memory_format"], co.attrs["extraction"]["memory_format"]) == (
        "channels_last", "contiguous")
    for name in cl.layers:
        a, b = cl.layer(name).compute(), co.layer(name).compute()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()), err_msg=name)
    with pytest.raises(ExtractError, match="memory_format: store 'contiguous' vs now 'channels_last'"):
        extract_store(ckpts[0], digits, tmp_path / "co.zarr", batch_size=64, dtype="float32", **FAST)
    # a store written before the setting existed was contiguous
    g = zarr.open_group(str(tmp_path / "co.zarr"), mode="r+")
    g.attrs["extraction"] = {k: v for k, v in g.attrs["extraction"].items() if k != "memory_format"}
    with pytest.raises(ExtractError, match="memory_format: store 'contiguous' vs now 'channels_last'"):
        extract_store(ckpts[0], digits, tmp_path / "co.zarr", batch_size=64, dtype="float32", **FAST)
    assert extract_store(ckpts[0], digits, tmp_path / "co.zarr", batch_size=64, dtype="float32",
                         memory_format="contiguous", **FAST).complete

    given = load_model(ckpts[0])  # a caller's module is run channels-last and handed back contiguous
    s = extract_store(given, digits, tmp_path / "given.zarr", layers="block1", batch_size=64, **FAST)
    assert s.attrs["extraction"]["memory_format"] == "channels_last"
    assert all(p.is_contiguous() for p in given.parameters())
    given.to(memory_format=torch.channels_last)  # ... and a channels-last one channels-last, untouched
    before = {k: p.data_ptr() for k, p in given.named_parameters()}
    extract_store(given, digits, tmp_path / "given_cl.zarr", layers="block1", batch_size=64, **FAST)
    assert {k: p.data_ptr() for k, p in given.named_parameters()} == before

    torch.manual_seed(0)
    net = _ViewNet().eval()
    with pytest.raises(RuntimeError, match="view"):  # the premise: NHWC strides break .view here
        net.to(memory_format=torch.channels_last)(torch.randn(2, 1, 8, 8).contiguous(memory_format=torch.channels_last))
    s = extract_store(net, digits, tmp_path / "view.zarr", layers="conv", batch_size=64, dtype="float32", **FAST)
    assert s.attrs["extraction"]["memory_format"] == "contiguous"
    perm = np.random.default_rng(0).permutation(len(digits))  # the default row order
    x = torch.stack([digits[int(i)][0] for i in perm[:64]])
    with torch.inference_mode():
        want = net.conv(x.contiguous()).numpy()
    np.testing.assert_array_equal(s.read_chunk("conv", 0)[:64], want)
    with pytest.raises(ExtractError, match="model failed on the first example"):
        extract_store(net, digits, tmp_path / "view2.zarr", layers="conv", memory_format="channels_last", **FAST)
    with pytest.raises(ExtractError, match="--memory-format must be one of"):
        extract_store(net, digits, tmp_path / "view3.zarr", layers="conv", memory_format="nhwc", **FAST)


def test_float16_overflow_is_refused_naming_the_layer(ckpts, digits, tmp_path):
    model = load_model(ckpts[0])
    with torch.no_grad():
        model.backbone.layer2[1].bn3.weight.mul_(1e6)  # block5 = layer2.1 now exceeds float16 range
    out = tmp_path / "overflow.zarr"
    with pytest.raises(ExtractError, match=r"layer 'block5' overflows float16.*--dtype float32"):
        extract_store(model, digits, out, split="test", batch_size=64, chunk_rows=64, **FAST)
    assert not open_store(out, allow_incomplete=True).complete
    assert not zarr.open_group(str(out))["written"][...].any()
    s32 = extract_store(model, digits, tmp_path / "ok32.zarr", split="test", dtype="float32", batch_size=64, **FAST)
    big = s32.layer("block5").compute()
    assert np.isfinite(big).all() and np.abs(big).max() > 65504


def test_refuses_when_the_disk_lacks_room(ckpts, digits, tmp_path, capsys):
    class Huge(torch.utils.data.Dataset):  # 10^12 examples: the estimate exceeds any disk
        name = "digits-huge"

        def __len__(self):
            return 10**12

        def __getitem__(self, i):
            return digits[i % len(digits)]

    out = tmp_path / "huge.zarr"
    with pytest.raises(ExtractError, match="not enough disk space") as exc:
        extract_store(ckpts[0], Huge(), out, split="test", layers="pool", **FAST)  # float16, the default
    assert "--dtype" not in str(exc.value)  # already float16: no such advice
    assert not out.exists()
    assert "uncompressed (upper bound" in capsys.readouterr().err
    with pytest.raises(ExtractError, match="not enough disk space.*or --dtype float16"):
        extract_store(ckpts[0], Huge(), out, split="test", layers="pool", dtype="float32", **FAST)


# ----------------------------------------------------------------------------------- sharding


@pytest.mark.slow  # three torchrun / extraction runs
def test_torchrun_extraction_killed_mid_run_resumes_to_the_single_process_store(ckpts, tmp_path):
    """Each of 2 torchrun ranks SIGKILLs itself right after writing its 2nd chunk (a known point; torchrun
    then ends the run): 2 to 4 chunks are written (rank 1 may be stopped by torchrun before its own kill),
    the store is incomplete; the same torchrun command resumes it, and the store equals a single process's,
    byte for byte. The chunks of the killed run are a fresh sharded run's (rank 0 creates the store, each
    rank writes its shard), so this is also the check that a 2-process extraction equals one process's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = ["--checkpoint", str(ckpts[1]), "--data", "digits", "--split", "test", "--chunk-rows", "32",
            "--batch-size", "16", "--workers", "0", "--device", "cpu"]
    out = tmp_path / "sharded.zarr"
    killer = tmp_path / "killed_after_2_chunks.py"
    killer.write_text(KILLED_AFTER_2_CHUNKS)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    killed = subprocess.run([*torchrun, str(killer), *args, "--out", str(out)], env=env, capture_output=True,
                            text=True, timeout=300)  # a hang guard, not a speed check
    assert killed.returncode != 0, killed.stderr[-3000:]
    flags = zarr.open_array(str(out / "written"), mode="r")[...]
    assert 2 <= flags.sum() <= 4 < flags.size, flags
    with pytest.raises(ValueError, match="incomplete"):
        open_store(out)
    resumed = subprocess.run([*torchrun, "-m", "repsim.extract", *args, "--out", str(out)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {out}: {flags.sum()} of {flags.size} chunks already written" in resumed.stderr
    single = extract_store(ckpts[1], "digits", tmp_path / "single.zarr", split="test", chunk_rows=32,
                           batch_size=16, **FAST)
    s = open_store(out)
    assert s.complete and s.attrs["extraction"]["world_size"] == 2
    a, b = _arrays(single.path), _arrays(out)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


@pytest.mark.parametrize("objective,given,want", [
    ("cosine_softmax", {}, {"tau": 0.05, "scale_by_tau": False}),
    ("cosine_softmax", {"tau": 0.2}, {"tau": 0.2, "scale_by_tau": False}),
    ("softmax", {}, {}),
    ("logit_norm+dropout", {"keep_prob": 0.9}, {"tau": 0.04, "keep_prob": 0.9}),
    ("an_objective_of_other_code", {"x": 1}, {"x": 1}),
])
def test_store_provenance_records_the_objective_defaults_too(objective, given, want):
    """attrs["model"]["params"] is what the network trained with, defaults included (Table 4 from the
    stores alone needs τ even when a run kept the default)."""
    from repsim.extract.sources import model_meta

    class Net(torch.nn.Module):
        config = {"arch": "mini_resnet", "objective": objective, "objective_params": given, "seed": 3}

    assert model_meta(Net())["params"] == want


def test_jobs_default_per_device(monkeypatch):
    """--jobs by default: one per core on the CPU; on one GPU up to GPU_JOBS, at most one per two
    cores; one checkpoint or torchrun: 1."""
    from repsim.extract import cli

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cli._jobs(None, 18, "cpu", False) == 16
    assert cli._jobs(None, 18, "cuda", False) == cli.GPU_JOBS == 4
    assert cli._jobs(None, 3, "cuda:0", False) == 3
    assert cli._jobs(None, 1, "cuda", False) == 1 and cli._jobs(None, 18, "cuda", True) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert cli._jobs(None, 18, "cuda", False) == 1 and cli._jobs(None, 18, "cpu", False) == 2
    assert cli._jobs(3, 18, "cuda", False) == 3


def test_checkpoints_as_threads_write_the_stores_one_at_a_time_writes(ckpts, tmp_path, monkeypatch):
    """On a GPU with a dataset held in memory, --jobs runs the checkpoints as threads of one process
    (repsim/extract/cli.py): the stores are byte-identical to one-at-a-time ones (here on the CPU, the same
    thread path without CUDA streams), and a failing job is one error."""
    from repsim.extract import cli

    common = ["--checkpoint", str(ckpts[0]), "--checkpoint", str(ckpts[1]), "--name", "{parent}", "--data", "digits",
              "--split", "test", "--layers", "block1,block16,pool", "--batch-size", "64", "--workers", "0",
              "--device", "cpu"]
    assert repsim_main(["extract", *common, "--out-dir", str(tmp_path / "one"), "--jobs", "1"]) == 0
    called = []
    real = cli._extract_in_threads
    monkeypatch.setattr(cli, "_on_gpu", lambda device: True)  # take the GPU's branch, run on the CPU
    monkeypatch.setattr(cli, "_extract_in_threads", lambda *a: called.append(a[-1]) or real(*a))
    assert repsim_main(["extract", *common, "--out-dir", str(tmp_path / "two"), "--jobs", "2"]) == 0
    assert called == [2]
    for name in ("seed0.zarr", "seed1.zarr"):
        one, two = tmp_path / "one" / name, tmp_path / "two" / name
        assert _chunk_files(one) == _chunk_files(two) and _chunk_files(one)
    from repsim.extract import pipeline
    assert pipeline._CPUS is None and not pipeline.LOADER_SPAWN.is_set()  # restored
    fake = tmp_path / "fake" / "checkpoint.pt"
    fake.parent.mkdir()
    fake.write_bytes(b"not a checkpoint at all")
    bad = ["extract", "--checkpoint", str(ckpts[0]), "--checkpoint", str(fake), "--name", "{parent}", "--data",
           "digits", "--split", "test", "--layers", "pool", "--batch-size", "64", "--workers", "0", "--device", "cpu",
           "--out-dir", str(tmp_path / "bad"), "--jobs", "2"]
    assert repsim_main(bad) == 2


def test_cuda_device_resolution():
    """--device resolves to the CUDA device the thread path sets (an explicit index kept), or None."""
    import torch

    from repsim.extract import cli

    assert cli._cuda_device("cpu") is None and not cli._on_gpu("cpu")
    assert cli._cuda_device("cuda:1") == torch.device("cuda", 1) and cli._on_gpu("cuda")
    assert (cli._cuda_device(None) is None) == (not torch.cuda.is_available())


def test_in_memory_specs():
    from repsim.extract.memory import in_memory_spec

    assert all(in_memory_spec(s) for s in ("digits", "synthetic", "fashion-source", "fashion-target@2000", "x.npz"))
    assert not any(in_memory_spec(s) for s in (None, "cifar10", "/data/imagenet", "list.csv"))


def test_the_demo_extract_stage_forks_workers_that_take_the_networks_in_turn(ckpts, tmp_path):
    """`python -m repsim.analyses.command_runs --jobs 2` (the demo's extract stage): one process, two forked
    workers, an ``@@item`` line per network, stores bitwise equal to a network's own process; a
    failing network's status and name."""
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cmds(ckpt, out):
        return [["extract", "--checkpoint", str(ckpt), "--data", "digits", "--split", "test", "--out", str(out),
                 "--no-progress", "--workers", "0", "--layers", "block1,pool"]]

    networks = [{"name": f"net{i}", "commands": cmds(c, tmp_path / "forked" / f"net{i}.zarr")} for i, c in enumerate(ckpts)]
    run = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", "--jobs", "2", json.dumps(networks)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    items = sorted(json.loads(ln[len("@@item "):])["name"] for ln in run.stdout.splitlines() if ln.startswith("@@item "))
    assert items == ["net0", "net1"]
    assert all(json.loads(ln[len("@@item "):])["commands"] == 1 for ln in run.stdout.splitlines() if ln.startswith("@@item "))
    alone = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", json.dumps(cmds(ckpts[1], tmp_path / "alone.zarr"))],
                           env=env, capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-2000:]
    a, b = open_store(str(tmp_path / "forked" / "net1.zarr")), open_store(str(tmp_path / "alone.zarr"))
    assert all(np.array_equal(np.asarray(a.zarr_array(k)[:]), np.asarray(b.zarr_array(k)[:])) for k in a.layers)

    bad = [networks[0], {"name": "broken", "commands": [cmds(ckpts[1], tmp_path / "bad.zarr")[0] + ["--layers", "nope"]]}]
    fail = subprocess.run([sys.executable, "-m", "repsim.analyses.command_runs", "--jobs", "2", json.dumps(bad)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert fail.returncode != 0 and "command_runs: broken failed" in fail.stderr and "nope" in fail.stderr


def test_the_wrote_line_gives_the_setup_steps_that_the_heatmap_bench_reads():
    """extract's "wrote ..." line ends with the setup before the first forward pass and its steps
    (pipeline.setup_line); bench/heatmap18.py splits a heatmap's extraction time with it."""
    import importlib.util
    from pathlib import Path

    from repsim.extract.pipeline import setup_line

    path = Path(__file__).resolve().parents[1] / "bench" / "heatmap18.py"
    spec = importlib.util.spec_from_file_location("heatmap18", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    line = setup_line({"start": 10.0, "model": 10.25, "data": 10.5, "plan": 11.0, "store": 11.125})
    assert line == "1.1 s of setup (model 0.2, data 0.2, probe and plan 0.5, store 0.1)"
    got = bench.store_times(f"extract: wrote s.zarr (2 chunks, 100 examples) in 3.0 s, after {line}\n" * 2)
    assert got == {"store_seconds": [3.0, 3.0], "store_setup_seconds": [1.1, 1.1],
                   "setup_steps": {"model": 0.4, "data": 0.4, "probe_and_plan": 1.0, "store": 0.2}}
