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
    w_gate, w_up [Ld, D, F]  layers, embed, mlp        (Ld: the dense-MLP layers)
    w_down   [Ld, F, D]      layers, mlp, embed
    moe      {...}           the Lm MoE layers' router and experts (models/moe.py)
    unembed  [D, V]          embed, vocab (absent when embeddings are tied)

With multi-head latent attention (config.model.mla, DeepSeek-V2 / V3) the attention leaves are
models/mla.py's (latent down- and up-projections) in place of wq, wk, wv, wo.

`config.model.layer_pattern` and `.mlp_pattern` say which attention and MLP each layer has. The
attention and norm leaves hold every layer; the dense-MLP leaves only the Ld dense layers and
`moe` only the Lm MoE ones, in layer order, so every stack splits over pipeline stages that hold
whole periods of the two patterns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxsys import execution
from jaxsys.cache import base as cache_base
from jaxsys.config import ConfigError, block_pattern
from jaxsys.models import attention, ladder, layers, mla, moe, mtp, quant
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import context, tensor, zeropp
from jaxsys.sharding import Layout

DENSE_MLP = ("w_gate", "w_up", "w_down")  # leaves of the dense-MLP layers only


def layer_counts(m) -> dict:
    """Layers each kind of layer leaf holds: every layer, the dense-MLP ones, the MoE ones."""
    pattern, periods = block_pattern(m), m.n_layers // len(block_pattern(m))
    return {
        "all": m.n_layers,
        "dense": periods * sum(mlp == "dense" for _, mlp in pattern),
        "moe": periods * sum(mlp == "moe" for _, mlp in pattern),
    }


def leaf_kind(name: str) -> str:
    """Which layers a layer leaf holds: "all", the "dense"-MLP ones or the "moe" ones."""
    return "moe" if name == "moe" else "dense" if name in DENSE_MLP else "all"


def period(m) -> tuple:
    """The layers of one period of the layer and MLP patterns: (attention kind, MLP kind, the
    layer's index among each kind of leaf within the period)."""
    out, offsets = [], {"all": 0, "dense": 0, "moe": 0}
    for kind, mlp_kind in block_pattern(m):
        out.append((kind, mlp_kind, dict(offsets)))
        offsets["all"] += 1
        offsets[mlp_kind] += 1
    return tuple(out)


