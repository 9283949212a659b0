"""Context parallelism over the `seq` mesh axis: the sequence of every batch row is split over P
devices, and attention, the one layer that mixes positions, communicates.

Assignment. The sequence is cut into chunks of Tc tokens. Without load balancing device r holds chunk
r (P chunks). With it (`model.context_load_balance`), there are 2P chunks and device r holds r and
2P-1-r (the zigzag of Megatron-CP / striped attention), so under a causal mask every device sees
the same number of visible (query, key) pairs. The tokens, targets and RoPE positions of a device
are its chunks' (`shard_sequence`, `positions`); nothing else in the model knows.

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

    @classmethod
    def of(cls, layout, m) -> "SeqLayout":
        axes = layout.compute_axes("seq")
        local = layout.seq_local if axes else 0.0
        return cls(axes, layout.size(axes), bool(m.context_load_balance), m.context_parallel, local)

    def regions(self, seq_len: int) -> tuple[int, int]:
        """(L, R): a device's tokens in its local region and in the ring region, of a row of
        `seq_len` positions (`row_regions`)."""
        return region_sizes(seq_len, self.size, self.balance, self.local)

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


def region_sizes(seq_len: int, size: int, balance: bool, local: float) -> tuple[int, int]:
    """(L, R) per device: tokens of its local region and of the ring region, L = local * T / P.
    Raises ValueError when they are not whole (the config checks this first)."""
    per, cpd = seq_len // size, 2 if balance else 1
    if not local:
        return 0, per
    n_local = int(round(local * per))
    if seq_len % size or abs(n_local - local * per) > 1e-6 or (per - n_local) % cpd or not 0 <= n_local < per:
        raise ValueError(
            f"a row of T={seq_len} on {size} devices (zigzag: {balance}) has no local region of {local} of each "
            f"device's T/P tokens: T/P and L = local * T/P must be whole, with T/P - L > 0 a multiple of {cpd}"
        )
    return n_local, per - n_local


def row_regions(seq_len: int, size: int, balance: bool, local: float = 0.0) -> np.ndarray:
    """[P, T/P] the row positions each device holds, in its local order: its local region first
    (device d: positions [d L, (d + 1) L), whole documents, attended with no communication), then
    its chunks of the ring region (positions [P L, T), cut as `chunk_table` cuts a row). With
    local = 0 this is plain context parallelism's assignment."""
    n_local, n_ring = region_sizes(seq_len, size, balance, local)
    table = chunk_table(size, balance)
    tc = n_ring // table.shape[1]
    rows = []
    for d in range(size):
        parts = [np.arange(d * n_local, (d + 1) * n_local)]
        parts += [size * n_local + int(k) * tc + np.arange(tc) for k in table[d]]
        rows.append(np.concatenate(parts))
    return np.stack(rows)


def _my_chunks(seq: SeqLayout):
    return jnp.asarray(chunk_table(seq.size, seq.balance))[axis_index(seq.axes)]


def shard_sequence(x, seq: SeqLayout, dim: int = SEQ_DIM):
    """This device's positions of x (full length T along `dim`), concatenated as `row_regions`
    orders them: its local region (if any), then its chunks of the ring region. T / P tokens."""
    if not seq.axes:
        return x
    n_local, n_ring = seq.regions(x.shape[dim])
    tc = n_ring // seq.chunks_per_device
    ids, base = _my_chunks(seq), seq.size * n_local
    parts = [lax.dynamic_slice_in_dim(x, axis_index(seq.axes) * n_local, n_local, axis=dim)] if n_local else []
    parts += [lax.dynamic_slice_in_dim(x, base + ids[i] * tc, tc, axis=dim) for i in range(seq.chunks_per_device)]
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


def _ring_perm(size: int, shift: int = 1):
    return [(i, (i + shift) % size) for i in range(size)]


# ----------------------------------------------------------------------------- the three variants


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def ring_attention(q, k, v, segments, seq: SeqLayout, blocks: BlockAttention):
    """Causal attention of this device's query chunks over the whole sequence, K/V on a ring (with
    their segment ids, when `segments` [B, T/P] are given)."""
    return _ring_forward(q, k, v, segments, seq, blocks)[0]


def _ring_forward(q, k, v, segments, seq, blocks):
    table, rank = jnp.asarray(chunk_table(seq.size, seq.balance)), axis_index(seq.axes)
    o = lse = None
    kv_seg = segments
    for step in range(seq.size):
        ob, lb = _attend_chunks(q, k, v, table[rank], table[(rank - step) % seq.size], blocks, segments, kv_seg)
        o, lse = (ob, lb) if o is None else merge(o, lse, ob, lb)
        if step < seq.size - 1:
            k, v, kv_seg = lax.ppermute((k, v, kv_seg), seq.axes, _ring_perm(seq.size))
    return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, segments, seq, blocks):
    o, lse = _ring_forward(q, k, v, segments, seq, blocks)
    return o, (q, k, v, segments, o, lse)


def _ring_bwd(seq, blocks, residuals, do):
    q, k, v, segments, o, lse = residuals
    table, rank = jnp.asarray(chunk_table(seq.size, seq.balance)), axis_index(seq.axes)
    q_ids = table[rank]
    c = seq.chunks_per_device
    qs, os_, dos = _split(q, c), _split(o, c), _split(do, c)
    q_segs, kv_seg = _split(segments, c), segments
    lses = jnp.split(lse, c, axis=-1)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for step in range(seq.size):
        kv_ids = table[(rank - step) % seq.size]
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
        if step < seq.size - 1:
            k, v, kv_seg, dk, dv = lax.ppermute((k, v, kv_seg, dk, dv), seq.axes, _ring_perm(seq.size))
        else:
            dk, dv = lax.ppermute((dk, dv), seq.axes, _ring_perm(seq.size))
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

    With a local region (`seq.local`, length-adaptive CP, docs/bytescale.md) the first L tokens
    hold whole documents: `local_attention(q, k, v, segments)` (one device's causal attention)
    attends them with no communication, and only the ring region's K/V (T/P - L tokens) go
    round the ring. Documents must not cross the regions (the host plan ensures it)."""
    shapes = "context.attention takes q[B, T/P, N, H], k/v[B, T/P, K, H], segments[B, T/P]"
    chex.assert_rank([q, k, v], 4, custom_message=shapes)
    chex.assert_equal_shape([k, v], custom_message=shapes)
    chex.assert_equal_shape_prefix([q, k], 2, custom_message=shapes)
    if segments is not None:
        chex.assert_shape(segments, q.shape[:2], custom_message=shapes)
        chex.assert_type(segments, int, custom_message=shapes)
    if seq.local:
        n_local = seq.regions(q.shape[SEQ_DIM] * seq.size)[0]
        if local_attention is None:
            raise ValueError("context.attention with a local region needs local_attention (one device's attention)")
        head = lambda x: None if x is None else x[:, :n_local]
        tail = lambda x: None if x is None else x[:, n_local:]
        o_local = local_attention(head(q), head(k), head(v), head(segments))
        o_ring = attention(tail(q), tail(k), tail(v), dataclasses.replace(seq, local=0.0), blocks, tail(segments))
        return jnp.concatenate([o_local.astype(q.dtype), o_ring], axis=SEQ_DIM)
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
