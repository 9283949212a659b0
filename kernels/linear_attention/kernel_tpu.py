"""Chunked causal linear attention for TPU (Pallas Mosaic): a forward kernel, and the backward as a
forward pass over the chunks (dq) and a reverse pass (dk, dv, d initial_state). Same semantics as
`reference.recurrent` and kernel.py's generic kernel; kernel.py's `linear_attention` picks this
variant when the program is lowered for TPU (see there) and holds the custom_vjp.

Layout. Mosaic wants the last two dims of every block to be multiples of (8, 128) or the whole
array dims, so the kernels see heads-major arrays: q, k [B, N, Tp, H], v, o, dO [B, N, Tp, Hv]
(XLA transposes and pads outside), blocks (block_t, H) and (block_t, Hv); states [B, N, H, Hv],
blocks (H, Hv), whole array dims. The per-head log-decay [N] (fp32) is a scalar-prefetch operand,
read from SMEM as one scalar per program.

Grid (N, B, Tp / block_t): heads, batch "parallel" (a megacore chip splits them over its two
TensorCores), blocks of tokens "arbitrary" and innermost, so one program walks the whole sequence
of its (head, batch) in order while its fp32 state S [H, Hv] stays in VMEM scratch. VMEM holds
one block of block_t tokens (double-buffered by the pipeline), never the sequence. Inside a block
the kernel walks its block_t / C chunks of C tokens with a `lax.fori_loop`; block_t exists because
a grid step has a fixed cost (DMA issue and wait, pipeline bookkeeping) that one 64-token chunk,
a few MFLOP, would hardly amortise. With block_t = C each grid step is exactly one chunk.

- forward: S <- s0 at block 0; per chunk o = scale [((q k^T) * D) v + exp(b) * (q S)],
  S <- exp(b_last) S + (k * exp(b_last - b))^T v; the last block writes final_state = S.
- dq pass (blocks in order): recomputes S from s0 the same way and writes
  dq = scale [((dO v^T) * D) k + exp(b) * (dO S^T)].
- dk/dv pass (blocks in reverse: index maps c -> n_blocks - 1 - c, chunks in reverse inside a
  block): dS <- dL/d final_state at the first step; per chunk
  dk = scale ((v dO^T) * D^T) q + exp(b_last - b) * (v dS^T),
  dv = scale ((k q^T) * D^T) dO + (k * exp(b_last - b)) dS,
  dS <- exp(b_last) dS + scale (q * exp(b))^T dO; the last step writes d initial_state = dS.
  The [C, C] blocks are built transposed (keys on rows), so dk and dv are plain matmuls.
dq and dk come out in fp32 (kernel.py derives d log_decay from them); dv in v's dtype.

Decay. With a = log(gamma) of the program's head, b_i = a (i + 1) inside a chunk, so
D_ij = exp(a (i - j)) for j <= i does not depend on the chunk: it is built once per grid step
([C, C], one exp per element). T is padded at the end to a multiple of block_t with zero rows;
the chunk holding the last real token has L < C real rows, and its exp(b_last) = exp(a L) and
exp(b_last - b_i) = exp(a (L - 1 - i)) (exponents clamped at 0 for padded rows, whose k and v are
zero) use L, so no decay is applied past the last real token (the generic kernel's rule). Chunks
that hold only padding are skipped (pl.when); their output rows are zero. Every exponent is <= 0.

Numerics as the generic kernel: matmul operands in the input dtype, fp32 accumulation, fp32 state
(the state is rounded to the input dtype as a matmul operand); fp32 operands get
Precision.HIGHEST (Mosaic's fp32 contraction), bf16 operands DEFAULT (a higher precision on bf16
operands is rejected by Mosaic).

Chunk rules (checked in `tpu_config`): C a positive multiple of 8 (the sublane tile; Mosaic
also accepts C = 8 in bf16, half a packed tile) and block_t a positive multiple of C. H and Hv
are whole block dims, so any size compiles (16 ... 256 were compiled). Inputs other than fp32 and
bf16 (float16: Mosaic fails on its packed loads) are computed in fp32 and cast back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["TpuConfig", "tpu_config", "compute_dtype", "forward", "backward", "DEFAULT_BLOCK_T"]

F32 = jnp.float32
DEFAULT_BLOCK_T = 512  # tokens per grid step (untuned: no TPU to time on)
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a^T @ b (contracts the token rows)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Static parameters of one call (hashable: part of the custom_vjp's static argument)."""

    chunk: int
    block_t: int
    scale: float
    has_decay: bool
    interpret: bool