def param_specs(m, chunks: int = 1) -> dict:
    """The parameter pytree of `config.model` as ParamSpecs. With `chunks` = v > 1 (interleaved
    pipeline) each layer leaf is [v, L/v, ...] ("chunks", "layers", ...): layer l is [l // (L/v),
    l % (L/v)], so sharding the second dimension over `pipe` gives device d the stages d, d+p, ..."""
    L, D, N, K, H, F, V = m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    std, out_std = m.init_std, m.init_std / (2 * L) ** 0.5  # GPT-2 scaling of residual outputs
    norm = lambda *shape_axes: ParamSpec(*shape_axes, init="ones", decay=False)
    counts = layer_counts(m)
    Ld = counts["dense"]
    layer_specs = {"attn_norm": norm((L, D), ("layers", "embed"))}
    if mla.enabled(m):  # multi-head latent attention (DeepSeek-V2 / V3): its leaves in models/mla.py
        layer_specs.update(mla.param_specs(m, std, out_std))
    else:
        layer_specs["wq"] = ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), std=std)
        layer_specs["wk"] = ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std)
        layer_specs["wv"] = ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std)
        layer_specs["wo"] = ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), std=out_std)
    layer_specs["mlp_norm"] = norm((L, D), ("layers", "embed"))
    if m.qk_norm:  # used on each rank's own heads: the gradient is a partial sum over heads (zero.plan)
        layer_specs["q_norm"] = dataclasses.replace(norm((L, H), ("layers", "head_dim")), partial=("heads",))
        layer_specs["k_norm"] = dataclasses.replace(norm((L, H), ("layers", "head_dim")), partial=("kv_heads",))
    if m.post_norms:  # each sublayer's output normed before the residual add (Gemma 2 / 3)
        layer_specs["attn_out_norm"] = norm((L, D), ("layers", "embed"))
        layer_specs["mlp_out_norm"] = norm((L, D), ("layers", "embed"))
    if m.qkv_bias:  # split over heads as their projections are (column-parallel), no weight decay
        bias = lambda heads, n: ParamSpec((L, n, H), ("layers", heads, "head_dim"), init="zeros", decay=False)
        layer_specs.update(bq=bias("heads", N), bk=bias("kv_heads", K), bv=bias("kv_heads", K))
    if Ld:
        layer_specs["w_gate"] = ParamSpec((Ld, D, F), ("layers", "embed", "mlp"), std=std)
        layer_specs["w_up"] = ParamSpec((Ld, D, F), ("layers", "embed", "mlp"), std=std)
        layer_specs["w_down"] = ParamSpec((Ld, F, D), ("layers", "mlp", "embed"), std=out_std)
    if counts["moe"]:
        layer_specs["moe"] = moe.param_specs(m, counts["moe"])
    layer_specs = quant.quantize_specs(layer_specs, m)  # codes and scales (config.model.quant)
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), std=std),
        "layers": layer_specs,
        "final_norm": norm((D,), ("embed",)),
    }
    if not m.tie_embeddings:
        specs["unembed"] = ParamSpec((D, V), ("embed", "vocab"), std=std)
    if mtp.enabled(m):  # DeepSeek-V3's multi-token-prediction modules (models/mtp.py)
        specs["mtp"] = mtp.param_specs(m, param_specs(mtp.layer_config(m))["layers"])
    if chunks > 1:
        specs["layers"] = jax.tree.map(
            lambda s: dataclasses.replace(
                s, shape=(chunks, s.shape[0] // chunks) + s.shape[1:], axes=("chunks",) + s.axes
            ),
            specs["layers"],
            is_leaf=lambda x: isinstance(x, ParamSpec),
        )
    return specs


def _axes(specs):
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=lambda x: isinstance(x, ParamSpec))


def _qkv(linear, h, ws):
    """The attention's column-parallel projections of h: q, k, v."""
    wq, wk, wv = ws
    return (
        linear("btd,dnh->btnh", h, wq, name="wq"),
        linear("btd,dkh->btkh", h, wk, name="wk"),
        linear("btd,dkh->btkh", h, wv, name="wv"),
    )


