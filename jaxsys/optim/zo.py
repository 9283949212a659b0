"""Zeroth-order fine-tuning: MeZO (Malladi et al. 2023) with ZO2's weight streaming (Wang et al. 2025).

One step on the parameters theta, with z ~ N(0, I) drawn from (seed, step):

    l+ = L(theta + eps z),   l- = L(theta - eps z)          two forwards, no backward
    g  = (l+ - l-) / (2 eps)                                 the projected gradient (a scalar)
    theta <- theta - lr_t (g z + wd theta)                   wd only on leaves whose ParamSpec.decay

z is never stored. `normal_block` regenerates any block of it from (seed, step, leaf name, global
element index), so the two forwards and the update see the same z, every layout sees the same z,
and a shard computes only its own block:

* key: `jax.random.key(seed, impl="threefry2x32")`, folded with ZO_STREAM (kept apart from the
  initialisation's keys), the step, a 31-bit CRC of the leaf name ("layers/wq", "layers/moe/w_up")
  and, for stacked layer leaves, the layer's index in the stack;
* element [i_0, i_1, ...] of a leaf (of one layer's slice of a stacked leaf) of shape S gets
  counter n = row-major flat index of i in S, bits = xor of the two words of
  threefry2x32(key, (n >> 32, n mod 2^32)), and z = sqrt(2) erfinv(u) of the uniform u that the
  bits' top 23 bits give on (-1, 1): exactly what `jax.random.normal(key, S)` computes for that
  element with JAX's partitionable threefry (the default), so z equals it bitwise (tested) while
  only the shard's own counters are hashed. The counter is one 32-bit word here (a leaf, or one
  layer of a stacked leaf, must hold < 2^32 elements; a 405B Llama's largest has 2^31).

Inside the train step's shard_map (`local_step`) the perturbation goes where the model reads a
weight: `transformer.token_losses(..., hook=...)` calls the hook on each leaf (each layer's slice
inside the layer scan) after it was moved in from host memory and before the FSDP all-gather, so
the perturbed copy exists for one layer at a time. With `config.offload.params` the parameters
rest in host memory and stream in per layer (ZO2); the update streams them once more, layer by
layer: in, updated on the device, back out (`update`), so no part of the step holds more than a
layer's weights (plus the embedding and output leaves) on the device. Without offload the same
update runs on the device in place, leaf by leaf and layer by layer (`lax.map`), so z is
materialised one layer at a time. (An update on the host, `compute_on("device_host")`, was tried:
XLA:CPU's host computation rounds erfinv differently in the last bit, and the TPU compiler refuses
to create the counters there: "No registered implementation ... AllocateBuffer for Host".) Every perturbation is added to the unperturbed weights
(theta + eps z, theta - eps z), not applied and undone in place as MeZO's PyTorch code does, so
no rounding accumulates in theta between the forwards.

The reported "loss" is (l+ + l-)/2 = L(theta) + (eps^2/2) z^T H z + O(eps^4): the loss at theta to
O(eps^2); "grad_norm" is |g|, the size of the step's one projected gradient.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from jaxsys.models.params import ParamSpec, is_spec
from jaxsys.optim.schedules import schedule
from jaxsys.parallel import offload
from jaxsys.parallel.collectives import axis_index

ZO_STREAM = 0x7A6F  # "zo": folded into the seed's key first, so z never reuses an init key


# ----------------------------------------------------------------------------- the perturbation z


def step_key(seed, step):
    """The key of step `step`'s perturbation (step may be traced)."""
    base = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), ZO_STREAM)
    return jax.random.fold_in(base, step)


