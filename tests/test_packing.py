"""Sequence packing, the data side: pieces, best-fit-decreasing rows, segment ids and loss weights
on a hand-built example, and fewer padding tokens per step than one document a row on a
long-tailed length distribution."""

from __future__ import annotations

import numpy as np

from jaxsys.data import loader, packing


def test_pieces_cut_long_text_without_losing_a_target_and_chats_are_truncated():
    p = packing.pieces(np.array([5, 1, 16, 8]), seq_len=7)
    # doc 1 (1 token) has no target; doc 2 (16 tokens): pieces at 0 and 7 (len 8) and 14 (len 2)
    assert p.doc.tolist() == [0, 2, 2, 2, 3]
    assert p.start.tolist() == [0, 0, 7, 14, 0]
    assert p.length.tolist() == [5, 8, 8, 2, 8]
    # every target of doc 2 (positions 1..15) is a non-first token of exactly one piece
    targets = sorted(t for s, n in zip(p.start[1:4], p.length[1:4]) for t in range(s + 1, s + n))
    assert targets == list(range(1, 16))
    chat = packing.pieces(np.array([5, 16]), seq_len=7, split_long=False)
    assert chat.start.tolist() == [0, 0] and chat.length.tolist() == [5, 8]


def test_hand_built_rows_segments_and_weights():
    """Documents of 5, 3, 4, 2 and 9 tokens, T = 7 (rows of 8): best-fit decreasing fills all
    three rows exactly (8 | 5 + 3 | 4 + 2 + 2)."""
    lengths = np.array([5, 3, 4, 2, 9])
    docs = {d: np.arange(100 * d, 100 * d + n) for d, n in enumerate(lengths)}
    masks = {d: None for d in docs}
    fetch = lambda d: (docs[d], masks[d])
    p = packing.pieces(lengths, seq_len=7)  # doc 4 -> pieces (0, 8) and (7, 2)
    assert p.length.tolist() == [5, 3, 4, 2, 8, 2]
    plan = packing.packed_plan(p.length, capacity=8)
    assert [plan.row(r).tolist() for r in range(plan.num_rows)] == [[4], [0, 1], [2, 3, 5]]
    assert packing.row_fill(plan, p).tolist() == [8, 8, 8]
    tokens, segments, weights = packing.assemble([plan.row(r) for r in range(3)], p, fetch, seq_len=7)
    assert tokens.tolist() == [
        [400, 401, 402, 403, 404, 405, 406, 407],
        [0, 1, 2, 3, 4, 100, 101, 102],
        [200, 201, 202, 203, 300, 301, 407, 408],
    ]
    assert segments.tolist() == [[1] * 8, [1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 3, 3]]
    # weight of target t+1 given input t: 0 where the target starts another document
    assert weights.tolist() == [[1] * 7, [1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 1, 0, 1]]
    assert weights.dtype == np.float32 and tokens.dtype == segments.dtype == np.int32

    # one document a row: padding after it, weight 0 on every padding target
    padded = packing.padded_plan(len(p))
    tokens, segments, weights = packing.assemble([padded.row(3)], p, fetch, seq_len=7)  # doc 3: 2 tokens
    assert tokens.tolist() == [[300, 301, 0, 0, 0, 0, 0, 0]]
    assert segments.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]
    assert weights.tolist() == [[1, 0, 0, 0, 0, 0, 0]]

    # a chat's mask: only the assistant's targets count (here tokens 2..3 of doc 0)
    masks[0] = np.array([0, 0, 1, 1, 0], np.uint8)
    _, _, weights = packing.assemble([plan.row(1)], p, fetch, seq_len=7)
    assert weights.tolist() == [[0, 1, 1, 0, 0, 1, 1]]


class _Store:
    """The part of shards.Store that loader.split_documents reads, over arrays in memory."""

    def __init__(self, lengths, rng):
        self.doc_len = np.asarray(lengths, np.int64)
        self.docs = [rng.integers(1, 200, size=n) for n in lengths]
        self.directory = "memory"
        self.manifest = {"docs": len(lengths), "tokens": int(self.doc_len.sum()), "vocab_needed": 200}

    @property
    def num_docs(self):
        return len(self.docs)

    def document(self, i):
        return self.docs[i], None


class _Data(dict):
    __getattr__ = dict.__getitem__


def _corpus(store, packed: bool, seq_len: int):
    cfg = _Data(seq_len=seq_len, eval_fraction=0.0, format="text", packing=packed, source="jsonl", tokenizer="bytes")
    return loader.split_documents(store, cfg)


def test_packing_fills_rows_and_pads_far_less_than_one_document_a_row():
    """Lognormal document lengths (median ~20 tokens, a long tail past T = 128): the padding
    tokens per step of packed batches against padded ones, over the same steps."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.lognormal(3.0, 1.0, size=3000).astype(int))
    store = _Store(lengths, rng)
    T, B, steps = 128, 16, 20
    padding = {}
    for packed in (False, True):
        corpus = _corpus(store, packed, T)
        split = corpus.splits["train"]
        per_step = []
        for step in range(steps):
            tokens, segments, weights = corpus.rows(seed=0, step=step, batch_size=B, split="train", rows=range(B))
            per_step.append(int((segments == 0).sum()))
            assert (tokens[segments == 0] == 0).all()
            # weights: a target counts iff it is a token of the same document as its input
            same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
            np.testing.assert_array_equal(weights, same.astype(np.float32))
        padding[packed] = np.mean(per_step)
        if packed:
            fill = packing.row_fill(split.plan, split.pieces)
            # filled: all rows but a handful (the last ones opened) have no room for the shortest piece
            assert (fill > T + 1 - 2).mean() > 0.95
            lower_bound = int(np.ceil(split.pieces.length.sum() / (T + 1)))
            assert split.num_rows <= lower_bound + 2
            # every piece is in exactly one row
            assert sorted(split.plan.members.tolist()) == list(range(len(split.pieces)))
    assert padding[True] < 0.05 * padding[False], padding
    assert padding[False] > 0.5 * B * (T + 1)  # most of a padded row is padding here
