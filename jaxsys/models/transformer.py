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

`config.model.layer_pattern` and `.mlp_pattern` say which attention and MLP each layer has. The
attention and norm leaves hold every layer; the dense-MLP leaves only the Ld dense layers and
`moe` only the Lm MoE ones, in layer order, so every stack splits over pipeline stages that hold
whole periods of the two patterns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxsys.config import block_pattern
from jaxsys.kernels.paged_attention.kernel import paged_attention
from jaxsys.models import attention, layers, moe, quant
from jaxsys.models.params import ParamSpec
from jaxsys.parallel import context, fsdp, offload, tensor
from jaxsys.sharding import Layout

DENSE_MLP = ("w_gate", "w_up", "w_down")  # leaves of the dense-MLP layers only
# a cache's per-layer leaves [L, ...] (`layer_stack(kv=...)`; the quantized ones: models/kv_quant.py)
CACHE_LEAVES = ("k", "v", "kq", "vq", "ks", "kz", "vs", "vz")
_ATTENTION = None  # `attention_override`


@contextlib.contextmanager
def attention_override(fn):
    """While open, the forward without a cache computes its softmax attention as fn(q, k, v) (q
    [B, T, N, H], k, v [B, T, K, H] after RoPE, causal over positions 0..T-1) instead of
    `attention.softmax_attention`: e.g. models/kv_quant.kivi_attention, attention over a quantized
    KV cache. Trace time, as quant.capture_inputs: jit a new function inside the block (a cached
    trace keeps the attention it was traced with)."""
    global _ATTENTION
    outer, _ATTENTION = _ATTENTION, fn
    try:
        yield
    finally:
        _ATTENTION = outer


def layer_counts(m) -> dict:
    """Layers each kind of layer leaf holds: every layer, the dense-MLP ones, the MoE ones."""
    pattern, periods = block_pattern(m), m.n_layers // len(block_pattern(m))
    return {
        "all": m.n_layers,
        "dense": periods * sum(mlp == "dense" for _, mlp in pattern),
        "moe": periods * sum(mlp == "moe" for _, mlp in pattern),
    }


def param_specs(m, chunks: int = 1) -> dict:
    """The parameter pytree of `config.model` as ParamSpecs. With `chunks` = v > 1 (interleaved
    pipeline) each layer leaf is [v, L/v, ...] ("chunks", "layers", ...): layer l is [l // (L/v),
    l % (L/v)], so sharding the second dimension over `pipe` gives device d the stages d, d+p, ..."""
    L, D, N, K, H, F, V = m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    std, out_std = m.init_std, m.init_std / (2 * L) ** 0.5  # GPT-2 scaling of residual outputs
    norm = lambda *shape_axes: ParamSpec(*shape_axes, init="ones", decay=False)
    counts = layer_counts(m)
    Ld = counts["dense"]
    layer_specs = {
        "attn_norm": norm((L, D), ("layers", "embed")),
        "wq": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), std=std),
        "wk": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std),
        "wv": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), std=std),
        "wo": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), std=out_std),
        "mlp_norm": norm((L, D), ("layers", "embed")),
    }
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


def remat_policy(name: str, offloaded: tuple[str, ...] = ()):
    """`none` saves everything but the FSDP-gathered weights (always gathered again backward);
    `dots` saves matmul outputs only; `full` saves nothing inside a layer. The activations named in
    `offloaded` (config.offload.activations) are saved to host memory instead."""
    policies = jax.checkpoint_policies
    if name == "full":
        base = policies.nothing_saveable
    elif name == "dots":
        base = policies.dots_saveable
    else:
        base = fsdp.remat_saveable
    return offload.remat_policy(base, offloaded)


def _weights(w, axes, m, layout: Layout, hook=None, name: str = "", index=None):
    """Weights as a layer uses them: moved in from host memory when they live there
    (config.offload.params), passed through `hook` (name, local weights, layer index) when given
    (zeroth-order perturbations), cast to the compute dtype, gathered over the FSDP axes."""
    w = offload.fetch(w, layout.params_on_host)
    if hook is not None:
        w = hook(name, w, index)
    return fsdp.gather(w if quant.is_quantized(w) else _cast(w, m), axes, layout)


