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

The MoE layer (models/moe.py) asks this module twice per layer, dispatch -> local experts -> combine:

    sent = expert.dispatch(x, Routed(...), moe, layout, impl)  # the rows this device's experts compute
    out = SwiGLU of the local experts on sent.rows               # models/moe.py
    y = expert.combine(out, sent.plan, gates)                    # [B, T, D], each token's gated sum

`dispatch` takes the model's routing decisions (each token copy's expert; in the capacity path also
its slot, from `moe.admit`), builds the capacity buffers or sorts the copies by expert, and sends
them to their experts' devices. It also computes every routing statistic of the layer
(`routing_statistics`: the global loads, dropped copies, co-routing pairs, device traffic and the
balance / z-loss sums), since they need the same per-expert counts and all-reduces over the batch;
the model keeps the router, the capacity admission and the experts' FFN. `combine` brings the
results home and returns each token's gate-weighted sum of its copies.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.config import EXPERT_DISPATCH
from jaxsys.parallel.collectives import all_to_all, axis_index, exchange, psum_fwd_copy_bwd
from jaxsys.sharding import Layout

ROUTING_STATISTICS = ("load", "dropped", "pairs", "traffic")  # per MoE layer, integer, global


class Routed(NamedTuple):
    """The router's decisions for this device's tokens: what the model hands `dispatch`."""

    experts: jax.Array  # [B, T, k] int32: each copy's expert, at every position of the MoE block
    previous: jax.Array  # [B, T, k] int32: the previous MoE layer's experts (-1: none), for `pairs`
    logits: jax.Array  # [B, T', E] fp32 router logits of this rank's positions (T' = T/tp under SP)
    probs: jax.Array  # [B, T', E] router probabilities of this rank's positions (balance loss)
    slot: jax.Array | None = None  # [B, T, k] capacity path: each copy's slot in [0, E C), E C: dropped
    capacity: int = 0  # C, an expert's slots per sequence; 0: the dropless path


class Dispatched(NamedTuple):
    """What `dispatch` returns: the rows this device's experts compute and what `combine` needs."""

    rows: jax.Array  # capacity: [ep G, E_l, C, D] slots; dropless: [R, D] sorted by local expert
    group_sizes: jax.Array | None  # dropless: [E_l] rows of each local expert; None: capacity
    plan: NamedTuple  # _CapacityPlan or _DroplessPlan: the way home
    stats: dict  # the layer's routing statistics (`routing_statistics`)


class _CapacityPlan(NamedTuple):
    slot: jax.Array  # [B, T, k]
    axes: tuple[str, ...]
    dtype: jnp.dtype


class _DroplessPlan(NamedTuple):
    order: jax.Array  # [M]: the copies sorted by expert
    regroup: jax.Array | None  # with expert parallelism: the received rows sorted by local expert
    route: RaggedRoute | None  # with expert parallelism: sizes and offsets of the ragged all-to-all
    axes: tuple[str, ...]
    impl: str
    dtype: jnp.dtype


def dispatch(x, routed: Routed, moe, layout: Layout, impl: str = "padded") -> Dispatched:
    """x[B, T, D] (every position of the MoE block, on each tensor rank) and the routing decisions ->
    the rows of this device's experts, the plan of their way home and the layer's routing statistics.
    `moe`: config.model.moe; `impl`: the dropless all-to-all (`ragged_all_to_all`)."""
    chex.assert_rank(x, 3, custom_message="expert.dispatch takes x[B, T, D]")
    chex.assert_shape(routed.experts, x.shape[:2] + (None,), custom_message="expert.dispatch takes experts[B, T, k]")
    chex.assert_type(routed.experts, int, custom_message="expert.dispatch takes integer expert ids")
    counts = expert_counts(routed.experts, moe.experts)
    stats = routing_statistics(routed, counts, moe, layout)
    axes = expert_axes(layout)
    if routed.slot is not None:
        return _dispatch_capacity(x, routed.slot, moe.experts, routed.capacity, axes, stats)
    return _dispatch_dropless(x, routed.experts, counts, axes, impl, stats)


def combine(out, plan, gates):
    """The local experts' results `out` (laid out as `Dispatched.rows`) -> y[B, T, D] at home, each
    token's copies summed with their gates[B, T, k] (fp32), in x's dtype."""
    chex.assert_rank(gates, 3, custom_message="expert.combine takes gates[B, T, k]")
    if isinstance(plan, _CapacityPlan):
        y_copies = _combine_capacity(out, plan)
    else:
        y_copies = _combine_dropless(out, plan, gates.shape)
    return jnp.einsum("btk,btkd->btd", gates, y_copies.astype(jnp.float32)).astype(plan.dtype)


