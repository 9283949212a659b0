"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3), the attention of
every layer when `config.model.mla.kv_lora_rank` C > 0.

Keys and values come from one latent per token, c = RMSNorm(x W_kv_a) [C], expanded per head:
k_n = [c W_k_b[n], rope(x W_k_rope)] and v_n = c W_v_b[n], the rotary part of k ([R], R =
`mla.rope_head_dim`) one vector shared by every head. Queries come from x W_q, or with
`mla.q_lora_rank` Q > 0 from their own latent, RMSNorm(x W_q_a) W_q_b; the last R of each query
head's H dims are rotated. So a head scores q_n . k_n over H = nope + R dims and reads values of
H_v = `mla.v_head_dim` dims. Parameters of the L layers (logical axes):

    wq      [L, D, N, H]     layers, embed, heads, head_dim          (Q = 0)
    wq_a    [L, D, Q]        layers, embed, latent_out                (Q > 0)
    q_a_norm [L, Q]           layers, latent_out
    wq_b    [L, Q, N, H]     layers, latent, heads, head_dim
    wkv_a   [L, D, C]        layers, embed, latent_out
    kv_a_norm [L, C]         layers, latent_out
    wk_rope [L, D, R]        layers, embed, head_dim
    wk_b    [L, C, N, H - R] layers, latent, heads, head_dim
    wv_b    [L, C, N, H_v]   layers, latent, heads, head_dim
    wo      [L, N, H_v, D]   layers, heads, head_dim, embed

The down-projections (to the latents) are replicated over `tensor`: each tensor rank computes the
latents of its tokens and expands them to its own heads (column-parallel), so MLA keeps Megatron's
one all-reduce per attention block. The up-projections' latent rows (`latent`) are split over
`fsdp` at rest, as `embed` is (ZeRO-3), and gathered before use; `latent_out` is never split.

Every attention path of training (reference, the flash kernels, cuDNN, context parallelism)
takes q/k/v of one head dim, so values are zero-padded from H_v to H before attention and the
output cut back. Serving caches the latent (`config.model.mla.cache = "latent"`): one row of
C + R per token and layer, attended in the absorbed form (`latent_attention`); "expanded" caches
every head's keys and padded values instead, N (H + H) per token (docs/mla.md weighs the two).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsys.cache import base as cache_base
from jaxsys.models import adapters, layers
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import tensor

# the latents' RMSNorm epsilon: DeepSeek builds those norms with RMSNorm's default, whatever
# rms_norm_eps (config.model.norm_eps) says for the others
LATENT_NORM_EPS = 1e-6


def enabled(m) -> bool:
    return bool(m.mla.kv_lora_rank)


def v_head_dim(m) -> int:
    """H_v, the values' head dim (mla.v_head_dim, 0: head_dim)."""
    return m.mla.v_head_dim or m.head_dim


def param_specs(m, std: float, out_std: float) -> dict:
    """The attention leaves of the L layers (the table above)."""
    L, D, N, H = m.n_layers, m.d_model, m.n_heads, m.head_dim
    C, Q, R, Hv = m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, v_head_dim(m)
    # the down-projections and their norms feed every head: under tensor parallelism each rank's
    # gradient is the part of its own heads, summed over `heads`' axes (zero.plan)
    heads = ("heads",)
    norm = lambda n: ParamSpec((L, n), ("layers", "latent_out"), init="ones", decay=False, partial=heads)
    down = lambda n, axis: ParamSpec((L, D, n), ("layers", "embed", axis), std=std, partial=heads)
    specs = {}
    if Q:
        specs["wq_a"] = down(Q, "latent_out")
        specs["q_a_norm"] = norm(Q)
        specs["wq_b"] = ParamSpec((L, Q, N, H), ("layers", "latent", "heads", "head_dim"), std=std)
    else:
        specs["wq"] = ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), std=std)
    specs["wkv_a"] = down(C, "latent_out")
    specs["kv_a_norm"] = norm(C)
    specs["wk_rope"] = down(R, "head_dim")
    specs["wk_b"] = ParamSpec((L, C, N, H - R), ("layers", "latent", "heads", "head_dim"), std=std)
    specs["wv_b"] = ParamSpec((L, C, N, Hv), ("layers", "latent", "heads", "head_dim"), std=std)
    specs["wo"] = ParamSpec((L, N, Hv, D), ("layers", "heads", "head_dim", "embed"), std=out_std)
    return specs


