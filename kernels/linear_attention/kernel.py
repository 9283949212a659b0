"""Chunked causal linear attention as a Pallas kernel, forward and backward (custom_vjp).

Computes what `reference.recurrent` defines (see reference.py for the math):

    S_t = gamma * S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,   gamma = exp(log_decay) per head.

Design of the generic variant (interpret mode on CPU, Triton on GPU; generic pallas_call):

* grid = (B, N, Hv // block_v), every axis parallel. Value columns of the state are independent
  (o[:, j] depends only on S[:, j] and v[:, j]), so splitting Hv into block_v tiles is exact in the
  forward and multiplies the number of programs, which matters on a GPU when B * N is small.
* Each program owns one (batch, head, value tile) and walks the chunks of T with a `lax.fori_loop`
  inside the kernel, carrying the fp32 state S [H, block_v] in the loop carry (registers on a GPU).
  The blocks of q, k, v, o span the whole (padded) sequence; the kernel loads one [C, H] chunk at a
  time with `ref[pl.ds(start, C), :]`, the pattern of JAX's own Pallas GPU attention. A sequential
  "arbitrary" grid axis over chunks with a scratch accumulator was not used: the Triton lowering
  has no scratch memory and does not order grid programs, so the in-kernel loop is the design that
  runs on all three targets.
* Backward: one kernel per program, two loops. A forward loop recomputes the chunk-start states
  (nothing but q, k, v, the initial state and log_decay is saved, so residual memory is O(T), not
  O(T / C * H * Hv)) and produces dq; a reverse loop carries dS (starting from the cotangent of
  final_state) and produces dk, dv; what is left of dS at the start is d initial_state. dq and dk
  are sums over value tiles, so the kernel writes fp32 partials [Hv // block_v, ...] that are summed
  outside (one tile by default when Hv <= 64).
* d log_decay comes from an identity, computed outside the kernel from the exact dq and dk:
  dL/dlog_gamma = sum_t (t + 1) (<q_t, dq_t> - <k_t, dk_t>) + T <dS_T, S_T>   (summed over batch).
  (Terms exp(log_gamma * (t - s)) split as (t + 1) - (s + 1); the initial/final-state terms fold into
  T <dS_T, S_T>.) It is exact, but is a weighted difference of large sums, so for long T in low
  precision it is less accurate than dq/dk themselves.

Numerics: matmul operands in the input dtype (bf16 -> tensor cores), fp32 accumulation, fp32 state;
fp32 inputs get IEEE fp32 matmuls (Precision.HIGHEST). Padding of T to a multiple of C is at the
end with zeros and decay 1 (log-decay 0) on padded positions, so final_state is the state after the
T real tokens (reference.chunked uses the same rule).

Platforms. The kernels here are the "generic" variant; TPUs get kernel_tpu.py's Mosaic variant
(heads-major blocks, chunks on an "arbitrary" grid axis with the state in VMEM scratch), because
the generic blocks squeeze the head axis next to the minor dims, which Mosaic rejects, and hold
the whole sequence in VMEM. `linear_attention` chooses per lowering platform with
`lax.platform_dependent` (every branch is traced, only the one for the platform being lowered for
is lowered), so a program jitted on a CPU host and lowered ahead of time for TPU devices gets the
Mosaic kernels; `backend="tpu"` or `backend="generic"` forces one variant (kernels/platforms.py). Both
variants return the same values and dtypes; the custom_vjp and the d log_decay identity here are
shared.

Differentiable: q, k, v, initial_state, log_decay (and the cotangent of final_state is accepted).
Static (not differentiable): scale, chunk_size, block_v, block_t, interpret, backend.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .. import platforms
from . import kernel_tpu

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one call (hashable: it is a nondiff argument of the custom_vjp)."""

    chunk: int
    block_v: int
    scale: float
    has_decay: bool
    interpret: bool


