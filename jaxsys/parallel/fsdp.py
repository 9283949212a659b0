"""FSDP / ZeRO-3 (Rajbhandari et al. 2020; Zhao et al. 2023) over the mesh axes that hold
parameters at rest but not in compute (`config.sharding.params` minus `.compute`, by default
`embed -> fsdp`).

`gather` all-gathers one layer's weights just before use; its backward reduce-scatters the
gradient, so gradients leave the backward pass already sharded like the parameters. Inside the
layer scan the gathered weights are tagged `fsdp_gathered` and never saved for the backward pass:
they are gathered again there (torchtitan's reshard_after_forward).
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxsys.parallel.collectives import all_gather_fwd_reduce_scatter_bwd
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
        for dim, name in enumerate(names):
            axes = gathered_axes(layout, name)
            if axes:
                w = checkpoint_name(all_gather_fwd_reduce_scatter_bwd(w, axes, dim), GATHERED)
        return w

    return jax.tree.map(one, weights, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
