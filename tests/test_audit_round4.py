"""Issue 43, the fourth bad-input and fault audit: results overwritten or deleted by a second run or a
checkpoint path, runt batches, overflow read as "constant", copied head groups, edited version-1 stores,
streamed kNN ties, unlabelled splits. Each test reproduces an audit case (its number in the issue) that
ran silently, lost a file or ended in a traceback before the fix.

Real stores on disk and real subprocesses; the one monkeypatch (item 1) stands in for a file system
without ``flock`` (some network mounts), where only the create-that-fails protects the output.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import repsim
from repsim.commands.main import main
from repsim.store.writer import save_store
from test_engine_helpers import correlated_layers, signalled_at_checkpoint, wait_until_stopped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_REFUSED = 2


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _store(path, *, seed=0, n=200, chunk_rows=50, layers=None, **kw):
    rng = np.random.default_rng(seed)
    layers = layers or {k: v.astype(np.float32) for k, v in correlated_layers(rng, n, {"f": (24,)}).items()}
    n = next(iter(layers.values())).shape[0]
    kw.setdefault("labels", np.arange(n) % 4)
    kw.setdefault("example_ids", np.arange(n))
    return save_store(str(path), layers, chunk_rows=chunk_rows, **kw)


def _run(capsys, *argv) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ------------------------------------------------------------------------------- 1-3. results lost


def test_1_a_second_run_with_the_same_out_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two `similarity` runs with one --out both printed "-> same.npz"; the file held the last finisher's."""
    _store(tmp_path / "a.zarr", seed=0, n=400, chunk_rows=100)
    _store(tmp_path / "b.zarr", seed=1, n=400, chunk_rows=100)
    out = tmp_path / "same.npz"
    first = [sys.executable, "-m", "repsim", "similarity", str(tmp_path / "a.zarr"), "--batch-size", "100",
             "--epochs", "300", "--checkpoint-every", "1", "--no-progress", "--out", str(out)]
    # stopped (SIGSTOP) by itself right after its first checkpoint: running, its --out claimed, at a known point
    proc = subprocess.Popen(signalled_at_checkpoint(first[3:], 1, signal.SIGSTOP), env=_env(), stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_until_stopped(proc)
        code, err = _run(capsys, "similarity", tmp_path / "b.zarr", "--batch-size", "100", "--epochs", "1",
                         "--no-progress", "--out", out)
        assert code == EXIT_REFUSED and len(err) == 1, err
        assert f"--out {out} is being written by another running repsim command" in err[0]
        # --overwrite does not take a file another run is writing either
        code, err = _run(capsys, "similarity", tmp_path / "b.zarr", "--epochs", "1", "--no-progress",
                         "--out", out, "--overwrite", "--resume", tmp_path / "own.ckpt.npz")
        assert code == EXIT_REFUSED and "is being written by another running repsim command" in err[0], err
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()


def test_1_a_file_made_by_another_run_since_the_start_is_not_replaced(tmp_path, capsys, monkeypatch):
    """Where no lock can be taken (a file system without flock), the save is a create that fails: the
    other run's file stays, this run's result is kept beside it and named."""
    import repsim.fileio as io
    import repsim.engine.minibatch as mb

    monkeypatch.setattr(io, "_try_lock", lambda path: None)
    _store(tmp_path / "a.zarr", seed=0)
    out = tmp_path / "same.npz"
    real = mb.similarity_matrix

    def other_run_finishes_meanwhile(*args, **kw):
        result = real(*args, **kw)
        out.write_bytes(b"the other run's result")
        return result

    monkeypatch.setattr(mb, "similarity_matrix", other_run_finishes_meanwhile)
    code, err = _run(capsys, "similarity", tmp_path / "a.zarr", "--epochs", "1", "--no-progress", "--out", out)
    kept = tmp_path / f"same.run-{os.getpid()}.npz"
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert f"{out} was written by another run after this one started; this run's result is kept as {kept}" in err[0]
    assert out.read_bytes() == b"the other run's result"
    assert repsim.load_result(str(kept)).matrix("linear_cka").shape == (1, 1)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("spelling", ["res.npz", "res", "sub/../res.npz"])
def test_2_a_checkpoint_naming_the_output_is_refused_before_work(tmp_path, capsys, overwrite, spelling):
    """--checkpoint naming --out: the run saved the result, then removed "the checkpoint" — the result."""
    _store(tmp_path / "a.zarr")
    out = tmp_path / "res.npz"
    (tmp_path / "sub").mkdir()
    if overwrite:
        out.write_bytes(b"previous result")
    code, err = _run(capsys, "cka", tmp_path / "a.zarr", "--epochs", "1", "--no-progress", "--out", out,
                     "--resume", f"{tmp_path}/{spelling}", *(["--overwrite"] if overwrite else []))
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert "is the output file itself" in err[0]
    assert out.read_bytes() == b"previous result" if overwrite else not out.exists()


@pytest.mark.parametrize("method", ["minibatch", "exact"])
def test_3_a_checkpoint_naming_another_results_file_is_refused_and_kept(tmp_path, capsys, method):
    """--checkpoint naming another result: "ignoring unreadable checkpoint", then overwritten and deleted."""
    _store(tmp_path / "a.zarr")
    other = tmp_path / "other.npz"
    assert main(["cka", str(tmp_path / "a.zarr"), "--epochs", "1", "--no-progress", "--out", str(other)]) == 0
    before = other.read_bytes()
    capsys.readouterr()
    code, err = _run(capsys, "cka", tmp_path / "a.zarr", "--epochs", "1", "--no-progress", "--method", method,
                     "--out", tmp_path / "new.npz", "--resume", other)
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert f"--resume {other} exists and is not a repsim checkpoint" in err[0]
    assert other.read_bytes() == before and not (tmp_path / "new.npz").exists()


def test_3_a_truncated_checkpoint_is_named_in_one_line(tmp_path, capsys):
    """A truncated checkpoint on rerun: exit 70 and a BadZipFile traceback."""
    _store(tmp_path / "a.zarr")
    ckpt = tmp_path / "run.ckpt.npz"
    argv = ["cka", tmp_path / "a.zarr", "--epochs", "1", "--no-progress", "--resume", ckpt]
    assert _run(capsys, *argv, "--out", tmp_path / "first.npz")[0] == 0
    from repsim.engine.checkpoint import Checkpoint

    Checkpoint(ckpt, {"x": 1}).save(1, {"a": np.arange(1000.0)})
    ckpt.write_bytes(ckpt.read_bytes()[:300])
    code, err = _run(capsys, *argv, "--out", tmp_path / "second.npz")
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert f"{ckpt} cannot be read as a checkpoint (truncated or damaged" in err[0]
    assert ckpt.stat().st_size == 300


def test_3_another_computations_checkpoint_is_refused_not_overwritten(tmp_path, capsys):
    """A checkpoint of other settings at the named path was "starting over": overwritten, then deleted."""
    _store(tmp_path / "a.zarr")
    ckpt = tmp_path / "run.ckpt.npz"
    from repsim.engine.minibatch import cka_matrix

    cka_matrix([str(tmp_path / "a.zarr")], epochs=1, batch_size=50, checkpoint=ckpt, progress=False)
    before = ckpt.read_bytes()
    code, err = _run(capsys, "cka", tmp_path / "a.zarr", "--epochs", "1", "--batch-size", "40", "--no-progress",
                     "--resume", ckpt, "--out", tmp_path / "r.npz")
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert f"checkpoint {ckpt} belongs to a different computation" in err[0]
    assert ckpt.read_bytes() == before


# ------------------------------------------------------------------------- 13. truncated files named


def test_13_load_result_names_a_truncated_file(tmp_path):
    _store(tmp_path / "a.zarr")
    out = tmp_path / "r.npz"
    assert main(["cka", str(tmp_path / "a.zarr"), "--epochs", "1", "--no-progress", "--out", str(out)]) == 0
    out.write_bytes(out.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"^{out} is a truncated or damaged \.npz"):
        repsim.load_result(str(out))


# ------------------------------------------------------------------------------ 4. the batch plan

from hypothesis import given, seed, settings, strategies as st  # noqa: E402

from repsim.engine.blocks import BatchPlan  # noqa: E402

QUARTER = 0.25  # the documented promise: every window batch within a quarter of n / K rows


@seed(43)
@settings(max_examples=300, deadline=None, derandomize=True)
@given(n=st.integers(4, 5000), block=st.integers(1, 1200), b=st.integers(4, 6000), window=st.integers(0, 8000),
       scheme=st.sampled_from(["window", "examples"]), epoch=st.integers(0, 3))
def test_4_every_plan_cuts_round_n_over_b_near_equal_batches(n, block, b, window, scheme, epoch):
    """The documented promise for every n, chunk, batch and window size: K = round(n/b) batches (at
    least 1, at most n/4), every row once, every batch within a quarter of n/K rows (the "examples"
    scheme: sizes differ by at most one), and a window batch reads only its own group's blocks."""
    plan = BatchPlan(n=n, batch_size=b, shuffle=scheme, seed=epoch, block_rows=block, window_rows=window)
    groups = plan.groups(epoch)
    batches = [r for g in groups for r in g.batches]
    k = max(1, min(round(n / b), n // 4))
    assert len(batches) == k
    rows = np.concatenate(batches)
    assert rows.size == n and np.unique(rows).size == n
    sizes = np.array([r.size for r in batches])
    assert sizes.min() >= 4
    if scheme == "examples" or len(groups) == 1:
        assert sizes.max() - sizes.min() <= 1, sizes
    else:
        assert sizes.min() >= (1 - QUARTER) * n / k and sizes.max() <= (1 + QUARTER) * n / k, sizes
        blocks = np.concatenate([g.blocks for g in groups])
        assert np.unique(blocks).size == blocks.size == -(-n // block)  # each block read once per epoch
        for g in groups:
            assert set(np.unique(np.concatenate(g.batches) // block).tolist()) <= set(g.blocks.tolist())


@pytest.mark.parametrize("n,chunk,b,want", [
    (300, 139, 300, [300]),  # was 22 + 278 rows, weighted alike (CKA 0.5745 against 0.5575)
    (300, 139, 1500, [300]),
    (250, 139, 1500, [250]),
    (130, 64, 1500, [130]),  # last chunk of 2 rows: "batch ... has n = 2 examples" at the defaults
    (5, 64, 1500, [5]),  # "batch has n = 3"
    (300, 139, 150, [161, 139]),  # two windows of whole blocks, each batch within a quarter of 150
])
def test_4_a_runt_last_chunk_is_merged_not_a_batch_of_its_own(n, chunk, b, want):
    for epoch in range(4):
        sizes = sorted((r.size for r in BatchPlan(n=n, batch_size=b, seed=epoch, block_rows=chunk).batches(epoch)),
                       reverse=True)
        assert sizes == want


def test_4_batch_size_at_least_n_is_one_full_batch_from_the_cli(tmp_path, capsys):
    """n = 300 in 139-row chunks, --batch-size >= n: the CKA of one full batch (debiased linear CKA)."""
    rng = np.random.default_rng(4)
    layers = {k: v.astype(np.float64) for k, v in correlated_layers(rng, 300, {"f": (12,), "g": (9,)}).items()}
    _store(tmp_path / "a.zarr", layers=layers, chunk_rows=139)
    out = tmp_path / "r.npz"
    code, err = _run(capsys, "cka", tmp_path / "a.zarr", "--batch-size", "400", "--no-progress", "--out", out)
    assert code == 0, err
    got = repsim.load_result(str(out)).matrix("linear_cka")
    want = repsim.linear_cka(layers["f"], layers["g"], debiased=True)
    assert got[0, 1] == pytest.approx(want, rel=1e-9)
    for n, chunk in ((130, 64), (5, 64)):  # the runts that failed at the defaults
        _store(tmp_path / f"s{n}.zarr", layers={"f": layers["f"][:n], "g": layers["g"][:n]}, chunk_rows=chunk)
        code, err = _run(capsys, "cka", tmp_path / f"s{n}.zarr", "--no-progress", "--out", tmp_path / f"s{n}.npz")
        assert code == 0, err


# ------------------------------------------------------------------------- 5, 10. overflow, bounds


def _scaled_store(path, scale, n=300):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 24))
    layers = {"f": x * scale, "g": (x[:, :12] + rng.normal(size=(n, 12))) * scale}
    return _store(path, layers=layers, chunk_rows=100)


@pytest.mark.parametrize("method", ["minibatch", "exact"])
@pytest.mark.parametrize("scale", [1e100, 1e75])
def test_5_values_whose_hsic_products_overflow_are_named_as_overflow(tmp_path, capsys, scale, method):
    """float64 values near 1e100 passed the magnitude check (1e150) and overflowed the HSIC products:
    the minibatch route wrote NaN, exited 0 and called the column constant."""
    _scaled_store(tmp_path / "big.zarr", scale)
    out = tmp_path / "r.npz"
    code, err = _run(capsys, "similarity", tmp_path / "big.zarr", "--method", method, "--measures",
                     "linear_cka,rbf_cka", "--epochs", "1", "--no-progress", "--out", out)
    if method == "exact" and scale == 1e75:  # the exact route's cross-covariances hold these: right numbers
        assert code == 0, err
        ref = _scaled_store(tmp_path / "one.zarr", 1.0)
        want = repsim.similarity_matrix([ref], ["linear_cka"], method="exact", progress=False).matrix("linear_cka")
        np.testing.assert_allclose(repsim.load_result(str(out)).matrix("linear_cka"), want, rtol=1e-9)
        return
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert "overflow" in err[0] and "constant" not in err[0] and "rescale the layer" in err[0]
    assert not out.exists()


def test_5_the_in_memory_accumulator_names_overflow_too():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16))
    acc = repsim.MinibatchCKA(2)
    acc.update([x, x[:, :8]])  # an ordinary batch is fine
    with pytest.raises(ValueError, match="overflow"):
        acc.update([x * 1e76, x[:, :8]])
    from repsim.kernels._precision import max_trace

    # the rule: a centred Gram's trace up to max_trace(n) keeps the HSIC products finite; beyond it refused
    ok = x * np.sqrt(0.5 * max_trace(64) / np.sum((x - x.mean(0)) ** 2))
    acc = repsim.MinibatchCKA(2)
    acc.update([ok, x[:, :8]])
    assert acc.result()[0, 1] == pytest.approx(_one_batch_cka(x, x[:, :8]), rel=1e-9)  # scale-invariant


def _one_batch_cka(x, y):
    acc = repsim.MinibatchCKA(2)
    acc.update([x, y])
    return acc.result()[0, 1]


@pytest.mark.parametrize("value", ["1e8", "1e5", "1e-200", "0.01", "0.05"])
def test_10_rbf_threshold_outside_what_float64_holds_is_refused_in_one_line(tmp_path, capsys, value):
    """--rbf-threshold 1e8: every kernel entry rounds to 1 (RBF CKA 0.985-1.0 for layers of linear CKA
    0.13); 1e-200: ZeroDivisionError, exit 70; 0.05 (allowed before): the minibatch route's centred
    Gram had lost 4 digits of the pairs."""
    with pytest.raises(SystemExit) as exc:
        main(["similarity", str(tmp_path / "x.zarr"), "--measures", "rbf_cka", "--rbf-threshold", value])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == EXIT_REFUSED and len(err) == 1, err
    assert "argument --rbf-threshold: must lie in [0.167, 5790]" in err[0]
    from repsim.kernels.measures import get_measure

    with pytest.raises(ValueError, match=r"rbf_threshold must lie in \[0.167, 5790\]"):
        get_measure("rbf_cka", rbf_threshold=float(value))


def test_10_the_range_is_derived_from_float64():
    """One bound, derived once: the median pair's entry exp(−1/(2t²)) at least √eps from 0 and from 1."""
    from repsim.kernels.measures.rbf_cka import RBF_THRESHOLD_RANGE, threshold_range

    eps = np.finfo(np.float64).eps
    lo, hi = RBF_THRESHOLD_RANGE
    assert RBF_THRESHOLD_RANGE == threshold_range(np.float64)
    assert np.exp(-1 / (2 * lo * lo)) >= np.sqrt(eps) > np.exp(-1 / (2 * (0.99 * lo) ** 2))
    assert -np.expm1(-1 / (2 * hi * hi)) >= np.sqrt(eps) > -np.expm1(-1 / (2 * (1.01 * hi) ** 2))
    assert (lo, hi) == (0.167, 5790.0)  # rounded inwards to 3 digits: the numbers the message names
    from repsim.commands.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert f"{lo:g} to {hi:g}, what float64 holds" in " ".join(sub.choices["similarity"].format_help().split())


def _edge_store(path):
    rng = np.random.default_rng(0)
    layers = {k: v.astype(np.float32) for k, v in correlated_layers(rng, 120, {"f": (24,), "g": (9,)}).items()}
    return _store(path, layers=layers, chunk_rows=40)


@pytest.mark.parametrize("edge", ["low", "high"])
def test_10_just_inside_the_range_both_routes_run_and_agree(tmp_path, capsys, edge):
    """At either end of the range the exact route and the minibatch route (one batch of all n rows: the
    same σ) give the same numbers, to the half of float64's digits the bound keeps (the minibatch route
    centres each batch's RBF Gram; the exact route sums the uncentred entries)."""
    from repsim.kernels.measures.rbf_cka import RBF_THRESHOLD_RANGE

    t = RBF_THRESHOLD_RANGE[0 if edge == "low" else 1]
    _edge_store(tmp_path / "s.zarr")
    got = {}
    for method, extra in (("exact", []), ("minibatch", ["--batch-size", "120", "--epochs", "1", "--shuffle", "none"])):
        out = tmp_path / f"{method}.npz"
        code, err = _run(capsys, "similarity", tmp_path / "s.zarr", "--method", method, "--measures", "rbf_cka",
                         "--rbf-threshold", repr(t), "--no-progress", "--out", out, *extra)
        assert code == 0, err
        got[method] = repsim.load_result(str(out)).matrix("rbf_cka")
        assert np.all(np.isfinite(got[method])), (method, got[method])
    np.testing.assert_allclose(got["minibatch"], got["exact"], rtol=1e-5 if edge == "low" else 1e-8)
    if edge == "high":  # t -> inf: RBF CKA tends to linear CKA; at the edge it still has those digits
        lin = repsim.similarity_matrix([repsim.open_store(str(tmp_path / "s.zarr"))], ["linear_cka"],
                                       method="exact", progress=False).matrix("linear_cka")
        np.testing.assert_allclose(got["exact"], lin, atol=1e-7)


@pytest.mark.parametrize("edge", ["low", "high"])
def test_10_just_outside_the_range_both_routes_refuse_alike(tmp_path, capsys, edge):
    """The next float beyond either end: the CLI (either --method) and the Python API (either method, and
    the measure and accumulator themselves) refuse it with the same line, before any store is read."""
    from repsim.kernels.measures import get_measure
    from repsim.kernels.measures.rbf_cka import RBF_THRESHOLD_RANGE, MinibatchRBFCKA

    lo, hi = RBF_THRESHOLD_RANGE
    t = float(np.nextafter(lo, 0.0) if edge == "low" else np.nextafter(hi, np.inf))
    store = _edge_store(tmp_path / "s.zarr")
    lines = set()
    for method in ("exact", "minibatch"):
        with pytest.raises(SystemExit) as exc:
            main(["similarity", str(tmp_path / "s.zarr"), "--method", method, "--measures", "rbf_cka",
                  "--rbf-threshold", repr(t), "--out", str(tmp_path / "r.npz")])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exc.value.code == EXIT_REFUSED and len(err) == 1, err
        lines.add(err[0].split("error: ", 1)[1].removesuffix(" (repsim similarity --help lists the options)"))
    assert lines == {f"argument --rbf-threshold: must lie in [{lo:g}, {hi:g}] (beyond it float64 keeps fewer than "
                     f"half of the digits of the Gaussian kernel, and RBF CKA means nothing), got {t!r}"}, lines
    api = set()
    for call in (lambda: repsim.similarity_matrix([store], ["rbf_cka"], method="exact", options={"rbf_threshold": t},
                                                  progress=False),
                 lambda: repsim.similarity_matrix([store], ["rbf_cka"], options={"rbf_threshold": t}, progress=False),
                 lambda: repsim.similarity(np.eye(5), np.eye(5), "rbf_cka", rbf_threshold=t),
                 lambda: get_measure("rbf_cka", rbf_threshold=t),
                 lambda: MinibatchRBFCKA(repsim.MinibatchCKA(2), t)):
        with pytest.raises(ValueError) as e:
            call()
        api.add(str(e.value))
    assert api == {"rbf_threshold " + next(iter(lines)).split(": ", 1)[1]}, api
    assert not (tmp_path / "r.npz").exists()


def test_10_the_largest_threshold_allowed_still_has_its_digits():
    """At the upper end RBF CKA is its t -> inf limit (biased linear CKA: exp(-d/s) = 1 - d/s + ...) to
    1e-7; at 1e8, outside the range, float64 had lost it."""
    from repsim.kernels.measures import get_measure
    from repsim.kernels.measures.rbf_cka import RBF_THRESHOLD_RANGE, rbf_gram

    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 10))
    y = x[:, :3] @ rng.normal(size=(3, 8)) + 2 * rng.normal(size=(200, 8))
    h = np.eye(200) - 1 / 200

    def cka(t):
        a = h @ rbf_gram((h @ x) @ (h @ x).T, t) @ h
        b = h @ rbf_gram((h @ y) @ (h @ y).T, t) @ h
        return np.sum(a * b) / np.sqrt(np.sum(a * a) * np.sum(b * b))

    hi = RBF_THRESHOLD_RANGE[1]
    get_measure("rbf_cka", rbf_threshold=hi)  # allowed
    assert cka(hi) == pytest.approx(repsim.linear_cka(x, y, debiased=False), abs=1e-7)
    assert abs(cka(1e8) - repsim.linear_cka(x, y, debiased=False)) > 0.05


