"""Host offloading: training state in host memory (memory kind `pinned_host`), moved to the device
around its use (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity without NVMe, Rajbhandari et al. 2021;
Deep Optimizer States, Maurya et al. 2024). docs/offload.md says how the options fit together.

    optimizer   the optimizer state at rest on the host. `device` update: each step streams it in,
                updates on the device and streams it out (2 x its bytes over the host link).
                `host` update: the update itself runs on the host (`compute_on("device_host")`),
                as ZeRO-Offload runs Adam on the CPU: gradients go down, parameters come up.
                `optimizer_fraction` offloads only part of the state, leaf by leaf (`choose`).
    params      parameters at rest on the host; each layer's (shard of its) weights moves to the
                device just before its FSDP all-gather (`fetch`), and the update writes them back.
    activations a remat policy that saves named residuals to the host instead of keeping them in
                HBM or recomputing them (`remat_policy`).

Inside the train step's shard_map the moves are `jax.device_put(x, jax.memory.Space.*)`. On TPU
and GPU they lower to XLA's host-offload annotations; XLA:CPU has one memory and lowers them to
nothing, so on CPU the numerics and the shardings' memory kinds are what can be checked, and
the device bytes come from the TPU compiler (`python -m jaxsys.analyze --target ...`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental.compute_on import compute_on

HOST = "pinned_host"
DEVICE = "device"


class OffloadError(ValueError):
    """An offload option the backend cannot run."""


def require_host_memory(devices, what: str) -> None:
    """Raise (naming `what`) unless the devices have a `pinned_host` memory space."""
    device = devices[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - backends without memories raise various errors
        kinds = set()
    if HOST not in kinds:
        raise OffloadError(
            f"{what} needs host memory kinds, but {device.platform} devices have "
            f"{sorted(kinds) or 'none'}: turn the offload option off (TPU, GPU and CPU "
            "devices have pinned_host)"
        )


def _move(space, back):
    """device_put to `space` whose gradient moves back to `back`: JAX's own transpose of a move
    to a memory space leaves the cotangent where it arrived, which then has the wrong memory type."""

    @jax.custom_vjp
    def move(x):
        return jax.device_put(x, space)

    move.defvjp(lambda x: (move(x), None), lambda _, ct: (jax.device_put(ct, back),))
    return move


_in = _move(jax.memory.Space.Device, jax.memory.Space.Host)
_out = _move(jax.memory.Space.Host, jax.memory.Space.Device)


def _on_host(x) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_device(tree):
    """Every host leaf into device memory (inside jit / shard_map); gradients go back to the host.
    Leaves already on the device are left alone."""
    return jax.tree.map(lambda x: _in(x) if _on_host(x) else x, tree)


def to_host(tree):
    """Every device leaf into host memory (inside jit / shard_map); gradients come back to the
    device. Leaves already on the host are left alone."""
    return jax.tree.map(lambda x: x if _on_host(x) else _out(x), tree)


def place(tree, kinds):
    """Each leaf of `tree` into the memory its entry of `kinds` (same structure) names."""
    return jax.tree.map(lambda x, k: to_host(x) if k == HOST else to_device(x), tree, kinds)


def fetch(weights, on_host: bool):
    """Parameters as read by a layer: moved in from the host when they live there. The gradient
    flows back the same way (the transpose of the move), so it reaches the host too."""
    return to_device(weights) if on_host else weights


# ----------------------------------------------------------------------------- which state leaves


def choose(sizes: list[int], fraction: float) -> list[bool]:
    """Which leaves (by their byte sizes) to offload so that at least `fraction` of the bytes are on
    the host: largest first. Every offloaded leaf costs a transfer each step, and a transfer's fixed
    cost (DMA set-up, ~10 us) is amortised over its bytes, so the fewest, largest leaves carry a
    given share at the lowest cost (`transfer_seconds`); the device keeps the many small leaves."""
    total = sum(sizes)
    target = fraction * total
    chosen = [False] * len(sizes)
    moved = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if moved >= target or fraction <= 0:
            break
        chosen[i] = True
        moved += sizes[i]
    return chosen


TRANSFER_LATENCY_S = 10e-6  # fixed cost of one host<->device DMA (order of magnitude)


def transfer_seconds(leaf_bytes: list[int], link_bytes_per_s: float) -> float:
    """Time to move these leaves once over the host link."""
    return sum(TRANSFER_LATENCY_S + b / link_bytes_per_s for b in leaf_bytes)


def hidden_fraction(compute_s: float, state_bytes: float, link_bytes_per_s: float) -> float:
    """Deep Optimizer States' balance point: the largest share of the optimizer state whose round
    trip (in and out, 2 x bytes) over the host link fits under the step's compute, so that
    streaming it costs no step time when overlapped."""
    if state_bytes <= 0:
        return 1.0
    return min(1.0, compute_s * link_bytes_per_s / (2.0 * state_bytes))


def state_kinds(optimizer: optax.GradientTransformation, abstract_params, param_bytes_tree, fraction: float):
    """Memory kind of every optimizer-state leaf: the param-shaped leaves (moments) of the params
    `choose` picks go to HOST, the rest (step counts, non-param state) stay on DEVICE. The choice is
    made per parameter from the bytes of its state (`param_bytes_tree`: bytes of one state leaf of
    that parameter, per device)."""
    leaves, treedef = jax.tree.flatten(param_bytes_tree)
    picked = jax.tree.unflatten(treedef, choose(leaves, fraction))
    opt_shapes = jax.eval_shape(optimizer.init, abstract_params)
    return optax.tree_map_params(
        optimizer, lambda _, host: HOST if host else DEVICE, opt_shapes, picked, transform_non_params=lambda _: DEVICE
    )


# ----------------------------------------------------------------------------- the update


def _empty(x):
    return jnp.zeros((0,) * x.ndim, x.dtype)


def split_update(
    optimizer: optax.GradientTransformation,
    grads,
    opt_state,
    params,
    opt_kinds,
    param_kinds,
    on_host_update: bool,
    leafwise: bool = False,
    grad_scale=None,
    tpu_tiles: bool = False,
):
    """One optimizer update of local shards where some optimizer-state leaves (`opt_kinds`) live on
    the host. Returns (new params, new optimizer state), each leaf in the memory its kind names
    (params by `param_kinds`).

    `on_host_update=False`: the host leaves are streamed in, updated on the device, streamed out.
    `on_host_update=True`: the update of the parameters whose state lives on the host runs on the
    host; that of the rest on the device. The two halves are the same optax update applied to the
    two halves of the tree: the other half's leaves are replaced by zero-size arrays, so the tree
    structure (and a checkpoint's) is that of the run without offload. This needs an update that
    treats leaves independently (AdamW does); step counts are taken from the device half.

    `leafwise` (the optimizer treats leaves independently, as AdamW does; counts aside): the device
    update streams the state layer by layer (`streamed_update`), so the device holds one layer's
    moments (and a block of the embeddings') at a time. Without it (GaLore) the whole tree is
    streamed in and out around one update, as XLA schedules it.

    `grad_scale` (a scalar or None): the gradients are multiplied by it first (gradient clipping).
    `tpu_tiles`: the program is for a TPU (`_block_rows`)."""
    if not on_host_update and leafwise:
        return streamed_update(optimizer, grads, opt_state, params, opt_kinds, param_kinds, grad_scale, tpu_tiles)
    if grad_scale is not None:
        grads = jax.tree.map(lambda g: g * grad_scale.astype(g.dtype), grads)
    if not on_host_update:
        updates, new_state = optimizer.update(grads, to_device(opt_state), to_device(params))
        new_params = optax.apply_updates(to_device(params), updates)
        return place(new_params, param_kinds), place(new_state, opt_kinds)

    on_host = _param_mask(optimizer, params, opt_kinds)
    half = lambda tree, host: jax.tree.map(lambda x, h: x if h == host else _empty(x), tree, on_host)
    state_half = lambda host: _state_half(optimizer, opt_state, on_host, host)

    d_updates, d_state = optimizer.update(
        half(grads, False), to_device(state_half(False)), to_device(half(params, False))
    )
    d_params = optax.apply_updates(to_device(half(params, False)), d_updates)

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def host_update(g, s, p):
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    h_params, h_state = host_update(to_host(half(grads, True)), to_host(state_half(True)), to_host(half(params, True)))
    new_params = jax.tree.map(lambda h, d, k: h if k else d, h_params, d_params, on_host)
    new_state = _merge_state(optimizer, d_state, h_state, opt_kinds)
    return place(new_params, param_kinds), place(new_state, opt_kinds)


def _stacked(path) -> bool:
    """A leaf of the stack of layers (leading dimension: the layers): the `layers` subtree."""
    return bool(path) and getattr(path[0], "key", None) == "layers"


def _state_owners(optimizer, params, opt_state) -> list:
    """Per leaf of the flattened optimizer state: the index of the parameter (in the flattened
    params) it is a copy of (AdamW's moments), or None (step counts, other non-param state)."""
    flat_params, treedef = jax.tree.flatten(params)
    index_tree = jax.tree.unflatten(treedef, list(range(len(flat_params))))
    owners = optax.tree_map_params(optimizer, lambda _, i: i, opt_state, index_tree, transform_non_params=lambda _: -1)
    return [None if o < 0 else o for o in jax.tree.leaves(owners)]


def _block_rows(shape, blocks: int, tpu_tiles: bool) -> int:
    """Rows per block when a leaf of `shape` is updated in `blocks` blocks of its leading
    dimension, or 0 where it cannot be: the blocks must divide it, and the TPU tiles the two minor
    dimensions (8, 128) and copies only whole tiles of its lane dimension, which its layout may put
    on the leading dimension of a 2-D leaf whose last dimension is short ("Slicing lane dimension
    is only supported when the lane slice size is a multiple of LaneCount"). Other backends take
    any block that divides the leading dimension."""
    if not shape or shape[0] % blocks:
        return 0
    rows = shape[0] // blocks
    if (
        not tpu_tiles
        or rows % 128 == 0
        or len(shape) >= 3
        or (len(shape) == 2 and rows % 8 == 0 and shape[1] % 128 == 0)
    ):
        return rows
    return 0


def streamed_update(
    optimizer, grads, opt_state, params, opt_kinds, param_kinds, grad_scale=None, tpu_tiles: bool = False
):
    """The device update of a leafwise optimizer (AdamW), streamed layer by layer as ZeRO-Offload
    and Deep Optimizer States stream it. A loop over the stack of layers (the `layers` subtree,
    leading dimension the layers) updates one layer's slice of every stacked leaf per iteration:
    only that layer's optimizer state moves in from the host, is updated on the device and moves
    back out, and the parameters are updated in place (the loop carries the stacks and writes each
    layer back). The other leaves (embeddings, final norm) go through the same loop a block of
    rows at a time (iteration l updates rows [l n/L, (l+1) n/L) of a leaf of n rows, L layers);
    a leaf that cannot be cut so (`_block_rows`) is updated whole, with one of the first layers,
    before the loop. (On XLA:CPU such unrolled pieces were seen to round AdamW's first moment
    differently from the whole-tree update in the last bit; every leaf in the loop gave equal
    numbers in every layout tested.) Each stack of another length (rare) gets a loop of its own.

    Streamed this way the device holds the parameters, gradients and one iteration's share of
    the optimizer state; a whole-tree update lets XLA move every leaf's state in at once and
    early (it prefetches the copies during the forward), which on the TPU compiler cost 5-6
    bytes/param more (experiments/offload_capacity).

    Each piece is the optimizer's own update applied to a tree in which every other leaf is
    zero-size, so the arithmetic is that of the whole-tree update; the non-param state (step
    counts) comes from one update of the all-empty tree, so it advances once. Every piece holds
    several leaves on purpose: XLA rewrites a division by a scalar with one user (Adam's bias
    correction, when one leaf is updated alone) into a multiplication by its reciprocal, which
    rounds differently from the whole-tree update. The gradient clipping's `grad_scale` is
    applied to each piece's gradients, so no scaled copy of the whole gradient tree is made."""
    flat_p, ptree = jax.tree.flatten(params)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    flat_g = ptree.flatten_up_to(grads)  # type: ignore[attr-defined]  # missing from the stubs
    flat_pk = ptree.flatten_up_to(param_kinds)  # type: ignore[attr-defined]  # missing from the stubs
    flat_s, stree = jax.tree.flatten(opt_state)
    flat_sk = jax.tree.leaves(opt_kinds)
    owners = _state_owners(optimizer, params, opt_state)
    mine = [[k for k, o in enumerate(owners) if o == i] for i in range(len(flat_p))]

    def home(x, kind):
        return to_host(x) if kind == HOST else to_device(x)

    def update(pieces):
        """The optimizer's update of the leaves in `pieces` ({i: (param, grad, its state leaves)},
        on the device) alone: {i: (new param, its new state leaves)}, and the new flat state."""
        ps = [pieces[j][0] if j in pieces else _empty(x) for j, x in enumerate(flat_p)]
        gs = [pieces[j][1] if j in pieces else _empty(x) for j, x in enumerate(flat_g)]
        states = {k: v for j, (_, _, vs) in pieces.items() for k, v in zip(mine[j], vs)}
        ss = [
            states[k] if o in pieces else (x if o is None else _empty(x))
            for k, (o, x) in enumerate(zip(owners, flat_s))
        ]
        updates, new = optimizer.update(ptree.unflatten(gs), stree.unflatten(ss), ptree.unflatten(ps))
        new_p = ptree.flatten_up_to(optax.apply_updates(ptree.unflatten(ps), updates))
        new = jax.tree.leaves(new)
        return {j: (new_p[j], [new[k] for k in mine[j]]) for j in pieces}, new

    params_now = [home(p, k) for p, k in zip(flat_p, flat_pk)]
    states_now = [[flat_s[k] for k in mine[i]] for i in range(len(flat_p))]
    kinds = [[flat_sk[k] for k in mine[i]] for i in range(len(flat_p))]
    # the non-param state (step counts) of one update: every parameter's leaves zero-size
    _, new_flat_s = update({})

    stacks: dict[int, list[int]] = {}  # number of layers -> the stacked leaves with that many
    rest = []
    for i, (path, p) in enumerate(zip(paths, flat_p)):
        (stacks.setdefault(p.shape[0], []) if _stacked(path) and p.ndim >= 1 and p.shape[0] > 0 else rest).append(i)

    def layer(l, stacked, chunked, whole, carry):
        """Update layer `l` of the `stacked` leaves, row block `l` of the `chunked` leaves ({leaf:
        rows per block}) and the `whole` leaves. carry: (params, state leaves), dicts by leaf index
        holding at least those leaves; returns it updated."""
        p_all, s_all = dict(carry[0]), dict(carry[1])
        scaled = lambda g: g if grad_scale is None else g * grad_scale.astype(g.dtype)

        def take(i, x):
            if i in chunked:
                return lax.dynamic_slice_in_dim(x, l * chunked[i], chunked[i], axis=0)
            return lax.dynamic_index_in_dim(x, l, keepdims=False) if i in stacked else x

        def put(i, x, v):
            if i in chunked:
                return lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), l * chunked[i], axis=0)
            return lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), l, 0) if i in stacked else v

        pieces = {
            i: (take(i, p_all[i]), scaled(take(i, flat_g[i])), [to_device(take(i, s)) for s in s_all[i]])
            for i in [*stacked, *chunked, *whole]
        }
        done, _ = update(pieces)
        for i, (p, vs) in done.items():
            p_all[i] = put(i, p_all[i], p)
            s_all[i] = [put(i, s, home(v, k)) for s, v, k in zip(s_all[i], vs, kinds[i])]
        return p_all, s_all

    carry = (dict(enumerate(params_now)), dict(enumerate(states_now)))
    if not stacks:
        carry = layer(0, [], {}, rest, carry)
    for n_layers, stacked in sorted(stacks.items(), key=lambda kv: -len(kv[1])):
        # the other leaves go with the layers a block of rows at a time where their rows divide
        # evenly; the rest ride along with the first layers, one per layer (the last takes the surplus)
        chunked = {i: _block_rows(flat_p[i].shape, n_layers, tpu_tiles) for i in rest}
        chunked = {i: rows for i, rows in chunked.items() if rows}
        rest = [i for i in rest if i not in chunked]
        first = min(len(rest), n_layers)
        for l in range(first):
            carry = layer(l, stacked, chunked, rest[l : l + 1] if l < first - 1 else rest[l:], carry)
        rest = []
        if first < n_layers:
            members = [*stacked, *chunked]
            sub = ({i: carry[0][i] for i in members}, {i: carry[1][i] for i in members})
            sub = lax.fori_loop(
                first, n_layers, lambda l, c, stacked=stacked, chunked=chunked: layer(l, stacked, chunked, [], c), sub
            )
            carry = ({**carry[0], **sub[0]}, {**carry[1], **sub[1]})

    carry = ([carry[0][i] for i in range(len(flat_p))], [carry[1][i] for i in range(len(flat_p))])
    new_flat_p = [home(p, k) for p, k in zip(carry[0], flat_pk)]
    new_flat_s = list(new_flat_s)
    for i, vs in enumerate(carry[1]):
        for k, v in zip(mine[i], vs):
            new_flat_s[k] = v
    return ptree.unflatten(new_flat_p), stree.unflatten(new_flat_s)  # type: ignore[attr-defined]  # missing from the stubs


