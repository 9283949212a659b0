"""Context parallelism over the `seq` mesh axis: the sequence of every batch row is split over P
devices, and attention, the one layer that mixes positions, communicates.

Assignment. The sequence is cut into chunks of Tc tokens. Without load balancing device r holds chunk
r (P chunks). With it (`model.context_load_balance`), there are 2P chunks and device r holds r and
2P-1-r (the zigzag of Megatron-CP / striped attention), so under a causal mask every device sees
the same number of visible (query, key) pairs. The tokens, targets and RoPE positions of a device
are its chunks' (`shard_sequence`, `positions`); nothing else in the model knows.

Tiers (length-adaptive CP, docs/bytescale.md; `region_sizes`, `row_regions`): a device's T/P
tokens may be split into a local region (no communication), group tiers (a ring within each
group of g consecutive ranks, `SeqLayout.group`) and the full ring region, each cut as above over
its own devices.

Softmax attention, `model.context_parallel`:
  ring       K/V blocks go round the ring (ppermute), each step's block attention is merged into
             the running output by its log-sum-exp (Liu et al., Ring Attention). The backward is a
             ring too (custom_vjp): K/V travel again with their dK/dV accumulators, which arrive
             home after the last hop, and each block's gradients come from the *final* o and LSE.
             Holds one remote K/V block at a time.
  allgather  all-gather K and V over `seq` (reduce-scatter of dK, dV backward) and attend the local
             queries to all of them: the simple baseline (also what LASP-2H uses for the softmax
             layers of hybrid models).
  tokenring  queries go round the ring one hop per step while each step's partial (o, LSE) goes
             straight back to its owner, so both directions of every link carry data at once
             (TokenRing). Backward by autodiff (the transposed permutes).
Each (query chunk, key chunk) pair is attended as `full` (key chunk before), `causal` (the same
chunk) or skipped (after), chosen at run time with lax.switch, by the configured implementation
(the reference or the Pallas flash kernel, as models/attention.py chose: a `BlockAttention`).

Linear attention: LASP-2 (Sun et al. 2025). Each device computes its chunks with a zero initial
state, all-gathers the chunk states (B x N x H x H each: independent of T) in one all-gather per
layer, scans them into the state entering each of its chunks, and adds that state's contribution
scale * gamma^(t+1) q_t S_in to its outputs.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.parallel.collectives import all_gather_fwd_reduce_scatter_bwd, axis_index

VARIANTS = ("ring", "allgather", "tokenring")
SEQ_DIM = 1


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """How the sequence is split: over mesh `axes` (size P), zigzag when `balance`."""

    axes: tuple[str, ...]
    size: int
    balance: bool
    variant: str = "ring"
    local: float = 0.0  # share of each device's tokens in its local region (config.data.adaptive_cp_local)
    groups: tuple[tuple[int, float], ...] = ()  # (g, share) subgroup tiers (config.data.adaptive_cp_groups)
    group: int = 0  # the ring runs within consecutive groups of this many ranks (0: all P)

    @classmethod
    def of(cls, layout, m) -> "SeqLayout":
        axes = layout.compute_axes("seq")
        local, groups = (layout.seq_local, layout.seq_groups) if axes else (0.0, ())
        return cls(axes, layout.size(axes), bool(m.context_load_balance), m.context_parallel, local, groups)

    def regions(self, seq_len: int) -> tuple[int, ...]:
        """A device's tokens in each tier of a row of `seq_len` positions (`region_sizes`): its
        local region, each group tier's, the full ring's."""
        return region_sizes(seq_len, self.size, self.balance, self.local, self.groups)

    def tiers(self) -> tuple[int, ...]:
        """Group size of each entry of `regions`: 1, the group tiers' g, P."""
        return tier_groups(self.size, self.groups)

    @property
    def ring(self) -> int:
        """Devices one ring runs over (`group`, else all P)."""
        return self.group or self.size

    @property
    def chunks_per_device(self) -> int:
        return 2 if self.balance else 1

    @property
    def n_chunks(self) -> int:
        return self.size * self.chunks_per_device