# ----------------------------------------------------------------------------------------------
# Kernel bodies. Refs are per program: q/k [Tp, H], v/o [Tp, bv], s0/sT [H, bv], ld a scalar.


def _mm(a, b, ca, cb, precision):
    """a @ b contracting dim ca of a with dim cb of b (2-D), fp32 result."""
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=F32)


def _chunk_decay(a, c, chunk, seq_len, causal):
    """Per-chunk decay factors for chunk index c (traced) and log-gamma a (fp32 scalar).

    b_i = a * min(i + 1, L) with L the number of real tokens in the chunk: padded positions get
    log-decay 0. Returns exp(b) [C], D [C, C] (exp(b_i - b_j) below the diagonal, else 0),
    exp(b_last - b) [C] and exp(b_last) (scalar). All exponents are <= 0.
    """
    idx = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    valid = seq_len - c * chunk
    b = a * jnp.minimum(idx + 1, valid).astype(F32)
    blast = a * jnp.minimum(chunk, valid).astype(F32)
    diff = jnp.minimum(b[:, None] - b[None, :], 0.0)
    dmat = jnp.where(causal, jnp.exp(diff), 0.0)
    return jnp.exp(b), dmat, jnp.exp(blast - b), jnp.exp(blast)


def _fwd_kernel(*refs, cfg: _Cfg, seq_len: int, n_chunks: int, precision):
    if cfg.has_decay:
        q_ref, k_ref, v_ref, s0_ref, ld_ref, o_ref, st_ref = refs
        a = ld_ref[()].astype(F32)
    else:
        q_ref, k_ref, v_ref, s0_ref, o_ref, st_ref = refs
    chunk, cd = cfg.chunk, q_ref.dtype
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    causal = row >= col

    def body(c, s):
        sl = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        q, k, v = q_ref[sl, :], k_ref[sl, :], v_ref[sl, :]
        qk = _mm(q, k, 1, 1, precision)  # [C, C]
        if cfg.has_decay:
            eb, dmat, ekd, eblast = _chunk_decay(a, c, chunk, seq_len, causal)
            att = (qk * dmat).astype(cd)
            o = _mm(att, v, 1, 0, precision) + eb[:, None] * _mm(q, s.astype(cd), 1, 0, precision)
            kd = (k.astype(F32) * ekd[:, None]).astype(cd)
            s = eblast * s + _mm(kd, v, 0, 0, precision)
        else:
            att = jnp.where(causal, qk, 0.0).astype(cd)
            o = _mm(att, v, 1, 0, precision) + _mm(q, s.astype(cd), 1, 0, precision)
            s = s + _mm(k, v, 0, 0, precision)
        o_ref[sl, :] = (cfg.scale * o).astype(o_ref.dtype)
        return s

    st_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))


