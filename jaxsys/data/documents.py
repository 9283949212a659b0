"""Corpora of documents: JSON lines, Parquet and Hugging Face datasets on disk, read record by
record, and a document's token ids (with, for chats, the mask of the assistant's tokens).

    units = documents.plan_units(config.data)              # [(file, start, stop, kind)], whole files cut
    for record in documents.read_unit(unit, config.data):   # dicts
        ids, mask = documents.encode_record(tok, record, config.data, where)

Sources (`config.data.source`, `config.data.path`):

- `jsonl`: JSON-lines files (a path, glob or comma list; `.jsonl`, or `.json` with one object a
  line), one document per line (blank lines skipped).
- `parquet`: Parquet files (pyarrow), one document per row.
- `hf`: a dataset written by `datasets.Dataset.save_to_disk` (a directory with state.json and its
  .arrow files; for a DatasetDict, the directory of `config.data.split` inside it), or the data
  files of a Hugging Face dataset (.parquet, .jsonl/.json, .arrow) by path or glob. Only pyarrow is
  imported: the `datasets` library is not needed to read what it saved.

The document is `record[config.data.text_field]` (format text) or the chat
`record[config.data.messages_field]` (format chat, a list of {"role", "content"}). A preference
record (format preference, DPO: docs/finetune.md) has the fields `prompt`, `chosen` and `rejected`
and gives two documents, the prompt followed by each completion (`encode_preference`). A record
without the field is a DataError naming the file, the record and the fields it has.

A text document is `tok.encode(text)` followed by the tokenizer's first end-of-sequence id (when it
has one and the encoding does not already end with it), so that packed documents stay apart. A
chat is rendered with the tokenizer's chat template (`encode_chat(..., add_generation_prompt=False)`)
and its loss mask marks the assistant's tokens: each assistant turn's span is found by rendering
the conversation's prefixes, as TRL and torchtitan do (`assistant_mask`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxsys.data import DataError, _resolve_files

JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet",)
ARROW_EXT = (".arrow",)


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of the corpus tokenized as one shard: records [start, stop) of `file` (for jsonl,
    `offset` is the byte offset of record `start`)."""

    file: str
    kind: str  # jsonl | parquet | arrow
    start: int
    stop: int
    offset: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- files


def input_files(data_cfg) -> list[tuple[str, str]]:
    """(file, kind) of every input file of the corpus, in order."""
    source, path = data_cfg.source, data_cfg.path
    if source == "hf" and isinstance(path, str) and os.path.isdir(os.path.expanduser(path)):
        return [(f, "arrow") for f in _saved_dataset_files(os.path.expanduser(path), data_cfg.split)]
    files = _resolve_files(path)
    out = []
    for f in files:
        kind = _kind_of(f, source)
        out.append((f, kind))
    return out


def _kind_of(f: str, source: str) -> str:
    low = f.lower()
    if source == "jsonl":
        if low.endswith(PARQUET_EXT + ARROW_EXT):
            raise DataError(f"{f} (config.data.path) is not JSON lines: use config.data.source='parquet' or 'hf'")
        return "jsonl"
    if source == "parquet":
        if not low.endswith(PARQUET_EXT):
            raise DataError(f"{f} (config.data.path) is not a .parquet file (config.data.source='parquet')")
        return "parquet"
    for ext, kind in ((PARQUET_EXT, "parquet"), (ARROW_EXT, "arrow"), (JSONL_EXT, "jsonl")):
        if low.endswith(ext):
            return kind
    raise DataError(
        f"{f} (config.data.path) is not a data file of a Hugging Face dataset (.parquet, .arrow, .jsonl, .json); "
        "or pass the directory written by save_to_disk"
    )


