"""The tokenized cache of a corpus of documents: memory-mapped shards, built once, resumable.

    python -m jaxsys.tokenize --config C        # build (or finish, or repair) the cache of C's corpus
    store = shards.load(config.data)            # open it (training: builds it first when missing)

As Levanter's cache: the corpus is cut into units (`documents.plan_units`: at most
`config.data.shard_docs` records, a Parquet row group whole), each unit is tokenized by a worker
process into one shard, and a shard counts as done only once its files are complete and listed in
the ledger. A directory per corpus, `<cache_dir>/<key>` where the key hashes what the ids depend
on (the input files' paths, sizes and modification times, the format and field, the tokenizer's
fingerprint), holds:

    plan.json               the key's inputs and the units
    ledger.jsonl            one line per finished shard: its documents, tokens, largest id, and
                            each file's size and SHA-256
    NNNNN.tokens.npy        the shard's ids, concatenated (uint16, or uint32 above 65536 ids)
    NNNNN.docs.npy          int64 [documents + 1]: where each document starts (and the end)
    NNNNN.mask.npy          uint8, per token (chats: 1 on the assistant's tokens; preference
                            pairs: 1 on the completions', a record's chosen and rejected being
                            documents 2i and 2i + 1)
    manifest.json           written last: the cache is complete

A shard's files are written under temporary names and renamed, so an interrupted build leaves
whole shards and nothing half-written; running the build again tokenizes only the units the
ledger lacks (or whose files no longer match it). Opening a cache checks every shard's files
against the ledger (sizes, and that the index fits the ids) and names the first that is damaged or
missing; the command rebuilds exactly those (`--verify` also compares the SHA-256 of every file).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import tempfile
from typing import Any

import numpy as np

from jaxsys.data import DataError, _cache_dir, documents

VERSION = 1
TOKENIZE_HINT = "python -m jaxsys.tokenize --config CONFIG (with the same --config.data.* overrides)"


# ----------------------------------------------------------------------------- keys and paths


def documents_sources() -> tuple[str, ...]:
    from jaxsys.config import DOCUMENT_SOURCES

    return DOCUMENT_SOURCES


def tokenizer_id(spec: str) -> str:
    """What identifies the tokenizer `spec` names in the cache key: 'bytes' or its file's hash."""
    from jaxsys import tokenizer as tokenizer_lib

    if spec == "bytes":
        return "bytes"
    try:
        tok = tokenizer_lib.load_source(spec)
    except tokenizer_lib.TokenizerError as e:
        raise DataError(f"config.data.tokenizer={spec!r}: {e}") from None
    if tok is None:
        raise DataError(
            "config.data.tokenizer='none': a corpus of documents is text, tokenized into the shards: name a "
            "Hugging Face tokenizer (a directory or tokenizer.json) or 'bytes'"
        )
    return f"huggingface:{getattr(tok, 'fingerprint', spec)}"


def key_of(data_cfg, files=None) -> dict:
    """Everything the shards' contents depend on (hashed into the cache directory's name)."""
    files = documents.input_files(data_cfg) if files is None else files
    return {
        "version": VERSION,
        "source": data_cfg.source,
        "inputs": documents.fingerprint_inputs(files),
        "format": data_cfg.format,
        "field": documents.field_of(data_cfg),
        "tokenizer": tokenizer_id(data_cfg.tokenizer),
        "shard_docs": int(data_cfg.shard_docs),
    }


def directory(data_cfg, key: dict | None = None) -> str:
    key = key_of(data_cfg) if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = os.path.expanduser(data_cfg.cache_dir) if data_cfg.cache_dir else os.path.join(_cache_dir(), "corpora")
    return os.path.join(root, f"{data_cfg.source}-{digest}")


def _names(index: int, chat: bool) -> dict[str, str]:
    names = {"tokens": f"{index:05d}.tokens.npy", "docs": f"{index:05d}.docs.npy"}
    if chat:
        names["mask"] = f"{index:05d}.mask.npy"
    return names


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: str, value: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- one unit (in a worker)

