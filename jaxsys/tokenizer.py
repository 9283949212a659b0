"""Text <-> token ids for a workdir's model: the byte tokenizer of the byte corpora, a Hugging Face
tokenizer a workdir carries, or none (the model takes and prints token ids).

    tok = tokenizer.for_config(config, workdir)     # None when the model has no text tokenizer
    ids = tok.encode("def main(")
    stream = tok.detokenizer(); text = stream.push(ids) + stream.flush()

Every tokenizer has the same small interface (`Tokenizer`): encode, decode, an incremental
detokenizer that never emits half a UTF-8 character, its end-of-sequence ids, its vocabulary size
and, where the tokenizer defines one, a chat template (`apply_chat_template`).

Which tokenizer a workdir's model has is recorded in the workdir: `W/tokenizer/jaxsys.json` says
"bytes", "huggingface" (the Hugging Face files are beside it: tokenizer.json, tokenizer_config.json,
generation_config.json, chat_template.jinja) or "none". `attach` writes it (`python -m jaxsys.convert
--tokenizer PATH --workdir W`, and `--from-hf` with the HF directory's files); a workdir without a
record (every run trained before records existed) is byte-level when its corpus is bytes
(config.data.source stdlib or text) and its vocabulary has 256 ids, and has no tokenizer otherwise.

The commands go through the helpers here: `prompt_ids` (a --prompt as text or ids), `TokenPrinter`
(streamed output), `corpus_for` / `text_corpus` (a text corpus read through the model's tokenizer).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

BYTE_VOCAB = 256
TOKENIZER_DIR = "tokenizer"  # W/tokenizer/: the record and the Hugging Face files
RECORD = "jaxsys.json"
KINDS = ("bytes", "huggingface", "none")
# the files of a Hugging Face tokenizer that a workdir keeps (tokenizer.json is the one required)
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
ATTACH_HINT = "python -m jaxsys.convert --tokenizer HF_DIR_OR_TOKENIZER_JSON --workdir {workdir}"


class TokenizerError(ValueError):
    """A text the model cannot take (no tokenizer, ids it cannot decode); names the fix."""


class Detokenizer(Protocol):
    def push(self, ids: Sequence[int]) -> str:
        """The text the new ids complete (nothing of a character still incomplete)."""
        ...

    def flush(self) -> str:
        """What is left at the end (an incomplete character as U+FFFD)."""
        ...


class Tokenizer(Protocol):
    name: str
    eos_ids: tuple[int, ...]
    chat_template: str | None

    @property
    def vocab_size(self) -> int:
        """1 + the largest id the tokenizer produces or decodes."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def detokenizer(self, context: Sequence[int] = ()) -> Detokenizer:
        """An incremental decoder; `context` (e.g. the prompt's ids) is text already shown, which
        the first pushed ids continue."""
        ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


# ----------------------------------------------------------------------------- bytes


