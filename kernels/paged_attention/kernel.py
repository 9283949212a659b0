"""Paged decode attention in Pallas: one query per sequence over a paged KV cache (PagedAttention).

Semantics, layout and argument conventions: reference.py (k/v_pages [P, page_size, K, H],
page_table [B, max_pages], lengths [B], q [B, N, H], GQA with G = N / K).

Generic variant (this file: interpret mode on CPU, Triton on GPU), one program per (sequence, kv
head), grid (B, K):
* the G query heads of the kv head are one [G, H] tile (G padded to a power of two: Triton's
  tensor shapes must be powers of two), pre-multiplied by the scale, in fp32;
* a `fori_loop` walks the sequence's ceil(length / page_size) pages only (a dynamic trip count);
  each step reads the page id from the page table ref *inside the kernel* and loads
  k_pages[page, :, kv_head, :] and the same of v_pages by dynamic index: the page gather is the
  kernel's own loads, no gathered copy of the cache exists;
* online softmax (running max m, sum l, fp32 accumulator acc [G, H]); positions >= length on the
  last page are masked; o = acc / l at the end. With a logit soft-cap c (`softcap`, Gemma 2) a
  page's scores s (q pre-scaled) become c * tanh(s / c) before the mask.
Scores and P V are computed as broadcast products reduced along H (resp. the page), in fp32, not
as dots: G is 1-8 in practice and Triton's `tl.dot` needs >= 16 rows; decode is bound by reading
the cache, not by these FLOPs. fp32 inputs are therefore exact fp32 products (no TF32).

TPU variant (kernel_tpu.py, Mosaic): grid (B, K, max_pages) with the page table and lengths as
scalar-prefetch operands read by the k/v BlockSpec index_maps (the pipeline's DMAs do the
gather). `paged_attention` chooses per lowering platform (kernels/platforms.py): interpret mode
when lowered for CPU, Mosaic for TPU, Triton otherwise; `backend="generic"` / `"tpu"` forces one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention.reference import check_softcap
from jaxsys.kernels.paged_attention import kernel_tpu
from jaxsys.kernels.paged_attention.reference import check_inputs

__all__ = ["paged_attention"]

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class GenericConfig:
    scale: float
    interpret: bool = True
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None  # sliding window: the last `window` positions only
    softcap: float | None = None  # logit soft-cap c: scores s -> c * tanh(s / c)


def first_page(length, page_size: int, window: int | None):
    """The first page a row of cache length `length` reads: 0, or with a sliding window the page
    of position length - window (the pages before it are never read)."""
    if window is None:
        return 0
    return lax.div(jnp.maximum(length - window, 0), page_size)


def window_visible(pos, length, window: int | None):
    """Positions a row of cache length `length` sees: < length, and >= length - window."""
    visible = pos < length
    return visible if window is None else visible & (pos >= length - window)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def head_parts(h: int) -> tuple[pl.Slice, ...]:
    """The head dim H as powers of two, largest first (576 -> 512 + 64; a power of two: itself):
    the generic kernels load and multiply a head dim in these parts, Triton's tensor shapes being
    powers of two, so a cache row need not be padded to one (MLA's latent, docs/mla.md)."""
    out, start = [], 0
    for bit in reversed(range(h.bit_length())):
        if h & (1 << bit):
            out.append(pl.ds(start, 1 << bit))
            start += 1 << bit
    return tuple(out)


def _generic_kernel(
    pt_ref, len_ref, q_ref, k_ref, v_ref, o_ref, *, page_size: int, scale: float, window, softcap: float | None
):
    b, kh = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    n_pages = lax.div(length + page_size - 1, page_size)
    g, h = q_ref.shape
    parts = head_parts(h)
    qs = [q_ref[:, part].astype(jnp.float32) * scale for part in parts]  # [G, H] in parts

    def body(i, carry):
        m, l, acc = carry
        page = pt_ref[b, i]
        ks = [k_ref[page, :, kh, part].astype(jnp.float32) for part in parts]  # [page_size, H] in parts
        vs = [v_ref[page, :, kh, part].astype(jnp.float32) for part in parts]
        s = sum(jnp.sum(q[:, None, :] * k[None, :, :], axis=2) for q, k in zip(qs, ks))  # [G, page_size]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = i * page_size + lax.broadcasted_iota(jnp.int32, (g, page_size), 1)
        visible = window_visible(pos, length, window)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = tuple(alpha[:, None] * a + jnp.sum(p[:, :, None] * v[None, :, :], axis=1) for a, v in zip(acc, vs))
        return m_new, l, acc

    zeros = tuple(jnp.zeros((g, part.size), jnp.float32) for part in parts)
    carry = (jnp.full((g,), MASK_VALUE, jnp.float32), jnp.zeros((g,), jnp.float32), zeros)
    _, l, acc = lax.fori_loop(first_page(length, page_size, window), n_pages, body, carry)
    for part, a in zip(parts, acc):
        o_ref[:, part] = (a / l[:, None]).astype(o_ref.dtype)


def triton_params(cfg, page_size: int, h: int, split_heads: bool = False):
    """Triton's launch parameters for a compiled (not interpreted) generic kernel, after checking
    that its tile shapes are powers of two (with `split_heads`, a kernel that takes H in
    `head_parts`: every part at least 16, i.e. H a multiple of 16); None when interpreted or left
    to Triton's defaults. `cfg` has interpret, num_warps and num_stages (GenericConfig,
    kernel_quant.QuantConfig)."""
    if cfg.interpret:
        return None
    head_ok = h % 16 == 0 if split_heads else _pow2(h)
    bad = {name: v for name, v, ok in (("page_size", page_size, _pow2(page_size)), ("H", h, head_ok)) if not ok}
    if bad:
        need = "page_size a power of two and H a multiple of 16" if split_heads else "page_size and H powers of two"
        raise ValueError(
            f"the Triton paged-attention kernel needs {need} (Triton tensor shapes are powers of two); got {bad}"
        )
    if cfg.num_warps is None and cfg.num_stages is None:
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _generic(q, k_pages, v_pages, page_table, lengths, *, cfg: GenericConfig):
    """q [B, K, G, H] -> o [B, K, G, H] (G padded by the caller)."""
    b, kh, g, h = q.shape
    page_size = k_pages.shape[1]
    compiler_params = triton_params(cfg, page_size, h, split_heads=True)
    whole = lambda shape: pl.BlockSpec(shape, lambda bi, hi: (0,) * len(shape))
    q_spec = pl.BlockSpec((None, None, g, h), lambda bi, hi: (bi, hi, 0, 0))
    return pl.pallas_call(
        functools.partial(
            _generic_kernel, page_size=page_size, scale=cfg.scale, window=cfg.window, softcap=cfg.softcap
        ),
        grid=(b, kh),
        in_specs=[whole(page_table.shape), whole(lengths.shape), q_spec, whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=cfg.interpret,
        name="paged_attention",
    )(page_table.astype(jnp.int32), lengths.astype(jnp.int32), q, k_pages, v_pages)


def _pad_rows(x, rows: int):
    """x [B, K, G, H] with G padded to `rows` (zero queries; their outputs are sliced off)."""
    g = x.shape[2]
    return x if g == rows else jnp.pad(x, ((0, 0), (0, 0), (0, rows - g), (0, 0)))


def _variant(fn, rows_for):
    """fn on q [B, K, G, H] padded to rows_for(G, dtype) rows, sliced back (each variant pads
    differently; lax.platform_dependent's branches must agree in output shape)."""

    def run(q, k_pages, v_pages, page_table, lengths, *, cfg):
        g = q.shape[2]
        out = fn(_pad_rows(q, rows_for(g, q.dtype)), k_pages, v_pages, page_table, lengths, cfg=cfg)
        return out[:, :, :g]

    return run


_VARIANTS = {
    "generic": (_variant(_generic, lambda g, dtype: int(pl.next_power_of_2(g))),),
    "tpu": (
        _variant(kernel_tpu.forward, lambda g, dtype: -(-g // kernel_tpu.sublanes(dtype)) * kernel_tpu.sublanes(dtype)),
    ),
}


def paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    lengths,
    *,
    scale=None,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
    window=None,
    softcap: float | None = None,
):
    """Decode attention over a paged KV cache, as `reference.paged_attention_reference`.

    q [B, N, H]; k_pages, v_pages [P, page_size, K, H]; page_table [B, max_pages] int32 (page ids
    of each sequence in order; entries past a sequence's pages are never read); lengths [B] int32
    in [1, max_pages * page_size]. Returns [B, N, H] in q.dtype. scale defaults to H ** -0.5.
    interpret / backend as in kernels/platforms.py: None interprets when lowered for CPU, runs the
    Mosaic variant on TPU and Triton elsewhere. num_warps / num_stages: Triton launch parameters.
    window: sliding-window attention (the last `window` positions; pages before them are not read).
    softcap: logit soft-capping (Gemma 2), None or 0 (off) or c > 0: the scaled scores s become
    c * tanh(s / c) before the mask and the softmax.

    Page ids and lengths are trusted: an id outside [0, P) reads out of bounds (no check on
    device), and lengths are range-checked only when they are concrete."""
    check_inputs(q, k_pages, v_pages, page_table, lengths)
    b, n, h = q.shape
    kh = k_pages.shape[2]
    scale = float(h**-0.5 if scale is None else scale)
    softcap = check_softcap(softcap)
    plan = platforms.plan(
        backend,
        interpret,
        GenericConfig(scale, num_warps=num_warps, num_stages=num_stages, window=window, softcap=softcap),
        kernel_tpu.TpuConfig(scale, window=window, softcap=softcap),
    )
    qg = q.reshape(b, kh, n // kh, h)
    out = platforms.dispatch(
        plan, _VARIANTS, 0, qg, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32)
    )
    return out.reshape(b, n, h)