_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(spec: str):
    if spec not in _TOKENIZERS:
        from jaxsys import tokenizer as tokenizer_lib

        _TOKENIZERS[spec] = tokenizer_lib.load_source(spec)
    return _TOKENIZERS[spec]


def _tokenize_unit(job: dict) -> dict:
    """Tokenize one unit into its shard files (written whole, then renamed); its ledger entry."""
    unit = documents.Unit(**job["unit"])
    cfg = _DataView(job["data"])
    tok = _tokenizer(cfg.tokenizer)
    dtype = np.dtype(job["dtype"])
    chat = has_masks(cfg)
    ids_parts, mask_parts, offsets, total, largest, records = [], [], [0], 0, -1, 0
    for value, where in documents.read_unit(unit, documents.field_of(cfg)):
        records += 1
        for ids, mask in documents.record_documents(tok, value, cfg, where):  # a preference record: two
            if ids.size and int(ids.max()) >= np.iinfo(dtype).max + 1:
                raise DataError(f"{where}: token id {int(ids.max())} does not fit the shard dtype {dtype}")
            ids_parts.append(ids.astype(dtype))
            if chat:
                mask_parts.append(mask)
            total += ids.size
            offsets.append(total)
            if ids.size:
                largest = max(largest, int(ids.max()))
    arrays = {
        "tokens": np.concatenate(ids_parts) if ids_parts else np.zeros((0,), dtype),
        "docs": np.asarray(offsets, np.int64),
    }
    if chat:
        arrays["mask"] = np.concatenate(mask_parts) if mask_parts else np.zeros((0,), np.uint8)
    files = {}
    for what, name in _names(job["index"], chat).items():
        path = os.path.join(job["dir"], name)
        fd, tmp = tempfile.mkstemp(dir=job["dir"], suffix=".npy.tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, arrays[what])
        os.replace(tmp, path)
        files[what] = [name, os.path.getsize(path), _sha256(path)]
    entry = {"unit": job["index"], "docs": len(offsets) - 1, "tokens": total, "max_id": largest, "files": files}
    return {**entry, "records": records}


def has_masks(data_cfg) -> bool:
    """Whether the shards store a loss mask per token: chats (the assistant's tokens) and preference
    pairs (the completions' tokens)."""
    return data_cfg.format in ("chat", "preference")


class _DataView:
    """The data keys a worker needs, as attributes (a ConfigDict does not cross processes cheaply)."""

    KEYS = ("source", "format", "text_field", "messages_field", "tokenizer")
    source: str
    format: str
    text_field: str
    messages_field: str
    tokenizer: str

    def __init__(self, values: dict):
        self.__dict__.update(values)

    @classmethod
    def of(cls, data_cfg) -> dict:
        return {k: data_cfg[k] for k in cls.KEYS}


# ----------------------------------------------------------------------------- checks


def _read_ledger(dir_: str) -> dict[int, dict]:
    """The last entry of each unit in the ledger (a torn last line is ignored)."""
    entries: dict[int, dict] = {}
    path = os.path.join(dir_, "ledger.jsonl")
    if not os.path.exists(path):
        return entries
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
                entries[int(entry["unit"])] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return entries


def check_shard(dir_: str, entry: dict, full: bool = False) -> str | None:
    """None when the shard's files match its ledger entry; else what is wrong (naming the file)."""
    arrays = {}
    for what, (name, size, digest) in entry["files"].items():
        path = os.path.join(dir_, name)
        if not os.path.isfile(path):
            return f"shard file {path} is missing"
        if os.path.getsize(path) != size:
            return f"shard file {path} has {os.path.getsize(path)} bytes, the ledger says {size}"
        if full and _sha256(path) != digest:
            return f"shard file {path} does not have the SHA-256 the ledger recorded"
        try:
            arrays[what] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            return f"shard file {path} cannot be read ({e})"
    docs, tokens = arrays["docs"], arrays["tokens"]
    if docs.ndim != 1 or docs.shape[0] != entry["docs"] + 1 or tokens.shape != (entry["tokens"],):
        return f"shard {entry['unit']} in {dir_} does not hold the documents and tokens the ledger says"
    if docs[0] != 0 or docs[-1] != tokens.shape[0] or np.any(np.diff(docs) < 0):
        return f"shard file {os.path.join(dir_, entry['files']['docs'][0])} is not an index of its tokens"
    if "mask" in arrays and arrays["mask"].shape != tokens.shape:
        return f"shard file {os.path.join(dir_, entry['files']['mask'][0])} does not match its tokens"
    return None


# ----------------------------------------------------------------------------- build


def _workers(n: int, units: int) -> int:
    if n <= 0:
        n = min(8, os.cpu_count() or 1)
    return max(1, min(n, units))


def build(data_cfg, progress: bool = True, verify: bool = False, workers: int | None = None, log=print) -> str:
    """Build, finish or repair the cache of `data_cfg`'s corpus; returns its directory. Units the
    ledger lists with matching files are kept; the others are tokenized (in `workers` processes,
    default config.data.tokenize_workers). `verify` also checks every kept file's SHA-256. An error
    in a record stops the build with a DataError naming it; the shards already finished stay."""
    files = documents.input_files(data_cfg)
    key = key_of(data_cfg, files)
    dir_ = directory(data_cfg, key)
    os.makedirs(dir_, exist_ok=True)
    plan_path = os.path.join(dir_, "plan.json")
    plan = None
    if os.path.exists(plan_path):
        try:
            with open(plan_path) as f:
                plan = json.load(f)
        except ValueError:
            plan = None
        if plan is not None and plan.get("key") != key:
            plan = None
    if plan is None:
        from jaxsys import tokenizer as tokenizer_lib

        units = documents.plan_units(data_cfg, files)
        if not units:
            raise DataError(f"config.data.path={data_cfg.path!r} holds no documents")
        tok = tokenizer_lib.load_source(data_cfg.tokenizer)
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        plan = {"key": key, "dtype": dtype, "units": [u.as_dict() for u in units]}
        _write_json(plan_path, plan)
        manifest = os.path.join(dir_, "manifest.json")
        if os.path.exists(manifest):
            os.remove(manifest)
    ledger = _read_ledger(dir_)
    done, todo = {}, []
    for i in range(len(plan["units"])):
        entry = ledger.get(i)
        problem = "not built" if entry is None else check_shard(dir_, entry, full=verify)
        if problem is None:
            done[i] = entry
        else:
            if entry is not None:
                log(f"jaxsys.tokenize: rebuilding shard {i}: {problem}")
            todo.append(i)
    if todo and os.path.exists(os.path.join(dir_, "manifest.json")):
        os.remove(os.path.join(dir_, "manifest.json"))
    if todo:
        _run(dir_, data_cfg, plan, todo, done, progress, _workers(workers or data_cfg.tokenize_workers, len(todo)))
    entries = [done[i] for i in range(len(plan["units"]))]
    manifest = {
        "complete": True,
        "key": key,
        "dtype": plan["dtype"],
        "shards": len(entries),
        "docs": sum(e["docs"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "vocab_needed": max(e["max_id"] for e in entries) + 1,
        "chat": has_masks(data_cfg),  # masks stored
        "pairs": data_cfg.format == "preference",  # documents 2i, 2i + 1: a record's chosen, rejected
    }
    _write_json(os.path.join(dir_, "manifest.json"), manifest)
    return dir_


def _run(dir_: str, data_cfg, plan: dict, todo: list[int], done: dict, progress: bool, workers: int) -> None:
    from tqdm import tqdm

    jobs = [
        {"dir": dir_, "index": i, "unit": plan["units"][i], "data": _DataView.of(data_cfg), "dtype": plan["dtype"]}
        for i in todo
    ]
    total = sum(u["stop"] - u["start"] for u in plan["units"])
    initial = sum(e.get("records", e["docs"]) for e in done.values())
    bar = tqdm(total=total, initial=initial, unit="doc", desc="tokenize", disable=not progress, dynamic_ncols=True)
    ledger = open(os.path.join(dir_, "ledger.jsonl"), "a")

    def record(entry: dict) -> None:
        ledger.write(json.dumps(entry) + "\n")
        ledger.flush()
        os.fsync(ledger.fileno())
        done[entry["unit"]] = entry
        bar.update(entry.get("records", entry["docs"]))

    try:
        if workers == 1:
            for job in jobs:
                record(_tokenize_unit(job))
        else:
            # spawn: the parent may hold JAX's threads, which a fork would copy mid-flight
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
                futures = [pool.submit(_tokenize_unit, job) for job in jobs]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        record(future.result())
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        ledger.close()
        bar.close()


# ----------------------------------------------------------------------------- open


@dataclasses.dataclass
class Store:
    """An opened cache: per-shard memory-mapped ids (and masks), and where each document is."""

    directory: str
    manifest: dict
    tokens: list[np.ndarray]
    masks: list[np.ndarray] | None
    doc_shard: np.ndarray  # [N] int32
    doc_start: np.ndarray  # [N] int64, within its shard
    doc_len: np.ndarray  # [N] int64

    @property
    def num_docs(self) -> int:
        return int(self.doc_len.shape[0])

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        s, a = int(self.doc_shard[i]), int(self.doc_start[i])
        b = a + int(self.doc_len[i])
        return self.tokens[s][a:b], (self.masks[s][a:b] if self.masks is not None else None)


def _damaged(dir_: str, problem: str) -> DataError:
    return DataError(
        f"the tokenized corpus in {dir_} is damaged: {problem}. Run `{TOKENIZE_HINT}` to rebuild the damaged "
        "shards (the others are kept)"
    )


def open_store(dir_: str) -> Store:
    """Open a complete cache, checking every shard against the ledger; DataError names what is wrong."""
    with open(os.path.join(dir_, "manifest.json")) as f:
        manifest = json.load(f)
    ledger = _read_ledger(dir_)
    tokens, masks, shard, start, length = [], [], [], [], []
    for i in range(manifest["shards"]):
        entry = ledger.get(i)
        if entry is None:
            raise _damaged(dir_, f"shard {i} is not in the ledger")
        problem = check_shard(dir_, entry)
        if problem is not None:
            raise _damaged(dir_, problem)
        files = entry["files"]
        tokens.append(np.load(os.path.join(dir_, files["tokens"][0]), mmap_mode="r"))
        if "mask" in files:
            masks.append(np.load(os.path.join(dir_, files["mask"][0]), mmap_mode="r"))
        docs = np.load(os.path.join(dir_, files["docs"][0]))
        shard.append(np.full(docs.shape[0] - 1, i, np.int32))
        start.append(docs[:-1])
        length.append(np.diff(docs))
    cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros((0,), dtype)
    return Store(
        dir_,
        manifest,
        tokens,
        masks if manifest.get("chat") else None,
        cat(shard, np.int32),
        cat(start, np.int64),
        cat(length, np.int64),
    )


def load(data_cfg, build_missing: bool = True, progress: bool = True, log=print) -> Store:
    """The opened cache of `data_cfg`'s corpus. A cache never completed is built first when
    `build_missing` (one process), else a DataError says to run the tokenize command; a damaged
    one is a DataError naming the shard and the command that repairs it (nothing is deleted)."""
    dir_ = directory(data_cfg)
    if not os.path.exists(os.path.join(dir_, "manifest.json")):
        if not build_missing:
            raise DataError(
                f"the corpus config.data.path={data_cfg.path!r} is not tokenized yet ({dir_} has no manifest): "
                f"run `{TOKENIZE_HINT}` first (with several processes, training does not build it itself)"
            )
        log(f"jaxsys: tokenizing config.data.path={data_cfg.path!r} into {dir_} (once; `{TOKENIZE_HINT}`)")
        build(data_cfg, progress=progress, log=log)
    return open_store(dir_)