def _inverse(permutation):
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.shape[0], dtype=permutation.dtype))


# ----------------------------------------------------------------------------- routing statistics


def expert_counts(experts, n_experts: int):
    """[E] int32: token copies routed to each expert."""
    return jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def co_routing(previous, experts, n_experts: int):
    """[E, E] int32: pairs[i, j] counts, over tokens, the copies routed to expert i by the previous MoE
    layer and to expert j by this one (k x k pairs per token; `previous` < 0: no previous layer)."""
    e = n_experts
    index = previous[..., :, None] * e + experts[..., None, :]
    index = jnp.where((previous >= 0)[..., :, None], index, e * e)  # past the end: dropped
    return jnp.zeros((e * e,), jnp.int32).at[index.reshape(-1)].add(1, mode="drop").reshape(e, e)


def balance_loss_sums(logits, probs, load, moe):
    """(a E sum_t sum_e f_e P_te, b sum_t logsumexp(z_t)^2) over this rank's positions, with the
    global fractions f = load / sum(load); the trainer divides by the batch's token count."""
    f = load.astype(jnp.float32) / jnp.maximum(jnp.sum(load), 1)
    aux = moe.aux_loss_weight * moe.experts * jnp.sum(probs * f)
    z = moe.z_loss_weight * jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return aux, z


def routing_statistics(routed: Routed, counts, moe, layout: Layout) -> dict:
    """The layer's statistics from this device's routing decisions and counts[E]: the loss sums
    `aux_loss` and `z_loss` of the whole batch's positions held by this device's tensor group, and
    the global int32 `load` [E], `dropped` [], `pairs` [E, E] and `traffic` [ep, ep] (`traffic`)."""
    load = global_sum(counts, layout)
    aux, z = balance_loss_sums(routed.logits, routed.probs, load, moe)
    if routed.slot is None:
        dropped = jnp.zeros((), jnp.int32)
    else:
        dropped = global_sum(jnp.sum(routed.slot == moe.experts * routed.capacity, dtype=jnp.int32), layout)
    return {
        "aux_loss": sum_over_sequence_shards(aux, layout),
        "z_loss": sum_over_sequence_shards(z, layout),
        "load": load,
        "dropped": dropped,
        "pairs": global_sum(co_routing(routed.previous, routed.experts, moe.experts), layout),
        "traffic": traffic(counts, layout),
    }


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


def _dispatch_capacity(x, slot, n_experts: int, c: int, axes: tuple[str, ...], stats: dict) -> Dispatched:
    """Each copy into its slot of this device's [B, E, C, D] buffers (empty slots zero), then
    `capacity_dispatch`."""
    b, t, d = x.shape
    e = n_experts
    batch_index = jnp.arange(b)[:, None, None]
    position = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :, None], slot.shape)
    filler = jnp.full((b, e * c), t, jnp.int32).at[batch_index, slot].set(position, mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((b, 1, d), x.dtype)], axis=1)  # row T: an empty slot
    buffers = jax.vmap(lambda xb, ib: xb[ib])(padded, filler).reshape(b, e, c, d)
    return Dispatched(capacity_dispatch(buffers, axes), None, _CapacityPlan(slot, axes, x.dtype), stats)


def _combine_capacity(out, plan: _CapacityPlan):
    """`capacity_combine`, then each copy's result from its slot: [B, T, k, D] (dropped copies 0)."""
    b, t = plan.slot.shape[:2]
    d = out.shape[-1]
    out = capacity_combine(out, plan.axes).reshape(b, -1, d)
    out = jnp.concatenate([out, jnp.zeros((b, 1, d), out.dtype)], axis=1)  # row E C: dropped copies
    return jax.vmap(lambda ob, sb: ob[sb])(out, plan.slot.reshape(b, -1)).reshape(b, t, -1, d)


def capacity_dispatch(buffer, axes: tuple[str, ...]):
    """[G, E, C, D] buffers of this device's sequences -> [ep G, E_l, C, D]: the slots of this
    device's experts, from every device of the expert axis (source i's G rows at i G)."""
    chex.assert_rank(buffer, 4, custom_message="expert.capacity_dispatch takes buffer[G, E, C, D]")
    return all_to_all(buffer, axes, 1, 0)


