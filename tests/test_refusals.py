"""What repsim refuses (issue 15): inputs that used to give a wrong or misrecorded result with exit 0,
and failures that used to end in a traceback, now end in one line naming the file, store or key,
with the exit status documented in ``repsim.commands.main.EXIT_CODES`` (README "What repsim refuses").

Real stores on disk, real subprocesses for SIGKILL and for a full disk (``RLIMIT_FSIZE``: a write
past the limit fails with EFBIG, the same path as ENOSPC). The torch-side reproductions (extract
order, train resume, fake checkpoints) live in tests/test_extract.py and tests/test_train_loop.py.
"""
from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import zarr

import repsim
from repsim.commands.main import main
from repsim.store.format import StoreError
from repsim.store.reader import open_store
from repsim.store.writer import save_store
from test_engine_helpers import checkpoint_segments, correlated_layers, signalled_at_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_REFUSED, EXIT_IO = 2, 3  # the documented exit statuses (README "What repsim refuses")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _store(path, *, seed=0, n=200, dataset=None, labels=None, chunk_rows=50, **kw):
    rng = np.random.default_rng(seed)
    layers = correlated_layers(rng, n, {"f": (24,)})
    meta = {"dataset": dataset} if dataset else None
    return save_store(str(path), {k: v.astype(np.float32) for k, v in layers.items()},
                      np.arange(n) % 4 if labels is None else labels, example_ids=np.arange(n), meta=meta,
                      chunk_rows=chunk_rows, **kw)


def _run(capsys, *argv) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ------------------------------------------------------------------- 2. cka resume vs a replaced store


def test_cka_resume_after_a_store_was_replaced_in_place_is_refused(tmp_path):
    for name, seed in (("a", 0), ("b", 1), ("other", 2)):
        _store(tmp_path / f"{name}.zarr", seed=seed, n=400, chunk_rows=100)
    a, b, out = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "cka.npz"
    ckpt = tmp_path / "cka.ckpt.npz"
    cmd = [sys.executable, "-m", "repsim", "cka", str(a), str(b), "--batch-size", "100", "--shuffle", "window",
           "--epochs", "200", "--checkpoint-every", "1", "--no-progress", "--out", str(out)]
    # killed (SIGKILL) by itself right after its 3rd checkpoint: a known point, not a poll's
    proc = subprocess.run(signalled_at_checkpoint(cmd[3:], 3, signal.SIGKILL), env=_env(), capture_output=True,
                          text=True, timeout=300)  # a hang guard, not a speed check
    done = checkpoint_segments(ckpt)
    assert proc.returncode == -signal.SIGKILL and done == 3, proc.stderr[-2000:]

    # another network's store, same ids, put where b was: resuming would mix the two
    shutil.rmtree(b)
    shutil.copytree(tmp_path / "other.zarr", b)
    rerun = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    err = rerun.stderr.strip().splitlines()
    assert rerun.returncode == EXIT_REFUSED, rerun.stderr
    assert len(err) == 1 and f"checkpoint {ckpt} was computed from other stores than the ones now at {b}" in err[0]
    assert f"delete {ckpt} to start over" in err[0]
    assert not out.exists() and checkpoint_segments(ckpt) == done  # nothing mixed, nothing lost