def chunk_table(size: int, balance: bool) -> np.ndarray:
    """[P, c] global chunk ids of each device's chunks, in the order they are stored locally."""
    if balance:
        return np.array([[r, 2 * size - 1 - r] for r in range(size)], np.int32)
    return np.arange(size, dtype=np.int32)[:, None]


def parse_groups(text: str) -> tuple[tuple[int, float], ...]:
    """config.data.adaptive_cp_groups, "g:share,g:share" -> ((g, share), ...); "" -> ().
    Raises ValueError on anything else (the config checks the values)."""
    out = []
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        g, sep, share = item.partition(":")
        if not sep:
            raise ValueError(f"{item!r} is not g:share")
        out.append((int(g), float(share)))
    return tuple(out)


def tier_groups(size: int, groups=()) -> tuple[int, ...]:
    """Group size of each tier in row order: 1 (local regions), each of `groups`' g, P (the full ring)."""
    return (1, *(int(g) for g, _ in groups), size)


def region_sizes(seq_len: int, size: int, balance: bool, local: float, groups=()) -> tuple[int, ...]:
    """Per device, tokens of each tier (`tier_groups`): (L, L_g..., R), L = local * T / P,
    L_g = share * T / P, R the rest. Without groups this is (L, R). Raises ValueError when a tier
    is not whole, a group tier's g does not divide P with 1 < g < P, or R <= 0 (the config checks
    this first)."""
    per, cpd = seq_len // size, 2 if balance else 1
    if not local and not groups:
        return 0, per
    shares = [float(local)] + [float(s) for _, s in groups]
    counts = [int(round(f * per)) for f in shares]
    n_ring = per - sum(counts)
    for i, (f, n) in enumerate(zip(shares, counts)):
        tier = "local region" if i == 0 else f"group tier {groups[i - 1][0]}:{f}"
        ok = abs(n - f * per) < 1e-6 and n >= 0 and (i == 0 or (n > 0 and n % cpd == 0))
        if seq_len % size or not ok:
            raise ValueError(
                f"a row of T={seq_len} on {size} devices (zigzag: {balance}) has no {tier} of {f} of each device's "
                f"T/P tokens: T/P and the tier's share of T/P must be whole"
                + (f", > 0 and a multiple of {cpd}" if i else "")
            )
    for g, _ in groups:
        if not 1 < g < size or size % g:
            raise ValueError(f"a group tier of g={g} on {size} devices: g must divide {size} with 1 < g < {size}")
    if n_ring <= 0 or n_ring % cpd:
        raise ValueError(
            f"a row of T={seq_len} on {size} devices (zigzag: {balance}) has no full ring region: the tiers take "
            f"{sum(counts)} of each device's {per} tokens, leaving T/P - L > 0 a multiple of {cpd}"
        )
    return (*counts, n_ring)


def tier_positions(seq_len: int, size: int, balance: bool, local: float = 0.0, groups=()):
    """Per tier in row order: (g, L_g tokens a device, [P, L_g] the row positions each device holds
    of it, in its local order). Tier g covers positions [base, base + P L_g): P/g group regions
    of g L_g tokens, group j (ranks [j g, (j + 1) g)) cut as context parallelism cuts a row of g L_g
    tokens over its g devices (`chunk_table(g, balance)`; the local tier g = 1 is one block)."""
    out, base = [], 0
    for g, n in zip(tier_groups(size, groups), region_sizes(seq_len, size, balance, local, groups)):
        table = chunk_table(g, balance and g > 1)
        tc = n // table.shape[1]
        rows = []
        for d in range(size):
            j, r = divmod(d, g)
            rows.append(np.concatenate([base + j * g * n + int(k) * tc + np.arange(tc) for k in table[r]]))
        out.append((g, n, np.stack(rows).astype(np.int64)))
        base += size * n
    return out


