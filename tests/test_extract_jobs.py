"""Several checkpoints in one `repsim extract` (extract/cli.py): the jobs as threads of one process
(the default on a GPU; here the same path on the CPU, without CUDA streams) write every store
byte for byte as one-at-a-time extraction does, with valid checksums and manifests (`repsim check`);
a failing job leaves the others' stores whole and is reported with its store."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("repsim.train.data")

from repsim.extract import cli  # noqa: E402
from repsim.commands.main import main as repsim_main  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402

TESTS = Path(__file__).resolve().parent
# four kinds of model source, each built (seeded) by its own job: a torchvision name, and a user's
# module factories (ConvNeXt, ViT, a generic classifier)
MODELS = ["torchvision:resnet18", "module:tiny_models:convnext", "module:tiny_models:vit",
          "module:tiny_models:classifier_first"]
RUN = ["--data", "digits", "--split", "test", "--image-size", "32", "--batch-size", "64", "--chunk-rows", "128",
       "--workers", "0", "--device", "cpu", "--no-progress"]  # every layer of each model's registry


@pytest.fixture(autouse=True)
def _tiny_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # module:tiny_models:<factory>, as a user's own module


def _files(path: Path) -> dict[str, bytes]:
    """Every file of a store but the two attributes that name the write (when, which store)."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = p.read_bytes()
    return out


def _attrs(path: Path) -> dict:
    return {k: v for k, v in open_store(path).attrs.items() if k not in ("created", "store_uuid")}


def _checkpoints(models: list[str]) -> list[str]:
    return sum((["--checkpoint", m] for m in models), [])


def test_job_mode_defaults_and_refusals():
    """auto: threads on a GPU, processes on the CPU; an explicit mode wins; anything else is refused."""
    assert cli.job_mode("auto", "cpu") == "processes" and cli.job_mode(None, "cpu") == "processes"
    assert cli.job_mode("threads", "cpu") == "threads" and cli.job_mode("processes", "cpu") == "processes"
    assert cli.job_mode("auto", "cuda:0") == "threads"  # (names a GPU: no GPU is needed to decide)
    with pytest.raises(ValueError, match="--job-mode must be one of auto, threads, processes"):
        cli.job_mode("fibres", "cpu")


def test_threads_write_the_stores_one_at_a_time_extraction_writes(tmp_path, capsys):
    """Four models as four threads of one process: every chunk, manifest and checksum byte-identical to
    one-at-a-time stores, the attributes equal but for the write's time and uuid, `repsim check` clean."""
    one, four = tmp_path / "one", tmp_path / "four"
    assert repsim_main(["extract", *_checkpoints(MODELS), *RUN, "--out-dir", str(one), "--jobs", "1"]) == 0
    assert repsim_main(["extract", *_checkpoints(MODELS), *RUN, "--out-dir", str(four), "--jobs", "4",
                        "--job-mode", "threads"]) == 0
    names = sorted(p.name for p in one.glob("*.zarr"))
    assert len(names) == 4 and names == sorted(p.name for p in four.glob("*.zarr"))
    for name in names:
        a, b = _files(one / name), _files(four / name)
        chunks = [k for k in a if "/c/" in k]
        assert len(chunks) > 10
        assert {k: a[k] for k in chunks} == {k: b[k] for k in chunks}, name
        assert _attrs(one / name) == _attrs(four / name), name
        assert open_store(four / name).complete
    capsys.readouterr()
    assert repsim_main(["check", *(str(four / n) for n in names)]) == 0, capsys.readouterr()


