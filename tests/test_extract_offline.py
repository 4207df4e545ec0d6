"""Pretrained weights without a network (extract/models/offline.py): one line naming the weights file, the
cache it was looked for in and a local route, at once (no retry loop); a cached file loads offline.
Nothing here needs the network: the machine is declared offline (REPSIM_OFFLINE=1) or the hub endpoint
is a closed local port."""
from __future__ import annotations

import pytest

from repsim.commands.main import main as repsim_main

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")


def test_torchvision_weights_offline_is_one_line_naming_file_cache_and_local_route(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("REPSIM_OFFLINE", "1")
    assert repsim_main(["extract", "--checkpoint", "torchvision:resnet18:DEFAULT", "--list-layers"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    assert f"the weights file resnet18-f37072fd.pth is not in {cache}" in err
    assert "download.pytorch.org cannot be reached" in err and "TORCH_HOME" in err
    assert "module:torchvision.models:resnet18:/path/to/resnet18-f37072fd.pth" in err


def test_cached_torchvision_weights_load_offline(tmp_path, monkeypatch, capsys):
    from torchvision.models import resnet18

    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.manual_seed(5)
    torch.save(resnet18().state_dict(), cache / "resnet18-f37072fd.pth")  # stands for the downloaded file
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("REPSIM_OFFLINE", "1")
    from repsim.extract.models import load_spec

    loaded = load_spec("torchvision:resnet18:DEFAULT")
    want = torch.load(cache / "resnet18-f37072fd.pth")
    assert torch.equal(loaded.model.state_dict()["fc.weight"], want["fc.weight"])
    assert loaded.meta["init"] == "pretrained"
    # the route the error names: the same file as a module: state dict
    local = load_spec(f"module:torchvision.models:resnet18:{cache / 'resnet18-f37072fd.pth'}")
    assert torch.equal(local.model.state_dict()["fc.weight"], want["fc.weight"])


@pytest.fixture
def closed_hub(tmp_path, monkeypatch):
    """The Hugging Face hub at a closed local port (connection refused: no network needed) and an empty
    cache under tmp_path."""
    pytest.importorskip("timm")
    import huggingface_hub.constants as constants

    from repsim.extract.models import offline

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(offline, "_SEEN", {})
    monkeypatch.delenv("REPSIM_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "hf"


def test_timm_pretrained_unreachable_is_one_line_without_retries(closed_hub, capsys, monkeypatch):
    import socket

    attempts: list[object] = []
    connect = socket.socket.connect

    def counted(sock, address):  # every connection attempt to the closed hub port
        if isinstance(address, tuple) and address[1] == 9:
            attempts.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    assert repsim_main(["extract", "--checkpoint", "timm:resnet18:pretrained", "--list-layers"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"model.safetensors of timm/resnet18.a1_in1k is not in {closed_hub}" in err
    assert "127.0.0.1 cannot be reached" in err and "HF_HOME" in err and "module:" in err
    # one reachability check (asked once per process), then the hub in offline mode asks nothing: counted,
    # not timed (this was ~53 s of the hub's retries)
    assert len(attempts) == 1, attempts


def test_cached_timm_weights_load_with_the_hub_out_of_reach(closed_hub):
    import timm
    from safetensors.torch import save_file

    from repsim.extract.models import load_spec

    snapshot = closed_hub / "models--timm--resnet18.a1_in1k" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (closed_hub / "models--timm--resnet18.a1_in1k" / "refs").mkdir()
    (closed_hub / "models--timm--resnet18.a1_in1k" / "refs" / "main").write_text("0" * 40)
    torch.manual_seed(7)
    state = {k: v.contiguous() for k, v in timm.create_model("resnet18").state_dict().items()}
    save_file(state, str(snapshot / "model.safetensors"))
    import huggingface_hub.constants as constants

    loaded = load_spec("timm:resnet18:pretrained")
    assert torch.equal(loaded.model.state_dict()["fc.weight"], state["fc.weight"])
    assert constants.HF_HUB_OFFLINE is False  # offline mode only while loading