def tpu_config(*, chunk_size, block_t, scale, has_decay, seq_len, interpret=True) -> TpuConfig:
    """Check the TPU chunk rules and resolve block_t. None: the fewest blocks of at most
    max(C, DEFAULT_BLOCK_T) tokens, the chunks spread evenly over them (so T is padded by less than
    one chunk per block). Raises ValueError naming the rule."""
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size <= 0
        or chunk_size % 8
    ):
        raise ValueError(
            f"the TPU kernel needs chunk_size to be a positive multiple of 8 "
            f"(Mosaic's sublane tile), got chunk_size={chunk_size!r}"
        )
    c = int(chunk_size)
    if block_t is None:
        n_chunks = -(-seq_len // c)
        n_blocks = -(-n_chunks // max(1, DEFAULT_BLOCK_T // c))
        block_t = c * -(-n_chunks // n_blocks)
    elif isinstance(block_t, bool) or not isinstance(block_t, numbers.Integral) or block_t <= 0 or block_t % c:
        raise ValueError(f"block_t must be a positive multiple of chunk_size={c}, got block_t={block_t!r}")
    return TpuConfig(
        chunk=c, block_t=int(block_t), scale=float(scale), has_decay=bool(has_decay), interpret=bool(interpret)
    )


def compute_dtype(dtype):
    """The dtype the kernels compute in: float32 and bfloat16 as given; any other floating dtype
    (float16: Mosaic fails on its packed loads) in float32, cast back on the way out."""
    return jnp.dtype(dtype) if jnp.dtype(dtype) in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)) else jnp.dtype(F32)


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def _dot(a, b, dims):
    """fp32-accumulated matmul; fp32 operands at full fp32 precision (see the module docstring)."""
    precision = lax.Precision.HIGHEST if a.dtype == F32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


class _Decay:
    """Decay factors of one head for the chunks of a grid step: a = log(gamma) (an fp32 scalar)
    or None (no decay: only the causal mask)."""

    def __init__(self, a, chunk: int, transposed: bool):
        self.a, self.chunk = a, chunk
        row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        # D [t, s] (queries on rows), or D^T [s, t] for the reverse pass (keys on rows).
        dist = col - row if transposed else row - col  # t - s
        self.visible = dist >= 0
        if a is None:
            self.dmat = None
            self.eb = None
        else:
            self.dmat = jnp.where(self.visible, jnp.exp(jnp.minimum(a * dist.astype(F32), 0.0)), 0.0)
            i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(F32)
            self.eb = jnp.exp(a * (i + 1.0))  # exp(b_i), [C, 1]

    def apply(self, scores):
        """scores [C, C] (fp32) * D, or the causal mask without decay."""
        if self.dmat is None:
            return jnp.where(self.visible, scores, 0.0)
        return scores * self.dmat

    def tail(self, length):
        """exp(b_last - b_i) [C, 1] and exp(b_last) [1, 1] for a chunk with `length` real rows
        (traced int32, 1..C): b_last = a L."""
        i = lax.broadcasted_iota(jnp.int32, (self.chunk, 1), 0)
        ekd = jnp.exp(jnp.minimum(self.a * (length - 1 - i).astype(F32), 0.0))
        eblast = jnp.exp(jnp.full((1, 1), self.a * length.astype(F32), F32))
        return ekd, eblast


def _chunk_loop(n_sub: int, chunk: int, block_start, seq_len: int, body, *, reverse=False):
    """Call body(rows, length, real) for the n_sub chunks of a block, in order or reversed: rows
    is the chunk's pl.ds within the block, length min(real rows, C) (traced; >= 1 when real) and
    real whether the chunk holds a real token (traced bool)."""

    def step(j, carry):
        jj = n_sub - 1 - j if reverse else j
        start = block_start + jj * chunk
        rows = pl.ds(pl.multiple_of(jj * chunk, chunk), chunk)
        body(rows, jnp.minimum(seq_len - start, chunk), start < seq_len)
        return carry

    lax.fori_loop(0, n_sub, step, 0)


def _nbytes(*arrays) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


# ----------------------------------------------------------------------------------------------
# Kernels. Refs per program: ld [N] (SMEM), token blocks [block_t, H or Hv], states [H, Hv].


def _fwd_kernel(
    ld_ref, q_ref, k_ref, v_ref, s0_ref, o_ref, st_ref, s_scr, *, cfg: TpuConfig, seq_len: int, n_blocks: int
):
    n, c = pl.program_id(0), pl.program_id(2)
    chunk, scale = cfg.chunk, cfg.scale

    @pl.when(c == 0)
    def _init():
        s_scr[...] = s0_ref[...].astype(F32)

    dec = _Decay(ld_ref[n] if cfg.has_decay else None, chunk, transposed=False)

    def body(rows, length, real):
        @pl.when(real)
        def _run():
            q, k, v = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :]
            s = s_scr[...]
            att = dec.apply(_dot(q, k, _NT)).astype(v.dtype)  # [C, C]
            inter = _dot(q, s.astype(q.dtype), _NN)  # q S, [C, Hv]
            if cfg.has_decay:
                ekd, eblast = dec.tail(length)
                inter = dec.eb * inter
                kd = (k.astype(F32) * ekd).astype(k.dtype)
                s_scr[...] = eblast * s + _dot(kd, v, _TN)
            else:
                s_scr[...] = s + _dot(k, v, _TN)
            o_ref[rows, :] = (scale * (_dot(att, v, _NN) + inter)).astype(o_ref.dtype)

        @pl.when(jnp.logical_not(real))
        def _skip():
            o_ref[rows, :] = jnp.zeros((chunk, o_ref.shape[-1]), o_ref.dtype)

    _chunk_loop(cfg.block_t // chunk, chunk, c * cfg.block_t, seq_len, body)

    @pl.when(c == n_blocks - 1)
    def _finish():
        st_ref[...] = s_scr[...]


def _dq_kernel(ld_ref, k_ref, v_ref, do_ref, s0_ref, dq_ref, s_scr, *, cfg: TpuConfig, seq_len: int):
    n, c = pl.program_id(0), pl.program_id(2)
    chunk, scale = cfg.chunk, cfg.scale

    @pl.when(c == 0)
    def _init():
        s_scr[...] = s0_ref[...].astype(F32)

    dec = _Decay(ld_ref[n] if cfg.has_decay else None, chunk, transposed=False)

    def body(rows, length, real):
        @pl.when(real)
        def _run():
            k, v, do = k_ref[rows, :], v_ref[rows, :], do_ref[rows, :]
            s = s_scr[...]
            dov = dec.apply(_dot(do, v, _NT)).astype(k.dtype)  # (dO v^T) * D, [C, C]
            inter = _dot(do, s.astype(do.dtype), _NT)  # dO S^T, [C, H]
            if cfg.has_decay:
                ekd, eblast = dec.tail(length)
                inter = dec.eb * inter
                kd = (k.astype(F32) * ekd).astype(k.dtype)
                s_scr[...] = eblast * s + _dot(kd, v, _TN)
            else:
                s_scr[...] = s + _dot(k, v, _TN)
            dq_ref[rows, :] = scale * (_dot(dov, k, _NN) + inter)

        @pl.when(jnp.logical_not(real))
        def _skip():
            dq_ref[rows, :] = jnp.zeros((chunk, dq_ref.shape[-1]), F32)

    _chunk_loop(cfg.block_t // chunk, chunk, c * cfg.block_t, seq_len, body)


def _dkdv_kernel(
    ld_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    dst_ref,
    dk_ref,
    dv_ref,
    ds0_ref,
    ds_scr,
    *,
    cfg: TpuConfig,
    seq_len: int,
    n_blocks: int,
):
    n, c = pl.program_id(0), pl.program_id(2)
    chunk, scale = cfg.chunk, cfg.scale

    @pl.when(c == 0)
    def _init():
        ds_scr[...] = dst_ref[...].astype(F32)

    dec = _Decay(ld_ref[n] if cfg.has_decay else None, chunk, transposed=True)

    def body(rows, length, real):
        @pl.when(real)
        def _run():
            q, k, v, do = q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], do_ref[rows, :]
            ds = ds_scr[...]
            dsc = ds.astype(q.dtype)
            dovt = dec.apply(_dot(v, do, _NT)).astype(q.dtype)  # (v dO^T) * D^T, [C(s), C(t)]
            attt = dec.apply(_dot(k, q, _NT)).astype(q.dtype)  # (k q^T) * D^T
            dk_state = _dot(v, dsc, _NT)  # v dS^T, [C, H]
            if cfg.has_decay:
                ekd, eblast = dec.tail(length)
                dk_state = ekd * dk_state
                kd = (k.astype(F32) * ekd).astype(k.dtype)
                qd = (q.astype(F32) * dec.eb).astype(q.dtype)
            else:
                kd, qd = k, q
            dk_ref[rows, :] = scale * _dot(dovt, q, _NN) + dk_state
            dv_ref[rows, :] = (scale * _dot(attt, do, _NN) + _dot(kd, dsc, _NN)).astype(dv_ref.dtype)
            ds_prev = scale * _dot(qd, do, _TN)  # [H, Hv]
            ds_scr[...] = (eblast * ds if cfg.has_decay else ds) + ds_prev

        @pl.when(jnp.logical_not(real))
        def _skip():
            dk_ref[rows, :] = jnp.zeros((chunk, dk_ref.shape[-1]), F32)
            dv_ref[rows, :] = jnp.zeros((chunk, dv_ref.shape[-1]), dv_ref.dtype)

    block = n_blocks - 1 - c
    _chunk_loop(cfg.block_t // chunk, chunk, block * cfg.block_t, seq_len, body, reverse=True)

    @pl.when(c == n_blocks - 1)
    def _finish():
        ds0_ref[...] = ds_scr[...]


# ----------------------------------------------------------------------------------------------
# pallas_calls on padded heads-major arrays.


def _flops(b, n, n_real_chunks, chunk, h, hv, intra: int, state: int) -> int:
    """intra [C, C]-sized matmuls (2 C^2 x width each, width H or Hv in pairs) and state
    [C] x [H, Hv] matmuls (2 C H Hv each) per real chunk."""
    per_chunk = intra * chunk * chunk * (h + hv) + state * 2 * chunk * h * hv
    return b * n * n_real_chunks * per_chunk


def _transcendentals(b, n, n_blocks, n_real_chunks, chunk, has_decay) -> int:
    if not has_decay:
        return 0
    return b * n * (n_blocks * chunk * (chunk + 1) + n_real_chunks * (chunk + 1))


def _specs(cfg: TpuConfig, h: int, hv: int, reverse: bool, n_blocks: int):
    bt = cfg.block_t
    blk = (lambda c: n_blocks - 1 - c) if reverse else (lambda c: c)
    # Index maps get the grid indices (head, batch, block) and the scalar-prefetch ref.
    qk = pl.BlockSpec((None, None, bt, h), lambda n_, b_, c, ld: (b_, n_, blk(c), 0))
    vo = pl.BlockSpec((None, None, bt, hv), lambda n_, b_, c, ld: (b_, n_, blk(c), 0))
    st = pl.BlockSpec((None, None, h, hv), lambda n_, b_, c, ld: (b_, n_, 0, 0))
    return qk, vo, st


def _forward_padded(ld, qt, kt, vt, s0, cfg: TpuConfig, seq_len: int):
    b, n, tp, h = qt.shape
    hv = vt.shape[-1]
    n_blocks, n_real = tp // cfg.block_t, -(-seq_len // cfg.chunk)
    qk, vo, st = _specs(cfg, h, hv, False, n_blocks)
    out_shape = [jax.ShapeDtypeStruct((b, n, tp, hv), qt.dtype), jax.ShapeDtypeStruct((b, n, h, hv), F32)]
    cost = pl.CostEstimate(  # q k^T, att v; q S, k^T v
        flops=_flops(b, n, n_real, cfg.chunk, h, hv, intra=2, state=2),
        transcendentals=_transcendentals(b, n, n_blocks, n_real, cfg.chunk, cfg.has_decay),
        bytes_accessed=_nbytes(qt, kt, vt, s0, *out_shape),
    )
    kernel = functools.partial(_fwd_kernel, cfg=cfg, seq_len=seq_len, n_blocks=n_blocks)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n, b, n_blocks),
            in_specs=[qk, qk, vo, st],
            out_specs=[vo, st],
            scratch_shapes=[pltpu.VMEM((h, hv), F32)],
        ),
        out_shape=out_shape,
        compiler_params=_params(),
        cost_estimate=cost,
        interpret=cfg.interpret,
        name="linear_attention_tpu_fwd",
    )(ld, qt, kt, vt, s0)


