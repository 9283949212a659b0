"""FSDP prefetch (config.parallel.fsdp_prefetch): the layer scan gathers layer i+1's weights while
layer i computes, and the gradient reduce-scatter of layer i+1 runs beside layer i's backward (the
delayed reduce-scatter; docs/comm_overlap.md).

The scan carries the next layer's gathered weights. Each layer first issues the all-gather of the
layer after it (`ahead`: from the whole stack, by dynamic index), then computes on the weights
gathered one layer earlier (layer 0's before the scan; the last layer gathers the last group's first
layer again, unused). `prefetched` keeps the gathered weights out of the backward's residuals: the
backward gathers them again, as without prefetch. The weight gradients flow back along the carry:
backward iteration i reduce-scatters layer i+1's (the transpose of its prefetch) beside layer i's
VJP, into the stack's gradient; the scanned stack is only read, under stop_gradient, for the
backward's regather. execution/stack.py's layer scan (`run_layers`) runs this loop with
`following`, `first` and `scanned`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def prefetched(block, regather, policy):
    """A layer for FSDP prefetch: `run(x, previous, local, gathered)` computes `block(x, previous,
    gathered)` on weights gathered ahead of time and differentiates like the plain layer
    `block(x, previous, regather(local))` under `jax.checkpoint(policy=policy)`:

    - forward: the block runs under the remat policy and keeps what the policy saves, except the
      gathered weights themselves (the residuals that are `gathered`'s leaves are dropped);
    - backward: the weights are gathered again from `local` (the shards at rest) and put back in
      those residuals; the weights' cotangent goes to `gathered`, the gathered weights, and `local`
      gets none. So the reduce-scatter is the transpose of the gather that made `gathered`: in the
      layer scan, the all-gather one iteration earlier, whose transpose runs one backward iteration
      later, beside the previous layer's VJP.

    `regather(local)` must give exactly `gathered` (the same gather of the same shards), so the
    forward and backward compute the plain layer's numbers, and the gradient reaches the shards
    through the same reduce-scatter. `block` takes and returns pytrees; integer inputs and outputs
    (MoE routing) pass through."""
    remat = jax.checkpoint(block, policy=policy, prevent_cse=False)
    static = {}  # the residual structure, from the forward's trace to the backward's

    @jax.custom_vjp
    def run(x, previous, local, gathered):
        return block(x, previous, gathered)

    def fwd(x, previous, local, gathered):
        out, vjp = jax.vjp(remat, x, previous, gathered)
        leaves, static["tree"] = jax.tree.flatten(vjp)
        slot = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves(gathered))}
        static["slots"] = [slot.get(id(leaf)) for leaf in leaves]
        kept = [None if s is not None else leaf for leaf, s in zip(leaves, static["slots"])]
        return out, (kept, local)

    def bwd(residuals, ct):
        kept, local = residuals
        weights = jax.tree.leaves(regather(local))
        vjp = jax.tree.unflatten(
            static["tree"], [weights[s] if s is not None else leaf for leaf, s in zip(kept, static["slots"])]
        )
        ct_x, ct_previous, ct_weights = vjp(ct)
        return ct_x, ct_previous, None, ct_weights

    run.defvjp(fwd, bwd)
    return run


def following(g, i: int, period: int, n_groups: int):
    """(group, layer in the period) of the layer after layer i of group g, whose weights layer i
    gathers: the next group's first layer after a period's last (the last group's own again at the
    end of the stack, unused)."""
    if i + 1 < period:
        return g, i + 1
    return jnp.minimum(g + 1, n_groups - 1), 0


def first():
    """The (group, layer) gathered before the scan starts."""
    return jnp.int32(0), 0


def scanned(groups):
    """The stack as the scan reads it under prefetch: only under stop_gradient (the gradient
    comes back along the carry, through the transposes of the gathers ahead)."""
    return jax.lax.stop_gradient(groups)
