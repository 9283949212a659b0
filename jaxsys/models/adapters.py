"""LoRA adapters on a model's parameter tree (config.lora; docs/finetune.md): their ParamSpecs, the
trainable subtree, fresh adapters around a base, and merging them into the weights.

    specs = adapters.wrap_specs(transformer.param_specs(m), config)   # LoRA nodes on the targets
    adapters.strip(tree)          # the base tree (a model without adapters): specs, params, abstract
    adapters.trainable(tree)      # the adapters alone, a pruned tree of {"lora_a", "lora_b"} dicts
    adapters.with_trainable(tree, new)     # the tree with those adapters replaced
    adapters.attach(base, new, specs)      # LoRA nodes from a base tree and adapters
    adapters.merged(params, m)    # every LoRA node as W + scale A B (a quantized base dequantized)

A target projection's weight W [lead..., in dims..., out dims...] (lead: the stacked layers;
`quant.CONTRACTED` says how many dimensions are contracted) gets

    lora_a  [lead..., in dims..., r]    the base's axes for lead and in, an unsharded rank axis;
                                        normal(0, 1 / sqrt(3 K')) (the variance of PEFT's
                                        kaiming_uniform(a=sqrt(5)) on K' = prod(in dims) inputs)
    lora_b  [lead..., r, out dims...]   the rank axis, the base's out axes; zeros

so W + scale A B equals W at initialisation and the adapted model starts as the base model.
`ParamSpec.partial` records the axes each factor's gradient is contracted over that it does not
hold (A: the out axes, B: the in axes): under tensor parallelism that gradient is a partial sum
per rank, and `zero.plan` adds the all-reduce over `tensor` (models/lora.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxsys.config import lora_targets
from jaxsys.models import quant
from jaxsys.models.lora import LoRA, is_lora
from jaxsys.models.params import ParamSpec, is_spec

FACTORS = ("lora_a", "lora_b")


def enabled(config) -> bool:
    return int(config.lora.rank) > 0


def _float_spec(spec, name: str) -> ParamSpec:
    """The float weight a (possibly quantized) layer leaf stands for: its shape and logical axes."""
    if is_spec(spec):
        return spec
    if "q" in spec:
        return spec["q"]
    packed = spec["packed"]  # w4a16: the last contracted dimension holds two codes a byte
    last = quant._lead(packed.axes) + quant.contracted(name) - 1
    shape = packed.shape[:last] + (2 * packed.shape[last],) + packed.shape[last + 1 :]
    return ParamSpec(shape, packed.axes)


def factor_specs(spec: ParamSpec, name: str, rank: int) -> tuple[ParamSpec, ParamSpec]:
    """The ParamSpecs of A and B for the float weight `spec` of projection `name`."""
    lead, c = quant._lead(spec.axes), quant.contracted(name)
    lead_dims, k_dims, out_dims = spec.shape[:lead], spec.shape[lead : lead + c], spec.shape[lead + c :]
    lead_axes, k_axes, out_axes = spec.axes[:lead], spec.axes[lead : lead + c], spec.axes[lead + c :]
    # a base whose gradient is already partial (MLA's down-projections: each tensor rank's heads)
    # makes both factors' gradients partial over the same axes
    a = ParamSpec(
        lead_dims + k_dims + (rank,),
        lead_axes + k_axes + (None,),
        std=1.0 / math.sqrt(3 * math.prod(k_dims)),
        partial=tuple(n for n in out_axes if n) + tuple(spec.partial),
    )
    b = ParamSpec(
        lead_dims + (rank,) + out_dims,
        lead_axes + (None,) + out_axes,
        init="zeros",
        partial=tuple(n for n in k_axes if n) + tuple(spec.partial),
    )
    return a, b


def wrap_specs(specs: dict, config) -> dict:
    """`specs` (transformer.param_specs) with every target projection of config.lora a LoRA node of
    its base spec and the factors' specs; unchanged when config.lora.rank is 0."""
    if not enabled(config):
        return specs
    lo = config.lora
    scale, dropout = float(lo.alpha) / int(lo.rank), float(lo.dropout)
    layers = dict(specs["layers"])
    for name in lora_targets(config):
        if name not in layers:  # e.g. the MLP projections of a model whose layers are all MoE
            continue
        a, b = factor_specs(_float_spec(layers[name], name), name, int(lo.rank))
        layers[name] = LoRA(layers[name], a, b, scale, dropout)
    return {**specs, "layers": layers}


