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


@pytest.mark.parametrize("table", TABLES)
def test_the_plan_places_local_pieces_where_the_device_keeps_its_local_region(table):
    """The host plan's regions are the device's (`context.row_regions`, which `shard_sequence`
    follows): every position's device agrees, and a piece in a local region lies inside one
    device's region."""
    size, zigzag = TABLES[table]
    t, chunks = 64, context.chunk_table(size, zigzag)
    n_local = context.region_sizes(t, size, zigzag, 0.25)[0]  # 4 of each device's 16
    regions = context.row_regions(t, size, zigzag, 0.25)
    assert sorted(regions.reshape(-1).tolist()) == list(range(t))
    where = bytescale._layout(t, chunks, n_local).position_device
    for d in range(size):
        assert (where[regions[d]] == d).all()
    lengths = np.clip(_long_tail(80, t, seed=6), 2, t - size * n_local + 1)
    placed = bytescale.plan(lengths, t, chunks, local=n_local)
    for n, s in zip(lengths.tolist(), placed.start.tolist()):
        if s < size * n_local:
            assert n <= n_local and s // n_local == (s + n - 1) // n_local
        else:
            assert s + n <= t + 1
    assert (placed.start < size * n_local).any()


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


@pytest.mark.parametrize(
    "local,adaptive,zigzag,match",
    [
        (1.0, True, False, r"adaptive_cp_local=1.0: .*\[0, 1\)"),
        (0.25, False, False, "adaptive_cp_local=0.25 needs config.data.adaptive_cp=True"),
        (0.3, True, False, "adaptive_cp_local=0.3 with config.data.seq_len=32: .*must be whole"),
        (0.875, True, True, "adaptive_cp_local=0.875 with config.data.seq_len=32: .*multiple of 2"),
    ],
)
def test_local_regions_are_refused_when_they_do_not_cut_the_row(local, adaptive, zigzag, match):
    """seq=4, T=32: 8 tokens a device. 0.875 leaves 1 ring token, which the zigzag cannot halve."""
    c = small_config({"seq": 4, "data": 2}, context_load_balance=zigzag)
    c.data.source, c.data.packing = "jsonl", True
    c.data.adaptive_cp, c.data.adaptive_cp_local = adaptive, local
    with pytest.raises(ConfigError, match=match):
        validate(c)
    c.data.adaptive_cp, c.data.adaptive_cp_local = True, 0.5
    validate(c)
    with pytest.raises(ValueError, match="does not fit a ring region of 17"):  # the plan: pieces fit the ring region
        bytescale.plan(np.array([18]), 32, context.chunk_table(4, zigzag), local=4)


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


T, ROWS, LOCAL = 32, 8, 0.5  # seq=4: 8 tokens a device, 4 of them local (16 a row), a ring region of 16


def _program(mesh, zigzag: bool, local: float | None = None, variant: str = "ring"):
    """The program and its loss-and-gradients function (one jit: each loss_and_grads_fn() call
    makes a new one, which would compile again)."""
    c = small_config(mesh, context_load_balance=zigzag, context_parallel=variant)
    c.data.source, c.data.packing = "jsonl", True
    if local is not None:
        c.data.adaptive_cp, c.data.adaptive_cp_local = True, local
    program = program_for(c)
    return program, program.loss_and_grads_fn()