def test_cka_overwrite_after_a_kill_between_output_and_checkpoint_removal(tmp_path, capsys, monkeypatch):
    """A run killed after writing --out but before removing its checkpoint leaves a finished run's
    checkpoint, no newer than the output. A later --overwrite over replaced stores must start afresh
    (removing it, with a note), not refuse as if resuming (the crash audit's case)."""
    for name, seed in (("a", 0), ("b", 1), ("other", 2)):
        _store(tmp_path / f"{name}.zarr", seed=seed, n=200, chunk_rows=50)
    a, b, out = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "cka.npz"
    ckpt = tmp_path / "cka.ckpt.npz"
    argv = ["cka", a, b, "--batch-size", "50", "--shuffle", "none", "--checkpoint-every", "1", "--no-progress",
            "--out", out]
    real_remove = os.remove
    with monkeypatch.context() as m:  # the kill: the checkpoint outlives the finished output
        m.setattr(os, "remove", lambda p, *k, **kw: None if str(p) == str(ckpt) else real_remove(p, *k, **kw))
        assert _run(capsys, *argv)[0] == 0
    assert out.exists() and ckpt.exists() and os.path.getmtime(ckpt) <= os.path.getmtime(out)
    first = repsim.load_result(str(out)).matrix("linear_cka").copy()

    shutil.rmtree(b)
    shutil.copytree(tmp_path / "other.zarr", b)
    code, err = _run(capsys, *argv, "--overwrite")
    assert code == 0, err
    assert f"repsim: removing {ckpt}, left by the finished run that wrote {out}" in err
    assert not ckpt.exists()
    again = repsim.load_result(str(out)).matrix("linear_cka")
    assert not np.allclose(again, first)  # b is another network now: computed afresh, not resumed

    # a checkpoint newer than the output is an interrupted --overwrite run's: it is kept for resuming
    from repsim.engine.checkpoint import Checkpoint

    Checkpoint(ckpt, {"not": "yet"}).save(1, {})
    os.utime(ckpt, (os.path.getmtime(out) + 10,) * 2)
    args = __import__("argparse").Namespace(out=str(out), overwrite=True, checkpoint=None)
    from repsim.commands.cka import output_and_checkpoint

    assert output_and_checkpoint(args) == (str(out), str(ckpt)) and ckpt.exists()


def test_store_identity_tells_rewritten_stores_apart_even_without_a_uuid(tmp_path):
    path = tmp_path / "s.zarr"
    first = _store(path, seed=0)
    again = _store(path, seed=0, overwrite=True)  # same data, same second: a new store all the same
    assert len(first.identity) == 32 and first.identity != again.identity
    assert open_store(path).identity == again.identity
    # a store written before repsim recorded store_uuid: attrs digest + zarr.json mtime
    g = zarr.open_group(str(path), mode="r+")
    del g.attrs["store_uuid"]
    legacy = open_store(path).identity
    assert legacy.startswith("attrs-") and open_store(path).identity == legacy
    _store(path, seed=1, overwrite=True)
    del zarr.open_group(str(path), mode="r+").attrs["store_uuid"]
    assert open_store(path).identity != legacy


# ------------------------------------------------------------------- 3. stores of different datasets


def test_stores_of_different_datasets_are_refused_unless_allowed(tmp_path, capsys):
    a = _store(tmp_path / "A.zarr", dataset={"name": "cifar10", "split": "test"})
    b = _store(tmp_path / "B.zarr", seed=1, dataset={"name": "imagenet", "split": "val"})
    code, err = _run(capsys, "cka", a.path, b.path, "--out", tmp_path / "ab.npz", "--batch-size", "50",
                     "--epochs", "1", "--no-progress")
    assert code == EXIT_REFUSED and len(err) == 1, err
    assert "different datasets: 'B' vs 'A': name 'imagenet' vs 'cifar10'; split 'val' vs 'test'" in err[0]
    assert "--allow-mixed-datasets" in err[0] and not (tmp_path / "ab.npz").exists()
    code, err = _run(capsys, "check", "--no-progress", a.path, b.path)  # each store checked on its own: a note
    assert code == 0 and "store B: other data than store A (name 'imagenet' vs 'cifar10'" in err[0], err
    code, err = _run(capsys, "check", "--no-progress", "--compare", a.path, b.path)  # meant to be compared
    assert code == 1 and "store B: other data than store A (name 'imagenet' vs 'cifar10'" in err[0], err
    # the explicit override, for users who know the rows are the same examples
    assert main(["cka", a.path, b.path, "--out", str(tmp_path / "ab.npz"), "--batch-size", "50", "--epochs", "1",
                 "--no-progress", "--allow-mixed-datasets"]) == 0
    assert main(["check", "--no-progress", "--compare", "--allow-mixed-datasets", a.path, b.path]) == 0
    # without dataset names, labels that disagree on the same ids give unrelated stores away
    c = _store(tmp_path / "C.zarr", seed=2, labels=np.arange(200) % 3)
    with pytest.raises(ValueError, match="'C' has other labels than 'A' on the same example_ids"):
        repsim.cka_matrix([a, c], batch_size=50, epochs=1, progress=False)


