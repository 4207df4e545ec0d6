"""repsim's direct chunk I/O (repsim.store._chunkio) against zarr's own codec pipeline, byte for byte."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import zarr

from repsim.store._chunkio import TMP_PREFIX, fast_chunks
from repsim.store.format import StoreError, _codecs
from repsim.store.writer import StoreWriter
from repsim.store.reader import open_store


def _arrays(rng, n):
    conv = (rng.standard_normal((n, 3, 4, 5)) * 50).astype(np.float16)
    conv[conv < 0] = 0  # post-ReLU-like: half zeros
    conv.flat[:4] = [np.float16(6e-8), -0.0, np.nan, np.inf]
    return {"conv": conv, "pool": rng.standard_normal((n, 9)).astype(np.float32)}


def _objects(root: str) -> dict[str, bytes]:
    out = {}
    for f in glob.glob(os.path.join(root, "**", "c", "**"), recursive=True):
        if os.path.isfile(f):
            out[os.path.relpath(f, root)] = open(f, "rb").read()
    return out


@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("n,chunk_rows", [(50, 16), (48, 16), (7, 16)])
def test_writer_objects_equal_zarr_objects_and_reads_round_trip(tmp_path, n, chunk_rows, compression):
    """StoreWriter's direct writes produce the very bytes zarr writes (edge chunks padded with the
    fill value), and direct reads return what zarr reads."""
    rng = np.random.default_rng(0)
    data = _arrays(rng, n)
    ids, labels = np.arange(n, dtype=np.int64) * 3, (np.arange(n) % 4).astype(np.int32)
    w = StoreWriter.create(tmp_path / "fast.zarr", n=n, layers={k: (v.shape[1:], v.dtype) for k, v in data.items()},
                           chunk_rows=chunk_rows, compression=compression)
    assert all(f is not None for f in w._fast.values())
    for i in range(w.n_chunks):
        a, b = w.rows(i)
        w.write_chunk(i, layers={k: v[a:b] for k, v in data.items()}, labels=labels[a:b], example_ids=ids[a:b])
    store = w.finalize()
    chunk_rows = store.chunk_rows  # (the writer clips chunk_rows to n)

    # the same arrays written by zarr itself
    ref = zarr.open_group(str(tmp_path / "ref.zarr"), mode="w")
    for name, x in [("layers/conv", data["conv"]), ("layers/pool", data["pool"]), ("example_ids", ids),
                    ("labels", labels)]:
        codecs = _codecs(compression if name.startswith("layers/") else "zstd")
        arr = ref.create_array(name, shape=x.shape, chunks=(chunk_rows, *x.shape[1:]), dtype=x.dtype,
                               fill_value=0, **codecs)
        arr.with_config({"write_empty_chunks": True})[...] = x
    fast = _objects(str(tmp_path / "fast.zarr"))
    slow = _objects(str(tmp_path / "ref.zarr"))
    assert slow and set(slow) <= set(fast)
    for key, blob in slow.items():
        assert fast[key] == blob, key

    for name, x in data.items():
        arr = store.zarr_array(name)
        fc = fast_chunks(store.path, arr.path, arr)
        for i in range(store.n_chunks):
            a, b = i * chunk_rows, min(n, (i + 1) * chunk_rows)
            got = store.read_chunk(name, i)
            np.testing.assert_array_equal(got.view(f"u{x.dtype.itemsize}"), x[a:b].view(f"u{x.dtype.itemsize}"))
            np.testing.assert_array_equal(fc.read((i,) + (0,) * (x.ndim - 1)), arr[a:b])
        np.testing.assert_array_equal(np.asarray(store.layer(name)), x)  # the dask path
    assert not glob.glob(str(tmp_path / "fast.zarr" / "**" / f"{TMP_PREFIX}*"), recursive=True)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_corrupt_and_truncated_objects_raise_naming_the_chunk(tmp_path, compression):
    rng = np.random.default_rng(1)
    data = _arrays(rng, 40)
    w = StoreWriter.create(tmp_path / "s.zarr", n=40, layers={k: (v.shape[1:], v.dtype) for k, v in data.items()},
                           chunk_rows=10, compression=compression)
    for i in range(4):
        a, b = w.rows(i)
        w.write_chunk(i, layers={k: v[a:b] for k, v in data.items()}, labels=np.zeros(b - a, np.int32),
                      example_ids=np.arange(a, b))
    store = w.finalize()
    arr = store.zarr_array("conv")
    path = fast_chunks(store.path, arr.path, arr).path((2, 0, 0, 0))
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0x10
    open(path, "wb").write(bytes(blob))
    with pytest.raises(StoreError, match=r"conv.*chunk 2"):
        open_store(tmp_path / "s.zarr").read_chunk("conv", 2)
    open(path, "wb").write(bytes(blob[:3]))
    with pytest.raises(StoreError, match=r"conv.*chunk 2"):
        open_store(tmp_path / "s.zarr").read_chunk("conv", 2)
    np.testing.assert_array_equal(open_store(tmp_path / "s.zarr").read_chunk("conv", 1), data["conv"][10:20])
    # the encoded route (a GPU decodes the body: engine/device_decode.py) checks and names the same way
    got = open_store(tmp_path / "s.zarr").chunk_object("conv", 1)
    if compression == "none":
        assert got is None  # raw objects: nothing to decode, the usual read
    else:
        with pytest.raises(StoreError, match=r"conv.*chunk 2"):
            open_store(tmp_path / "s.zarr").chunk_object("conv", 2)
        from numcodecs import Zstd

        body, shape, dtype = got
        assert shape == (10, 3, 4, 5) and dtype == np.float16
        np.testing.assert_array_equal(np.frombuffer(Zstd().decode(body), dtype).reshape(shape), data["conv"][10:20])
    os.remove(path)
    assert open_store(tmp_path / "s.zarr").chunk_object("conv", 2) is None  # missing: the usual read names it


def test_other_encodings_fall_back_to_zarr(tmp_path):
    """An array with another codec chain (or a sharded one) is read through zarr, unchanged."""
    from zarr.codecs import BloscCodec

    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    a = g.create_array("blosc", shape=x.shape, chunks=(8, 3), dtype=x.dtype, compressors=[BloscCodec()])
    a[...] = x
    assert fast_chunks(str(tmp_path / "g.zarr"), "blosc", a) is None
    b = g.create_array("plain", shape=x.shape, chunks=(8, 3), dtype=x.dtype, **_codecs())
    b[...] = x
    fc = fast_chunks(str(tmp_path / "g.zarr"), "plain", b)
    assert fc is not None
    np.testing.assert_array_equal(fc.read((2, 0)), x[16:20])
    with pytest.raises(IndexError):
        fc.read((3, 0))
    with pytest.raises(ValueError, match="compression"):
        StoreWriter.create(tmp_path / "x.zarr", n=4, layers={"a": ((2,), np.float32)}, compression="lz4")