def matmul_params(m) -> int:
    """Weights one token multiplies with in one MLA layer (the table's matrices)."""
    D, N, H = m.d_model, m.n_heads, m.head_dim
    C, Q, R, Hv = m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, v_head_dim(m)
    q = D * Q + Q * N * H if Q else D * N * H
    return q + D * C + D * R + C * N * (H - R) + C * N * Hv + N * Hv * D


def project(linear, h, w, m, heads: tuple[str, ...], sp: tuple[str, ...], collective: bool):
    """q[B, T, N', H] of this rank's N' heads (rotary tails not yet rotated), the normed kv latent
    c[B, T, C] and the rotary key k_r[B, T, 1, R] (not yet rotated) from normed h[B, T(/tp), D];
    `linear` is quant.linear with the model bound. The down-projections run in
    tensor.enter_matmul (after the sequence-parallel gather), so c and k_r are every token's."""
    Q = m.mla.q_lora_rank

    def down(h, ws):
        wq, wkv_a, wk_rope = ws
        eq = "btd,dq->btq" if Q else "btd,dnh->btnh"
        return (
            linear(eq, h, wq, name="wq_a" if Q else "wq"),
            linear("btd,dc->btc", h, wkv_a, name="wkv_a"),
            linear("btd,dr->btr", h, wk_rope, name="wk_rope"),
        )

    ws = (w["wq_a"] if Q else w["wq"], w["wkv_a"], w["wk_rope"])
    q, latent, k_rope = tensor.enter_matmul(down, h, ws, heads, sp, collective)
    if Q:
        q = linear("btq,qnh->btnh", layers.rms_norm(q, w["q_a_norm"], LATENT_NORM_EPS), w["wq_b"], name="wq_b")
    return q, layers.rms_norm(latent, w["kv_a_norm"], LATENT_NORM_EPS), k_rope[:, :, None, :]


def expand(linear, latent, k_rope, w):
    """k[B, T, N', H] (k_r broadcast over the heads) and v[B, T, N', H_v] of this rank's heads
    from the latent c[B, T, C]: what training and an expanded cache attend with."""
    k_nope = linear("btc,cnh->btnh", latent, w["wk_b"], name="wk_b")
    v = linear("btc,cnh->btnh", latent, w["wv_b"], name="wv_b")
    k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], k_rope.shape[-1]))
    return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v


def latent_attention(cache, q, latent, k_rope, w, positions, window, softcap, m):
    """Attention through a latent cache (cache/base.py) in DeepSeek-V2's absorbed form: each head's
    q_n . k_n = (W_k_b[n] q_nope_n) . c + q_rope_n . k_r, so the cache holds the row [c, k_r]
    [C + R] per token (one "kv head", padded to the cache's H_c) and a head's query is
    [W_k_b[n] q_nope_n, q_rope_n]; its output over the rows' first C dims is the latent
    o_c = sum_t p_t c_t, and o_n = o_c W_v_b[n] = sum_t p_t v_t. q[B, T, N', H] and k_rope
    [B, T, 1, R] rotated, q already carrying query_pre_attn_scalar. Returns (o [B, T, N', H_v],
    cache)."""
    C, R, H = m.mla.kv_lora_rank, m.mla.rope_head_dim, m.head_dim
    hc = cache_base.head_dim(m)
    # float weights: a quantized checkpoint's dequantized (per step: C N H each), LoRA folded in
    wk_b, wv_b = (adapters.folded(w[name], name, m) for name in ("wk_b", "wv_b"))
    q_latent = jnp.einsum("btnh,cnh->btnc", q[..., :-R], wk_b.astype(q.dtype))
    # the cache's scale is H_c^-0.5; the model's H^-0.5
    q = jnp.concatenate([q_latent, q[..., -R:]], axis=-1) * jnp.asarray((hc / H) ** 0.5, q.dtype)
    row = jnp.concatenate([latent[:, :, None, :], k_rope.astype(latent.dtype)], axis=-1)
    o, cache = cache.attend(pad_values(q, hc), pad_values(row, hc), None, positions, window=window, softcap=softcap)
    return jnp.einsum("btnc,cnh->btnh", o[..., :C], wv_b.astype(o.dtype)), cache


def rope(x, positions, theta: float, scaling: layers.RopeScaling, m):
    """RoPE on the last mla.rope_head_dim dims of each head of x[B, T, N, H] (its frequencies over
    those R dims), the rest passed through."""
    R = m.mla.rope_head_dim
    return jnp.concatenate([x[..., :-R], layers.rope(x[..., -R:], positions, theta, scaling)], axis=-1)


def pad_values(v, head_dim: int):
    """v[..., H_v] zero-padded to head_dim (one head dim for every attention path)."""
    pad = head_dim - v.shape[-1]
    return v if pad == 0 else jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
