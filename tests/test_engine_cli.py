"""`repsim cka|separation|sparsity|collapse` end to end, including SIGKILL + resume of `repsim cka`."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import repsim
from repsim.commands.main import main
from repsim.engine.result import CKAResult
from test_engine_helpers import checkpoint_segments as _done, correlated_layers, make_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    n = 2400
    for name in ("net_a", "net_b"):
        layers = correlated_layers(rng, n, {"block": (16, 8, 8), "pool": (300,)})
        make_store(root / f"{name}.zarr", {k: v.astype(np.float32) for k, v in layers.items()},
                   labels=np.arange(n) % 6, meta={"model": {"objective": name[-1], "seed": 1}}, chunk_rows=100,
                   head=(rng.normal(size=(6, 300)), np.zeros(6)))
    return root


def test_cka_killed_mid_epoch_resumes_to_the_uninterrupted_result(nets, tmp_path):
    # windows of 4 chunks = one batch: 6 window-batches per epoch, one checkpointed segment each
    args = [str(nets / "*.zarr"), "--batch-size", "400", "--shuffle-window", "400", "--epochs", "4", "--seed", "3",
            "--checkpoint-every", "1", "--no-progress"]
    cmd = [sys.executable, "-m", "repsim", "cka"]
    out = str(tmp_path / "cka_killed.npz")
    ckpt = str(tmp_path / "cka_killed.ckpt.npz")
    # the run kills itself (SIGKILL, no cleanup) right after its 7th checkpoint (one batch into epoch 2): a
    # known point, not wherever it had got when a poll saw the checkpoint
    killer = ("import os, signal, sys\n"
              "from repsim.engine.checkpoint import Checkpoint\n"
              "save = Checkpoint.save\n"
              "def save_then_die(self, done, state):\n"
              "    save(self, done, state)\n"
              "    if done == 7:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "Checkpoint.save = save_then_die\n"
              "from repsim.commands.main import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", killer, "cka"] + args + ["--out", out], env=_env(),
                          capture_output=True, text=True, timeout=300)  # a hang guard, not a speed check
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(out), proc.stderr[-2000:]
    killed_at = _done(ckpt)
    assert killed_at == 7, killed_at  # mid-epoch

    rerun = subprocess.run(cmd + args + ["--out", out], env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from {ckpt}: {killed_at}/24 segments done" in rerun.stderr
    assert not os.path.exists(ckpt)  # removed once the output is written

    whole = str(tmp_path / "cka_whole.npz")
    ref = subprocess.run(cmd + args + ["--out", whole], env=_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    got, want = CKAResult.load(out), CKAResult.load(whole)
    np.testing.assert_array_equal(got.values, want.values)
    np.testing.assert_array_equal(got.state["batches"], want.state["batches"])
    assert got.index == [("net_a", "block"), ("net_a", "pool"), ("net_b", "block"), ("net_b", "pool")]
    assert got.meta["epochs"] == 4 and got.meta["n_batches"] == 24


def test_cka_cli_exact_and_errors(nets, tmp_path, capsys):
    out = tmp_path / "cka_exact.npz"
    assert main(["cka", str(nets / "net_a.zarr"), str(nets / "net_b.zarr"), "--layers", "pool", "--method", "exact",
                 "--out", str(out), "--no-progress"]) == 0
    res = CKAResult.load(out)
    assert res.meta["method"] == "exact" and res.values.shape == (2, 2)
    assert main(["cka", str(nets / "net_a.zarr"), "--layers", "nope", "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert "net_a" in err and "nope" in err and "Traceback" not in err
    out64 = tmp_path / "cka64.npz"
    assert main(["cka", str(nets / "net_a.zarr"), "--epochs", "1", "--batch-size", "16", "--compute-dtype", "float64",
                 "--out", str(out64), "--no-progress"]) == 0
    assert set(CKAResult.load(out64).meta["gram_dtypes"].values()) == {"float64"}


def test_table_commands_write_contract_csvs(nets, tmp_path):
    stores = [str(nets / "*.zarr")]
    sep, spa, col, spec = (tmp_path / f for f in ("separation.csv", "sparsity.csv", "collapse.csv", "spectra.npz"))
    assert main(["separation", *stores, "--distance", "cosine,sqeuclidean", "--spatial", "mean", "--out", str(sep),
                 "--no-progress"]) == 0
    assert main(["sparsity", *stores, "--out", str(spa), "--no-progress"]) == 0
    assert main(["collapse", *stores, "--out", str(col), "--spectra", str(spec), "--no-progress"]) == 0
    rows = {p.name: list(csv.DictReader(open(p))) for p in (sep, spa, col)}
    meta = ["dataset", "split", "n", "spatial", "method", "engine_spatial"]  # estimator metadata
    assert list(rows["separation.csv"][0]) == ["store", "objective", "seed", "layer", "distance", "r2", *meta]
    assert len(rows["separation.csv"]) == 2 * 2 * 2
    assert {r["engine_spatial"] for r in rows["separation.csv"]} == {"mean"}
    assert list(rows["sparsity.csv"][0]) == ["store", "objective", "seed", "layer", "nonzero_fraction", *meta]
    assert {r["engine_spatial"] for r in rows["sparsity.csv"]} == {"flatten"}
    assert {r["objective"] for r in rows["sparsity.csv"]} == {"a", "b"}
    assert rows["collapse.csv"][0]["layer"] == "pool" and "self_duality" in rows["collapse.csv"][0]
    with np.load(spec) as z:
        assert set(z.files) == {f"net_{s}/pool/{k}" for s in "ab" for k in ("activations", "centroids", "weights")}


def test_table_commands_merge_into_an_existing_out(nets, tmp_path):
    """A second store's run keeps the first's rows (and spectra); a rerun replaces its own rows."""
    a, b = str(nets / "net_a.zarr"), str(nets / "net_b.zarr")
    sep, col, spec = tmp_path / "separation.csv", tmp_path / "collapse.csv", tmp_path / "spectra.npz"
    for store in (a, b, a):
        assert main(["separation", store, "--layers", "pool", "--out", str(sep), "--no-progress"]) == 0
        assert main(["collapse", store, "--out", str(col), "--spectra", str(spec), "--no-progress"]) == 0
    for path in (sep, col):
        rows = list(csv.DictReader(open(path)))
        assert sorted(r["store"] for r in rows) == ["net_a", "net_b"], path
    with np.load(spec) as z:
        assert {k.split("/")[0] for k in z.files} == {"net_a", "net_b"}
    assert main(["separation", a, "--layers", "pool", "--distance", "sqeuclidean", "--out", str(sep),
                 "--no-progress"]) == 0  # another distance is another result
    assert sorted((r["store"], r["distance"]) for r in csv.DictReader(open(sep))) == [
        ("net_a", "cosine"), ("net_a", "sqeuclidean"), ("net_b", "cosine")]


def test_accuracy_of_two_stores_sharing_a_name_keeps_both(tmp_path, capsys):
    """sm/tgt.zarr and cos/tgt.zarr (README's layout): rows named by path in one call, and a second
    call for the other network does not replace the first's row."""
    rng = np.random.default_rng(3)
    paths = []
    for net, seed in (("sm", 0), ("cos", 1)):
        logits = rng.normal(size=(60, 4))
        store = repsim.save_store(str(tmp_path / net / "tgt.zarr"), layers={"pool": rng.normal(size=(60, 5))},
                                  labels=np.arange(60) % 4, logits=logits,
                                  meta={"model": {"objective": net, "seed": seed}})
        paths.append(str(store.path))
    together, apart = tmp_path / "together.csv", tmp_path / "apart.csv"
    assert main(["accuracy", *paths, "--out", str(together)]) == 0
    assert sorted(r["store"] for r in csv.DictReader(open(together))) == sorted(paths)
    for p in paths:
        assert main(["accuracy", p, "--out", str(apart)]) == 0
    assert sorted(r["objective"] for r in csv.DictReader(open(apart))) == ["cos", "sm"]


def _merge_one(args):
    from repsim.results import merge_csv

    path, i = args
    merge_csv([{"store": f"s{i}", "value": i}], path, ("store",))


def test_concurrent_merges_into_one_results_file_keep_every_row(tmp_path):
    """A job array of per-network runs sharing one CSV: each read-merge-replace holds the file's lock."""
    import multiprocessing as mp

    path = str(tmp_path / "probes.csv")
    with mp.get_context("fork").Pool(8) as pool:
        pool.map(_merge_one, [(path, i) for i in range(32)], chunksize=1)
    assert sorted(int(r["value"]) for r in csv.DictReader(open(path))) == list(range(32))


def test_a_checkpoint_named_without_npz_is_removed_after_the_run(nets, tmp_path):
    out, ckpt = tmp_path / "c.npz", tmp_path / "run.ckpt"
    assert main(["cka", str(nets / "net_a.zarr"), "--layers", "pool", "--epochs", "1", "--checkpoint", str(ckpt),
                 "--out", str(out), "--no-progress"]) == 0
    assert out.exists() and not (tmp_path / "run.ckpt.npz").exists()


@pytest.mark.parametrize("command,flag,value,message", [
    ("cka", "--scheduler", "local:0", "local:N needs N >= 1 worker processes, got 'local:0'"),  # hung forever
    ("cka", "--scheduler", "local:x", "local:N needs N >= 1 worker processes, got 'local:x'"),
    ("similarity", "--rbf-threshold", "0", "must be a finite number > 0, got 0"),  # ZeroDivisionError, exit 70
    ("similarity", "--rbf-threshold", "-1", "must be a finite number > 0, got -1"),  # squared: ran as 1
    ("similarity", "--ridge-folds", "1", "must be >= 2, got 1"),  # all NaN, exit 0
    ("similarity", "--rsa-max-rows", "2", "must be >= 3, got 2"),
    ("probe", "--lambdas", "-3", "must be >= 1, got -3"),  # numpy's "Number of samples, -3, must be non-negative"
    ("probe", "--val-fraction", "1.5", "must lie strictly between 0 and 1, got 1.5"),
])
def test_out_of_range_flags_are_one_line_naming_the_flag(nets, tmp_path, capsys, command, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        main([command, str(nets / "net_a.zarr"), flag, value, "--out", str(tmp_path / "x.npz")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err and "Traceback" not in err