def test_a_failing_thread_leaves_the_other_stores_whole_and_each_failure_is_named(tmp_path, capsys):
    """Two of four jobs fail — one before its store exists, one after it wrote chunks — and the other
    two stores are complete and byte-identical to lone runs; the error names both failed stores
    (exit 2), the half-written one is left incomplete, not complete, and valid as far as it goes."""
    out = tmp_path / "out"
    models = ["module:tiny_models:convnext", "module:tiny_models:fails", "module:tiny_models:fails_later",
              "module:tiny_models:vit"]
    argv = ["extract", *_checkpoints(models), *RUN, "--layers", "pool,logits", "--chunk-rows", "64", "--out-dir", str(out), "--jobs", "4", "--job-mode", "threads"]
    assert repsim_main(argv) == 2
    err = capsys.readouterr().err
    stores = {m: out / (cli.store_paths([m], str(out), "{stem}")[0].name) for m in models}
    fails, later = stores["module:tiny_models:fails"], stores["module:tiny_models:fails_later"]
    assert f"extract: {fails} failed: " in err and "this model refuses every input" in err
    assert f"extract: {later} failed: " in err and "fourth forward pass" in err
    assert "2 of 4 stores failed" in err and "the other 2 are complete" in err
    assert not fails.exists()
    half = open_store(later, allow_incomplete=True)
    assert not half.complete and 0 < int(half.written().sum()) < len(half.written())
    for m in ("module:tiny_models:convnext", "module:tiny_models:vit"):
        lone = tmp_path / "lone" / stores[m].name
        assert repsim_main(["extract", "--checkpoint", m, *RUN, "--layers", "pool,logits", "--chunk-rows", "64", "--out", str(lone)]) == 0
        got = _files(stores[m])
        assert {k: v for k, v in _files(lone).items() if "/c/" in k} == {k: v for k, v in got.items() if "/c/" in k}
    capsys.readouterr()
    assert repsim_main(["check", *(str(stores[m]) for m in ("module:tiny_models:convnext", "module:tiny_models:vit"))]) == 0


def test_one_failing_job_is_raised_as_the_lone_run_raises_it(tmp_path, capsys):
    """A single failure among several jobs is the one line the lone run would print (no summary)."""
    argv = ["extract", *_checkpoints(["module:tiny_models:convnext", "module:tiny_models:fails"]), *RUN,
            "--layers", "pool", "--out-dir", str(tmp_path / "out"), "--jobs", "2",
            "--job-mode", "threads"]
    assert repsim_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "this model refuses every input" in err[0], err
    assert open_store(tmp_path / "out" / "module_tiny_models_convnext.zarr").complete


def test_seeded_builds_in_threads_take_turns():
    """Random-init models built in several threads at once get the weights of a lone build: the seeded
    builds share torch's one CPU generator and take turns (repsim.extract.models.common.seeded)."""
    from concurrent.futures import ThreadPoolExecutor

    from repsim.extract.models.common import seeded

    def build(_):
        with seeded():
            return [torch.randn(2000) for _ in range(20)]

    lone = build(0)
    with ThreadPoolExecutor(8) as pool:
        for got in pool.map(build, range(16)):
            assert all(torch.equal(a, b) for a, b in zip(lone, got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_threads_on_one_gpu_write_the_stores_of_one_at_a_time_runs(tmp_path, capsys):
    """On a GPU, several checkpoints run as threads by default (each on a CUDA stream of its own): every
    store complete and valid, its values those of one-at-a-time runs on the same GPU (float32, no
    autocast; cuDNN may pick other kernels per run, so within float32 rounding, not bytes)."""
    run = ["--data", "digits", "--split", "test", "--image-size", "32", "--batch-size", "64", "--chunk-rows", "128",
           "--workers", "0", "--device", "cuda", "--amp", "off", "--dtype", "float32", "--no-progress"]
    models = MODELS[:3]
    assert cli.job_mode("auto", "cuda") == "threads"
    assert repsim_main(["extract", *_checkpoints(models), *run, "--out-dir", str(tmp_path / "one"), "--jobs", "1"]) == 0
    assert repsim_main(["extract", *_checkpoints(models), *run, "--out-dir", str(tmp_path / "three"), "--jobs", "3"]) == 0
    for name in (p.name for p in (tmp_path / "one").glob("*.zarr")):
        a, b = open_store(tmp_path / "one" / name), open_store(tmp_path / "three" / name)
        assert b.complete and a.layers == b.layers
        for layer in a.layers:
            x, y = np.asarray(a.layer(layer).compute()), np.asarray(b.layer(layer).compute())
            assert np.allclose(x, y, rtol=1e-4, atol=1e-5 * float(np.abs(x).max())), (name, layer)
    capsys.readouterr()
    assert repsim_main(["check", *(str(p) for p in (tmp_path / "three").glob("*.zarr"))]) == 0