def block(
    x,
    w,
    positions,
    m,
    layout: Layout,
    kind: str = "softmax",
    mlp_kind: str = "dense",
    previous=None,
    dispatch: str = "padded",
    cache=None,
    segments=None,
):
    """One layer on x[B, T, D] (or [B, T/tp, D] under sequence parallelism); `w` gathered.
    Under the ladder residual x is a `ladder.LadderStream` (h, pending) of such arrays, and so is
    the x returned. `kind` is the layer's attention: "softmax" (with RoPE), "local" (softmax over
    a sliding window of config.model.sliding_window keys) or "linear" (attention.py); `mlp_kind` its MLP: "dense" (SwiGLU) or "moe" (models/moe.py, which takes
    `previous`, the experts the last MoE layer chose). `cache` (inference): this layer's KV cache
    (jaxsys/cache/), which writes the new keys and values at `positions` [B, T] and attends.
    `segments` [B, T] (this device's full T, as the positions): the document ids of packed rows,
    so that attention stays within each document (`split_tokens`).
    Returns (x, experts chosen here or `previous`, MoE stats or None, the cache after the write)."""
    seq = context.SeqLayout.of(layout, m)
    heads, mlp, sp = layout.compute_axes("heads"), layout.compute_axes("mlp"), layout.sp_axes
    x = checkpoint_name(x, "layer_input")  # host-offloadable residual (config.offload.activations)
    linear = functools.partial(quant.linear, m=m)  # einsum, or the quantized kernels (config.model.quant)
    cm = layout.collective_matmul  # the TP matmuls beside their SP collectives (config.parallel.collective_matmul)
    normed = layers.rms_norm(ladder.module_input(x), w["attn_norm"], m.norm_eps)
    latent = None  # MLA through a latent cache: (c, k_r), attended in the absorbed form
    if mla.enabled(m):  # multi-head latent attention: v's H_v padded to H for the attention paths
        q, c, k = mla.project(linear, normed, w, m, heads, sp, cm)
        if cache is not None and cache_base.latent(m):
            latent, v = c, None
        else:
            k, v = mla.expand(linear, c, k, w)
            v = mla.pad_values(v, m.head_dim)
    else:
        q, k, v = tensor.enter_matmul(
            functools.partial(_qkv, linear), normed, (w["wq"], w["wk"], w["wv"]), heads, sp, cm
        )
    if m.qkv_bias:  # this rank's heads of each bias, as of the projections (config.model.qkv_bias)
        q, k, v = q + w["bq"].astype(q.dtype), k + w["bk"].astype(k.dtype), v + w["bv"].astype(v.dtype)
    if m.qk_norm:  # per head, over H (config.model.qk_norm)
        q, k = layers.rms_norm(q, w["q_norm"], m.norm_eps), layers.rms_norm(k, w["k_norm"], m.norm_eps)
    if kind == "linear":
        if segments is not None:
            raise ConfigError(
                "packed documents (config.data.packing, segment ids) need softmax attention layers: "
                f"config.model.layer_pattern={m.layer_pattern!r} has linear-attention layers, whose "
                "recurrent state would carry over from one document to the next (no per-document "
                "reset yet); use a softmax layer_pattern or unpacked rows"
            )
        if cache is not None:
            raise ValueError(
                "decoding with a KV cache needs softmax attention layers; linear-attention "
                "layers keep a recurrent state instead (not implemented)"
            )
        o = attention.linear_attention(q, k, v, m, heads, seq)
    else:
        theta, scaling = m.rope_theta, layers.rope_scaling(m)
        if kind == "local" and m.rope_local_theta:  # Gemma 3's local layers: their own base, unscaled
            theta, scaling = m.rope_local_theta, layers.RopeScaling()
        rope = functools.partial(mla.rope, m=m) if mla.enabled(m) else layers.rope  # MLA: each head's tail
        q, k = rope(q, positions, theta, scaling), rope(k, positions, theta, scaling)
        if m.query_pre_attn_scalar:  # softmax scale s^-0.5 where every attention path applies H^-0.5
            q = q * jnp.asarray((q.shape[-1] / m.query_pre_attn_scalar) ** 0.5, q.dtype)
        window = m.sliding_window if kind == "local" else None
        if cache is None:
            o = attention.softmax_attention(q, k, v, m, seq, segments, window)
        else:
            if segments is not None:
                raise ValueError("segment ids (packed documents) are for training and evaluation, not a KV cache")
            if latent is not None:
                softcap = m.attn_logit_softcap or None
                o, cache = mla.latent_attention(cache, q, latent, k, w, positions, window, softcap, m)
            else:
                o, cache = _cached_attention(cache, q, k, v, positions, window, m)
    o = checkpoint_name(o, "attention_output")
    if mla.enabled(m):
        o = o[..., : mla.v_head_dim(m)]
    # Gemma 2 / 3 norm each sublayer's output before the residual add (config.model.post_norms)
    post = lambda y, name: layers.rms_norm(y, w[name], m.norm_eps) if m.post_norms else y
    y = tensor.leave_matmul(functools.partial(linear, "btnh,nhd->btd", name="wo"), o, w["wo"], heads, sp, cm)
    x = ladder.add_output(x, post(y, "attn_out_norm"))
    h = layers.rms_norm(ladder.module_input(x), w["mlp_norm"], m.norm_eps)
    if mlp_kind == "moe":
        y, experts, stats = moe.apply(h, w["moe"], m, layout, previous, dispatch)
        return ladder.add_output(x, post(y, "mlp_out_norm")), experts, stats, cache
    gate, up = tensor.enter_matmul(
        lambda h, ws: layers.swiglu_up(h, ws[0], ws[1], linear), h, (w["w_gate"], w["w_up"]), mlp, sp, cm
    )
    hidden = layers.swiglu_hidden(gate, up, m.mlp_activation)
    y = tensor.leave_matmul(lambda a, wd: layers.swiglu_down(a, wd, linear), hidden, w["w_down"], mlp, sp, cm)
    return ladder.add_output(x, post(y, "mlp_out_norm")), previous, None, cache


