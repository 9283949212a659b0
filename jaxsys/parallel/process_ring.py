"""A ring over processes: each process's buffer moves to the next process through the training
devices (one device per process), so that a peer copy needs no second transport across hosts.
Used by the in-memory snapshots (jaxsys/checkpoint/snapshot.py, docs/fault_tolerance.md)."""

from __future__ import annotations

from functools import lru_cache

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys.parallel.spmd import per_shard


def process_devices() -> list:
    """One device per process (its lowest id), in process order."""
    first: dict = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return [first[p] for p in sorted(first)]


@lru_cache(maxsize=8)
def ring_fn(n_proc: int, length: int):
    """The compiled ring for [n_proc, length] uint8 buffers (row p on process p's device) and the
    buffers' sharding: row p goes to process (p + 1) % n_proc."""
    del length  # part of the cache key: one program per padded length
    mesh = Mesh(np.array(process_devices()), ("proc",))
    sharding = NamedSharding(mesh, P("proc"))
    perm = [(i, (i + 1) % n_proc) for i in range(n_proc)]
    fn = jax.jit(per_shard(lambda x: lax.ppermute(x, "proc", perm), mesh, P("proc"), P("proc")), out_shardings=sharding)
    return fn, sharding