def test_default_example_ids_warn_unless_the_dataset_is_named(tmp_path):
    x, y = np.ones((8, 2), np.float32) * np.arange(8)[:, None], np.zeros(8, int)
    with pytest.warns(UserWarning, match="example_ids default to 0..7 and no dataset is named"):
        save_store(tmp_path / "anon.zarr", {"f": x}, y)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (labels that vary: all-equal ones could not reveal rows in another order, which warns; test_pairing)
        save_store(tmp_path / "named.zarr", {"f": x}, np.arange(8) % 2, meta={"dataset": {"name": "digits", "split": "test"}})
        save_store(tmp_path / "ids.zarr", {"f": x}, y, example_ids=np.arange(8) + 100)


# ------------------------------------------------------------------- 4. check verifies every array


def _flip(path, offset=-6) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_check_verifies_the_checksums_of_every_array(tmp_path, capsys):
    rng = np.random.default_rng(0)
    s = _store(tmp_path / "A.zarr", logits=rng.normal(size=(200, 4)), head=(rng.normal(size=(4, 24)), np.zeros(4)))
    root = tmp_path / "A.zarr"
    for part in ("labels/c/1", "example_ids/c/2", "logits/c/3/0", "head/weight/c/0/0"):
        _flip(root / part)
    code, err = _run(capsys, "check", "--no-progress", s.path)
    assert code == 1
    for expected in ("store A: labels: chunk 1 (rows 50:100) could not be read",
                     "store A: example_ids: chunk 2 (rows 100:150) could not be read",
                     "store A: logits: chunk 3 (rows 150:200) could not be read",
                     "store A: head unreadable"):
        assert any(line.startswith(expected) for line in err), (expected, err)
    # ids and labels are verified even without the value scan
    code, err = _run(capsys, "check", "--no-progress", "--no-values", s.path)
    assert code == 1 and any(line.startswith("store A: labels: chunk 1") for line in err), err


# ------------------------------------------------------------------- smaller items


def test_minibatch_cka_refuses_a_layer_whose_width_changes():
    rng = np.random.default_rng(0)
    acc = repsim.MinibatchCKA(2, names=["s/a", "s/b"])
    acc.update([rng.normal(size=(8, 20)), rng.normal(size=(8, 3))])
    with pytest.raises(ValueError, match="s/a has 10 features in this batch but 20 in earlier ones"):
        acc.update([rng.normal(size=(8, 10)), rng.normal(size=(8, 3))])
    assert acc.n_batches == 1
    restored = repsim.MinibatchCKA.from_state(acc.to_state())  # a resumed checkpoint keeps the widths
    with pytest.raises(ValueError, match="s/a has 10 features"):
        restored.update([rng.normal(size=(8, 10)), rng.normal(size=(8, 3))])
    other = repsim.MinibatchCKA(2, names=["s/a", "s/b"]).update([rng.normal(size=(8, 5)), rng.normal(size=(8, 3))])
    with pytest.raises(ValueError, match="cannot merge: s/a has 5 features there but 20 here"):
        acc.merge(other)


def test_kernels_accept_nested_lists_like_numpy():
    x = [[1.0, 2.0], [3.0, 4.5], [5.0, 6.0], [7.0, 9.0], [1.0, 1.5], [2.0, 5.0]]
    y = [0, 0, 1, 1, 0, 1]
    X = np.asarray(x)
    assert repsim.linear_cka(x, x) == pytest.approx(1.0)
    assert repsim.linear_cka(x, X[:, ::-1].tolist()) == repsim.linear_cka(X, X[:, ::-1])
    assert repsim.class_separation(x, y) == repsim.class_separation(X, y)
    assert repsim.nonzero_fraction(x) == repsim.nonzero_fraction(X)
    assert repsim.collapse_metrics(x, y) == repsim.collapse_metrics(X, y)
    np.testing.assert_array_equal(repsim.MinibatchCKA(2).update([x, x]).result(),
                                  repsim.MinibatchCKA(2).update([X, X]).result())
    assert repsim.knn_probe(x, y, x, y, ks=[1]).accuracy == repsim.knn_probe(X, y, X, y, ks=[1]).accuracy