# --------------------------------------------------------------- 6, 7. checkpoints and heads bound


def _version_1(path):
    """A store as repsim wrote it before the checksum manifest (version 1; its store_uuid kept)."""
    import json
    import shutil

    shutil.rmtree(path / "checksums")
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["repsim_store_version"] = 1
    (path / "zarr.json").write_text(json.dumps(meta))


def test_6_a_version_1_store_rewritten_in_place_after_a_checkpoint_is_not_resumed(tmp_path):
    """The checkpoint's identity (store_uuid) did not change and v1 has no manifest: the resume mixed
    the old and the new data (CKA 0.39 or 0.20; 0.98 before the edit, -0.002 after)."""
    import zarr

    from repsim.engine.checkpoint import StaleCheckpointError
    from repsim.engine.minibatch import cka_matrix

    rng = np.random.default_rng(6)
    x = rng.normal(size=(200, 16))
    path = tmp_path / "v1.zarr"
    _store(path, layers={"f": x, "g": x + 0.1 * rng.normal(size=(200, 16))})
    _version_1(path)
    ckpt = tmp_path / "run.ckpt.npz"
    kw = dict(batch_size=50, seed=1, progress=False, checkpoint=ckpt, checkpoint_every=1)
    before = cka_matrix([str(path)], epochs=1, **kw)
    assert before.get("v1", "f", "v1", "g") > 0.95
    uuid = repsim.open_store(path).identity
    zarr.open_array(str(path / "layers" / "g"), mode="r+")[...] = rng.normal(size=(200, 16))  # in place
    assert repsim.open_store(path).identity == uuid  # the identity alone cannot tell
    with pytest.raises(StaleCheckpointError, match="was computed from other stores than the ones now at"):
        cka_matrix([str(path)], epochs=2, **kw)
    ckpt.unlink()
    after = cka_matrix([str(path)], epochs=2, **kw)  # afresh: the new content alone
    assert abs(after.get("v1", "f", "v1", "g")) < 0.1


