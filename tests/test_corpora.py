"""Corpora of documents: jsonl, Parquet and Hugging Face datasets on disk round-trip through the
tokenized shards (text and messages fields); the tokenize command's shards equal encoding the
documents directly; an interrupted build resumes; damaged or missing shards and absent fields are
named before anything compiles, and nothing saved is lost."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxsys import tokenize, train
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.data import DataError, documents, shards
from tests.helpers import ROOT, small_config

HF_TOKENIZER = os.path.join(ROOT, "tests", "golden", "hf_llama", "tokenizer")
TEXTS = [
    "def main():\n    return 0\n",
    "Grüße aus Zürich — ünïcödé",
    "a",
    "",
    "the quick brown fox jumps over the lazy dog " * 5,
    "x = [i ** 2 for i in range(10)]",
    "line one\nline two\n\nline four",
]
CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ],
    [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue."}],
]


def data_config(tmp_path, source, path, **keys):
    c = small_config()
    c.data.source, c.data.path = source, str(path)
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.tokenize_workers = 1
    for k, v in keys.items():
        c.data[k] = v
    return c


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_parquet(path, rows, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return path


def stored(store):
    return [store.document(i) for i in range(store.num_docs)]


def expected_text(tok, texts):
    return [documents.encode_text(tok, t, "test") for t in texts]


@pytest.mark.parametrize("tokenizer", ["bytes", HF_TOKENIZER])
def test_text_round_trips_through_jsonl_parquet_and_hf_on_disk(tmp_path, tokenizer):
    import datasets

    rows = [{"text": t, "id": i} for i, t in enumerate(TEXTS)]
    write_jsonl(tmp_path / "a.jsonl", rows[:4])
    write_jsonl(tmp_path / "b.jsonl", rows[4:])
    write_parquet(tmp_path / "p.parquet", rows, row_group_size=3)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[2:]), "test": datasets.Dataset.from_list(rows[:2])})
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[2:]), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(tmp_path / "dict"))
    tok = tokenizer_lib.load_source(tokenizer)
    want = expected_text(tok, TEXTS)
    cases = {
        "jsonl": ("jsonl", str(tmp_path / "*.jsonl"), {}, want),
        "parquet": ("parquet", tmp_path / "p.parquet", {}, want),
        "hf saved": ("hf", tmp_path / "saved", {}, want),
        "hf dict split": ("hf", tmp_path / "dict", {"split": "test"}, want[:2]),
        "hf data files": ("hf", tmp_path / "p.parquet", {}, want),
    }
    for name, (source, path, keys, expect) in cases.items():
        c = data_config(tmp_path, source, path, tokenizer=tokenizer, shard_docs=3, **keys)
        store = shards.load(c.data, progress=False, log=lambda *_: None)
        got = stored(store)
        assert len(got) == len(expect), name
        for (ids, mask), w in zip(got, expect):
            np.testing.assert_array_equal(ids, w, err_msg=name)
            assert mask is None
        if tok.eos_ids:  # text documents end in the tokenizer's EOS, so that packed ones stay apart
            assert all(int(ids[-1]) == tok.eos_ids[0] for ids, _ in got)
        assert store.manifest["vocab_needed"] == max(int(w.max()) for w in expect if w.size) + 1


def test_chats_round_trip_with_their_assistant_masks(tmp_path):
    import datasets

    tok = tokenizer_lib.HFTokenizer(HF_TOKENIZER)
    rows = [{"messages": m, "source": "test"} for m in CHATS]
    write_jsonl(tmp_path / "c.jsonl", rows)
    write_parquet(tmp_path / "c.parquet", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    want = [documents.assistant_mask(tok, m) for m in CHATS]
    for source, path in (("jsonl", "c.jsonl"), ("parquet", "c.parquet"), ("hf", "saved")):
        c = data_config(tmp_path, source, tmp_path / path, tokenizer=HF_TOKENIZER, format="chat", shard_docs=2)
        got = stored(shards.load(c.data, progress=False, log=lambda *_: None))
        for (ids, mask), (w_ids, w_mask) in zip(got, want, strict=True):
            np.testing.assert_array_equal(ids, w_ids, err_msg=source)
            np.testing.assert_array_equal(mask, w_mask, err_msg=source)


def test_tokenize_command_shards_equal_encoding_the_documents(tmp_path, capsys):
    """The command with 2 worker processes: every shard is the documents of its unit encoded."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "δ", "\n"], rng.integers(1, 40))) for _ in range(23)]
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    args = [
        "--config",
        os.path.join(ROOT, "configs", "tiny.py:test"),
        "--config.data.source=jsonl",
        f"--config.data.path={tmp_path / 'd.jsonl'}",
        f"--config.data.tokenizer={HF_TOKENIZER}",
        f"--config.data.cache_dir={tmp_path / 'cache'}",
        "--config.data.shard_docs=5",
        "--workers=2",
        "--quiet",
    ]
    assert tokenize.main(args) == 0
    out = capsys.readouterr().out
    assert "23 documents" in out and "5 shards" in out
    c = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", tokenizer=HF_TOKENIZER, shard_docs=5)
    store = shards.open_store(shards.directory(c.data))
    tok = tokenizer_lib.HFTokenizer(HF_TOKENIZER)
    for (ids, _), w in zip(stored(store), expected_text(tok, texts), strict=True):
        np.testing.assert_array_equal(ids, w)
    assert store.tokens[0].dtype == np.uint16  # 384 ids
    assert tokenize.main(args + ["--verify"]) == 0  # a complete cache: checked, nothing rebuilt
    assert "rebuilding" not in capsys.readouterr().out


