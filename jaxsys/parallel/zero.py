"""Data parallelism and ZeRO stages 0-2 (Rajbhandari et al. 2020) over the `data` axis.

Gradients computed per shard are partial sums over the batch. Each leaf's gradient is summed over
the batch-splitting mesh axes that it is replicated on (the FSDP axes were already reduce-scattered
by the backward of the FSDP gather), and over `tensor` for replicated weights under sequence
parallelism, where each rank saw only its slice of the sequence. Then, over `data`:

    stage 0: all-reduce the gradient; every rank updates the whole leaf (plain DP).
    stage 1: all-reduce the gradient; each rank updates its 1/N slice with its 1/N of the optimizer
             state, then the slices are all-gathered.
    stage 2: reduce-scatter the gradient instead (the full gradient never exists after the
             backward); update and all-gather as in stage 1. Same bytes as an all-reduce.

A leaf is sliced along its first dimension whose local size divides by the data size; a leaf with
no such dimension stays replicated (its optimizer state too) and is reported by `plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsys.parallel import fsdp
from jaxsys.parallel.collectives import axis_index
from jaxsys.sharding import Layout, spec_axes

ZERO_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """What happens to one parameter's gradient and optimizer state."""

    sum_axes: tuple[str, ...]  # gradient summed over these (all-reduce, or RS on `data` at stage 2)
    zero_dim: int | None  # dimension sliced over `data` for the update (stage >= 1)
    stage: int

    @property
    def sliced(self) -> bool:
        return self.zero_dim is not None


def plan(
    layout: Layout, logical: Sequence[str | None], shape: Sequence[int], stage: int, partial: Sequence[str] = ()
) -> LeafPlan:
    """`partial`: logical axes the leaf's gradient is a partial sum over (`ParamSpec.partial`, a LoRA
    factor's contracted-away axes): the gradient is also summed over their compute mesh axes."""
    param_axes = {a for n in logical for a in layout.param_axes(n)}
    gathered = {a for n in logical for a in fsdp.gathered_axes(layout, n)}
    sum_axes = [a for a in layout.batch_axes if a not in gathered and a not in param_axes]
    if layout.sequence_parallel:
        sum_axes += [a for a in layout.tensor_axes if a not in param_axes and a not in sum_axes]
    sum_axes += [a for n in partial for a in layout.compute_axes(n) if a not in param_axes and a not in sum_axes]
    if layout.mesh_sizes.get("pipe", 1) > 1 and "pipe" not in param_axes:
        sum_axes.append("pipe")  # used by some pipeline stages only (embedding, final norm, output)
    zero_dim = None
    data = layout.mesh_sizes[ZERO_AXIS]
    if stage >= 1 and data > 1 and ZERO_AXIS in sum_axes:
        local = layout.local_shape(shape, logical)
        zero_dim = next((i for i, d in enumerate(local) if d % data == 0), None)
    return LeafPlan(tuple(sum_axes), zero_dim, stage)


def grad_spec(layout: Layout, spec, stage: int) -> P:
    """PartitionSpec of a parameter's gradient as the update sees it (its optimizer-state spec):
    `state_spec` of the parameter's layout spec and its ZeRO plan. `spec`: its ParamSpec."""
    leaf = plan(layout, spec.axes, spec.shape, stage, spec.partial)
    return state_spec(layout.param_spec(spec.axes), leaf, len(spec.shape))


def state_spec(param_spec: P, leaf: LeafPlan, ndim: int) -> P:
    """PartitionSpec of the optimizer state of a leaf: the parameter's, plus `data` (minor) on the
    sliced dimension."""
    if not leaf.sliced:
        return param_spec
    entries = list(param_spec) + [None] * (ndim - len(param_spec))
    current = entries[leaf.zero_dim]
    current = () if current is None else (current,) if isinstance(current, str) else tuple(current)
    entries[leaf.zero_dim] = current + (ZERO_AXIS,) if current else ZERO_AXIS
    return P(*entries)


def reduce_gradient(g, leaf: LeafPlan):
    """Sum a local gradient over the batch shards. At stage 2 the `data` part is a reduce-scatter
    that leaves this rank's slice; otherwise an all-reduce."""
    if leaf.stage == 2 and leaf.sliced:
        rest = tuple(a for a in leaf.sum_axes if a != ZERO_AXIS)
        g = lax.psum(g, rest) if rest else g
        return lax.psum_scatter(g, ZERO_AXIS, scatter_dimension=leaf.zero_dim, tiled=True)
    return lax.psum(g, leaf.sum_axes) if leaf.sum_axes else g


def take_slice(x, leaf: LeafPlan):
    """This rank's 1/N slice (no communication) of a replicated leaf, for the update."""
    if not leaf.sliced:
        return x
    size = x.shape[leaf.zero_dim] // lax.axis_size(ZERO_AXIS)
    return lax.dynamic_slice_in_dim(x, axis_index((ZERO_AXIS,)) * size, size, axis=leaf.zero_dim)


def gather_slices(x, leaf: LeafPlan):
    """All-gather the updated slices back into the replicated leaf."""
    if not leaf.sliced:
        return x
    return lax.all_gather(x, ZERO_AXIS, axis=leaf.zero_dim, tiled=True)


def global_norm(grads, specs, layout: Layout, skip: tuple[str, ...] = ()):
    """L2 norm of the whole gradient, from sharded leaves: each leaf's local sum of squares is
    divided by the number of ranks holding the same block, then one scalar all-reduce over the mesh.
    `specs` are the PartitionSpecs of the leaves as held (optimizer-state specs for sliced leaves).
    `skip`: mesh axes whose ranks hold different gradients (DiLoCo's islands on `data`): the norm
    of each rank's own."""
    active = tuple(a for a, s in layout.mesh_sizes.items() if s > 1 and a not in skip)
    total = jnp.zeros((), jnp.float32)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        replicas = layout.size([a for a in active if a not in spec_axes(spec)])
        total += jnp.sum(jnp.square(g.astype(jnp.float32))) / replicas
    return jnp.sqrt(lax.psum(total, active) if active else total)