def row_regions(seq_len: int, size: int, balance: bool, local: float = 0.0, groups=()) -> np.ndarray:
    """[P, T/P] the row positions each device holds, in its local order: its local region first
    (device d: positions [d L, (d + 1) L), whole documents, attended with no communication), then
    its chunks of each group tier's group region (`tier_positions`), then its chunks of the full
    ring region (the last P R positions, cut as `chunk_table` cuts a row). With local = 0 and no
    groups this is plain context parallelism's assignment."""
    return np.concatenate([pos for *_, pos in tier_positions(seq_len, size, balance, local, groups)], axis=1)


def _my_chunks(seq: SeqLayout):
    return jnp.asarray(chunk_table(seq.size, seq.balance))[axis_index(seq.axes)]


def shard_sequence(x, seq: SeqLayout, dim: int = SEQ_DIM):
    """This device's positions of x (full length T along `dim`), concatenated as `row_regions`
    orders them: its local region (if any), its chunks of each group tier, then its chunks of the
    full ring region. T / P tokens."""
    if not seq.axes:
        return x
    rank, parts, base = axis_index(seq.axes), [], 0
    for g, n in zip(seq.tiers(), seq.regions(x.shape[dim])):
        table = jnp.asarray(chunk_table(g, seq.balance and g > 1))
        tc = n // table.shape[1]
        for i in range(table.shape[1] if n else 0):
            first = base + (rank // g) * g * n + table[rank % g, i] * tc
            parts.append(lax.dynamic_slice_in_dim(x, first, tc, axis=dim))
        base += seq.size * n
    return jnp.concatenate(parts, axis=dim)


def positions(seq_len: int, seq: SeqLayout):
    """Global positions of this device's tokens (RoPE follows the assignment)."""
    return shard_sequence(jnp.arange(seq_len), seq, dim=0)


def causal_work(size: int, balance: bool, chunk_len: int) -> np.ndarray:
    """Visible (query, key) pairs each device attends under a causal mask, per the block schedule:
    a key chunk before the query chunk is full (Tc^2), the same chunk is its lower triangle."""
    table = chunk_table(size, balance)
    full, diag = chunk_len * chunk_len, chunk_len * (chunk_len + 1) // 2
    return np.array([sum(full * int(qid) + diag for qid in row) for row in table])


# ----------------------------------------------------------------------------- block attention


class BlockAttention(Protocol):
    """One block of attention and its backward given the final o and LSE, as the kernel chosen in
    models/attention.py (`attention.BlockAttention`) computes them; with segment ids of the query
    and key blocks (None: no document mask)."""

    def forward(self, q, k, v, causal: bool, q_seg=None, kv_seg=None): ...

    def backward(self, q, k, v, o, lse, do, causal: bool, q_seg=None, kv_seg=None): ...


def _case(q_id, kv_id):
    """0: key chunk before the query chunk (full), 1: the same chunk (causal), 2: after (skip)."""
    return jnp.where(kv_id < q_id, 0, jnp.where(kv_id == q_id, 1, 2))


def merge(o1, lse1, o2, lse2):
    """Combine two partial attentions over disjoint keys by their LSE; o[B, T, N, H] fp32,
    lse[B, N, T]. Rows empty in both stay (0, -inf), with finite gradients."""
    m = jnp.maximum(lse1, lse2)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = w1 + w2
    nonempty = total > 0
    safe = jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, m + jnp.log(safe), -jnp.inf)
    to_o = lambda w: jnp.transpose(w / safe, (0, 2, 1))[..., None]  # [B, N, T] -> [B, T, N, 1]
    return o1 * to_o(w1) + o2 * to_o(w2), lse


def _split(x, parts: int, dim: int = SEQ_DIM):
    """x cut into `parts` equal chunks along `dim`; None (no segment ids) into `parts` Nones."""
    return [None] * parts if x is None else jnp.split(x, parts, axis=dim)


