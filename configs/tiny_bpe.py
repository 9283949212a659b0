"""configs/tiny.py on the same corpus read through a 2048-id byte-level BPE tokenizer
(experiments/bpe_chat/: the tokenizer, its chat template, the comparison with bytes).

    python experiments/bpe_chat/run.py     # all of it: token file, this config trained, scored, served
    # or by hand, once run.py has written the token file (it prints these commands):
    python -m jaxsys.train --config configs/tiny_bpe.py --workdir /tmp/jaxsys_bpe_chat/tiny_bpe
    python -m jaxsys.convert --tokenizer experiments/bpe_chat/tokenizer --workdir /tmp/jaxsys_bpe_chat/tiny_bpe
    python -m jaxsys.serve --workdir /tmp/jaxsys_bpe_chat/tiny_bpe

The model, batch, steps and learning rate are configs/tiny.py's (300 steps of 16 x 128 tokens);
only the vocabulary (2048 ids: the tokenizer's) and the data differ. The data is a token file
(data.source='tokens'): the stdlib corpus through experiments/bpe_chat/tokenizer, its train text
then its held-out text, cut where jaxsys.data cuts a text corpus read through a tokenizer.
`eval_fraction` is the held-out tokens' share of the file, so that the file's held-out split is
that text exactly: the value below is CPython 3.12.1's stdlib's; run.py passes the one of the
interpreter it runs on (--config.data.eval_fraction=...).
"""

import os

from jaxsys.config import load_config

VOCAB = 2048  # experiments/bpe_chat/tokenizer: 3 special tokens, 256 bytes, 1789 merges
TOKEN_FILE = "/tmp/jaxsys_bpe_chat/stdlib_bpe2048.npy"
EVAL_FRACTION = 0.009689636336893867  # (102,638 + 0.5) / 10,592,606 tokens; run.py passes its own


def _tiny():
    """configs/tiny.py beside this file (whatever the working directory), loaded as --config loads it."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))


def get_config(arg=None):
    if arg is not None:
        raise ValueError(f"configs/tiny_bpe.py takes no argument, got {arg!r}")
    c = _tiny()
    c.model.vocab_size = VOCAB
    c.data.source = "tokens"
    c.data.path = TOKEN_FILE
    c.data.eval_fraction = EVAL_FRACTION
    return c
