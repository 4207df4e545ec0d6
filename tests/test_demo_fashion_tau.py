"""`repsim demo --profile fashion-tau` on tiny idx files (no real data): 3 of the sweep's cosine-softmax
temperatures × 1 seed × 1 epoch of a 4-block network, end to end; the report renders Table 4 and Fig. 5b
and the temperature verdict. The profile's design (5 temperatures around the rule's τ*) is checked too."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")  # training and extraction need the [torch] extra

from test_demo_fashion import TINY, _tiny_fashion


def test_fashion_tau_profile_spans_the_rules_temperature():
    from repsim.analyses.pipeline import Demo
    from repsim.analyses.profiles import FASHION_TAU
    from repsim.study.rescale import params

    star = params("cosine_softmax", 5, 0.05)["tau"]
    taus = [float(v[0].split("=")[1]) for v in FASHION_TAU.settings.values()]
    assert len(taus) >= 5 and min(taus) == pytest.approx(star / 4) and max(taus) == pytest.approx(star * 4)
    assert star in taus and FASHION_TAU.seeds >= 2 and FASHION_TAU.findings == "tau"
    d = Demo(__import__("pathlib").Path("/nonexistent"), ("tau0.1",), 1, profile=FASHION_TAU)
    argv = d.train_argv("tau0.1", 0)
    assert argv[argv.index("--preset") + 1] == "fashion-cosine_softmax" and "objective_params.tau=0.1" in argv
    assert d.run_names == ["tau0.1-s0"]


@pytest.mark.slow
def test_fashion_tau_profile_tiny(tmp_path):
    root = _tiny_fashion(tmp_path / "data")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "repsim", "demo", "--profile", "fashion-tau", "--out", str(out), "--data-root",
           str(root), "--objectives", "tau0.05", "tau0.1", "tau0.2", "--num-seeds", "1", "--epochs", "1"]
    for s in TINY:
        cmd += ["--set", s]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[demo] train: 0 of 3 networks already trained" in run.stdout
    report = (out / "report" / "report.html").read_text()
    for item in ("table4", "fig5b"):
        assert f"<h2 id='{item}'>" in report, item
    assert "Raw pixels (linear probe)" in report
    findings = (out / "report" / "findings.md").read_text()
    assert findings.startswith("## Temperature: R² rises with τ and transfer falls: ")
    assert sum(line.startswith("## ") for line in findings.splitlines()) == 1
    assert "| ρ(τ, R²) > 0 with p < 0.05 | ρ = " in findings and "Pixel baseline" in findings
