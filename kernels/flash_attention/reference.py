"""Pure-JAX attention: the reference the flash-attention kernel is tested against.

Shapes: q[B, T, N, H], k/v[B, S, K, H] with N a multiple of K (grouped-query attention; K == 1 is
multi-query). Query head n reads key/value head n // (N / K). The whole [B, N, T, S] score matrix is
materialised, so this is for tests, small shapes and as the XLA baseline in bench.py.

Conventions shared with kernel.py (tests hold both to them):
- scores s = softmax_scale * q.k in fp32 (softmax_scale defaults to H ** -0.5);
- causal: query i sees key j iff j <= i (top-left aligned), which needs T == S;
- window W (sliding-window attention, causal only): besides, query i sees key j only if
  i - j < W, its last W keys including its own (Mistral's, and transformers' convention);
- segment ids: query i sees key j iff q_segment_ids[b, i] == kv_segment_ids[b, j];
- softcap c (Gemma 2's attention logit soft-capping): the scaled scores become c * tanh(s / c),
  before any mask and the softmax (`softcapped`, the one statement of it that the other modules
  import); so s, lse and the P = exp(s - lse) of the backward are all of the capped scores, and
  d s_capped / d(q.k) = scale * (1 - tanh(s / c)^2) enters dS. None or 0: no cap;
- lse[B, N, T] = log(sum_j exp(s_ij)) over the visible keys, natural log, fp32;
- a row with no visible key (fully masked) has output 0 and lse = -inf, with no NaN anywhere,
  forward or backward. Merging blocks by their lse must then guard -inf (see the docs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["attention", "attention_backward", "check_inputs", "check_softcap", "make_mask", "softcapped"]

# Head dims the compiled kernel supports; in interpret mode smaller multiples of 16 are allowed too
# (so that CPU tests are fast). The reference itself accepts any head dim.
KERNEL_HEAD_DIMS = (64, 128, 256)
INTERPRET_HEAD_DIMS = (16, 32, 48) + KERNEL_HEAD_DIMS


def check_softcap(softcap) -> float | None:
    """The attention logit soft-cap as a static Python float, or None for no cap (None or 0);
    ValueError naming the value for anything else (a bool, a string, a negative or non-finite
    number, an array)."""
    number = isinstance(softcap, (int, float, np.integer, np.floating)) and not isinstance(softcap, (bool, np.bool_))
    if softcap is not None and not (number and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(
            f"softcap={softcap!r}: attention logit soft-capping takes a positive number c (the scores become "
            "c * tanh(s / c); Gemma 2 uses 50.0), or None (or 0) for no cap"
        )
    return float(softcap) if softcap else None


def softcapped(scores, softcap):
    """Gemma 2's attention logit soft-capping of the (scaled) scores: softcap * tanh(scores /
    softcap), applied before any mask and the softmax; scores unchanged when softcap is None (or
    0). softcap is a static Python number (see `check_softcap`)."""
    if not softcap:
        return scores
    return softcap * jnp.tanh(scores / softcap)


def check_inputs(q, k, v, *, causal, q_segment_ids, kv_segment_ids, head_dims=None, window=None, softcap=None):
    """Raise ValueError, naming the constraint and the values, for inputs attention cannot take."""
    check_softcap(softcap)
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window={window!r}: a sliding window is a positive number of keys (each query's last W) and "
            f"needs causal=True (causal={causal})"
        )
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 (q[B, T, N, H], k/v[B, S, K, H]); got shapes q{q.shape}, k{k.shape}, v{v.shape}"
        )
    b, t, n, h = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k{k.shape}, v{v.shape}")
    bk, s, kh, hk = k.shape
    if bk != b:
        raise ValueError(f"batch sizes differ: q has B={b}, k/v have B={bk}")
    if hk != h:
        raise ValueError(f"head dims differ: q has H={h}, k/v have H={hk}")
    if kh == 0 or n % kh != 0:
        raise ValueError(
            f"the number of query heads N must be a multiple of the number of kv heads K; got N={n}, K={kh}"
        )
    if causal and t != s:
        raise ValueError(f"causal attention is top-left aligned and needs T == S; got T={t}, S={s}")
    if head_dims is not None and h not in head_dims:
        raise ValueError(f"head dim H={h} is not supported; supported head dims: {head_dims}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        # the kernels cast them to int32: fractional ids would silently merge segments
        for name, ids in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(f"{name} must be integers; got {ids.dtype}")
        if q_segment_ids.shape != (b, t):
            raise ValueError(f"q_segment_ids must have shape [B, T] = {(b, t)}; got {q_segment_ids.shape}")
        if kv_segment_ids.shape != (b, s):
            raise ValueError(f"kv_segment_ids must have shape [B, S] = {(b, s)}; got {kv_segment_ids.shape}")


def make_mask(t, s, *, causal, q_segment_ids=None, kv_segment_ids=None, window=None):
    """Boolean visibility mask broadcastable to [B, 1, T, S], or None when everything is visible."""
    mask = None
    if causal:
        back = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]  # how far key j is behind query i
        mask = ((back >= 0) if window is None else (back >= 0) & (back < window))[None, None]
    if q_segment_ids is not None:
        seg = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
        mask = seg if mask is None else mask & seg
    return mask


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    return_lse=False,
    window=None,
    softcap=None,
):
    """softmax(cap(scale * q k^T) + mask) v for q[B, T, N, H], k/v[B, S, K, H] -> o[B, T, N, H] in
    q.dtype, and lse[B, N, T] in fp32 when return_lse; cap is `softcapped` (the identity when
    softcap is None). See the module docstring for the conventions."""
    check_inputs(
        q,
        k,
        v,
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        window=window,
        softcap=softcap,
    )
    softcap = check_softcap(softcap)
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    qg = q.reshape(b, t, kh, n // kh, h)  # query head n = kv head * G + g
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = softcapped(scores.reshape(b, n, t, s) * scale, softcap)
    mask = make_mask(t, s, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window)
    if mask is None:
        mask = jnp.ones((1, 1, t, s), dtype=bool)
    # A masked entry contributes exp(-inf) = 0 and, being a constant branch of `where`, no gradient;
    # the row max is taken over visible entries only and is 0 for an empty row, so no inf - inf.
    m = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(jnp.where(mask, scores - m, -jnp.inf))
    l = jnp.sum(p, axis=-1, keepdims=True)
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    probs = (p / l_safe).reshape(b, kh, n // kh, t, s)
    o = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    o = o.reshape(b, t, n, h).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return o, lse


def attention_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    *,
    causal=False,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    window=None,
    softcap=None,
):
    """(dq, dk, dv) given the output o and lse of a (possibly longer) attention and the cotangent do,
    recomputing only P = exp(s - lse): the pure-JAX twin of `kernel.flash_attention_backward`
    (ring attention sums it over key blocks with the final o and lse). fp32 math, inputs' dtypes out.
    Segment ids and the window as in `attention`: pairs they hide get P = 0. With softcap, s is the
    capped score and dS carries the cap's derivative 1 - tanh^2 (per score, so blocks still sum)."""
    check_inputs(
        q,
        k,
        v,
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        window=window,
        softcap=softcap,
    )
    softcap = check_softcap(softcap)
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    f32 = lambda x: x.astype(jnp.float32)
    qg, dog, og = (f32(x).reshape(b, t, kh, g, h) for x in (q, do, o))
    scores = softcapped(jnp.einsum("btkgh,bskh->bkgts", qg, f32(k)) * scale, softcap)
    lse_g = lse.reshape(b, kh, g, t)[..., None]
    visible = jnp.isfinite(lse_g)
    if causal:
        visible = visible & make_mask(t, s, causal=True, window=window)[0, 0]
    if q_segment_ids is not None:  # [B, T, S] -> [B, 1, 1, T, S] against [B, K, G, T, S]
        visible = visible & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None, None]
    p = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)), 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dog)
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, f32(v))
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog, og)[..., None]
    ds = p * (dp - delta)
    if softcap is not None:  # d cap(x) / dx = 1 - tanh(x / c)^2 = 1 - (cap(x) / c)^2
        ds = ds * (1.0 - jnp.square(scores / softcap))
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, f32(k)).reshape(b, t, n, h) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, qg) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
