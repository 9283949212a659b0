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
    """Mesh axes over which a dimension named `logical` is sharded at rest but not in compute, and
    which a layer gathers. Under ZeRO++'s hpZ the weights reach the layers already gathered over
    `data` (`zeropp.secondary`, once a step): the layers gather over the rest (`fsdp`) only."""
    compute = layout.compute_axes(logical)
    return tuple(a for a in layout.param_axes(logical) if a not in compute and not (layout.hpz and a == "data"))


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
