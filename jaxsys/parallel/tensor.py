"""Megatron tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al.
2022) over the `tensor` axis, plus the vocabulary-parallel embedding, cross-entropy and the logits
gathered for sampling (`gather_vocab`).

A tensor-parallel block is entered and left once:

    h = enter(x, axes, sp)   # x[B, T, D]: f (identity; all-reduce of dx backward), or with SP an
                             # all-gather of x[B, T/tp, D] over T (reduce-scatter backward)
    ... column-parallel matmuls, local heads / hidden units, row-parallel matmul ...
    y = leave(y, axes, sp)   # g (all-reduce of the partial sums; identity backward), or with SP a
                             # reduce-scatter over T (all-gather backward)

so each block costs one all-reduce forward and one backward (2 all-reduces = 2 reduce-scatters +
2 all-gathers with SP, the same bytes, with activations between blocks 1/tp the size).

`sp` is the tuple of mesh axes that split T between blocks (`Layout.sp_axes`: the tensor axes under
sequence parallelism, else empty). Of `axes`, those in `sp` are gathered / scattered over T and the
others are plain f / g: the vocabulary-parallel embedding and output layer under pipeline
vocabulary parallelism run over (pipe, tensor) while only `tensor` splits T.

`enter_matmul` / `leave_matmul` take the block's first (column-parallel) and last (row-parallel)
matmuls with them: the same as `enter` then the matmul, or the matmul then `leave`, unless
`collective` (config.parallel.collective_matmul) decomposes SP's all-gather / reduce-scatter into
ppermute steps beside chunks of the matmul (collective_matmul.py, docs/comm_overlap.md).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jax import lax

from jaxsys.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jaxsys.parallel.collectives import (
    all_gather_fwd_reduce_scatter_bwd,
    axis_index,
    copy_fwd_psum_bwd,
    psum_fwd_copy_bwd,
    reduce_scatter_fwd_all_gather_bwd,
)

SEQ_DIM = 1  # activations are [B, T, D]


def _split(axes: tuple[str, ...], sp: tuple[str, ...]):
    return tuple(a for a in axes if a in sp), tuple(a for a in axes if a not in sp)


def enter(x, axes: tuple[str, ...], sp: tuple[str, ...] = ()):
    """Into a tensor-parallel region: every rank needs the full x[B, T, D]."""
    gather, copy = _split(axes, sp)
    if gather:  # over T = dim 1: on x[B*T, D] it would gather D instead
        chex.assert_rank(x, 3, custom_message="tensor.enter under sequence parallelism takes x[B, T/sp, D]")
    x = all_gather_fwd_reduce_scatter_bwd(x, gather, SEQ_DIM) if gather else x
    return copy_fwd_psum_bwd(x, copy)


def leave(y, axes: tuple[str, ...], sp: tuple[str, ...] = ()):
    """Out of a tensor-parallel region: sum the partial y[B, T, D] of the ranks."""
    scatter, total = _split(axes, sp)
    if scatter:  # over T = dim 1, as in `enter`
        chex.assert_rank(y, 3, custom_message="tensor.leave under sequence parallelism takes y[B, T, D]")
    y = psum_fwd_copy_bwd(y, total)
    return reduce_scatter_fwd_all_gather_bwd(y, scatter, SEQ_DIM) if scatter else y


def enter_matmul(fn, x, ws, axes: tuple[str, ...], sp: tuple[str, ...] = (), collective: bool = False):
    """fn(enter(x, axes, sp), ws): a tensor-parallel block's column-parallel matmul(s) `fn(x, ws)`
    on the full x[B, T, D]. With `collective` (config.parallel.collective_matmul) the all-gather
    over T is decomposed into ppermute steps beside fn on the chunks already present
    (collective_matmul.all_gather_matmul). `fn` must be a matmul per position (T a batch dim)."""
    gather, copy = _split(axes, sp)
    if not (collective and gather):
        return fn(enter(x, axes, sp), ws)
    chex.assert_rank(x, 3, custom_message="tensor.enter_matmul under sequence parallelism takes x[B, T/sp, D]")
    return all_gather_matmul(fn, copy_fwd_psum_bwd(x, copy), ws, gather, SEQ_DIM)


def leave_matmul(fn, o, ws, axes: tuple[str, ...], sp: tuple[str, ...] = (), collective: bool = False):
    """leave(fn(o, ws), axes, sp): a tensor-parallel block's row-parallel matmul `fn(o, ws)` (the
    partial y[B, T, D] of this rank) summed over the ranks. With `collective` the reduce-scatter
    over T is decomposed into ppermute steps of the running sum, each beside fn on the next chunk
    of o (collective_matmul.matmul_reduce_scatter)."""
    scatter, total = _split(axes, sp)
    if not (collective and scatter):
        return leave(fn(o, ws), axes, sp)
    chex.assert_rank(o, {3, 4}, custom_message="tensor.leave_matmul under sequence parallelism takes o[B, T, ...]")
    return psum_fwd_copy_bwd(matmul_reduce_scatter(fn, o, ws, scatter, SEQ_DIM), total)


def gather_sequence(x, sp: tuple[str, ...] = ()):
    """The full-T copy of a per-position array that takes no gradient (routing decisions x[B, T/tp,
    ...] under sequence parallelism): an all-gather over T on the `sp` axes, as `enter` does for x."""
    return lax.all_gather(x, sp, axis=SEQ_DIM, tiled=True) if sp else x


def shard_offset(local_size: int, axes: tuple[str, ...]):
    """Global index of this rank's first element of a dimension split evenly over `axes`
    (e.g. the first vocabulary row or query head it owns)."""
    return axis_index(axes) * local_size


def embed_lookup(table, ids, axes: tuple[str, ...], sp: tuple[str, ...] = ()):
    """Vocabulary-parallel embedding: table[V/tp, D] holds rows [r*V/tp, (r+1)*V/tp); ids[B, T].

    Each rank looks up the ids it owns (zeros elsewhere) and the rows are summed with `leave`,
    so the full table is never gathered."""
    chex.assert_rank(table, 2, custom_message="tensor.embed_lookup takes table[V/tp, D]")
    chex.assert_type(ids, int, custom_message="tensor.embed_lookup takes integer token ids")
    rows = table.shape[0]
    local = ids - shard_offset(rows, axes)
    owned = (local >= 0) & (local < rows)
    x = jnp.take(table, jnp.where(owned, local, 0), axis=0) * owned[..., None].astype(table.dtype)
    return leave(x, axes, sp)


def cross_entropy(logits, targets, axes: tuple[str, ...]):
    """Vocabulary-parallel cross-entropy: logits[B, T, V/tp] (this rank's vocabulary slice),
    targets[B, T] -> per-token loss[B, T] (fp32), equal on every rank. Never gathers the logits:
    three [B, T] all-reduces (max, sum of exponentials, target logit)."""
    chex.assert_shape(
        targets, logits.shape[:-1], custom_message="tensor.cross_entropy takes targets[B, T] for logits[B, T, V/tp]"
    )
    chex.assert_type(targets, int, custom_message="tensor.cross_entropy takes integer targets")
    logits = logits.astype(jnp.float32)
    width = logits.shape[-1]
    local_max = lax.stop_gradient(jnp.max(logits, axis=-1))
    global_max = lax.pmax(local_max, axes) if axes else local_max
    shifted = logits - global_max[..., None]
    sum_exp = psum_fwd_copy_bwd(jnp.sum(jnp.exp(shifted), axis=-1), axes)
    local = targets - shard_offset(width, axes)
    owned = (local >= 0) & (local < width)
    picked = jnp.take_along_axis(shifted, jnp.where(owned, local, 0)[..., None], axis=-1)[..., 0]
    target_logit = psum_fwd_copy_bwd(jnp.where(owned, picked, 0.0), axes)
    return jnp.log(sum_exp) - target_logit


def gather_vocab(logits, axes: tuple[str, ...]):
    """The full-vocabulary logits [..., V] from this rank's slice [..., V/tp] (sampling needs every
    token's logit): one all-gather over the vocabulary's axes; no gradient."""
    return lax.all_gather(logits, axes, axis=logits.ndim - 1, tiled=True) if axes else logits
