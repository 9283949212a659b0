"""jaxsys/tokenizer.py: the Hugging Face tokenizer against `transformers` (golden files), the
incremental detokenizer, workdir records, and the commands that read text through a tokenizer.

tests/golden/hf_llama/tokenizer/ is a 384-token Llama-style tokenizer (byte fallback, SentencePiece
spaces, a chat template) for the golden tiny Llamas; tokenizer_golden.json holds what transformers
5.23 made of it, and <name>/text_greedy.json transformers' greedy continuations of a text prompt and
a chat (scripts/make_hf_tokenizer_golden.py, Python 3.11; these tests need neither torch nor
transformers).
"""

import json
import os
import random
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxsys import bench_serve, convert, data, train
from jaxsys import evaluate as evaluate_cli
from jaxsys import tokenizer as T
from jaxsys.quantization import workdir as quant_workdir
from tests.helpers import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden", "hf_llama")
TOKENIZER = os.path.join(GOLDEN, "tokenizer")
with open(os.path.join(GOLDEN, "tokenizer_golden.json"), encoding="utf-8") as _f:
    G = json.load(_f)


@pytest.fixture(scope="module")
def tok():
    return T.HFTokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A GPT-2-style byte-level BPE (no byte-fallback tokens: characters split inside tokens)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = "déjà vu 😀 中文 ☕ the cat sat on the mat, naïve café € " * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    backend.train_from_iterator([text], trainer)
    path = tmp_path_factory.mktemp("bytelevel")
    backend.save(str(path / "tokenizer.json"))
    return T.HFTokenizer(str(path))


# ----------------------------------------------------------------------------- against transformers


def test_encode_matches_transformers_and_tokenizers(tok):
    backend = Backend.from_file(os.path.join(TOKENIZER, "tokenizer.json"))
    for case in G["encode"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert backend.encode(case["text"]).ids == case["ids"], case["text"]
    assert tok.encode("The cat")[0] == G["bos_token_id"] == 1  # BOS as transformers adds it
    assert tok.encode("The cat", add_special_tokens=False)[0] != 1
    assert tok.vocab_size == G["vocab_size"] == 384 and tok.eos_ids == (G["eos_token_id"],)
    assert len(tok.byte_ids) == 256  # <0x00> ... <0xFF>


def test_add_bos_and_eos_token_from_tokenizer_config(tmp_path):
    """transformers 5 rebuilds the post-processor when tokenizer_config.json names add_bos_token or
    add_eos_token (the one left out counts as false): with add_eos_token alone, no BOS."""
    shutil.copytree(TOKENIZER, tmp_path / "t")
    config = json.load(open(tmp_path / "t" / "tokenizer_config.json"))
    json.dump({**config, "add_eos_token": True}, open(tmp_path / "t" / "tokenizer_config.json", "w"))
    with_eos = T.HFTokenizer(str(tmp_path / "t"))
    for case in G["encode_add_eos_token"]:
        assert with_eos.encode(case["text"]) == case["ids"], case["text"]


def test_decode_matches_transformers(tok):
    for case in G["decode"]:
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
        assert tok.decode(case["ids"]) == case["text_skip_special"]


def test_chat_template_renders_as_transformers(tok):
    for case in G["chat"]:
        assert tok.apply_chat_template(case["messages"]) == case["text"]
        assert (
            tok.apply_chat_template(case["messages"], add_generation_prompt=False) == case["text_no_generation_prompt"]
        )
        assert tok.encode_chat(case["messages"]) == case["ids"]  # the template writes BOS; none added
    for case in G["chat_errors"]:  # raise_exception in the template
        with pytest.raises(T.TokenizerError, match="refused the conversation") as e:
            tok.apply_chat_template(case["messages"])
        assert case["error"] in str(e.value)
    # a message key set to None is dropped, as transformers does
    assert tok.apply_chat_template([{"role": "user", "content": "Hello there", "name": None}]) == G["chat"][0]["text"]


def test_chat_template_from_tokenizer_config_and_named_templates(tmp_path, tok):
    template = open(os.path.join(TOKENIZER, "chat_template.jinja")).read()
    for i, value in enumerate(
        [template, [{"name": "other", "template": "x"}, {"name": "default", "template": template}]]
    ):
        d = tmp_path / f"t{i}"
        shutil.copytree(TOKENIZER, d)
        os.remove(d / "chat_template.jinja")
        config = json.load(open(d / "tokenizer_config.json"))
        json.dump({**config, "chat_template": value}, open(d / "tokenizer_config.json", "w"))
        assert T.HFTokenizer(str(d)).apply_chat_template(G["chat"][1]["messages"]) == G["chat"][1]["text"]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(TOKENIZER, "tokenizer.json"), bare)
    plain = T.HFTokenizer(str(bare / "tokenizer.json"))  # a tokenizer.json alone: no template, no EOS
    assert plain.chat_template is None and plain.eos_ids == () and plain.encode("the") == tok.encode("the")
    with pytest.raises(T.TokenizerError, match="has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(T.TokenizerError, match="no chat template"):
        T.ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_from_generation_config(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(TOKENIZER, d)
    for value, want in ((7, (2, 7)), ([2, 9, 4], (2, 9, 4))):
        json.dump({"eos_token_id": value}, open(d / "generation_config.json", "w"))
        assert T.HFTokenizer(str(d)).eos_ids == want


# ----------------------------------------------------------------------------- incremental detokenizer


def _stream(tok, ids, context=(), rng=None):
    rng = rng or random.Random(0)
    stream, pushes, k = tok.detokenizer(context), [], 0
    while k < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        pushes.append(stream.push(ids[k : k + n]))
        k += n
    return pushes, stream.flush()


@pytest.mark.parametrize("which", ["fixture", "byte_level", "bytes"])
def test_detokenizer_pushes_add_up_to_decode(which, tok, byte_level):
    """Random ids (byte-fallback runs, invalid UTF-8, special tokens, SentencePiece spaces): the
    pushes and flush concatenate to decode(ids), with a prompt as context too, and no push ends in
    a replacement character that more ids could still turn into a real one."""
    t = {"fixture": tok, "byte_level": byte_level, "bytes": T.ByteTokenizer()}[which]
    rng = random.Random(1)
    for trial in range(600):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(0, 40))]
        context = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(1, 9))] if trial % 2 else []
        head, full = t.decode(context), t.decode(context + ids)
        if head.endswith("\ufffd") or not full.startswith(head):
            continue  # a context is text shown whole: not one ending in an incomplete character
        pushes, rest = _stream(t, ids, context, rng)
        assert "".join(pushes) + rest == full[len(head) :], (context, ids, pushes, rest)
        if which != "bytes":  # the byte tokenizer emits U+FFFD at once for a byte that can never be valid
            assert not any(p.endswith("\ufffd") for p in pushes), (ids, pushes)


