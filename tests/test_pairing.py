"""Verified pairings, one finiteness rule, paths that are paths, and bounded options (issue 30), on
real stores through the CLI."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from repsim.commands.main import main
from repsim.engine.result import CKAResult
from repsim.store.writer import save_store


def net_store(path, seed, split, n, *, digest=None, model=None, logits_nan=0, dataset="toy", ids=None):
    """One network's features of one split: class structure shared by the seed's network."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(3, 6)) * 2
    y = np.arange(n) % 3
    X = np.maximum(means[y] + np.random.default_rng(seed * 7 + n).normal(size=(n, 6)), 0).astype(np.float32)
    logits = (X @ rng.normal(size=(6, 3))).astype(np.float32)
    logits[:logits_nan] = np.nan
    m = dict(model or {"objective": "softmax", "seed": seed})
    if digest:
        m["checkpoint_sha256"] = digest
    return save_store(path, {"pool": X}, y, logits=logits, example_ids=ids,
                      meta={"model": m, "dataset": {"name": dataset, "split": split}})


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture
def nets(tmp_path):
    for name, seed, digest in (("r18", 0, "aa" * 32), ("r34", 1, "bb" * 32)):
        net_store(tmp_path / f"{name}_tr.zarr", seed, "train", 90, digest=digest, model={"arch": name})
        net_store(tmp_path / f"{name}_te.zarr", seed, "test", 45, digest=digest, model={"arch": name})
    return tmp_path


