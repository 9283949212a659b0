"""GaLore's communication (jaxsys/optim/galore.py; docs/galore.md gives the bytes). The optimizer
update runs inside the train step's shard_map on this device's block of each gradient, split over
its row axes (the `embed` dimension), its column axes and its batch axes:

- refresh (one step in K): `gather` the local block over the row axes, then over each split column
  dimension's axes, so the device holds its whole matrices for the SVD, and keep `own_block` of
  the new projection (no communication);
- projection (every step): `sum_projected`, R summed over the axes of the contracted side: a
  reduce-scatter along r when the moments are split there, an all-reduce otherwise;
- projection back: `gather` Adam's output N along r when the moments are split there.

No gradient flows through an optimizer update, so these are the plain collectives (no custom_vjp).
Every function is the identity when its axes are empty (nothing split: no collective)."""

from __future__ import annotations

from jax import lax

from jaxsys.parallel.collectives import axis_index


def gather(x, dim: int, axes: tuple[str, ...]):
    """All-gather of `x` along `dim` over `axes` (major to minor): the blocks in device order."""
    return lax.all_gather(x, axes, axis=dim, tiled=True) if axes else x


def own_block(x, dim: int, axes: tuple[str, ...], size: int):
    """This device's block (of `size`) of dimension `dim` of a whole array, split over `axes`
    (major to minor): a slice, no communication."""
    if not axes:
        return x
    return lax.dynamic_slice_in_dim(x, axis_index(axes) * size, size, axis=dim)


def sum_projected(r, rank_dim: int, sum_axes: tuple[str, ...], rank_axes: tuple[str, ...]):
    """The projected gradient R (local matmuls) summed over `sum_axes`: a reduce-scatter along
    `rank_dim` (r) over `rank_axes` when the moments are split there (`rank_axes` is then
    `sum_axes`), else an all-reduce over `sum_axes`."""
    if rank_axes:
        return lax.psum_scatter(r, rank_axes, scatter_dimension=rank_dim, tiled=True)
    if sum_axes:
        return lax.psum(r, sum_axes)
    return r
