"""Stores that know what they are (issue 30): every chunk is bound to its array and index by the
checksum manifest, version-1 stores still read, and creation is all-or-nothing on disk."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil

import numpy as np
import pytest
import zarr

from repsim.commands.main import main
from repsim.store import writer as writer_mod
from repsim.store.format import StoreError
from repsim.store.reader import open_store
from repsim.store.writer import StoreWriter, save_store


def make(path, seed=0, n=96, head=False):
    rng = np.random.default_rng(seed)
    layers = {"conv": rng.standard_normal((n, 3, 2, 2)).astype(np.float32),
              "pool": rng.standard_normal((n, 8)).astype(np.float32)}
    W = rng.standard_normal((4, 8)).astype(np.float32)
    return save_store(path, layers, np.arange(n) * 4 // n, logits=rng.standard_normal((n, 4)), chunk_rows=32,
                      meta={"dataset": {"name": "toy", "split": "test"}},
                      head=(W, np.zeros(4, np.float32)) if head else None)


def swap(a, b):
    tmp = str(a) + ".swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def check(capsys, *paths):
    code = main(["check", "--no-progress", *map(str, paths)])
    return code, capsys.readouterr().err


def test_swapped_layer_chunks_fail_check_and_every_read(tmp_path, capsys):
    s = tmp_path / "net.zarr"
    make(s)
    assert check(capsys, s)[0] == 0
    chunks = s / "layers" / "pool" / "c"
    swap(chunks / "0" / "0", chunks / "2" / "0")
    code, err = check(capsys, s)
    assert code == 1 and "layers/pool: chunk 0 (rows 0:32)" in err and "not the one written here" in err
    with pytest.raises(StoreError, match=r"layers/pool: chunk [02] .*moved, swapped"):
        open_store(s).layer("pool").compute()
    with pytest.raises(StoreError, match=r"layers/pool: chunk 2"):
        open_store(s).read_chunk("pool", 2)
    with pytest.raises(StoreError, match=r"layers/pool: chunk 2 .*moved, swapped"):
        open_store(s).chunk_object("pool", 2)  # the GPU-decoding route checks the manifest too
    out = tmp_path / "cka.npz"
    assert main(["cka", str(s), "--layers", "pool,conv", "--method", "exact", "--out", str(out)]) == 2
    assert not out.exists()


def test_swapped_label_and_id_chunks_and_manifest_rows_are_refused(tmp_path, capsys):
    s = tmp_path / "net.zarr"
    make(s)
    swap(s / "labels" / "c" / "0", s / "labels" / "c" / "1")
    with pytest.raises(StoreError, match=r"store net: labels: chunk 0 \(rows 0:32\)"):
        open_store(s).labels
    swap(s / "labels" / "c" / "0", s / "labels" / "c" / "1")  # restored
    np.testing.assert_array_equal(open_store(s).labels, np.arange(96) // 24)
    swap(s / "checksums" / "c" / "1" / "0", s / "checksums" / "c" / "2" / "0")
    code, err = check(capsys, s)
    assert code == 1 and "chunk index 1 is the one written for chunk 2" in err


def test_chunk_copied_from_another_store_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    make(a, seed=0, head=True)
    make(b, seed=1, head=True)
    shutil.copyfile(b / "layers" / "conv" / "c" / "1" / "0" / "0" / "0", a / "layers" / "conv" / "c" / "1" / "0" / "0" / "0")
    shutil.copyfile(b / "head" / "weight" / "c" / "0" / "0", a / "head" / "weight" / "c" / "0" / "0")
    code, err = check(capsys, a)
    assert code == 1 and "layers/conv: chunk 1" in err and "head" in err
    with pytest.raises(StoreError, match="head/weight: chunk 0"):
        open_store(a).head


def test_version_1_stores_still_read_and_check_says_what_is_not_verified(tmp_path, capsys):
    """A store as repsim wrote it before the manifest: no ``checksums`` array, version 1."""
    s = tmp_path / "old.zarr"
    make(s)
    shutil.rmtree(s / "checksums")
    meta = json.loads((s / "zarr.json").read_text())
    meta["attributes"]["repsim_store_version"] = 1
    (s / "zarr.json").write_text(json.dumps(meta))
    st = open_store(s)
    assert st.version == 1 and st.layer("pool").compute().shape == (96, 8)
    code, err = check(capsys, s)
    assert code == 0 and "note: store old: store version 1" in err
    # resuming a version-1 store keeps it version 1 (no half-written manifest)
    w = StoreWriter.open(s)
    assert w._manifest is None
    meta["attributes"]["repsim_store_version"] = 2  # a version-2 store must have its manifest
    (s / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="missing array 'checksums'"):
        open_store(s)


def test_creation_interrupted_by_a_full_disk_leaves_nothing_and_reruns(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr.Group, "update_attributes", full)
    with pytest.raises(OSError, match="No space left") as exc:
        make(path)
    assert exc.value.filename == str(path)  # the full path of the store, not a bare "No space left"
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # neither the store nor its staging folder
    make(path)
    assert open_store(path).complete


def test_a_half_created_store_of_an_older_repsim_is_named_and_overwritable(tmp_path, monkeypatch):
    path = tmp_path / "half.zarr"
    g = zarr.open_group(str(path), mode="w-", zarr_format=3)  # what the old creation order left
    g.create_array("example_ids", shape=(96,), chunks=(32,), dtype="int64")
    with pytest.raises(StoreError, match=rf"{path}\): not a repsim activation store but what an interrupted creation"):
        open_store(path)
    with pytest.raises(StoreError, match=rf"{path} holds an interrupted creation.*--overwrite"):
        make(path)
    monkeypatch.chdir(tmp_path)  # a relative path is shown in full
    with pytest.raises(StoreError, match=rf"{path} holds an interrupted creation"):
        make("half.zarr")
    save_store(path, {"a": np.zeros((4, 2), np.float32)}, np.zeros(4, int), overwrite=True)
    assert open_store(path).complete


def test_two_creators_of_one_store_the_second_is_told(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    build = writer_mod._build

    def racing(*a, **k):  # another process publishes the same store while this one builds its own
        out = build(*a, **k)
        monkeypatch.setattr(writer_mod, "_build", build)
        # (the store's writer lock, repsim.store.lock, refuses a second writer first: this one runs as where
        # no lock can be taken, to check the creation's own refusal behind it)
        monkeypatch.setattr(writer_mod, "lock_store", lambda *a, **k: contextlib.nullcontext())
        make(path, seed=1)
        return out

    monkeypatch.setattr(writer_mod, "_build", racing)
    with pytest.raises(StoreError, match=rf"another process created {path} while this one was creating it"):
        make(path)
    assert open_store(path).complete and sorted(os.listdir(tmp_path)) == ["s.zarr"]


def test_a_corrupt_written_flag_is_named_by_its_chunk(tmp_path, capsys):
    s = tmp_path / "net.zarr"
    make(s)
    f = s / "written" / "c" / "2"
    raw = bytearray(f.read_bytes())
    raw[0] ^= 0xFF
    f.write_bytes(bytes(raw))
    code, err = check(capsys, s)
    assert code == 1 and "store net: written: chunk 2 (rows 2:3) could not be read" in err


def test_sha256_file_is_the_sha256_of_the_bytes(tmp_path):
    """repsim.fileio.sha256_file (a checkpoint's identity, model.checkpoint_sha256): the file mapped and
    hashed in one call, or read block by block where it cannot be mapped (an empty file)."""
    import hashlib

    from repsim.fileio import sha256_file

    data = np.random.default_rng(0).bytes(3 << 20)
    full, empty = tmp_path / "f.bin", tmp_path / "e.bin"
    full.write_bytes(data)
    empty.write_bytes(b"")
    assert sha256_file(full) == hashlib.sha256(data).hexdigest()
    assert sha256_file(empty) == hashlib.sha256(b"").hexdigest()