def _bwd_kernel(*refs, cfg: _Cfg, seq_len: int, n_chunks: int, precision):
    if cfg.has_decay:
        (q_ref, k_ref, v_ref, s0_ref, ld_ref, do_ref, dst_ref, dq_ref, dk_ref, dv_ref, ds0_ref) = refs
        a = ld_ref[()].astype(F32)
    else:
        (q_ref, k_ref, v_ref, s0_ref, do_ref, dst_ref, dq_ref, dk_ref, dv_ref, ds0_ref) = refs
        a = None
    chunk, cd, scale = cfg.chunk, q_ref.dtype, cfg.scale
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    causal = row >= col

    def decay(c):
        if cfg.has_decay:
            return _chunk_decay(a, c, chunk, seq_len, causal)
        return None, causal.astype(F32), None, None

    # Loop 1 (forward in T): recompute the chunk-start state S, emit dq.
    #   dq = scale * [ ((dO v^T) * D) k + exp(b) * (dO S^T) ]
    def fwd_body(c, s):
        sl = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        k, v, do = k_ref[sl, :], v_ref[sl, :], do_ref[sl, :]
        eb, dmat, ekd, eblast = decay(c)
        dov = (_mm(do, v, 1, 1, precision) * dmat).astype(cd)  # [C, C]
        dq_inter = _mm(do, s.astype(cd), 1, 1, precision)  # [C, H]
        if cfg.has_decay:
            dq_inter = eb[:, None] * dq_inter
            kd = (k.astype(F32) * ekd[:, None]).astype(cd)
            s = eblast * s + _mm(kd, v, 0, 0, precision)
        else:
            s = s + _mm(k, v, 0, 0, precision)
        dq_ref[sl, :] = (scale * (_mm(dov, k, 1, 0, precision) + dq_inter)).astype(dq_ref.dtype)
        return s

    lax.fori_loop(0, n_chunks, fwd_body, s0_ref[...].astype(F32))

    # Loop 2 (reverse in T): carry dS = dL/d(state after chunk c), emit dk, dv.
    #   dk = scale * ((dO v^T) * D)^T q + exp(b_last - b) * (v dS^T)
    #   dv = scale * ((q k^T) * D)^T dO + (k * exp(b_last - b)) dS
    #   dS <- exp(b_last) dS + scale * (q * exp(b))^T dO
    def rev_body(i, ds):
        c = n_chunks - 1 - i
        sl = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        q, k, v, do = q_ref[sl, :], k_ref[sl, :], v_ref[sl, :], do_ref[sl, :]
        eb, dmat, ekd, eblast = decay(c)
        dov = (_mm(do, v, 1, 1, precision) * dmat).astype(cd)  # [C(t), C(s)]
        att = (_mm(q, k, 1, 1, precision) * dmat).astype(cd)  # [C(t), C(s)]
        dsc = ds.astype(cd)
        dk_state = _mm(v, dsc, 1, 1, precision)  # [C, H]
        if cfg.has_decay:
            dk_state = ekd[:, None] * dk_state
            kd = (k.astype(F32) * ekd[:, None]).astype(cd)
            qd = (q.astype(F32) * eb[:, None]).astype(cd)
        else:
            kd, qd = k, q
        dk = scale * _mm(dov, q, 0, 0, precision) + dk_state
        dv = scale * _mm(att, do, 0, 0, precision) + _mm(kd, dsc, 1, 0, precision)
        dk_ref[sl, :] = dk.astype(dk_ref.dtype)
        dv_ref[sl, :] = dv.astype(dv_ref.dtype)
        ds_prev = scale * _mm(qd, do, 0, 0, precision)
        if cfg.has_decay:
            return eblast * ds + ds_prev
        return ds + ds_prev

    ds0_ref[...] = lax.fori_loop(0, n_chunks, rev_body, dst_ref[...].astype(F32))


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded to Tp = n_chunks * chunk).


def _compiler_params(cfg: _Cfg, h: int):
    """Triton launch parameters on a GPU backend; None elsewhere (interpret mode, TPU defaults)."""
    if cfg.interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4 if max(h, cfg.block_v) <= 64 else 8, num_stages=2)


def _specs(b, tp, n, h, hv, cfg):
    del b, n, hv
    bv = cfg.block_v
    qk = pl.BlockSpec((None, tp, None, h), lambda ib, i_n, j: (ib, 0, i_n, 0))
    vo = pl.BlockSpec((None, tp, None, bv), lambda ib, i_n, j: (ib, 0, i_n, j))
    st = pl.BlockSpec((None, None, h, bv), lambda ib, i_n, j: (ib, i_n, 0, j))
    ld = pl.BlockSpec((None,), lambda ib, i_n, j: (i_n,))
    return qk, vo, st, ld


