"""Rows of T + 1 tokens from documents: one document a row (padded) or several (packed), with the
segment ids and loss weights the objective reads.

Dimension letters: B rows, T sequence length (a row holds T + 1 tokens: inputs [:-1], targets [1:]).

A document of L tokens becomes pieces of at most T + 1 tokens (`pieces`): a text document is cut
every T tokens, each piece starting on the last token of the one before so that no target is lost;
a chat is cut to its first T + 1 tokens (a later piece would hold answers without their question).
Pieces of fewer than 2 tokens hold no target and are dropped.

A plan puts pieces in rows (`Plan`: `row_ptr` [R + 1] and `members` [P], the pieces of row r being
members[row_ptr[r]:row_ptr[r + 1]]). `padded_plan`: one piece a row. `packed_plan`: best-fit
decreasing (the longest piece first, each into the fullest row it still fits), which on a
long-tailed length distribution leaves far fewer padding tokens than one document a row.

A row (`assemble`): tokens [T + 1] int32 (0 after the last piece), segments [T + 1] int32 (1, 2, ...
for the row's pieces in order, 0 on padding) and weights [T] float32, the weight of the target at
t + 1 given the input at t:

    weights[t] = (segments[t + 1] > 0) and (segments[t] == segments[t + 1]) and mask[t + 1]

that is 0 for a padding target, a target in another document than its input (a piece's first token),
and, for chats, a token that is not the assistant's (mask 0). The objective sums the per-token losses
times these weights and divides by the global batch's weight sum.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Where each piece comes from: document, first token, length."""

    doc: np.ndarray  # [P] int64
    start: np.ndarray  # [P] int64
    length: np.ndarray  # [P] int64

    def __len__(self) -> int:
        return int(self.doc.shape[0])


def pieces(doc_len: np.ndarray, seq_len: int, split_long: bool = True, docs: np.ndarray | None = None) -> Pieces:
    """The pieces of documents with lengths `doc_len` (ids `docs`, default 0..N-1), in order."""
    doc_len = np.asarray(doc_len, np.int64)
    docs = np.arange(doc_len.shape[0], dtype=np.int64) if docs is None else np.asarray(docs, np.int64)
    keep = doc_len >= 2
    doc_len, docs = doc_len[keep], docs[keep]
    if not split_long:
        return Pieces(docs, np.zeros_like(docs), np.minimum(doc_len, seq_len + 1))
    counts = -(-(doc_len - 1) // seq_len)  # ceil((L - 1) / T): pieces starting at 0, T, 2T, ...
    doc = np.repeat(docs, counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(doc.shape[0], dtype=np.int64) - first) * seq_len
    length = np.minimum(seq_len + 1, np.repeat(doc_len, counts) - start)
    return Pieces(doc, start, length)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rows of pieces: row r holds pieces members[row_ptr[r]:row_ptr[r + 1]], in that order."""

    row_ptr: np.ndarray  # [R + 1] int64
    members: np.ndarray  # [P] int64
    starts: np.ndarray | None = None  # [P] int64: each member's first position (None: one after the other)

    @property
    def num_rows(self) -> int:
        return int(self.row_ptr.shape[0] - 1)

    def row(self, r: int) -> np.ndarray:
        return self.members[self.row_ptr[r] : self.row_ptr[r + 1]]

    def row_starts(self, r: int) -> np.ndarray | None:
        return None if self.starts is None else self.starts[self.row_ptr[r] : self.row_ptr[r + 1]]


def padded_plan(num_pieces: int) -> Plan:
    return Plan(np.arange(num_pieces + 1, dtype=np.int64), np.arange(num_pieces, dtype=np.int64))


def packed_plan(length: np.ndarray, capacity: int) -> Plan:
    """Best-fit decreasing: pieces from the longest (ties in index order), each into the row with
    the least room that still holds it, else a new row. Rows are numbered as they open; a row's
    pieces keep their index order."""
    length = np.asarray(length, np.int64)
    if length.size and int(length.max()) > capacity:
        raise ValueError(f"a piece of {int(length.max())} tokens does not fit a row of {capacity}")
    order = np.argsort(-length, kind="stable")
    room: dict[int, list[int]] = {}  # free tokens -> rows with exactly that much room
    frees: list[int] = []  # the keys of `room`, sorted
    row_of = np.empty(length.shape[0], np.int64)
    rows = 0
    for p in order.tolist():
        n = int(length[p])
        i = bisect.bisect_left(frees, n)
        if i < len(frees):
            free = frees[i]
            r = room[free].pop()
            if not room[free]:
                del room[free]
                frees.pop(i)
        else:
            free, r = capacity, rows
            rows += 1
        row_of[p] = r
        left = free - n
        if left >= 2:  # a piece needs 2 tokens
            if left not in room:
                room[left] = []
                bisect.insort(frees, left)
            room[left].append(r)
    members = np.lexsort((np.arange(length.shape[0]), row_of))  # by row, then piece index
    counts = np.bincount(row_of, minlength=rows)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Plan(row_ptr, members.astype(np.int64))


def row_fill(plan: Plan, pieces_: Pieces) -> np.ndarray:
    """[R] tokens of each row that are not padding."""
    return np.add.reduceat(pieces_.length[plan.members], plan.row_ptr[:-1]) if plan.num_rows else np.zeros(0)


def weights_of(segments: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[..., T] loss weights of rows with `segments` and per-token `mask` [..., T + 1] (see module)."""
    seg_in, seg_out = segments[..., :-1], segments[..., 1:]
    return ((seg_out > 0) & (seg_in == seg_out) & (mask[..., 1:] > 0)).astype(np.float32)


Fetch = Callable[[int], tuple[np.ndarray, "np.ndarray | None"]]  # document -> (ids, mask or None)


def assemble(
    rows: list[np.ndarray], pieces_: Pieces, fetch: Fetch, seq_len: int, starts: list[np.ndarray] | None = None
):
    """(tokens [n, T + 1] int32, segments [n, T + 1] int32, weights [n, T] float32) of rows given as
    arrays of piece indices; `fetch(doc)` gives a document's ids and mask (None: every token counts).
    `starts` (per row, each piece's first position, increasing): where the pieces sit; by default
    one after the other from 0 (data/bytescale.py leaves gaps of padding between them)."""
    n, width = len(rows), seq_len + 1
    tokens = np.zeros((n, width), np.int32)
    segments = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.uint8)
    for i, members in enumerate(rows):
        pos = 0
        for k, p in enumerate(members.tolist()):
            ids, m = fetch(int(pieces_.doc[p]))
            a, length = int(pieces_.start[p]), int(pieces_.length[p])
            if starts is not None:
                assert int(starts[i][k]) >= pos, "pieces overlap"
                pos = int(starts[i][k])
            tokens[i, pos : pos + length] = ids[a : a + length]
            mask[i, pos : pos + length] = 1 if m is None else m[a : a + length]
            segments[i, pos : pos + length] = k + 1
            pos += length
    return tokens, segments, weights_of(segments, mask)