@pytest.mark.parametrize("which", ["fixture", "byte_level", "bytes"])
def test_detokenizer_emits_whole_characters(which, tok, byte_level):
    """Text with multi-byte characters (spelled in byte-fallback tokens by the fixture, split inside
    byte-level tokens by the GPT-2-style one), one id at a time: everything emitted so far is a
    prefix of the text, without U+FFFD, and it all comes out."""
    t = {"fixture": tok, "byte_level": byte_level, "bytes": T.ByteTokenizer()}[which]
    for text in ["déjà vu 😀 中文 ☕", "the cat sat on the mat", "naïve  café €", "😀😀", "a\n\nb"]:
        ids = t.encode(text)
        assert t.decode(ids) == text
        if which == "fixture":
            assert any(i in tok.byte_ids for i in ids) or text.isascii()
        stream, shown = t.detokenizer(), ""
        for i in ids:
            shown += stream.push([i])
            assert text.startswith(shown) and "\ufffd" not in shown, (text, shown)
        assert shown + stream.flush() == text


def test_detokenizer_continues_the_prompt_with_its_space(tok):
    prompt = tok.encode("The cat")
    new = tok.encode(" sat on the mat", add_special_tokens=False)
    stream = tok.detokenizer(prompt)
    assert "".join(stream.push([i]) for i in new) + stream.flush() == " sat on the mat"
    alone = tok.detokenizer()  # without context, SentencePiece drops the first piece's space
    assert "".join(alone.push([i]) for i in new) + alone.flush() == "sat on the mat"
    ids = tok.encode("a😀😀😀")  # a prompt ending in a run of byte tokens that the new ids continue
    assert sum(i in tok.byte_ids for i in ids) == 12
    stream = tok.detokenizer(ids[:-4])
    assert [stream.push([i]) for i in ids[-4:]] == ["", "", "", ""] and stream.flush() == "😀"


