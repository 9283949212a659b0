"""The generated chat task of experiments/sft_lora and the tokenizer it is read with.

    python experiments/sft_lora/generate.py OUT_DIR [--chats 2000] [--seed 0]

writes OUT_DIR/chats.jsonl (one {"messages": [...]} a line) and OUT_DIR/tokenizer/, a Hugging Face
tokenizer whose ids are the UTF-8 bytes (id = byte value, 256 ids, so the byte-level configs/tiny.py
model pretrained on the stdlib corpus reads it unchanged) with a chat template:

    <|user|>shout: green apple<|end|>
    <|assistant|>GREEN APPLE!<|end|>

The task has a known answer, learnable by a small model in a few hundred steps: an instruction
("shout", "whisper", "repeat", "first") applied to a few words (upper case and "!", lower case and
"...", the words twice, the first word). The loss counts the assistant's tokens only
(config.data.format=chat).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = (
    "red green blue apple river stone cloud paper small quick bright silver garden window table "
    "music winter orange yellow forest"
).split()
TASKS = {
    "shout": lambda ws: " ".join(ws).upper() + "!",
    "whisper": lambda ws: " ".join(ws).lower() + "...",
    "repeat": lambda ws: " ".join(ws + ws),
    "first": lambda ws: ws[0],
}


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        task = str(rng.choice(list(TASKS)))
        words = [str(w) for w in rng.choice(WORDS, int(rng.integers(1, 4)))]
        prompt = " ".join(w.capitalize() if rng.random() < 0.3 else w for w in words)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"{task}: {prompt}"},
                    {"role": "assistant", "content": TASKS[task](prompt.split())},
                ]
            }
        )
    return out


def byte_tokenizer(directory: str) -> None:
    """A Hugging Face tokenizer (tokenizer.json, tokenizer_config.json with the chat template) whose
    ids are the bytes: byte-level pre-tokenization and a BPE without merges over the 256 byte
    symbols, numbered by their byte values."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbol = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte -> symbol map: printable bytes are themselves, the others shifted past 255
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    shifted, extra = {}, 0
    for b in range(256):
        if b in printable:
            shifted[b] = chr(b)
        else:
            shifted[b] = chr(256 + extra)
            extra += 1
    assert set(shifted.values()) == set(symbol)
    vocab = {shifted[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--chats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chats.jsonl"), "w") as f:
        for chat in chats(args.chats, args.seed):
            f.write(json.dumps(chat) + "\n")
    byte_tokenizer(os.path.join(args.out, "tokenizer"))


if __name__ == "__main__":
    main()
