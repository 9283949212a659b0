"""Pure-JAX causal linear attention: the step-by-step recurrence and the chunkwise form.

Notation (scaling-book letters): B batch, T sequence, N heads, H key/query head dim, Hv value head
dim, C chunk size. Per head, with decay gamma = exp(log_decay) in (0, 1] (1 when log_decay is None):

    S_t = gamma * S_{t-1} + k_t^T v_t          S [H, Hv], S_{-1} = initial_state (zeros if None)
    o_t = scale * q_t S_t

so o_t = scale * sum_{s<=t} gamma^(t-s) (q_t . k_s) v_s + scale * gamma^(t+1) q_t S_{-1}.
No softmax and no feature map: the caller applies any feature map to q and k first.

`recurrent` is the ground truth (one lax.scan step per token, fp32 throughout, HIGHEST precision).
`chunked` is the algorithm the Pallas kernel implements, written in jnp: the same numerics policy as
the kernel (matmul operands in the input dtype, fp32 accumulation, fp32 state), so it is also the
XLA baseline that bench.py compares the kernel against. Both are differentiable by jax.grad in every
array argument, log_decay included.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _decay_and_state(q, k, v, log_decay, initial_state):
    """gamma [N] fp32 (ones when log_decay is None) and the fp32 initial state [B, N, H, Hv]."""
    b, _, n, h = q.shape
    hv = v.shape[-1]
    gamma = jnp.ones((n,), F32) if log_decay is None else jnp.exp(log_decay.astype(F32))
    s0 = jnp.zeros((b, n, h, hv), F32) if initial_state is None else initial_state.astype(F32)
    return gamma, s0


def recurrent(q, k, v, *, log_decay=None, initial_state=None, scale=1.0):
    """Causal linear attention by its recurrence, one token at a time (the ground truth).

    Args:
      q, k: [B, T, N, H]; v: [B, T, N, Hv].
      log_decay: [N] per-head log(gamma), <= 0, or None for no decay.
      initial_state: [B, N, H, Hv] fp32 state carried in, or None for zeros.
      scale: multiplies q (default 1.0).

    Returns:
      (o [B, T, N, Hv] in q.dtype, final_state [B, N, H, Hv] fp32).
    """
    gamma, s0 = _decay_and_state(q, k, v, log_decay, initial_state)
    hi = lax.Precision.HIGHEST
    # Time-major so lax.scan walks T.
    qs, ks, vs = (jnp.swapaxes(x.astype(F32), 0, 1) for x in (q, k, v))

    def step(s, qkv):
        qt, kt, vt = qkv  # [B, N, H], [B, N, H], [B, N, Hv]
        s = gamma[None, :, None, None] * s + jnp.einsum("bnh,bnv->bnhv", kt, vt, precision=hi)
        ot = scale * jnp.einsum("bnh,bnhv->bnv", qt, s, precision=hi)
        return s, ot

    s_final, o = lax.scan(step, s0, (qs, ks, vs))
    return jnp.swapaxes(o, 0, 1).astype(q.dtype), s_final


def _precision(dtype):
    """fp32 inputs get true fp32 matmuls (no TF32); low-precision inputs use the native unit."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def chunked(q, k, v, *, chunk_size, log_decay=None, initial_state=None, scale=1.0):
    """Causal linear attention in chunkwise form (pure JAX; what the Pallas kernel computes).

    T is padded at the end to a multiple of chunk_size with zero q/k/v rows, and padded positions
    get decay 1 (log-decay 0): zero k/v add nothing to the state and no decay is applied past the
    real tokens, so final_state is the state after the T real tokens. Within a chunk of C positions
    with cumulative log-decay b_i (b_i = log_gamma * (i + 1) for real positions):

        o     = scale * [ ((q k^T) * D) v + exp(b) * (q S) ],   D_ij = exp(b_i - b_j) if j <= i else 0
        S_new = exp(b_last) S + (k * exp(b_last - b))^T v

    Every exponent is <= 0, so strong decay underflows to 0 rather than overflowing.
    Arguments and returns as `recurrent`, plus chunk_size (a positive int).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    bsz, t, n, h = q.shape
    hv = v.shape[-1]
    c = chunk_size
    nc = -(-t // c)
    tp = nc * c
    cd = q.dtype
    prec = _precision(cd)
    _, s0 = _decay_and_state(q, k, v, None, initial_state)

    def to_chunks(x):  # [B, T, N, D] -> [nc, B, N, C, D]
        x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        return x.reshape(bsz, nc, c, n, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    causal = jnp.tril(jnp.ones((c, c), bool))

    if log_decay is None:

        def step(s, xs):
            qi, ki, vi = xs
            a = jnp.einsum("bnch,bndh->bncd", qi, ki, precision=prec, preferred_element_type=F32)
            a = jnp.where(causal, a, 0.0).astype(cd)
            o = jnp.einsum("bncd,bndv->bncv", a, vi, precision=prec, preferred_element_type=F32)
            o = o + jnp.einsum("bnch,bnhv->bncv", qi, s.astype(cd), precision=prec, preferred_element_type=F32)
            s = s + jnp.einsum("bnch,bncv->bnhv", ki, vi, precision=prec, preferred_element_type=F32)
            return s, scale * o

        s_final, oc = lax.scan(step, s0, (qc, kc, vc))
    else:
        ld = log_decay.astype(F32)
        real = (jnp.arange(tp) < t).reshape(nc, c)
        # Cumulative log-decay within each chunk, 0 increments on padded positions: [nc, N, C].
        bcum = jnp.cumsum(jnp.where(real[:, None, :], ld[None, :, None], 0.0), axis=-1)

        def step(s, xs):
            qi, ki, vi, b = xs  # b [N, C]
            blast = b[:, -1]
            a = jnp.einsum("bnch,bndh->bncd", qi, ki, precision=prec, preferred_element_type=F32)
            # where before exp: the masked (j > i) exponents are positive and could overflow.
            dmat = jnp.exp(jnp.where(causal, b[:, :, None] - b[:, None, :], -jnp.inf))
            a = (a * dmat[None]).astype(cd)
            o = jnp.einsum("bncd,bndv->bncv", a, vi, precision=prec, preferred_element_type=F32)
            inter = jnp.einsum("bnch,bnhv->bncv", qi, s.astype(cd), precision=prec, preferred_element_type=F32)
            o = o + jnp.exp(b)[None, :, :, None] * inter
            kd = (ki.astype(F32) * jnp.exp(blast[:, None] - b)[None, :, :, None]).astype(cd)
            s = jnp.exp(blast)[None, :, None, None] * s + jnp.einsum(
                "bnch,bncv->bnhv", kd, vi, precision=prec, preferred_element_type=F32
            )
            return s, scale * o

        s_final, oc = lax.scan(step, s0, (qc, kc, vc, bcum))

    o = oc.transpose(1, 0, 3, 2, 4).reshape(bsz, tp, n, hv)[:, :t]
    return o.astype(q.dtype), s_final
