"""DPO of configs/tiny.py on preference pairs with a known answer (docs/finetune.md; the pairs are
experiments/dpo's generated task: "is N even? ", chosen = the right answer, rejected = the wrong one).

    python experiments/dpo/run.py --pairs /tmp/jaxsys_dpo/pairs.jsonl           # the pairs only
    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/jaxsys_tiny    # the base (~3 min)
    python -m jaxsys.train --config configs/tiny_dpo.py --workdir /tmp/jaxsys_tiny_dpo

DPO (beta 0.1) of rank-16 LoRA adapters, the reference being the base itself (the adapters left
out); 8 pairs (16 rows of 33 tokens) a step, 200 steps at lr 1e-3. metrics.jsonl logs the DPO loss,
dpo_margin, dpo_accuracy and the chosen / rejected rewards, and their held-out means (eval_*).
Arguments:
    :full   every weight trained (lr 5e-4); the reference is the starting parameters, held
            beside the state and passed to each step
"""

import os

from jaxsys.config import load_config


def _tiny():
    """configs/tiny.py beside this file (whatever the working directory), loaded as --config loads it."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))


def get_config(arg=None):
    c = _tiny()
    c.data.source = "jsonl"
    c.data.path = "/tmp/jaxsys_dpo/pairs.jsonl"
    c.data.format = "preference"
    c.data.tokenizer = "bytes"
    c.data.seq_len = 32
    c.data.eval_fraction = 0.1
    c.train.objective = "dpo"
    c.train.dpo.beta = 0.1
    c.checkpoint.init_from = "/tmp/jaxsys_tiny"
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.train.steps = 200
    c.train.lr = 1e-3
    c.train.warmup_steps = 10
    c.train.log_every = 5
    c.train.eval_every = 25
    c.train.eval_batches = 8
    if arg == "full":
        c.lora.rank = 0
        c.train.lr = 5e-4
    elif arg is not None:
        raise ValueError(f"configs/tiny_dpo.py: unknown argument {arg!r}; use full")
    return c
