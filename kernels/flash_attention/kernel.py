"""FlashAttention-2 in Pallas: forward with online softmax, backward as two kernels (dq; dk/dv).

Written against the generic Pallas API only (`pl.pallas_call`, a grid, `pl.BlockSpec`, ref
indexing, `lax.fori_loop`), so one source runs in interpret mode on CPU and lowers through Triton on
GPU. Shapes follow the reference: q[B, T, N, H], k/v[B, S, K, H], G = N / K query heads per kv head,
o[B, T, N, H], lse[B, N, T] (fp32, natural log). Tiles are block_q x block_k (powers of two, >= 16).

Forward, one program per (q block i, b, n): q_i[block_q, H] stays resident while a loop walks the
kv blocks of kv head n // G, keeping the running row max m, row sum l and unnormalised output acc
in fp32; at the end o = acc / l and lse = m + log l.

exp2: the scores are multiplied once by scale * log2(e), so every exponential is exp2 (one ex2 on a
GPU, where exp costs an extra multiply per score element); m is then in log2 units and the lse
written out is converted back to natural log (m * ln 2 + log l), so its contract is unchanged. The
backward likewise computes P = exp2(s * scale * log2(e) - lse * log2(e)).

Backward (FlashAttention-2's split, no atomics), with P = exp(s - lse), dP = dO V^T and
Delta = rowsum(dO * O) - dlse (the lse cotangent folds in here: d lse_i / d s_ij = P_ij):
- dq kernel, one program per (q block, b, n): loops over kv blocks, dQ = scale * sum dS K with
  dS = P * (dP - Delta);
- dk/dv kernel, one program per (kv block, b, kv head): loops over the G query heads of its group
  and over the q blocks, dV = sum P^T dO, dK = scale * sum dS^T Q. Summing the group inside the
  kernel means no per-query-head dk/dv is materialised and no repeat of K/V exists anywhere.

Causal: kv blocks entirely above the diagonal are never visited (the loop bounds depend on the
program id), which halves the FLOPs; blocks entirely below it skip the causal mask.

Sliding window W (`window`, causal only: query t sees keys t - W < s <= t): a q block's loop
starts at the kv block of its first row's first key, so blocks wholly behind every row's window
are never visited (O(T W) work); blocks straddling the window's far edge are masked like the
diagonal's, those wholly inside it run unmasked. The dk/dv kernel likewise stops at the last q
block that sees its keys. The Mosaic GPU kernels have no window: such calls run here.

Logit soft-capping c (`softcap`, Gemma 2; reference.softcapped): the scaled scores become
c * tanh(s / c) before any mask. The forward computes them as tanh(q.k * (scale / c)) * (c * log2(e)),
so they stay in log2 units for exp2; the backward recomputes t = tanh(q.k * scale / c) with P and
multiplies dS by the cap's derivative 1 - t^2 (dq, dk keep their final factor of scale). The
derivative is per score, so flash_attention_backward with the final o and lse of a longer
attention (ring attention) stays exact. The Mosaic GPU kernels have no cap: such calls run here.

Segment ids: a (q block, kv block) pair whose id ranges do not overlap is skipped (`lax.cond` in
the loop body, in all three kernels), so packed documents cost their own attention plus the
blocks that straddle document boundaries, not the whole row's.

Padding: T and S are padded up to a multiple of the block sizes; padded keys are masked by index,
padded queries carry dO = 0 and are sliced off, so they add nothing to dk/dv.

Empty rows (nothing visible, e.g. a query whose segment has no keys in this block) give o = 0 and
lse = -inf and contribute nothing to the gradients; no NaN is produced on the way.

Tiles and launch parameters. block_q / block_k (and the backward's) left None come from the
tuning cache for (head dim, dtype, causal, T bucket) on the current device kind (kernels/tuning.py,
docs/kernels_tuning.md), else 128; Triton's num_warps / num_stages likewise, else the per-head-dim
defaults of `_default_launch`. Explicit arguments win. The TPU variant is not tuned.

Platforms. The kernels here are the "generic" variant (interpret mode on CPU, Triton on GPU); TPUs
get kernel_tpu.py's Mosaic variant. The public functions choose per lowering platform with
`lax.platform_dependent` (every branch is traced, only the one for the platform being lowered
for is lowered), so a program jitted on a CPU host and lowered ahead of time for TPU devices gets
the Mosaic kernels; `backend="tpu"` or `backend="generic"` forces one variant (kernels/platforms.py).
On a Hopper GPU, a supported call runs kernel_mgpu.py's Mosaic GPU kernels instead of Triton
(`_mgpu_config` decides at trace time; `backend="mosaic_gpu"` forces them); their backward is the
generic one here only where kernel_mgpu's does not apply (S not a multiple of 128).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .. import platforms, tuning
from . import kernel_mgpu, kernel_tpu
from .reference import INTERPRET_HEAD_DIMS, KERNEL_HEAD_DIMS, check_inputs, check_softcap

__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward"]

# Finite stand-in for -inf inside the kernels: masked scores never win a row max, and
# exp(MASK - m) is 0 or (for an all-masked block) exp(0), which the visibility mask then zeroes.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Scores are kept in log2 units (scale * log2(e) folded into one multiply) so that the softmax
# exponentials are exp2, one ex2 instruction on a GPU; lse leaves the kernel in natural log.
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
DEFAULT_BLOCK = 128  # the tiles when neither the caller nor the tuning cache gives one


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) parameters of one call; the custom_vjp's non-differentiable argument."""

    scale: float
    causal: bool
    block_q: int  # the tiles of the kernel being run; the backward runs with bwd_block_*
    block_k: int
    bwd_block_q: int
    bwd_block_k: int
    interpret: bool
    num_warps: int | None = None  # Triton launch parameters; None: _compiler_params' defaults
    num_stages: int | None = None
    window: int | None = None  # sliding window (causal): a query sees its last `window` keys
    softcap: float | None = None  # logit soft-cap c: scaled scores s -> c * tanh(s / c)