@pytest.fixture(scope="module")
def documents():
    """Short documents (2-4 tokens: a local region's 4 holds them) and long ones (up to the ring
    region + 1 = 17 tokens), and the single-device loss and gradients of them packed best-fit."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(2, 5, 24), rng.integers(9, 18, 7)])
    docs = [rng.integers(1, 256, n).astype(np.int32) for n in lengths.tolist()]
    one, loss_and_grads = _program({}, False)
    params = jax.tree.map(np.asarray, one.init().params)
    want = _batch(bytescale.packed_placement(lengths, T), lengths, docs, T, ROWS)
    loss, grads = loss_and_grads(params, jax.device_put(want, one.batch_sharding))
    return lengths, docs, params, want, float(loss), jax.tree.map(np.asarray, grads)


def _close_to_one_device(program, batch, documents):
    (program, loss_and_grads), (*_, params, _, want_loss, want_grads) = program, documents
    loss, grads = loss_and_grads(params, jax.device_put(batch, program.batch_sharding))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    grads = jax.tree.map(np.asarray, grads)
    assert_trees_close_leafwise(grads, want_grads, rtol=1e-5, atol=lambda w: 2e-5 * np.abs(w).max())


def _far_from_one_device(program, batch, documents):
    (program, loss_and_grads), (*_, params, _, _, want_grads) = program, documents
    _, grads = loss_and_grads(params, jax.device_put(batch, program.batch_sharding))
    gaps = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max() / np.abs(b).max()), grads, want_grads)
    assert max(jax.tree.leaves(gaps)) > 1e-3


@pytest.fixture(scope="module")
def fixed_programs():
    """seq=4 x data=2, the whole row on the ring, contiguous and zigzag."""
    return {z: _program({"seq": 4, "data": 2}, z) for z in (False, True)}


@pytest.fixture(scope="module")
def split_programs():
    """The same with local regions of LOCAL of each device's tokens."""
    return {z: _program({"seq": 4, "data": 2}, z, LOCAL) for z in (False, True)}


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_adaptive_rows_give_the_single_device_loss_and_gradients(zigzag, documents, fixed_programs):
    """seq=4 x data=2, ring, the whole row on the ring (adaptive_cp_local=0): the plan's rows give
    the loss and gradients of the same documents packed best-fit on one device; with one segment a
    row (documents see the ones before them) they do not."""
    lengths, docs = documents[:2]
    chunks = context.chunk_table(4, zigzag)
    adaptive = bytescale.plan(lengths, T, chunks, min_rows=ROWS)
    assert adaptive.num_rows == ROWS
    assert bytescale.kv_traffic(adaptive, lengths, T, chunks) > 0  # some documents are split
    batch = _batch(adaptive, lengths, docs, T, ROWS)
    _close_to_one_device(fixed_programs[zigzag], batch, documents)
    merged = batch._replace(segments=(batch.segments > 0).astype(np.int32))
    _far_from_one_device(fixed_programs[zigzag], merged, documents)


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_local_regions_give_the_single_device_loss_and_gradients(zigzag, documents, split_programs):
    """adaptive_cp_local=0.5 on seq=4 x data=2, ring: each device's first 4 tokens are attended
    with no communication and only the ring region's K/V travel. The plan's rows (short documents
    in the local regions, long ones over the ring region) give the single-device loss and
    gradients; best-fit rows, whose documents cross from one region into another (or from one
    device's local region into the next's), do not, nor do the plan's rows with one segment a row."""
    lengths, docs = documents[:2]
    chunks = context.chunk_table(4, zigzag)
    n_local, _ = context.region_sizes(T, 4, zigzag, LOCAL)
    placed = bytescale.plan(lengths, T, chunks, min_rows=ROWS, local=n_local)
    assert placed.num_rows == ROWS
    in_local = placed.start < 4 * n_local
    assert in_local.sum() >= 8 and (lengths[~in_local] > 4).any()  # both regions hold documents
    assert bytescale.kv_traffic(placed, lengths, T, chunks, local=n_local) > 0  # some documents are split
    program, batch = split_programs[zigzag], _batch(placed, lengths, docs, T, ROWS)
    _close_to_one_device(program, batch, documents)
    _far_from_one_device(program, documents[3], documents)
    _far_from_one_device(program, batch._replace(segments=(batch.segments > 0).astype(np.int32)), documents)


def test_local_regions_with_the_all_gather_variant(documents):
    """The split is the variant's business only on the ring region: all-gather CP (contiguous)
    with local regions gives the single-device loss and gradients too."""
    lengths, docs = documents[:2]
    n_local, _ = context.region_sizes(T, 4, False, LOCAL)
    placed = bytescale.plan(lengths, T, context.chunk_table(4, False), min_rows=ROWS, local=n_local)
    program = _program({"seq": 4, "data": 2}, False, LOCAL, variant="allgather")
    _close_to_one_device(program, _batch(placed, lengths, docs, T, ROWS), documents)


def _seq_bytes(program) -> dict:
    """{kind: (count, bytes)} of the step's collectives over `seq` alone (lowered, layers unrolled)."""
    from jaxsys.analysis import collectives, report

    sizes = dict(program.layout.mesh_sizes)
    out: dict = {}
    for c in collectives.parse(report.lower_unrolled(program).as_text(), sizes):
        if c.axes == ("seq",):
            n, b = out.get(c.kind, (0, 0))
            out[c.kind] = (n + 1, b + c.operand_bytes)
    return out


def test_local_regions_cut_the_seq_collective_bytes_by_the_ring_share(fixed_programs, split_programs):
    """The split program's seq collectives are fixed CP's, each carrying the ring region's
    T/P - L tokens instead of T/P (K, V, dK, dV and the segment ids alike): bytes x (1 - local),
    counts unchanged; cost_model.context_parallel_rows says the same."""
    from jaxsys.analysis import cost_model

    fixed, split = fixed_programs[False][0], split_programs[False][0]
    want, got = _seq_bytes(fixed), _seq_bytes(split)
    assert set(got) == set(want) and "collective_permute" in got
    for kind, (count, size) in want.items():
        assert got[kind] == (count, size * (1 - LOCAL)), kind
    rows = lambda p: {r.kind: r.bytes for r in cost_model.context_parallel_rows(p.config)}
    assert rows(split) == {k: b * (1 - LOCAL) for k, b in rows(fixed).items()}


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
