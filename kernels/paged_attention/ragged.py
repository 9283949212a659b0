"""Ragged paged attention: a serving step's queries, grouped by sequence, over a paged KV cache.

A step holds decodes (one query per sequence), prefill chunks (C queries) and speculative verifies
(k + 1 queries) at once. Sequence s owns the contiguous query rows cu_q_lens[s]:cu_q_lens[s + 1]
(q_len_s >= 1 of them) at the consecutive positions kv_lens[s] - q_len_s .. kv_lens[s] - 1: its
cache already holds this step's keys and values, and query j of the sequence sees the keys at
positions <= its own (causal inside the chunk). The per-row decode kernel (kernel.py) reads the
sequence's pages once per query row; this one reads them once per *query block* of a sequence.

Layout (one layer), as reference.py, with T query rows and S sequence slots:
- q [T, N, H]; k_pages, v_pages [P, page_size, K, H]; N a multiple of K (GQA, G = N / K);
- page_table [S, max_pages] int32: token t of sequence s is in page page_table[s, t // page_size],
  slot t % page_size; entries past ceil(kv_lens[s] / page_size) are never read;
- cu_q_lens [S + 1] int32: query offsets, cu_q_lens[0] = 0, non-decreasing up to num_seqs;
- kv_lens [S] int32: tokens in s's cache after this step's writes, q_len_s <= kv_lens[s] <=
  max_pages * page_size;
- num_seqs: int32 scalar (shape () or (1,)), the sequences in use (<= S). Sequences >= num_seqs
  and their cu_q_lens / kv_lens / page_table entries are ignored; rows at or past
  cu_q_lens[num_seqs] are padding: their output is 0.
T, S and max_pages are static (the engine pads them to buckets); offsets and lengths are dynamic.
Output [T, N, H] in q.dtype, scores and softmax in fp32, scale defaulting to H ** -0.5. With a
logit soft-cap c (`softcap`, Gemma 2) the scaled scores s become c * tanh(s / c) before the mask.

Work items. Each sequence's rows are cut into blocks of `block_q` query tokens; a work item is one
(sequence, block) pair. Their number is dynamic but at most W = min(T, (T + S (block_q - 1)) //
block_q) (sum over sequences of ceil(q_len / block_q)), the static size of the grid; items past the
real count are dead (they read nothing and their output is never used). `schedule` computes, per
item, its sequence, first query row and position and its number of rows, and per query row, its
item and row within it (cheap XLA on [S] and [T] arrays). The wrapper gathers each item's rows of q
into a [W, K, block_q * Gp, H] tensor (Gp = G rounded up to a power of two; row r of a tile is
query token r // Gp of the block, head r % Gp of the kv head's group; padded tokens and heads are
zero queries) and scatters the output back: the kernels only ever see whole, aligned tiles. That
costs a gather and a scatter of q and o (block_q-padded), small next to the KV pages.

Generic kernel (interpret mode on CPU, Triton on GPU), grid (W, K): program (w, kv head) keeps the
[block_q * Gp, H] query tile and walks the item's pages 0 .. ceil((last position + 1) / page_size)
- 1 in a `fori_loop` (a dynamic trip count: the causal bound of the block's last query, so a
prefill chunk's early blocks read fewer pages), loading each page id from the page table inside the
kernel and the page of its kv head by dynamic index, as kernel.py. Online softmax in fp32 (m, l,
acc [block_q * Gp, H]); key position c is visible to the row of query position p iff c <= p (which
also masks slots past kv_len); values in slots past the block's last position are zeroed so that
stale (even NaN) slots of a partly written page never reach the output. Scores and P V are
`tl.dot`s with fp32 accumulation when every tile dim is >= 16 (Triton's minimum), fp32 operands at
HIGHEST (IEEE, no TF32), bf16 ones with P rounded to the value dtype as in flash attention; tiles
with a dim < 16 use broadcast products reduced in fp32 (exact, as kernel.py).

The TPU (Mosaic) variant is ragged_tpu.py; `ragged_paged_attention` chooses per lowering platform as
kernel.py's `paged_attention` does (kernels/platforms.py).

Quantized pages (KIVI, quant.py; `ragged_paged_attention_quant`, generic variant only): the engine's
rule is that what a query sees depends only on its position: the query at position p reads page i
from the quantized pool iff i < n_quant(p + 1) = max((p + 1) // page_size - residual, 0)
(kernel_quant.py's per-row default, the row's length being p + 1), else from the full-precision
pool. Within one block that count grows with the row, so the kernel walks three page ranges sharing
one softmax carry: pages every row of the block reads quantized, pages some rows read quantized and
others full precision (both pools loaded, the row chooses; with block_q <= page_size at most one
page: the page boundary the block crosses), and pages every row reads full precision. An explicit
`quant_pages` [S] instead gives each sequence one count for all its queries (a read view's, as
kernel_quant.py's `quant_pages` per row).

docs/kernels_paged_attention.md, section "Ragged paged attention".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention.reference import check_softcap, softcapped
from jaxsys.kernels.paged_attention import quant, ragged_tpu
from jaxsys.kernels.paged_attention.kernel import MASK_VALUE, head_parts, triton_params
from jaxsys.kernels.paged_attention.kernel_quant import check_quant_inputs
from jaxsys.kernels.paged_attention.reference import gather_pages

__all__ = [
    "DEFAULT_BLOCK_Q",
    "Schedule",
    "check_ragged_inputs",
    "num_items",
    "schedule",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_quant",
    "ragged_paged_attention_quant_reference",
]

DEFAULT_BLOCK_Q = 16
_TRITON_DOT_MIN = 16  # Triton's tl.dot needs every dim >= 16
# the most elements of a program's [rows, H] query tile in the generic kernel: larger item tiles
# are split over a third grid axis (MLA's latent cache: 16 heads x 16 tokens x H = 1024 asked an
# H100 for 640 KB of shared memory; 16 x 1024 fits). Every tile of H <= 128 and <= 128 rows stays whole.
_TILE_ELEMENTS = 16384


def row_block(rows: int, h: int, limit: int = _TILE_ELEMENTS) -> int:
    """Rows of an item tile [rows, H] one generic program takes: all of them, or the largest power
    of two (at least 16, the dot form's minimum, or all rows if fewer) whose tile has <= `limit`
    elements."""
    rb = rows
    while rb > _TRITON_DOT_MIN and rb * h > limit:
        rb //= 2
    return rb


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# ----------------------------------------------------------------------------- inputs and schedule


def check_ragged_inputs(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, block_q=None) -> None:
    """Raise ValueError, naming the constraint and the values, for inputs ragged paged attention
    cannot take. The dynamic values (offsets, lengths, num_seqs) are checked only when all three are
    concrete (not traced); page ids are never checked."""
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(
            f"ragged paged attention takes q[T, N, H] and k_pages/v_pages[P, page_size, K, H]; "
            f"got q{q.shape}, k_pages{k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape; got {k_pages.shape}, {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype; got {k_pages.dtype}, {v_pages.dtype}")
    t, n, h = q.shape
    _, page_size, kh, hk = k_pages.shape
    if hk != h:
        raise ValueError(f"head dims differ: q has H={h}, k_pages/v_pages have H={hk}")
    if kh == 0 or n % kh:
        raise ValueError(
            f"the number of query heads N must be a multiple of the number of kv heads K; got N={n}, K={kh}"
        )
    if t == 0:
        raise ValueError("q must have at least one row (T >= 1)")
    if page_table.ndim != 2 or page_table.shape[0] == 0 or page_table.shape[1] == 0:
        raise ValueError(f"page_table must have shape [S, max_pages] with S, max_pages >= 1; got {page_table.shape}")
    s, max_pages = page_table.shape
    if kv_lens.shape != (s,):
        raise ValueError(f"kv_lens must have shape [S] = {(s,)}; got {kv_lens.shape}")
    if cu_q_lens.shape != (s + 1,):
        raise ValueError(f"cu_q_lens must have shape [S + 1] = {(s + 1,)}; got {cu_q_lens.shape}")
    if jnp.shape(num_seqs) not in ((), (1,)):
        raise ValueError(f"num_seqs must be an int32 scalar (shape () or (1,)); got shape {jnp.shape(num_seqs)}")
    for name, a in (("page_table", page_table), ("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), ("num_seqs", num_seqs)):
        if not jnp.issubdtype(jnp.result_type(a), jnp.integer):
            raise ValueError(f"{name} must be integer (int32); got {jnp.result_type(a)}")
    if block_q is not None and (not isinstance(block_q, int) or not _pow2(block_q)):
        raise ValueError(f"block_q must be a power of two >= 1; got {block_q!r}")
    try:  # concrete values only (a traced array raises a TracerArrayConversionError here)
        cu, lens, ns = np.asarray(cu_q_lens), np.asarray(kv_lens), int(np.asarray(num_seqs).reshape(()))
    except Exception:  # noqa: BLE001 - traced: nothing to check
        return
    if not 0 <= ns <= s:
        raise ValueError(f"num_seqs must lie in [0, S] = [0, {s}]; got {ns}")
    cu, lens = cu[: ns + 1], lens[:ns]
    if cu[0] != 0 or cu[-1] > t:
        raise ValueError(f"cu_q_lens must start at 0 and end (at num_seqs={ns}) <= T={t}; got {cu.tolist()}")
    q_lens = np.diff(cu)
    if (q_lens < 1).any():
        raise ValueError(f"every sequence in use needs q_len >= 1 (non-decreasing cu_q_lens); got {q_lens.tolist()}")
    cap = max_pages * page_size
    if (lens < q_lens).any() or (lens > cap).any():
        raise ValueError(
            f"kv_lens must lie in [q_len, max_pages * page_size] (max_pages={max_pages}, "
            f"page_size={page_size}: {cap}) for the sequences in use; got kv_lens {lens.tolist()}, "
            f"q_lens {q_lens.tolist()}"
        )


def num_items(num_tokens: int, num_seq_slots: int, block_q: int) -> int:
    """The static number W of work items: sum_s ceil(q_len_s / block_q) over at most S sequences
    holding at most T rows is <= (T + S (block_q - 1)) // block_q, and <= T."""
    return max(1, min(num_tokens, (num_tokens + num_seq_slots * (block_q - 1)) // block_q))


class Schedule(NamedTuple):
    """Work items [W] (dead ones: rows 0, pos 0) and the query rows' places [T] (`schedule`)."""

    seq: jax.Array  # [W] the item's sequence
    q0: jax.Array  # [W] its first query row
    pos: jax.Array  # [W] the position of its first query
    rows: jax.Array  # [W] its query rows, 1..block_q (0: dead)
    tok_item: jax.Array  # [T] the item of each query row
    tok_row: jax.Array  # [T] its row in the item
    tok_pos: jax.Array  # [T] its position
    tok_seq: jax.Array  # [T] its sequence
    tok_live: jax.Array  # [T] False for padding rows


def schedule(cu_q_lens, kv_lens, num_seqs, num_tokens: int, block_q: int) -> Schedule:
    """Work items and row places for T = num_tokens query rows (module docstring); traceable.
    Offsets past num_seqs are ignored (replaced by cu_q_lens[num_seqs])."""
    s = kv_lens.shape[0]
    kv = kv_lens.astype(jnp.int32)
    ns = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, s)
    cu = cu_q_lens.astype(jnp.int32)
    cu = jnp.where(jnp.arange(s + 1) <= ns, cu, cu[ns])
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    w = jnp.arange(num_items(num_tokens, s, block_q), dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right").astype(jnp.int32), s - 1)
    live = w < ends[-1]
    j = w - starts[seq]
    q0 = cu[seq] + j * block_q
    rows = jnp.where(live, jnp.clip(cu[seq + 1] - q0, 0, block_q), 0)
    pos = jnp.where(live, kv[seq] - q_lens[seq] + j * block_q, 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32), s - 1)
    tlive = (t >= cu[0]) & (t < cu[ns])
    off = t - cu[tseq]
    zero = jnp.zeros_like(t)
    return Schedule(
        seq=seq,
        q0=jnp.where(live, q0, 0),
        pos=pos,
        rows=rows,
        tok_item=jnp.where(tlive, starts[tseq] + off // block_q, zero),
        tok_row=jnp.where(tlive, off % block_q, zero),
        tok_pos=jnp.where(tlive, kv[tseq] - q_lens[tseq] + off, zero),
        tok_seq=tseq,
        tok_live=tlive,
    )


def _gather_queries(q, sch: Schedule, kh: int, block_q: int, gp: int):
    """q [T, N, H] -> the items' query tiles [W, K, block_q * Gp, H] (zeros past each item's rows
    and in the padded heads)."""
    t, n, h = q.shape
    g = n // kh
    idx = sch.q0[:, None] + jnp.arange(block_q)[None, :]  # [W, block_q]
    valid = jnp.arange(block_q)[None, :] < sch.rows[:, None]
    qi = q.reshape(t, kh, g, h)[jnp.clip(idx, 0, t - 1)]  # [W, block_q, K, G, H]
    qi = jnp.where(valid[:, :, None, None, None], qi, jnp.zeros((), q.dtype))
    if gp != g:
        qi = jnp.pad(qi, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
    w = qi.shape[0]
    return qi.transpose(0, 2, 1, 3, 4).reshape(w, kh, block_q * gp, h)


def _scatter_outputs(o, sch: Schedule, n: int, block_q: int, gp: int):
    """The items' output tiles [W, K, block_q * Gp, H] -> o [T, N, H] (0 on padding rows)."""
    w, kh, _, h = o.shape
    g = n // kh
    o = o.reshape(w, kh, block_q, gp, h)[:, :, :, :g].transpose(0, 2, 1, 3, 4).reshape(w, block_q, n, h)
    out = o[sch.tok_item, sch.tok_row]  # [T, N, H]
    return jnp.where(sch.tok_live[:, None, None], out, jnp.zeros((), o.dtype))


# ----------------------------------------------------------------------------- references


def _attend_rows(q, keys, values, tok_pos, tok_live, scale, window=None, softcap=None):
    """q [T, N, H], keys/values [T, L, K, H] (row t's sequence laid out contiguously), causal by
    position (and with `window` only the row's last `window` positions), scaled scores s soft-capped
    to c * tanh(s / c) with `softcap` c -> [T, N, H] in q.dtype, fp32 scores and softmax, zeros on
    padding rows."""
    softcap = check_softcap(softcap)
    t, n, h = q.shape
    length, kh = keys.shape[1], keys.shape[2]
    qg = q.reshape(t, kh, n // kh, h).astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    scores = jnp.einsum("tkgh,tskh->tkgs", qg, keys.astype(jnp.float32), precision=hi) * scale
    scores = softcapped(scores, softcap)
    visible = jnp.arange(length)[None, :] <= tok_pos[:, None]  # [T, L]
    if window is not None:
        visible = visible & (jnp.arange(length)[None, :] > tok_pos[:, None] - window)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgs,tskh->tkgh", p, values.astype(jnp.float32), precision=hi).reshape(t, n, h)
    return jnp.where(tok_live[:, None, None], o, 0.0).astype(q.dtype)


def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    page_table,
    cu_q_lens,
    kv_lens,
    num_seqs,
    *,
    scale=None,
    block_q=None,
    interpret=None,
    backend=None,
    window=None,
    softcap=None,
):
    """Pure JAX, the semantics of `ragged_paged_attention` (module docstring): each query row's
    sequence gathered into a contiguous [max_pages * page_size, K, H] cache, keys at positions <= the
    row's position visible, one fp32 softmax per row; padding rows 0. Materialises [T, max_pages *
    page_size, K, H]: for tests and small shapes. block_q, interpret and backend are accepted (and
    ignored) so that it can stand in for the kernel."""
    del block_q, interpret, backend
    check_ragged_inputs(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs)
    sch = schedule(cu_q_lens, kv_lens, num_seqs, q.shape[0], 1)
    rows_table = page_table.astype(jnp.int32)[sch.tok_seq]  # [T, max_pages]
    scale = q.shape[2] ** -0.5 if scale is None else scale
    k, v = gather_pages(k_pages, rows_table), gather_pages(v_pages, rows_table)
    return _attend_rows(q, k, v, sch.tok_pos, sch.tok_live, scale, window, softcap)


def _quant_pages_per_row(sch: Schedule, page_size: int, residual: int, quant_pages):
    """The quantized page count of each query row: n_quant(position + 1), or its sequence's
    quant_pages when given."""
    if quant_pages is None:
        return quant.n_quant(sch.tok_pos + 1, page_size, residual)
    return quant_pages.astype(jnp.int32)[sch.tok_seq]


def ragged_paged_attention_quant_reference(
    q,
    k_pages,
    v_pages,
    qp: dict,
    quant_table,
    fp_table,
    cu_q_lens,
    kv_lens,
    num_seqs,
    *,
    mode: str,
    residual: int = 0,
    quant_pages=None,
    scale=None,
    block_q=None,
    interpret=None,
    window=None,
    softcap=None,
):
    """Pure JAX, the semantics of `ragged_paged_attention_quant`: the query at position p reads page
    i dequantized from the quantized pool (page id quant_table[s, i]) iff i < n_quant(p + 1) (or
    i < quant_pages[s] when given), else from the full-precision pool (fp_table[s, i]); then as
    `ragged_paged_attention_reference`. block_q and interpret are accepted and ignored."""
    del block_q, interpret
    check_ragged_inputs(q, k_pages, v_pages, quant_table, cu_q_lens, kv_lens, num_seqs)
    check_quant_inputs(k_pages, qp, mode)
    sch = schedule(cu_q_lens, kv_lens, num_seqs, q.shape[0], 1)
    page_size, max_pages = k_pages.shape[1], quant_table.shape[1]
    nq = _quant_pages_per_row(sch, page_size, int(residual), quant_pages)
    use_q = jnp.arange(max_pages)[None, :] < nq[:, None]  # [T, max_pages]
    kd, vd = quant.dequantize_pages(qp, mode)
    tq, tf = quant_table.astype(jnp.int32)[sch.tok_seq], fp_table.astype(jnp.int32)[sch.tok_seq]
    t = q.shape[0]
    sel = lambda deq, fp: jnp.where(use_q[:, :, None, None, None], deq[tq], fp.astype(jnp.float32)[tf]).reshape(
        t, max_pages * page_size, *fp.shape[2:]
    )
    scale = q.shape[2] ** -0.5 if scale is None else scale
    return _attend_rows(q, sel(kd, k_pages), sel(vd, v_pages), sch.tok_pos, sch.tok_live, scale, window, softcap)


# ----------------------------------------------------------------------------- generic kernels


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    scale: float
    group_shift: int  # log2(Gp): row r of a tile is query token r >> group_shift of its block
    interpret: bool = True
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None  # sliding window: a query sees its last `window` positions
    softcap: float | None = None  # logit soft-cap c: scores s -> c * tanh(s / c)
    row_block: int | None = None  # rows of an item tile per program (None: `row_block`'s choice)


@dataclasses.dataclass(frozen=True)
class RaggedQuantConfig:
    scale: float
    group_shift: int
    bits: int
    residual: int
    explicit: bool  # quant_pages given (one count per sequence) rather than n_quant of the position
    interpret: bool = True
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None
    softcap: float | None = None


def _mm(a, b, contract_b: int, use_dot: bool):
    """a [M, C] times b ([N, C] when contract_b is 1, [C, N] when 0) -> [M, N] in fp32: a dot with
    fp32 accumulation (fp32 operands at HIGHEST), or broadcast products reduced in fp32."""
    if use_dot:
        dtype = jnp.promote_types(a.dtype, b.dtype)
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
        return lax.dot_general(
            a.astype(dtype),
            b.astype(dtype),
            (((1,), (contract_b,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if contract_b == 1:
        return jnp.sum(a[:, None, :] * b[None, :, :], axis=2)
    return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)


def _item(seq_ref, pos_ref, rows_ref, r: int, page_size: int, group_shift: int, row0=0):
    """The program's work item: (sequence, first and last query position, pages to read, each tile
    row's query position [R, page_size] (padded rows take the last row's)). `row0`: the item tile's
    row this program's R rows start at (a split tile)."""
    w = pl.program_id(0)
    seq, pos0, rows = seq_ref[w], pos_ref[w], rows_ref[w]
    last = pos0 + rows - 1
    n_pages = lax.div(pos0 + rows + page_size - 1, page_size)  # 0 for a dead item (pos0 = rows = 0)
    tile_row = lax.broadcasted_iota(jnp.int32, (r, page_size), 0) + row0
    row = lax.shift_right_logical(tile_row, jnp.int32(group_shift))
    qpos = pos0 + jnp.minimum(row, rows - 1)
    return seq, pos0, last, n_pages, qpos


def _visible(kpos, qpos, window):
    """Key positions a row at query position qpos sees: <= qpos, and > qpos - window."""
    visible = kpos <= qpos
    return visible if window is None else visible & (kpos > qpos - window)


def _first_page(pos0, page_size: int, window):
    """The first page an item whose first query is at pos0 reads (the pages wholly behind every
    row's window are never read)."""
    return 0 if window is None else lax.div(jnp.maximum(pos0 - window + 1, 0), page_size)


def _cap(s, softcap: float | None):
    """The logit soft-cap of scaled scores s inside a kernel: c * tanh(s / c), or s (None)."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _online_softmax_step(carry, s, visible, pv):
    """One page of the online softmax: s [R, page_size] fp32 scores, `visible` its mask, pv(p) the
    [R, H] (or parts) product of the probabilities with the page's values."""
    m, l, acc = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = jax.tree.map(lambda a, x: alpha[:, None] * a + x, acc, pv(p))
    return m_new, l, acc


def _finish(l, acc):
    """o = acc / l; a dead item (l = 0, nothing read) gives 0."""
    l = jnp.where(l == 0.0, 1.0, l)
    return jax.tree.map(lambda a: a / l[:, None], acc)


def _generic_kernel(pt_ref, seq_ref, pos_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, *, page_size: int, cfg):
    kh = pl.program_id(1)
    r, h = q_ref.shape
    parts = head_parts(h)  # H in powers of two (a latent cache row of 576: 512 + 64)
    qs = [q_ref[:, part] for part in parts]  # [R, H] in parts
    row0 = pl.program_id(2) * r  # this program's rows of the item tile
    seq, pos0, last, n_pages, qpos = _item(seq_ref, pos_ref, rows_ref, r, page_size, cfg.group_shift, row0)
    use_dot = min(r, page_size, parts[-1].size) >= _TRITON_DOT_MIN
    fresh = lambda i, part: i * page_size + lax.broadcasted_iota(jnp.int32, (page_size, part.size), 0) <= last

    def body(i, carry):
        page = pt_ref[seq, i]
        ks = [k_ref[page, :, kh, part] for part in parts]  # [page_size, H] in parts
        # stale slots past the block zeroed
        vs = [jnp.where(fresh(i, part), v_ref[page, :, kh, part], jnp.zeros((), v_ref.dtype)) for part in parts]
        kpos = i * page_size + lax.broadcasted_iota(jnp.int32, (r, page_size), 1)
        s = _cap(sum(_mm(q, k, 1, use_dot) for q, k in zip(qs, ks)) * cfg.scale, cfg.softcap)
        pv = lambda p: tuple(_mm(p.astype(v.dtype) if use_dot else p, v, 0, use_dot) for v in vs)
        return _online_softmax_step(carry, s, _visible(kpos, qpos, cfg.window), pv)

    zeros = tuple(jnp.zeros((r, part.size), jnp.float32) for part in parts)
    carry = (jnp.full((r,), MASK_VALUE, jnp.float32), jnp.zeros((r,), jnp.float32), zeros)
    start = jnp.minimum(_first_page(pos0, page_size, cfg.window), n_pages)
    _, l, acc = lax.fori_loop(start, n_pages, body, carry)
    for part, o in zip(parts, _finish(l, acc)):
        o_ref[:, part] = o.astype(o_ref.dtype)


def _whole(a):
    return pl.BlockSpec(a.shape, lambda *grid, nd=a.ndim: (0,) * nd)


def _generic(q, k_pages, v_pages, page_table, seq, pos, rows, *, cfg: RaggedConfig):
    """q [W, K, R, H] item tiles -> o [W, K, R, H]; grid (W, K, R / Rb), program (w, kv head, c)
    taking the tile's rows c Rb .. (c + 1) Rb (`row_block`; one program per tile unless it is large)."""
    w, kh, r, h = q.shape
    page_size = k_pages.shape[1]
    rb = cfg.row_block or row_block(r, h)
    if r % rb:
        raise ValueError(f"row_block={rb} must divide the item tile's {r} rows (block_q x Gp)")
    q_spec = pl.BlockSpec((None, None, rb, h), lambda wi, hi, ci: (wi, hi, ci, 0))
    operands = (page_table, seq, pos, rows)
    return pl.pallas_call(
        functools.partial(_generic_kernel, page_size=page_size, cfg=cfg),
        grid=(w, kh, r // rb),
        in_specs=[_whole(a) for a in operands] + [q_spec, _whole(k_pages), _whole(v_pages)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(cfg, page_size, h, split_heads=True),
        interpret=cfg.interpret,
        name="ragged_paged_attention",
    )(*operands, q, k_pages, v_pages)


_VARIANTS = {"generic": (_generic,), "tpu": (ragged_tpu.forward,)}


def _quant_kernel(
    tq_ref,
    tf_ref,
    seq_ref,
    pos_ref,
    rows_ref,
    nq_ref,
    q_ref,
    k_ref,
    v_ref,
    kq_ref,
    vq_ref,
    ks_ref,
    kz_ref,
    vs_ref,
    vz_ref,
    o_ref,
    *,
    page_size: int,
    cfg: RaggedQuantConfig,
):
    kh = pl.program_id(1)
    bits = cfg.bits
    n = 8 // bits
    r, h = q_ref.shape
    hp = h // n
    parts = [pl.ds(j * hp, hp) for j in range(n)]
    seq, pos0, last, n_pages, qpos = _item(seq_ref, pos_ref, rows_ref, r, page_size, cfg.group_shift)
    qs = [q_ref[:, part] for part in parts]  # n x [R, Hp]
    use_dot = min(r, page_size, hp) >= _TRITON_DOT_MIN
    cdt = q_ref.dtype if use_dot else jnp.float32  # dequantized tiles enter the dots in q's dtype
    mask = 2**bits - 1
    slot = lax.broadcasted_iota(jnp.int32, (page_size, hp), 0)
    # quantized pages per row [R, page_size] (equal along the page), and the block's range of them
    if cfg.explicit:
        nq_seq = nq_ref[seq]
        nq_row, lo, hi = jnp.full((r, page_size), nq_seq, jnp.int32), nq_seq, nq_seq
    else:
        rule = lambda p: jnp.maximum(lax.div(p + 1, page_size) - cfg.residual, 0)
        nq_row, lo, hi = rule(qpos), rule(pos0), rule(last)
    start = jnp.minimum(_first_page(pos0, page_size, cfg.window), n_pages)
    lo = jnp.clip(lo, start, n_pages)
    hi = jnp.clip(hi, lo, n_pages)

    def stat(ref, page, j):
        """A scale / zero tile: [1, Hp] of part j (per channel) or [page_size, 1] (per token)."""
        per_channel = ref.shape[3] > 1
        return ref[page, :, kh, parts[j] if per_channel else pl.ds(0, 1)].astype(jnp.float32)

    def quant_page(i):
        page = tq_ref[seq, i]
        kb = kq_ref[page, :, kh, :].astype(jnp.int32)  # [page_size, Hp]
        vb = vq_ref[page, :, kh, :].astype(jnp.int32)
        deq = lambda b, s_ref, z_ref, j: (
            (((b >> (bits * j)) & mask).astype(jnp.float32)) * stat(s_ref, page, j) + stat(z_ref, page, j)
        )
        ks = [deq(kb, ks_ref, kz_ref, j).astype(cdt) for j in range(n)]
        vs = [deq(vb, vs_ref, vz_ref, j).astype(cdt) for j in range(n)]
        return ks, vs

    def fp_page(i):
        page = tf_ref[seq, i]
        return [k_ref[page, :, kh, part] for part in parts], [v_ref[page, :, kh, part] for part in parts]

    def scores_and_pv(i, ks, vs):
        vs = [jnp.where(i * page_size + slot <= last, v, jnp.zeros((), v.dtype)) for v in vs]
        s = _cap(sum(_mm(qj, kj, 1, use_dot) for qj, kj in zip(qs, ks)) * cfg.scale, cfg.softcap)  # [R, page_size]
        pv = lambda p: tuple(_mm(p.astype(v.dtype) if use_dot else p, v, 0, use_dot) for v in vs)
        return s, pv

    def kpos_visible(i):
        return _visible(i * page_size + lax.broadcasted_iota(jnp.int32, (r, page_size), 1), qpos, cfg.window)

    def one_pool(load):
        def step(i, carry):
            s, pv = scores_and_pv(i, *load(i))
            return _online_softmax_step(carry, s, kpos_visible(i), pv)

        return step

    def both_pools(i, carry):
        """A page some rows read quantized (i < their count) and the others full precision."""
        s_q, pv_q = scores_and_pv(i, *quant_page(i))
        s_f, pv_f = scores_and_pv(i, *fp_page(i))
        use_q = i < nq_row  # [R, page_size]
        s = jnp.where(use_q, s_q, s_f)
        pv = lambda p: jax.tree.map(lambda a, b: a + b, pv_q(jnp.where(use_q, p, 0.0)), pv_f(jnp.where(use_q, 0.0, p)))
        return _online_softmax_step(carry, s, kpos_visible(i), pv)

    carry = (
        jnp.full((r,), MASK_VALUE, jnp.float32),
        jnp.zeros((r,), jnp.float32),
        tuple(jnp.zeros((r, hp), jnp.float32) for _ in range(n)),
    )
    carry = lax.fori_loop(start, lo, one_pool(quant_page), carry)
    if not cfg.explicit:
        carry = lax.fori_loop(lo, hi, both_pools, carry)
    _, l, acc = lax.fori_loop(hi, n_pages, one_pool(fp_page), carry)
    for part, a in zip(parts, _finish(l, acc)):
        o_ref[:, part] = a.astype(o_ref.dtype)


def _quant_generic(q, k_pages, v_pages, qp, quant_table, fp_table, seq, pos, rows, nq, *, cfg: RaggedQuantConfig):
    w, kh, r, h = q.shape
    page_size = k_pages.shape[1]
    q_spec = pl.BlockSpec((None, None, r, h), lambda wi, hi: (wi, hi, 0, 0))
    names = ("kq", "vq", "ks", "kz", "vs", "vz")
    head = (quant_table, fp_table, seq, pos, rows, nq)
    tail = (k_pages, v_pages) + tuple(qp[name] for name in names)
    return pl.pallas_call(
        functools.partial(_quant_kernel, page_size=page_size, cfg=cfg),
        grid=(w, kh),
        in_specs=[_whole(a) for a in head] + [q_spec] + [_whole(a) for a in tail],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(cfg, page_size, h),
        interpret=cfg.interpret,
        name="ragged_paged_attention_quant",
    )(*head, q, *tail)


# ----------------------------------------------------------------------------- public functions


def _prepare(q, k_pages, cu_q_lens, kv_lens, num_seqs, block_q):
    t, n, h = q.shape
    kh = k_pages.shape[2]
    gp = int(pl.next_power_of_2(n // kh))
    sch = schedule(cu_q_lens, kv_lens, num_seqs, t, block_q)
    return sch, gp, _gather_queries(q, sch, kh, block_q, gp)


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    cu_q_lens,
    kv_lens,
    num_seqs,
    *,
    scale=None,
    block_q: int = DEFAULT_BLOCK_Q,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
    window=None,
    softcap: float | None = None,
    row_block: int | None = None,
):
    """Attention of a step's ragged query blocks over a paged KV cache, as
    `ragged_paged_attention_reference` (module docstring for the layout).

    q [T, N, H]; k_pages, v_pages [P, page_size, K, H]; page_table [S, max_pages] int32;
    cu_q_lens [S + 1] int32 (sequence s owns rows cu_q_lens[s]:cu_q_lens[s + 1]); kv_lens [S] int32
    (its queries are at positions kv_lens[s] - q_len_s .. kv_lens[s] - 1, causal among themselves);
    num_seqs an int32 scalar (sequences in use; rows past cu_q_lens[num_seqs] are padding and get 0).
    Returns [T, N, H] in q.dtype. scale defaults to H ** -0.5. block_q (a power of two): query
    tokens per work item. interpret / backend as in kernels/platforms.py: None interprets when
    lowered for CPU, runs the Mosaic variant (ragged_tpu.py) on TPU and Triton elsewhere.
    num_warps / num_stages: Triton launch parameters. window: sliding-window attention (a query
    sees its last `window` positions; pages wholly behind a block's windows are not read).
    softcap: logit soft-capping (Gemma 2), None or 0 (off) or c > 0: the scaled scores s become
    c * tanh(s / c) before the mask and the softmax. row_block (generic variant): rows of an item's
    [block_q x Gp, H] query tile per program, a power of two dividing it (None: the whole tile, or
    for a tile over 16K elements the largest part under it, `row_block`).

    Page ids, offsets and lengths are trusted under jit (checked only when concrete): an id outside
    [0, P) reads out of bounds in the generic variant."""
    if row_block is not None and (not isinstance(row_block, int) or not _pow2(row_block)):
        raise ValueError(f"row_block must be a power of two >= 1; got {row_block!r}")
    check_ragged_inputs(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs, block_q)
    t, n, h = q.shape
    scale = float(h**-0.5 if scale is None else scale)
    sch, gp, qi = _prepare(q, k_pages, cu_q_lens, kv_lens, num_seqs, block_q)
    shift = gp.bit_length() - 1
    softcap = check_softcap(softcap)
    plan = platforms.plan(
        backend,
        interpret,
        RaggedConfig(
            scale,
            shift,
            num_warps=num_warps,
            num_stages=num_stages,
            window=window,
            softcap=softcap,
            row_block=row_block,
        ),
        ragged_tpu.RaggedTpuConfig(scale, shift, window=window, softcap=softcap),
    )
    o = platforms.dispatch(
        plan, _VARIANTS, 0, qi, k_pages, v_pages, page_table.astype(jnp.int32), sch.seq, sch.pos, sch.rows
    )
    return _scatter_outputs(o, sch, n, block_q, gp)


def ragged_paged_attention_quant(
    q,
    k_pages,
    v_pages,
    qp: dict,
    quant_table,
    fp_table,
    cu_q_lens,
    kv_lens,
    num_seqs,
    *,
    mode: str,
    residual: int = 0,
    quant_pages=None,
    scale=None,
    block_q: int = DEFAULT_BLOCK_Q,
    interpret=None,
    num_warps=None,
    num_stages=None,
    window=None,
    softcap: float | None = None,
):
    """Ragged paged attention over a quantized (KIVI) cache, as
    `ragged_paged_attention_quant_reference`: q, cu_q_lens, kv_lens, num_seqs as
    `ragged_paged_attention`; k_pages, v_pages [Pf, page_size, K, H] the full-precision pool; qp
    the quantized pool (quant.page_shapes(mode, Pq, ...)); quant_table, fp_table [S, max_pages]
    page ids into each pool (entries a sequence's queries do not read from that pool are never
    read). The query at position p reads page i quantized iff i < max((p + 1) // page_size -
    residual, 0), or, with quant_pages [S] given, iff i < quant_pages[s] for every query of s.
    window and softcap as in `ragged_paged_attention`. Generic variant only (interpret mode on CPU, Triton elsewhere; no Mosaic variant)."""
    check_ragged_inputs(q, k_pages, v_pages, quant_table, cu_q_lens, kv_lens, num_seqs, block_q)
    check_quant_inputs(k_pages, qp, mode)
    if fp_table.shape != quant_table.shape:
        raise ValueError(f"fp_table must have quant_table's shape {quant_table.shape}; got {fp_table.shape}")
    s = quant_table.shape[0]
    if quant_pages is not None and quant_pages.shape != (s,):
        raise ValueError(f"quant_pages must have shape [S] = {(s,)}; got {quant_pages.shape}")
    t, n, h = q.shape
    scale = float(h**-0.5 if scale is None else scale)
    sch, gp, qi = _prepare(q, k_pages, cu_q_lens, kv_lens, num_seqs, block_q)
    cfg = RaggedQuantConfig(
        scale,
        gp.bit_length() - 1,
        quant.MODES[mode][0],
        int(residual),
        quant_pages is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        window=window,
        softcap=check_softcap(softcap),
    )
    plan = platforms.plan("generic", interpret, cfg, None)
    nq = jnp.zeros((s,), jnp.int32) if quant_pages is None else quant_pages.astype(jnp.int32)
    o = platforms.dispatch(
        plan,
        {"generic": (_quant_generic,)},
        0,
        qi,
        k_pages,
        v_pages,
        qp,
        quant_table.astype(jnp.int32),
        fp_table.astype(jnp.int32),
        sch.seq,
        sch.pos,
        sch.rows,
        nq,
    )
    return _scatter_outputs(o, sch, n, block_q, gp)