def _cached_attention(cache, q, k, v, positions, window, m):
    """cache.attend at the caches' head dim (cache.base.head_dim: a power of two): q, k, v
    zero-padded to it, q times (H_c / H)^0.5 so that the scale H_c^-0.5 the cache's attention
    applies gives every score its H^-0.5; the output cut back to H."""
    h, hc = q.shape[-1], cache_base.head_dim(m)
    softcap = m.attn_logit_softcap or None
    if hc == h:
        return cache.attend(q, k, v, positions, window=window, softcap=softcap)
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, hc - h)])
    q = pad(q * jnp.asarray((hc / h) ** 0.5, q.dtype))
    o, cache = cache.attend(q, pad(k), pad(v), positions, window=window, softcap=softcap)
    return o[..., :h], cache


# The model in four pieces, so that a pipeline can run them on different stages:
#   embed -> layer_stack (any run of whole pattern periods) -> final_norm -> output_loss / output_logits
# Weights reach the model through execution.weights_as_used (host offload, the zeroth-order hook,
# the compute dtype, the FSDP gather); `hook` is passed through for it.


def _secondary(params, m, layout: Layout, specs=None):
    """ZeRO++'s hpZ: the weights gathered over `data` once, before the layers (parallel/zeropp.py)."""
    if not layout.hpz:
        return params
    axes = _axes(specs if specs is not None else param_specs(m))
    return zeropp.secondary(params, axes, jnp.dtype(m.compute_dtype), layout)