def _param_mask(optimizer, params, opt_kinds):
    """Per parameter: True when its optimizer state lives on the host."""
    flat_params, treedef = jax.tree.flatten(params)
    marks = [False] * len(flat_params)
    index_tree = jax.tree.unflatten(treedef, list(range(len(flat_params))))

    def mark(kind, index):
        if kind == HOST:
            marks[index] = True
        return kind

    optax.tree_map_params(
        optimizer, mark, opt_kinds, index_tree, transform_non_params=lambda x: x, is_leaf=lambda x: isinstance(x, str)
    )
    return jax.tree.unflatten(treedef, marks)


def _state_half(optimizer, opt_state, on_host, host: bool):
    """The optimizer state with the param-shaped leaves of the other half made zero-size."""
    return optax.tree_map_params(
        optimizer, lambda x, h: x if h == host else _empty(x), opt_state, on_host, transform_non_params=lambda x: x
    )


def _merge_state(optimizer, d_state, h_state, opt_kinds):
    flat_kinds = jax.tree.leaves(opt_kinds)
    flat_d, treedef = jax.tree.flatten(d_state)
    flat_h = jax.tree.leaves(h_state)
    return jax.tree.unflatten(treedef, [h if k == HOST else d for k, d, h in zip(flat_kinds, flat_d, flat_h)])


# ----------------------------------------------------------------------------- activations


def remat_policy(base, names: tuple[str, ...]):
    """`base` (a jax.checkpoint policy), except that the values named `names` (checkpoint_name) are
    saved to host memory: written out after the forward, read back for the backward."""
    if not names:
        return base
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src=DEVICE, offload_dst=HOST
    )

    def policy(prim, *args, **params):
        decision = offload(prim, *args, **params)
        if prim.name == "name" and params.get("name") in names:
            return decision
        return base(prim, *args, **params)

    return policy


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a config offloads (config.offload), resolved."""

    optimizer: bool = False
    host_update: bool = False
    fraction: float = 1.0
    params: bool = False
    activations: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return self.optimizer or self.params or bool(self.activations)

    @classmethod
    def from_config(cls, config) -> "Plan":
        from jaxsys.config import offloaded_activations

        o = config.offload
        return cls(
            bool(o.optimizer),
            o.optimizer_update == "host",
            float(o.optimizer_fraction),
            bool(o.params),
            offloaded_activations(config),
        )
