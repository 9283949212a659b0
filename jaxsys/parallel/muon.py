"""Muon's communication (jaxsys/optim/muon.py): the update runs inside the train step's shard_map
on this device's block of each momentum matrix, split over its row axes and its column axes. Newton-
Schulz needs whole matrices, and the G devices of those axes hold blocks of the same ones, so they
trade blocks for whole matrices: `spread_matrices` is an all-to-all that sends matrix i of the local
batch to device i of the group (each device ends with 1/G of the matrices, whole along one dimension;
once over the row axes and once over the column axes), `gather_matrices` the inverse all-to-all. Each
moves (G - 1) / G of the block each way, and each device runs NS on 1/G of the matrices instead of
all of them (the all-gather of `galore.whole_matrices`, the fallback when the batch does not
divide by G, receives G - 1 blocks and leaves every device the whole NS).

No gradient flows through an optimizer update, so these are the plain collectives. Both are the
identity when `axes` is empty."""

from __future__ import annotations

from jax import lax


def spread_matrices(x, dim: int, axes: tuple[str, ...]):
    """[b, ...] blocks split along `dim` over `axes` -> [b / G, ...] with `dim` whole: matrix
    chunk i of the batch to device i, blocks concatenated in device order."""
    return lax.all_to_all(x, axes, 0, dim, tiled=True) if axes else x


def gather_matrices(x, dim: int, axes: tuple[str, ...]):
    """The inverse of `spread_matrices`: [b / G, ...] whole along `dim` -> this device's blocks of
    all b matrices."""
    return lax.all_to_all(x, axes, dim, 0, tiled=True) if axes else x
