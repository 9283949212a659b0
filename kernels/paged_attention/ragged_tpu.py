"""Ragged paged attention for TPU (Pallas Mosaic). Same semantics as ragged.py's reference and its
generic kernel; `ragged.ragged_paged_attention` picks this variant when the program is lowered for
TPU. The wrapper in ragged.py has already cut the step into work items (one block of <= block_q
queries of one sequence each) and gathered their query tiles [W, K, R, H], R = block_q * Gp.

Grid (W, K, max_pages) (or (W, 1, max_pages), below), as kernel_tpu.py's decode kernel with the
work item in place of the sequence: the page table (flattened to [S * max_pages]) and the items'
sequence, first position and row count are scalar-prefetch operands (`pltpu.PrefetchScalarGridSpec`),
and the k/v BlockSpec index_map reads the page id from them, so the page gather is the pipeline's
own DMA, double-buffered. An item reads its pages 0 .. ceil((last position + 1) / page_size) - 1;
later steps map to its last page again (an unchanged block index starts no DMA) and `pl.when` skips
their compute. Dead items (past the real item count) map every step to the last live item's last
page (`first` = `last`), so they start no DMA either; page ids are clamped to [0, P) in the index
map, so unused table entries cannot send a DMA out of bounds.

The pool is seen as [P, page_size, K * H]: block (page_size, H) at lane block kv_head when H is a
multiple of 128, else the whole K * H lanes with a static Python loop over the K kv heads (Mosaic's
lane blocks must be multiples of 128), as kernel_tpu.py. The query tile block (R, H) is whole in
its last two dims. Scratch across the page axis (fp32): m and l [heads, R, 128] (equal over lanes)
and acc [heads, R, H]; the last step writes o = acc / l (0 for a dead item). Row r of a tile holds
query position pos0 + min(r >> log2(Gp), rows - 1); key c is visible iff c <= that position (with a
logit soft-cap, `softcap`, the scaled scores s are first mapped to softcap * tanh(s / softcap));
values in slots past the item's last position are zeroed (stale slots of a partly written page).
bf16 dots at Precision.DEFAULT, fp32 at HIGHEST, P rounded to the value dtype before P V, as
kernel_tpu.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxsys.kernels import platforms
from jaxsys.kernels.paged_attention.kernel_tpu import _NN, _NT, LANES, MASK_VALUE, _dot

__all__ = ["RaggedTpuConfig", "forward"]


@dataclasses.dataclass(frozen=True)
class RaggedTpuConfig:
    scale: float
    group_shift: int  # log2(Gp)
    interpret: bool = False
    window: int | None = None  # sliding window: a query sees its last `window` positions
    softcap: float | None = None  # logit soft-cap c: scores s -> c * tanh(s / c)


def _kernel(
    pt_ref,
    seq_ref,
    pos_ref,
    rows_ref,
    first_ref,
    last_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    acc_ref,
    *,
    scale: float,
    page_size: int,
    max_pages: int,
    group_shift: int,
    window: int | None,
    softcap: float | None,
):
    """q_ref/o_ref [heads, R, H]; k_ref/v_ref [page_size, heads * H]; scratch m, l [heads, R, 128],
    acc [heads, R, H]."""
    del pt_ref, seq_ref, first_ref, last_ref  # read by the index maps
    w, i = pl.program_id(0), pl.program_id(2)
    pos0, rows = pos_ref[w], rows_ref[w]
    end = pos0 + rows  # keys [0, end) may be visible to the item; 0 for a dead item
    heads, r, h = acc_ref.shape

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    runs = i * page_size < end
    if window is not None:  # pages wholly behind every row's window are skipped
        runs = jnp.logical_and(runs, (i + 1) * page_size > pos0 - window + 1)

    @pl.when(runs)
    def _step():
        kv_k, kv_v = k_ref[...], v_ref[...]
        row = lax.shift_right_logical(lax.broadcasted_iota(jnp.int32, (r, page_size), 0), jnp.int32(group_shift))
        qpos = pos0 + jnp.minimum(row, rows - 1)
        kpos = i * page_size + lax.broadcasted_iota(jnp.int32, (r, page_size), 1)
        visible = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)
        live_slot = i * page_size + lax.broadcasted_iota(jnp.int32, (page_size, h), 0) < end
        for j in range(heads):  # static lane slices of the page
            q, k, v = q_ref[j], kv_k[:, j * h : (j + 1) * h], kv_v[:, j * h : (j + 1) * h]
            v = jnp.where(live_slot, v.astype(jnp.float32), 0.0).astype(v.dtype)
            s = _dot(q, k, _NT) * scale  # [R, page_size]
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(visible, s, MASK_VALUE)
            m_prev, l_prev = m_ref[j], l_ref[j]  # [R, 128]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - platforms.lanes(m_next, page_size)), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[j] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[j] = m_next
            acc_ref[j] = acc_ref[j] * platforms.lanes(alpha, h) + _dot(p.astype(v.dtype), v, _NN)

    @pl.when(i == max_pages - 1)
    def _finish():
        for j in range(heads):
            l = l_ref[j]
            l = jnp.where(l == 0.0, 1.0, l)
            o_ref[j] = (acc_ref[j] / platforms.lanes(l, h)).astype(o_ref.dtype)


def forward(q, k_pages, v_pages, page_table, seq, pos, rows, *, cfg: RaggedTpuConfig):
    """q [W, K, R, H] item tiles, k/v_pages [P, page_size, K, H], page_table [S, max_pages], the
    items' seq / pos / rows [W] (ragged.schedule) -> o [W, K, R, H]."""
    w, kh, r, h = q.shape
    num_pages, page_size = k_pages.shape[:2]
    max_pages = page_table.shape[1]
    heads = 1 if h % LANES == 0 else kh
    kp = k_pages.reshape(num_pages, page_size, kh * h)
    vp = v_pages.reshape(num_pages, page_size, kh * h)
    pt = page_table.reshape(-1).astype(jnp.int32)
    live = rows > 0
    last = jnp.where(live, jnp.clip((pos + rows + page_size - 1) // page_size - 1, 0, max_pages - 1), 0)
    # dead items (all after the live ones) stay on the last live item's last page: no DMA
    n_live = jnp.sum(live.astype(jnp.int32))
    tail = jnp.maximum(n_live - 1, 0)
    seq = jnp.where(live, seq, seq[tail]).astype(jnp.int32)
    last = jnp.where(live, last, last[tail]).astype(jnp.int32)
    # an item's first page: 0, or the one holding its first query's window start
    start = 0 if cfg.window is None else jnp.maximum(pos - cfg.window + 1, 0) // page_size
    first = jnp.where(live, jnp.minimum(start, last), last).astype(jnp.int32)

    def kv_index(wi, hi, i, pt_ref, seq_ref, pos_ref, rows_ref, first_ref, last_ref):
        idx = jnp.minimum(jnp.maximum(i, first_ref[wi]), last_ref[wi])
        page = pt_ref[seq_ref[wi] * max_pages + idx]
        return jnp.minimum(jnp.maximum(page, 0), num_pages - 1), 0, hi

    q_spec = pl.BlockSpec((None, heads, r, h), lambda wi, hi, i, *_: (wi, hi, 0, 0))
    kv_spec = pl.BlockSpec((None, page_size, heads * h), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(w, kh // heads, max_pages),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((heads, r, LANES), jnp.float32),
            pltpu.VMEM((heads, r, LANES), jnp.float32),
            pltpu.VMEM((heads, r, h), jnp.float32),
        ],
    )
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * w * kh * r * max_pages * page_size * h,
        transcendentals=(1 if cfg.softcap is None else 2) * w * kh * r * max_pages * page_size,
        bytes_accessed=2 * w * kh * max_pages * page_size * h * itemsize + 2 * q.size * q.dtype.itemsize,
    )
    return pl.pallas_call(
        functools.partial(
            _kernel,
            scale=cfg.scale,
            page_size=page_size,
            max_pages=max_pages,
            group_shift=cfg.group_shift,
            window=cfg.window,
            softcap=cfg.softcap,
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=cfg.interpret,
        name="ragged_paged_attention_tpu",
    )(pt, seq, pos.astype(jnp.int32), rows.astype(jnp.int32), first, last, q, kp, vp)
