"""Corpora, byte tokenizer, deterministic sampler and sharded global batches.

Dimension letters: B batch, T sequence length (a sample holds T + 1 tokens so
that inputs are ``[:, :-1]`` and targets ``[:, 1:]``).

Everything here is deterministic: the batch for ``(seed, step, split)`` is a
pure function of those arguments and the corpus, so any process can build
exactly its own rows of the global batch without communication.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sys
import sysconfig
import tempfile
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxsys.config import DOCUMENT_SOURCES  # corpora of documents, tokenized into shards (docs/data.md)

VALID_SOURCES = ("stdlib", "text", "tokens") + DOCUMENT_SOURCES
BYTE_SOURCES = ("stdlib", "text")  # corpora whose tokens are UTF-8 bytes (text in, text out)
VALID_TOKEN_DTYPES = ("uint16", "uint32")
_NPY_TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.int32))
_SPLIT_IDS = {"train": 0, "eval": 1}
_BYTE_VOCAB = 256
_MAX_CHUNK = 1 << 24  # tokens per chunk in the vocab_needed pass (memory bound)


class DataError(ValueError):
    """Bad data configuration or input; the message names the key/file and the fix."""


class Batch(NamedTuple):
    """A batch of documents (config.data.source jsonl, parquet or hf), a pytree of three arrays
    sharded alike over the batch axes (`Program.batch_specs`): a token stream's batch stays one
    [B, T + 1] int32 array.

    tokens:   [B, T + 1] int32, inputs [:, :-1] and targets [:, 1:]
    segments: [B, T + 1] int32, the document of each token within its row (1, 2, ...; 0 padding);
              the model sees them only with config.data.packing (one document a row needs none)
    weights:  [B, T] float32, the loss weight of each target (0 on padding, on a target in another
              document than its input and, for chats, on tokens that are not the assistant's)

    The loss is sum(weights * per-token losses) / sum(weights) over the global batch."""

    tokens: Any
    segments: Any
    weights: Any


def batch_parts(batch) -> tuple[Any, Any, Any]:
    """(tokens, segments, weights) of a Batch, (tokens, None, None) of a [B, T + 1] array."""
    if isinstance(batch, Batch):
        return batch.tokens, batch.segments, batch.weights
    return batch, None, None


def is_documents(data_cfg) -> bool:
    """Whether the corpus is one of documents (batches are `Batch`es) rather than a token stream."""
    return data_cfg.source in DOCUMENT_SOURCES


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split into train (head) and eval (tail) 1-D arrays."""

    train: np.ndarray
    eval: np.ndarray
    vocab_needed: int
    description: str

    @property
    def has_eval(self) -> bool:
        return self.eval.shape[0] > 0

    def split(self, split: str) -> np.ndarray:
        """The token array for ``split`` ('train' or 'eval')."""
        if split not in _SPLIT_IDS:
            raise DataError(f"unknown split {split!r}; valid splits are {sorted(_SPLIT_IDS)}")
        tokens = self.train if split == "train" else self.eval
        if tokens.shape[0] == 0:
            raise DataError(
                "the eval split is empty because config.data.eval_fraction is 0; "
                "set config.data.eval_fraction > 0 to evaluate"
            )
        return tokens


# ----------------------------------------------------------------------------
# Byte tokenizer (jaxsys/tokenizer.py has every model's tokenizer: `tokenizer.for_config`)
# ----------------------------------------------------------------------------


def byte_encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as a uint8 token array (token = byte value)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def byte_decode(ids: Any) -> str:
    """Inverse of :func:`byte_encode`; invalid UTF-8 becomes U+FFFD."""
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= _BYTE_VOCAB):
        raise DataError(f"byte_decode got ids outside [0, 256): min={arr.min()}, max={arr.max()}")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------
# Corpus loading
# ----------------------------------------------------------------------------


def _cfg(data_cfg: Any, name: str) -> Any:
    """Read ``data_cfg.<name>`` or raise a DataError naming ``config.data.<name>``."""
    try:
        return getattr(data_cfg, name)
    except (AttributeError, KeyError):
        raise DataError(f"config.data.{name} is missing; set it in the config") from None