def _backward_padded(ld, qt, kt, vt, s0, dot_, dst, cfg: TpuConfig, seq_len: int):
    b, n, tp, h = qt.shape
    hv = vt.shape[-1]
    n_blocks, n_real = tp // cfg.block_t, -(-seq_len // cfg.chunk)
    trans = _transcendentals(b, n, n_blocks, n_real, cfg.chunk, cfg.has_decay)

    qk, vo, st = _specs(cfg, h, hv, False, n_blocks)
    dq_shape = jax.ShapeDtypeStruct((b, n, tp, h), F32)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, seq_len=seq_len),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n, b, n_blocks),
            in_specs=[qk, vo, vo, st],
            out_specs=qk,
            scratch_shapes=[pltpu.VMEM((h, hv), F32)],
        ),
        out_shape=dq_shape,
        compiler_params=_params(),
        cost_estimate=pl.CostEstimate(  # dO v^T, dov k; dO S^T, k^T v
            flops=_flops(b, n, n_real, cfg.chunk, h, hv, intra=2, state=2),
            transcendentals=trans,
            bytes_accessed=_nbytes(kt, vt, dot_, s0, dq_shape),
        ),
        interpret=cfg.interpret,
        name="linear_attention_tpu_bwd_dq",
    )(ld, kt, vt, dot_, s0)

    qk, vo, st = _specs(cfg, h, hv, True, n_blocks)
    out_shape = [
        jax.ShapeDtypeStruct((b, n, tp, h), F32),
        jax.ShapeDtypeStruct((b, n, tp, hv), vt.dtype),
        jax.ShapeDtypeStruct((b, n, h, hv), F32),
    ]
    dk, dv, ds0 = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, seq_len=seq_len, n_blocks=n_blocks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n, b, n_blocks),
            in_specs=[qk, qk, vo, vo, st],
            out_specs=[qk, vo, st],
            scratch_shapes=[pltpu.VMEM((h, hv), F32)],
        ),
        out_shape=out_shape,
        compiler_params=_params(),
        cost_estimate=pl.CostEstimate(  # v dO^T, k q^T, dovt q, attt dO; v dS^T, kd dS, qd^T dO
            flops=_flops(b, n, n_real, cfg.chunk, h, hv, intra=4, state=3),
            transcendentals=trans,
            bytes_accessed=_nbytes(qt, kt, vt, dot_, dst, *out_shape),
        ),
        interpret=cfg.interpret,
        name="linear_attention_tpu_bwd_dkdv",
    )(ld, qt, kt, vt, dot_, dst)
    return dq, dk, dv, ds0