def _forward_call(q, k, v, s0, ld, cfg: _Cfg, seq_len: int):
    b, tp, n, h = q.shape
    hv = v.shape[-1]
    n_chunks = tp // cfg.chunk
    qk, vo, st, lds = _specs(b, tp, n, h, hv, cfg)
    in_specs = [qk, qk, vo, st] + ([lds] if cfg.has_decay else [])
    args = (q, k, v, s0) + ((ld,) if cfg.has_decay else ())
    kernel = functools.partial(
        _fwd_kernel, cfg=cfg, seq_len=seq_len, n_chunks=n_chunks, precision=_mm_precision(q.dtype)
    )
    return pl.pallas_call(
        kernel,
        grid=(b, n, hv // cfg.block_v),
        in_specs=in_specs,
        out_specs=[vo, st],
        out_shape=[jax.ShapeDtypeStruct((b, tp, n, hv), q.dtype), jax.ShapeDtypeStruct((b, n, h, hv), F32)],
        compiler_params=_compiler_params(cfg, h),
        interpret=cfg.interpret,
        name="linear_attention_fwd",
    )(*args)


def _backward_call(q, k, v, s0, ld, do, dst, cfg: _Cfg, seq_len: int):
    b, tp, n, h = q.shape
    hv = v.shape[-1]
    nv = hv // cfg.block_v
    n_chunks = tp // cfg.chunk
    qk, vo, st, lds = _specs(b, tp, n, h, hv, cfg)
    # dq, dk: fp32 partials per value tile, [nv, B, Tp, N, H], summed by the caller.
    part = pl.BlockSpec((None, None, tp, None, h), lambda ib, i_n, j: (j, ib, 0, i_n, 0))
    in_specs = [qk, qk, vo, st] + ([lds] if cfg.has_decay else []) + [vo, st]
    args = (q, k, v, s0) + ((ld,) if cfg.has_decay else ()) + (do, dst)
    kernel = functools.partial(
        _bwd_kernel, cfg=cfg, seq_len=seq_len, n_chunks=n_chunks, precision=_mm_precision(q.dtype)
    )
    return pl.pallas_call(
        kernel,
        grid=(b, n, nv),
        in_specs=in_specs,
        out_specs=[part, part, vo, st],
        out_shape=[
            jax.ShapeDtypeStruct((nv, b, tp, n, h), F32),
            jax.ShapeDtypeStruct((nv, b, tp, n, h), F32),
            jax.ShapeDtypeStruct((b, tp, n, hv), v.dtype),
            jax.ShapeDtypeStruct((b, n, h, hv), F32),
        ],
        compiler_params=_compiler_params(cfg, h),
        interpret=cfg.interpret,
        name="linear_attention_bwd",
    )(*args)


def _mm_precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _pad_t(x, tp):
    t = x.shape[1]
    return x if t == tp else jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))


# ----------------------------------------------------------------------------------------------
# The generic variant on unpadded [B, T, N, *] arrays (kernel_tpu.forward / backward have the same
# signatures and return the same shapes and dtypes).


