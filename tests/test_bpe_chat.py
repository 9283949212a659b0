"""experiments/bpe_chat/: the committed byte-level BPE tokenizer (2048 ids, <s> </s> <unk>, a chat
template) round-trips text, renders its template through HFTokenizer.apply_chat_template, rides
in a workdir as configs/tiny_bpe.py's tokenizer, and a random-weight model of its vocabulary
serves a completion and a chat completion through the server and the official openai client (no
training here: experiments/bpe_chat/run.py trains)."""

import importlib.util
import json
import os
import threading
import urllib.request

import openai
import pytest

from jaxsys import tokenizer as tokenizer_lib
from jaxsys.config import load_config
from jaxsys.serve import engine, server
from jaxsys.tokenizer import HFTokenizer, TokenizerError
from tests.helpers import generate_contiguous, program_for, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "experiments", "bpe_chat", "tokenizer")
_spec = importlib.util.spec_from_file_location(
    "bpe_chat_train_tokenizer", os.path.join(ROOT, "experiments", "bpe_chat", "train_tokenizer.py")
)
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

MESSAGES = [
    {"role": "system", "content": "You are a Python programmer."},
    {"role": "user", "content": "Reverse a list."},
]
RENDERED = "<s>system\nYou are a Python programmer.</s>\n<s>user\nReverse a list.</s>\n<s>assistant\n"
TEXTS = [
    "def main():\n    return 0\n",
    "class A(object):\n\tpass  # tabs, trailing spaces   \n\n\n",
    'print("héllo wörld €😀 日本語")\r\n',
    "x = b'\\x00\\xff' + '\\u2028'",
]


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(TOKENIZER)


def test_the_committed_tokenizer(tok):
    assert tok.vocab_size == 2048 == load_config(os.path.join(ROOT, "configs", "tiny_bpe.py")).model.vocab_size
    assert [tok.token(i) for i in range(3)] == ["<s>", "</s>", "<unk>"]
    assert tok.eos_ids == (1,) and tok.special_ids == {0, 1, 2}
    assert len(tok.encode("    def __init__(self):")) < len("    def __init__(self):") // 2  # merges happen
    # the committed config files are what train_tokenizer.save writes (its CHAT_TEMPLATE included)
    assert json.load(open(os.path.join(TOKENIZER, "tokenizer_config.json")))["chat_template"] == tt.CHAT_TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_without_added_tokens(tok, text):
    ids = tok.encode(text)
    assert ids and 0 not in ids and 1 not in ids  # neither BOS nor EOS is added to a text
    assert tok.decode(ids) == text
    assert sum(tt.token_bytes(TOKENIZER)[i] for i in ids) == len(text.encode())  # bits per byte's denominator
    stream = tok.detokenizer()
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == text


def test_a_special_token_in_the_text_is_the_special_token(tok):
    """As in every Hugging Face tokenizer: `<s>` in a text encodes as BOS (the corpus has 11);
    decode drops it unless asked, and its 3 bytes count in bits per byte."""
    ids = tok.encode("a<s>b")
    assert 0 in ids and tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<s>b"
    assert sum(tt.token_bytes(TOKENIZER)[i] for i in ids) == 5


def test_chat_template(tok):
    assert tok.apply_chat_template(MESSAGES) == RENDERED
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED.removesuffix("<s>assistant\n")
    ids = tok.encode_chat(MESSAGES)
    assert ids == tok.encode(RENDERED, add_special_tokens=False)
    assert ids[0] == 0 and ids.count(0) == 3 and ids.count(1) == 2  # <s> and </s> as special ids
    assert tok.decode(ids) == RENDERED.replace("<s>", "").replace("</s>", "")
    with pytest.raises(TokenizerError, match="roles are system, user and assistant, not tool"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_attached_to_a_workdir(tmp_path, tok):
    config = load_config(os.path.join(ROOT, "configs", "tiny_bpe.py"))
    assert config.data.source == "tokens" and config.train.steps == 300
    record = tokenizer_lib.attach(str(tmp_path), TOKENIZER, config.model.vocab_size)
    assert record["kind"] == "huggingface" and record["chat_template"] and record["eos_ids"] == [1]
    got = tokenizer_lib.for_config(config, str(tmp_path))
    assert isinstance(got, HFTokenizer) and got.fingerprint == tok.fingerprint
    assert got.apply_chat_template(MESSAGES) == RENDERED
    with pytest.raises(TokenizerError, match="does not fit"):
        tokenizer_lib.attach(str(tmp_path / "bytes_model"), TOKENIZER, 256)


@pytest.fixture(scope="module")
def served(tok):
    program = program_for(small_config(n_kv_heads=4, vocab_size=tok.vocab_size))
    params = program.init(5).params
    eng = engine.Engine(program, params, num_pages=32, page_size=8, token_budget=32, chunk_size=8, max_seqs=4)
    httpd, loop = server.serve(eng, tok, "tiny-bpe", port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", program, params
    server.shutdown(httpd, loop)


def _expected(tok, program, params, prompt, n):
    """The greedy continuation generated alone, up to the first EOS: (text, finish_reason)."""
    ids = generate_contiguous(program, params, [prompt], n)[0]
    if 1 in ids:
        return tok.decode(ids[: ids.index(1)]), "stop"
    return tok.decode(ids), "length"


def test_served_chat_and_completion_through_the_openai_client(served, tok):
    url, program, params = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt_ids = tok.encode_chat(MESSAGES)
    text, reason = _expected(tok, program, params, prompt_ids, 8)
    whole = client.chat.completions.create(model="tiny-bpe", messages=MESSAGES, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].finish_reason == reason
    assert whole.usage.prompt_tokens == len(prompt_ids)
    streamed = list(
        client.chat.completions.create(model="tiny-bpe", messages=MESSAGES, max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == reason

    completion = client.completions.create(model="tiny-bpe", prompt="def main(", max_tokens=8, temperature=0)
    text, reason = _expected(tok, program, params, tok.encode("def main("), 8)
    assert completion.choices[0].text == text and completion.choices[0].finish_reason == reason
    assert completion.usage.prompt_tokens == len(tok.encode("def main("))

    # vLLM's /tokenize renders the conversation by the same template
    request = urllib.request.Request(
        url + "/tokenize",
        data=json.dumps({"messages": MESSAGES}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["tokens"] == prompt_ids
