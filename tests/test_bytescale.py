"""Length-adaptive context parallelism (data/bytescale.py, docs/bytescale.md): the host plan that
places packed pieces on the devices of the seq axis, and the step on its rows.

The plan is checked against its own contract (every piece once, in its row, no overlap, short pieces
inside one chunk, long ones from a chunk boundary), its work against a brute-force count of the
visible (query, key) pairs from the rows' segment ids, and the step against an independent reference:
the same documents packed best-fit (a different layout and row order) on one device, whose loss is
the same mean over the same (document, position) targets. Tolerances as tests/test_document_masks.py
(fp32; the sums run in another order): 1e-5 relative on the loss; gradients 1e-5 relative plus
2e-5 of their leaf's largest entry.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxsys import data as data_lib
from jaxsys.config import ConfigError, validate
from jaxsys.data import bytescale, loader, packing
from jaxsys.parallel import context
from tests.helpers import assert_trees_close_leafwise, program_for, small_config


def _long_tail(n: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Piece lengths in [2, T + 1], most short, a few long (Pareto)."""
    rng = np.random.default_rng(seed)
    return np.clip((rng.pareto(1.2, n) * seq_len / 16).astype(np.int64) + 2, 2, seq_len + 1)


TABLES = {"contiguous": (4, False), "zigzag": (4, True)}


@pytest.mark.parametrize("table", TABLES)
def test_every_piece_sits_once_in_its_row_short_ones_inside_a_chunk(table):
    t = 64
    chunks = context.chunk_table(*TABLES[table])
    c = t // chunks.size
    lengths = _long_tail(120, t)
    placed = bytescale.plan(lengths, t, chunks)
    assert placed.num_rows >= -(-int(lengths.sum()) // (t + 1))
    used = np.zeros((placed.num_rows, t + 1), np.int64)
    for n, r, s in zip(lengths.tolist(), placed.row.tolist(), placed.start.tolist()):
        assert 0 <= s and s + n <= t + 1 and 0 <= r < placed.num_rows
        used[r, s : s + n] += 1
        if n <= c:  # local: one chunk, so one device
            assert s // c == (s + n - 1) // c or s + n - 1 == t
        else:  # split: from a chunk boundary
            assert s % c == 0
    assert used.max() == 1  # no two pieces overlap
    # the rows the loader keeps reproduce the placement
    rows = placed.to_plan()
    for r in range(placed.num_rows):
        members = rows.row(r)
        assert sorted(members.tolist()) == sorted(np.flatnonzero(placed.row == r).tolist())
        np.testing.assert_array_equal(rows.row_starts(r), placed.start[members])


def _segments(placed, lengths, t: int) -> np.ndarray:
    seg = np.zeros((placed.num_rows, t + 1), np.int64)
    for i, (n, r, s) in enumerate(zip(lengths.tolist(), placed.row.tolist(), placed.start.tolist())):
        seg[r, s : s + n] = i + 1
    return seg


@pytest.mark.parametrize("table", TABLES)
def test_work_counts_the_visible_pairs_and_tokens_of_each_device(table):
    t = 32
    chunks = context.chunk_table(*TABLES[table])
    lengths = _long_tail(30, t, seed=1)
    placed = bytescale.plan(lengths, t, chunks)
    seg = _segments(placed, lengths, t)[:, :t]  # the inputs
    owner = np.repeat(bytescale.owners(chunks), t // chunks.size)  # device of each position
    pairs = np.zeros((placed.num_rows, chunks.shape[0]))
    tokens = np.zeros_like(pairs)
    q, k = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    for r in range(placed.num_rows):
        visible = (seg[r][q] == seg[r][k]) & (seg[r][q] > 0) & (k <= q)
        np.add.at(pairs[r], owner, visible.sum(1))
        np.add.at(tokens[r], owner, seg[r] > 0)
    np.testing.assert_array_equal(bytescale.work(placed, lengths, t, chunks, a=0.0, b=1.0), pairs)
    np.testing.assert_array_equal(bytescale.work(placed, lengths, t, chunks, a=1.0, b=0.0), tokens)


def test_imbalance_and_traffic_of_one_row_long_piece():
    """T = 8 on 2 devices, one piece of T + 1 tokens: device 0 sees 1+2+3+4 pairs, device 1
    5+6+7+8; each device's 4 keys/values reach the other."""
    chunks = context.chunk_table(2, False)
    placed = bytescale.plan(np.array([9]), 8, chunks)
    load = bytescale.work(placed, np.array([9]), 8, chunks, a=0.0, b=1.0)
    np.testing.assert_array_equal(load, [[10, 26]])
    assert bytescale.imbalance(load) == pytest.approx(26 / 18 - 1)
    assert bytescale.kv_traffic(placed, np.array([9]), 8, chunks) == 8
    short = bytescale.plan(np.array([4, 4]), 8, chunks)  # each fits a chunk: no traffic, even work
    assert bytescale.kv_traffic(short, np.array([4, 4]), 8, chunks) == 0
    assert bytescale.imbalance(bytescale.work(short, np.array([4, 4]), 8, chunks)) == 0.0


def test_the_balancing_rule_evens_work_and_cuts_traffic_on_a_long_tail():
    """Against best-fit packing, both on the zigzag: the per-device work summed over all the rows
    (what a whole-split plan balances; per batch see experiments/bytescale) is far more even, and
    fewer keys/values need to cross devices."""
    t, chunks = 256, context.chunk_table(8, True)
    lengths = _long_tail(300, t, seed=2)
    fixed = bytescale.packed_placement(lengths, t)
    adaptive = bytescale.plan(lengths, t, chunks, min_rows=fixed.num_rows)
    load = lambda p: bytescale.work(p, lengths, t, chunks).sum(0)
    assert bytescale.imbalance(load(adaptive)) < 0.5 * bytescale.imbalance(load(fixed))
    assert bytescale.kv_traffic(adaptive, lengths, t, chunks) < bytescale.kv_traffic(fixed, lengths, t, chunks)


def test_adaptive_cp_is_refused_without_packing_or_a_seq_axis():
    c = small_config({"seq": 2, "data": 4})
    c.data.source, c.data.adaptive_cp = "jsonl", True
    with pytest.raises(ConfigError, match="adaptive_cp=True.*packing=True"):
        validate(c)
    c = small_config({"data": 8})
    c.data.source, c.data.packing, c.data.adaptive_cp = "jsonl", True, True
    with pytest.raises(ConfigError, match="mesh.seq=1"):
        validate(c)


# ------------------------------------------------------------------------------------------ the step


def _batch(placement, lengths, docs, t: int, rows: int):
    """data.Batch numpy arrays of `rows` rows (empty rows after the placement's)."""
    pieces = packing.Pieces(np.arange(len(lengths)), np.zeros(len(lengths), np.int64), np.asarray(lengths))
    members, starts = placement.rows()
    tokens, segments, weights = packing.assemble(members, pieces, lambda d: (docs[d], None), t, starts)
    pad = rows - tokens.shape[0]
    assert pad >= 0
    grow = lambda a: np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    return data_lib.Batch(grow(tokens), grow(segments), grow(weights))


def _program(mesh, **model):
    c = small_config(mesh, **model)
    c.data.source, c.data.packing = "jsonl", True
    return program_for(c)


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_adaptive_rows_give_the_single_device_loss_and_gradients(zigzag):
    """seq=4 x data=2, ring: the plan's rows give the loss and gradients of the same documents
    packed best-fit on one device."""
    t, rows = 32, 8
    lengths = _long_tail(18, t, seed=3)
    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 256, n).astype(np.int32) for n in lengths.tolist()]
    chunks = context.chunk_table(4, zigzag)
    adaptive = bytescale.plan(lengths, t, chunks, min_rows=rows)
    assert adaptive.num_rows == rows
    assert bytescale.kv_traffic(adaptive, lengths, t, chunks) > 0  # some documents are split
    one = _program({})
    params = jax.tree.map(np.asarray, one.init().params)
    want = _batch(bytescale.packed_placement(lengths, t), lengths, docs, t, rows)
    want_loss, want_grads = one.loss_and_grads_fn()(params, jax.device_put(want, one.batch_sharding))
    program = _program({"seq": 4, "data": 2}, context_load_balance=zigzag)
    batch = _batch(adaptive, lengths, docs, t, rows)
    loss, grads = program.loss_and_grads_fn()(params, jax.device_put(batch, program.batch_sharding))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    grads, want_grads = jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, want_grads)
    assert_trees_close_leafwise(grads, want_grads, rtol=1e-5, atol=lambda w: 2e-5 * np.abs(w).max())
    # the check can fail: the same rows with one segment a row (documents see the ones before them)
    merged = batch._replace(segments=(batch.segments > 0).astype(np.int32))
    _, unmasked = program.loss_and_grads_fn()(params, jax.device_put(merged, program.batch_sharding))
    gaps = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max() / np.abs(b).max()), unmasked, want_grads)
    assert max(jax.tree.leaves(gaps)) > 1e-3


