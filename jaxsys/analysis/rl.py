"""RL weight sync: the bytes of the trainer -> generator transfer by formula (docs/rl.md).

After each update the new weights go from the trainer's layout to the generator's. When the two
sub-meshes are disjoint every byte a generator device holds comes from another device, so

    bytes = sum over parameters p of  bytes(p) x n_gen / shards_gen(p)

where shards_gen(p) is the number of distinct pieces p is cut into on the generator (the product
of the mesh axes its PartitionSpec names) and n_gen / shards_gen(p) the copies the generator's
replication makes of each piece. `serve.engine.reshard` (what `Engine.set_params` runs) counts the
bytes it moves; the tests require the two to be equal. Formulas only: nothing is compiled.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxsys.config import MESH_AXES


def _spec_axes(pspec) -> list:
    out = []
    for entry in pspec:
        if entry is None:
            continue
        out += list(entry) if isinstance(entry, tuple) else [entry]
    return out


def sync_bytes(config, dtype=None) -> int:
    """Bytes the generator's devices receive from a disjoint trainer: `config` is the generator's
    (its mesh and rules; parameters in config.model.param_dtype unless `dtype`)."""
    from jaxsys.models import transformer
    from jaxsys.models.params import is_spec
    from jaxsys.sharding import Layout

    layout = Layout.from_config(config)
    sizes = {a: config.mesh[a] for a in MESH_AXES}
    n = math.prod(sizes.values())
    item = np.dtype(dtype or config.model.param_dtype).itemsize
    total = 0
    for spec in jax.tree.leaves(transformer.param_specs(config.model), is_leaf=is_spec):
        shards = math.prod(sizes[a] for a in _spec_axes(layout.param_spec(spec.axes)))
        total += math.prod(spec.shape) * item * n // shards
    return total


def all_gather_bytes(config, dtype=None) -> int:
    """The naive sync: every generator device receives the full weights (gather, then slice)."""
    from jaxsys.models import transformer
    from jaxsys.models.params import is_spec

    item = np.dtype(dtype or config.model.param_dtype).itemsize
    n = math.prod(config.mesh[a] for a in MESH_AXES)
    specs = jax.tree.leaves(transformer.param_specs(config.model), is_leaf=is_spec)
    return n * sum(math.prod(s.shape) for s in specs) * item
