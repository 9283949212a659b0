"""Length-adaptive context parallelism (after ByteScale, Ge et al. 2025): the host decides where
each piece of a packed batch sits in its row, so that short pieces lie whole on one device of the
`seq` axis (data parallelism, no context-parallel traffic) and only long pieces are split over the
fewest devices that hold them, with the work even over the devices.

The row's T inputs are cut into the chunks of context parallelism (`context.chunk_table`: S
chunks, or 2S with the zigzag of `model.context_load_balance`), chunk k of length c = T / chunks,
owned by device owner[k] (position T is only a target: it belongs to no chunk, but a piece may end
there). A piece of n tokens either fits one chunk (n <= c: it is local to that chunk's device) or
starts on a chunk boundary and spans the fewest chunks that hold it; its context-parallel group is
the set of devices owning those chunks. Under the zigzag, chunks S - 1 and S are both device
S - 1's, so a piece of up to 2c tokens placed there is local too, and a piece centred on the middle
gets the zigzag's balance within its group.

The balancing rule (`plan`), on the host, per set of pieces: pieces from the longest, each placed
where the most loaded device ends least loaded, a device's load summed over the rows it holds
(ties: the row's most loaded device, then the fewest devices in the piece's group, then the least
room left, then the first row), the load being the work,
a tokens + b causal (query, key) pairs: linear and attention FLOPs up to a constant each. A long
piece takes empty chunks only; a short one any chunk with room. A new row opens when nothing holds a
piece. Planned over a whole split (the loader: rows are then shuffled into batches), this evens the
devices' work over the split, so in expectation over a batch's rows; planned per batch
(`shards` = the data axis), over the batch's devices exactly as the rule manages.

Local regions (config.data.adaptive_cp_local > 0, `local` = L tokens a device): the row is laid
out as `context.row_regions` says, device d's local region [d L, (d + 1) L) first, then (without
group tiers) the ring region [S L, T) cut into the chunks above. A local region holds whole pieces of at most L tokens,
never running on into the next region; the ring region holds the rest, pieces of at most
T - S L + 1 tokens (the loader cuts documents there). The device program attends each local
region with no communication and runs the ring (or all-gather) over the ring region only, so its
collective bytes are fixed CP's times (T/S - L) / (T/S) (`ring_traffic`; parallel/context.py).

Subgroup tiers (config.data.adaptive_cp_groups, `groups` = ((g, L_g), ...) tokens a device):
after the local regions, each g tier's S/g group regions of g L_g positions, group j on devices
[j g, (j + 1) g), each cut as the chunks above cut a row over g devices; then the full ring region.
A group region holds whole pieces of at most g L_g tokens, whose K/V go round a ring of its g
devices only: `ring_traffic` sums S L_g (g - 1) per tier with the full ring's. A piece may go in
any region that holds it whole; ties prefer the smallest tier.

Otherwise the device program is the ordinary context-parallel step with segment ids
(parallel/context.py): the plan only moves tokens within their rows, so the losses are the
single-device ones. What is not here that ByteScale does: a group per piece chosen per batch (the
tiers and their shares are static, one compiled program; a piece of the full ring region that
spans fewer devices still travels round all S); `kv_traffic` counts what the plan's groups would
need (docs/bytescale.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.data import packing


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each piece sits: its row and first position in the row."""

    row: np.ndarray  # [P] int64
    start: np.ndarray  # [P] int64
    num_rows: int

    def rows(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per row: its pieces by position, and their first positions (`packing.assemble(starts=)`)."""
        members, starts = [], []
        for r in range(self.num_rows):
            idx = np.flatnonzero(self.row == r)
            idx = idx[np.argsort(self.start[idx], kind="stable")]
            members.append(idx)
            starts.append(self.start[idx])
        return members, starts

    def to_plan(self) -> packing.Plan:
        """The rows as a `packing.Plan` with each member's first position (what the loader keeps)."""
        order = np.lexsort((self.start, self.row))
        counts = np.bincount(self.row, minlength=self.num_rows)
        row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return packing.Plan(row_ptr, order.astype(np.int64), self.start[order].astype(np.int64))


def owners(chunks: np.ndarray) -> np.ndarray:
    """[n_chunks] the device holding each global chunk, from `context.chunk_table` [S, c]."""
    chunks = np.asarray(chunks)
    out = np.empty(chunks.size, np.int64)
    out[chunks.reshape(-1)] = np.repeat(np.arange(chunks.shape[0]), chunks.shape[1])
    return out


def _chunk_len(seq_len: int, n_chunks: int) -> int:
    if seq_len % n_chunks:
        raise ValueError(f"a row of T={seq_len} inputs does not cut into {n_chunks} equal chunks")
    return seq_len // n_chunks


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A row's chunks in position order: first position, length, device, the region it belongs to
    (a piece may run on from one chunk into the next of the same region only: a local region is one
    chunk, a group region g or 2g, the full ring region S or 2S) and the region's tier g."""

    start: np.ndarray
    length: np.ndarray
    device: np.ndarray
    region: np.ndarray
    tier: np.ndarray
    devices: int

    @property
    def position_device(self) -> np.ndarray:
        """[T] the device holding each input position."""
        return np.repeat(self.device, self.length)


def _layout(seq_len: int, chunks: np.ndarray, local: int, groups=()) -> _Layout:
    """Local regions [d L, (d + 1) L) of device d, then each group tier (g, L_g) of `groups`: S/g
    group regions of g L_g tokens, group j on devices [j g, (j + 1) g), each cut as context
    parallelism cuts a row over g devices; then the full ring region cut as `chunks` cuts a row
    (`context.row_regions`)."""
    from jaxsys.parallel import context

    owner = owners(chunks)
    devices, per = int(owner.max()) + 1, int(np.asarray(chunks).shape[1])
    ring_len = seq_len - devices * (local + sum(int(n) for _, n in groups))
    if local < 0 or ring_len <= 0:
        raise ValueError(
            f"local regions of {local} tokens and group tiers {tuple(groups)} on {devices} devices leave no ring "
            f"region of T={seq_len}"
        )
    start, length, device, region, tier = [], [], [], [], []
    base = 0
    for g, n in ([(1, local)] if local else []) + [(int(g), int(n)) for g, n in groups]:
        cpd = per if g > 1 else 1  # a local region is one block
        c = _chunk_len(g * n, g * cpd)
        # the cut of the full ring, over the g devices of each group
        sub = owners(context.chunk_table(g, cpd == 2))
        for j in range(devices // g):
            start += (base + j * g * n + np.arange(g * cpd) * c).tolist()
            length += [c] * (g * cpd)
            device += (j * g + sub).tolist()
            region += [len(set(region))] * (g * cpd)
            tier += [g] * (g * cpd)
        base += devices * n
    c = _chunk_len(ring_len, owner.shape[0])
    start += (base + np.arange(owner.shape[0]) * c).tolist()
    length += [c] * owner.shape[0]
    device += owner.tolist()
    region += [len(set(region))] * owner.shape[0]
    tier += [devices] * owner.shape[0]
    arr = lambda x: np.array(x, np.int64)
    return _Layout(arr(start), arr(length), arr(device), arr(region), arr(tier), devices)


def _device_work(start: int, n: int, seq_len: int, where: np.ndarray, devices: int, a: float, b: float) -> np.ndarray:
    """[S] work each device does for a piece of n tokens at `start` (`where`: each position's
    device): per input token it holds, a + b (the keys of its piece it sees, causal)."""
    out = np.zeros(devices)
    pos = np.arange(start, min(start + n, seq_len))  # position T is a target only
    np.add.at(out, where[pos], a + b * (pos - start + 1))
    return out


def plan(
    length: np.ndarray,
    seq_len: int,
    chunks: np.ndarray,
    token_cost: float = 1.0,
    pair_cost: float = 1.0,
    min_rows: int = 1,
    shards: int = 1,
    local: int = 0,
    groups=(),
) -> Placement:
    """Place pieces of `length` tokens (each at most T + 1) in rows whose inputs are split as
    `chunks` (`context.chunk_table`) by the balancing rule of the module docstring; at least
    `min_rows` rows. With `shards` > 1, row r goes to data shard r % shards and a device's load is
    summed over its shard's rows only (planning one batch for a mesh with a data axis). `local`:
    tokens of each device's local region (`context.region_sizes`, config.data.adaptive_cp_local),
    which hold whole pieces of at most that length; `groups`: (g, L_g) tokens of each device in each
    group tier (`context.region_sizes`, config.data.adaptive_cp_groups), whose group regions hold
    whole pieces of at most g L_g; the full ring region, the last T - S (L + sum L_g) positions,
    holds pieces of at most its length + 1. A piece may go in any region that holds it whole."""
    length = np.asarray(length, np.int64)
    lay = _layout(seq_len, chunks, local, groups)
    where, devices, nk = lay.position_device, lay.devices, lay.start.shape[0]
    ring_len = int(lay.length[lay.tier == devices].sum())
    if length.size and int(length.max()) > ring_len + 1:
        raise ValueError(f"a piece of {int(length.max())} tokens does not fit a ring region of {ring_len + 1}")
    cap = lay.length.copy()
    cap[-1] += 1  # a piece may end on position T
    fill = np.zeros((max(1, int(min_rows)), nk), np.int64)  # tokens placed in each chunk, from its start
    load = np.zeros((fill.shape[0], devices))
    row = np.empty(length.shape[0], np.int64)
    start = np.empty(length.shape[0], np.int64)
    for p in np.argsort(-length, kind="stable").tolist():
        n = int(length[p])
        # candidates (chunk, first position, chunks covered): one chunk with room, or a run of empty ones
        best = None
        for _ in range(2):  # the second pass has a new empty row
            for k in range(nk):
                s0 = int(lay.start[k])
                if s0 + n - 1 > seq_len:
                    break
                last = int(np.searchsorted(lay.start, min(s0 + n - 1, seq_len - 1), side="right")) - 1
                span = np.arange(k, last + 1)
                if last == k:
                    if n > cap[k]:
                        continue
                    ok = np.flatnonzero(cap[k] - fill[:, k] >= n)
                    first = s0 + fill[ok, k]
                    room = cap[k] - fill[ok, k] - n
                else:
                    if lay.region[last] != lay.region[k]:  # a document stays inside its region
                        continue
                    ok = np.flatnonzero((fill[:, span] == 0).all(-1))
                    first = np.full(ok.shape[0], s0)
                    room = np.full(ok.shape[0], lay.start[last] + cap[last] - s0 - n)
                if not ok.size:
                    continue
                # the device work is the same wherever in the chunk the piece starts
                added = _device_work(s0, n, seq_len, where, devices, token_cost, pair_cost)
                shard = np.arange(load.shape[0]) % shards
                column = np.stack([load[shard == d].sum(0) for d in range(shards)])  # [shards, S]
                column = (column[shard[ok]] + added).max(-1)  # the most loaded device of the row's shard
                peak = (load[ok] + added).max(-1)
                i = int(np.lexsort((ok, room, peak, column))[0])
                key = (
                    float(column[i]),
                    float(peak[i]),
                    int(np.count_nonzero(added)),
                    int(lay.tier[k]),
                    int(room[i]),
                    int(ok[i]),
                )
                if best is None or key < best[0]:
                    best = (key, int(ok[i]), int(first[i]), span, added)
            if best is not None:
                break
            fill = np.concatenate([fill, np.zeros((1, nk), np.int64)])
            load = np.concatenate([load, np.zeros((1, devices))])
        assert best is not None, "an empty row holds any piece of at most its ring region + 1 tokens"
        _, r, first_pos, span, added = best
        row[p], start[p] = r, first_pos
        for k in span.tolist():
            fill[r, k] = min(first_pos + n, int(lay.start[k] + cap[k])) - int(lay.start[k])
        load[r] += added
    return Placement(row, start, int(fill.shape[0]))


def packed_placement(length: np.ndarray, seq_len: int) -> Placement:
    """The fixed-CP baseline: best-fit decreasing rows (`packing.packed_plan`, what
    `config.data.packing` does), pieces one after the other from position 0."""
    length = np.asarray(length, np.int64)
    rows = packing.packed_plan(length, seq_len + 1)
    row, start = np.empty(length.shape[0], np.int64), np.empty(length.shape[0], np.int64)
    for r in range(rows.num_rows):
        members = rows.row(r)
        row[members] = r
        start[members] = np.cumsum(length[members]) - length[members]
    return Placement(row, start, rows.num_rows)


def work(
    placement: Placement,
    length: np.ndarray,
    seq_len: int,
    chunks: np.ndarray,
    a: float = 1.0,
    b: float = 1.0,
    local: int = 0,
    groups=(),
) -> np.ndarray:
    """[rows, S] work of each device of the `seq` axis on each row (`chunks`: `context.chunk_table`;
    `local`, `groups`: the tiers' tokens a device, as `plan`)."""
    lay = _layout(seq_len, chunks, local, groups)
    where = lay.position_device
    out = np.zeros((placement.num_rows, lay.devices))
    for p in range(len(length)):
        out[placement.row[p]] += _device_work(
            int(placement.start[p]), int(length[p]), seq_len, where, lay.devices, a, b
        )
    return out


def imbalance(load: np.ndarray) -> float:
    """max / mean - 1 of per-device loads (0: perfectly even)."""
    mean = float(np.mean(load))
    return float(np.max(load)) / mean - 1.0 if mean > 0 else 0.0


def kv_traffic(
    placement: Placement, length: np.ndarray, seq_len: int, chunks: np.ndarray, local: int = 0, groups=()
) -> int:
    """Tokens of keys/values (one direction, forward) that must cross devices: each device's tokens
    of a piece reach the other devices of the piece's group once (ring or all-gather within the
    group). The static ring moves `ring_traffic` per row whatever the row holds."""
    lay = _layout(seq_len, chunks, local, groups)
    where = lay.position_device
    total = 0
    for p in range(len(length)):
        tokens = _device_work(int(placement.start[p]), int(length[p]), seq_len, where, lay.devices, 1.0, 0.0)
        total += int(tokens.sum()) * (int(np.count_nonzero(tokens)) - 1)
    return total


def ring_traffic(seq_len: int, devices: int, local: int = 0, groups=()) -> int:
    """Tokens of keys/values (one direction, forward) the static program moves per row: a group
    tier's S/g group regions of g L_g positions each reach the g - 1 other devices of their group,
    S L_g (g - 1); every full ring position reaches the S - 1 others, (T - S (L + sum L_g))(S - 1);
    the local regions move none."""
    tiers = sum(devices * int(n) * (int(g) - 1) for g, n in groups)
    return tiers + (seq_len - devices * (local + sum(int(n) for _, n in groups))) * (devices - 1)


# ----------------------------------------------------------------------------- batches of layouts


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Rows grouped into batches of B, each batch laid out for one of several local-region sizes
    (`locals_`, one compiled program each): batch i is rows batches[i] (in global-batch order)
    with local regions of locals_[bucket[i]] tokens a device; `placement` places `pieces`."""

    pieces: packing.Pieces
    placement: Placement
    batches: np.ndarray  # [NB, B] int64 row ids
    bucket: np.ndarray  # [NB] int64 index into locals_
    locals_: tuple[int, ...]


def plan_batches(
    doc_len: np.ndarray,
    seq_len: int,
    chunks: np.ndarray,
    locals_: tuple[int, ...],
    batch_rows: int,
    batch_shards: int = 1,
    token_cost: float = 1.0,
    pair_cost: float = 1.0,
    groups=(),
    split_long: bool = True,
    docs: np.ndarray | None = None,
) -> BatchPlan:
    """Documents of `doc_len` tokens (ids `docs`) in whole batches of `batch_rows` rows, each batch
    with the layout of one bucket (L tokens of local region a device, `locals_`), chosen per batch
    by the short-document supply: from the largest L down, a bucket takes as many batches as the
    documents of at most L tokens can fill local regions of (B S L tokens a batch), offers all the
    short documents to them and other documents, in split order, for the rest of its rows. Each bucket cuts its documents at its own full ring region (`packing.pieces`: a bucket
    without local regions cuts at T, as fixed CP does) and `plan` places the pieces (the balancing
    rule, over each (batch, data shard) of `batch_shards`); a document with a piece in a row past
    the bucket's n B returns whole to the pool. The smallest L takes every document left, in as few
    batches as hold them. Every piece is in exactly one row and every row in one batch; each
    batch's rows are ordered so that global row b sits on data shard b // (B / D), as the batch
    sharding splits it. `groups`: the (g, L_g) subgroup tiers (`plan`), the same in every bucket."""
    doc_len = np.asarray(doc_len, np.int64)
    docs = np.arange(doc_len.shape[0], dtype=np.int64) if docs is None else np.asarray(docs, np.int64)
    devices = int(np.asarray(chunks).shape[0])
    if batch_rows % batch_shards:
        raise ValueError(f"a batch of {batch_rows} rows does not split over {batch_shards} data shards")
    grouped = sum(int(n) for _, n in groups)
    pool = doc_len >= 2  # shorter documents hold no target (`packing.pieces` drops them)
    order = sorted(range(len(locals_)), key=lambda i: -locals_[i])
    parts: list[tuple[int, packing.Pieces, Placement]] = []
    for rank, b in enumerate(order):
        local, last = int(locals_[b]), rank == len(order) - 1
        ids = np.flatnonzero(pool)
        if not ids.size:
            break
        if not last:
            short = ids[doc_len[ids] <= local]
            n = int(doc_len[short].sum()) // (batch_rows * devices * local) if local else 0
            if not n:
                continue
            # every short document may fill a local region (the plan goes longest first, so the
            # small ones fill the gaps; what is left over returns to the pool), and other documents
            # in split order fill the rest of the rows
            rest = np.setdiff1d(ids, short)
            outside = n * batch_rows * (seq_len - devices * local)  # tokens outside the local regions
            take = np.concatenate([short, rest[np.cumsum(doc_len[rest]) <= outside]])
        else:
            take = ids
        pieces = packing.pieces(doc_len[take], seq_len - devices * (local + grouped), split_long, docs=take)
        if last:  # best-fit's rows, in whole batches, as a first guess
            n = max(1, -(-packing.packed_plan(pieces.length, seq_len + 1).num_rows // batch_rows))
        while True:
            rows = n * batch_rows
            placed = plan(pieces.length, seq_len, chunks, token_cost, pair_cost, rows, n * batch_shards, local, groups)
            if placed.num_rows == rows or not last:
                break
            n += 1  # the last bucket holds every document left: one more batch
        keep = ~np.isin(pieces.doc, pieces.doc[placed.row >= rows])  # documents whole in the bucket's rows
        pool[pieces.doc[keep]] = False
        kept = packing.Pieces(pieces.doc[keep], pieces.start[keep], pieces.length[keep])
        parts.append((b, kept, Placement(placed.row[keep], placed.start[keep], rows)))
    if pool.any():
        raise AssertionError("the last bucket places every document left")
    batches, bucket, offset = [], [], 0
    rows_, starts = [], []
    for b, _, placed in parts:
        rows_.append(placed.row + offset)
        starts.append(placed.start)
        n, per_shard = placed.num_rows // batch_rows, batch_rows // batch_shards
        for i in range(n):  # row r serves (batch, shard) slot r % (n D) (`plan`'s shard rule)
            slots = [
                np.arange(i * batch_shards + d, placed.num_rows, n * batch_shards)[:per_shard]
                for d in range(batch_shards)
            ]
            batches.append(np.concatenate(slots) + offset)
            bucket.append(b)
        offset += placed.num_rows
    cat = lambda xs: np.concatenate(xs).astype(np.int64)
    pieces = packing.Pieces(
        docs[cat([p.doc for _, p, _ in parts])],
        cat([p.start for _, p, _ in parts]),
        cat([p.length for _, p, _ in parts]),
    )
    placement = Placement(cat(rows_), cat(starts), offset)
    return BatchPlan(pieces, placement, np.stack(batches), np.asarray(bucket, np.int64), tuple(locals_))
