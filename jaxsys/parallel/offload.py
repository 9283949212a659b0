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
        raise OffloadError(f"{what} needs host memory kinds, but {device.platform} devices have "
                           f"{sorted(kinds) or 'none'}: turn the offload option off (TPU, GPU and CPU "
                           "devices have pinned_host)")


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


def state_kinds(optimizer: optax.GradientTransformation, abstract_params, param_bytes_tree,
                fraction: float):
    """Memory kind of every optimizer-state leaf: the param-shaped leaves (moments) of the params
    `choose` picks go to HOST, the rest (step counts, non-param state) stay on DEVICE. The choice is
    made per parameter from the bytes of its state (`param_bytes_tree`: bytes of one state leaf of
    that parameter, per device)."""
    leaves, treedef = jax.tree.flatten(param_bytes_tree)
    picked = jax.tree.unflatten(treedef, choose(leaves, fraction))
    opt_shapes = jax.eval_shape(optimizer.init, abstract_params)
    return optax.tree_map_params(optimizer, lambda _, host: HOST if host else DEVICE, opt_shapes, picked,
                                 transform_non_params=lambda _: DEVICE)


# ----------------------------------------------------------------------------- the update


def _empty(x):
    return jnp.zeros((0,) * x.ndim, x.dtype)


def split_update(optimizer: optax.GradientTransformation, grads, opt_state, params, opt_kinds, param_kinds,
                 on_host_update: bool):
    """One optimizer update of local shards where some optimizer-state leaves (`opt_kinds`) live on
    the host. Returns (new params, new optimizer state), each leaf in the memory its kind names
    (params by `param_kinds`).

    `on_host_update=False`: the host leaves are streamed in, updated on the device, streamed out.
    `on_host_update=True`: the update of the parameters whose state lives on the host runs on the
    host; that of the rest on the device. The two halves are the same optax update applied to the
    two halves of the tree: the other half's leaves are replaced by zero-size arrays, so the tree
    structure (and a checkpoint's) is that of the run without offload. This needs an update that
    treats leaves independently (AdamW does); step counts are taken from the device half."""
    if not on_host_update:
        updates, new_state = optimizer.update(grads, to_device(opt_state), to_device(params))
        new_params = optax.apply_updates(to_device(params), updates)
        return place(new_params, param_kinds), place(new_state, opt_kinds)

    on_host = _param_mask(optimizer, params, opt_kinds)
    half = lambda tree, host: jax.tree.map(lambda x, h: x if h == host else _empty(x), tree, on_host)
    state_half = lambda host: _state_half(optimizer, opt_state, on_host, host)

    d_updates, d_state = optimizer.update(half(grads, False), to_device(state_half(False)),
                                          to_device(half(params, False)))
    d_params = optax.apply_updates(to_device(half(params, False)), d_updates)

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def host_update(g, s, p):
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    h_params, h_state = host_update(to_host(half(grads, True)), to_host(state_half(True)),
                                    to_host(half(params, True)))
    new_params = jax.tree.map(lambda h, d, k: h if k else d, h_params, d_params, on_host)
    new_state = _merge_state(optimizer, d_state, h_state, opt_kinds)
    return place(new_params, param_kinds), place(new_state, opt_kinds)


def _param_mask(optimizer, params, opt_kinds):
    """Per parameter: True when its optimizer state lives on the host."""
    flat_params, treedef = jax.tree.flatten(params)
    marks = [False] * len(flat_params)
    index_tree = jax.tree.unflatten(treedef, list(range(len(flat_params))))

    def mark(kind, index):
        if kind == HOST:
            marks[index] = True
        return kind

    optax.tree_map_params(optimizer, mark, opt_kinds, index_tree, transform_non_params=lambda x: x,
                          is_leaf=lambda x: isinstance(x, str))
    return jax.tree.unflatten(treedef, marks)


def _state_half(optimizer, opt_state, on_host, host: bool):
    """The optimizer state with the param-shaped leaves of the other half made zero-size."""
    return optax.tree_map_params(optimizer, lambda x, h: x if h == host else _empty(x), opt_state, on_host,
                                 transform_non_params=lambda x: x)


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
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src=DEVICE, offload_dst=HOST)

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
        return cls(bool(o.optimizer), o.optimizer_update == "host", float(o.optimizer_fraction),
                   bool(o.params), offloaded_activations(config))

