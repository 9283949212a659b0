"""The one place jaxsys builds a `jax.shard_map`: per-shard code over the whole mesh.

Every step function (training, evaluation, the serving engine's, the page transfers of
disaggregated serving) is a function of local shards run on every device with `per_shard`. The
collectives inside are jaxsys.parallel's own, which state their backward themselves (custom_vjp),
so shard_map's varying-manual-axes check is off (`check_vma=False`).
"""

from __future__ import annotations

import jax


def per_shard(fn, mesh, in_specs, out_specs):
    """`fn` on this device's shards of its arguments (split as `in_specs` say) over every axis of
    `mesh`; its results are assembled as `out_specs` say."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