def test_the_loader_lays_rows_out_by_the_plan():
    """loader.split_documents with a chunk table keeps the plan's rows and positions: each piece's
    tokens sit where the plan put them, with its own segment id."""
    from tests.test_packing import _Data, _Store

    rng = np.random.default_rng(5)
    t, chunks = 32, context.chunk_table(4, True)
    store = _Store(_long_tail(40, t, seed=5), rng)
    cfg = _Data(seq_len=t, eval_fraction=0.0, format="text", packing=True, source="jsonl", tokenizer="bytes")
    corpus = loader.split_documents(store, cfg, chunks)
    split = corpus.splits["train"]
    placed = bytescale.plan(split.pieces.length, t, chunks)
    assert split.num_rows == placed.num_rows
    tokens, segments, _ = corpus.rows(seed=0, step=0, batch_size=4, split="train", rows=range(4))
    for i, r in enumerate(corpus.row_ids(0, 0, 4, "train", range(4))):
        for p in np.flatnonzero(placed.row == r).tolist():
            s, n = int(placed.start[p]), int(split.pieces.length[p])
            doc, a = int(split.pieces.doc[p]), int(split.pieces.start[p])
            np.testing.assert_array_equal(tokens[i, s : s + n], store.docs[doc][a : a + n])
            assert len(set(segments[i, s : s + n].tolist())) == 1 and segments[i, s] > 0
