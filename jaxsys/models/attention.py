"""The attention of a layer, and the one place its kernel is chosen: softmax attention by
`config.model.attention_impl`, or causal linear attention, chosen per layer by
`config.model.layer_pattern`; under context parallelism the blocks the ring / all-gather /
TokenRing schedules run (`BlockAttention`, handed to parallel/context.py). A KV cache's attention
(decoding) is the cache type's own (jaxsys/cache/).

    attention_impl   softmax layers                              linear layers
    reference        layers.attention (jnp, XLA)                 kernels.linear_attention.chunked (jnp)
    pallas           kernels.flash_attention (Pallas)            kernels.linear_attention (Pallas)
    cudnn            jax.nn.dot_product_attention(cudnn), GPU    kernels.linear_attention (Pallas)

Shapes are per device: q[B, T, N, H], k/v[B, T, K, H] with this rank's N/tp query heads and K/tp
key/value heads (heads split over `tensor`; a query head's key/value head is on the same rank).

Linear layers (RetNet / Lightning Attention style): the same q, k, v projections without RoPE,
key/value heads repeated to N, per-head decay gamma_n = 1 - 2^(-5 - n) over the *global* head index
n (RetNet's), scale H^-0.5, and a parameter-free RMS norm of each head's output (the normalisation
that keeps linear attention's unnormalised sums at unit scale, as RetNet's GroupNorm and
TransNormer's NormAttention do).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The kernels (jaxsys.kernels) are imported here, never inside a function that runs while a step is
# traced: importing them imports jax.experimental.pallas.tpu, which defines a JAX config state that
# is part of the jit cache key (pallas_fuser_disable_nested_fuse), so a first import mid-trace makes
# the step's second call miss its cache and compile again (tests/test_recompile.py).
from jaxsys.config import ConfigError, layer_pattern
from jaxsys.kernels import flash_attention as flash
from jaxsys.kernels import linear_attention as lin
from jaxsys.models import layers
from jaxsys.parallel import context, tensor


def pattern(m) -> tuple[str, ...]:
    """`layer_pattern` is a comma-separated list of layer types repeated over the layers:
    "softmax"; "local" (softmax over a sliding window of config.model.sliding_window keys);
    "linear"; "linear,linear,linear,softmax" (one softmax layer in 4); "local,softmax"."""
    return layer_pattern(m)


def layer_types(m) -> tuple[str, ...]:
    """The type of each of the n_layers layers."""
    return pattern(m) * (m.n_layers // len(pattern(m)))


@dataclasses.dataclass(frozen=True)
class BlockAttention:
    """One block of attention and its backward given the final o and LSE, by implementation (the
    blocks of context parallelism's schedules)."""

    impl: str = "reference"  # reference | pallas
    block: int | None = None  # None: the tuning cache's tiles for the shape on this device, else 128
    backend: str | None = None  # the flash kernel (config.model.attention_kernel); None: by platform
    softcap: float | None = None  # scores c * tanh(s / c) (config.model.attn_logit_softcap)

    def forward(self, q, k, v, causal: bool, q_seg=None, kv_seg=None):
        """(o fp32, lse) of q's block against one block of keys; with segment ids q_seg[B, Tq] and
        kv_seg[B, Tk] (packed documents) a query sees only keys of its own segment."""
        segments = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, softcap=self.softcap)
        if self.impl == "pallas":
            o, lse = flash.flash_attention_forward(
                q, k, v, causal=causal, block_q=self.block, block_k=self.block, backend=self.backend, **segments
            )
        else:
            o, lse = flash.reference_attention(q, k, v, causal=causal, return_lse=True, **segments)
        return o.astype(jnp.float32), lse

    def backward(self, q, k, v, o, lse, do, causal: bool, q_seg=None, kv_seg=None):
        segments = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, softcap=self.softcap)
        if self.impl == "pallas":
            grads = flash.flash_attention_backward(
                q,
                k,
                v,
                o,
                lse,
                do,
                causal=causal,
                block_q=self.block,
                block_k=self.block,
                backend=self.backend,
                **segments,
            )
        else:
            grads = flash.reference_attention_backward(q, k, v, o, lse, do, causal=causal, **segments)
        return tuple(g.astype(jnp.float32) for g in grads)