def load_corpus(data_cfg: Any, encode=None, splits=("train", "eval")) -> Corpus:
    """Load the token stream described by ``data_cfg`` (see module docs) and split it (a corpus of
    documents, source jsonl, parquet or hf, opens with `loader.load_corpus`).

    Fields: source, path, token_dtype, eval_fraction, seq_len. ``encode`` (UTF-8 bytes -> 1-D
    token array; `jaxsys.tokenizer.corpus_for` passes the model's tokenizer) reads a text corpus
    (stdlib, text) through a tokenizer instead of as bytes: the text is split at a line first (the
    held-out part is the last ``eval_fraction`` of the bytes, from the next line on) and only
    ``splits`` are encoded (the other is empty).
    """
    source = _cfg(data_cfg, "source")
    seq_len = _cfg(data_cfg, "seq_len")
    eval_fraction = _cfg(data_cfg, "eval_fraction")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise DataError(f"config.data.seq_len must be a positive int, got {seq_len!r}")
    try:
        eval_fraction = float(eval_fraction)
    except (TypeError, ValueError):
        raise DataError(f"config.data.eval_fraction must be a float in [0, 0.5), got {eval_fraction!r}") from None
    if not 0.0 <= eval_fraction < 0.5:
        raise DataError(f"config.data.eval_fraction must be in [0, 0.5), got {eval_fraction}")

    if source in DOCUMENT_SOURCES:
        raise DataError(
            f"config.data.source={source!r} is a corpus of documents, tokenized into shards: open it with "
            "jaxsys.data.loader.load_corpus (docs/data.md)"
        )
    if source in BYTE_SOURCES and encode is not None:
        return _encoded_split(data_cfg, encode, splits, eval_fraction, int(seq_len))
    if source == "stdlib":
        tokens, vocab, desc = _load_stdlib(), _BYTE_VOCAB, "python stdlib sources (bytes)"
    elif source == "text":
        files = _resolve_files(_cfg(data_cfg, "path"))
        tokens, vocab = _load_text(files), _BYTE_VOCAB
        desc = f"text files (bytes): {_short_list(files)}"
    elif source == "tokens":
        files = _resolve_files(_cfg(data_cfg, "path"))
        tokens = _load_tokens(files, data_cfg)
        vocab = _vocab_needed(tokens, files)
        desc = f"token files: {_short_list(files)}"
    else:
        raise DataError(f"config.data.source={source!r} is unknown; valid sources are {list(VALID_SOURCES)}")
    return _split(tokens, vocab, desc, eval_fraction, int(seq_len))


def _split(tokens: np.ndarray, vocab: int, desc: str, eval_fraction: float, seq_len: int) -> Corpus:
    """Hold out the last ``eval_fraction`` of tokens for eval; check both splits fit T + 1."""
    n = int(tokens.shape[0])
    need = seq_len + 1
    if n == 0:
        raise DataError(f"the corpus ({desc}) is empty; check config.data.path / config.data.source")
    n_eval = int(n * eval_fraction)
    n_train = n - n_eval
    if n_train < need:
        raise DataError(
            f"train split has {n_train} tokens (corpus {n}) but one sample needs "
            f"config.data.seq_len + 1 = {need}; lower config.data.seq_len or "
            f"config.data.eval_fraction, or give more data ({desc})"
        )
    if eval_fraction > 0 and n_eval < need:
        raise DataError(
            f"eval split has {n_eval} tokens (corpus {n} x config.data.eval_fraction="
            f"{eval_fraction}) but one sample needs config.data.seq_len + 1 = {need}; "
            f"lower config.data.seq_len, raise config.data.eval_fraction, set it to 0, "
            f"or give more data ({desc})"
        )
    desc = f"{desc}; {n} tokens (train {n_train}, eval {n_eval}), vocab_needed {vocab}"
    return Corpus(train=tokens[:n_train], eval=tokens[n_train:], vocab_needed=vocab, description=desc)


