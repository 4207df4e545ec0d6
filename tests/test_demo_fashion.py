"""`repsim demo --profile fashion` on tiny idx files written here (no real data, no download): the whole
pipeline (train, extract, analyse, report) for 2 objectives × 1 seed × 1 epoch of a 4-block network,
one log line per stage and network; and the missing-data error before any training."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")  # training and extraction need the [torch] extra

from repsim.train import fashion as fm


def _tiny_fashion(root, per_class=(30, 12)):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, per in zip(("train", "t10k"), per_class):
        labels = np.repeat(np.arange(10), per).astype(np.uint8)
        # class-dependent mean brightness, so one epoch learns something
        images = np.clip(rng.normal(20 + 20 * labels[:, None, None], 40, (len(labels), 28, 28)), 0, 255)
        fm.write_idx(root / f"{split}-images-idx3-ubyte.gz", images.astype(np.uint8))
        fm.write_idx(root / f"{split}-labels-idx1-ubyte", labels)  # raw: both encodings in one set
    return root


TINY = ["data.train_per_class=20", "data.holdout_per_class=5", "data.test_per_class=12", "batch_size=20",
        "arch_params.layers=[1,1,1,1]", "arch_params.width=4"]


@pytest.mark.slow
def test_fashion_profile_tiny(tmp_path):
    root = _tiny_fashion(tmp_path / "data")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "repsim", "demo", "--profile", "fashion", "--out", str(out), "--data-root",
           str(root), "--objectives", "softmax", "sigmoid", "--num-seeds", "1", "--epochs", "1"]
    for s in TINY:
        cmd += ["--set", s]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # hang guard (slow at high load)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    log = run.stdout
    assert "[demo] train: 0 of 2 networks already trained" in log  # the stage's header
    assert re.findall(r"^\[demo\] train (\d)/2 ", log, re.M) == ["1", "2"]  # then one line per network
    assert "[demo] extract 2/2 " in log and "5 store(s)" in log
    assert "estimated store size" not in log and "epoch 1/1" in log  # summaries, not every line
    stores = sorted(p.name for p in (out / "stores").glob("*/*.zarr"))
    assert len(stores) == 2 * 5 and "sigmoid-s0-tgt-test.zarr" in stores
    from repsim import open_store

    tgt = open_store(out / "stores" / "tgt-test" / "softmax-s0-tgt-test.zarr")
    assert tgt.attrs["dataset"]["name"] == "fashion-target" and tgt.n == 5 * 12
    src = open_store(out / "stores" / "src-test" / "softmax-s0-src-test.zarr")
    assert len(src.layers) >= 6  # every block, pool, logits
    report = (out / "report" / "report.html").read_text()
    assert "Profile <code>fashion</code>" in report and "fashion-target" in report
    findings = (out / "report" / "findings.md").read_text().splitlines()
    assert sum(l.startswith("## ") for l in findings) == 3  # one verdict line per finding
    assert findings[-1].startswith("This run reproduces") or len(findings) == 3  # and the shortfall, if any


def test_fashion_profile_missing_data_fails_before_training(tmp_path, monkeypatch):
    from repsim.analyses.pipeline import Demo, DemoError
    from repsim.analyses.profiles import FASHION

    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no-debian")
    demo = Demo(tmp_path / "out", ("softmax",), 1, profile=FASHION, data_root=str(tmp_path / "empty"))
    with pytest.raises(DemoError) as exc:
        demo.stage_train()
    msg = str(exc.value)
    assert "--data-root" in msg and "dataset-fashion-mnist" in msg and "--download" in msg
    assert not (tmp_path / "out" / "runs").exists()


def test_train_argv_carries_profile_and_data_options(tmp_path):
    from repsim.analyses.pipeline import Demo
    from repsim.analyses.profiles import DIGITS, FASHION

    d = Demo(tmp_path, ("softmax",), 1, 3, profile=FASHION, sets=("data.train_per_class=50",),
             data_root="/data/fm", download=True)
    argv = d.train_argv("softmax", 0)
    assert argv[argv.index("--preset") + 1] == "fashion-softmax"
    assert 'data.root="/data/fm"' in argv and "data.download=true" in argv and "data.train_per_class=50" in argv
    assert "epochs=3" in argv
    assert argv[argv.index("--keep-every") + 1] == str(FASHION.keep_every) and FASHION.keep_every > 0  # Fig. E.4
    assert set(d.dynamics_groups) == {"dyn-src-train", "dyn-src-test", "dyn-tgt-train", "dyn-tgt-test"}
    assert Demo(tmp_path).train_argv("sigmoid", 1)[:3] == ["train", "--preset", "digits-sigmoid"]
    assert DIGITS.groups["tgt-train"][0] == "digits-target" and FASHION.groups["src-test"][0] == "fashion-source"
    (tmp_path / "runs" / "softmax-s0").mkdir(parents=True)
    (tmp_path / "runs" / "softmax-s0" / "best.pt").write_text("not read")
    args = d.extract_args("tgt-test", "softmax-s0", d.checkpoint("softmax-s0"))
    assert args[args.index("--data") + 1] == "fashion-target" and args[args.index("--data-root") + 1] == "/data/fm"


def test_finished_networks_are_reused_by_their_resolved_config(tmp_path):
    """The demo reuses a network when its configuration as `repsim train` resolves it is unchanged: a value
    given by --set that the preset already has is the same run; a different value, seed or epoch count
    is not (an edited preset changes the resolved config too)."""
    from repsim.analyses.pipeline import Demo
    from repsim.analyses.profiles import FASHION
    from repsim.train.config import load_config

    per_class = load_config("fashion-softmax")["data"]["train_per_class"]
    key = lambda *sets, seed=0, epochs=None: Demo(tmp_path, ("softmax",), 1, epochs, profile=FASHION,  # noqa: E731
                                                 sets=sets).train_key("softmax", seed)
    assert key() == key(f"data.train_per_class={per_class}")
    assert key() != key(f"data.train_per_class={per_class + 1}")
    assert key() != key(seed=1) and key() != key(epochs=3)
    assert json.loads(key())["data"]["train_per_class"] == per_class and json.loads(key())["keep_every"] == FASHION.keep_every


def test_report_says_when_fewer_than_two_findings_reproduce():
    from repsim.analyses.findings import Finding
    from repsim.analyses.pipeline import shortfall
    from repsim.analyses.profiles import DIGITS, FASHION

    two = [Finding("a", "reproduced", ""), Finding("b", "reproduced", ""), Finding("c", "partial", "")]
    assert shortfall(two, FASHION) == ""
    one = [Finding("a", "reproduced", ""), Finding("b", "partial", ""), Finding("c", "not reproduced", "")]
    text = shortfall(one, FASHION)
    assert text.startswith("This run reproduces 1 of the paper's 3 findings.") and "Search record" in text
    assert "profile fashion" in shortfall(one[1:], DIGITS) and "reproduces 0 of" in shortfall(one[1:], DIGITS)
    # the run's own numbers, not a fixed string
    assert "reach 91–99 % source accuracy" in shortfall(one, DIGITS, (91.0, 99.4))
    # and only what they bear out: a short run's 34–72 % is no saturation (a reduced demo said it was)
    short = shortfall(one, DIGITS, (34.2, 71.9), epochs=3)
    assert "saturates" not in short and "reach only 34–72 % source accuracy after 3 epochs (--epochs)" in short
    assert "undertrained" in short and "rerun without --epochs" in short
    assert "saturates" in shortfall(one, DIGITS, (90.0, 97.0)) and "saturated" in shortfall(one, DIGITS, (89.9, 97.0))
    assert "rerun without --epochs" not in shortfall(one, DIGITS, (60.0, 70.0))  # the presets' own epochs