def _headed(path, seed):
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.normal(size=(120, 8)), 0).astype(np.float32)
    w, b = rng.normal(size=(3, 8)) * (1 + 10 * seed), rng.normal(size=3)
    return _store(path, layers={"pool": x}, labels=np.arange(120) % 3, head=(w, b), logits=x @ w.T + b,
                  chunk_rows=40)


@pytest.mark.parametrize("group", ["head", "logits"])
@pytest.mark.parametrize("target_has_one", [True, False])
def test_7_a_head_or_logits_copied_from_another_store_is_refused(tmp_path, capsys, group, target_has_one):
    """`cp -r B/head A/head`: `check` said OK (the head's checksum record lived inside the copied group)
    and `collapse` used B's head (cos_std_weights 0.042 -> 0.400)."""
    import shutil

    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    _headed(b, 1)
    if target_has_one:
        _headed(a, 0)
        shutil.rmtree(a / group)
    else:
        _store(a, layers={"pool": np.ones((120, 8), np.float32) + np.arange(120)[:, None]}, chunk_rows=40)
    shutil.copytree(b / group, a / group)
    code, err = _run(capsys, "check", a)
    if group == "logits" and not target_has_one:  # no manifest column for them: named as a layout change
        assert code == 1 and "expected (3, 5) / (1, 5) for ['example_ids', 'labels', 'logits'" in err[0], err
        return
    assert code == 1 and "copied from" in " ".join(err), err
    if group == "head":
        code, err = _run(capsys, "collapse", a, "--layers", "pool", "--out", tmp_path / "c.csv")
        assert code == EXIT_REFUSED and len(err) == 1 and "head/weight" in err[0] and "copied from" in err[0], err
        assert not (tmp_path / "c.csv").exists()