def _saved_dataset_files(directory: str, split: str) -> list[str]:
    """The .arrow files of a `save_to_disk` directory (a Dataset, or a DatasetDict's `split`)."""
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        with open(os.path.join(directory, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise DataError(
                f"{directory} is a DatasetDict with splits {splits}: config.data.split={split!r} is not one of them"
            )
        directory = os.path.join(directory, split)
    state = os.path.join(directory, "state.json")
    if not os.path.isfile(state):
        raise DataError(
            f"{directory} (config.data.path) is a directory without state.json: pass a directory written by "
            "datasets' save_to_disk, or the dataset's data files (a glob such as 'DIR/*.parquet')"
        )
    with open(state) as f:
        names = [d["filename"] for d in json.load(f).get("_data_files", [])]
    if not names:
        raise DataError(f"{state} lists no data files")
    files = [os.path.join(directory, n) for n in names]
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"{f}, listed in {state}, does not exist: the saved dataset is incomplete")
    return files


def fingerprint_inputs(files: list[tuple[str, str]]) -> list[list]:
    """What identifies the inputs in the cache key: path, size and modification time of each."""
    out = []
    for f, kind in files:
        st = os.stat(f)
        out.append([os.path.abspath(f), kind, st.st_size, int(st.st_mtime_ns)])
    return out


# ----------------------------------------------------------------------------- units


def plan_units(data_cfg, files: list[tuple[str, str]] | None = None) -> list[Unit]:
    """The corpus cut into units of at most `config.data.shard_docs` records (a Parquet row group
    is never split), in corpus order."""
    per = int(data_cfg.shard_docs)
    units: list[Unit] = []
    for f, kind in files if files is not None else input_files(data_cfg):
        if kind == "jsonl":
            starts = _jsonl_offsets(f, per)
            for start, offset, stop in starts:
                units.append(Unit(f, kind, start, stop, offset))
        elif kind == "parquet":
            pq = _pq()
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as e:  # pyarrow raises its own error types
                raise DataError(f"{f} is not a Parquet file pyarrow reads: {e}") from None
            start = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                units.append(Unit(f, kind, start, start + n, g))
                start += n
        else:
            n = _arrow_table(f).num_rows
            units += [Unit(f, kind, s, min(s + per, n)) for s in range(0, n, per)]
    return units


def _jsonl_offsets(f: str, per: int) -> list[tuple[int, int, int]]:
    """[(first record, its byte offset, end record)] for units of `per` non-blank lines."""
    out, count, unit_start, unit_offset, pos = [], 0, 0, 0, 0
    with open(f, "rb") as fh:
        for line in fh:
            if line.strip():
                if count - unit_start == per:
                    out.append((unit_start, unit_offset, count))
                    unit_start, unit_offset = count, pos
                count += 1
            pos += len(line)
    if count > unit_start:
        out.append((unit_start, unit_offset, count))
    return out


def _pq():
    import pyarrow.parquet as pq

    return pq


def _arrow_table(f: str):
    """A saved dataset's .arrow file (Arrow IPC stream, as datasets writes it), memory-mapped."""
    import pyarrow as pa

    try:
        source = pa.memory_map(f, "r")
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()
    except Exception as e:  # pyarrow's own error types
        raise DataError(f"{f} is not an Arrow file pyarrow reads: {e}") from None


def read_unit(unit: Unit, field: str | tuple[str, ...]) -> Iterator[tuple[Any, str]]:
    """(value of `field`, where) of every record of `unit`; `where` names the file and record. A
    tuple of fields gives each record's {field: value} dict of them."""
    fields = field if isinstance(field, tuple) else (field,)
    if unit.kind == "jsonl":
        for record, where in _read_jsonl(unit, fields):
            yield (record if isinstance(field, tuple) else record[field]), where
        return
    if unit.kind == "parquet":
        pf = _pq().ParquetFile(unit.file)
        names = pf.schema_arrow.names
        for f in fields:
            _require_column(f, names, unit.file)
        table = pf.read_row_group(unit.offset, columns=list(fields))
    else:
        table = _arrow_table(unit.file)
        for f in fields:
            _require_column(f, table.column_names, unit.file)
        table = table.select(list(fields)).slice(unit.start, unit.stop - unit.start)
    columns = [table.column(f).to_pylist() for f in fields]
    for i, values in enumerate(zip(*columns)):
        value = dict(zip(fields, values)) if isinstance(field, tuple) else values[0]
        yield value, f"{unit.file} row {unit.start + i}"


def _require_column(field: str, names: list[str], f: str) -> None:
    if field not in names:
        raise DataError(
            f"{f} has no column {field!r} (config.data.text_field / config.data.messages_field); its columns "
            f"are {names}"
        )


def _read_jsonl(unit: Unit, fields: tuple[str, ...]) -> Iterator[tuple[dict, str]]:
    with open(unit.file, "rb") as fh:
        fh.seek(unit.offset)
        record = unit.start
        for raw in fh:
            if record >= unit.stop:
                break
            if not raw.strip():
                continue
            where = f"{unit.file} record {record + 1}"
            try:
                value = json.loads(raw)
            except ValueError as e:
                raise DataError(f"{where} is not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(value, dict):
                raise DataError(f"{where} is a JSON {type(value).__name__}, not an object with a {fields[0]!r} field")
            for field in fields:
                if field not in value:
                    raise DataError(
                        f"{where} has no field {field!r} (config.data.text_field / config.data.messages_field; a "
                        f"preference record has {PREFERENCE_FIELDS}); its fields are {sorted(value)}"
                    )
            yield value, where
            record += 1


# ----------------------------------------------------------------------------- encoding


PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")  # a preference record's fields (format preference)


def field_of(data_cfg) -> str | tuple[str, ...]:
    if data_cfg.format == "preference":
        return PREFERENCE_FIELDS
    return data_cfg.messages_field if data_cfg.format == "chat" else data_cfg.text_field


def encode_text(tok, text: Any, where: str) -> np.ndarray:
    """A text document's ids: `tok.encode(text)` and the tokenizer's first EOS id."""
    if not isinstance(text, str):
        raise DataError(f"{where}: the text field holds a {type(text).__name__}, not a string")
    ids = list(tok.encode(text))
    eos = tuple(getattr(tok, "eos_ids", ()))
    if eos and (not ids or ids[-1] != eos[0]):
        ids.append(eos[0])
    return np.asarray(ids, np.int64)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_mask(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, mask) of a chat: the ids of the whole conversation rendered by the chat template, and
    1 on the tokens of each assistant turn, 0 elsewhere. An assistant turn i spans from the end of
    the rendered prompt before it (`messages[:i]` with the generation prompt) to the end of the
    conversation through it (`messages[:i + 1]`), each found as the longest common prefix of its ids
    with the whole conversation's (a token merged across the boundary counts as the prompt's)."""
    ids = list(tok.encode_chat(messages, add_generation_prompt=False))
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = _common_prefix(ids, list(tok.encode_chat(messages[:i], add_generation_prompt=True))) if i else 0
        end = _common_prefix(ids, list(tok.encode_chat(messages[: i + 1], add_generation_prompt=False)))
        for t in range(start, end):
            mask[t] = 1
    return ids, mask


def encode_chat(tok, messages: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    from jaxsys.tokenizer import TokenizerError

    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DataError(f"{where}: the messages field holds a {type(messages).__name__}, not a list of messages")
    if not messages:
        raise DataError(f"{where}: the chat has no messages")
    bad = [m for m in messages if "role" not in m or "content" not in m]
    if bad:
        raise DataError(f"{where}: a message without 'role' or 'content': {bad[0]}")
    try:
        ids, mask = assistant_mask(tok, messages)
    except TokenizerError as e:
        raise DataError(f"{where}: {e}") from None
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)


def encode_record(tok, value: Any, data_cfg, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids, assistant mask or None) of one record's document."""
    if data_cfg.format == "chat":
        return encode_chat(tok, value, where)
    return encode_text(tok, value, where), None


def record_documents(tok, value: Any, data_cfg, where: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The documents of one record: its one document, or a preference record's two (chosen, rejected)."""
    if data_cfg.format == "preference":
        return list(encode_preference(tok, value, where))
    return [encode_record(tok, value, data_cfg, where)]


def _messages(value: Any, role: str | None, what: str, where: str) -> list[dict]:
    """A prompt or completion as a list of messages: a string is one message of `role`."""
    if isinstance(value, str) and role is not None:
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise DataError(f"{where}: the {what} field holds {type(value).__name__}, not a string or a list of messages")
    bad = [m for m in value if "role" not in m or "content" not in m]
    if bad:
        raise DataError(f"{where}: a {what} message without 'role' or 'content': {bad[0]}")
    return value


def encode_preference(tok, record: dict, where: str) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(ids, mask) of a preference record's chosen and rejected documents: the prompt followed by
    the completion, the mask 1 on the completion's tokens (the DPO log-probability sums over them).

    Plain text (prompt and completions strings, the tokenizer without a chat template): the ids of
    prompt + completion and the tokenizer's EOS; the completion starts where these ids leave those
    of the prompt alone. Chat (a prompt that is a list of messages, or a tokenizer with a chat
    template): the prompt as messages (a string: one user message) and the completion as the
    assistant's message(s) (a string: one assistant message), rendered by the chat template; the
    completion starts where the conversation leaves the prompt rendered with the generation prompt
    (as `assistant_mask` finds a turn)."""
    from jaxsys.tokenizer import TokenizerError

    prompt = record["prompt"]
    chat = not isinstance(prompt, str) or bool(getattr(tok, "chat_template", None))
    out = []
    for name in ("chosen", "rejected"):
        completion = record[name]
        try:
            if chat:
                head = _messages(prompt, "user", "prompt", where)
                whole = head + _messages(completion, "assistant", name, where)
                ids = list(tok.encode_chat(whole, add_generation_prompt=False))
                start = _common_prefix(ids, list(tok.encode_chat(head, add_generation_prompt=True)))
            else:
                if not isinstance(completion, str):
                    raise DataError(
                        f"{where}: the prompt is a string, the {name} completion a {type(completion).__name__}"
                    )
                ids = list(encode_text(tok, prompt + completion, where))
                start = _common_prefix(ids, list(tok.encode(prompt)))
        except TokenizerError as e:
            raise DataError(f"{where}: {e}") from None
        if start >= len(ids) or len(ids) < 2:
            raise DataError(f"{where}: the {name} completion has no tokens after the prompt")
        mask = np.zeros(len(ids), np.uint8)
        mask[start:] = 1
        out.append((np.asarray(ids, np.int64), mask))
    return tuple(out)