def _attend_chunks(q, k, v, q_ids, kv_ids, blocks: BlockAttention, q_seg=None, kv_seg=None):
    """Local query chunks (ids q_ids) against key/value chunks (ids kv_ids): (o fp32, lse). With
    the segment ids of the queries and keys ([B, len] each, or None) a query sees only keys of
    its own segment, within the causal schedule of the chunks."""
    qs, ks, vs = _split(q, len(q_ids)), _split(k, len(kv_ids)), _split(v, len(kv_ids))
    q_segs, kv_segs = _split(q_seg, len(q_ids)), _split(kv_seg, len(kv_ids))
    outs, lses = [], []
    for i, qi in enumerate(qs):
        o = lse = None
        for j, (kj, vj) in enumerate(zip(ks, vs)):
            branches = (
                lambda q, k, v, qs, ks: blocks.forward(q, k, v, False, qs, ks),
                lambda q, k, v, qs, ks: blocks.forward(q, k, v, True, qs, ks),
                lambda q, k, v, qs, ks: (
                    jnp.zeros(q.shape, jnp.float32),
                    jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf),
                ),
            )
            ob, lb = lax.switch(_case(q_ids[i], kv_ids[j]), branches, qi, kj, vj, q_segs[i], kv_segs[j])
            o, lse = (ob, lb) if o is None else merge(o, lse, ob, lb)
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=SEQ_DIM), jnp.concatenate(lses, axis=-1)


def _ring_perm(size: int, shift: int = 1, group: int = 0):
    """Pairs of a ring over `size` ranks, or one ring per consecutive group of `group` ranks
    (rank r -> j g + (r - j g + shift) % g): the groups never exchange."""
    g = group or size
    return [(i, i - i % g + (i % g + shift) % g) for i in range(size)]


def _ring_place(seq: SeqLayout):
    """(chunk table of the ring, this device's rank in it): the whole axis, or its group."""
    return jnp.asarray(chunk_table(seq.ring, seq.balance)), axis_index(seq.axes) % seq.ring


# ----------------------------------------------------------------------------- the three variants


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def ring_attention(q, k, v, segments, seq: SeqLayout, blocks: BlockAttention):
    """Causal attention of this device's query chunks over the whole sequence, K/V on a ring (with
    their segment ids, when `segments` [B, T/P] are given). With `seq.group` = g the ring runs
    within each group of g consecutive ranks (a group tier's sequence of g chunks, or 2g)."""
    return _ring_forward(q, k, v, segments, seq, blocks)[0]


def _ring_forward(q, k, v, segments, seq, blocks):
    (table, rank), perm = _ring_place(seq), _ring_perm(seq.size, 1, seq.group)
    o = lse = None
    kv_seg = segments
    for step in range(seq.ring):
        ob, lb = _attend_chunks(q, k, v, table[rank], table[(rank - step) % seq.ring], blocks, segments, kv_seg)
        o, lse = (ob, lb) if o is None else merge(o, lse, ob, lb)
        if step < seq.ring - 1:
            k, v, kv_seg = lax.ppermute((k, v, kv_seg), seq.axes, perm)
    return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, segments, seq, blocks):
    o, lse = _ring_forward(q, k, v, segments, seq, blocks)
    return o, (q, k, v, segments, o, lse)