def leaf_id(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def leaf_key(key, name: str, layer=None):
    """The key of leaf `name` (of its layer `layer` when the leaf is a stack of layers)."""
    key = jax.random.fold_in(key, leaf_id(name))
    return key if layer is None else jax.random.fold_in(key, layer)


def _bits(key, shape, offsets, block):
    """uint32 bits of elements offsets + [0, block) of an array of `shape`, as
    `jax.random.bits(key, shape, jnp.uint32)` (partitionable threefry) gives them."""
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(
            f"zeroth-order perturbation of an array of {size} elements (shape {shape}): "
            "the counter is one 32-bit word; split the leaf (one layer of a stack) below 2^32"
        )
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    flat = jnp.zeros(block, jnp.uint32)
    for d, (offset, stride) in enumerate(zip(offsets, strides)):
        coord = lax.broadcasted_iota(jnp.uint32, block, d) + jnp.asarray(offset).astype(jnp.uint32)
        flat = flat + coord * jnp.uint32(stride)
    k = jax.random.key_data(key)
    b1, b2 = threefry2x32_p.bind(k[0], k[1], jnp.zeros_like(flat), flat)
    return b1 ^ b2


_LO = np.nextafter(np.float32(-1.0), np.float32(0.0), dtype=np.float32)
_SPAN = np.float32(1.0) - _LO  # as jax.random.uniform computes maxval - minval in float32


def normal_block(key, shape, offsets=None, block=None):
    """The block offsets + [0, block) of `jax.random.normal(key, shape)` (float32), computing only
    that block. `offsets` may be traced (a shard's position); `block` defaults to the whole."""
    shape = tuple(shape)
    block = shape if block is None else tuple(block)
    offsets = (0,) * len(shape) if offsets is None else tuple(offsets)
    bits = _bits(key, shape, offsets, block)
    # jax.random.uniform on [nextafter(-1, 0), 1): 23 random mantissa bits on [1, 2), shifted, scaled
    floats = lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32)
    u = lax.max(jnp.float32(_LO), (floats - jnp.float32(1.0)) * _SPAN + _LO)
    return jnp.float32(np.sqrt(2)) * lax.erf_inv(u)


def perturbation_tree(specs, key):
    """z of every parameter as whole (global) arrays, on one device: for tests and analysis."""

    def one(name, spec):
        if not _is_layered(name):
            return normal_block(leaf_key(key, name), spec.shape)
        return jnp.stack([normal_block(leaf_key(key, name, l), spec.shape[1:]) for l in range(spec.shape[0])])

    return jax.tree.map(lambda n, s: one(n.lstrip("/"), s), _with_names("", specs), specs, is_leaf=is_spec)


# ----------------------------------------------------------------------------- leaves and their shards


def _entries(pspec: P, ndim: int) -> list[tuple[str, ...]]:
    entries = list(pspec) + [None] * (ndim - len(pspec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


def _offsets(pspec: P, block_shape) -> list:
    """Global offset per dimension of this device's block of a leaf held as `pspec` (inside
    shard_map): the block's index along the dimension's mesh axes times its size."""
    return [
        axis_index(axes) * size if axes else 0 for axes, size in zip(_entries(pspec, len(block_shape)), block_shape)
    ]


def _subtree(tree, name: str):
    for part in name.split("/"):
        tree = tree[part]
    return tree


def _with_names(name: str, tree):
    """Every leaf's full name: `name` itself for a leaf, `name/<key>/...` inside a dict."""
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: is_spec(x) or isinstance(x, P))[0]
    names = [name + "".join(f"/{getattr(k, 'key', k)}" for k in path) for path, _ in paths]
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=lambda x: is_spec(x) or isinstance(x, P)), names)


def _is_layered(name: str) -> bool:
    return name.startswith("layers/")


def perturbation(program, key, scale):
    """The weights hook of `transformer.token_losses` that adds `scale` z to every weight it reads
    (local shards; one layer's slice inside the layer scan)."""
    specs, pspecs = program.specs, program.param_pspecs

    def hook(name, w, index):
        def one(leaf, full, spec, pspec):
            layered = index is not None
            shape = spec.shape[1:] if layered else spec.shape
            entries = list(pspec) + [None] * (len(spec.shape) - len(pspec))
            offsets = _offsets(P(*entries[1:]) if layered else pspec, leaf.shape)
            z = normal_block(leaf_key(key, full, index), shape, offsets, leaf.shape)
            return (leaf.astype(jnp.float32) + scale * z).astype(leaf.dtype)

        return jax.tree.map(
            one,
            w,
            _with_names(name, _subtree(specs, name)),
            _subtree(specs, name),
            _subtree(pspecs, name),
            is_leaf=lambda x: is_spec(x) or isinstance(x, P),
        )

    return hook


# ----------------------------------------------------------------------------- the update


def _sgd(w, z, g, lr, wd):
    w32 = w.astype(jnp.float32)
    step = g * z + wd * w32 if wd else g * z
    return (w32 - lr * step).astype(w.dtype)


