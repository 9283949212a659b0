"""Collectives with their backward written out (custom_vjp), the building blocks of the strategies.

Inside `shard_map(check_vma=False)` JAX would otherwise pick a transpose for each collective; here
the backward communication is stated next to the forward, as the papers state it. Every function
is the identity when `axes` is empty, so a one-device layout has no collectives at all.
"""

from __future__ import annotations

from functools import partial

import jax
from jax import lax


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_fwd_psum_bwd(x, axes):
    """Megatron's `f`: identity forward, all-reduce of the gradient backward."""
    return x


def _f_fwd(x, axes):
    return x, None


def _f_bwd(axes, _, g):
    return (lax.psum(g, axes) if axes else g,)


copy_fwd_psum_bwd.defvjp(_f_fwd, _f_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def psum_fwd_copy_bwd(x, axes):
    """Megatron's `g`: all-reduce forward, identity backward."""
    return lax.psum(x, axes) if axes else x


def _g_fwd(x, axes):
    return psum_fwd_copy_bwd(x, axes), None


def _g_bwd(axes, _, g):
    return (g,)


psum_fwd_copy_bwd.defvjp(_g_fwd, _g_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather_fwd_reduce_scatter_bwd(x, axes, dim):
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""
    return lax.all_gather(x, axes, axis=dim, tiled=True) if axes else x


def _ag_fwd(x, axes, dim):
    return all_gather_fwd_reduce_scatter_bwd(x, axes, dim), None


def _ag_bwd(axes, dim, _, g):
    return (lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True) if axes else g,)


all_gather_fwd_reduce_scatter_bwd.defvjp(_ag_fwd, _ag_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_scatter_fwd_all_gather_bwd(x, axes, dim):
    """Reduce-scatter along `dim` forward; all-gather of the gradient backward."""
    return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True) if axes else x


def _rs_fwd(x, axes, dim):
    return reduce_scatter_fwd_all_gather_bwd(x, axes, dim), None


def _rs_bwd(axes, dim, _, g):
    return (lax.all_gather(g, axes, axis=dim, tiled=True) if axes else g,)


reduce_scatter_fwd_all_gather_bwd.defvjp(_rs_fwd, _rs_bwd)


def max_over_replicas_and_shards(x):
    """The elementwise max of `x` (a statistic such as an absmax, not differentiated) over every
    device that holds a shard or a replica of the same tensor: inside the training shard_map, all
    mesh axes of size > 1 but `pipe` (whose stages hold other layers and other microbatches);
    outside one (a single device, plain jit) x itself. fp8 training's per-tensor scales
    (models/quant.py) take their amax here, so a sharded run scales as one device does."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = tuple(a for a in mesh.manual_axes if a != "pipe" and sizes[a] > 1)
    return lax.pmax(x, axes) if axes else x


def axis_index(axes: tuple[str, ...]):
    """Linear index of this device along `axes` (major to minor), 0 when `axes` is empty."""
    return lax.axis_index(axes) if axes else 0


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_to_all(x, axes, split_axis, concat_axis):
    """All-to-all over `axes`: `split_axis` is cut into one block per device, block i goes to device
    i, and the blocks received are concatenated along `concat_axis` in device order. Backward: the
    reverse all-to-all (split and concat swapped)."""
    return lax.all_to_all(x, axes, split_axis, concat_axis, tiled=True) if axes else x


def _a2a_fwd(x, axes, split_axis, concat_axis):
    return all_to_all(x, axes, split_axis, concat_axis), None


def _a2a_bwd(axes, split_axis, concat_axis, _, g):
    return (all_to_all(g, axes, concat_axis, split_axis),)


all_to_all.defvjp(_a2a_fwd, _a2a_bwd)


def exchange(x, axes):
    """All-to-all of a small integer array x[n, ...] (n = devices on `axes`): row i goes to device i,
    and row i of the result came from device i. For sizes and offsets; no gradient."""
    return lax.all_to_all(x, axes, 0, 0, tiled=True) if axes else x


def sum_over_batch_shards(tree, axes):
    """Each batch shard's share of a global mean (losses, metrics), summed over the batch axes
    into the global value on every device: one all-reduce for the whole pytree. No gradient
    flows through it (the step sums its metrics after differentiating)."""
    return lax.psum(tree, axes) if axes else tree