def _ring_bwd(seq, blocks, residuals, do):
    q, k, v, segments, o, lse = residuals
    (table, rank), perm = _ring_place(seq), _ring_perm(seq.size, 1, seq.group)
    q_ids = table[rank]
    c = seq.chunks_per_device
    qs, os_, dos = _split(q, c), _split(o, c), _split(do, c)
    q_segs, kv_seg = _split(segments, c), segments
    lses = jnp.split(lse, c, axis=-1)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for step in range(seq.ring):
        kv_ids = table[(rank - step) % seq.ring]
        ks, vs, kv_segs = _split(k, c), _split(v, c), _split(kv_seg, c)
        dks, dvs = _split(dk, c), _split(dv, c)
        for i in range(c):
            for j in range(c):
                branches = (
                    lambda q, k, v, o, lse, do, qs, ks: blocks.backward(q, k, v, o, lse, do, False, qs, ks),
                    lambda q, k, v, o, lse, do, qs, ks: blocks.backward(q, k, v, o, lse, do, True, qs, ks),
                    lambda q, k, v, *_: (
                        jnp.zeros(q.shape, jnp.float32),
                        jnp.zeros(k.shape, jnp.float32),
                        jnp.zeros(v.shape, jnp.float32),
                    ),
                )
                dqb, dkb, dvb = lax.switch(
                    _case(q_ids[i], kv_ids[j]),
                    branches,
                    qs[i],
                    ks[j],
                    vs[j],
                    os_[i],
                    lses[i],
                    dos[i],
                    q_segs[i],
                    kv_segs[j],
                )
                dq[i], dks[j], dvs[j] = dq[i] + dqb, dks[j] + dkb, dvs[j] + dvb
        dk, dv = jnp.concatenate(dks, axis=SEQ_DIM), jnp.concatenate(dvs, axis=SEQ_DIM)
        # dK/dV travel with their K/V (and segment ids); after the last step one more hop takes them home.
        if step < seq.ring - 1:
            k, v, kv_seg, dk, dv = lax.ppermute((k, v, kv_seg, dk, dv), seq.axes, perm)
        else:
            dk, dv = lax.ppermute((dk, dv), seq.axes, perm)
    return (jnp.concatenate(dq, axis=SEQ_DIM).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


def allgather_attention(q, k, v, segments, seq: SeqLayout, blocks: BlockAttention):
    """All-gather K/V (and their segment ids) over `seq`, attend the local queries to every chunk
    (autodiff backward)."""
    table = chunk_table(seq.size, seq.balance)
    k_all = all_gather_fwd_reduce_scatter_bwd(k, seq.axes, SEQ_DIM)
    v_all = all_gather_fwd_reduce_scatter_bwd(v, seq.axes, SEQ_DIM)
    seg_all = None if segments is None else lax.all_gather(segments, seq.axes, axis=SEQ_DIM, tiled=True)
    o, _ = _attend_chunks(
        q,
        k_all,
        v_all,
        jnp.asarray(table)[axis_index(seq.axes)],
        jnp.asarray(table.reshape(-1)),
        blocks,
        segments,
        seg_all,
    )
    return o.astype(q.dtype)


def tokenring_attention(q, k, v, segments, seq: SeqLayout, blocks: BlockAttention):
    """Queries hop forward round the ring (with their segment ids); each partial (o, LSE) is sent
    straight back to the device that owns those queries, in the same step (both link directions
    busy)."""
    table, rank = jnp.asarray(chunk_table(seq.size, seq.balance)), axis_index(seq.axes)
    o, lse = _attend_chunks(q, k, v, table[rank], table[rank], blocks, segments, segments)
    visiting, visiting_seg = q, segments
    for step in range(1, seq.size):
        visiting, visiting_seg = lax.ppermute((visiting, visiting_seg), seq.axes, _ring_perm(seq.size))
        ob, lb = _attend_chunks(
            visiting, k, v, table[(rank - step) % seq.size], table[rank], blocks, visiting_seg, segments
        )
        ob, lb = lax.ppermute((ob, lb), seq.axes, _ring_perm(seq.size, -step))
        o, lse = merge(o, lse, ob, lb)
    return o.astype(q.dtype)


def attention(q, k, v, seq: SeqLayout, blocks: BlockAttention, segments=None, local_attention=None):
    """Causal GQA attention of local queries q[B, T/P, N, H] over the sequence split on `seq`.
    `segments` [B, T/P] (this device's tokens' document ids, from `shard_sequence`): a query sees
    only keys of its own document; the ids travel with the keys (ring, all-gather) or with the
    queries (TokenRing).

    With tiers (length-adaptive CP, docs/bytescale.md) the tokens split as `row_regions` orders
    them: the local region's first L hold whole documents, which `local_attention(q, k, v,
    segments)` (one device's causal attention) attends with no communication; each group tier's
    L_g go round a ring within the device's group of g (`seq.group`); only the full ring region's
    K/V (R tokens) go round all P. Documents must not cross the regions (the host plan ensures it)."""
    shapes = "context.attention takes q[B, T/P, N, H], k/v[B, T/P, K, H], segments[B, T/P]"
    chex.assert_rank([q, k, v], 4, custom_message=shapes)
    chex.assert_equal_shape([k, v], custom_message=shapes)
    chex.assert_equal_shape_prefix([q, k], 2, custom_message=shapes)
    if segments is not None:
        chex.assert_shape(segments, q.shape[:2], custom_message=shapes)
        chex.assert_type(segments, int, custom_message=shapes)
    if seq.local or seq.groups:
        if local_attention is None and seq.local:
            raise ValueError("context.attention with a local region needs local_attention (one device's attention)")
        outs, first = [], 0
        for g, n in zip(seq.tiers(), seq.regions(q.shape[SEQ_DIM] * seq.size)):
            part = lambda x: None if x is None else x[:, first : first + n]
            if g == 1 and n:
                outs.append(local_attention(part(q), part(k), part(v), part(segments)).astype(q.dtype))
            elif n:
                tier = dataclasses.replace(seq, local=0.0, groups=(), group=0 if g == seq.size else g)
                outs.append(attention(part(q), part(k), part(v), tier, blocks, part(segments)))
            first += n
        return jnp.concatenate(outs, axis=SEQ_DIM)
    if seq.group and seq.variant != "ring":
        raise ValueError(f"context_parallel={seq.variant!r} within groups of {seq.group}: only 'ring' runs in groups")
    return {"ring": ring_attention, "allgather": allgather_attention, "tokenring": tokenring_attention}[seq.variant](
        q, k, v, segments, seq, blocks
    )


# ----------------------------------------------------------------------------- LASP-2


def lasp2(q, k, v, log_decay, scale: float, seq: SeqLayout, chunk_attention):
    """Causal linear attention over the sequence split on `seq`; q, k, v [B, T/P, N, H] (K/V heads
    already repeated), log_decay [N] of the local heads. `chunk_attention(q, k, v)` -> (o, final
    state) with a zero initial state (the Pallas kernel or the pure-JAX chunked form)."""
    shapes = "context.lasp2 takes q/k[B, T/P, N, H], v[B, T/P, N, Hv], log_decay[N]"
    chex.assert_rank([q, k, v], 4, custom_message=shapes)
    chex.assert_equal_shape([q, k], custom_message=shapes)
    chex.assert_equal_shape_prefix([q, v], 3, custom_message=shapes)
    chex.assert_shape(log_decay, (q.shape[2],), custom_message=shapes)
    c, tc = seq.chunks_per_device, q.shape[SEQ_DIM] // seq.chunks_per_device
    outs, states = [], []
    for qi, ki, vi in zip(_split(q, c), _split(k, c), _split(v, c)):
        o, state = chunk_attention(qi, ki, vi)
        outs.append(o.astype(jnp.float32))
        states.append(state.astype(jnp.float32))
    # The one collective: every chunk's state [B, N, H, Hv], whatever T is.
    gathered = all_gather_fwd_reduce_scatter_bwd(jnp.stack(states), seq.axes, 0)  # [P*c, ...] device order
    table = chunk_table(seq.size, seq.balance)
    in_order = gathered[np.argsort(table.reshape(-1))]  # global chunk order
    chunk_decay = jnp.exp(log_decay.astype(jnp.float32) * tc)[None, :, None, None]
    prefix, entering = jnp.zeros_like(in_order[0]), []
    for g in range(seq.n_chunks):  # exclusive scan: the state entering chunk g
        entering.append(prefix)
        prefix = chunk_decay * prefix + in_order[g]
    entering = jnp.stack(entering)
    my_ids = _my_chunks(seq)
    t_decay = jnp.exp(log_decay.astype(jnp.float32)[None, :] * jnp.arange(1, tc + 1, dtype=jnp.float32)[:, None])
    for i, qi in enumerate(_split(q, c)):
        inter = jnp.einsum("btnh,bnhv->btnv", qi.astype(jnp.float32) * t_decay[None, :, :, None], entering[my_ids[i]])
        outs[i] = outs[i] + scale * inter
    return jnp.concatenate(outs, axis=SEQ_DIM).astype(q.dtype)