def _write_cache(cache, new, positions):
    """cache[B, S, K, H] with new[B, T, K, H] written at slots positions[b, 0] .. + T of each sequence."""
    write = lambda c, n, start: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (start, 0, 0))
    return jax.vmap(write)(cache, new, positions[:, 0])


def _paged_attention(q, k, v, kv, positions):
    """One token per row (q, k, v [R, 1, ., H], positions [R, 1]) against a paged cache: kv["k"],
    kv["v"] [P, page_size, K, H] pages, kv["page_table"] [R, max_pages] each row's sequence's pages.
    Every row's key and value are written to its slot first, then each row attends to its
    sequence's slots up to its position (the Pallas paged-attention kernel, one query per row), so
    the rows of one prefill chunk see each other causally."""
    if "kv_quant" in kv:  # the quantized cache (config.serve.kv_quant, models/kv_quant.py)
        from jaxsys.models import kv_quant

        return kv_quant.paged_attention(q, k, v, kv, positions)
    pages, page_size = kv["k"].shape[:2]
    table = kv["page_table"]
    pos = positions[:, 0]
    slot = jnp.take_along_axis(table, (pos // page_size)[:, None], axis=1)[:, 0] * page_size + pos % page_size
    write = lambda cache, new: (
        cache.reshape(pages * page_size, *cache.shape[2:])
        .at[slot]
        .set(new[:, 0].astype(cache.dtype))
        .reshape(cache.shape)
    )
    out = dict(kv, k=write(kv["k"], k), v=write(kv["v"], v))
    # self-speculation's sparse draft (serve/spec_engine.py) reads through another table of the same
    # pages (its attention sinks and recent window) with its own lengths; the writes above use the full one
    read_table, read_lengths = kv.get("read_table", table), kv.get("read_lengths", pos + 1)
    o = paged_attention(q[:, 0], out["k"].astype(q.dtype), out["v"].astype(q.dtype), read_table, read_lengths)
    return o[:, None], out


class LadderStream(NamedTuple):
    """The residual stream under the ladder residual (config.model.residual="ladder"; Zhang et al.
    2025): `h`[B, T, D], what the next module reads, and `pending`, the last module's output,
    already reduced over `tensor` but added to h only after the next module has read h. So that
    module's compute does not wait for the collective, which can run beside it."""

    h: jax.Array
    pending: jax.Array


def residual_stream(x, m):
    """The stream a layer stack carries for x[B, T, D]: x itself, or under the ladder residual
    (x, nothing pending yet)."""
    return LadderStream(x, jnp.zeros_like(x)) if m.residual == "ladder" else x


def flushed(stream):
    """x[B, T, D] at the end of a layer stack: under the ladder residual with the pending output added."""
    return stream.h + stream.pending if isinstance(stream, LadderStream) else stream


def _module_input(stream):
    """What a module (attention, MLP) reads of the residual stream: the stream through the module
    before the last one under the ladder residual, else all of it."""
    return stream.h if isinstance(stream, LadderStream) else stream


def _add_output(stream, out):
    """The stream after a module's output `out`: x + out, or under the ladder residual (h + pending,
    out): the previous module's output joins h now, this one's waits for the next module."""
    if isinstance(stream, LadderStream):
        return LadderStream(stream.h + stream.pending, out)
    return stream + out


def _qkv(linear, h, ws):
    """The attention's column-parallel projections of h: q, k, v."""
    wq, wk, wv = ws
    return (
        linear("btd,dnh->btnh", h, wq, name="wq"),
        linear("btd,dkh->btkh", h, wk, name="wk"),
        linear("btd,dkh->btkh", h, wv, name="wv"),
    )


def _block(
    x,
    w,
    positions,
    m,
    layout: Layout,
    kind: str = "softmax",
    mlp_kind: str = "dense",
    previous=None,
    dispatch: str = "padded",
    kv=None,
):
    """One layer on x[B, T, D] (or [B, T/tp, D] under sequence parallelism); `w` gathered.
    Under the ladder residual x is a `LadderStream` (h, pending) of such arrays, and so is the x returned.
    `kind` is the layer's attention: "softmax" (with RoPE) or "linear" (attention.py); `mlp_kind`
    its MLP: "dense" (SwiGLU) or "moe" (models/moe.py, which takes `previous`, the experts the last
    MoE layer chose). Returns (x, experts chosen here or `previous`, MoE stats or None).

    Decoding (jaxsys/serve): `kv` = {"k", "v"}, this layer's cache [B, S, K, H] (this device's
    sequences and kv heads) and `positions` [B, T] per sequence: the new keys and values are
    written at their positions, the queries attend to the cache, and the updated cache is returned
    as a fourth value."""
    seq = context.SeqLayout.of(layout, m)
    heads, mlp, sp = layout.compute_axes("heads"), layout.compute_axes("mlp"), layout.sp_axes
    x = checkpoint_name(x, "layer_input")  # host-offloadable residual (config.offload.activations)
    linear = functools.partial(quant.linear, m=m)  # einsum, or the quantized kernels (config.model.quant)
    cm = layout.collective_matmul  # the TP matmuls beside their SP collectives (config.parallel.collective_matmul)
    q, k, v = tensor.enter_matmul(
        functools.partial(_qkv, linear),
        layers.rms_norm(_module_input(x), w["attn_norm"], m.norm_eps),
        (w["wq"], w["wk"], w["wv"]),
        heads,
        sp,
        cm,
    )
    if kind == "linear":
        if kv is not None:
            raise ValueError(
                "decoding with a KV cache needs softmax attention layers; linear-attention "
                "layers keep a recurrent state instead (not implemented)"
            )
        o = attention.linear_attention(q, k, v, m, heads, seq)
    else:
        q, k = layers.rope(q, positions, m.rope_theta), layers.rope(k, positions, m.rope_theta)
        if kv is None:
            o = attention.softmax_attention(q, k, v, m, seq) if _ATTENTION is None else _ATTENTION(q, k, v)
        elif "page_table" in kv:  # the serving engine's paged cache (jaxsys/serve/engine.py)
            o, kv = _paged_attention(q, k, v, kv, positions)
        else:
            kv = {"k": _write_cache(kv["k"], k, positions), "v": _write_cache(kv["v"], v, positions)}
            o = layers.attention(q, kv["k"].astype(q.dtype), kv["v"].astype(q.dtype), q_positions=positions)
    o = checkpoint_name(o, "attention_output")
    x = _add_output(
        x, tensor.leave_matmul(functools.partial(linear, "btnh,nhd->btd", name="wo"), o, w["wo"], heads, sp, cm)
    )
    h = layers.rms_norm(_module_input(x), w["mlp_norm"], m.norm_eps)
    if mlp_kind == "moe":
        y, experts, stats = moe.apply(h, w["moe"], m, layout, previous, dispatch)
        out = (_add_output(x, y), experts, stats)
    else:
        gate, up = tensor.enter_matmul(
            lambda h, ws: layers.swiglu_up(h, ws[0], ws[1], linear), h, (w["w_gate"], w["w_up"]), mlp, sp, cm
        )
        y = tensor.leave_matmul(
            lambda a, wd: layers.swiglu_down(a, wd, linear), layers.swiglu_hidden(gate, up), w["w_down"], mlp, sp, cm
        )
        out = (_add_output(x, y), previous, None)
    return out if kv is None else out + (kv,)


# The model in four pieces, so that a pipeline can run them on different stages:
#   embed -> layer_stack (any run of whole pattern periods) -> final_norm -> output_loss / output_logits


def _cast(tree, m):
    compute = jnp.dtype(m.compute_dtype)
    return jax.tree.map(lambda p: p.astype(compute), tree)


def embed(params, inputs, m, layout: Layout, specs=None, hook=None):
    """inputs[B, T] -> x[B, T, D] (x[B, T/tp, D] under sequence parallelism)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    table = _weights(params["embed"], axes["embed"], m, layout, hook, "embed")
    return tensor.embed_lookup(table, inputs, layout.compute_axes("vocab"), layout.sp_axes)


def _leaf_kind(name: str) -> str:
    return "moe" if name == "moe" else "dense" if name in DENSE_MLP else "all"


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
    kv=None,
):
    """Run the layers of `layer_params` (this device's shards of a run of whole periods of the
    layer and MLP patterns, starting at the pattern's first layer) on x[B, T, D].

    Returns (x, moe_stats): for a model with MoE layers, the sums `aux_loss` and `z_loss` of its
    MoE layers' losses over this device's tokens, and per MoE layer here ([Lm', ...]) the global
    routing statistics `load`, `dropped`, `pairs` and `traffic` (models/moe.py); {} for a dense model.
    `dispatch` is the expert-parallel all-to-all (`config.parallel.expert_dispatch`). `hook` (see
    `_weights`) sees each layer's leaves as ("layers/<leaf>", weights, index in that leaf's stack).
    `kv` (decoding): {"k", "v"} caches [L, B, S, K, H] of these layers, with `positions` [B, T];
    then the updated caches are returned as a third value (and no layer is rematerialised).
    Under the ladder residual (config.model.residual) the scan carries the stream (h, pending) and
    the last module's pending output is added at the end: a stack is always whole (no pipeline)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    layer_axes = jax.tree.map(
        lambda a: a[a.index("layers") + 1 :], axes["layers"], is_leaf=lambda a: isinstance(a, tuple)
    )
    pattern = block_pattern(m)
    period = len(pattern)
    n_groups = layer_params["attn_norm"].shape[0] // period
    offsets = {"all": 0, "dense": 0, "moe": 0}
    per_layer = []  # (attention, mlp, this layer's index among each kind of leaf of its period)
    for kind, mlp_kind in pattern:
        per_layer.append((kind, mlp_kind, dict(offsets)))
        offsets["all"] += 1
        offsets[mlp_kind] += 1

    def pick(group, g, mlp_kind, index):
        """A layer's weights from its group's: the leaves of every layer and of its MLP kind. With
        one layer per period the scan slices the stacks themselves (`group` is one layer)."""
        if period == 1:
            return {name: leaf for name, leaf in group.items() if _leaf_kind(name) in ("all", mlp_kind)}
        return {
            name: jax.tree.map(lambda a: a[index[_leaf_kind(name)]], leaf)
            for name, leaf in group.items()
            if _leaf_kind(name) in ("all", mlp_kind)
        }

    # The layer input is the remat'd function's own argument, which remat always keeps; to put it in
    # host memory it is moved there before the call and back at the layer's start, so the scan
    # stacks the host copy for the backward (config.offload.activations=layer_input).
    input_to_host = "layer_input" in layout.offload_activations

    def gather(w, g, index):
        """A layer's picked weights as it uses them (`_weights`: cast, FSDP all-gather)."""
        return {
            k: _weights(
                w[k], layer_axes[k], m, layout, hook, f"layers/{k}", g * offsets[_leaf_kind(k)] + index[_leaf_kind(k)]
            )
            for k in w
        }

    def layer(x, previous, group, g, kind, mlp_kind, index, kv_layer=None):
        if input_to_host:
            x = offload.to_device(x)
        gathered = gather(pick(group, g, mlp_kind, index), g, index)
        return _block(x, gathered, positions, m, layout, kind, mlp_kind, previous, dispatch, kv_layer)

    if kv is None:
        remat = [
            jax.checkpoint(
                lambda x, prev, w, g, spec=spec: layer(x, prev, w, g, *spec),
                policy=remat_policy(m.remat, layout.offload_activations),
                prevent_cse=False,
            )
            for spec in per_layer
        ]
    else:  # inference: nothing to rematerialise
        remat = [
            lambda x, prev, w, g, kv_layer, spec=spec: layer(x, prev, w, g, *spec, kv_layer=kv_layer)
            for spec in per_layer
        ]
    # Each kind of leaf is [groups x (its layers per period), ...]: scan over the groups. With one
    # layer per period the stacks are scanned as they are: no reshape, which the TPU compiler
    # cannot do to a buffer in host memory (config.offload.params).
    groups = (
        layer_params
        if period == 1
        else {
            name: jax.tree.map(lambda a: a.reshape(n_groups, a.shape[0] // n_groups, *a.shape[1:]), leaf)
            for name, leaf in layer_params.items()
        }
    )
    n_moe = offsets["moe"]
    # experts of the previous MoE layer per token (none yet), over the full T under sequence parallelism
    previous = jnp.full((x.shape[0], x.shape[1] * layout.size(layout.sp_axes), m.moe.top_k), -1, jnp.int32)

    # the caches [L, ...] scan as [groups, period, ...] beside the weights
    # (a paged cache's page table is the same for every layer: it is not scanned)
    shared = {} if kv is None else {k: a for k, a in kv.items() if k not in CACHE_LEAVES}
    kv_groups = (
        None
        if kv is None
        else jax.tree.map(
            lambda a: a.reshape(n_groups, period, *a.shape[1:]), {k: a for k, a in kv.items() if k in CACHE_LEAVES}
        )
    )

    # FSDP prefetch (config.parallel.fsdp_prefetch): the scan carries the next layer's gathered
    # weights; each layer first issues the all-gather of the layer after it, then computes on the
    # weights gathered one layer earlier (layer 0's before the scan; the last layer gathers the
    # last group's first layer again, unused). fsdp.prefetched keeps the gathered weights out of the
    # backward's residuals: the backward gathers them again, as without prefetch. The weight
    # gradients flow back along the carry: backward iteration i reduce-scatters layer i+1's (the
    # transpose of its prefetch) beside layer i's VJP, into the stack's gradient (the delayed
    # reduce-scatter); the scanned stack is only read, under stop_gradient, for the backward's regather.
    prefetch = layout.fsdp_prefetch and kv is None

    def ahead(g, i):
        """Layer i of group g, gathered from the whole stack `groups` (a dynamic index): its gradient
        comes back along the carry (fsdp.prefetched), and this gather's transpose reduce-scatters it."""
        _, mlp_kind, index = per_layer[i]
        return gather(pick(jax.tree.map(lambda a: a[g], groups), g, mlp_kind, index), g, index)

    def prefetched(kind, mlp_kind, index):
        def block(x, prev, w):
            if input_to_host:
                x = offload.to_device(x)
            return _block(x, w, positions, m, layout, kind, mlp_kind, prev, dispatch)

        run = fsdp.prefetched(
            block, lambda local: gather(local[0], local[1], index), remat_policy(m.remat, layout.offload_activations)
        )
        return lambda x, prev, group, g, w: run(x, prev, (pick(group, g, mlp_kind, index), g), w)

    runs = [prefetched(*spec) for spec in per_layer] if prefetch else None

    def body(carry, xs):
        (x, previous, gathered), (group_params, g, kv_group) = carry, xs
        stats, kv_out = [], []
        for i in range(period):
            args = (offload.to_host(x) if input_to_host else x, previous, group_params, g)
            if prefetch:
                following = ahead(g, i + 1) if i + 1 < period else ahead(jnp.minimum(g + 1, n_groups - 1), 0)
                x, previous, layer_stats = runs[i](*args, gathered)
                gathered = following
            elif kv_group is None:
                x, previous, layer_stats = remat[i](*args)
            else:
                x, previous, layer_stats, kv_layer = remat[i](
                    *args, {**jax.tree.map(lambda a: a[i], kv_group), **shared}
                )
                kv_out.append({k: kv_layer[k] for k in kv_group})
            if layer_stats is not None:
                stats.append(layer_stats)
        stack = lambda items: jax.tree.map(lambda *s: jnp.stack(s), *items) if items else None
        return (x, previous, gathered), (stack(stats), stack(kv_out))

    first = ahead(jnp.int32(0), 0) if prefetch else None
    # the carry's x is the residual stream: x, or the ladder residual's (h, pending)
    (stream, *_), (stats, kv_new) = jax.lax.scan(
        body,
        (residual_stream(x, m), previous, first),
        (jax.lax.stop_gradient(groups) if prefetch else groups, jnp.arange(n_groups), kv_groups),
        unroll=n_groups if unroll else 1,
    )
    x = flushed(stream)
    if kv is not None:
        kv_new = jax.tree.map(lambda a: a.reshape(n_groups * period, *a.shape[2:]), kv_new)
    if not n_moe:
        return (x, {}) if kv is None else (x, {}, kv_new)
    per_moe_layer = jax.tree.map(lambda a: a.reshape(n_groups * n_moe, *a.shape[2:]), stats)
    moe_stats = {
        "aux_loss": jnp.sum(per_moe_layer["aux_loss"]),
        "z_loss": jnp.sum(per_moe_layer["z_loss"]),
        **{key: per_moe_layer[key] for key in moe.ROUTING_STATISTICS},
    }
    return (x, moe_stats) if kv is None else (x, moe_stats, kv_new)


def final_norm(params, x, m, layout: Layout, specs=None, hook=None):
    axes = _axes(specs if specs is not None else param_specs(m))
    scale = _weights(params["final_norm"], axes["final_norm"], m, layout, hook, "final_norm")
    return layers.rms_norm(x, scale, m.norm_eps)


def output_logits(params, h, m, layout: Layout, specs=None, hook=None):
    """Normed h[B, T, D] -> logits[B, T, V] (this shard's vocabulary columns when `vocab` is split)."""
    axes = _axes(specs if specs is not None else param_specs(m))
    if m.tie_embeddings:
        w, eq = _weights(params["embed"], axes["embed"], m, layout, hook, "embed"), "btd,vd->btv"
    else:
        w, eq = _weights(params["unembed"], axes["unembed"], m, layout, hook, "unembed"), "btd,dv->btv"
    return tensor.enter_matmul(
        functools.partial(jnp.einsum, eq), h, w, layout.compute_axes("vocab"), layout.sp_axes, layout.collective_matmul
    )


def output_loss(params, h, targets, m, layout: Layout, specs=None, hook=None):
    """Per-token cross-entropy [B, T] of normed h[B, T, D] against targets[B, T]."""
    return tensor.cross_entropy(output_logits(params, h, m, layout, specs, hook), targets, layout.compute_axes("vocab"))


def logits(params, inputs, m, layout: Layout, specs=None, unroll: bool = False, positions=None):
    """Next-token logits [B, T, V] (this shard's V/tp columns under tensor parallelism) of inputs[B, T]
    at `positions` [T] (default 0..T-1). `unroll` writes the layer loop out (the analysis counts
    every executed collective that way)."""
    positions = jnp.arange(inputs.shape[1]) if positions is None else positions
    x = embed(params, inputs, m, layout, specs)
    x, _ = layer_stack(params["layers"], x, positions, m, layout, specs, unroll)
    return output_logits(params, final_norm(params, x, m, layout, specs), m, layout, specs)


def split_tokens(tokens, m, layout: Layout):
    """tokens[B, T+1] -> (inputs, targets) [B, T'] and positions [T'] of this device's T' = T/P
    positions (context parallelism) of next-token prediction."""
    seq = context.SeqLayout.of(layout, m)
    inputs = context.shard_sequence(tokens[:, :-1], seq)
    targets = context.shard_sequence(tokens[:, 1:], seq)
    return inputs, targets, context.positions(tokens.shape[1] - 1, seq)


def token_losses(
    params, tokens, m, layout: Layout, specs=None, unroll: bool = False, dispatch: str = "padded", hook=None
):
    """Per-token cross-entropy [B, T] of next-token prediction on this shard's tokens[B, T+1]
    (under context parallelism: of this device's T/P positions of them), and the MoE layers' loss
    sums and routing statistics (`layer_stack`; {} for a dense model). `hook`: see `_weights`."""
    inputs, targets, positions = split_tokens(tokens, m, layout)
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
    )
    h = final_norm(params, x, m, layout, specs, hook)
    return output_loss(params, h, targets, m, layout, specs, hook), moe_stats
