"""Running a stack of layers: the scan over the layers, with every execution policy applied around
the model's layer (execution/__init__.py lists them).

The model gives `run_layers` what a layer is: `period`, the (attention kind, MLP kind, index of the
layer among each kind of leaf in its period) of the layers of one period of its patterns;
`kinds[name]`, which layers a parameter leaf holds ("all", "dense" or "moe"); `layer_axes`, the
logical axes of one layer's slice of each leaf; and `block(x, w, previous, spec, cache)`, the layer's
math on gathered weights. This module decides how the weights reach the layer, what the backward
keeps, where activations live and what the scan carries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsys.execution.remat import remat_policy
from jaxsys.models import ladder, lora, quant
from jaxsys.parallel import fsdp, fsdp_prefetch, offload
from jaxsys.sharding import Layout


def weights_as_used(w, axes, m, layout: Layout, hook=None, name: str = "", index=None):
    """Weights as a layer uses them: moved in from host memory when they live there
    (config.offload.params), passed through `hook` (name, local weights, layer index) when given
    (zeroth-order perturbations, optim/zo.py; a LoRA node's dropout key, program.py), cast to the
    compute dtype (quantized codes as they are), gathered over the FSDP axes. A LoRA node
    (models/lora.py) is its base and factors, each treated so."""
    w = offload.fetch(w, layout.params_on_host)
    if hook is not None:
        w = hook(name, w, index)
    key = None
    if lora.is_lora(w) and w.key is not None:  # a dropout key is not a weight: kept aside
        key, w = w.key, dataclasses.replace(w, key=None)
    compute = jnp.dtype(m.compute_dtype)
    cast = lambda p: p if quant.is_quantized(p) else p.astype(compute)
    w = fsdp.gather(jax.tree.map(cast, w, is_leaf=quant.is_quantized), axes, layout)
    return w if key is None else dataclasses.replace(w, key=key)


def run_layers(
    layer_params,
    x,
    *,
    period,
    kinds,
    layer_axes,
    block,
    previous,
    m,
    layout: Layout,
    hook=None,
    unroll: bool = False,
    cache=None,
):
    """Run the layers of `layer_params` (this device's shards of a run of whole periods, each leaf
    stacked [layers of its kind, ...]) on x[B, T, D] from the first layer of a period.

    Returns (x, per-layer statistics stacked [layers that returned some, ...] or None, cache).
    `previous` starts the MoE routing carry. `hook`: see `weights_as_used`; it sees each layer's
    leaves as ("layers/<leaf>", weights, index in that leaf's stack). `cache` (inference): a
    jaxsys.cache type whose per-layer arrays scan beside the weights; no layer is rematerialised then.
    The scan carries the residual stream (models/ladder.py: x, or the ladder residual's (h, pending),
    flushed at the end: a stack is always whole under the ladder residual, no pipeline)."""
    n_period = len(period)
    n_groups = layer_params["attn_norm"].shape[0] // n_period
    offsets = {kind: sum(1 for _, mlp, _ in period if kind in ("all", mlp)) for kind in ("all", "dense", "moe")}

    def pick(group, mlp_kind, index):
        """A layer's leaves from its group's: those of every layer and of its MLP kind. With one
        layer per period the scan slices the stacks themselves (`group` is one layer)."""
        keep = {name: leaf for name, leaf in group.items() if kinds[name] in ("all", mlp_kind)}
        if n_period == 1:
            return keep
        return {name: jax.tree.map(lambda a: a[index[kinds[name]]], leaf) for name, leaf in keep.items()}

    def gather(w, g, index):
        """A layer's picked weights as it uses them (cast, FSDP all-gather, ...)."""
        return {
            k: weights_as_used(
                w[k], layer_axes[k], m, layout, hook, f"layers/{k}", g * offsets[kinds[k]] + index[kinds[k]]
            )
            for k in w
        }

    # The layer input is the remat'd function's own argument, which remat always keeps; to put it in
    # host memory it is moved there before the call and back at the layer's start, so the scan
    # stacks the host copy for the backward (config.offload.activations=layer_input).
    input_to_host = "layer_input" in layout.offload_activations
    arrive = offload.to_device if input_to_host else (lambda x: x)
    leave = offload.to_host if input_to_host else (lambda x: x)
    policy = remat_policy(m.remat, layout.offload_activations)
    prefetch = layout.fsdp_prefetch and cache is None

    def plain(spec):
        def layer(x, prev, group, g):
            return block(arrive(x), gather(pick(group, spec[1], spec[2]), g, spec[2]), prev, spec, None)[:3]

        return jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def cached(spec):  # inference: nothing to rematerialise
        def layer(x, prev, group, g, cache_layer):
            return block(arrive(x), gather(pick(group, spec[1], spec[2]), g, spec[2]), prev, spec, cache_layer)

        return layer

    def prefetching(spec):
        run = fsdp_prefetch.prefetched(
            lambda x, prev, w: block(arrive(x), w, prev, spec, None)[:3],
            lambda local: gather(local[0], local[1], spec[2]),
            policy,
        )
        return lambda x, prev, group, g, w: run(x, prev, (pick(group, spec[1], spec[2]), g), w)

    make = prefetching if prefetch else cached if cache is not None else plain
    layers = [make(spec) for spec in period]

    # Each kind of leaf is [groups x (its layers per period), ...]: scan over the groups. With one
    # layer per period the stacks are scanned as they are: no reshape, which the TPU compiler
    # cannot do to a buffer in host memory (config.offload.params).
    groups = (
        layer_params
        if n_period == 1
        else {
            name: jax.tree.map(lambda a: a.reshape(n_groups, a.shape[0] // n_groups, *a.shape[1:]), leaf)
            for name, leaf in layer_params.items()
        }
    )
    # the cache's per-layer arrays [L, ...] scan as [groups, period, ...] beside the weights
    cache_groups = (
        None
        if cache is None
        else jax.tree.map(lambda a: a.reshape(n_groups, n_period, *a.shape[1:]), cache.per_layer())
    )

    def ahead(g, i):
        """Layer i of group g gathered from the whole stack (FSDP prefetch)."""
        _, mlp_kind, index = period[i]
        return gather(pick(jax.tree.map(lambda a: a[g], groups), mlp_kind, index), g, index)

    def body(carry, xs):
        (x, previous, gathered), (group, g, cache_group) = carry, xs
        stats, cache_out = [], []
        for i in range(n_period):
            args = (leave(x), previous, group, g)
            if prefetch:
                following = ahead(*fsdp_prefetch.following(g, i, n_period, n_groups))
                x, previous, layer_stats = layers[i](*args, gathered)
                gathered = following
            elif cache_group is None:
                x, previous, layer_stats = layers[i](*args)
            else:
                layer_cache = cache.with_layers(jax.tree.map(lambda a: a[i], cache_group))
                x, previous, layer_stats, layer_cache = layers[i](*args, layer_cache)
                cache_out.append(layer_cache.per_layer())
            if layer_stats is not None:
                stats.append(layer_stats)
        stack = lambda items: jax.tree.map(lambda *s: jnp.stack(s), *items) if items else None
        return (x, previous, gathered), (stack(stats), stack(cache_out))

    first = ahead(*fsdp_prefetch.first()) if prefetch else None
    (stream, *_), (stats, cache_new) = jax.lax.scan(
        body,
        (ladder.residual_stream(x, m), previous, first),
        (fsdp_prefetch.scanned(groups) if prefetch else groups, jnp.arange(n_groups), cache_groups),
        unroll=n_groups if unroll else 1,
    )
    if cache is not None:
        cache = cache.with_layers(jax.tree.map(lambda a: a.reshape(n_groups * n_period, *a.shape[2:]), cache_new))
    return ladder.flushed(stream), stats, cache