def _encoded_split(data_cfg: Any, encode, splits, eval_fraction: float, seq_len: int) -> Corpus:
    """A text corpus cut into train and held-out text at a line, each part encoded by ``encode``."""
    if data_cfg.source == "stdlib":
        raw, desc = _load_stdlib(), "python stdlib sources"
    else:
        files = _resolve_files(_cfg(data_cfg, "path"))
        raw, desc = _load_text(files), f"text files: {_short_list(files)}"
    data = memoryview(np.ascontiguousarray(raw)).cast("B")
    n = len(data)
    if n == 0:
        raise DataError(f"the corpus ({desc}) is empty; check config.data.path / config.data.source")
    cut = n
    if eval_fraction > 0:
        newline = bytes(data[n - int(n * eval_fraction) :]).find(b"\n")
        cut = n - int(n * eval_fraction) + newline + 1 if newline >= 0 else n
    parts = {"train": bytes(data[:cut]), "eval": bytes(data[cut:])}
    tokens = {
        name: np.asarray(encode(part)) if name in splits and part else np.zeros((0,), np.uint32)
        for name, part in parts.items()
    }
    need = seq_len + 1
    for name in splits:
        if name == "eval" and eval_fraction == 0:
            continue
        if tokens[name].shape[0] < need:
            raise DataError(
                f"the {name} split of {desc} is {tokens[name].shape[0]} tokens through the tokenizer, but one "
                f"sample needs config.data.seq_len + 1 = {need}; lower config.data.seq_len or give more text"
            )
    vocab = max((int(t.max()) + 1 for t in tokens.values() if t.shape[0]), default=0)
    sizes = ", ".join(f"{k} {v.shape[0]}" for k, v in tokens.items() if k in splits)
    desc = f"{desc} through a tokenizer; {n} bytes, tokens: {sizes}"
    return Corpus(train=tokens["train"], eval=tokens["eval"], vocab_needed=vocab, description=desc)


def _short_list(files: list[str], k: int = 3) -> str:
    more = f" (+{len(files) - k} more)" if len(files) > k else ""
    return ", ".join(files[:k]) + more


def _resolve_files(path: Any) -> list[str]:
    """Expand a path / glob / comma-separated list into sorted, unique files."""
    if not isinstance(path, str) or not path.strip():
        raise DataError(f"config.data.path must be a non-empty path, glob or comma list, got {path!r}")
    files: set[str] = set()
    for entry in (p.strip() for p in path.split(",")):
        if not entry:
            continue
        pattern = os.path.expanduser(entry)
        if glob.has_magic(pattern):
            matches = [m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise DataError(
                    f"glob {entry!r} from config.data.path matches no files; fix the pattern "
                    f"(relative to cwd {os.getcwd()!r}) or point to existing files"
                )
            files.update(matches)
        elif os.path.isdir(pattern):
            raise DataError(
                f"{entry!r} in config.data.path is a directory; use a glob such as '{entry.rstrip('/')}/*.txt'"
            )
        elif not os.path.isfile(pattern):
            raise DataError(f"file {entry!r} from config.data.path does not exist; fix config.data.path")
        else:
            files.add(pattern)
    if not files:
        raise DataError(f"config.data.path={path!r} names no files")
    return sorted(files)


def _load_text(files: list[str]) -> np.ndarray:
    """Raw bytes of ``files`` concatenated in order, as uint8 tokens."""
    chunks = []
    for f in files:
        with open(f, "rb") as fh:
            chunks.append(fh.read())
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _load_tokens(files: list[str], data_cfg: Any) -> np.ndarray:
    """Memory-map ``.npy``/``.bin`` token files; several files are concatenated in RAM."""
    arrays = [_load_token_file(f, data_cfg) for f in files]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _load_token_file(f: str, data_cfg: Any) -> np.ndarray:
    if f.endswith(".npy"):
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"cannot read token file {f!r} (config.data.path): {e}") from None
        if arr.ndim != 1 or arr.dtype not in _NPY_TOKEN_DTYPES:
            raise DataError(
                f"token file {f!r} (config.data.path) has shape {arr.shape} dtype {arr.dtype}; "
                f"it must be 1-D with dtype uint16, uint32 or int32 (re-save it e.g. with "
                f"np.save(path, ids.reshape(-1).astype(np.uint32)))"
            )
        return arr
    if f.endswith(".bin"):
        dtype = _cfg(data_cfg, "token_dtype")
        if dtype not in VALID_TOKEN_DTYPES:
            raise DataError(
                f"config.data.token_dtype={dtype!r} is invalid for raw file {f!r}; "
                f"use one of {list(VALID_TOKEN_DTYPES)}"
            )
        size, item = os.path.getsize(f), np.dtype(dtype).itemsize
        if size % item:
            raise DataError(
                f"raw token file {f!r} has {size} bytes, not a multiple of {item} "
                f"(config.data.token_dtype={dtype!r}); check config.data.token_dtype"
            )
        if size == 0:
            return np.zeros((0,), dtype=dtype)  # np.memmap refuses empty files
        return np.memmap(f, dtype=dtype, mode="r")
    raise DataError(
        f"token file {f!r} (config.data.path) must end in .npy or .bin; for raw text use config.data.source='text'"
    )