# ----------------------------------------------------------------------------------------------
# Shared pieces of the kernels.


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul contracting a's dim contract_a with b's dim contract_b, fp32 accumulation."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _visible(q_start, k_start, shape, *, causal: bool, kv_len: int | None, q_seg, kv_seg, window=None):
    """Boolean [block_q, block_k] mask of the (query, key) pairs that may attend, or None."""
    mask = None
    if causal:
        rows = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        mask = rows >= cols if window is None else (rows >= cols) & (rows - cols < window)
    if kv_len is not None:  # keys past the true length are padding
        cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        mask = cols < kv_len if mask is None else mask & (cols < kv_len)
    if q_seg is not None:
        seg = q_seg[:, None] == kv_seg[None, :]
        mask = seg if mask is None else mask & seg
    return mask


def _scores_log2(qk, scale: float, softcap: float | None):
    """The scores of the fp32 q.k products in log2 units, s * log2(e) with s = scale * q.k, or with a
    soft-cap c, c * tanh(s / c) * log2(e) (reference.softcapped): one multiply before the tanh and one
    after. Also returns t = tanh(s / c), whose 1 - t^2 the backward needs (None without a cap)."""
    if softcap is None:
        return qk * (scale * LOG2_E), None
    t = jnp.tanh(qk * (scale / softcap))
    return t * (softcap * LOG2_E), t


def _segments_meet(q_seg, kv_seg):
    """Whether a block of query segment ids and a block of key segment ids can share a visible
    pair: their [min, max] ranges overlap. Disjoint ranges share no id, so a block pair where this
    is False is wholly masked and skipped. For packed rows (documents in order, ids not decreasing)
    overlapping ranges do share an id, so every wholly masked pair is skipped; for other ids it
    only skips fewer blocks."""
    return jnp.logical_and(jnp.min(q_seg) <= jnp.max(kv_seg), jnp.min(kv_seg) <= jnp.max(q_seg))


def _skip_unless(meet, body):
    """body(j, carry) run only where `meet(j)` (segment ids: the blocks can share a visible pair);
    elsewhere the carry passes through. `meet` None runs every block."""
    if meet is None:
        return body
    return lambda j, carry: lax.cond(meet(j), lambda c: body(j, c), lambda c: c, carry)


def _causal_kv_range(i, block_q: int, block_k: int, num_kv_blocks: int, window=None):
    """For q block i: (n_start, n_inner, n_full, n_end). kv blocks [n_inner, n_full) lie wholly on
    or below the diagonal and, with a sliding window, wholly inside every row's window (no mask
    needed); [n_full, n_end) straddle the diagonal and [n_start, n_inner) the window's far edge
    (masked); blocks outside [n_start, n_end) are all masked and never visited. Without a window
    n_start = n_inner = 0."""
    n_end = jnp.minimum(lax.div((i + 1) * block_q + block_k - 1, block_k), num_kv_blocks)
    n_full = jnp.minimum(lax.div(i * block_q + 1, block_k), n_end)
    if window is None:
        return 0, 0, n_full, n_end
    # the first key the block's first row sees, and the first that its last row sees too
    n_start = jnp.minimum(lax.div(jnp.maximum(i * block_q - window + 1, 0), block_k), n_full)
    n_inner = lax.div(jnp.maximum((i + 1) * block_q - window, 0) + block_k - 1, block_k)
    return n_start, jnp.clip(n_inner, n_start, n_full), n_full, n_end