def embed(params, inputs, m, layout: Layout, specs=None, hook=None):
    """inputs[B, T] -> x[B, T, D] (x[B, T/tp, D] under sequence parallelism)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    table = execution.weights_as_used(params["embed"], axes["embed"], m, layout, hook, "embed")
    x = tensor.embed_lookup(table, inputs, layout.compute_axes("vocab"), layout.sp_axes)
    if m.embed_scale:  # Gemma: times sqrt(D), rounded to the activations' dtype as transformers does
        x = x * jnp.asarray(m.d_model**0.5, x.dtype)
    return x


def layer_stack(
    layer_params,
    x,
    positions,
    m,
    layout: Layout,
    specs=None,
    unroll: bool = False,
    dispatch: str = "padded",
    hook=None,
    cache=None,
    segments=None,
):
    """Run the layers of `layer_params` (this device's shards of a run of whole periods of the
    layer and MLP patterns, starting at the pattern's first layer) on x[B, T, D], through
    execution.run_layers (remat, FSDP prefetch, offload, the ladder stream, caches).
    `segments` [B, T]: the document ids of packed rows (`split_tokens`), with `positions` [B, T]
    restarting at each document; None: no document mask.

    Returns (x, moe_stats): for a model with MoE layers, the sums `aux_loss` and `z_loss` of its
    MoE layers' losses over this device's tokens, and per MoE layer here ([Lm', ...]) the global
    routing statistics `load`, `dropped`, `pairs` and `traffic` (models/moe.py); {} for a dense model.
    `dispatch` is the expert-parallel all-to-all (`config.parallel.expert_dispatch`). `hook` (see
    `execution.weights_as_used`) sees each layer's leaves as ("layers/<leaf>", weights, index in
    that leaf's stack). `cache` (inference): a jaxsys.cache type holding these layers, with
    `positions` [B, T]; then the cache after the writes is returned as a third value."""
    axes = _axes(specs if specs is not None else param_specs(m))
    layer_axes = jax.tree.map(
        lambda a: a[a.index("layers") + 1 :], axes["layers"], is_leaf=lambda a: isinstance(a, tuple)
    )

    def run(x, w, previous, spec, layer_cache):
        kind, mlp_kind, _ = spec
        return block(x, w, positions, m, layout, kind, mlp_kind, previous, dispatch, layer_cache, segments)

    # experts of the previous MoE layer per token (none yet), over the full T under sequence parallelism
    previous = jnp.full((x.shape[0], x.shape[1] * layout.size(layout.sp_axes), m.moe.top_k), -1, jnp.int32)
    x, stats, cache_out = execution.run_layers(
        layer_params,
        x,
        period=period(m),
        kinds={name: leaf_kind(name) for name in layer_params},
        layer_axes=layer_axes,
        block=run,
        previous=previous,
        m=m,
        layout=layout,
        hook=hook,
        unroll=unroll,
        cache=cache,
    )
    moe_stats = {}
    if stats is not None:
        per_moe_layer = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), stats)
        moe_stats = {
            "aux_loss": jnp.sum(per_moe_layer["aux_loss"]),
            "z_loss": jnp.sum(per_moe_layer["z_loss"]),
            **{key: per_moe_layer[key] for key in moe.ROUTING_STATISTICS},
        }
    return (x, moe_stats) if cache is None else (x, moe_stats, cache_out)


def final_norm(params, x, m, layout: Layout, specs=None, hook=None):
    axes = _axes(specs if specs is not None else param_specs(m))
    scale = execution.weights_as_used(params["final_norm"], axes["final_norm"], m, layout, hook, "final_norm")
    return layers.rms_norm(x, scale, m.norm_eps)


def output_logits(params, h, m, layout: Layout, specs=None, hook=None):
    """Normed h[B, T, D] -> logits[B, T, V] (this shard's vocabulary columns when `vocab` is split),
    soft-capped c * tanh(logits / c) with config.model.final_logit_softcap c (Gemma 2), elementwise
    so the same on every shard."""
    axes = _axes(specs if specs is not None else param_specs(m))
    name = "embed" if m.tie_embeddings else "unembed"
    w = execution.weights_as_used(params[name], axes[name], m, layout, hook, name)
    eq = "btd,vd->btv" if m.tie_embeddings else "btd,dv->btv"
    logits = tensor.enter_matmul(
        functools.partial(jnp.einsum, eq), h, w, layout.compute_axes("vocab"), layout.sp_axes, layout.collective_matmul
    )
    return layers.softcapped(logits, m.final_logit_softcap or None)


def output_loss(params, h, targets, m, layout: Layout, specs=None, hook=None):
    """Per-token cross-entropy [B, T] of normed h[B, T, D] against targets[B, T]."""
    return tensor.cross_entropy(output_logits(params, h, m, layout, specs, hook), targets, layout.compute_axes("vocab"))


def forward(params, inputs, positions, m, layout: Layout, specs=None, cache=None, unroll: bool = False, segments=None):
    """Logits [B, T, V] (this shard's V/tp columns under tensor parallelism) of inputs[B, T] at
    `positions` ([T], or [B, T] per sequence). With a KV cache (jaxsys/cache/) the keys and values
    are written into it and attention reads it: returns (logits, the cache). The one cached forward
    the serving engine, its drafters and the KIVI reference run. `segments` [B, T] (no cache):
    document ids of packed rows, attention within each document (positions as `segment_positions`)."""
    params = _secondary(params, m, layout, specs)
    x = embed(params, inputs, m, layout, specs)
    out = layer_stack(params["layers"], x, positions, m, layout, specs, unroll, cache=cache, segments=segments)
    logits = output_logits(params, final_norm(params, out[0], m, layout, specs), m, layout, specs)
    return logits if cache is None else (logits, out[2])


def logits(params, inputs, m, layout: Layout, specs=None, unroll: bool = False, positions=None, segments=None):
    """Next-token logits [B, T, V] (this shard's V/tp columns under tensor parallelism) of inputs[B, T]
    at `positions` [T] (default 0..T-1; with `segments` [B, T], the packed rows' document ids,
    each document's own positions from 0). `unroll` writes the layer loop out (the analysis counts
    every executed collective that way). No context parallelism here: T is the whole row."""
    if positions is None:
        positions = jnp.arange(inputs.shape[1]) if segments is None else segment_positions(segments)
    return forward(params, inputs, positions, m, layout, specs, unroll=unroll, segments=segments)


def segment_positions(segments):
    """segments[B, T] -> positions [B, T] counted from each document's first token: a document is
    a run of equal ids, and a new run starts where the id changes (so two documents in a row need
    different ids; padding, id 0, counts as one more run)."""
    t = jnp.arange(segments.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], dtype=bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def split_tokens(tokens, m, layout: Layout, segments=None):
    """tokens[B, T+1] -> (inputs, targets) [B, T'] and positions [T'] of this device's T' = T/P
    positions (context parallelism) of next-token prediction.

    With `segments` [B, T+1] (packed rows: 0 padding, 1, 2, ... the document of each token), four
    values: inputs, targets, positions [B, T'] restarting at each document's first token, and the
    inputs' segment ids [B, T'], all cut like the tokens. A target in another segment than its
    input (a document's last token predicting the next one's first) is the caller's to weight 0."""
    seq = context.SeqLayout.of(layout, m)
    inputs = context.shard_sequence(tokens[:, :-1], seq)
    targets = context.shard_sequence(tokens[:, 1:], seq)
    if segments is None:
        return inputs, targets, context.positions(tokens.shape[1] - 1, seq)
    if segments.shape != tokens.shape:
        raise ValueError(f"segments must have the tokens' shape [B, T+1] = {tokens.shape}; got {segments.shape}")
    segments = segments[:, :-1].astype(jnp.int32)
    positions = context.shard_sequence(segment_positions(segments), seq)
    return inputs, targets, positions, context.shard_sequence(segments, seq)


def token_losses(
    params,
    tokens,
    m,
    layout: Layout,
    specs=None,
    unroll: bool = False,
    dispatch: str = "padded",
    hook=None,
    segments=None,
    multi_token: bool = False,
):
    """Per-token cross-entropy [B, T] of next-token prediction on this shard's tokens[B, T+1]
    (under context parallelism: of this device's T/P positions of them), and the MoE layers' loss
    sums and routing statistics (`layer_stack`; {} for a dense model). `hook`: see
    `execution.weights_as_used`. `segments` [B, T+1] (int, the tokens' shape): packed rows' document
    ids, 0 for padding; each token then attends only to earlier tokens of its own document, at
    positions counted from the document's first token (`split_tokens`). The losses are returned
    for every position: the caller weights them (0 for padding and for targets in another
    document). None: one sequence per row, exactly as without the argument. `multi_token` (a
    model with config.model.mtp.depth > 0): the stats also hold "mtp", the modules' per-token
    losses [D_m, B, T] (models/mtp.py), and their MoE losses are added to the main ones."""
    params = _secondary(params, m, layout, specs)
    inputs, targets, positions, *seg = split_tokens(tokens, m, layout, segments)
    x, moe_stats = layer_stack(
        params["layers"],
        embed(params, inputs, m, layout, specs, hook),
        positions,
        m,
        layout,
        specs,
        unroll,
        dispatch,
        hook,
        segments=seg[0] if seg else None,
    )
    h = final_norm(params, x, m, layout, specs, hook)
    losses = output_loss(params, h, targets, m, layout, specs, hook)
    if multi_token and mtp.enabled(m):
        extra, extra_moe = mtp_losses(params, x, tokens, positions, m, layout, specs, dispatch, seg[0] if seg else None)
        moe_stats = dict(moe_stats, mtp=extra)
        for key in extra_moe:
            moe_stats[key] = moe_stats[key] + extra_moe[key]
    return losses, moe_stats


# ----------------------------------------------------------------------------- multi-token prediction


def mtp_outputs(params, h, tokens, positions, m, layout: Layout, specs, dispatch: str = "padded", segments=None):
    """DeepSeek-V3's modules (models/mtp.py): their normed outputs RMSNorm_k(h^k) [B, T(/tp), D] for
    k = 1 .. D_m (a list), from the main model's last hidden state h[B, T(/tp), D] (before the
    final norm) on this shard's tokens[B, T+1], and their MoE loss sums ({} without MoE). Position
    i of depth k reads token t_{i+k} (padding past the row's end) and predicts t_{i+k+1}."""
    sub = _axes(specs["mtp"])
    T = tokens.shape[1] - 1
    mk = mtp.layer_config(m, depth=1)
    used = lambda name: execution.weights_as_used(params["mtp"][name], sub[name], m, layout, None, f"mtp/{name}")
    weights = used("enorm"), used("hnorm"), used("proj")
    norm = used("norm")
    out, aux, zl = [], 0.0, 0.0
    for k in range(1, m.mtp.depth + 1):
        x = mtp.combine(embed(params, mtp.shifted(tokens, k, T), m, layout, specs), h, k, weights, m)
        one = jax.tree.map(lambda a, k=k: a[k - 1 : k], params["mtp"]["layers"])
        h, stats = layer_stack(
            one, x, positions, mk, layout, {"layers": specs["mtp"]["layers"]}, dispatch=dispatch, segments=segments
        )
        out.append(layers.rms_norm(h, norm[k - 1], m.norm_eps))
        if stats:
            aux, zl = aux + stats["aux_loss"], zl + stats["z_loss"]
    return out, ({"aux_loss": aux, "z_loss": zl} if "moe" in mk.mlp_pattern else {})


def mtp_losses(params, h, tokens, positions, m, layout: Layout, specs, dispatch: str = "padded", segments=None):
    """Per-token cross-entropies [D_m, B, T] of the modules (`mtp_outputs`) against t_{i+k+1}, and
    their MoE loss sums; positions past the row's end are computed on padding ids, for the
    caller's weights to drop (`mtp.chain_weights`)."""
    normed, moe_stats = mtp_outputs(params, h, tokens, positions, m, layout, specs, dispatch, segments)
    T = tokens.shape[1] - 1
    out = [output_loss(params, hk, mtp.shifted(tokens, k + 2, T), m, layout, specs) for k, hk in enumerate(normed)]
    return jnp.stack(out), moe_stats


def mtp_logits(params, tokens, m, layout: Layout, specs):
    """(main logits [B, T, V], the modules' logits [D_m, B, T, V]) of tokens[B, T+1] on a layout
    without sequence sharding: what an experiment measures the modules' predictions with (their
    agreement with the main model's next prediction is a speculative draft's acceptance)."""
    inputs = tokens[:, :-1]
    positions = jnp.arange(inputs.shape[1])
    x = layer_stack(params["layers"], embed(params, inputs, m, layout, specs), positions, m, layout, specs)[0]
    main = output_logits(params, final_norm(params, x, m, layout, specs), m, layout, specs)
    normed, _ = mtp_outputs(params, x, tokens, positions, m, layout, specs)
    return main, jnp.stack([output_logits(params, hk, m, layout, specs) for hk in normed])