# ------------------------------------------------------------------------------- 8. kNN ties


def _sparse_relu(rng, n, units=8):
    """A sparse 8-unit ReLU layer: most rows have one or two active units or none, so many training
    rows are exactly as similar to a query as others (all-zero rows: similarity 0 to everything)."""
    z = rng.normal(size=(n, units)) - 1.2
    x = np.maximum(z, 0).astype(np.float32)
    x[rng.random(n) < 0.3] = 0.0
    return np.round(x, 1)  # few distinct values: ties between different rows too


@pytest.mark.parametrize("block,query_bytes", [(64, 4096), (500, None), (37, 20000)])
def test_8_streamed_and_in_memory_knn_agree_exactly_with_planted_ties(block, query_bytes):
    """A sparse 8-unit ReLU layer: 0.403 (k = 100) in memory against 0.353 (k = 20) at --memory-budget 0
    (argpartition took any member of a tie at the k-th place, the streamed search the lowest index)."""
    from repsim.probes.knn import knn_neighbours, knn_probe, knn_probe_rows, knn_search_rows
    from repsim.probes.rows import Rows

    rng = np.random.default_rng(8)
    x_train, x_test = _sparse_relu(rng, 900), _sparse_relu(rng, 300)
    y_train = (x_train[:, :3].argmax(1) + (rng.random(900) < 0.4) * rng.integers(0, 4, 900)) % 4
    y_test = (x_test[:, :3].argmax(1) + (rng.random(300) < 0.4) * rng.integers(0, 4, 300)) % 4
    mem = knn_probe(x_train, y_train, x_test, y_test)
    streamed = knn_probe_rows(Rows.from_array(x_train, block), y_train, Rows.from_array(x_test, block), y_test,
                              query_bytes=query_bytes)
    assert streamed.best_param == mem.best_param and streamed.curve == mem.curve
    assert streamed.accuracy == mem.accuracy
    np.testing.assert_array_equal(streamed.predictions, mem.predictions)
    # the neighbours themselves, against the rule written out: stable sort of -similarity
    idx, _ = knn_neighbours(x_test, x_train, 50)
    def unit(x):
        norms = np.sqrt(np.sum(x * x, axis=1, keepdims=True))
        return x / np.where(norms > 0, norms, np.float32(1))

    cosine = (unit(x_test).astype(np.float64) @ unit(x_train).astype(np.float64).T).astype(np.float32)
    rule = np.argsort(-cosine, axis=1, kind="stable")[:, :50]  # larger first, ties: smaller index
    np.testing.assert_array_equal(idx, rule)
    got = np.concatenate([nb for _, _, nb, _ in knn_search_rows(Rows.from_array(x_test, block), np.arange(300),
                                                                Rows.from_array(x_train, block), np.arange(900),
                                                                50, query_bytes=query_bytes)])
    np.testing.assert_array_equal(got, idx)


