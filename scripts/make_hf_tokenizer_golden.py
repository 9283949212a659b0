"""A 384-token Hugging Face tokenizer for the golden tiny Llamas, and what `transformers` makes of it.

tests/golden/hf_llama/{untied,tied} (scripts/make_hf_golden.py) have a vocabulary of 384 ids and no
tokenizer. This script trains one for them with the `tokenizers` library and checks it, and the
models' greedy continuations of text prompts, against `transformers`:

* ``tests/golden/hf_llama/tokenizer/``: the tokenizer as `transformers` saves it
  (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) plus a
  ``generation_config.json`` naming the end-of-sequence id. Llama-2's layout: ``<unk>`` 0,
  ``<s>`` 1 (BOS, added in front of every encoded text), ``</s>`` 2 (EOS), the 256 byte-fallback
  tokens ``<0x00>`` ... ``<0xFF>`` at 3-258, then 125 BPE pieces (the 50 most frequent characters
  of the training text and merges) with SentencePiece's ``▁`` for a space. Any other character
  (``é``, ``€``, emoji, most capitals) is spelled in byte tokens. The chat template is a small
  ChatML-like one that uses ``bos_token``, ``eos_token``, ``raise_exception``, ``tojson``,
  ``loop.first`` and ``add_generation_prompt``, over block tags on lines of their own (so
  ``trim_blocks`` / ``lstrip_blocks`` matter).
* ``tests/golden/hf_llama/tokenizer_golden.json``: for a list of texts, the ids of
  ``AutoTokenizer.from_pretrained(dir)(text)["input_ids"]`` (checked equal to the ``tokenizers``
  library's own ids here), and with ``add_eos_token=True``; ``decode`` of id lists (special tokens kept and skipped); conversations
  rendered by ``apply_chat_template(..., tokenize=False, add_generation_prompt=True)`` and their ids
  (``tokenize=True``), and the error a bad conversation raises.
* ``tests/golden/hf_llama/<name>/text_greedy.json``: the greedy continuation (16 tokens,
  ``model.generate(do_sample=False, eos_token_id=None)``, fp32, eager attention) of a text prompt
  and of a chat, as ids and as the text `transformers` decodes (``decode(prompt + new)`` minus
  ``decode(prompt)``, special tokens skipped).

Environment: the Python 3.11 venv of scripts/make_hf_golden.py with ``tokenizers`` and ``jinja2``
(transformers 5.23.0 brings them). Run from the repository root, after make_hf_golden.py:

    /tmp/hfvenv/bin/python scripts/make_hf_tokenizer_golden.py
"""

from __future__ import annotations

import json
import os
import random
import shutil

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden", "hf_llama")
OUT = os.path.join(ROOT, "tokenizer")
VOCAB = 384
SPECIALS = ["<unk>", "<s>", "</s>"]
NEW = 16

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A model reads text as tokens, and a tokenizer turns
the text into the ids of those tokens and back. The cat sat on the mat; the dog sat on the log.
In the beginning the state of the art was a table of counts, then a network, then a transformer.
Every layer of the transformer reads the sequence so far and writes a little more of the answer.
def main(args):
    for line in open(args.path):
        if line.startswith("#"):
            continue
        print(line.strip())
    return 0
class Tokenizer:
    def encode(self, text):
        return [self.vocab[piece] for piece in self.split(text)]
