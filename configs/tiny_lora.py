"""LoRA (or QLoRA) supervised fine-tuning of configs/tiny.py on a chat JSON-lines file
(docs/finetune.md; the chats and tokenizer are experiments/sft_lora's generated task).

    python experiments/sft_lora/generate.py /tmp/jaxsys_sft_lora/data          # chats.jsonl + tokenizer/
    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/jaxsys_tiny    # the base (~3 min)
    python -m jaxsys.train --config configs/tiny_lora.py --workdir /tmp/jaxsys_tiny_lora
    python -m jaxsys.evaluate --workdir /tmp/jaxsys_tiny_lora
    python -m jaxsys.generate --workdir /tmp/jaxsys_tiny_lora --chat --prompt "shout: blue river"
    python -m jaxsys.convert --to-hf /tmp/jaxsys_tiny_lora_hf --workdir /tmp/jaxsys_tiny_lora   # merged

Rank-16 adapters (alpha 32) on every dense projection, the base frozen; the loss on the assistant
tokens of packed rows; 100 steps of 8 x 128 tokens at lr 5e-3 (a few minutes on 2 CPU cores;
experiments/sft_lora/README.md has the held-out loss against full fine-tuning). Arguments:
    :qlora  the same over the base quantized w4a16 (QLoRA): first
            python -m jaxsys.quantize --workdir /tmp/jaxsys_tiny --out /tmp/jaxsys_tiny_w4a16 \\
                --format w4a16 --group-size 64
"""

import os

from jaxsys.config import load_config

DATA = "/tmp/jaxsys_sft_lora/data"


def _tiny():
    """configs/tiny.py beside this file (whatever the working directory), loaded as --config loads it."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))


def get_config(arg=None):
    c = _tiny()
    c.data.source = "jsonl"
    c.data.path = f"{DATA}/chats.jsonl"
    c.data.format = "chat"
    c.data.tokenizer = f"{DATA}/tokenizer"
    c.data.packing = True
    c.data.eval_fraction = 0.1
    c.checkpoint.init_from = "/tmp/jaxsys_tiny"
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.train.steps = 100
    c.train.batch_size = 8
    c.train.lr = 5e-3
    c.train.warmup_steps = 10
    c.train.log_every = 10
    c.train.eval_every = 33
    if arg == "qlora":
        c.model.quant, c.model.quant_group_size = "w4a16", 64
        c.checkpoint.init_from = "/tmp/jaxsys_tiny_w4a16"
    elif arg is not None:
        raise ValueError(f"configs/tiny_lora.py: unknown argument {arg!r}; use qlora")
    return c
