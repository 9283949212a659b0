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
# seq=4, T=32: each device's 8 tokens are 2 local, 2 in a ring within its group of 2 (ranks {0, 1}
# and {2, 3}: two group regions of 4 positions), 4 on the full ring (16 positions, documents <= 17).
TIER_LOCAL, TIER_GROUPS = 0.25, "2:0.25"


def _program(mesh, zigzag: bool, local: float | None = None, variant: str = "ring", groups: str = ""):
    """The program and its loss-and-gradients function (one jit: each loss_and_grads_fn() call
    makes a new one, which would compile again)."""
    c = small_config(mesh, context_load_balance=zigzag, context_parallel=variant)
    c.data.source, c.data.packing = "jsonl", True
    if local is not None:
        c.data.adaptive_cp, c.data.adaptive_cp_local, c.data.adaptive_cp_groups = True, local, groups
    program = program_for(c)
    return program, program.loss_and_grads_fn()


@pytest.fixture(scope="module")
def one_device():
    return _program({}, False)


@pytest.fixture(scope="module")
def documents(one_device):
    """Short documents (2-4 tokens: a local region's 4 holds them) and long ones (up to the ring
    region + 1 = 17 tokens), and the single-device loss and gradients of them packed best-fit."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(2, 5, 24), rng.integers(9, 18, 7)])
    docs = [rng.integers(1, 256, n).astype(np.int32) for n in lengths.tolist()]
    one, loss_and_grads = one_device
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


@pytest.mark.parametrize("tiers", [(0.0, ""), (TIER_LOCAL, TIER_GROUPS)], ids=["ring", "tiers"])
def test_the_loader_lays_rows_out_by_the_plan(tiers):
    """loader.split_documents with a chunk table keeps the plan's rows and positions: each piece's
    tokens sit where the plan put them, with its own segment id; with tiers, documents are cut to
    the full ring region (16 + 1 tokens)."""
    from tests.test_packing import _Data, _Store

    rng = np.random.default_rng(5)
    t, chunks = 32, context.chunk_table(4, True)
    store = _Store(np.append(_long_tail(40, t, seed=5), 40), rng)  # one document longer than a row
    cfg = _Data(seq_len=t, eval_fraction=0.0, format="text", packing=True, source="jsonl", tokenizer="bytes")
    cfg.update(adaptive_cp_local=tiers[0], adaptive_cp_groups=tiers[1])
    corpus = loader.split_documents(store, cfg, chunks)
    split = corpus.splits["train"]
    local, groups = _tier_tokens(True, local=tiers[0], groups=tiers[1])
    assert int(split.pieces.length.max()) == (t if not groups else 16) + 1
    placed = bytescale.plan(split.pieces.length, t, chunks, local=local, groups=groups)
    assert split.num_rows == placed.num_rows
    tokens, segments, _ = corpus.rows(seed=0, step=0, batch_size=4, split="train", rows=range(4))
    for i, r in enumerate(corpus.row_ids(0, 0, 4, "train", range(4))):
        for p in np.flatnonzero(placed.row == r).tolist():
            s, n = int(placed.start[p]), int(split.pieces.length[p])
            doc, a = int(split.pieces.doc[p]), int(split.pieces.start[p])
            np.testing.assert_array_equal(tokens[i, s : s + n], store.docs[doc][a : a + n])
            assert len(set(segments[i, s : s + n].tolist())) == 1 and segments[i, s] > 0


# ------------------------------------------------------------------- layout buckets, chosen per batch


def _short_heavy(n_short: int, n_long: int, seed: int) -> np.ndarray:
    """Documents of 2-4 tokens (they fit a local region of 4) and of 9-17 (the ring region's)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(2, 5, n_short), rng.integers(9, 18, n_long)])


def test_batches_hold_every_piece_once_each_batch_in_one_layout():
    """plan_batches over seq=4 (T=32) with buckets of 0 and 4 local tokens a device, B=8 on 2 data
    shards: the batches partition the rows, every piece sits once in its row with no overlap,
    a batch of the local bucket keeps its local pieces inside one device's region, and the bucket
    count follows the supply of short tokens: a short-heavy mix runs local batches, a mix of long
    documents none."""
    t, b, chunks = T, ROWS, context.chunk_table(4, False)
    n_local = context.region_sizes(t, 4, False, LOCAL)[0]
    doc_len = _short_heavy(150, 25, seed=8)
    planned = bytescale.plan_batches(doc_len, t, chunks, (0, n_local), b, 2)
    placed, lengths = planned.placement, planned.pieces.length
    covered = np.zeros(doc_len.shape[0], np.int64)  # each document's tokens, less one a cut
    np.add.at(covered, planned.pieces.doc, lengths)
    cuts = np.bincount(planned.pieces.doc, minlength=doc_len.shape[0]) - 1
    np.testing.assert_array_equal(covered - cuts, doc_len)
    assert planned.batches.shape[1] == b
    assert sorted(planned.batches.reshape(-1).tolist()) == list(range(placed.num_rows))
    used = np.zeros((placed.num_rows, t + 1), np.int64)
    for n, r, s in zip(lengths.tolist(), placed.row.tolist(), placed.start.tolist()):
        used[r, s : s + n] += 1
    assert used.max() == 1
    batch_of = np.empty(placed.num_rows, np.int64)
    batch_of[planned.batches.reshape(-1)] = np.repeat(np.arange(planned.batches.shape[0]), b)
    local_bucket = planned.bucket[batch_of[placed.row]] == 1
    in_local = local_bucket & (placed.start < 4 * n_local)
    assert in_local.sum() >= 30  # the local batches hold short documents in their local regions
    s, n = placed.start[in_local], lengths[in_local]
    assert ((s // n_local) == ((s + n - 1) // n_local)).all()  # whole, inside one device's region
    assert (planned.bucket == 1).sum() >= 1 and (planned.bucket == 0).sum() >= 1
    # short tokens per batch: the local bucket's batches carry more of them than the others
    short = lengths <= n_local
    share = [lengths[short & (batch_of[placed.row] == i)].sum() for i in range(planned.batches.shape[0])]
    assert min(np.asarray(share)[planned.bucket == 1]) > max(np.asarray(share)[planned.bucket == 0])
    long_only = bytescale.plan_batches(np.full(40, 15), t, chunks, (0, n_local), b, 2)
    assert (long_only.bucket == 0).all()


@pytest.fixture(scope="module")
def bucket_batches():
    """A short-heavy mix planned in batches of ROWS for buckets (0, LOCAL) on seq=4 x data=2."""
    doc_len = _short_heavy(50, 15, seed=9)
    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 256, n).astype(np.int32) for n in doc_len.tolist()]
    n_local = context.region_sizes(T, 4, False, LOCAL)[0]
    planned = bytescale.plan_batches(doc_len, T, context.chunk_table(4, False), (0, n_local), ROWS, 2)
    pieces, rows = planned.pieces, planned.placement.to_plan()
    batches = []
    for ids in planned.batches:
        members = [rows.row(r) for r in ids]
        starts = [rows.row_starts(r) for r in ids]
        batches.append(data_lib.Batch(*packing.assemble(members, pieces, lambda d: (docs[d], None), T, starts)))
    return planned.bucket, batches


def test_each_layout_bucket_runs_its_batches_with_the_single_device_loss(
    bucket_batches, one_device, fixed_programs, split_programs
):
    """Every planned batch on its bucket's program (local 0: the ring over the whole row; local
    LOCAL: local regions) gives the loss and gradients of the same rows on one device. The
    dispatch matters: a batch of the whole-ring bucket, whose long documents cross the local
    regions' boundaries, is wrong on the local-region program."""
    buckets, batches = bucket_batches
    assert set(buckets.tolist()) == {0, 1}
    one, one_loss_and_grads = one_device
    params = jax.tree.map(np.asarray, one.init().params)
    programs = (fixed_programs[False], split_programs[False])
    for bucket, batch in zip(buckets.tolist(), batches):
        loss, grads = one_loss_and_grads(params, jax.device_put(batch, one.batch_sharding))
        reference = (None, None, params, None, float(loss), jax.tree.map(np.asarray, grads))
        _close_to_one_device(programs[bucket], batch, reference)
    whole_ring = batches[buckets.tolist().index(0)]
    loss, grads = one_loss_and_grads(params, jax.device_put(whole_ring, one.batch_sharding))
    _far_from_one_device(programs[1], whole_ring, (None, None, params, None, None, jax.tree.map(np.asarray, grads)))


def test_training_runs_each_batch_on_its_layouts_program(tmp_path, monkeypatch, one_device):
    """train.main with config.data.adaptive_cp_buckets='0,0.5' on seq=4 x data=2: the loader plans
    whole batches, each step runs the compiled program of its batch's bucket (both run), and each
    step's loss is the one-device loss of its batch at the parameters that step started from."""
    import json

    from jaxsys import train

    rng = np.random.default_rng(4)
    with open(tmp_path / "docs.jsonl", "w") as f:  # bytes tokenizer: one token a character
        for n in np.concatenate([rng.integers(2, 5, 60), rng.integers(10, 30, 12)]).tolist():
            f.write(json.dumps({"text": "".join(chr(97 + int(c)) for c in rng.integers(0, 26, n))}) + "\n")
    c = small_config({"seq": 4, "data": 2})
    c.data.source, c.data.path, c.data.cache_dir = "jsonl", str(tmp_path / "docs.jsonl"), str(tmp_path / "cache")
    c.data.tokenize_workers, c.data.packing, c.data.eval_fraction = 1, True, 0.0
    c.data.adaptive_cp, c.data.adaptive_cp_buckets = True, "0,0.5"
    c.checkpoint.enabled = False
    corpus = loader.load_corpus(c.data, chunks=train.adaptive_chunks(c), batch=train.adaptive_batch(c))
    split = corpus.splits["train"]
    assert set(split.bucket.tolist()) == {0, 1}, split.bucket
    c.train.steps = split.bucket.shape[0]  # one epoch: every batch once

    one, one_loss = one_device
    ran: list[tuple[int, float]] = []  # (bucket run, one-device loss of the step's batch at its parameters)
    real = train._bucket_steps

    def step_of(bucket, compiled):
        def step(state, batch, *args):
            params = jax.tree.map(np.asarray, state.params)
            on_one = jax.device_put(jax.tree.map(np.asarray, batch), one.batch_sharding)
            ran.append((bucket, float(one_loss(params, on_one)[0])))
            return compiled(state, batch, *args)

        return step

    monkeypatch.setattr(train, "_bucket_steps", lambda *a: [step_of(i, f) for i, f in enumerate(real(*a))])
    got = [r["loss"] for r in train.main(c, str(tmp_path / "run"))]
    assert [b for b, _ in ran] == [corpus.bucket(c.seed, s) for s in range(c.train.steps)]
    np.testing.assert_allclose(got, [loss for _, loss in ran], rtol=1e-5)


@pytest.mark.parametrize(
    "buckets,local,adaptive,match",
    [
        ("0.5", 0.0, True, "two or more distinct local shares"),
        ("0,x", 0.0, True, "two or more distinct local shares"),
        ("0,0.5", 0.0, False, "needs config.data.adaptive_cp=True"),
        ("0.25,0.5", 0.0, True, "must include config.data.adaptive_cp_local=0.0"),
        ("0,0.3", 0.0, True, "with config.data.seq_len=32: .*must be whole"),
    ],
)
def test_layout_buckets_are_refused_when_they_cannot_run(buckets, local, adaptive, match):
    c = small_config({"seq": 4, "data": 2})
    c.data.source, c.data.packing = "jsonl", True
    c.data.adaptive_cp, c.data.adaptive_cp_local, c.data.adaptive_cp_buckets = adaptive, local, buckets
    with pytest.raises(ConfigError, match=match):
        validate(c)
    c.data.adaptive_cp, c.data.adaptive_cp_buckets = True, "0,0.5"
    validate(c)


# ------------------------------------------------------------------------------------- subgroup tiers


def _tier_tokens(zigzag: bool, t: int = T, size: int = 4, local=TIER_LOCAL, groups=TIER_GROUPS):
    """(L, ((g, L_g), ...)): the tiers' tokens a device, as `bytescale.plan` takes them."""
    shares = context.parse_groups(groups)
    sizes = context.region_sizes(t, size, zigzag, local, shares)
    return sizes[0], tuple((g, n) for (g, _), n in zip(shares, sizes[1:-1]))


@pytest.mark.parametrize("table", TABLES)
def test_the_plan_keeps_every_piece_inside_one_tier_region(table):
    """The host plan's tiers are the device's: `context.row_regions` and the plan's layout map every
    position to the same device, a group region's positions to the devices of one group, and every
    piece lies inside one region (local, one group's, or the full ring's)."""
    size, zigzag = TABLES[table]
    t, chunks = 64, context.chunk_table(size, zigzag)
    local, groups = _tier_tokens(zigzag, t, size, 0.125, "2:0.25")  # 2, ((2, 4),): regions of 8, then 40
    regions = context.row_regions(t, size, zigzag, 0.125, context.parse_groups("2:0.25"))
    assert sorted(regions.reshape(-1).tolist()) == list(range(t))
    lay = bytescale._layout(t, chunks, local, groups)
    for d in range(size):
        assert (lay.position_device[regions[d]] == d).all()
    for j in range(size // 2):  # group j's region holds only its two ranks' positions
        assert set(lay.position_device[size * local + j * 8 : size * local + (j + 1) * 8]) == {2 * j, 2 * j + 1}
    lengths = np.clip(_long_tail(80, t, seed=7), 2, t - size * (local + 4) + 1)
    placed = bytescale.plan(lengths, t, chunks, local=local, groups=groups)
    edges = np.concatenate([np.arange(0, size * local, local), size * local + np.arange(0, size * 4, 8), [size * 6]])
    tiers = np.zeros(3, int)
    for n, s in zip(lengths.tolist(), placed.start.tolist()):
        i = int(np.searchsorted(edges, s, side="right")) - 1
        end = t + 1 if i == len(edges) - 1 else int(edges[i + 1])
        assert s + n <= end  # ends inside the region it starts in
        tiers[0 if i < size else 1 if i < len(edges) - 1 else 2] += 1
    assert (tiers > 0).all()
    assert bytescale.ring_traffic(t, size, local, groups) == size * 4 * (2 - 1) + (t - size * 6) * (size - 1)


@pytest.fixture(scope="module")
def tier_programs():
    """seq=4 x data=2, ring, with the tiers above, contiguous and zigzag."""
    return {z: _program({"seq": 4, "data": 2}, z, TIER_LOCAL, groups=TIER_GROUPS) for z in (False, True)}


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_subgroup_tiers_give_the_single_device_loss_and_gradients(zigzag, documents, tier_programs):
    """adaptive_cp_local=0.25 and adaptive_cp_groups='2:0.25' on seq=4 x data=2, ring: the plan's
    rows (documents of <= 2 tokens local, <= 4 in a group region, some spanning both devices of
    their group, long ones on the full ring) give the single-device loss and gradients. It can
    fail: best-fit rows, whose documents cross the tiers' regions, and the plan's rows with one
    segment a row are off by more than 1e-3 in the gradients."""
    lengths, docs = documents[:2]
    chunks = context.chunk_table(4, zigzag)
    local, groups = _tier_tokens(zigzag)
    placed = bytescale.plan(lengths, T, chunks, min_rows=ROWS, local=local, groups=groups)
    assert placed.num_rows == ROWS
    in_group = (placed.start >= 4 * local) & (placed.start < 4 * (local + 2))
    where = bytescale._layout(T, chunks, local, groups).position_device
    spans = [len(set(where[s : s + n].tolist())) for s, n in zip(placed.start[in_group], lengths[in_group])]
    assert max(spans) == 2 and (placed.start >= 16).sum() >= 7  # the group rings carry documents
    program, batch = tier_programs[zigzag], _batch(placed, lengths, docs, T, ROWS)
    _close_to_one_device(program, batch, documents)
    _far_from_one_device(program, documents[3], documents)
    _far_from_one_device(program, batch._replace(segments=(batch.segments > 0).astype(np.int32)), documents)


def _ring_formula(config, rings) -> tuple[int, int]:
    """(count, bytes) of the ring's K/V permutes over seq per step, for rings [(g, tokens a device)]:
    per softmax layer, forward (twice with remat) g - 1 hops of K and V; backward g - 1 hops of K,
    V, dK, dV (fp32) and one more of dK, dV."""
    m, b = config.model, config.train.batch_size // config.mesh.data
    kv = lambda n: b * n * m.n_kv_heads * m.head_dim * {"float32": 4, "bfloat16": 2}[m.compute_dtype]
    grad = lambda n: b * n * m.n_kv_heads * m.head_dim * 4
    fwd = 2 if m.remat != "none" else 1
    count = size = 0
    for g, n in rings:
        count += m.n_layers * (fwd * 2 * (g - 1) + 4 * (g - 1) + 2)
        size += m.n_layers * (fwd * (g - 1) * 2 * kv(n) + (g - 1) * (2 * kv(n) + 2 * grad(n)) + 2 * grad(n))
    return count, size


def _seq_permutes(program) -> tuple[tuple[int, int], set]:
    """((count, bytes) of the step's float permutes over seq (K, V, dK, dV), {[B, n] shapes of its
    segment-id permutes}), lowered with the layers unrolled."""
    from jaxsys.analysis import collectives, report

    sizes = dict(program.layout.mesh_sizes)
    count = size = 0
    ids = set()
    for c in collectives.parse(report.lower_unrolled(program).as_text(), sizes):
        if c.axes == ("seq",):
            assert c.kind == "collective_permute"
            if c.dtype == "i32":
                ids.add(c.shape)
            else:
                count, size = count + 1, size + c.operand_bytes
    return (count, size), ids


def test_subgroup_tiers_move_the_bytes_of_their_rings(fixed_programs, tier_programs):
    """The lowered step's seq collectives are permutes of one ring per tier: a ring of 2 within each
    group over its 2 tokens a device (1 hop), and the full ring of 4 over its 4 (3 hops), by the
    count of `_ring_formula`, which gives fixed CP's (one ring of 4 over 8 tokens) too. Forward,
    a device sends 1 x 2 + 3 x 4 = 14 tokens of K/V where fixed CP sends 3 x 8 = 24: per row
    `bytescale.ring_traffic` 56 of 96. The segment ids travel with the K/V of each tier ([B, 2]
    and [B, 4]). cost_model.context_parallel_rows says the same."""
    from jaxsys.analysis import cost_model

    fixed, tiered = fixed_programs[False][0], tier_programs[False][0]
    b = fixed.config.train.batch_size // fixed.config.mesh.data
    assert _seq_permutes(fixed) == (_ring_formula(fixed.config, [(4, 8)]), {(b, 8)})
    assert (bytescale.ring_traffic(T, 4, 2, ((2, 2),)), bytescale.ring_traffic(T, 4)) == (56, 96)
    want = _ring_formula(tiered.config, [(2, 2), (4, 4)])
    assert _seq_permutes(tiered) == (want, {(b, 2), (b, 4)})
    assert {r.kind: (r.count, r.bytes) for r in cost_model.context_parallel_rows(tiered.config)} == {
        "collective_permute": want
    }


@pytest.mark.parametrize(
    "groups,local,zigzag,variant,match",
    [
        ("2:0.25", 0.0, False, "allgather", "only with context_parallel='ring'"),
        ("3:0.25", 0.0, False, "ring", "group size 3 must divide config.mesh.seq=4"),
        ("4:0.25", 0.0, False, "ring", "group size 4 must divide config.mesh.seq=4 with 1 < g < 4"),
        ("2:0.5", 0.5, False, "ring", "positive remainder"),
        ("2:0.3", 0.0, False, "ring", "must be whole"),
        ("2:0.125", 0.25, True, "ring", "multiple of 2"),
        ("2", 0.0, False, "ring", "not g:share"),
        ("2:0.25,2:0.25", 0.0, False, "ring", "smallest first"),
    ],
)
def test_subgroup_tiers_are_refused_when_they_do_not_cut_the_row(groups, local, zigzag, variant, match):
    """seq=4, T=32: 8 tokens a device. Under the zigzag a group tier's 1 token cannot be halved."""
    c = small_config({"seq": 4, "data": 2}, context_load_balance=zigzag, context_parallel=variant)
    c.data.source, c.data.packing = "jsonl", True
    c.data.adaptive_cp, c.data.adaptive_cp_local, c.data.adaptive_cp_groups = True, local, groups
    with pytest.raises(ConfigError, match=match):
        validate(c)
    c.data.adaptive_cp = False
    c.data.adaptive_cp_local, c.data.adaptive_cp_groups = 0.0, "2:0.25"
    with pytest.raises(ConfigError, match="needs config.data.adaptive_cp=True"):
        validate(c)
