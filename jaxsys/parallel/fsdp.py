"""FSDP / ZeRO-3 (Rajbhandari et al. 2020; Zhao et al. 2023) over the mesh axes that hold
parameters at rest but not in compute (`config.sharding.params` minus `.compute`, by default
`embed -> fsdp`).

`gather` all-gathers one layer's weights just before use; its backward (the transpose of
`lax.all_gather`) reduce-scatters the gradient, so gradients leave the backward pass already
sharded like the parameters. Inside the layer scan the gathered weights are never saved for the
backward pass (see `remat_saveable`): they are gathered again there (torchtitan's
reshard_after_forward).
"""

from __future__ import annotations

import chex
import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxsys.sharding import Layout

GATHERED = "fsdp_gathered"


def gathered_axes(layout: Layout, logical: str | None) -> tuple[str, ...]:
    """Mesh axes over which a dimension named `logical` is sharded at rest but not in compute."""
    compute = layout.compute_axes(logical)
    return tuple(a for a in layout.param_axes(logical) if a not in compute)


def gather(weights, logical_axes, layout: Layout):
    """All-gather each leaf of `weights` over its FSDP axes; `logical_axes` has the same structure
    (a tuple of logical names per leaf)."""

    def one(w, names):
        # one logical name per dimension: a shorter tuple would leave dimensions sharded
        chex.assert_rank(w, len(names), custom_message=f"fsdp.gather: a weight with logical axes {names}")
        for dim, name in enumerate(names):
            axes = gathered_axes(layout, name)
            if axes:
                # a plain all_gather (not a custom_vjp) so that remat policies can see it
                w = checkpoint_name(lax.all_gather(w, axes, axis=dim, tiled=True), GATHERED)
        return w

    return jax.tree.map(one, weights, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


_NEVER_SAVED = ("all_gather", "broadcast_in_dim")


def remat_saveable(prim, *_, **params) -> bool:
    """Remat policy "save everything except the FSDP-gathered weights". The all_gather, its name
    and broadcasts are all refused: otherwise remat saves a gathered weight under another name (a
    norm scale broadcast to [B, T, D], say). Broadcasts are free to recompute."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _NEVER_SAVED


def prefetched(block, regather, policy):
    """A layer for FSDP prefetch (config.parallel.fsdp_prefetch): `run(x, previous, local, gathered)`
    computes `block(x, previous, gathered)` on weights gathered ahead of time (the layer scan gathers
    layer i+1 while layer i computes and carries the result), and differentiates like the plain
    layer `block(x, previous, regather(local))` under `jax.checkpoint(policy=policy)`:

    - forward: the block runs under the remat policy and keeps what the policy saves, except the
      gathered weights themselves (the residuals that are `gathered`'s leaves are dropped);
    - backward: the weights are gathered again from `local` (the shards at rest) and put back in
      those residuals; the weights' cotangent goes to `gathered`, the gathered weights, and `local`
      gets none. So the reduce-scatter is the transpose of the gather that made `gathered`: in the
      layer scan, the all-gather one iteration earlier, whose transpose runs one backward iteration
      later, beside the previous layer's VJP (the delayed reduce-scatter; the scan carries the
      gathered weights with their gradient, docs/comm_overlap.md).

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