def flash_backend(m) -> str | None:
    """The flash kernel's `backend` argument for config.model.attention_kernel ('auto': None)."""
    return None if m.attention_kernel == "auto" else m.attention_kernel


def softmax_attention(q, k, v, m, seq: context.SeqLayout, segments=None, window: int | None = None):
    """Causal GQA softmax attention of one layer with `m.attention_impl`; over the sequence split on
    `seq` by `m.context_parallel` when there is one. `segments` [B, T] (this device's tokens, as q):
    the document ids of packed rows; a query then sees only earlier keys of its own document.
    `window` (a "local" layer, config.model.sliding_window): a query sees its last `window` keys.
    Scores are soft-capped by config.model.attn_logit_softcap (every path but cuDNN's, which config
    validation refuses)."""
    softcap = m.attn_logit_softcap or None
    if seq.axes:
        if window is not None:  # config validation refuses this first; a direct call gets told too
            raise ConfigError("sliding-window layers under context parallelism are not implemented: use mesh.seq=1")
        impl = "pallas" if m.attention_impl == "pallas" else "reference"
        one_device = lambda q, k, v, s: softmax_attention(q, k, v, m, context.SeqLayout((), 1, False), s)
        return context.attention(
            q,
            k,
            v,
            seq,
            BlockAttention(impl, m.attention_block or None, flash_backend(m), softcap),
            segments,
            one_device,
        )
    if m.attention_impl == "pallas":
        return flash.flash_attention(
            q,
            k,
            v,
            causal=True,
            q_segment_ids=segments,
            kv_segment_ids=segments,
            block_q=m.attention_block or None,  # 0: the tuning cache's tile (kernels/tuning.py)
            block_k=m.attention_block or None,
            backend=flash_backend(m),
            window=window,
            softcap=softcap,
        )
    if m.attention_impl == "cudnn":
        if softcap is not None:  # config validation refuses this first; a direct call gets told too
            raise ConfigError("cuDNN's attention has no score soft-capping: use attention_impl='pallas' or 'reference'")
        # cuDNN's window counts the keys left of the diagonal: W - 1 besides the query's own
        local = None if window is None else (window - 1, 0)
        if segments is None:
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn", local_window_size=local
            )
        # jax.nn takes no segment ids: the document mask goes in as a boolean [B, 1, T, T] mask,
        # which cuDNN receives as a materialised additive bias (O(B T^2) memory, unlike the kernel's)
        same = segments[:, None, :, None] == segments[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=same, is_causal=True, implementation="cudnn", local_window_size=local
        )
    return layers.attention(q, k, v, causal=True, segment_ids=segments, window=window, softcap=softcap)


def head_log_decay(n_local: int, heads_axes: tuple[str, ...]):
    """log gamma [n_local] of this rank's query heads; gamma_n = 1 - 2^(-5 - n), n the global index."""
    n = tensor.shard_offset(n_local, heads_axes) + jnp.arange(n_local)
    return jnp.log1p(-jnp.exp2(-5.0 - n.astype(jnp.float32)))


def linear_attention(q, k, v, m, heads_axes: tuple[str, ...], seq: context.SeqLayout):
    """Causal linear attention of one layer: q[B, T, N, H], k/v[B, T, K, H] -> [B, T, N, H];
    LASP-2 over the sequence split on `seq` when there is one."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    log_decay = head_log_decay(q.shape[2], heads_axes)
    scale = q.shape[-1] ** -0.5
    kernel = lin.chunked if m.attention_impl == "reference" else lin.linear_attention
    chunk_attention = lambda q, k, v: kernel(q, k, v, chunk_size=m.linear_chunk, log_decay=log_decay, scale=scale)
    if seq.axes:
        o = context.lasp2(q, k, v, log_decay, scale, seq, chunk_attention)
    else:
        o, _ = chunk_attention(q, k, v)
    o32 = o.astype(jnp.float32)
    o32 = o32 * jax.lax.rsqrt(jnp.mean(jnp.square(o32), axis=-1, keepdims=True) + m.norm_eps)
    return o32.astype(q.dtype)