# --------------------------------------------------------------------- 9. an unrecorded split


@pytest.mark.parametrize("recorded", [{"name": "toy"}, {}])
def test_9_a_test_store_without_a_split_holding_the_training_examples_is_refused(tmp_path, capsys, recorded):
    """Accepted before, and the training-set score written as the test score: a missing split counted as
    "no part in common" with the training store's."""
    rng = np.random.default_rng(9)
    x = np.maximum(rng.normal(size=(90, 6)) + np.arange(90)[:, None] % 3, 0).astype(np.float32)
    model = {"model": {"arch": "r18", "checkpoint_sha256": "aa" * 32}}
    save_store(str(tmp_path / "tr.zarr"), {"pool": x}, np.arange(90) % 3, example_ids=np.arange(90),
               meta={**model, "dataset": {"name": "toy", "split": "train"}})
    save_store(str(tmp_path / "te.zarr"), {"pool": x}, np.arange(90) % 3, example_ids=np.arange(90),
               meta={**model, **({"dataset": recorded} if recorded else {})})
    out = tmp_path / "res"
    code, err = _run(capsys, "probe", "--train", tmp_path / "tr.zarr", "--test", tmp_path / "te.zarr",
                     "--probe", "knn", "--out", out)
    assert code == EXIT_REFUSED, err
    assert "90 of the 90 examples of test store te are also in train store tr" in err[-1] and "--same-examples" in err[-1]
    assert not (out / "probes.csv").exists()
    # other examples under the same unknown split: scored
    save_store(str(tmp_path / "te2.zarr"), {"pool": x}, np.arange(90) % 3, example_ids=np.arange(1000, 1090),
               meta={**model, **({"dataset": recorded} if recorded else {})})
    code, err = _run(capsys, "probe", "--train", tmp_path / "tr.zarr", "--test", tmp_path / "te2.zarr",
                     "--probe", "knn", "--out", out)
    assert code == 0, err