The engine serves many requests at once: it schedules the prompts, runs the model on the batch,
samples the next token of every sequence and streams the text back as soon as it is complete.
A cache of keys and values saves the work of reading the whole prompt again at every step.
She said that the rain in the plain stays mainly in the hills, and then the sun came out.
There are three things to read: the config, the checkpoint and the tokenizer of the model.
"""

CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Conversation roles must be system, user or assistant, not ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('Only the first message may be the system prompt') }}
    {% endif %}
<|{{ message['role'] }}|>
    {% if message['role'] == 'system' %}
{{ message['content'] | tojson }}
    {% else %}
{{ message['content'] | trim }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

TEXTS = [
    "The cat sat on the mat.",
    "the",
    " leading space and  two spaces",
    "Hello, World! Quiz: 42 + 17 = 59?",
    "def main(args):\n    return 0\n",
    "déjà vu — 3 € for a café ☕ and 😀",
    "中文 and 日本語",
    "<s> is BOS and </s> is EOS inside text",
    "tabs\tand\r\nwindows newlines",
    "",
    " ",
    "\n\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": 'You are terse. Quote "<html>" & café as is.'},
        {"role": "user", "content": "  What is 2 + 2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [{"role": "user", "content": "déjà vu 😀\nsecond line"}],
]
BAD_CONVERSATIONS = [
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
]
PROMPT = "The cat sat on the mat and the dog"
CHAT = [{"role": "user", "content": "Where is the cat?"}]


def build_tokenizer() -> Tokenizer:
    """BPE trained on TRAINING_TEXT, then laid out as Llama-2's tokenizer: specials, bytes, pieces."""
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 256, special_tokens=SPECIALS, limit_alphabet=50, show_progress=False
    )
    trainer_tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    pieces = [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in SPECIALS]
    vocab = {p: i for i, p in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})
    assert len(vocab) == VOCAB, len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    # the pipeline transformers 5's LlamaTokenizer builds (legacy=False): no normalizer, Metaspace
    # with prepend_scheme "first" and no split, byte fallback, and the matching decoder.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def save(tok: Tokenizer) -> None:
    from transformers import LlamaTokenizer

    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    hf = LlamaTokenizer(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(OUT)
    with open(os.path.join(OUT, "generation_config.json"), "w") as f:
        json.dump(
            {"bos_token_id": 1, "eos_token_id": [2], "transformers_version": transformers.__version__}, f, indent=2
        )


def main() -> None:
    torch.manual_seed(0)
    raw = build_tokenizer()
    save(raw)
    hf = AutoTokenizer.from_pretrained(OUT)
    fast = Tokenizer.from_file(os.path.join(OUT, "tokenizer.json"))
    encode = []
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == fast.encode(text).ids == raw.encode(text).ids, (text, ids, fast.encode(text).ids)
        encode.append({"text": text, "ids": ids})
    rng = random.Random(0)
    decode = []
    for ids in [e["ids"] for e in encode] + [
        [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))] for _ in range(20)
    ]:
        decode.append(
            {"ids": ids, "text": hf.decode(ids), "text_skip_special": hf.decode(ids, skip_special_tokens=True)}
        )
    chats = []
    for messages in CONVERSATIONS:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        plain = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        chats.append({"messages": messages, "text": text, "ids": list(ids), "text_no_generation_prompt": plain})
    errors = []
    for messages in BAD_CONVERSATIONS:
        try:
            hf.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja2's TemplateError through raise_exception
            errors.append({"messages": messages, "error": str(e)})
        else:
            raise AssertionError(f"{messages} rendered")
    with_eos = AutoTokenizer.from_pretrained(OUT, add_eos_token=True)  # as if tokenizer_config.json said so
    golden = {
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "tokenizer_class": type(hf).__name__,
        "eos_token_id": hf.eos_token_id,
        "bos_token_id": hf.bos_token_id,
        "vocab_size": len(hf),
        "encode": encode,
        "encode_add_eos_token": [{"text": t, "ids": with_eos(t)["input_ids"]} for t in TEXTS[:3]],
        "decode": decode,
        "chat": chats,
        "chat_errors": errors,
    }
    with open(os.path.join(ROOT, "tokenizer_golden.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")

    for name in ("untied", "tied"):
        path = os.path.join(ROOT, name)
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        out = {}
        for kind, ids in (
            ("text", hf(PROMPT)["input_ids"]),
            ("chat", list(hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False))),
        ):
            prompt = torch.tensor([ids])
            with torch.no_grad():
                seq = model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            new = seq[0, len(ids) :].tolist()
            head = hf.decode(ids, skip_special_tokens=True)
            full = hf.decode(ids + new, skip_special_tokens=True)
            assert full.startswith(head), (head, full)
            out[kind] = {"prompt_ids": ids, "new_ids": new, "new_text": full[len(head) :]}
        out["prompt"], out["chat"]["messages"] = PROMPT, CHAT
        out["chat"]["prompt_text"] = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        with open(os.path.join(path, "text_greedy.json"), "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(name, json.dumps(out, ensure_ascii=False))
    print(sorted(os.listdir(OUT)), type(hf).__name__, f"{len(hf)} tokens")


if __name__ == "__main__":
    main()