def _causal_q_range(j, block_q: int, block_k: int, num_q_blocks: int, window=None):
    """For kv block j: (n_start, n_full, n_outer, n_stop). q blocks [n_start, n_full) straddle the
    diagonal, [n_full, n_outer) see the whole kv block, and with a sliding window [n_outer,
    n_stop) straddle its far edge; blocks outside [n_start, n_stop) are all masked. Without a
    window n_outer = n_stop = num_q_blocks."""
    n_start = jnp.minimum(lax.div(j * block_k, block_q), num_q_blocks)
    n_full = jnp.maximum(jnp.minimum(lax.div((j + 1) * block_k - 1 + block_q - 1, block_q), num_q_blocks), n_start)
    if window is None:
        return n_start, n_full, num_q_blocks, num_q_blocks
    # one past the last query that sees the block's last key; the q blocks whose every row is
    # within the window of the block's first key
    n_stop = jnp.maximum(jnp.minimum(lax.div((j + 1) * block_k - 2 + window, block_q) + 1, num_q_blocks), n_full)
    n_outer = jnp.clip(lax.div(j * block_k + window, block_q), n_full, n_stop)
    return n_start, n_full, n_outer, n_stop


def _split_refs(refs, n_in: int, has_segments: bool):
    """Split a kernel's refs into (inputs, q_seg_ref, kv_seg_ref, outputs)."""
    ins = refs[:n_in]
    if has_segments:
        return ins, refs[n_in], refs[n_in + 1], refs[n_in + 2 :]
    return ins, None, None, refs[n_in:]


# ----------------------------------------------------------------------------------------------
# Forward kernel: grid (q blocks, B, N).


def _fwd_kernel(*refs, cfg: _Config, kv_len, num_kv_blocks: int, has_segments: bool):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = _split_refs(refs, 3, has_segments)
    bq, bk = cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_seg = None if qs_ref is None else qs_ref[...]
    h = q.shape[-1]

    def body(j, carry, *, causal_mask: bool):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s, _ = _scores_log2(_dot(q, k, 1, 1), cfg.scale, cfg.softcap)  # [bq, bk]; s, m in log2 units
        mask = _visible(
            i * bq,
            start,
            (bq, bk),
            causal=causal_mask,
            kv_len=kv_len,
            q_seg=q_seg,
            kv_seg=None if ks_ref is None else ks_ref[pl.ds(start, bk)],
            window=cfg.window,
        )
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, 1, 0)
        return acc, m_new, l

    carry = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    meet = None if ks_ref is None else lambda j: _segments_meet(q_seg, ks_ref[pl.ds(pl.multiple_of(j * bk, bk), bk)])
    run = lambda causal_mask: _skip_unless(meet, functools.partial(body, causal_mask=causal_mask))
    if cfg.causal:
        n_start, n_inner, n_full, n_end = _causal_kv_range(i, bq, bk, num_kv_blocks, cfg.window)
        if cfg.window is not None:
            carry = lax.fori_loop(n_start, n_inner, run(True), carry)
        carry = lax.fori_loop(n_inner, n_full, run(False), carry)
        carry = lax.fori_loop(n_full, n_end, run(True), carry)
    else:
        carry = lax.fori_loop(0, num_kv_blocks, run(False), carry)
    acc, m, l = carry
    nonempty = l > 0.0
    l_safe = jnp.where(nonempty, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m * LN_2 + jnp.log(l_safe), -jnp.inf)  # natural log: the contract


# ----------------------------------------------------------------------------------------------
# Backward kernels.


def _p_and_ds(q, k, v, do, lse2, delta, mask, scale, softcap=None):
    """P = exp(s - lse) (0 where masked) and dS = P * (dO V^T - Delta), both [bq, bk] fp32. lse2 is
    lse * log2(e): P is computed as exp2(s * log2(e) - lse2), the scale folded into one multiply.
    With a soft-cap, s is the capped score and dS is taken with respect to scale * q.k: times
    1 - t^2, t = tanh(scale * q.k / c) (the callers multiply by scale at the end)."""
    s2, t = _scores_log2(_dot(q, k, 1, 1), scale, softcap)
    p = jnp.exp2(s2 - lse2[:, None])
    if mask is not None:  # also covers empty rows, whose lse is -inf and whose p would be inf
        p = jnp.where(mask, p, 0.0)
    dp = _dot(do, v, 1, 1)
    ds = p * (dp - delta[:, None])
    return p, ds if t is None else ds * (1.0 - t * t)