def test_token_printer_stops_at_eos_and_prints_ids_without_a_tokenizer(tok):
    out = []
    printer = T.TokenPrinter(tok, out.append, tok.encode("The"))
    printer.push(tok.encode(" cat", add_special_tokens=False) + [2] + tok.encode(" dog", add_special_tokens=False))
    printer.close()
    assert "".join(out) == " cat" and printer.stopped == 2
    out = []
    printer = T.TokenPrinter(tok, out.append, (), stop_ids=())  # --ignore-eos
    printer.push(tok.encode("cat", add_special_tokens=False) + [2, 300])
    printer.close()
    assert "".join(out) == "cat" + tok.decode([300]) and printer.stopped is None
    out = []
    printer = T.TokenPrinter(None, out.append)
    printer.push([300, 2])
    printer.push([383])
    assert "".join(out) == "300 2 383"


# ----------------------------------------------------------------------------- workdirs and prompts


def _config(source="stdlib", vocab=256):
    from jaxsys.config import base_config

    c = base_config()
    c.data.source, c.model.vocab_size = source, vocab
    return c


def test_for_config_reads_the_record_and_old_workdirs_keep_working(tmp_path):
    old = str(tmp_path / "old")  # no record: byte corpus + 256 ids is bytes, anything else has none
    os.makedirs(old)
    byte = T.for_config(_config(), old)
    assert isinstance(byte, T.ByteTokenizer) and byte.decode(byte.encode("déjà")) == "déjà"
    assert T.for_config(_config(vocab=384), old) is None
    assert T.for_config(_config("tokens"), old) is None
    w = str(tmp_path / "w")
    T.attach(w, "none", 256)  # a record overrides the old rule both ways
    assert T.for_config(_config(), w) is None
    T.attach(w, TOKENIZER, 384)
    assert isinstance(T.for_config(_config(vocab=384), w), T.HFTokenizer)
    assert sorted(os.listdir(os.path.join(w, "tokenizer"))) == sorted(
        ["jaxsys.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
    )
    T.attach(w, "bytes", 256)
    assert isinstance(T.for_config(_config("tokens", 256), w), T.ByteTokenizer)
    assert os.listdir(os.path.join(w, "tokenizer")) == ["jaxsys.json"]


def test_attaching_a_tokenizer_that_does_not_fit_is_refused(tmp_path):
    w = str(tmp_path / "w")
    T.attach(w, "none", 256)
    with pytest.raises(
        T.TokenizerError, match=r"has 384 ids but the model's vocabulary is config.model.vocab_size=256"
    ):
        T.attach(w, TOKENIZER, 256)
    assert T.record(w) == {"kind": "none"}  # nothing written
    with pytest.raises(T.TokenizerError, match="does not exist"):
        T.attach(w, str(tmp_path / "nothere"), 384)
    with pytest.raises(T.TokenizerError, match="byte tokenizer decodes ids below 256 only.*vocab_size=384"):
        T.attach(w, "bytes", 384)
    assert T.record(w) == {"kind": "none"}


def test_prompt_ids_text_or_ids():
    byte = T.ByteTokenizer()
    assert T.prompt_ids(byte, "hé", 256) == [104, 195, 169]
    assert T.prompt_ids(None, " 300 2 7 ", 384) == [300, 2, 7]
    with pytest.raises(T.TokenizerError, match=r"'hello 300' is text.*has no tokenizer.*convert --tokenizer"):
        T.prompt_ids(None, "hello 300", 384, workdir="W")
    with pytest.raises(T.TokenizerError, match="--chat renders a chat template.*has no tokenizer"):
        T.prompt_ids(None, "1 2", 384, chat=True)
    with pytest.raises(T.TokenizerError, match=r"\[400\] are outside the vocabulary \[0, 384\)"):
        T.prompt_ids(None, "1 400", 384)


# ----------------------------------------------------------------------------- corpora and commands


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The untied fixture converted without a tokenizer (`none`) and with the fixture's, on a small
    text corpus (data.source=text, seq_len 16)."""
    root = tmp_path_factory.mktemp("conv")
    text = root / "corpus.txt"
    text.write_text("The cat sat on the mat and the dog sat on the log.\nNaïve café, déjà vu.\n" * 40)
    over = [
        "--config.data.source=text",
        f"--config.data.path={text}",
        "--config.data.seq_len=16",
        "--config.data.eval_fraction=0.2",
        "--config.train.batch_size=4",
        "--config.train.eval_batches=2",
    ]
    paths = {}
    for kind in ("none", "hf"):
        w = str(root / kind)
        args = ["--from-hf", os.path.join(GOLDEN, "untied"), "--workdir", w, *over]
        assert convert.main(args + (["--tokenizer", TOKENIZER] if kind == "hf" else [])) == 0
        paths[kind] = w
    paths["text"] = str(text)
    return paths


def test_corpus_through_the_tokenizer(converted, tok):
    from jaxsys.checkpoint import saved_config

    config, _ = saved_config(converted["hf"])
    corpus = T.corpus_for(config, converted["hf"])
    raw = open(converted["text"], "rb").read()
    cut = len(raw) - int(len(raw) * 0.2)
    cut += raw[cut:].index(b"\n") + 1  # the held-out text starts at a line
    assert corpus.eval.tolist() == tok.encode(raw[cut:].decode(), add_special_tokens=False)
    assert corpus.train.tolist() == tok.encode(raw[:cut].decode(), add_special_tokens=False)
    assert corpus.vocab_needed > 256  # not bytes
    assert T.corpus_for(config, converted["hf"], splits=("eval",)).train.shape == (0,)
    none, _ = saved_config(converted["none"])
    with pytest.raises(data.DataError, match=r"source='text' is a text corpus read as bytes, but .* has no tokenizer"):
        T.corpus_for(none, converted["none"])


def test_evaluate_reads_text_through_the_tokenizer(converted, tok, capsys):
    result = train.evaluate_workdir(converted["hf"], text=converted["text"])
    # the same loss from the file's ids computed here (the file through the tokenizer, held out whole)
    from jaxsys.checkpoint import load

    program, params, _ = load(converted["hf"])
    ids = np.asarray(tok.encode(open(converted["text"]).read(), add_special_tokens=False), np.uint16)
    corpus = data.Corpus(train=ids[:0], eval=ids, vocab_needed=384, description="")
    assert result["eval_loss"] == pytest.approx(train.evaluate(program, program.eval_loss_fn(), params, corpus))
    assert 3.0 < result["eval_loss"] < 8.0  # a random 384-token model: about ln 384 = 5.95
    assert evaluate_cli.main(["--workdir", converted["hf"]]) == 0  # the config's corpus, encoded
    assert "eval loss" in capsys.readouterr().out
    assert evaluate_cli.main(["--workdir", converted["none"], "--text", converted["text"]]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert evaluate_cli.main(["--workdir", converted["none"]]) == 2  # the text corpus is not its ids
    assert "its ids are not bytes" in capsys.readouterr().err


def test_gptq_calibrates_on_tokenizer_ids_or_refuses(converted, tmp_path):
    with pytest.raises(data.DataError, match="has no tokenizer, so its ids are not bytes"):
        quant_workdir.quantize_workdir(converted["none"], str(tmp_path / "q0"), "w8a16", "gptq", log=lambda m: None)
    assert not (tmp_path / "q0").exists()
    quant_workdir.quantize_workdir(converted["none"], str(tmp_path / "rtn"), "w8a16", "rtn")  # RTN needs no data
    assert (
        T.record(str(tmp_path / "rtn")) == T.record(converted["none"]) and T.record(converted["none"])["kind"] == "none"
    )
    out = str(tmp_path / "q1")
    quant_workdir.quantize_workdir(converted["hf"], out, "w8a16", "gptq", calibration_batches=1, log=lambda m: None)
    assert isinstance(T.for_config(_config("text", 384), out), T.HFTokenizer)  # the copy keeps the tokenizer


def test_bench_serve_takes_text_prompts(converted, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat sat\n\nWhere is the dog?\n")
    args = ["--requests", "3", "--rate", "0", "--output-len", "2", "--prompts", str(prompts), "--json"]
    assert bench_serve.main(["--workdir", converted["hf"], *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 3 and result["generated_tokens"] == 6
    assert bench_serve.main(["--workdir", converted["none"], *args]) == 2
    assert "--prompts" in capsys.readouterr().err