def _generic_forward(q, k, v, s0, ld, cfg: _Cfg):
    """(o [B, T, N, Hv] in q's dtype, final_state [B, N, H, Hv] fp32)."""
    t = q.shape[1]
    tp = -(-t // cfg.chunk) * cfg.chunk
    o, st = _forward_call(_pad_t(q, tp), _pad_t(k, tp), _pad_t(v, tp), s0, ld, cfg, t)
    return o[:, :t], st


def _generic_backward(q, k, v, s0, ld, do, dst, cfg: _Cfg):
    """(dq, dk fp32 [B, T, N, H], dv [B, T, N, Hv] in v's dtype, d initial_state fp32)."""
    t = q.shape[1]
    tp = -(-t // cfg.chunk) * cfg.chunk
    dq_p, dk_p, dv, ds0 = _backward_call(
        _pad_t(q, tp), _pad_t(k, tp), _pad_t(v, tp), s0, ld, _pad_t(do.astype(q.dtype), tp), dst.astype(F32), cfg, t
    )
    return jnp.sum(dq_p, axis=0)[:, :t], jnp.sum(dk_p, axis=0)[:, :t], dv[:, :t], ds0


_VARIANTS = {"generic": (_generic_forward, _generic_backward), "tpu": (kernel_tpu.forward, kernel_tpu.backward)}


@dataclasses.dataclass(frozen=True)
class _Static:
    """The custom_vjp's static argument: the platform plan, and whether there is a decay."""

    plan: platforms.Plan
    has_decay: bool


def _dispatch(static: _Static, which: int, *args):
    return platforms.dispatch(static.plan, _VARIANTS, which, *args)


# ----------------------------------------------------------------------------------------------
# custom_vjp core: all array arguments present (s0 zeros / ld zeros when the caller gave None).


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_attention(q, k, v, s0, ld, static: _Static):
    return _dispatch(static, 0, q, k, v, s0, ld)


def _la_fwd(q, k, v, s0, ld, static: _Static):
    o, st = _dispatch(static, 0, q, k, v, s0, ld)
    return (o, st), (q, k, v, s0, ld, st)


def _la_bwd(static: _Static, res, cts):
    q, k, v, s0, ld, st = res
    do, dst = cts
    t = q.shape[1]
    dq32, dk32, dv, ds0 = _dispatch(static, 1, q, k, v, s0, ld, do, dst.astype(F32))
    if static.has_decay:
        # dL/dlog_gamma = sum_t (t+1) (<q_t, dq_t> - <k_t, dk_t>) + T <dS_T, S_T>, summed over B.
        w = jnp.arange(1, t + 1, dtype=F32)[None, :, None]
        qdq = jnp.sum(q.astype(F32) * dq32, axis=-1)  # [B, T, N]
        kdk = jnp.sum(k.astype(F32) * dk32, axis=-1)
        state_term = t * jnp.sum(dst.astype(F32) * st, axis=(0, 2, 3))
        dld = (jnp.sum(w * (qdq - kdk), axis=(0, 1)) + state_term).astype(ld.dtype)
    else:
        dld = jnp.zeros_like(ld)
    return (dq32.astype(q.dtype), dk32.astype(k.dtype), dv, ds0.astype(s0.dtype), dld)


_linear_attention.defvjp(_la_fwd, _la_bwd)


# ----------------------------------------------------------------------------------------------
# Public entry point.


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _validate(q, k, v, log_decay, initial_state, scale, chunk_size, block_v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D [B, T, N, H], got shape {getattr(x, 'shape', None)}")
    if k.shape != q.shape:
        raise ValueError(f"k.shape must equal q.shape [B, T, N, H], got q {q.shape} and k {k.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v.shape[:3] must equal q.shape[:3] (B, T, N), got q {q.shape} and v {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, n, h = q.shape
    hv = v.shape[-1]
    if t < 1:
        raise ValueError(f"sequence length T must be >= 1, got T={t}")
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size <= 0
        or chunk_size % 8
    ):
        raise ValueError(f"chunk_size must be a positive multiple of 8, got {chunk_size!r}")
    if isinstance(block_v, bool) or not isinstance(block_v, numbers.Integral) or block_v <= 0 or hv % block_v:
        raise ValueError(f"block_v must be a positive divisor of Hv={hv}, got {block_v!r}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ValueError(f"scale must be a Python/NumPy real number (static), got {type(scale)}")
    if log_decay is not None:
        if getattr(log_decay, "shape", None) != (n,):
            raise ValueError(f"log_decay must have shape [N]=({n},), got {getattr(log_decay, 'shape', None)}")
        if not jnp.issubdtype(log_decay.dtype, jnp.floating):
            raise ValueError(f"log_decay must be floating, got dtype {log_decay.dtype}")
        if not isinstance(log_decay, jax.core.Tracer):
            mx = float(np.max(np.asarray(log_decay)))
            if not mx <= 0.0:
                raise ValueError(f"log_decay must be <= 0 (gamma = exp(log_decay) in (0, 1]), got max {mx}")
    if initial_state is not None and getattr(initial_state, "shape", None) != (b, n, h, hv):
        raise ValueError(
            f"initial_state must have shape [B, N, H, Hv]=({b}, {n}, {h}, {hv}), got "
            f"{getattr(initial_state, 'shape', None)}"
        )


def linear_attention(
    q,
    k,
    v,
    *,
    log_decay=None,
    initial_state=None,
    scale=1.0,
    chunk_size=64,
    block_v=None,
    interpret=None,
    block_t=None,
    backend=None,
):
    """Causal linear attention, chunked Pallas kernel with a custom_vjp.

    o_t = scale * sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s  (+ the initial-state term), that is
    S_t = gamma S_{t-1} + k_t^T v_t and o_t = scale * q_t S_t. No softmax, no feature map.

    Args:
      q, k: [B, T, N, H]; v: [B, T, N, Hv] (Hv may differ from H). One floating dtype.
      log_decay: [N] per-head log(gamma), <= 0 (RetNet / Lightning decay), or None (gamma = 1).
        Differentiable.
      initial_state: [B, N, H, Hv] state carried in (cast to fp32), or None for zeros.
      scale: static real multiplying q (default 1.0; pass H ** -0.5 for the usual scaling).
      chunk_size: C, a positive multiple of 8; T need not be a multiple of it. On a GPU (Triton)
        C, H and block_v must also be powers of two >= 16.
      block_v: value-dimension tile per program of the generic kernel (default Hv if Hv <= 64
        else 64); must divide Hv. The TPU kernel keeps the whole Hv (no tiling).
      interpret: None interprets when lowered for CPU and compiles elsewhere; True / False force
        it (True with backend None is the generic kernel interpreted everywhere).
      block_t: tokens per grid step of the TPU kernel, a multiple of chunk_size (default: the
        chunks spread evenly over the fewest blocks of at most max(C, 512) tokens).
      backend: None picks by the platform the program is lowered for (the Mosaic kernels of
        kernel_tpu.py on TPU, the generic kernels elsewhere); "tpu" or "generic" forces one.

    Returns:
      (o [B, T, N, Hv] in q.dtype, final_state [B, N, H, Hv] fp32). final_state is the state after
      the T tokens: feed it as initial_state of the next call to continue the sequence (decoding,
      or LASP-2 sequence parallelism, which differentiates through it).

    Raises:
      ValueError: on mismatched shapes or dtypes, a bad chunk_size / block_v / block_t /
        log_decay / scale / backend.
    """
    platforms.check_backend(backend)
    hv = getattr(v, "shape", (None,))[-1]
    if block_v is None and isinstance(hv, int):
        block_v = hv if hv <= 64 or hv % 64 else 64
    _validate(q, k, v, log_decay, initial_state, scale, chunk_size, block_v)
    b, t, n, h = q.shape
    if backend != "tpu" and interpret is not True and jax.default_backend() == "gpu":
        for name, val in (("chunk_size", chunk_size), ("H", h), ("block_v", block_v)):
            if not (_is_pow2(val) and val >= 16):
                raise ValueError(f"the Triton kernel needs {name} to be a power of two >= 16, got {name}={val}")
    has_decay = log_decay is not None
    # Every variant in the plan is traced, so its rules are checked here whatever runs.
    generic_cfg = _Cfg(
        chunk=int(chunk_size), block_v=int(block_v), scale=float(scale), has_decay=has_decay, interpret=True
    )
    tpu_cfg = kernel_tpu.tpu_config(chunk_size=chunk_size, block_t=block_t, scale=scale, has_decay=has_decay, seq_len=t)
    static = _Static(platforms.plan(backend, interpret, generic_cfg, tpu_cfg), has_decay)
    s0 = jnp.zeros((b, n, h, hv), F32) if initial_state is None else jnp.asarray(initial_state).astype(F32)
    ld = jnp.zeros((n,), F32) if log_decay is None else jnp.asarray(log_decay)
    return _linear_attention(q, k, v, s0, ld, static)