def _dq_kernel(*refs, cfg: _Config, kv_len, num_kv_blocks: int, has_segments: bool):
    """Grid (q blocks, B, N): dq for one q block of one query head."""
    ins, qs_ref, ks_ref, (dq_ref,) = _split_refs(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q, do, lse2, delta = q_ref[...], do_ref[...], lse_ref[...] * LOG2_E, delta_ref[...]
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(j, dq, *, causal_mask: bool):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        mask = _visible(
            i * bq,
            start,
            (bq, bk),
            causal=causal_mask,
            kv_len=kv_len,
            q_seg=q_seg,
            kv_seg=None if ks_ref is None else ks_ref[pl.ds(start, bk)],
            window=cfg.window,
        )
        _, ds = _p_and_ds(q, k, v, do, lse2, delta, mask, cfg.scale, cfg.softcap)
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    dq = jnp.zeros(q.shape, jnp.float32)
    meet = None if ks_ref is None else lambda j: _segments_meet(q_seg, ks_ref[pl.ds(pl.multiple_of(j * bk, bk), bk)])
    run = lambda causal_mask: _skip_unless(meet, functools.partial(body, causal_mask=causal_mask))
    if cfg.causal:
        n_start, n_inner, n_full, n_end = _causal_kv_range(i, bq, bk, num_kv_blocks, cfg.window)
        if cfg.window is not None:
            dq = lax.fori_loop(n_start, n_inner, run(True), dq)
        dq = lax.fori_loop(n_inner, n_full, run(False), dq)
        dq = lax.fori_loop(n_full, n_end, run(True), dq)
    else:
        dq = lax.fori_loop(0, num_kv_blocks, run(False), dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, kv_len, num_q_blocks: int, group: int, has_segments: bool):
    """Grid (kv blocks, B, K): dk, dv for one kv block of one kv head, summed over the G query
    heads that read it (their q, dO, lse, Delta blocks span the group: [T, G, H] / [G, T])."""
    ins, qs_ref, ks_ref, (dk_ref, dv_ref) = _split_refs(refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    bq, bk = cfg.block_q, cfg.block_k
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kv_seg = None if ks_ref is None else ks_ref[...]
    k_start = j * bk

    def body(i, carry, *, g, causal_mask: bool):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        rows = pl.ds(start, bq)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        mask = _visible(
            start,
            k_start,
            (bq, bk),
            causal=causal_mask,
            kv_len=kv_len,
            q_seg=None if qs_ref is None else qs_ref[rows],
            kv_seg=kv_seg,
            window=cfg.window,
        )
        p, ds = _p_and_ds(q, k, v, do, lse_ref[g, rows] * LOG2_E, delta_ref[g, rows], mask, cfg.scale, cfg.softcap)
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
        return dk, dv

    meet = None if qs_ref is None else lambda i: _segments_meet(qs_ref[pl.ds(pl.multiple_of(i * bq, bq), bq)], kv_seg)

    def group_body(g, carry):
        run = lambda causal_mask: _skip_unless(meet, functools.partial(body, g=g, causal_mask=causal_mask))
        if cfg.causal:
            n_start, n_full, n_outer, n_stop = _causal_q_range(j, bq, bk, num_q_blocks, cfg.window)
            carry = lax.fori_loop(n_start, n_full, run(True), carry)
            carry = lax.fori_loop(n_full, n_outer, run(False), carry)
            return carry if cfg.window is None else lax.fori_loop(n_outer, n_stop, run(True), carry)
        return lax.fori_loop(0, num_q_blocks, run(False), carry)

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, group, group_body, carry)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers (padded inputs in, padded outputs out).


def _default_launch(head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) without a tuned entry: JAX's own Triton attention uses the same for
    H <= 128; one pipeline stage for H = 256 keeps the tiles within shared memory. Not swept on a
    GPU yet (the H200 sweep of docs/benchmarks/h200_2026-11-26.md covered the tiles only)."""
    return (4 if head_dim <= 64 else 8), (2 if head_dim <= 128 else 1)


def _compiler_params(head_dim: int, interpret: bool, num_warps: int | None = None, num_stages: int | None = None):
    """Triton launch parameters on GPU: the given ones (from the tuning cache) or the defaults
    above. None elsewhere."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pl_triton

    warps, stages = _default_launch(head_dim)
    return pl_triton.CompilerParams(
        num_warps=warps if num_warps is None else num_warps, num_stages=stages if num_stages is None else num_stages
    )


def _segment_specs(q_seg, kv_seg, q_block: int, kv_block: int, *, grid_over_q: bool):
    """(BlockSpecs, arrays) for the [B, Tp] / [B, Sp] segment ids, none without segments. Grid
    axis 0 walks q blocks (grid_over_q) or kv blocks; that side is blocked, the other whole."""
    if q_seg is None:
        return [], []
    if grid_over_q:  # q segment block i, all kv segment ids
        specs = [
            pl.BlockSpec((None, q_block), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, kv_block), lambda i, b, h: (b, 0)),
        ]
    else:  # grid over kv blocks: all q segment ids, kv segment block j
        specs = [
            pl.BlockSpec((None, q_block), lambda j, b, h: (b, 0)),
            pl.BlockSpec((None, kv_block), lambda j, b, h: (b, j)),
        ]
    return specs, [q_seg, kv_seg]


