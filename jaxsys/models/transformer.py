"""Decoder-only transformer (Llama-style): token embedding, RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU MLP, optional tied embeddings. Layers are stacked on a `layers`
axis and run with `lax.scan`, so a pipeline can split the stack into stages without changing the
model.

The functions here run on one device's shards inside the training shard_map. Parameters at rest
(`param_specs`), with the scaling-book sharding under the default rules:

    embed    [V, D]          vocab, embed         -> [V_tensor, D_fsdp]
    wq       [L, D, N, H]    layers, embed, heads, head_dim
    wk, wv   [L, D, K, H]    layers, embed, kv_heads, head_dim
    wo       [L, N, H, D]    layers, heads, head_dim, embed
    w_gate, w_up [L, D, F]   layers, embed, mlp
    w_down   [L, F, D]       layers, mlp, embed
    unembed  [D, V]          embed, vocab (absent when embeddings are tied)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsys.models import attention, layers
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import context, fsdp, tensor
from jaxsys.sharding import Layout


def param_specs(m, chunks: int = 1) -> dict:
    """The parameter pytree of `config.model` as ParamSpecs. With `chunks` = v > 1 (interleaved
    pipeline) each layer leaf is [v, L/v, ...] ("chunks", "layers", ...): layer l is [l // (L/v),
    l % (L/v)], so sharding the second dimension over `pipe` gives device d the stages d, d+p, ..."""
    L, D, N, K, H, F, V = m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    std, out_std = m.init_std, m.init_std / (2 * L) ** 0.5  # GPT-2 scaling of residual outputs
    norm = lambda *shape_axes: ParamSpec(*shape_axes, init="ones", decay=False)
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), std=std),
        "layers": {
            "attn_norm": norm((L, D), ("layers", "embed")),
            "wq": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), std=std),
            "wk": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std),
            "wv": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std),
            "wo": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), std=out_std),
            "mlp_norm": norm((L, D), ("layers", "embed")),
            "w_gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), std=std),
            "w_up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), std=std),
            "w_down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), std=out_std),
        },
        "final_norm": norm((D,), ("embed",)),
    }
    if not m.tie_embeddings:
        specs["unembed"] = ParamSpec((D, V), ("embed", "vocab"), std=std)
    if chunks > 1:
        specs["layers"] = {k: dataclasses.replace(s, shape=(chunks, L // chunks) + s.shape[1:],
                                                  axes=("chunks",) + s.axes)
                           for k, s in specs["layers"].items()}
    return specs


def _axes(specs):
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=lambda x: isinstance(x, ParamSpec))


def remat_policy(name: str):
    """`none` saves everything but the FSDP-gathered weights (always gathered again backward);
    `dots` saves matmul outputs only; `full` saves nothing inside a layer."""
    policies = jax.checkpoint_policies
    if name == "full":
        return policies.nothing_saveable
    if name == "dots":
        return policies.dots_saveable
    return fsdp.remat_saveable


def _block(x, w, positions, m, layout: Layout, kind: str = "softmax"):
    """One layer on x[B, T, D] (or [B, T/tp, D] under sequence parallelism); `w` gathered.
    `kind` is the layer's attention: "softmax" (with RoPE) or "linear" (attention.py)."""
    seq = context.SeqLayout.of(layout, m)
    heads, mlp, sp = layout.compute_axes("heads"), layout.compute_axes("mlp"), layout.sp_axes
    h = tensor.enter(layers.rms_norm(x, w["attn_norm"], m.norm_eps), heads, sp)
    q = jnp.einsum("btd,dnh->btnh", h, w["wq"])
    k = jnp.einsum("btd,dkh->btkh", h, w["wk"])
    v = jnp.einsum("btd,dkh->btkh", h, w["wv"])
    if kind == "linear":
        o = attention.linear_attention(q, k, v, m, heads, seq)
    else:
        q, k = layers.rope(q, positions, m.rope_theta), layers.rope(k, positions, m.rope_theta)
        o = attention.softmax_attention(q, k, v, m, seq)
    x = x + tensor.leave(jnp.einsum("btnh,nhd->btd", o, w["wo"]), heads, sp)
    h = tensor.enter(layers.rms_norm(x, w["mlp_norm"], m.norm_eps), mlp, sp)
    return x + tensor.leave(layers.swiglu(h, w["w_gate"], w["w_up"], w["w_down"]), mlp, sp)


# The model in four pieces, so that a pipeline can run them on different stages:
#   embed -> layer_stack (any run of whole pattern periods) -> final_norm -> output_loss / output_logits


def _cast(tree, m):
    compute = jnp.dtype(m.compute_dtype)
    return jax.tree.map(lambda p: p.astype(compute), tree)