def _update_leaf(w, key, name: str, spec: ParamSpec, offsets, g, lr, wd: float, stream: bool):
    """theta - lr (g z + wd theta) for this device's block `w` of leaf `name` (offsets: its global
    position); a stack of layers is updated layer by layer, z regenerated per layer. `stream`: `w`
    lives in host memory; each layer's block moves in, is updated and moves back out."""
    into = offload.to_device if stream else (lambda x: x)
    out = offload.to_host if stream else (lambda x: x)
    if not _is_layered(name):
        return out(_sgd(into(w), normal_block(leaf_key(key, name), spec.shape, offsets, w.shape), g, lr, wd))

    def one(args):
        w_l, layer = args
        z = normal_block(leaf_key(key, name, layer), spec.shape[1:], offsets[1:], w_l.shape)
        return out(_sgd(into(w_l), z, g, lr, wd))

    return lax.map(one, (w, jnp.arange(w.shape[0], dtype=jnp.int32)))


def update(program, params, key, g, lr):
    """The ZO update of this device's shards, leaf by leaf and layer by layer. With parameters in
    host memory (ZO2) each layer's block streams in, is updated on the device and streams back, so
    the device holds one layer's block (and its z) at a time."""
    wd = float(program.config.train.weight_decay)
    is_leaf = lambda x: is_spec(x) or isinstance(x, P)
    names = [
        n.lstrip("/") for n in jax.tree.leaves(_with_names("", program.specs), is_leaf=lambda x: isinstance(x, str))
    ]
    specs = jax.tree.leaves(program.specs, is_leaf=is_spec)
    pspecs = jax.tree.leaves(program.param_pspecs, is_leaf=is_leaf)
    flat, treedef = jax.tree.flatten(params)
    stream = program.layout.params_on_host
    new = [
        _update_leaf(w, key, n, s, _offsets(ps, w.shape), g, lr, wd if s.decay else 0.0, stream)
        for w, n, s, ps in zip(flat, names, specs, pspecs)
    ]
    return jax.tree.unflatten(treedef, new)


# ----------------------------------------------------------------------------- the step


def _forward(program, params, tokens, hook):
    """(global objective, step metrics) of one forward with the weights hook: the shards' objective
    shares summed over the batch axes as the first-order step does (`Program._metrics`)."""
    mb = program.config.train.microbatches
    norm = program.weight_norm(tokens)  # a weighted batch's global weight sum (None for tokens)
    f = lambda batch: program._local_objective(params, batch, hook, norm)
    if mb > 1:  # as gradient accumulation: the objective is the sum over micro-batches
        batches = jax.tree.map(lambda a: a.reshape(mb, a.shape[0] // mb, *a.shape[1:]), tokens)
        total = jax.tree.map(jnp.zeros_like, jax.eval_shape(f, jax.tree.map(lambda a: a[0], batches)))
        (_, (ce, moe_stats)), _ = lax.scan(lambda t, b: (jax.tree.map(jnp.add, t, f(b)), None), total, batches)
    else:
        _, (ce, moe_stats) = f(tokens)
    metrics = program._metrics(ce, moe_stats, norm)
    objective = metrics["loss"] + metrics.get("moe_aux_loss", 0.0) + metrics.get("moe_z_loss", 0.0)
    return objective, metrics


def projected_gradient(program, params, tokens, key):
    """(g, metrics at theta + eps z, metrics at theta - eps z)."""
    eps = float(program.config.train.zo.eps)
    plus, m_plus = _forward(program, params, tokens, perturbation(program, key, eps))
    minus, m_minus = _forward(program, params, tokens, perturbation(program, key, -eps))
    return (plus - minus) / (2 * eps), m_plus, m_minus


def local_step(program, state, tokens):
    """One MeZO step on local shards (inside the train step's shard_map): (new state, metrics)."""
    c = program.config
    key = step_key(c.seed, state.step)
    g, m_plus, m_minus = projected_gradient(program, state.params, tokens, key)
    lr = schedule(c.train)(state.step)
    params = update(program, state.params, key, g, lr)
    metrics = dict(m_plus)
    for k in ("loss", "moe_aux_loss", "moe_z_loss"):
        if k in m_plus:
            metrics[k] = (m_plus[k] + m_minus[k]) / 2
    metrics.update(grad_norm=jnp.abs(g), projected_grad=g, loss_plus=m_plus["loss"], loss_minus=m_minus["loss"], lr=lr)
    return state._replace(step=state.step + 1, params=params), metrics


def optimizer() -> optax.GradientTransformation:
    """The optimizer slot of a ZO run: no state (optax.EmptyState, so TrainState and checkpoints
    keep their structure); the update is `local_step`'s, never a gradient transformation."""

    def refuse(updates, state, params=None):
        raise TypeError(
            "config.train.optimizer='zo' takes no gradients: jaxsys.optim.zo.local_step updates the parameters"
        )

    return optax.GradientTransformation(lambda params: optax.EmptyState(), refuse)