def test_probe_on_nan_features_names_the_store(tmp_path, capsys):
    x = np.random.default_rng(0).normal(size=(40, 6)).astype(np.float32)
    x[7, 2] = np.nan
    meta = {"dataset": {"name": "digits", "split": "train"}}
    save_store(tmp_path / "bad.zarr", {"pool": x}, np.arange(40) % 2, meta=meta)
    save_store(tmp_path / "ok.zarr", {"pool": np.nan_to_num(x)}, np.arange(40) % 2,
               meta={"dataset": {"name": "digits", "split": "test"}})  # other examples than the train store's
    code, err = _run(capsys, "probe", "--train", tmp_path / "bad.zarr", "--test", tmp_path / "ok.zarr",
                     "--out", tmp_path, "--no-progress")
    warned = [line for line in err if line.startswith("WARNING: ")]  # (the stores record no model to compare)
    err = [line for line in err if line not in warned]
    assert code == EXIT_REFUSED and len(err) == 1 and len(warned) == 1, (warned, err)
    assert err[0].startswith("repsim probe: error: store bad: layer 'pool' holds 1 NaN/Inf value(s)"), err


def test_cka_refuses_to_overwrite_an_existing_output(tmp_path, capsys):
    a = _store(tmp_path / "A.zarr")
    out = tmp_path / "results.npz"
    out.write_text("someone's results")
    argv = ["cka", a.path, "--out", out, "--batch-size", "50", "--epochs", "1", "--no-progress"]
    code, err = _run(capsys, *argv)
    assert code == EXIT_REFUSED and len(err) == 1 and "--overwrite" in err[0] and str(out) in err[0], err
    assert out.read_text() == "someone's results"
    assert main([str(v) for v in argv] + ["--overwrite"]) == 0
    assert repsim.CKAResult.load(out).values.shape == (1, 1)


def test_store_overwrite_never_deletes_what_is_not_a_store(tmp_path):
    args = ({"f": np.ones((4, 2), np.float32) * np.arange(4)[:, None]}, np.zeros(4, int))
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    with pytest.raises(StoreError, match="it is not a directory, so not an activation store"):
        save_store(notes, *args, overwrite=True)
    plain = tmp_path / "plain.zarr"
    zarr.open_group(str(plain), mode="w").create_array("x", shape=(3,), dtype="int8")
    with pytest.raises(StoreError, match="is not a repsim activation store"):
        save_store(plain, *args, overwrite=True)
    assert notes.read_text() == "precious" and (plain / "x").is_dir()


def _limited(limit_bytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))


@pytest.mark.parametrize("command", ["cka", "separation"])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_temporary(tmp_path, command):
    a = _store(tmp_path / "A.zarr")
    out = tmp_path / "out" / ("r.npz" if command == "cka" else "r.csv")
    extra = ["--batch-size", "50", "--epochs", "1"] if command == "cka" else []
    run = subprocess.run([sys.executable, "-m", "repsim", command, a.path, "--out", str(out), "--no-progress", *extra],
                         env=_env(), capture_output=True, text=True, timeout=120, preexec_fn=_limited(16))
    err = run.stderr.strip().splitlines()
    assert run.returncode == EXIT_IO and len(err) == 1, run.stderr
    assert err[0].startswith(f"repsim {command}: error: {out.parent}/") and "File too large" in err[0], err
    assert [p.name for p in out.parent.iterdir() if ".tmp-" in p.name] == []