# ------------------------------------------------------------- 12. streamed probes hold one block


def _pass_peaks(tmp_path, n, p=256, chunk=512, K=4):
    """Python-side peak bytes (tracemalloc, above what was live before) of the streamed linear probe's
    passes over a real store of n float16 rows in ``chunk``-row chunks, rows taken in a random order (the
    gather path), after a first pass (buffers kept between passes are the same for every n)."""
    import tracemalloc

    from repsim.probes._streamed import StreamedX
    from repsim.probes.rows import Rows

    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, p)).astype(np.float16)
    store = _store(tmp_path / f"s{n}.zarr", layers={"pool": x}, chunk_rows=chunk)
    rows = Rows.from_store(store, "layers/pool")
    X = StreamedX(rows, rng.permutation(n), np.zeros(p, np.float32), None, np.dtype(np.float32))
    R, A = rng.normal(size=(K, n)).astype(np.float32), rng.normal(size=(K, p))  # the solver's dtypes

    def abs_pass():  # as the solver's rounding bound takes them
        for _, blk in X.abs_blocks():
            blk.sum()
            del blk

    want = (x[X.select].astype(np.float64).T @ R.T.astype(np.float64)).T
    np.testing.assert_allclose(X.matmul_left(R), want, rtol=1e-4, atol=1e-3)  # the first pass: a real one
    tracemalloc.start()
    try:
        peaks = []
        for run in (lambda: X.matmul_left(R), lambda: X.t_matmul(A), abs_pass):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            run()
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return peaks


