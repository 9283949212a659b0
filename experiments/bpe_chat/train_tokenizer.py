"""A small byte-level BPE tokenizer trained on the embedded corpus, saved as Hugging Face files.

    python experiments/bpe_chat/train_tokenizer.py [--vocab 2048] [--out experiments/bpe_chat/tokenizer]

The corpus is the one configs/tiny.py trains on (config.data.source='stdlib': the interpreter's
standard-library sources), cut into train and held-out text where jaxsys.data cuts a text corpus
read through a tokenizer (at the line after the last eval_fraction = 1% of the bytes). The BPE
merges are learnt from the train text only, so the held-out text the models are scored on is as
new to the tokenizer as to the models.

The tokenizer is GPT-2's kind (the `tokenizers` library): bytes mapped to 256 printable characters
(no <unk> ever needed, every text round-trips), GPT-2's pre-tokenization regex (words, numbers,
punctuation runs and whitespace runs, so indentation merges into tokens of its own), no
normalization. `<s>`, `</s>` and `<unk>` are special tokens 0, 1, 2. tokenizer_config.json names
them (BOS, EOS, UNK), adds neither BOS nor EOS to an encoded text (the corpus has neither) and
carries CHAT_TEMPLATE: each message as `<s>ROLE\\nCONTENT</s>\\n`, roles system, user and
assistant, and `<s>assistant\\n` as the generation prompt.

The training is deterministic: the same corpus (the same Python's stdlib) gives byte-identical
files. The committed experiments/bpe_chat/tokenizer/ was trained on CPython 3.12.1's stdlib.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "tokenizer")
DEFAULT_VOCAB = 2048
SPECIALS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2
MIN_FREQUENCY = 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ('system', 'user', 'assistant') %}\n"
    "{{- raise_exception('roles are system, user and assistant, not ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- bos_token + 'assistant\\n' }}\n"
    "{%- endif %}\n"
)


def split_corpus(eval_fraction: float = 0.01) -> tuple[bytes, bytes]:
    """(train text, held-out text) of the stdlib corpus as UTF-8 bytes, cut as jaxsys.data cuts a
    text corpus read through a tokenizer (`load_corpus(..., encode=...)`)."""
    import numpy as np

    from jaxsys import data as data_lib
    from jaxsys.config import base_config

    c = base_config()
    c.data.source, c.data.eval_fraction = "stdlib", eval_fraction
    corpus = data_lib.load_corpus(c.data, encode=lambda raw: np.frombuffer(raw, np.uint8))
    return bytes(corpus.train), bytes(corpus.eval)


def pieces(text: str, size: int = 1 << 16) -> Iterator[str]:
    """The text in pieces of about `size` characters, each ending after a newline (as
    jaxsys.tokenizer.encode_text encodes a corpus)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def train_tokenizer(text: bytes, vocab_size: int = DEFAULT_VOCAB):
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` ids (the specials included) learnt
    from `text` (UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces(text.decode("utf-8", errors="replace")), trainer)
    return tok


def save(tok, out_dir: str) -> dict[str, str]:
    """Write the Hugging Face files (tokenizer.json, tokenizer_config.json with the chat template,
    special_tokens_map.json) to `out_dir`; {file: sha256[:16]}."""
    os.makedirs(out_dir, exist_ok=True)
    bos, eos, unk = SPECIALS
    specials = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    files = {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(specials, indent=2),
    }
    digests = {}
    for name, content in files.items():
        data = (content.rstrip("\n") + "\n").encode("utf-8")
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        digests[name] = hashlib.sha256(data).hexdigest()[:16]
    return digests


def token_bytes(directory: str = DEFAULT_DIR) -> list[int]:
    """The bytes of text each id of the byte-level BPE in `directory` stands for: one per character
    of a byte-level token, the UTF-8 of an added token's text (a `<s>` in a text encodes as that
    special token: 3 bytes)."""
    with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    ids = list(spec["model"]["vocab"].values()) + [a["id"] for a in spec["added_tokens"]]
    lengths = [0] * (max(ids) + 1)
    for text, i in spec["model"]["vocab"].items():
        lengths[i] = len(text)  # the ByteLevel alphabet: one character per byte
    for added in spec["added_tokens"]:
        lengths[added["id"]] = len(added["content"].encode("utf-8"))
    return lengths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="ids, the 3 special tokens included")
    parser.add_argument("--out", default=DEFAULT_DIR, help="directory for the Hugging Face files")
    args = parser.parse_args(argv)
    train, held_out = split_corpus()
    tok = train_tokenizer(train, args.vocab)
    digests = save(tok, args.out)
    print(
        f"byte-level BPE, {tok.get_vocab_size()} ids, from {len(train):,} bytes of train text -> {args.out} "
        f"({', '.join(f'{k} {v}' for k, v in digests.items())})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
