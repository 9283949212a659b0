"""Mixture-of-Experts MLP (Shazeer et al. 2017; GShard; Switch; ST-MoE; Mixtral / DeepSeek routing),
used in place of the dense MLP on the layers that `config.model.mlp_pattern` marks `moe`.

Parameters of the n MoE layers, with the scaling-book sharding under the default rules:

    router                 [n, D, E]    layers, embed, router_experts  -> [D_fsdp, E]
    w_gate, w_up           [n, E, D, F] layers, experts, embed, mlp    -> [E_expert, D_fsdp, F_tensor]
    w_down                 [n, E, F, D] layers, experts, mlp, embed
    shared_gate, shared_up [n, D, Fs]   layers, embed, mlp   (Fs = shared_experts x F; a dense SwiGLU)
    shared_down            [n, Fs, D]   layers, mlp, embed
    shared_expert_gate     [n, D]       layers, embed        (moe.shared_expert_gate: Qwen2-MoE)
    router_bias            [n, E]       layers, router_experts  (moe.score_bias: DeepSeek-V3)

Per token t with router logits z_t = h_t W_r (fp32): scores s_t = softmax(z_t) or sigmoid(z_t); the
k largest (of s_t + b with the choice bias b; among the experts of the token's best groups with
group-limited routing) pick the experts, and their scores are the gates (renormalised to sum 1 by
default, times moe.routed_scale);
y_t = sum_{e in top-k} g_te SwiGLU_e(h_t) + SwiGLU_shared(h_t), the last times sigmoid(h_t w_g) with
the shared expert gate (Qwen2-MoE).

Losses, per token like the LM loss and added to it:
    load balance  a E sum_e f_e P_e  (Switch): f_e the fraction of the batch's token copies routed to
                  e, P_e the mean router probability (sigmoid scores normalised to sum 1)
    router z      b mean_t logsumexp(z_t)^2  (ST-MoE)
f_e is counted over the whole (micro-)batch on every device (one all-reduce of E counts), so both
losses equal the single-device ones on any layout: given f, the balance loss is linear in the
per-token P, so each device adds the sum over its own tokens.

One layer is route -> dispatch -> local experts -> combine. This module routes (the router, and in
the capacity path which copies are admitted to which slot) and computes the local experts' SwiGLU;
jaxsys/parallel/expert.py moves the copies (`expert.dispatch`, `expert.combine`: the model asks it
twice per layer) and computes every routing statistic (loads, drops, co-routing pairs, traffic and
the two loss sums above) inside `dispatch`.

Two compute paths:
    dropless  (capacity_factor = 0) every copy is computed: copies sorted by expert, grouped
              matmuls (`layers.swiglu_grouped`, lax.ragged_dot); with expert parallelism the sorted
              rows go to their expert's device by a ragged all-to-all (parallel/expert.py).
    capacity  (capacity_factor = cf > 0) each expert takes at most C = ceil(cf k T / E) copies per
              sequence (T: this device's positions of it), admitted by choice rank first (every
              first choice before any second), then position, as GShard does; the others are
              dropped (they add nothing; the residual carries the token), counted and reported.
              Groups are whole sequences, so drops do not depend on the data/fsdp/expert/tensor
              layout, only on context parallelism (which splits sequences).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.models import layers
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import expert, tensor
from jaxsys.sharding import Layout

ROUTING_STATISTICS = expert.ROUTING_STATISTICS  # per MoE layer, integer, global


def param_specs(m, n: int) -> dict:
    """ParamSpecs of `n` MoE layers of `config.model` (leading `layers` axis)."""
    moe, D = m.moe, m.d_model
    E, F = moe.experts, moe.d_ff
    std, out_std = m.init_std, m.init_std / (2 * m.n_layers) ** 0.5
    specs = {
        "router": ParamSpec((n, D, E), ("layers", "embed", "router_experts"), std=std),
        "w_gate": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "mlp"), std=std),
        "w_up": ParamSpec((n, E, D, F), ("layers", "experts", "embed", "mlp"), std=std),
        "w_down": ParamSpec((n, E, F, D), ("layers", "experts", "mlp", "embed"), std=out_std),
    }
    if moe.shared_experts:
        fs = moe.shared_experts * F
        specs["shared_gate"] = ParamSpec((n, D, fs), ("layers", "embed", "mlp"), std=std)
        specs["shared_up"] = ParamSpec((n, D, fs), ("layers", "embed", "mlp"), std=std)
        specs["shared_down"] = ParamSpec((n, fs, D), ("layers", "mlp", "embed"), std=out_std)
    if moe.shared_experts and moe.shared_expert_gate:
        specs["shared_expert_gate"] = ParamSpec((n, D), ("layers", "embed"), std=std)
    if moe.score_bias:  # the choice's bias (DeepSeek-V3): no gradient reaches it, moved by `update_bias`
        specs["router_bias"] = ParamSpec((n, E), ("layers", "router_experts"), init="zeros", decay=False)
    return specs


def active_matmul_params(m) -> int:
    """Weights one token multiplies with in one MoE layer: router, k experts, shared experts."""
    moe, D = m.moe, m.d_model
    return D * moe.experts + 3 * D * moe.d_ff * (moe.top_k + moe.shared_experts) + D * int(moe.shared_expert_gate)


def capacity(tokens: int, moe) -> int:
    """C, the slots of one expert per sequence of `tokens` positions: ceil(cf k T / E), at least 1."""
    return max(1, math.ceil(moe.capacity_factor * moe.top_k * tokens / moe.experts))


# ----------------------------------------------------------------------------- routing


class Routing(NamedTuple):
    logits: jax.Array  # [B, T, E] fp32
    probs: jax.Array  # [B, T, E] router probabilities (normalised scores) for the balance loss
    experts: jax.Array  # [B, T, k] int32, best first
    gates: jax.Array  # [B, T, k] fp32


def route(h, w_router, moe, bias=None) -> Routing:
    """Top-k routing of h[B, T, D] by router weights [D, E], in fp32. `bias` [E] (moe.score_bias):
    added to the scores for the choice only. With moe.groups G > 1 the choice is limited to the
    experts of each token's moe.group_top_k best groups (DeepSeek's node-limited routing)."""
    logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), w_router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if moe.groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], moe.groups, moe.experts // moe.groups)
        if moe.group_score == "max":
            group_scores = jnp.max(grouped, axis=-1)
        else:  # "top2": the sum of each group's best two (DeepSeek-V3)
            group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)
        _, best = lax.top_k(group_scores, moe.group_top_k)
        kept = jnp.any(best[..., None] == jnp.arange(moe.groups), axis=-2)  # [B, T, G]
        choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, experts = lax.top_k(choice, moe.top_k)
    top = jnp.take_along_axis(scores, experts, axis=-1)
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if moe.renormalize else top
    gates = gates * moe.routed_scale if moe.routed_scale != 1 else gates
    probs = scores if moe.router == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routing(logits, probs, experts.astype(jnp.int32), gates)


def update_bias(bias, load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024), after each step: every MoE
    layer's choice bias b [Lm, E] moves by u toward balance, b_e += u sign(mean_e' load_e' - load_e),
    from the step's global loads [Lm, E] (token copies routed to each expert)."""
    load = load.astype(jnp.float32)
    return bias + (rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)).astype(bias.dtype)