def capacity_combine(y, axes: tuple[str, ...]):
    """The inverse of `capacity_dispatch`: [ep G, E_l, C, D] -> [G, E, C, D] back at home."""
    chex.assert_rank(y, 4, custom_message="expert.capacity_combine takes y[ep G, E_l, C, D]")
    return all_to_all(y, axes, 0, 1)


# ----------------------------------------------------------------------------- dropless


def _dispatch_dropless(x, experts, counts, axes: tuple[str, ...], impl: str, stats: dict) -> Dispatched:
    """The M = B T k copies sorted by expert; with expert parallelism `dropless_dispatch`, then every
    source's rows regrouped by local expert (rows past a source's count are padding: they sort last
    and come out of the grouped matmul zero)."""
    b, t, d = x.shape
    k, n = experts.shape[-1], experts.size
    ids = experts.reshape(-1)  # copy (b, t, r) at (b T + t) k + r
    order = jnp.argsort(ids, stable=True)
    rows = x.reshape(b * t, d)[order // k]  # [M, D] sorted by expert
    if not axes:
        return Dispatched(rows, counts, _DroplessPlan(order, None, None, axes, impl, x.dtype), stats)
    received, received_counts, route = dropless_dispatch(rows, counts, axes, impl)
    bounds = jnp.cumsum(received_counts, axis=1)  # [ep, E_l]
    local = jax.vmap(lambda bd: jnp.searchsorted(bd, jnp.arange(n), side="right"))(bounds)
    regroup = jnp.argsort(local.reshape(-1), stable=True)
    return Dispatched(
        received[regroup],
        jnp.sum(received_counts, axis=0),
        _DroplessPlan(order, regroup, route, axes, impl, x.dtype),
        stats,
    )


def _combine_dropless(out, plan: _DroplessPlan, gates_shape):
    """Undo the regrouping, `dropless_combine`, unsort: [B, T, k, D]."""
    b, t, k = gates_shape
    if plan.route is not None:
        out = out[_inverse(plan.regroup)]
        out = dropless_combine(out, plan.route, plan.order.shape[0], plan.axes, plan.impl)
    return out[_inverse(plan.order)].reshape(b, t, k, -1)


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes: tuple[str, ...], impl: str = "padded"
):
    """`lax.ragged_all_to_all`'s contract (one slice per device of `axes`; `output_offsets` are
    where the *sent* slices land on their receivers), by `impl`: "ragged" calls it, "padded"
    emulates it with one dense all-to-all of slices padded to the most rows a slice can hold."""
    if not axes:
        raise ValueError("ragged_all_to_all needs mesh axes")
    if impl == "ragged":
        return lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
        )
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
    chex.assert_rank([rows, counts], [2, 1], custom_message="expert.dropless_dispatch takes rows[M, D], counts[E]")
    chex.assert_type(counts, int, custom_message="expert.dropless_dispatch takes integer counts")
    ep = lax.axis_size(axes)
    m = rows.shape[0]
    per_device = counts.reshape(ep, -1)  # [ep, E_l]
    send_sizes = per_device.sum(1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    received_counts = exchange(per_device, axes)  # [ep, E_l] from each source
    recv_sizes = received_counts.sum(1)
    output_offsets = jnp.full((ep,), axis_index(axes) * m, jnp.int32)
    output = jnp.zeros((ep * m,) + rows.shape[1:], rows.dtype)
    route = RaggedRoute(
        input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32), output_offsets, recv_sizes.astype(jnp.int32)
    )
    received = ragged_all_to_all(rows, output, *route, axes, impl)
    return received, received_counts, route


def dropless_combine(results, route: RaggedRoute, m: int, axes: tuple[str, ...], impl: str = "padded"):
    """The return trip: results[ep M, D] (laid out as `dropless_dispatch` received them) -> [M, D]
    in this device's sorted row order."""
    chex.assert_rank(results, 2, custom_message="expert.dropless_combine takes results[ep M, D]")
    ep = lax.axis_size(axes)
    home_offsets = exchange(route.input_offsets, axes)  # where device i's slice for us came from
    output = jnp.zeros((m,) + results.shape[1:], results.dtype)
    starts = jnp.arange(ep, dtype=jnp.int32) * m
    return ragged_all_to_all(results, output, starts, route.recv_sizes, home_offsets, route.send_sizes, axes, impl)