# ----------------------------------------------------------------------------------------------
# Layout, padding, entry points ([B, T, N, *] in and out, as kernel.py's generic variant).


def _heads_major(x, tp: int):
    """[B, T, N, D] -> [B, N, Tp, D], padded along T with zero rows."""
    x = jnp.swapaxes(x, 1, 2)
    t = x.shape[2]
    return x if t == tp else jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0)))


def _tokens_major(x, t: int):
    """[B, N, Tp, D] -> [B, T, N, D]."""
    return jnp.swapaxes(x[:, :, :t], 1, 2)


def _padded(t: int, cfg: TpuConfig) -> int:
    return -(-t // cfg.block_t) * cfg.block_t


def forward(q, k, v, s0, ld, cfg: TpuConfig):
    """q, k [B, T, N, H], v [B, T, N, Hv], s0 [B, N, H, Hv] fp32, ld [N] -> (o [B, T, N, Hv] in
    q's dtype, final_state [B, N, H, Hv] fp32)."""
    t, cd = q.shape[1], compute_dtype(q.dtype)
    tp = _padded(t, cfg)
    o, st = _forward_padded(
        ld.astype(F32),
        _heads_major(q.astype(cd), tp),
        _heads_major(k.astype(cd), tp),
        _heads_major(v.astype(cd), tp),
        s0,
        cfg,
        t,
    )
    return _tokens_major(o, t).astype(q.dtype), st


def backward(q, k, v, s0, ld, do, dst, cfg: TpuConfig):
    """(dq, dk fp32 [B, T, N, H], dv [B, T, N, Hv] in v's dtype, d initial_state fp32)."""
    t, cd = q.shape[1], compute_dtype(q.dtype)
    tp = _padded(t, cfg)
    qh, kh, vh = (_heads_major(x.astype(cd), tp) for x in (q, k, v))
    dq, dk, dv, ds0 = _backward_padded(
        ld.astype(F32), qh, kh, vh, s0, _heads_major(do.astype(cd), tp), dst.astype(F32), cfg, t
    )
    return (_tokens_major(dq, t), _tokens_major(dk, t), _tokens_major(dv, t).astype(v.dtype), ds0)