def test_an_unwritable_output_is_one_line(tmp_path, capsys):
    a = _store(tmp_path / "A.zarr")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = _run(capsys, "separation", a.path, "--out", blocker / "sep.csv", "--no-progress")
    assert code == EXIT_IO and len(err) == 1 and str(blocker) in err[0], err
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        code, err = _run(capsys, "cka", a.path, "--out", ro / "cka.npz", "--batch-size", "50", "--epochs", "1",
                         "--no-progress")
        assert code == EXIT_IO and len(err) == 1 and "Permission denied" in err[0], err


def test_debug_shows_the_traceback_and_classify_tells_bugs_from_bad_input(tmp_path, capsys):
    code, err = _run(capsys, "check", "--no-progress", tmp_path / "missing.zarr")
    assert code == 1 and err[0].startswith("store missing:")  # check reports, never raises
    argv = ["cka", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "x.npz")]
    code, err = _run(capsys, *argv)
    assert code == EXIT_REFUSED and len(err) == 1 and err[0].startswith("repsim cka: error: store missing:"), err
    from repsim.commands.main import EXIT_CODES, classify

    assert EXIT_CODES[EXIT_REFUSED].startswith("refused") and EXIT_CODES[EXIT_IO].startswith("a file could not")
    for debug_argv in (["--debug", *argv], [*argv, "--debug"]):  # the traceback, and still the refusal's status
        code, err = _run(capsys, *debug_argv)
        assert code == EXIT_REFUSED, err
        assert err[0] == "Traceback (most recent call last):" and any(line.startswith("repsim.store") and "StoreError" in line
                                                                      and "does not exist" in line for line in err), err
        assert err[-1].startswith("repsim cka: error: store missing:"), err
    assert classify(OSError(errno.ENOSPC, "No space left on device", "/x/y")) == (
        EXIT_IO, "/x/y: No space left on device; free some space or choose another output location")
    assert classify(KeyError("layer 'x' is missing")) == (EXIT_REFUSED, "layer 'x' is missing")
    assert classify(TypeError("unsupported operand")) is None  # a bug: traceback, exit 70


def test_bad_arguments_are_one_line_naming_the_subcommand(capsys):
    """argparse's refusals are one line like every other (README "What repsim refuses"), not the usage block."""
    for argv, expected in ((["cka", "x", "--out", "y", "--batch-size", "-5"], "repsim cka: error: argument --batch-size:"),
                           (["cka", "x", "--out", "y", "--bogus"], "repsim cka: error: unrecognized arguments: --bogus"),
                           (["--bogus", "cka", "x", "--out", "y"], "repsim cka: error: unrecognized arguments: --bogus"),
                           (["cka"], "repsim cka: error: the following arguments are required:"),
                           (["nosuch"], "repsim: error: argument COMMAND: invalid choice: 'nosuch'")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == EXIT_REFUSED and len(err) == 1 and err[0].startswith(expected), (argv, err)
        assert err[0].endswith("--help lists the options)")


def test_a_store_named_twice_is_used_once_with_one_warning_line(tmp_path, capsys):
    """`repsim cka S S ./S` gave a 3x3 "CKA over 1 store(s)" whose index used paths; a repeat is dropped."""
    from tests.test_check import make_store

    with pytest.warns(UserWarning):
        make_store(tmp_path / "S.zarr")
    argv = ["cka", tmp_path / "S.zarr", tmp_path / "S.zarr", f"{tmp_path}/./S.zarr", "--out", tmp_path / "o.npz",
            "--batch-size", "100", "--epochs", "1", "--no-progress"]
    code, err = _run(capsys, *argv)
    assert code == 0, err
    assert err[:2] == [f"WARNING: store {tmp_path / 'S.zarr'} is named more than once: it is used once",
                       f"WARNING: store {tmp_path}/./S.zarr is named more than once (also as {tmp_path / 'S.zarr'}): "
                       "it is used once"], err
    assert err[2].startswith("repsim cka: 2x2 CKA over 1 store(s)")
    from repsim.engine.result import CKAResult

    assert [name for name, _ in CKAResult.load(tmp_path / "o.npz").index] == ["S", "S"]