def test_an_interrupted_tokenize_resumes_with_the_shards_it_finished(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"document {i} " * (i % 7 + 1)} for i in range(20)])
    c = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", shard_docs=4)  # 5 units
    real, calls = shards._tokenize_unit, []

    def dies_on_the_third(job):
        calls.append(job["index"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(shards, "_tokenize_unit", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        shards.build(c.data, progress=False)
    directory = shards.directory(c.data)
    assert not os.path.exists(os.path.join(directory, "manifest.json"))
    assert sorted(shards._read_ledger(directory)) == [0, 1]
    assert not [f for f in os.listdir(directory) if f.endswith(".tmp")]  # nothing half-written
    calls.clear()
    monkeypatch.setattr(shards, "_tokenize_unit", lambda job: calls.append(job["index"]) or real(job))
    shards.build(c.data, progress=False)
    assert calls == [2, 3, 4]  # only what was missing
    fresh = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", shard_docs=4, cache_dir=str(tmp_path / "fresh"))
    shards.build(fresh.data, progress=False)
    for (a, _), (b, _) in zip(stored(shards.open_store(directory)), stored(shards.load(fresh.data)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_absent_field_is_named_and_the_finished_shards_stay(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(6)] + [{"body": "no text here", "id": 6}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    c = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", shard_docs=3)
    with pytest.raises(DataError, match=r"d.jsonl record 7 has no field 'text'.*\['body', 'id'\]"):
        shards.build(c.data, progress=False)
    assert sorted(shards._read_ledger(shards.directory(c.data))) == [0, 1]
    write_parquet(tmp_path / "p.parquet", [{"body": "x"}])
    c = data_config(tmp_path, "parquet", tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"has no column 'text'.*\['body'\]"):
        shards.build(c.data, progress=False)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": "not a list"}])
    c = data_config(tmp_path, "jsonl", tmp_path / "chat.jsonl", format="chat", tokenizer=HF_TOKENIZER)
    with pytest.raises(DataError, match="record 1: the messages field holds a str"):
        shards.build(c.data, progress=False)


def test_a_damaged_or_missing_shard_is_named_before_compilation_and_nothing_saved_is_lost(tmp_path, monkeypatch):
    from jaxsys import program as program_lib

    write_jsonl(tmp_path / "d.jsonl", [{"text": f"document number {i}: " + "words " * (i % 9)} for i in range(40)])
    c = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", shard_docs=10, eval_fraction=0.1)
    c.train.steps, c.checkpoint.every_steps, c.mesh.data = 2, 2, 8
    workdir = tmp_path / "run"
    train.main(c, str(workdir))
    saved = sorted(os.listdir(workdir / "checkpoints"))
    directory = shards.directory(c.data)
    tokens_file = os.path.join(directory, "00001.tokens.npy")
    with open(tokens_file, "r+b") as f:
        f.truncate(os.path.getsize(tokens_file) - 8)

    def no_build(*args, **kwargs):
        raise AssertionError("a program was built before the error")

    monkeypatch.setattr(program_lib, "build", no_build)
    monkeypatch.setattr(train, "build", no_build)
    c.train.steps = 4
    with pytest.raises(DataError, match=r"00001.tokens.npy has \d+ bytes, the ledger says \d+.*jaxsys.tokenize"):
        train.main(c, str(workdir))
    os.remove(os.path.join(directory, "00002.docs.npy"))
    with pytest.raises(DataError, match="00001.tokens.npy"):  # the first damaged shard is named
        train.main(c, str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == saved  # nothing saved is lost
    logged = []
    shards.build(c.data, progress=False, log=logged.append)
    assert len(logged) == 2 and "shard 1" in logged[0] and "shard 2" in logged[1] and "missing" in logged[1]
    shards.open_store(directory)  # whole again
    # several processes never build the cache themselves: the error names the command
    other = data_config(tmp_path, "jsonl", tmp_path / "d.jsonl", cache_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match="not tokenized yet.*python -m jaxsys.tokenize"):
        shards.load(other.data, build_missing=False)
