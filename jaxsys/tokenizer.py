"""Text <-> token ids for a workdir's model: the byte tokenizer of the byte corpora, a Hugging Face
tokenizer a workdir carries, or none (the model takes and prints token ids).

    tok = tokenizer.for_config(config, workdir)     # None when the model has no text tokenizer
    ids = tok.encode("def main(")
    stream = tok.detokenizer(); text = stream.push(ids) + stream.flush()

Every tokenizer has the same small interface (`Tokenizer`): encode, decode, an incremental
detokenizer that never emits half a UTF-8 character, its end-of-sequence ids and, where the
tokenizer defines one, a chat template.
"""

from __future__ import annotations

import codecs
from typing import Protocol

BYTE_VOCAB = 256


class TokenizerError(ValueError):
    """A text the model cannot take (no tokenizer, ids it cannot decode); names the fix."""


class Detokenizer(Protocol):
    def push(self, ids: list[int]) -> str:
        """The text the new ids complete (nothing of a character still incomplete)."""
        ...

    def flush(self) -> str:
        """What is left at the end (an incomplete character as U+FFFD)."""
        ...


class Tokenizer(Protocol):
    name: str
    eos_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def detokenizer(self) -> Detokenizer: ...


class _ByteStream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        return self._decoder.decode(bytes(_bytes(ids)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _bytes(ids: list[int]) -> list[int]:
    bad = [i for i in ids if not 0 <= int(i) < BYTE_VOCAB]
    if bad:
        raise TokenizerError(f"token ids {bad[:5]} are not bytes: the byte tokenizer decodes ids in [0, 256) only")
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes: token = byte value (configs/tiny.py's corpora). No end-of-sequence id."""

    name = "bytes"
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(_bytes(ids)).decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        return _ByteStream()


def for_config(config, workdir: str | None = None) -> Tokenizer | None:
    """The tokenizer of a model: the byte tokenizer for a byte-level corpus with a 256-token
    vocabulary; None when it has no text tokenizer (ids in, ids out)."""
    from jaxsys.data import BYTE_SOURCES

    if config.data.source in BYTE_SOURCES and config.model.vocab_size <= BYTE_VOCAB:
        return ByteTokenizer()
    return None
