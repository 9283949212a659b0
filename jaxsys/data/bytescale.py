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
out as `context.row_regions` says, device d's local region [d L, (d + 1) L) first, then the ring
region [S L, T) cut into the chunks above. A local region holds whole pieces of at most L tokens,
never running on into the next region; the ring region holds the rest, pieces of at most
T - S L + 1 tokens (the loader cuts documents there). The device program attends each local
region with no communication and runs the ring (or all-gather) over the ring region only, so its
collective bytes are fixed CP's times (T/S - L) / (T/S) (`ring_traffic`; parallel/context.py).

Otherwise the device program is the ordinary context-parallel step with segment ids
(parallel/context.py): the plan only moves tokens within their rows, so the losses are the
single-device ones. What is not here that ByteScale does: groups of g < S devices for pieces that
span fewer devices (each piece of the ring region still travels round all S), and a local share
chosen per batch (it is one static number, so one compiled program); `kv_traffic` counts what the
plan's groups would need (docs/bytescale.md).
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
    """A row's chunks in position order: first position, length, device, and whether a piece may
    run on into the next chunk (ring region: yes; a local region: no, its documents stay whole)."""

    start: np.ndarray
    length: np.ndarray
    device: np.ndarray
    ring: np.ndarray
    devices: int

    @property
    def position_device(self) -> np.ndarray:
        """[T] the device holding each input position."""
        return np.repeat(self.device, self.length)


def _layout(seq_len: int, chunks: np.ndarray, local: int) -> _Layout:
    """Local regions [d L, (d + 1) L) of device d, then the ring region cut as `chunks` cuts a row
    (`context.row_regions`)."""
    owner = owners(chunks)
    devices = int(owner.max()) + 1
    ring_len = seq_len - devices * local
    if local < 0 or ring_len <= 0:
        raise ValueError(f"local regions of {local} tokens on {devices} devices leave no ring region of T={seq_len}")
    c = _chunk_len(ring_len, owner.shape[0])
    n_local = devices if local else 0
    start = np.concatenate([np.arange(n_local) * local, devices * local + np.arange(owner.shape[0]) * c])
    length = np.concatenate([np.full(n_local, local), np.full(owner.shape[0], c)])
    device = np.concatenate([np.arange(n_local), owner])
    ring = np.arange(start.shape[0]) >= n_local
    return _Layout(start.astype(np.int64), length.astype(np.int64), device, ring, devices)


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
) -> Placement:
    """Place pieces of `length` tokens (each at most T + 1) in rows whose inputs are split as
    `chunks` (`context.chunk_table`) by the balancing rule of the module docstring; at least
    `min_rows` rows. With `shards` > 1, row r goes to data shard r % shards and a device's load is
    summed over its shard's rows only (planning one batch for a mesh with a data axis). `local`:
    tokens of each device's local region (`context.region_sizes`, config.data.adaptive_cp_local),
    which hold whole pieces of at most that length; the ring region, T - S local positions, then
    holds pieces of at most its length + 1."""
    length = np.asarray(length, np.int64)
    lay = _layout(seq_len, chunks, local)
    where, devices, nk = lay.position_device, lay.devices, lay.start.shape[0]
    ring_len = seq_len - devices * local
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
                    if not lay.ring[k]:  # a local region's documents stay whole
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
                key = (float(column[i]), float(peak[i]), int(np.count_nonzero(added)), int(room[i]), int(ok[i]))
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
) -> np.ndarray:
    """[rows, S] work of each device of the `seq` axis on each row (`chunks`: `context.chunk_table`;
    `local`: tokens of each device's local region, as `plan`)."""
    lay = _layout(seq_len, chunks, local)
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


def kv_traffic(placement: Placement, length: np.ndarray, seq_len: int, chunks: np.ndarray, local: int = 0) -> int:
    """Tokens of keys/values (one direction, forward) that must cross devices: each device's tokens
    of a piece reach the other devices of the piece's group once (ring or all-gather within the
    group). The static ring moves `ring_traffic` per row whatever the row holds."""
    lay = _layout(seq_len, chunks, local)
    where = lay.position_device
    total = 0
    for p in range(len(length)):
        tokens = _device_work(int(placement.start[p]), int(length[p]), seq_len, where, lay.devices, 1.0, 0.0)
        total += int(tokens.sum()) * (int(np.count_nonzero(tokens)) - 1)
    return total


def ring_traffic(seq_len: int, devices: int, local: int = 0) -> int:
    """Tokens of keys/values (one direction, forward) the static program moves per row: every ring
    position's K/V reach the S - 1 other devices, (T - S L)(S - 1); the local regions move none."""
    return (seq_len - devices * local) * (devices - 1)