def test_12_a_streamed_pass_holds_one_block_whatever_n(tmp_path):
    """--memory-budget 8: peak RSS of `probe --probe linear` grew 127 -> 161 MiB and of `--relearn`
    152 -> 197 MiB from 10k to 40k rows. A pass held the previous block's rows (gathered and centred
    copies) while it read the next (the generators' and the caller's loop variables), and allocated those
    block-sized copies afresh for every block, which glibc kept resident. Now, from 1.4 chunks of rows
    to 5.2, a pass allocates (beyond the two block buffers the Rows keeps between passes) one chunk's
    read — its object and decoded rows, each at most the chunk's bytes — plus what is O(n) by design:
    the (K, n) products and the row order's index arrays, < 100 bytes a row. Before: 1.4-1.7 MB here,
    growing by 240-270 kB."""
    chunk, p, K = 512, 256, 4
    small, large = 700, 5 * 512 + 100
    a, b = _pass_peaks(tmp_path, small, p, chunk, K), _pass_peaks(tmp_path, large, p, chunk, K)
    per_row = 100  # bytes: t_matmul's (K, n) float32 output, the gather's sort order and positions (int64)
    read = 2 * chunk * p * 2  # one float16 chunk: its object (at most its bytes, + a checksum) and its rows
    for name, pa, pb in zip(("matmul_left", "t_matmul", "abs_blocks"), a, b):
        assert pb - pa <= per_row * (large - small), (name, pa, pb)
        assert pb <= read + per_row * large, (name, pb, read)


