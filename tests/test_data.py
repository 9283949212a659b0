"""Tests for jaxsys.data: corpora, tokenizer, sampler, sharded global batches."""

from __future__ import annotations

import time
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import data as D


def cfg(**kw) -> types.SimpleNamespace:
    base = dict(source="text", path="", token_dtype="uint16", eval_fraction=0.1, seq_len=8)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def stdlib_corpus(stdlib_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSYS_CACHE", str(stdlib_cache))
    try:
        yield D.load_corpus(cfg(source="stdlib", eval_fraction=0.01, seq_len=128))
    finally:
        mp.undo()


# ---------------------------------------------------------------- stdlib


def test_stdlib_corpus(stdlib_corpus, stdlib_cache, monkeypatch):
    c = stdlib_corpus
    n = c.train.shape[0] + c.eval.shape[0]
    assert n > 1_000_000
    assert c.vocab_needed == 256 and c.has_eval
    assert c.train.dtype == np.uint8
    assert b"def " in np.asarray(c.train[:200_000]).tobytes()
    # eval is the tail: 1% of the corpus, contiguous after train.
    assert c.eval.shape[0] == int(n * 0.01)
    cached = list(stdlib_cache.glob("stdlib-*.npy"))
    assert len(cached) == 1 and not list(stdlib_cache.glob("*.tmp"))
    full = np.load(cached[0], mmap_mode="r")
    np.testing.assert_array_equal(full[-c.eval.shape[0] :], c.eval)
    np.testing.assert_array_equal(full[: c.train.shape[0]], c.train)

    monkeypatch.setenv("JAXSYS_CACHE", str(stdlib_cache))
    t0 = time.perf_counter()
    c2 = D.load_corpus(cfg(source="stdlib", eval_fraction=0.01, seq_len=128))
    elapsed = time.perf_counter() - t0
    assert isinstance(c2.train, np.memmap)
    np.testing.assert_array_equal(c2.train, c.train)
    np.testing.assert_array_equal(c2.eval, c.eval)
    assert elapsed < 5.0  # loose; the real target is < 1 s


def test_stdlib_no_eval(stdlib_corpus, stdlib_cache, monkeypatch):
    monkeypatch.setenv("JAXSYS_CACHE", str(stdlib_cache))
    c = D.load_corpus(cfg(source="stdlib", eval_fraction=0.0, seq_len=16))
    assert not c.has_eval and c.eval.shape == (0,)
    with pytest.raises(D.DataError, match="config.data.eval_fraction"):
        D.batch_rows(c, 0, 0, 4, 16, "eval", slice(None))


# ---------------------------------------------------------------- tokenizer


def test_byte_roundtrip():
    s = "héllo, wörld ✓\n"
    ids = D.byte_encode(s)
    assert ids.dtype == np.uint8 and ids.shape == (len(s.encode()),)
    assert D.byte_decode(ids) == s
    assert D.byte_decode(np.array([0xFF, 65], np.int32)) == "\ufffdA"


# ---------------------------------------------------------------- sampler


def test_sample_offsets_deterministic_and_bounded():
    a = D.sample_offsets(1, 5, 64, 1000, 10, "train")
    b = D.sample_offsets(1, 5, 64, 1000, 10, "train")
    assert a.dtype == np.int64 and a.shape == (64,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, D.sample_offsets(1, 6, 64, 1000, 10, "train"))
    assert not np.array_equal(a, D.sample_offsets(1, 5, 64, 1000, 10, "eval"))
    assert not np.array_equal(a, D.sample_offsets(2, 5, 64, 1000, 10, "train"))
    # Tight bounds: num_tokens = T + 3 -> offsets in {0, 1, 2}; all values hit.
    o = D.sample_offsets(0, 0, 4096, 13, 10, "train")
    assert set(o.tolist()) == {0, 1, 2}
    o = D.sample_offsets(0, 0, 16, 11, 10, "train")
    assert (o == 0).all()
    with pytest.raises(D.DataError):
        D.sample_offsets(0, 0, 4, 10, 10, "train")
    with pytest.raises(D.DataError, match="split"):
        D.sample_offsets(0, 0, 4, 100, 10, "test")


# ---------------------------------------------------------------- global batch


def test_global_batch_matches_numpy_and_reads_only_local_rows(tmp_path, monkeypatch):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    tokens = np.arange(5000, dtype=np.uint32) * 7 % 50_021
    np.save(tmp_path / "t.npy", tokens)
    corpus = D.load_corpus(cfg(source="tokens", path=str(tmp_path / "t.npy"), seq_len=32))

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    B, T = 32, 32

    calls: list[tuple[slice, ...]] = []
    real = jax.make_array_from_callback

    def spy(shape, sharding, cb, *a, **k):
        def rec(index):
            calls.append(index)
            return cb(index)

        return real(shape, sharding, rec, *a, **k)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    for split in ("train", "eval"):
        calls.clear()
        arr = D.global_batch(corpus, sharding, seed=3, step=7, batch_size=B, seq_len=T, split=split)
        assert arr.shape == (B, T + 1) and arr.dtype == np.int32
        assert arr.sharding == sharding
        ref = D.batch_rows(corpus, 3, 7, B, T, split, slice(None))
        np.testing.assert_array_equal(np.asarray(arr), ref)
        # Each row is a contiguous window of the split.
        toks = corpus.train if split == "train" else corpus.eval
        offs = D.sample_offsets(3, 7, B, toks.shape[0], T, split)
        for i in (0, B - 1):
            np.testing.assert_array_equal(ref[i], toks[offs[i] : offs[i] + T + 1])
        # The callback is only asked for disjoint row slices of size B / 8.
        assert len(calls) == 8
        starts = set()
        for index in calls:
            r = index[0]
            start, stop, stride = r.indices(B)
            assert stop - start == B // 8 and stride == 1
            starts.add(start)
        assert starts == set(range(0, B, B // 8))
        # batch_rows on a slice agrees with the full batch.
        np.testing.assert_array_equal(D.batch_rows(corpus, 3, 7, B, T, split, slice(8, 12)), ref[8:12])

    other = D.batch_rows(corpus, 3, 8, B, T, "train", slice(None))
    assert not np.array_equal(other, D.batch_rows(corpus, 3, 7, B, T, "train", slice(None)))


# ---------------------------------------------------------------- text / tokens


def test_text_source(tmp_path):
    (tmp_path / "b.txt").write_text("world ✓\n" * 20, encoding="utf-8")
    (tmp_path / "a.txt").write_text("hello " * 20, encoding="utf-8")
    expected = (tmp_path / "a.txt").read_bytes() + (tmp_path / "b.txt").read_bytes()
    for path in (str(tmp_path / "*.txt"), f"{tmp_path / 'b.txt'}, {tmp_path / 'a.txt'}"):
        c = D.load_corpus(cfg(source="text", path=path, eval_fraction=0.25, seq_len=8))
        assert c.vocab_needed == 256
        got = np.concatenate([c.train, c.eval]).tobytes()
        assert got == expected
        assert c.eval.shape[0] == int(len(expected) * 0.25)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_bin(tmp_path, dtype):
    rng = np.random.default_rng(0)
    high = 60_000 if dtype == "uint16" else 200_000
    ids = rng.integers(0, high, size=3000).astype(dtype)
    ids[1234] = high  # known max
    ids.tofile(tmp_path / "t.bin")
    c = D.load_corpus(cfg(source="tokens", path=str(tmp_path / "t.bin"), token_dtype=dtype, eval_fraction=0.0))
    assert c.vocab_needed == high + 1 and not c.has_eval
    np.testing.assert_array_equal(c.train, ids)


def test_tokens_npy_and_chunked_vocab(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_MAX_CHUNK", 100)  # exercise multi-chunk max pass
    ids = (np.arange(1001) % 97).astype(np.int32)
    ids[777] = 4321
    np.save(tmp_path / "t.npy", ids)
    c = D.load_corpus(cfg(source="tokens", path=str(tmp_path / "t.npy"), eval_fraction=0.2))
    assert c.vocab_needed == 4322
    np.testing.assert_array_equal(np.concatenate([c.train, c.eval]), ids)
    assert c.eval.shape[0] == 200


# ---------------------------------------------------------------- errors


def _raises(c, *needles):
    with pytest.raises(D.DataError) as e:
        D.load_corpus(c)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_errors(tmp_path):
    missing = str(tmp_path / "nope.txt")
    _raises(cfg(path=missing), missing, "config.data.path")
    pat = str(tmp_path / "*.nothing")
    _raises(cfg(path=pat), pat, "config.data.path")
    _raises(cfg(path=str(tmp_path)), "config.data.path")

    (tmp_path / "empty.txt").write_bytes(b"")
    _raises(cfg(path=str(tmp_path / "empty.txt")), "empty")

    (tmp_path / "short.txt").write_bytes(b"x" * 20)
    msg = _raises(cfg(path=str(tmp_path / "short.txt"), seq_len=32), "config.data.seq_len", "20")
    assert "33" in msg
    # Train fits but eval (10% of 100 = 10 tokens) does not.
    (tmp_path / "mid.txt").write_bytes(b"x" * 100)
    _raises(cfg(path=str(tmp_path / "mid.txt"), seq_len=16), "eval split", "config.data.eval_fraction")

    msg = _raises(cfg(source="csv"), "config.data.source")
    assert all(s in msg for s in ("stdlib", "text", "tokens"))

    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    _raises(cfg(source="tokens", path=str(tmp_path / "f.npy")), "f.npy", "float32")
    np.save(tmp_path / "2d.npy", np.zeros((10, 10), np.uint16))
    _raises(cfg(source="tokens", path=str(tmp_path / "2d.npy")), "2d.npy", "1-D")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    _raises(cfg(source="tokens", path=str(tmp_path / "odd.bin")), "odd.bin", "config.data.token_dtype")
    np.zeros(100, np.uint16).tofile(tmp_path / "ok.bin")
    _raises(cfg(source="tokens", path=str(tmp_path / "ok.bin"), token_dtype="int8"), "config.data.token_dtype")
    _raises(cfg(eval_fraction=0.5), "config.data.eval_fraction")
    _raises(cfg(seq_len=0), "config.data.seq_len")
    _raises(types.SimpleNamespace(source="text"), "config.data.")
