"""Extraction says what it chose and refuses in one line (issue 30): the generic ``pool``/head choice,
``--list-layers`` on a failing model or a shared module, ``--device``, two creators of one store."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from repsim.commands.main import main  # noqa: E402
from repsim.store import lock as lock_mod  # noqa: E402
from repsim.store import writer as writer_mod  # noqa: E402
from repsim.store.reader import open_store  # noqa: E402

TESTS = Path(__file__).resolve().parent
RUN = ["--data", "digits", "--split", "test", "--workers", "0", "--device", "cpu", "--batch-size", "64"]


@pytest.fixture(autouse=True)
def _tiny_models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def extract(capsys, *args):
    code = main(["extract", *map(str, args)])
    return code, capsys.readouterr().err


def test_generic_pool_choice_is_said_and_a_failed_head_check_warns_naming_the_layers(tmp_path, capsys):
    code, err = extract(capsys, "--checkpoint", "module:tiny_models:classifier_first", *RUN, "--out",
                        tmp_path / "s.zarr", "--no-progress")
    assert code == 0, err
    assert "pool = input of 'proj' (Linear 32->16), the last nn.Linear in definition order" in err
    assert ("warning: the head check failed: 'proj' (Linear 32->16) does not map pool (32-d, its input) to the "
            "model's 10 outputs") in err
    assert "'classifier' (Linear 16->10) has the logits' width" in err
    assert open_store(tmp_path / "s.zarr").head is None


def test_a_classic_model_s_taps_are_described_but_not_printed():
    """(A classic registry is fixed, not guessed: extraction prints the line for generic models only.)"""
    from repsim.extract.layers import describe_pool
    from torchvision.models import resnet18

    assert describe_pool(resnet18()) == "pool = output of 'avgpool' (flattened), logits = output of 'fc'"


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "module:tiny_models:fails", "--list-layers"],
     "the model failed on the first example (input (1, 3, 224, 224)): this model refuses every input"),
    (["--checkpoint", "torchvision:resnet18", "--list-layers", "--layers", "layer1.0.relu"],
     "module 'layer1.0.relu' (layer 'layer1.0.relu') ran twice in one forward pass"),
    (["--checkpoint", "run", "--out", "s.zarr"],  # a training run's directory ("does not exist" before)
     "checkpoint 'run' is a directory, not a checkpoint file: pass run/best.pt"),
])
def test_refusals_are_one_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "best.pt").write_bytes(b"x")
    code, err = extract(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and message in lines[-1] and "Traceback" not in err


@pytest.mark.parametrize("device, message", [
    ("bogus", "argument --device: 'bogus' is not a device; use auto, cpu, cuda or cuda:N"),
    pytest.param("cuda", "argument --device: 'cuda': no CUDA GPU is usable on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")),
    ("cuda:99", "argument --device: 'cuda:99'"),
])
def test_device_is_checked_before_anything_runs(device, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["extract", "--checkpoint", "torchvision:resnet18", "--data", "digits", "--out", str(tmp_path / "x.zarr"),
              "--device", device])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


def test_two_extracts_into_one_new_store_the_second_is_told(tmp_path, monkeypatch, capsys):
    out = tmp_path / "s.zarr"
    build = writer_mod._build

    def racing(*a, **k):  # the other extraction publishes the same store while this one builds its own
        made = build(*a, **k)
        monkeypatch.setattr(writer_mod, "_build", build)
        # (the store's writer lock, repsim.store.lock, refuses a second extraction first: this one runs as
        # where no lock can be taken, to check the creation's own refusal behind it)
        monkeypatch.setattr(lock_mod, "lock_store", lambda *a, **k: SimpleNamespace(release=lambda: None))
        assert main(["extract", "--checkpoint", "module:tiny_models:classifier_first", *RUN, "--out", str(out),
                     "--no-progress"]) == 0
        return made

    monkeypatch.setattr(writer_mod, "_build", racing)
    code, err = extract(capsys, "--checkpoint", "module:tiny_models:classifier_first", *RUN, "--out", out,
                        "--no-progress")
    assert code == 2 and f"another process created {out} while this one was creating it" in err.splitlines()[-1]
    assert open_store(out).complete