def embed(params, inputs, m, layout: Layout, specs=None):
    """inputs[B, T] -> x[B, T, D] (x[B, T/tp, D] under sequence parallelism)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    table = fsdp.gather(_cast(params["embed"], m), axes["embed"], layout)
    return tensor.embed_lookup(table, inputs, layout.compute_axes("vocab"), layout.sp_axes)


def layer_stack(layer_params, x, positions, m, layout: Layout, specs=None, unroll: bool = False):
    """Run the layers of `layer_params` (leaves [L', ...], this device's shards; L' a multiple of
    the layer pattern's period, the pattern starting at its first layer) on x[B, T, D]."""
    axes = _axes(specs if specs is not None else param_specs(m))
    layer_axes = jax.tree.map(lambda a: a[a.index("layers") + 1:], axes["layers"],
                              is_leaf=lambda a: isinstance(a, tuple))
    n_local = jax.tree.leaves(layer_params)[0].shape[0]

    def layer(x, w, kind):
        return _block(x, fsdp.gather(_cast(w, m), layer_axes, layout), positions, m, layout, kind)

    # The layer pattern repeats with period p: scan over the L'/p groups, p layers written out in each.
    pattern = attention.pattern(m)
    period = len(pattern)
    remat = {kind: jax.checkpoint(lambda x, w, kind=kind: layer(x, w, kind), policy=remat_policy(m.remat),
                                  prevent_cse=False) for kind in set(pattern)}
    groups = jax.tree.map(lambda a: a.reshape(n_local // period, period, *a.shape[1:]), layer_params)

    def body(x, group_params):
        for i, kind in enumerate(pattern):
            x = remat[kind](x, jax.tree.map(lambda a: a[i], group_params))
        return x, None

    x, _ = jax.lax.scan(body, x, groups, unroll=n_local // period if unroll else 1)
    return x


def final_norm(params, x, m, layout: Layout, specs=None):
    axes = _axes(specs if specs is not None else param_specs(m))
    scale = fsdp.gather(_cast(params["final_norm"], m), axes["final_norm"], layout)
    return layers.rms_norm(x, scale, m.norm_eps)


def output_logits(params, h, m, layout: Layout, specs=None):
    """Normed h[B, T, D] -> logits[B, T, V] (this shard's vocabulary columns when `vocab` is split)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    h = tensor.enter(h, layout.compute_axes("vocab"), layout.sp_axes)
    if m.tie_embeddings:
        return jnp.einsum("btd,vd->btv", h, fsdp.gather(_cast(params["embed"], m), axes["embed"], layout))
    return jnp.einsum("btd,dv->btv", h, fsdp.gather(_cast(params["unembed"], m), axes["unembed"], layout))


def output_loss(params, h, targets, m, layout: Layout, specs=None):
    """Per-token cross-entropy [B, T] of normed h[B, T, D] against targets[B, T]."""
    return tensor.cross_entropy(output_logits(params, h, m, layout, specs), targets,
                                layout.compute_axes("vocab"))


def logits(params, inputs, m, layout: Layout, specs=None, unroll: bool = False, positions=None):
    """Next-token logits [B, T, V] (this shard's V/tp columns under tensor parallelism) of inputs[B, T]
    at `positions` [T] (default 0..T-1). `unroll` writes the layer loop out (the analysis counts
    every executed collective that way)."""
    positions = jnp.arange(inputs.shape[1]) if positions is None else positions
    x = embed(params, inputs, m, layout, specs)
    x = layer_stack(params["layers"], x, positions, m, layout, specs, unroll)
    return output_logits(params, final_norm(params, x, m, layout, specs), m, layout, specs)


def split_tokens(tokens, m, layout: Layout):
    """tokens[B, T+1] -> (inputs, targets) [B, T'] and positions [T'] of this device's T' = T/P
    positions (context parallelism) of next-token prediction."""
    seq = context.SeqLayout.of(layout, m)
    inputs = context.shard_sequence(tokens[:, :-1], seq)
    targets = context.shard_sequence(tokens[:, 1:], seq)
    return inputs, targets, context.positions(tokens.shape[1] - 1, seq)


def token_losses(params, tokens, m, layout: Layout, specs=None, unroll: bool = False):
    """Per-token cross-entropy [B, T] of next-token prediction on this shard's tokens[B, T+1]
    (under context parallelism: of this device's T/P positions of them)."""
    inputs, targets, positions = split_tokens(tokens, m, layout)
    h = final_norm(params, layer_stack(params["layers"], embed(params, inputs, m, layout, specs),
                                       positions, m, layout, specs, unroll), m, layout, specs)
    return output_loss(params, h, targets, m, layout, specs)