def _forward_padded(q, k, v, q_seg, kv_seg, cfg: _Config, kv_len):
    b, tp, n, h = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, g = cfg.block_q, cfg.block_k, n // kh
    seg_specs, seg_args = _segment_specs(q_seg, kv_seg, bq, sp, grid_over_q=True)
    kernel = functools.partial(
        _fwd_kernel, cfg=cfg, kv_len=kv_len, num_kv_blocks=sp // bk, has_segments=q_seg is not None
    )
    kv_spec = pl.BlockSpec((None, sp, None, h), lambda i, b_, n_: (b_, 0, lax.div(n_, g), 0))
    return pl.pallas_call(
        kernel,
        grid=(tp // bq, b, n),
        in_specs=[pl.BlockSpec((None, bq, None, h), lambda i, b_, n_: (b_, i, n_, 0)), kv_spec, kv_spec, *seg_specs],
        out_specs=[
            pl.BlockSpec((None, bq, None, h), lambda i, b_, n_: (b_, i, n_, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b_, n_: (b_, n_, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, tp), jnp.float32)],
        compiler_params=_compiler_params(h, cfg.interpret, cfg.num_warps, cfg.num_stages),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *seg_args)


def _backward_padded(q, k, v, q_seg, kv_seg, do, lse, delta, cfg: _Config, kv_len):
    b, tp, n, h = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, g = cfg.block_q, cfg.block_k, n // kh
    has_segments = q_seg is not None
    params = _compiler_params(h, cfg.interpret, cfg.num_warps, cfg.num_stages)

    seg_specs, seg_args = _segment_specs(q_seg, kv_seg, bq, sp, grid_over_q=True)
    q_blk = pl.BlockSpec((None, bq, None, h), lambda i, b_, n_: (b_, i, n_, 0))
    kv_all = pl.BlockSpec((None, sp, None, h), lambda i, b_, n_: (b_, 0, lax.div(n_, g), 0))
    row_blk = pl.BlockSpec((None, None, bq), lambda i, b_, n_: (b_, n_, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, kv_len=kv_len, num_kv_blocks=sp // bk, has_segments=has_segments),
        grid=(tp // bq, b, n),
        in_specs=[q_blk, kv_all, kv_all, q_blk, row_blk, row_blk, *seg_specs],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(q, k, v, do, lse, delta, *seg_args)

    seg_specs, seg_args = _segment_specs(q_seg, kv_seg, tp, bk, grid_over_q=False)
    q_group = pl.BlockSpec((None, tp, g, h), lambda j, b_, k_: (b_, 0, k_, 0))  # heads k_*G ...
    kv_blk = pl.BlockSpec((None, bk, None, h), lambda j, b_, k_: (b_, j, k_, 0))
    row_group = pl.BlockSpec((None, g, tp), lambda j, b_, k_: (b_, k_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, cfg=cfg, kv_len=kv_len, num_q_blocks=tp // bq, group=g, has_segments=has_segments
        ),
        grid=(sp // bk, b, kh),
        in_specs=[q_group, kv_blk, kv_blk, q_group, row_group, row_group, *seg_specs],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dkdv",
    )(q, k, v, do, lse, delta, *seg_args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Validation, padding and the custom_vjp.

GPU_MAX_BLOCK_K_WIDE_HEADS = 64  # key tile of the generic kernel when H > 64


def _block_size(requested: int, length: int, name: str) -> int:
    """The tile actually used: the requested power of two, shrunk for short sequences."""
    if requested < 16 or requested & (requested - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles); got {name}={requested}")
    return min(requested, max(16, pl.next_power_of_2(length)))


def _pad_axis(x, axis: int, size: int):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _resolve_blocks(block_q, block_k, block_q_bwd, block_k_bwd, *, head_dim, dtype, causal, seq_len):
    """(block_q, block_k, block_q_bwd, block_k_bwd, tuned): explicit arguments win; a tile left None
    comes from the tuning cache for this shape class on this device (kernels/tuning.py), else
    DEFAULT_BLOCK. Backward tiles default to the cached backward tiles when the forward ones were
    not given explicitly, otherwise to the forward tiles. `tuned` also carries num_warps/num_stages."""
    tuned = tuning.flash_attention_config(head_dim=head_dim, dtype=dtype, causal=causal, seq_len=seq_len)
    bwd = []
    resolved = []
    for given, given_bwd, name in ((block_q, block_q_bwd, "block_q"), (block_k, block_k_bwd, "block_k")):
        if given is None:
            given = tuned.get(name, DEFAULT_BLOCK)
            fallback_bwd = tuned.get(name + "_bwd", given)
        else:
            fallback_bwd = given
        resolved.append(given)
        bwd.append(fallback_bwd if given_bwd is None else given_bwd)
    return resolved[0], resolved[1], bwd[0], bwd[1], tuned


def _prepare(
    q,
    k,
    v,
    q_segment_ids,
    kv_segment_ids,
    *,
    causal,
    softmax_scale,
    block_q,
    block_k,
    block_q_bwd,
    block_k_bwd,
    interpret,
    backend,
    window=None,
    softcap=None,
):
    """Validate, resolve defaults and build the static plan."""
    platforms.check_backend(backend, (*platforms.BACKENDS, platforms.MOSAIC_GPU))
    if interpret is None:
        compiled_here = jax.default_backend() != "cpu"
    else:
        compiled_here = not interpret
    check_inputs(
        q,
        k,
        v,
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        head_dims=KERNEL_HEAD_DIMS if compiled_here else INTERPRET_HEAD_DIMS,
        window=window,
        softcap=softcap,
    )
    softcap = check_softcap(softcap)  # a Python float or None (0: none), hashable in the configs
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
    t, s, h = q.shape[1], k.shape[1], q.shape[3]
    scale = float(h**-0.5 if softmax_scale is None else softmax_scale)
    generic_cfg = tpu_cfg = None
    if backend != "tpu":  # Triton's tile rules (powers of two >= 16)
        # At H > 64 a 128-key tile needs more shared memory than an H100/H200 block has (256 KiB
        # against 227 KiB at 128 x 128), and (128, 64) measured fastest on an H200
        # (docs/benchmarks/h200_2026-11-26.md): cap the key tile at 64 there.
        cap_k = lambda b: min(b, GPU_MAX_BLOCK_K_WIDE_HEADS) if h > 64 else b
        bq, bk, bq_bwd, bk_bwd, tuned = _resolve_blocks(
            block_q, block_k, block_q_bwd, block_k_bwd, head_dim=h, dtype=q.dtype, causal=causal, seq_len=t
        )
        generic_cfg = _Config(
            scale=scale,
            causal=bool(causal),
            block_q=_block_size(bq, t, "block_q"),
            block_k=cap_k(_block_size(bk, s, "block_k")),
            bwd_block_q=_block_size(bq_bwd, t, "block_q_bwd"),
            bwd_block_k=cap_k(_block_size(bk_bwd, s, "block_k_bwd")),
            interpret=True,
            num_warps=tuned.get("num_warps"),
            num_stages=tuned.get("num_stages"),
            window=window,
            softcap=softcap,
        )
    if backend != "generic":  # Mosaic's (multiples of 128, adjusted rather than refused); not tuned
        block_q = DEFAULT_BLOCK if block_q is None else block_q
        block_k = DEFAULT_BLOCK if block_k is None else block_k
        block_q_bwd = block_q if block_q_bwd is None else block_q_bwd
        block_k_bwd = block_k if block_k_bwd is None else block_k_bwd
        tpu_cfg = kernel_tpu.TpuConfig(
            scale=scale,
            causal=bool(causal),
            block_q=kernel_tpu.tile(block_q, t, "block_q"),
            block_k=kernel_tpu.tile(block_k, s, "block_k"),
            bwd_block_q=kernel_tpu.tile(block_q_bwd, t, "block_q_bwd"),
            bwd_block_k=kernel_tpu.tile(block_k_bwd, s, "block_k_bwd"),
            interpret=True,
            window=window,
            softcap=softcap,
        )
    if window is not None and backend == platforms.MOSAIC_GPU:
        raise ValueError("backend='mosaic_gpu' has no sliding window: use backend=None (Triton on GPUs) or 'generic'")
    if softcap is not None and backend == platforms.MOSAIC_GPU:
        raise ValueError(
            f"backend='mosaic_gpu' has no logit soft-capping (softcap={softcap}): use backend=None (Triton on "
            "GPUs) or 'generic'"
        )
    mgpu_cfg = None
    # the Mosaic GPU kernels have neither a window nor a soft-cap: the generic (Triton) kernel runs
    if window is None and softcap is None:
        mgpu_cfg = _mgpu_config(backend, interpret, q, s, scale, causal, q_segment_ids is not None, generic_cfg)
    if q_segment_ids is not None:
        q_segment_ids = q_segment_ids.astype(jnp.int32)
        kv_segment_ids = kv_segment_ids.astype(jnp.int32)
    return platforms.plan(backend, interpret, generic_cfg, tpu_cfg, mgpu_cfg), q_segment_ids, kv_segment_ids


def _mgpu_config(backend, interpret, q, s, scale, causal, has_segments, generic_cfg):
    """The Mosaic GPU kernel's config when it should run on CUDA, else None. backend None: only on
    a Hopper GPU (kernel_mgpu.gpu_capability, read at trace time) for a supported call, and not
    when interpret=True; backend "mosaic_gpu": whenever the call is supported, else ValueError."""
    if backend not in (None, platforms.MOSAIC_GPU) or (backend is None and interpret):
        return None
    t, h = q.shape[1], q.shape[3]
    kw = dict(causal=bool(causal), scale=scale, has_segments=has_segments)
    if backend is None:
        if kernel_mgpu.why_not(kernel_mgpu.gpu_capability(), t, s, h, q.dtype, **kw) is not None:
            return None
    elif (why := kernel_mgpu.supported(t, s, h, q.dtype, **kw)) is not None:
        raise ValueError(f"backend='mosaic_gpu' cannot run this call: {why}")
    # the generic config runs the backward where the Mosaic one does not (S not a multiple of 128)
    return kernel_mgpu.make_config(
        h, s, q.dtype, scale=scale, causal=bool(causal), backward=generic_cfg, has_segments=has_segments
    )


def _forward(q, k, v, q_seg, kv_seg, cfg: _Config):
    """Unpadded in, unpadded out: (o[B, T, N, H], lse[B, N, T])."""
    t, s = q.shape[1], k.shape[1]
    tp, sp = -(-t // cfg.block_q) * cfg.block_q, -(-s // cfg.block_k) * cfg.block_k
    o, lse = _forward_padded(
        _pad_axis(q, 1, tp),
        _pad_axis(k, 1, sp),
        _pad_axis(v, 1, sp),
        _pad_axis(q_seg, 1, tp),
        _pad_axis(kv_seg, 1, sp),
        cfg,
        kv_len=s if sp != s else None,
    )
    return o[:, :t], lse[:, :, :t]


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg: _Config):
    """Unpadded in, unpadded out: (dq, dk, dv) in the dtypes of q, k, v."""
    cfg = dataclasses.replace(cfg, block_q=cfg.bwd_block_q, block_k=cfg.bwd_block_k)
    t, s = q.shape[1], k.shape[1]
    tp, sp = -(-t // cfg.block_q) * cfg.block_q, -(-s // cfg.block_k) * cfg.block_k
    # Delta_i = sum_h dO_ih O_ih - dlse_i (FlashAttention-2's preprocessing, plus the lse
    # cotangent), a cheap elementwise-and-reduce that XLA fuses; [B, N, T] fp32.
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    # Padded query rows get dO = 0 and Delta = 0, so their dS = 0; lse = 0 keeps their P finite.
    dq, dk, dv = _backward_padded(
        _pad_axis(q, 1, tp),
        _pad_axis(k, 1, sp),
        _pad_axis(v, 1, sp),
        _pad_axis(q_seg, 1, tp),
        _pad_axis(kv_seg, 1, sp),
        _pad_axis(do.astype(q.dtype), 1, tp),
        _pad_axis(lse.astype(jnp.float32), 2, tp),
        _pad_axis(delta, 2, tp),
        cfg,
        kv_len=s if sp != s else None,
    )
    return dq[:, :t], dk[:, :s], dv[:, :s]


def _mgpu_backward(*args, cfg: kernel_mgpu.MgpuConfig):
    """The Mosaic GPU variant's backward, from its o and lse: kernel_mgpu's (the fused dK/dV + dQ
    kernel, or the split dQ and dK/dV kernels) where they apply (S a multiple of 128), else the
    generic kernels (Triton, or interpreted with the forward)."""
    if cfg.mosaic_backward:
        return kernel_mgpu.backward(*args, cfg=cfg)
    return _backward(*args, cfg=dataclasses.replace(cfg.backward, interpret=cfg.interpret))


_VARIANTS = {
    "generic": (_forward, _backward),
    "tpu": (kernel_tpu.forward, kernel_tpu.backward),
    "mosaic_gpu": (kernel_mgpu.forward, _mgpu_backward),
}


def _dispatch(plan: platforms.Plan, which: int, *args):
    return platforms.dispatch(plan, _VARIANTS, which, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, plan: platforms.Plan):
    return _dispatch(plan, 0, q, k, v, q_seg, kv_seg)


def _flash_fwd(q, k, v, q_seg, kv_seg, plan: platforms.Plan):
    o, lse = _dispatch(plan, 0, q, k, v, q_seg, kv_seg)
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(plan: platforms.Plan, residuals, cotangents):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    do, dlse = cotangents  # dlse is zeros when the caller did not use lse
    dq, dk, dv = _dispatch(plan, 1, q, k, v, q_seg, kv_seg, o, lse, do, dlse)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------
# Public API.


def _kernel_head_dim(h: int, interpret) -> int:
    """The head dim the kernels run an H-dim call at: H itself where they take it, else the next
    one they take (H = 192 of DeepSeek's MLA heads -> 256, 96 of Phi-3 -> 128), with q, k, v
    zero-padded, which leaves every score and the output's first H dims unchanged once the softmax
    scale is H's (`_padded_call`). H beyond the largest is left to check_inputs to refuse."""
    compiled_here = jax.default_backend() != "cpu" if interpret is None else not interpret
    dims = KERNEL_HEAD_DIMS if compiled_here else INTERPRET_HEAD_DIMS
    return h if h in dims else min((d for d in dims if d > h), default=h)


def _pad_head(x, target: int):
    return (
        x if x is None or x.shape[-1] == target else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, target - x.shape[-1])])
    )


def _any_head_dim(padded: tuple[int, ...], cut):
    """Run the decorated public function at the kernels' head dim (`_kernel_head_dim`): where they
    do not take q's H, its positional arrays at `padded` are zero-padded to the next one they do,
    the softmax scale is H's, and `cut(result, H)` cuts the result back."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, softmax_scale=None, interpret=None, **kw):
            h = args[0].shape[-1]
            if (target := _kernel_head_dim(h, interpret)) == h:
                return fn(*args, softmax_scale=softmax_scale, interpret=interpret, **kw)
            args = tuple(_pad_head(a, target) if i in padded else a for i, a in enumerate(args))
            scale = h**-0.5 if softmax_scale is None else softmax_scale
            return cut(fn(*args, softmax_scale=scale, interpret=interpret, **kw), h)

        return run

    return wrap


@_any_head_dim((0, 1, 2), lambda out, h: (out[0][..., :h], out[1]) if isinstance(out, tuple) else out[..., :h])
def flash_attention(
    q,
    k,
    v,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    return_lse=False,
    block_q=None,
    block_k=None,
    interpret=None,
    block_q_bwd=None,
    block_k_bwd=None,
    backend=None,
    window=None,
    softcap=None,
):
    """Attention over q[B, T, N, H], k/v[B, S, K, H] -> o[B, T, N, H] (and lse[B, N, T] fp32 when
    return_lse), differentiable (custom_vjp; the lse cotangent is honoured). Same semantics as
    `reference.attention`.

    block_q, block_k: forward tiles; block_q_bwd, block_k_bwd: backward tiles, default the forward
    ones. None (the default): the tuning cache's tiles for this shape on this device, else 128
    (module docstring). The generic kernel needs powers of two >= 16 (shrunk to the sequence for short ones);
    the TPU kernel rounds them up to multiples of 128 (at most the padded sequence).
    backend: None picks by the platform the program is lowered for (Mosaic kernels on TPU, the
    Mosaic GPU kernels on a Hopper GPU for a supported call (kernel_mgpu.why_not), the generic
    kernels elsewhere), "tpu", "generic" or "mosaic_gpu" forces one. interpret: None interprets when
    lowered for CPU and compiles elsewhere; True / False force it (True with backend None is the
    generic kernel interpreted everywhere). window: sliding-window attention (causal only): query
    t sees keys t - window < s <= t; kv blocks outside every row's window are never visited, so the
    work is O(T * window), and the Mosaic GPU kernels give way to the generic one. softcap: Gemma 2's
    attention logit soft-capping, None or 0 (off) or c > 0: the scaled scores s become
    c * tanh(s / c) before the masks and the softmax (reference.softcapped); the Mosaic GPU kernels
    give way to the generic one here too, and backend="mosaic_gpu" with a softcap is a ValueError.
    A head dim the kernels do not take (e.g. 192, 96) runs zero-padded to the next one they do
    (`_kernel_head_dim`), at the scale of the true H."""
    plan, q_seg, kv_seg = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        softmax_scale=softmax_scale,
        block_q=block_q,
        block_k=block_k,
        block_q_bwd=block_q_bwd,
        block_k_bwd=block_k_bwd,
        interpret=interpret,
        backend=backend,
        window=window,
        softcap=softcap,
    )
    o, lse = _flash(q, k, v, q_seg, kv_seg, plan)
    return (o, lse) if return_lse else o


def flash_attention_forward(
    q,
    k,
    v,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    block_q=None,
    block_k=None,
    interpret=None,
    block_q_bwd=None,
    block_k_bwd=None,
    backend=None,
    window=None,
    softcap=None,
):
    """(o, lse) for one block of attention; the building block of context parallelism.
    Differentiable like flash_attention(..., return_lse=True)."""
    return flash_attention(
        q,
        k,
        v,
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        return_lse=True,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        block_q_bwd=block_q_bwd,
        block_k_bwd=block_k_bwd,
        backend=backend,
        window=window,
        softcap=softcap,
    )


@_any_head_dim((0, 1, 2, 3, 5), lambda grads, h: tuple(g[..., :h] for g in grads))
def flash_attention_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    dlse=None,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    block_q=None,
    block_k=None,
    interpret=None,
    backend=None,
    window=None,
    softcap=None,
):
    """(dq, dk, dv) of attention given the output o[B, T, N, H], its lse[B, N, T] and the
    cotangents do (and dlse, optional). Only P = exp(s - lse) is recomputed, so with the *final*
    o and lse of a longer attention (e.g. merged over ring steps) and a block of its keys, the
    results are that block's contributions to dq, dk, dv: summing them over the blocks gives the
    gradients of the whole. Returned in the dtypes of q, k, v. block_q, block_k are the tiles of
    the backward kernels here; backend, interpret, window and softcap as in flash_attention (the
    soft-cap's derivative is per score, so the block sums stay exact with it). A head dim the
    kernels do not take runs zero-padded, as in flash_attention."""
    plan, q_seg, kv_seg = _prepare(
        q,
        k,
        v,
        q_segment_ids,
        kv_segment_ids,
        causal=causal,
        softmax_scale=softmax_scale,
        block_q=block_q,
        block_k=block_k,
        block_q_bwd=None,
        block_k_bwd=None,
        interpret=interpret,
        backend=backend,
        window=window,
        softcap=softcap,
    )
    b, t, n, _ = q.shape
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must have q's shape {q.shape}; got o{o.shape}, do{do.shape}")
    if lse.shape != (b, n, t) or (dlse is not None and dlse.shape != (b, n, t)):
        raise ValueError(
            f"lse and dlse must have shape [B, N, T] = {(b, n, t)}; got "
            f"lse{lse.shape}, dlse{None if dlse is None else dlse.shape}"
        )
    return _dispatch(plan, 1, q, k, v, q_seg, kv_seg, o, lse, do, dlse)
