"""Paged decode attention for TPU (Pallas Mosaic). Same semantics as `reference.py` and the generic
kernel in kernel.py; kernel.py's `paged_attention` picks this variant when the program is lowered
for TPU.

Grid (B, K, max_pages) (or (B, 1, max_pages), below): one (sequence, kv head) pair per outer index, its pages along the last,
"arbitrary" axis. The page table (flattened to [B * max_pages]) and the lengths are scalar-prefetch
operands (`pltpu.PrefetchScalarGridSpec`): they sit in SMEM before the grid starts, and the
BlockSpec index_map of k_pages / v_pages reads them, so the page gather is the pipeline's own DMA
(double-buffered: page i + 1 is fetched while page i is computed). Steps past a sequence's last
page map to the last page again: an unchanged block index starts no DMA, and `pl.when` skips the
compute, so only ceil(length / page_size) pages are read.

The pool is seen as [P, page_size, K * H] (a free reshape of [P, page_size, K, H]): block
(page_size, H) at lane block kv_head is one page of one kv head. Mosaic tiles the last two dims of
a block by (8, 128) or takes them whole: page_size is a whole dim (any page size). When H is a
multiple of 128 the grid is (B, K, max_pages) and each program sees one kv head; otherwise (H = 64,
say) the lane block must be the whole K * H, so the grid is (B, 1, max_pages) and each program
loops over the K kv heads in Python, with static lane slices of the page ([G, H] tiles and
scratch per head).

The G = N / K query heads of a kv head form one [G, H] tile, padded to the dtype's sublane tile
(8 rows fp32, 16 bf16) in the wrapper. Scratch across the page axis (fp32): the running max m and
sum l as [G, 128] (equal over lanes, as in flash_attention/kernel_tpu.py) and acc [G, H]; the
last step writes o = acc / l. With a logit soft-cap c (`softcap`) the scaled scores s become
c * tanh(s / c) before the mask. bf16 dots take Precision.DEFAULT explicitly (Mosaic rejects an fp32
contraction of bf16 operands, which jax_default_matmul_precision="highest" would ask for).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxsys.kernels import platforms

__all__ = ["TpuConfig", "forward"]

LANES = 128
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    scale: float
    interpret: bool = False
    window: int | None = None  # sliding window: the last `window` positions only
    softcap: float | None = None  # logit soft-cap c: scores s -> c * tanh(s / c)


def _dot(a, b, dims):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def sublanes(dtype) -> int:
    return 8 * 4 // jnp.dtype(dtype).itemsize


def _kernel(
    pt_ref,
    len_ref,
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
    window: int | None,
    softcap: float | None,
):
    """q_ref/o_ref [heads, G, H]; k_ref/v_ref [page_size, heads * H] (one page of `heads` kv
    heads); scratch m, l [heads, G, 128], acc [heads, G, H]."""
    del pt_ref  # read by the index maps
    b, i = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    heads, _, h = acc_ref.shape

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    runs = i * page_size < length
    if window is not None:  # pages wholly before the window are skipped
        runs = jnp.logical_and(runs, (i + 1) * page_size > length - window)

    @pl.when(runs)
    def _step():
        kv_k, kv_v = k_ref[...], v_ref[...]
        for j in range(heads):  # static lane slices of the page
            q, k, v = q_ref[j], kv_k[:, j * h : (j + 1) * h], kv_v[:, j * h : (j + 1) * h]
            s = _dot(q, k, _NT) * scale  # [G, page_size]
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            pos = i * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            visible = pos < length if window is None else (pos < length) & (pos >= length - window)
            s = jnp.where(visible, s, MASK_VALUE)
            m_prev, l_prev = m_ref[j], l_ref[j]  # [G, 128]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - platforms.lanes(m_next, page_size)), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[j] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[j] = m_next
            acc_ref[j] = acc_ref[j] * platforms.lanes(alpha, h) + _dot(p.astype(v.dtype), v, _NN)

    @pl.when(i == max_pages - 1)
    def _finish():
        for j in range(heads):
            o_ref[j] = (acc_ref[j] / platforms.lanes(l_ref[j], h)).astype(o_ref.dtype)


def forward(q, k_pages, v_pages, page_table, lengths, *, cfg: TpuConfig):
    """q [B, K, G, H] (G padded to the sublane tile by the caller), k/v_pages [P, page_size, K, H],
    page_table [B, max_pages], lengths [B] -> o [B, K, G, H]."""
    b, kh, g, h = q.shape
    num_pages, page_size = k_pages.shape[:2]
    max_pages = page_table.shape[1]
    # one kv head per program when its lane block is legal (H a multiple of 128), else all K
    heads = 1 if h % LANES == 0 else kh
    kp = k_pages.reshape(num_pages, page_size, kh * h)
    vp = v_pages.reshape(num_pages, page_size, kh * h)
    pt = page_table.reshape(-1).astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)

    def kv_index(bi, hi, i, pt_ref, len_ref):  # skipped steps keep a page that runs: no DMA
        last = jnp.maximum(lax.div(len_ref[bi] + page_size - 1, page_size) - 1, 0)
        first = 0 if cfg.window is None else lax.div(jnp.maximum(len_ref[bi] - cfg.window, 0), page_size)
        return pt_ref[bi * max_pages + jnp.clip(i, first, last)], 0, hi

    q_spec = pl.BlockSpec((None, heads, g, h), lambda bi, hi, i, pt_ref, len_ref: (bi, hi, 0, 0))
    kv_spec = pl.BlockSpec((None, page_size, heads * h), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh // heads, max_pages),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((heads, g, LANES), jnp.float32),
            pltpu.VMEM((heads, g, LANES), jnp.float32),
            pltpu.VMEM((heads, g, h), jnp.float32),
        ],
    )
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * b * kh * g * max_pages * page_size * h,
        transcendentals=(1 if cfg.softcap is None else 2) * b * kh * g * max_pages * page_size,
        bytes_accessed=2 * b * kh * max_pages * page_size * h * itemsize + 2 * q.size * q.dtype.itemsize,
    )
    return pl.pallas_call(
        functools.partial(
            _kernel,
            scale=cfg.scale,
            page_size=page_size,
            max_pages=max_pages,
            window=cfg.window,
            softcap=cfg.softcap,
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=cfg.interpret,
        name="paged_attention_tpu",
    )(pt, lengths, q, kp, vp)
