"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021) over the mesh axes
that hold the `experts` logical axis (by default `expert`), and the statistics that MoE routing
needs from the whole batch.

The E experts of a layer are split into ep blocks of E_l = E/ep: device j of the expert axis holds
experts [j E_l, (j+1) E_l). Outside MoE layers the expert axis splits the batch like `data`, so
each device routes its own tokens and sends each copy to the device of its expert:

  capacity   each device fills a fixed [G, E, C, D] buffer (G sequences, C slots per expert and
             sequence, overflow dropped). One all-to-all sends block j of the E axis to device j,
             which computes [ep G, E_l, C, D]; the reverse all-to-all brings the results home
             (GShard's dispatch and combine). Backward: the same two all-to-alls, reversed.
  dropless   the M = G T k token copies are sorted by expert and sent as ragged slices, slice j
             holding the rows of device j's experts (Megablocks / Megatron's all-to-all
             dispatcher). `ragged_all_to_all` has two implementations:
               ragged  `lax.ragged_all_to_all`: exactly the rows, on GPU and TPU (XLA:CPU has no
                       ragged-all-to-all)
               padded  one dense all-to-all of [ep, M, D], every slice padded to M rows (the most
                       one device can send another), then a scatter: runs everywhere, sends ep x
                       the rows of the ragged one.
             Both receive into an [ep M, D] buffer (source i's rows at i M), the static worst case.

The expert weights need no collective of their own: every copy of a token routed to an expert is
processed on the device that holds it, so the expert's gradient is complete over the expert axis
(`zero.plan` sums it over the other batch axes only).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.config import EXPERT_DISPATCH
from jaxsys.parallel.collectives import all_to_all, axis_index, exchange, psum_fwd_copy_bwd
from jaxsys.sharding import Layout

def expert_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes the experts are split over (empty: every device holds all experts)."""
    return layout.compute_axes("experts")


def token_axes(layout: Layout) -> tuple[str, ...]:
    """Mesh axes over which a layer's tokens are split once they are inside the MoE block (after
    `tensor.enter`): the batch and sequence axes. Routing statistics are summed over them."""
    return layout.batch_axes


def global_sum(x, layout: Layout):
    """Sum of a routing statistic (expert counts, dropped copies; no gradient) over every token of
    the (micro-)batch: an all-reduce over the token axes."""
    axes = token_axes(layout)
    return lax.psum(x, axes) if axes else x


def traffic(counts, layout: Layout):
    """[ep, ep] int32: token copies that device i of the expert axis routes to the experts of device
    j (counts[E]: this device's copies per expert), summed over the other token axes (the expert
    groups of other data / fsdp / seq shards). Off the diagonal: what a ragged all-to-all sends."""
    axes = expert_axes(layout)
    ep = layout.size(axes)
    to_device = counts.reshape(ep, -1).sum(-1)
    matrix = lax.all_gather(to_device, axes) if axes else to_device[None]
    others = tuple(a for a in token_axes(layout) if a not in axes)
    return lax.psum(matrix, others) if others else matrix


def sum_over_sequence_shards(x, layout: Layout):
    """A per-token loss summed by each tensor rank over its own T/tp positions (under Megatron SP
    the router runs before the all-gather) is totalled over those ranks; identity backward, since
    each rank's positions are its own (Megatron's `g`)."""
    return psum_fwd_copy_bwd(x, layout.sp_axes)


# ----------------------------------------------------------------------------- capacity


def capacity_dispatch(buffer, axes: tuple[str, ...]):
    """[G, E, C, D] buffers of this device's sequences -> [ep G, E_l, C, D]: the slots of this
    device's experts, from every device of the expert axis (source i's G rows at i G)."""
    return all_to_all(buffer, axes, 1, 0)


def capacity_combine(y, axes: tuple[str, ...]):
    """The inverse of `capacity_dispatch`: [ep G, E_l, C, D] -> [G, E, C, D] back at home."""
    return all_to_all(y, axes, 0, 1)


# ----------------------------------------------------------------------------- dropless


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axes: tuple[str, ...], impl: str = "padded"):
    """`lax.ragged_all_to_all`'s contract (one slice per device of `axes`; `output_offsets` are
    where the *sent* slices land on their receivers), by `impl`: "ragged" calls it, "padded"
    emulates it with one dense all-to-all of slices padded to the most rows a slice can hold."""
    if not axes:
        raise ValueError("ragged_all_to_all needs mesh axes")
    if impl == "ragged":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axes)
    if impl != "padded":
        raise ValueError(f"expert dispatch {impl!r}: choose one of {EXPERT_DISPATCH}")
    chunk = min(operand.shape[0], output.shape[0])
    rows = jnp.arange(chunk)
    valid = rows[None, :] < send_sizes[:, None]  # [ep, chunk]
    source = jnp.clip(input_offsets[:, None] + rows[None, :], 0, operand.shape[0] - 1)
    mask = valid.reshape(valid.shape + (1,) * (operand.ndim - 1))
    slices = jnp.where(mask, operand[source], jnp.zeros((), operand.dtype))  # [ep, chunk, ...]
    received = all_to_all(slices, axes, 0, 0)  # [ep, chunk, ...]: row i from device i
    landing = exchange(output_offsets, axes)  # where device i's slice goes in this output
    keep = rows[None, :] < recv_sizes[:, None]
    target = jnp.where(keep, landing[:, None] + rows[None, :], output.shape[0])  # past the end: dropped
    return output.at[target].set(received, mode="drop")


class RaggedRoute(NamedTuple):
    """Sizes and offsets of one dropless dispatch, [ep] each, from the sender's side: what the
    return trip reverses."""

    input_offsets: jax.Array  # where slice j starts in the sorted rows
    send_sizes: jax.Array  # rows of device j's experts
    output_offsets: jax.Array  # where slice j lands on device j (this device's index x M)
    recv_sizes: jax.Array  # rows received from device i


def dropless_dispatch(rows, counts, axes: tuple[str, ...], impl: str = "padded"):
    """rows[M, D] sorted by (global) expert id, counts[E] rows per expert ->
    (received [ep M, D]: device i's rows for this device's experts at i M, sorted by expert;
     received_counts [ep, E_l]: how many of them each local expert has from device i;
     route: what `dropless_combine` needs)."""
    ep = lax.axis_size(axes)
    m = rows.shape[0]
    per_device = counts.reshape(ep, -1)  # [ep, E_l]
    send_sizes = per_device.sum(1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    received_counts = exchange(per_device, axes)  # [ep, E_l] from each source
    recv_sizes = received_counts.sum(1)
    output_offsets = jnp.full((ep,), axis_index(axes) * m, jnp.int32)
    output = jnp.zeros((ep * m,) + rows.shape[1:], rows.dtype)
    route = RaggedRoute(input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32), output_offsets,
                        recv_sizes.astype(jnp.int32))
    received = ragged_all_to_all(rows, output, *route, axes, impl)
    return received, received_counts, route


def dropless_combine(results, route: RaggedRoute, m: int, axes: tuple[str, ...], impl: str = "padded"):
    """The return trip: results[ep M, D] (laid out as `dropless_dispatch` received them) -> [M, D]
    in this device's sorted row order."""
    ep = lax.axis_size(axes)
    home_offsets = exchange(route.input_offsets, axes)  # where device i's slice for us came from
    output = jnp.zeros((m,) + results.shape[1:], results.dtype)
    starts = jnp.arange(ep, dtype=jnp.int32) * m
    return ragged_all_to_all(results, output, starts, route.recv_sizes, home_offsets,
                             route.send_sizes, axes, impl)