def strip(tree):
    """The base tree: every LoRA node replaced by its base (specs, parameters, abstract arrays)."""
    return jax.tree.map(lambda x: x.base if is_lora(x) else x, tree, is_leaf=is_lora)


def has_adapters(tree) -> bool:
    return any(is_lora(x) for x in jax.tree.leaves(tree, is_leaf=is_lora))


def trainable(tree):
    """The adapters of `tree` alone: the dicts on the path to each LoRA node, each node as
    {"lora_a", "lora_b"}; everything else dropped (the frozen part gets no gradient or state)."""

    def go(t):
        if is_lora(t):
            return {"lora_a": t.lora_a, "lora_b": t.lora_b}
        if isinstance(t, dict):
            kept = {k: go(v) for k, v in t.items()}
            kept = {k: v for k, v in kept.items() if v is not None}
            return kept or None
        return None

    return go(tree) or {}


def with_trainable(tree, new):
    """`tree` with its adapters replaced by `new` (a `trainable` tree of the same structure)."""

    def go(t, u):
        if is_lora(t):
            return dataclasses.replace(t, lora_a=u["lora_a"], lora_b=u["lora_b"])
        if isinstance(t, dict):
            return {k: go(v, u[k]) if k in u else v for k, v in t.items()}
        return t

    return go(tree, new)


def attach(base, new, specs):
    """LoRA nodes (with the scale and dropout of `specs`' nodes) from a base tree and its adapters."""

    def go(b, u, s):
        if is_lora(s):
            return LoRA(b, u["lora_a"], u["lora_b"], s.scale, s.dropout)
        if isinstance(s, dict):
            return {k: go(b[k], (u or {}).get(k), s[k]) for k in s}
        return b

    return go(base, new, specs)


def delta(node: LoRA, name: str):
    """scale * A B in the float weight's shape [lead..., in dims..., out dims...], fp32."""
    a, b = node.lora_a.astype(jnp.float32), node.lora_b.astype(jnp.float32)
    lead = a.ndim - quant.contracted(name) - 1
    lead_shape, k_dims, out_dims = a.shape[:lead], a.shape[lead:-1], b.shape[lead + 1 :]
    rank = a.shape[-1]
    a2 = a.reshape(math.prod(lead_shape), math.prod(k_dims), rank)
    b2 = b.reshape(math.prod(lead_shape), rank, math.prod(out_dims))
    d = jnp.einsum("lkr,lrn->lkn", a2, b2, precision=jax.lax.Precision.HIGHEST) * node.scale
    return d.reshape(*lead_shape, *k_dims, *out_dims)


def folded(w, name: str, m):
    """One layer's float weight of projection `name` for a product that does not go through
    quant.linear (MLA's absorbed attention over the latent cache, serving only: no dropout): a
    quantized base (config.model.quant* of `m`) dequantized to fp32, its rotation undone, and the
    adapter folded in, W + scale A B in W's dtype; a float weight without an adapter unchanged."""
    base = w.base if is_lora(w) else w
    if quant.is_quantized(base):
        base = quant.dequantize_layer(base, m.quant, quant.contracted(name), quant.rotation(m))
    return base + delta(w, name).astype(base.dtype) if is_lora(w) else base


def dense_base(w, name: str, m):
    """The fp32 weight a layer leaf's base stands for: itself, or a quantized one (config.model.quant*
    of `m`) dequantized, its rotation undone."""
    if not quant.is_quantized(w):
        return w.astype(jnp.float32)
    # a layer leaf is stacked [L, ...] (no pipeline chunks with adapters): one layer at a time
    return jax.vmap(lambda layer: quant.dequantize_layer(layer, m.quant, quant.CONTRACTED[name], quant.rotation(m)))(w)


def merged(params, m, dtype):
    """`params` with every LoRA node replaced by the weight W + scale A B in `dtype` (the merged
    model has no adapters; a quantized base, config.model.quant, is dequantized first). Rounded
    once, into `dtype`: the merged model's logits equal the adapted model's to that rounding."""
    layers = dict(params["layers"])
    for name, w in layers.items():
        if is_lora(w):
            layers[name] = (dense_base(w.base, name, m) + delta(w, name)).astype(dtype)
    return {**params, "layers": layers}