# ----------------------------------------------------------------------------- capacity admission


def _rank_within_expert(ids, n_experts: int):
    """ids[n] -> rank[n]: how many earlier entries have the same id (a stable sort, no [n, E] mask)."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.zeros((n_experts,), jnp.int32).at[ids].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(ids.shape[0], dtype=jnp.int32) - starts[ids[order]]
    return jnp.zeros_like(ids).at[order].set(ranked)


def admit(experts, n_experts: int, slots: int):
    """experts[B, T, k] -> slot[B, T, k] in [0, E C) of each copy, or E C when it is dropped. Within a
    sequence, copies queue by (choice rank, position)."""
    b, t, k = experts.shape
    queue = experts.transpose(0, 2, 1).reshape(b, k * t)  # copy (r, t) at r T + t
    rank = jax.vmap(lambda ids: _rank_within_expert(ids, n_experts))(queue)
    slot = jnp.where(rank < slots, queue * slots + rank, n_experts * slots)
    return slot.reshape(b, k, t).transpose(0, 2, 1)


def _local_experts(sent: expert.Dispatched, w):
    """The SwiGLU of this device's experts on the rows `expert.dispatch` brought them: per slot
    (capacity) or as a grouped matmul over rows sorted by local expert (dropless)."""
    if sent.group_sizes is None:
        return layers.swiglu_experts(sent.rows, w["w_gate"], w["w_up"], w["w_down"])
    return layers.swiglu_grouped(sent.rows, w["w_gate"], w["w_up"], w["w_down"], sent.group_sizes)


# ----------------------------------------------------------------------------- the layer


def apply(h, w, m, layout: Layout, previous, dispatch: str = "padded"):
    """One MoE MLP on the normed h[B, T', D] (T' = T/tp under sequence parallelism) with this
    layer's (FSDP-gathered) weights `w`. `previous` [B, T, k]: the experts the previous MoE layer
    chose for these tokens (-1 for none). Returns (y[B, T', D] to add to the residual,
    experts[B, T, k] of this layer, stats) where stats (`expert.routing_statistics`) has the loss
    sums `aux_loss` and `z_loss` of this device's tokens and the global int32 `load` [E],
    `dropped` [], `pairs` [E, E] and `traffic` [ep, ep].

    The router runs before the tensor-parallel region, on this rank's positions, so that its
    weights and h get their gradients once; the gates enter the region like h (Megatron's f: their
    gradient is summed over the ranks, each of which holds part of every expert's output)."""
    moe = m.moe
    r = route(h, w["router"], moe, w.get("router_bias"))
    mlp_axes, sp = layout.compute_axes("mlp"), layout.sp_axes
    x = tensor.enter(h, mlp_axes, sp)  # [B, T, D] on every tensor rank
    gates = tensor.enter(r.gates, mlp_axes, sp)
    if moe.shared_experts and moe.shared_expert_gate:  # like the router: on this rank's positions
        shared_scale = jax.nn.sigmoid(jnp.einsum("btd,d->bt", h, w["shared_expert_gate"]))[..., None]
        shared_scale = tensor.enter(shared_scale.astype(h.dtype), mlp_axes, sp)
    experts = tensor.gather_sequence(r.experts, sp)
    routed = expert.Routed(experts, previous, r.logits, r.probs)
    if moe.capacity_factor > 0:
        c = capacity(x.shape[1], moe)
        routed = routed._replace(slot=admit(experts, moe.experts, c), capacity=c)
    sent = expert.dispatch(x, routed, moe, layout, dispatch)
    y = expert.combine(_local_experts(sent, w), sent.plan, gates)
    if moe.shared_experts:
        shared = layers.swiglu(x, w["shared_gate"], w["shared_up"], w["shared_down"])
        y = y + (shared_scale * shared if moe.shared_expert_gate else shared)
    return tensor.leave(y, mlp_axes, sp), experts, sent.stats