# --------------------------------------------------------------- 11. a one-seed demo's finding 1


def test_11_a_one_seed_finding_1_does_not_claim_a_test_it_did_not_run(tmp_path):
    """One seed per objective: the evidence said "(not tested)" and the why "transfers better ... beyond the
    seeds' noise (p = n/a)"."""
    import pandas as pd
    from test_analyses_figures import write_results

    from repsim.analyses import findings as F
    from repsim.analyses.data import Inputs

    res = write_results(tmp_path)
    probes = pd.read_csv(res / "probes.csv")
    low = (probes["objective"] == "softmax") & (probes["task"] != "source") & (probes["probe"] == "linear")
    probes.loc[low, "accuracy"] = 0.5
    probes[probes["seed"] == 0].to_csv(res / "probes.csv", index=False)
    f1 = F.finding_transfer(Inputs(None, res))
    assert "softmax transfers worse than the best (not tested)" in f1.evidence
    assert f1.why.startswith("(a) fails:") and "not tested" in f1.why.split(";")[0]
    assert "beyond the seeds' noise" not in f1.why and "p = n/a" not in f1.why


# ------------------------------------------------------------------------ 15. the docs' ridge claim


def test_15_ridge_r2_of_a_column_with_itself_is_far_below_1_when_p_exceeds_n_and_the_docs_say_so():
    """docs/measures.md said ridge R² of a column with itself is ≈ 1; with p > n cross-validated ridge
    gives 0.16 (the number is right: held-out rows lie mostly outside the training rows' span)."""
    import os
    import re

    from repsim.kernels.measures import get_measure
    from repsim.kernels.measures.exact import similarity

    rng = np.random.default_rng(15)
    for p, low, high in ((1000, 0.05, 0.4), (8, 0.99, 1.0)):
        x = rng.normal(size=(200, p))
        assert low <= similarity(x, x, "ridge_r2") <= high, p
    text = open(os.path.join(REPO, "docs", "measures.md")).read()
    row = next(line for line in text.splitlines() if line.startswith("| `ridge_r2`"))
    cell = re.split(r"(?<!\\)\|", row)[5]
    assert "≈ 1" not in cell and "p > n" in cell
    assert get_measure("ridge_r2").info.identical == 1.0  # the supremum, reached as p / n -> 0


@pytest.mark.parametrize("name", ["cka_all.npz", "spectra.npz"])
def test_13_figures_over_a_truncated_npz_name_it_in_one_line(tmp_path, capsys, name):
    """`repsim figures` over a truncated results npz: exit 70 and a BadZipFile traceback."""
    from test_analyses_figures import write_results

    res = write_results(tmp_path)
    f = res / name
    f.write_bytes(f.read_bytes()[:200])
    only = ["--only", "figE2"] if name == "spectra.npz" else ["--quiet"]
    code = main(["figures", "--results", str(res), "--out", str(tmp_path / "out"), *only])
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines()
             if f"{f} is not a readable" in line or f"{f} is a truncated or damaged .npz" in line]
    assert code in (1, 2) and "Traceback" not in captured.err, captured.err
    assert lines and all("truncated or damaged" in line for line in lines), captured