def _vocab_needed(tokens: np.ndarray, files: list[str]) -> int:
    """max id + 1 via a chunked pass (bounded memory); rejects negative ids."""
    lo, hi = 0, -1
    for start in range(0, tokens.shape[0], _MAX_CHUNK):
        chunk = np.asarray(tokens[start : start + _MAX_CHUNK])
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    if lo < 0:
        raise DataError(f"token files {_short_list(files)} (config.data.path) contain negative ids ({lo})")
    return hi + 1


# ----------------------------------------------------------------------------
# stdlib corpus (cached)
# ----------------------------------------------------------------------------


def _cache_dir() -> str:
    return os.environ.get("JAXSYS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxsys")


def _stdlib_files(root: str) -> list[str]:
    """Relative paths of stdlib ``.py`` files, sorted, excluding site/dist-packages."""
    rels = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages")]
        rels += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py")]
    return sorted(rels, key=lambda r: r.replace(os.sep, "/"))


def _load_stdlib() -> np.ndarray:
    """Bytes of the interpreter's stdlib sources joined by ``\\n``, cached as .npy (mmap)."""
    root = sysconfig.get_paths()["stdlib"]
    ver = f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    key = hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:12]
    cache = _cache_dir()
    path = os.path.join(cache, f"stdlib-{ver}-{key}.npy")
    if os.path.exists(path):
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError):
            pass  # corrupt cache: rebuild below
    parts = []
    for rel in _stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as fh:
            parts.append(fh.read())
    data = np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    try:
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".npy.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as e:
        raise DataError(
            f"cannot write the stdlib cache {path!r}: {e}; set $JAXSYS_CACHE to a writable directory"
        ) from None
    return np.load(path, mmap_mode="r")


# ----------------------------------------------------------------------------
# Sampler and batches
# ----------------------------------------------------------------------------


def sample_offsets(seed: int, step: int, batch_size: int, num_tokens: int, seq_len: int, split: str) -> np.ndarray:
    """[B] int64 start offsets, uniform in [0, num_tokens - T - 1]; pure in its arguments."""
    if split not in _SPLIT_IDS:
        raise DataError(f"unknown split {split!r}; valid splits are {sorted(_SPLIT_IDS)}")
    if num_tokens < seq_len + 1:
        raise DataError(
            f"{split} split has {num_tokens} tokens but a sample needs seq_len + 1 = {seq_len + 1}; "
            f"lower config.data.seq_len or give more data"
        )
    if not 0 <= step < 2**62:
        raise DataError(f"step must be in [0, 2**62), got {step}")
    # Philox key: word 0 = seed, word 1 = (step, split) packed; distinct args -> distinct keys.
    key = np.array([int(seed) % 2**64, (int(step) << 1) | _SPLIT_IDS[split]], dtype=np.uint64)
    rng = np.random.Generator(np.random.Philox(key=key))
    return rng.integers(0, num_tokens - seq_len, size=batch_size, dtype=np.int64)


def _gather(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """[len(offsets), T + 1] int32 rows ``tokens[o : o + T + 1]`` (reads only these)."""
    out = np.empty((offsets.shape[0], seq_len + 1), dtype=np.int32)
    for i, o in enumerate(offsets):
        out[i] = tokens[o : o + seq_len + 1]
    return out


def batch_rows(
    corpus: Corpus, seed: int, step: int, batch_size: int, seq_len: int, split: str, rows: slice
) -> np.ndarray:
    """Rows ``rows`` of the [B, T + 1] int32 global batch for (seed, step, split)."""
    tokens = corpus.split(split)
    offsets = sample_offsets(seed, step, batch_size, tokens.shape[0], seq_len, split)
    return _gather(tokens, offsets[rows], seq_len)


def global_batch(
    corpus: Corpus,
    sharding: jax.sharding.Sharding,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    split: str = "train",
) -> jax.Array:
    """[B, T + 1] int32 global batch with ``sharding``; each process reads only its rows. A corpus
    of documents (`loader.DocumentCorpus`) gives a `Batch` of such arrays instead."""
    if not isinstance(corpus, Corpus):
        return corpus.global_batch(sharding, seed, step, batch_size, seq_len, split)
    tokens = corpus.split(split)
    offsets = sample_offsets(seed, step, batch_size, tokens.shape[0], seq_len, split)
    shape = (batch_size, seq_len + 1)

    def cb(index: tuple[slice, ...]) -> np.ndarray:
        rows = _gather(tokens, offsets[index[0]], seq_len)
        return rows[(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback(shape, sharding, cb)