def test_probe_refuses_stores_of_different_networks(nets, capsys):
    out = nets / "res"
    code, err = run(capsys, "probe", "--train", nets / "r18_tr.zarr", nets / "r34_tr.zarr",
                    "--test", nets / "r34_te.zarr", nets / "r18_te.zarr", "--probe", "knn", "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert "train store r18_tr and test store r34_te come from different networks: checkpoint digests differ" in err
    assert not (out / "probes.csv").exists()
    code, _ = run(capsys, "probe", "--train", nets / "r18_tr.zarr", nets / "r34_tr.zarr",
                  "--test", nets / "r18_te.zarr", nets / "r34_te.zarr", "--probe", "knn", "--out", out)
    assert code == 0


def test_probe_compares_the_model_metadata_of_save_store_stores(tmp_path, capsys):
    net_store(tmp_path / "a_tr.zarr", 0, "train", 90, model={"objective": "softmax", "seed": 0})
    net_store(tmp_path / "b_te.zarr", 1, "test", 45, model={"objective": "sigmoid", "seed": 1})
    code, err = run(capsys, "probe", tmp_path / "a_tr.zarr", "--test", tmp_path / "b_te.zarr", "--out", tmp_path)
    assert code == 2 and "model metadata differ (objective 'softmax' vs 'sigmoid'; seed 0 vs 1)" in err


def test_probe_refuses_shared_examples_unless_asked_and_then_says_so(nets, capsys):
    out = nets / "res"
    code, err = run(capsys, "probe", "--train", nets / "r18_te.zarr", "--test", nets / "r18_te.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 2 and "are the same store" in err and "--same-examples" in err
    # another store of the same split holding some of the same examples
    net_store(nets / "r18_more.zarr", 0, "test", 45, digest="aa" * 32, model={"arch": "r18"}, ids=np.arange(40, 85))
    code, err = run(capsys, "probe", "--train", nets / "r18_more.zarr", "--test", nets / "r18_te.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 2 and "5 of the 45 examples of test store r18_te are also in train store r18_more" in err
    code, err = run(capsys, "probe", "--train", nets / "r18_te.zarr", "--test", nets / "r18_te.zarr",
                    "--probe", "knn", "--same-examples", "--out", out)
    assert code == 0 and "WARNING: train store r18_te and test store r18_te are the same store" in err


def test_calibrate_pairs_like_probe_and_blames_the_store_with_nan_logits(tmp_path, capsys):
    net_store(tmp_path / "te.zarr", 0, "test", 45, digest="aa" * 32)
    net_store(tmp_path / "ho.zarr", 0, "holdout", 30, digest="aa" * 32, logits_nan=2)
    net_store(tmp_path / "other.zarr", 1, "holdout", 30, digest="bb" * 32)
    out = tmp_path / "cal.csv"
    code, err = run(capsys, "calibrate", "--test", tmp_path / "te.zarr", "--holdout", tmp_path / "ho.zarr", "--out", out)
    assert code == 2 and "error: store ho: logits holds 6 NaN/Inf value(s) in 2 row(s) (first: row 0)" in err
    code, err = run(capsys, "calibrate", "--test", tmp_path / "te.zarr", "--holdout", tmp_path / "other.zarr", "--out", out)
    assert code == 2 and "test store te and holdout store other come from different networks" in err


def test_relearn_refuses_nan_logits_like_accuracy(tmp_path, capsys):
    net_store(tmp_path / "src.zarr", 0, "test", 90, logits_nan=3)
    code, err = run(capsys, "accuracy", tmp_path / "src.zarr", "--out", tmp_path / "acc.csv")
    assert code == 2 and "store src: logits holds 9 NaN/Inf value(s) in 3 row(s)" in err
    code, err = run(capsys, "probe", "--relearn", tmp_path / "src.zarr", "--per-class", "5", "--out", tmp_path)
    assert code == 2 and "store src: logits holds 9 NaN/Inf value(s) in 3 row(s)" in err
    assert not (tmp_path / "probes.csv").exists()


def test_store_arguments_are_paths_and_only_missing_ones_are_globs(tmp_path, capsys):
    for name, seed in (("run[1]", 0), ("run*", 1), ("run2", 2), ("n", 3)):
        net_store(tmp_path / f"{name}.zarr", seed, "test", 45)
    out = tmp_path / "cka.npz"
    code, err = run(capsys, "cka", tmp_path / "run[1].zarr", tmp_path / "n.zarr", "--method", "exact", "--out", out)
    assert code == 0, err
    assert CKAResult.load(out).stores == ["run[1]", "n"]
    code, err = run(capsys, "cka", tmp_path / "run*.zarr", tmp_path / "n.zarr", "--method", "exact", "--out", out,
                    "--overwrite")
    assert code == 0, err
    assert CKAResult.load(out).stores == ["run*", "n"]  # the store named so, not every run*.zarr
    code, err = run(capsys, "cka", tmp_path / "run?.zarr", tmp_path / "n.zarr", "--method", "exact", "--out", out,
                    "--overwrite")  # missing, so a pattern: run*.zarr and run2.zarr
    assert code == 0, err
    assert CKAResult.load(out).stores == ["run*", "run2", "n"]


@pytest.mark.parametrize("option,value", [("--seed", "-1"), ("--shuffle-window", "-5"), ("--checkpoint-every", "-1"),
                                          ("--shuffle-window", "0")])
def test_out_of_range_options_name_the_option(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        main(["cka", str(tmp_path / "a.zarr"), option, value, "--out", str(tmp_path / "x.npz")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: argument {option}: must be >= " in err and "Traceback" not in err


def test_save_store_warns_when_nothing_can_check_the_row_order(tmp_path):
    X = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
    meta = {"dataset": {"name": "toy", "split": "test"}}
    with pytest.warns(UserWarning, match="all 20 rows have the same label"):
        save_store(tmp_path / "a.zarr", {"pool": X}, np.zeros(20, int), meta=meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_store(tmp_path / "b.zarr", {"pool": X}, np.arange(20) % 2, meta=meta)  # labels can tell
        save_store(tmp_path / "c.zarr", {"pool": X}, np.zeros(20, int), example_ids=np.arange(20), meta=meta)


@pytest.mark.parametrize("method", ["minibatch", "exact"])
def test_overflowing_float64_layer_is_named_not_called_constant(tmp_path, capsys, method):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 5)) * 1e160
    save_store(tmp_path / "big.zarr", {"a": X, "b": rng.normal(size=(64, 5))}, np.arange(64) % 2)
    code, err = run(capsys, "cka", tmp_path / "big.zarr", "--method", method, "--batch-size", "16", "--epochs", "1",
                    "--out", tmp_path / "x.npz", "--no-progress")
    assert code == 2 and "layer 'a': chunk 0 holds values up to" in err and "overflow float64" in err
    assert "constant" not in err


def test_probe_and_calibrate_refuse_stores_of_different_datasets_unless_asked(tmp_path, capsys):
    """A probe fit on `digits` and scored on `digits-source` (whose examples are all in the training set:
    shared_examples compares ids only within one dataset) reported top-1 1.0 with exit 0; fit on
    digits-source and scored on digits-target (other classes under the same labels), 0.28; calibrate fit
    its temperature on another dataset's labels. The dataset names must agree (up to a size suffix @N)."""
    ids = np.arange(90)
    net_store(tmp_path / "all_tr.zarr", 0, "train", 90, digest="aa" * 32, dataset="digits", ids=ids)
    net_store(tmp_path / "src_tr.zarr", 0, "train", 45, digest="aa" * 32, dataset="digits-source", ids=ids[:45])
    out = tmp_path / "res"
    code, err = run(capsys, "probe", "--train", tmp_path / "all_tr.zarr", "--test", tmp_path / "src_tr.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert ("train store all_tr (dataset 'digits') and test store src_tr (dataset 'digits-source') hold different "
            "datasets") in err and "--allow-mixed-datasets" in err
    assert not (out / "probes.csv").exists()
    code, err = run(capsys, "probe", "--train", tmp_path / "all_tr.zarr", "--test", tmp_path / "src_tr.zarr",
                    "--probe", "knn", "--allow-mixed-datasets", "--out", out)
    assert code == 0 and "WARNING: train store all_tr (dataset 'digits') and test store src_tr" in err
    # one dataset at two sizes (repsim.train.data's @N: at most N training images per class) pairs, and its
    # example ids are compared: a test store inside the training store is caught across the suffix
    net_store(tmp_path / "t2000_tr.zarr", 0, "train", 90, digest="aa" * 32, dataset="target@2000", ids=ids)
    net_store(tmp_path / "t_te.zarr", 0, "test", 45, digest="aa" * 32, dataset="target", ids=ids[:45])
    net_store(tmp_path / "t_tr.zarr", 0, "train", 45, digest="aa" * 32, dataset="target", ids=ids[40:85])
    code, err = run(capsys, "probe", "--train", tmp_path / "t2000_tr.zarr", "--test", tmp_path / "t_te.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 0, err
    code, err = run(capsys, "probe", "--train", tmp_path / "t2000_tr.zarr", "--test", tmp_path / "t_tr.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 2 and "45 of the 45 examples of test store t_tr are also in train store t2000_tr" in err
    # calibrate: the temperature is fit on the holdout of the test store's dataset
    net_store(tmp_path / "src_te.zarr", 0, "test", 45, digest="aa" * 32, dataset="digits-source")
    net_store(tmp_path / "tgt_ho.zarr", 0, "holdout", 30, digest="aa" * 32, dataset="digits-target")
    net_store(tmp_path / "src_ho.zarr", 0, "holdout", 30, digest="aa" * 32, dataset="digits-source")
    cal = tmp_path / "cal.csv"
    code, err = run(capsys, "calibrate", "--test", tmp_path / "src_te.zarr", "--holdout", tmp_path / "tgt_ho.zarr",
                    "--out", cal)
    assert code == 2 and err.count("\n") == 1 and not cal.exists()
    assert ("test store src_te (dataset 'digits-source') and holdout store tgt_ho (dataset 'digits-target') hold "
            "different datasets: a temperature fit on another dataset's holdout") in err
    code, err = run(capsys, "calibrate", "--test", tmp_path / "src_te.zarr", "--holdout", tmp_path / "tgt_ho.zarr",
                    "--allow-mixed-datasets", "--out", cal)
    assert code == 0 and "WARNING: test store src_te" in err
    code, err = run(capsys, "calibrate", "--test", tmp_path / "src_te.zarr", "--holdout", tmp_path / "src_ho.zarr",
                    "--out", cal)
    assert code == 0, err
    # the library calls the demo makes apply the same rule
    from repsim.probes.writers import write_calibration, write_probes

    with pytest.raises(ValueError, match="hold different datasets"):
        write_probes([tmp_path / "all_tr.zarr"], [tmp_path / "src_tr.zarr"], probe=["knn"], out=out)
    with pytest.raises(ValueError, match="hold different datasets"):
        write_calibration([tmp_path / "src_te.zarr"], [tmp_path / "tgt_ho.zarr"], cal)
    rows, _ = write_probes([tmp_path / "all_tr.zarr"], [tmp_path / "src_tr.zarr"], probe=["knn"], out=out,
                           allow_mixed_datasets=True, progress=False)
    assert len(rows) == 1


def test_a_test_store_inside_a_train_plus_holdout_store_is_caught(tmp_path, capsys):
    """`train+holdout` (the paper's retraining set) holds the holdout's examples under the holdout's ids:
    a probe fit on it and scored on the holdout is a training-set score (the splits' names differ, so
    their ids were never compared); train and holdout alone share no part and are not compared."""
    ids = np.arange(90)
    net_store(tmp_path / "all.zarr", 0, "train+holdout", 90, digest="aa" * 32, ids=ids)
    net_store(tmp_path / "ho.zarr", 0, "holdout", 30, digest="aa" * 32, ids=ids[60:])
    net_store(tmp_path / "tr.zarr", 0, "train", 30, digest="aa" * 32, ids=ids[60:])  # ids of another split's rows
    out = tmp_path / "res"
    code, err = run(capsys, "probe", "--train", tmp_path / "all.zarr", "--test", tmp_path / "ho.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 2 and "30 of the 30 examples of test store ho are also in train store all" in err
    code, err = run(capsys, "probe", "--train", tmp_path / "tr.zarr", "--test", tmp_path / "ho.zarr",
                    "--probe", "knn", "--out", out)
    assert code == 0, err


def test_swapped_train_and_test_stores_are_pointed_out(nets, capsys):
    """--train a test-split store, --test a train-split store: scored, with a WARNING that asks."""
    code, err = run(capsys, "probe", "--train", nets / "r18_te.zarr", "--test", nets / "r18_tr.zarr",
                    "--probe", "knn", "--out", nets / "res")
    assert code == 0
    assert "WARNING: train store r18_te holds the test split and test store r18_tr the train split: did you swap " \
           "--train and --test?" in err
    code, err = run(capsys, "probe", "--train", nets / "r18_tr.zarr", "--test", nets / "r18_te.zarr",
                    "--probe", "knn", "--out", nets / "res2")
    assert code == 0 and "did you swap" not in err


def test_a_directory_of_stores_or_a_run_directory_given_as_a_store_says_what_it_is(tmp_path, capsys):
    d = tmp_path / "stores"
    net_store(d / "a.zarr", 0, "test", 30)
    run_dir = tmp_path / "runs" / "softmax-s0"
    run_dir.mkdir(parents=True)
    (run_dir / "best.pt").write_bytes(b"x")
    code, err = run(capsys, "cka", d, "--out", tmp_path / "c.npz")
    assert code == 2 and f"a directory of 1 store(s) (a.zarr): pass them, e.g. {d}/*.zarr" in err
    code, err = run(capsys, "cka", run_dir, "--out", tmp_path / "c.npz")
    assert code == 2 and f"a training run (best.pt): extract its activations first, repsim extract --checkpoint " \
                         f"{run_dir}/best.pt" in err