class _ByteStream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(_bytes(ids)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def _bytes(ids: Sequence[int]) -> list[int]:
    bad = [int(i) for i in ids if not 0 <= int(i) < BYTE_VOCAB]
    if bad:
        raise TokenizerError(f"token ids {bad[:5]} are not bytes: the byte tokenizer decodes ids in [0, 256) only")
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes: token = byte value (configs/tiny.py's corpora). No end-of-sequence id."""

    name = "bytes"
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(_bytes(ids)).decode("utf-8", errors="replace")

    def detokenizer(self, context: Sequence[int] = ()) -> Detokenizer:
        return _ByteStream()  # bytes need no context: a prompt ends on a whole character

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation by this tokenizer's `chat_template` (a subclass or an instance may give
        one; the plain byte tokenizer has none: a byte-level model continues plain text)."""
        if not self.chat_template:
            raise TokenizerError("the byte tokenizer has no chat template: a byte-level model continues plain text")
        if not messages:
            raise TokenizerError("a chat needs at least one message")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        return _compile_chat_template(self.chat_template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, bos_token="", eos_token=""
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


# ----------------------------------------------------------------------------- Hugging Face


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} ({what}) could not be read: {e}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} ({what}) is not a JSON object")
    return value


class HFTokenizer:
    """A Hugging Face tokenizer from its files, with the `tokenizers` library (no `transformers`):
    `path` is a directory holding tokenizer.json (and, where present, tokenizer_config.json,
    special_tokens_map.json, generation_config.json, chat_template.jinja / .json) or a
    tokenizer.json file alone.

    encode(text) gives the ids `transformers.AutoTokenizer(path)(text)["input_ids"]` gives: the
    tokenizer.json pipeline, and BOS/EOS added by its post-processor, or, when tokenizer_config.json
    sets add_bos_token / add_eos_token, as those say (transformers 5 rebuilds the post-processor
    then; the one it leaves out counts as false). decode skips special tokens by default.
    eos_ids: the EOS token of tokenizer_config.json and generation_config.json's eos_token_id (an
    int or a list). The chat template renders as transformers renders it (`apply_chat_template`)."""

    name = "huggingface"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Backend
        from tokenizers import processors

        if os.path.isdir(path):
            directory, file = path, os.path.join(path, "tokenizer.json")
        else:
            directory, file = None, path
        if not os.path.isfile(file):
            raise TokenizerError(
                f"{path} has no tokenizer.json: a Hugging Face tokenizer is read from its tokenizer.json "
                "(a directory with only tokenizer.model can be converted with transformers: "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            )
        self.path = path
        with open(file, "rb") as f:
            raw = f.read()
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        try:
            self._tok = _Backend.from_str(raw.decode("utf-8"))
            spec = json.loads(raw)
        except Exception as e:  # tokenizers raises its own Exception type on a bad file
            raise TokenizerError(f"{file} is not a tokenizer.json the tokenizers library reads: {e}") from None
        optional = lambda name, what: (
            _read_json(os.path.join(directory, name), what)
            if directory and os.path.isfile(os.path.join(directory, name))
            else {}
        )
        config = optional("tokenizer_config.json", "tokenizer config")
        specials_map = optional("special_tokens_map.json", "special tokens map")
        generation = optional("generation_config.json", "generation config")

        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        self.special_tokens: dict[str, str] = {}
        for key in names:
            text = _token_text(config.get(key, specials_map.get(key)))
            if text is not None:
                self.special_tokens[key] = text
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_post_processor(processors, bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))

        eos: list[int] = []
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.append(self._tok.token_to_id(self.eos_token))
        gen_eos = generation.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []:
            if int(i) not in eos:
                eos.append(int(i))
        self.eos_ids: tuple[int, ...] = tuple(eos)
        self.chat_template: str | None = self._read_chat_template(directory, config)

        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_ids = frozenset(
            int(i) for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )
        byte_fallback = "ByteFallback" in json.dumps(spec.get("decoder"))
        pattern = re.compile(r"<0x[0-9A-Fa-f]{2}>")
        self.byte_ids = frozenset(i for t, i in vocab.items() if byte_fallback and pattern.fullmatch(t))
        self._template: Any = None  # the compiled chat template, on first use

    def _set_post_processor(self, processors, add_bos: bool, add_eos: bool) -> None:
        """As transformers 5's `TokenizersBackend.update_post_processor`."""
        bos, eos = self.bos_token, self.eos_token
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        special = [(t, self._tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        missing = [t for t, i in special if i is None]
        if missing:
            raise TokenizerError(
                f"{self.path}: tokenizer_config.json names special tokens {missing} the vocabulary lacks"
            )
        self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    @staticmethod
    def _read_chat_template(directory: str | None, config: dict) -> str | None:
        if directory is None:
            return None
        jinja = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        template = config.get("chat_template")
        as_json = os.path.join(directory, "chat_template.json")
        if template is None and os.path.isfile(as_json):
            template = _read_json(as_json, "chat template").get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def detokenizer(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> Detokenizer:
        return _HFStream(self, context, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation rendered by the tokenizer's chat template, as transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` renders it: a
        sandboxed Jinja environment with trim_blocks and lstrip_blocks, `raise_exception`,
        `tojson` (no HTML escaping), `strftime_now`, the loop controls and `{% generation %}`, and
        the special tokens (bos_token, eos_token, ...) as variables. Message keys whose value is
        None are dropped first, as transformers does."""
        if not self.chat_template:
            raise TokenizerError(
                f"the tokenizer {self.path} has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): prompt it with plain text instead"
            )
        import jinja2

        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        if not messages:
            raise TokenizerError("a chat needs at least one message")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template of {self.path} refused the conversation: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of the rendered chat, without special tokens added around it (the template
        writes its own BOS), as transformers' apply_chat_template(tokenize=True)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _compile_chat_template(template: str):
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant masks in transformers): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template does not parse: {e}") from None


class _HFStream:
    """Incremental detokenization by a window of ids (vLLM's and TGI's prefix / read offsets): each
    push decodes ids[prefix:] and ids[prefix:read] and emits the difference, then moves the window
    on. A decode depends on its neighbours (SentencePiece drops the space of the first piece, a
    multi-byte character may span tokens), so the window keeps a few ids of context. Text is held
    back while it ends in U+FFFD (a character not yet complete) and while the last id is a
    byte-fallback token (`<0xE2>`): tokenizers decodes a run of byte tokens as one UTF-8 string, or
    as one U+FFFD per byte if any is invalid, so a run's text is final only when a non-byte token
    ends it. Skipped special tokens are dropped on arrival (decoding skips them anyway), so they
    never open a window. The pushes plus flush equal decode(context + ids) after decode(context)."""

    CONTEXT = 5  # ids of context kept before the read offset (vLLM's choice)

    def __init__(self, tok: HFTokenizer, context: Sequence[int], skip_special_tokens: bool):
        self._tok, self._skip = tok, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self._append(context)
        self._read = len(self._ids)
        self._prefix = max(self._read - self.CONTEXT, 0)
        while (
            0 < self._prefix and self._ids[self._prefix] in tok.byte_ids and self._ids[self._prefix - 1] in tok.byte_ids
        ):
            self._prefix -= 1  # never start a window inside a run of byte tokens

    def _append(self, ids: Sequence[int]) -> None:
        special = self._tok.special_ids if self._skip else frozenset()
        self._ids.extend(int(i) for i in ids if int(i) not in special)

    def _step(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        if not final and self._ids[-1] in self._tok.byte_ids:
            return ""
        decode = lambda ids: self._tok.decode(ids, self._skip)
        before = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def push(self, ids: Sequence[int]) -> str:
        self._append(ids)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)


# ----------------------------------------------------------------------------- workdir records


def record(workdir: str) -> dict | None:
    """The workdir's tokenizer record ({"kind", ...}), or None for a workdir without one."""
    path = os.path.join(workdir, TOKENIZER_DIR, RECORD)
    if not os.path.isfile(path):
        return None
    value = _read_json(path, "the workdir's tokenizer record")
    if value.get("kind") not in KINDS:
        raise TokenizerError(f"{path} has kind {value.get('kind')!r}; expected one of {KINDS}")
    return value


def _byte_level(config) -> bool:
    from jaxsys.data import BYTE_SOURCES

    return config.data.source in BYTE_SOURCES and config.model.vocab_size <= BYTE_VOCAB


def for_config(config, workdir: str | None = None) -> Tokenizer | None:
    """The tokenizer of a model: what `workdir` records (W/tokenizer/jaxsys.json), else the byte
    tokenizer for a byte-level corpus with a 256-token vocabulary; None when it has no text
    tokenizer (ids in, ids out)."""
    rec = record(workdir) if workdir else None
    if rec is None:
        return ByteTokenizer() if _byte_level(config) else None
    if rec["kind"] == "bytes":
        return ByteTokenizer()
    if rec["kind"] == "none":
        return None
    return HFTokenizer(os.path.join(workdir, TOKENIZER_DIR))


def describe(workdir: str | None, tok: Tokenizer | None) -> str:
    if tok is None:
        rec = record(workdir) if workdir else None
        why = "it records none" if rec else "not a byte-level model, and no tokenizer attached"
        return f"no tokenizer ({why})"
    return f"{tok.name} tokenizer ({tok.vocab_size} ids)"


def hf_files(directory: str) -> list[str]:
    """The Hugging Face tokenizer files present in `directory` (empty without tokenizer.json)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return []
    return [f for f in HF_FILES if os.path.isfile(os.path.join(directory, f))]


def check_fits(tok: Tokenizer, vocab_size: int, what: str) -> None:
    """Refuse a tokenizer with ids the model's vocabulary does not have."""
    if tok.vocab_size > vocab_size:
        raise TokenizerError(
            f"the tokenizer {what} has {tok.vocab_size} ids but the model's vocabulary is "
            f"config.model.vocab_size={vocab_size}: it does not fit this model (not its tokenizer)"
        )


def load_source(source: str) -> Tokenizer | None:
    """The tokenizer `source` names: "bytes", "none", a Hugging Face directory or a tokenizer.json."""
    if source == "bytes":
        return ByteTokenizer()
    if source == "none":
        return None
    if not os.path.exists(source):
        raise TokenizerError(
            f"tokenizer {source!r} does not exist: pass a Hugging Face directory, a tokenizer.json, bytes or none"
        )
    return HFTokenizer(source)


def check_source(source: str, vocab_size: int) -> Tokenizer | None:
    """The tokenizer `source` names (`load_source`), refused when it does not fit a model of
    `vocab_size` ids: more ids than the model has, or bytes for a model with more than 256."""
    tok = load_source(source)
    if tok is not None:
        check_fits(tok, vocab_size, repr(source))
    if isinstance(tok, ByteTokenizer) and vocab_size > BYTE_VOCAB:
        raise TokenizerError(
            f"the byte tokenizer decodes ids below 256 only, but the model's vocabulary is "
            f"config.model.vocab_size={vocab_size}: it would generate ids that are not bytes"
        )
    return tok


def attach(workdir: str, source: str, vocab_size: int, note: str | None = None) -> dict:
    """Record `source` ("bytes", "none", a Hugging Face directory or tokenizer.json) as the
    tokenizer of `workdir`'s model, copying the Hugging Face files into W/tokenizer/ (replacing
    what was there). A tokenizer with more ids than `vocab_size` is refused before anything is
    written, and so is the byte tokenizer for a vocabulary of more than 256 ids. Returns the record."""
    tok = check_source(source, vocab_size)
    rec: dict[str, Any] = {
        "kind": "none" if tok is None else "bytes" if isinstance(tok, ByteTokenizer) else "huggingface"
    }
    files: list[str] = []
    if rec["kind"] == "huggingface":
        files = hf_files(source) if os.path.isdir(source) else ["tokenizer.json"]
        rec.update(source=os.path.abspath(source), files=files, vocab_size=tok.vocab_size, eos_ids=list(tok.eos_ids))
        rec["chat_template"] = tok.chat_template is not None
    if note:
        rec["note"] = note
    os.makedirs(workdir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tokenizer-", dir=workdir)
    try:
        for f in files:
            shutil.copyfile(source if os.path.isfile(source) else os.path.join(source, f), os.path.join(staging, f))
        with open(os.path.join(staging, RECORD), "w") as fh:
            json.dump(rec, fh, indent=2)
            fh.write("\n")
        target = os.path.join(workdir, TOKENIZER_DIR)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
    return rec


def copy_record(src_workdir: str, dst_workdir: str) -> None:
    """Give `dst_workdir` (e.g. a quantized copy) the tokenizer `src_workdir` records, if any."""
    src = os.path.join(src_workdir, TOKENIZER_DIR)
    if os.path.isfile(os.path.join(src, RECORD)):
        shutil.copytree(src, os.path.join(dst_workdir, TOKENIZER_DIR), dirs_exist_ok=True)


def export_hf(workdir: str, out_dir: str) -> list[str]:
    """Copy a workdir's Hugging Face tokenizer files into `out_dir` (`convert --to-hf`); the files copied."""
    rec = record(workdir)
    if not rec or rec["kind"] != "huggingface":
        return []
    files = list(rec.get("files", []))
    for f in files:
        shutil.copyfile(os.path.join(workdir, TOKENIZER_DIR, f), os.path.join(out_dir, f))
    return files


# ----------------------------------------------------------------------------- commands' helpers


def _no_tokenizer(workdir: str | None, what: str, instead: str = "") -> TokenizerError:
    where = workdir or "this model"
    return TokenizerError(
        f"{what}, but {where} has no tokenizer (its model takes and prints token ids): {instead}attach the "
        f"model's tokenizer with `{ATTACH_HINT.format(workdir=workdir or 'W')}`"
    )


def prompt_ids(
    tok: Tokenizer | None,
    prompt: str,
    vocab_size: int,
    chat: bool = False,
    system: str | None = None,
    workdir: str | None = None,
) -> list[int]:
    """A --prompt's ids: text through the model's tokenizer (with `chat`, rendered by its chat
    template as one user message after an optional system one), or space-separated ids for a
    model without a tokenizer. Ids must fit `vocab_size`. TokenizerError names the problem."""
    if tok is None:
        if chat:
            raise _no_tokenizer(workdir, "--chat renders a chat template")
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            raise _no_tokenizer(
                workdir, f"--prompt {_clip(prompt)!r} is text", "pass the prompt as space-separated token ids, or "
            ) from None
    elif chat:
        ids = tok.encode_chat(chat_messages(prompt, system))
    else:
        if system:
            raise TokenizerError("--system goes with --chat")
        ids = tok.encode(prompt)
    if not ids:
        raise TokenizerError("the prompt has no tokens: give at least one token of context")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def chat_messages(prompt: str, system: str | None = None) -> list[dict]:
    """A one-turn chat: the prompt as the user's message, after an optional system message."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


class TokenPrinter:
    """Streams generated ids to `write`: text through the tokenizer's detokenizer (after `context`,
    the prompt), or space-separated ids when there is no tokenizer. Stops showing at the first id
    in `stop_ids` (the tokenizer's EOS ids unless told otherwise); `stopped` is then that id."""

    def __init__(self, tok: Tokenizer | None, write: Callable[[str], Any], context: Sequence[int] = (), stop_ids=None):
        self.tok, self._write = tok, write
        self._stream = tok.detokenizer(context) if tok is not None else None
        self.stop_ids = frozenset(tok.eos_ids if tok is not None and stop_ids is None else stop_ids or ())
        self.shown = 0
        self.stopped: int | None = None

    def push(self, ids: Sequence[int]) -> None:
        if self.stopped is not None:
            return
        keep = []
        for i in (int(i) for i in ids):
            if i in self.stop_ids:
                self.stopped = i
                break
            keep.append(i)
        if self._stream is not None:
            self._write(self._stream.push(keep))
        elif keep:
            self._write(("" if self.shown == 0 else " ") + " ".join(map(str, keep)))
        self.shown += len(keep)

    def close(self) -> None:
        if self._stream is not None:
            self._write(self._stream.flush())


# ----------------------------------------------------------------------------- corpora


_CHUNK = 1 << 16  # characters per piece the corpus is encoded in (split after a newline)


def encode_text(tok: Tokenizer, raw: bytes, cache: bool = True) -> np.ndarray:
    """The ids of a UTF-8 text (invalid bytes as U+FFFD) through `tok`, without special tokens,
    encoded in pieces that end after a newline (about 64K characters each, in parallel). Cached
    under $JAXSYS_CACHE (default ~/.cache/jaxsys) by the tokenizer's and the text's hashes."""
    from jaxsys.data import _cache_dir

    text = raw.decode("utf-8", errors="replace")
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(dtype)
    key = hashlib.sha256(getattr(tok, "fingerprint", tok.name).encode() + raw).hexdigest()[:24]
    path = os.path.join(_cache_dir(), f"tokens-{key}.npy")
    if cache and os.path.exists(path):
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError):
            pass
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    encode_batch = getattr(tok, "encode_batch", None)
    lists = encode_batch(pieces) if encode_batch else [tok.encode(p) for p in pieces]
    ids = np.fromiter((i for ids in lists for i in ids), dtype=dtype)
    if cache and len(raw) > _CHUNK:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npy.tmp")
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, ids)
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache only costs the encoding next time
    return ids


def corpus_for(config, workdir: str | None, splits=("train", "eval")):
    """The config's corpus as the workdir's model reads it: token files as they are; a text corpus
    (stdlib, text) as bytes for a byte-level model, through the model's Hugging Face tokenizer
    otherwise (the text split into train and held-out parts at a line first, so the held-out text
    is the byte model's; only `splits` are encoded). A text corpus for a model without a tokenizer
    is refused: its ids are not bytes."""
    from jaxsys import data as data_lib

    if config.data.source not in data_lib.BYTE_SOURCES:
        return data_lib.load_corpus(config.data)
    tok = for_config(config, workdir)
    if isinstance(tok, ByteTokenizer):
        return data_lib.load_corpus(config.data)
    if tok is None:
        raise data_lib.DataError(
            f"config.data.source={config.data.source!r} is a text corpus read as bytes, but "
            f"{workdir or 'this model'} has no tokenizer, so its ids are not bytes: attach the model's "
            f"tokenizer (`{ATTACH_HINT.format(workdir=workdir or 'W')}`) to read the text through it, "
            "or give token ids (--config.data.source=tokens --config.data.path=...)"
        )
    return data_lib.load_corpus(config.data, encode=lambda raw: encode_text(tok, raw), splits=splits)


def text_corpus(tok: Tokenizer | None, path: str, seq_len: int, workdir: str | None = None):
    """A text file as a held-out split (train split empty), read through the model's tokenizer."""
    from jaxsys import data as data_lib

    if tok is None:
        raise _no_tokenizer(workdir, f"--text {path} is text")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise data_lib.DataError(f"--text {path}: {e}") from None
    ids = encode_text(tok, raw)
    if ids.shape[0] < seq_len + 1:
        raise data_lib.DataError(
            f"--text {path} is {ids.shape[0]} tokens, but one sample needs config.data.seq_len + 1 = {seq_len + 1}: "
            "give a longer text or lower --config.data.seq_len"
        )
    empty = np.zeros((0,), ids.dtype)
    vocab = int(ids.max()) + 1
    return data_lib.Corpus(
        train=empty, eval=ids, vocab_needed=vocab, description=f"{path} ({tok.name}): {ids.shape[0]} tokens"
    )


def read_prompts(tok: Tokenizer | None, path: str, workdir: str | None = None) -> list[list[int]]:
    """A file of text prompts, one a line (blank lines skipped), as ids through the model's tokenizer."""
    if tok is None:
        raise _no_tokenizer(workdir, f"--prompts {path} holds text prompts")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"--prompts {path}: {e}") from None
    prompts = [tok.encode(line) for line in lines if line.strip()]
    if not prompts:
        raise TokenizerError(f"--prompts {path} has no prompt (one a line)")
    return prompts
