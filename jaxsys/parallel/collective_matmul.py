"""Collective matmul for tensor parallelism under sequence parallelism (`config.parallel.
collective_matmul`; Wang et al. 2023, "Overlap communication with dependent computation via
decomposition"; the decomposition of JAX's shard_map collective-matmul example and of the TPU
stacks). docs/comm_overlap.md.

With sequence parallelism a tensor-parallel block is entered with an all-gather of x[B, T/t, D]
over T and left with a reduce-scatter over T of the row-parallel partial sums. Each is one
collective the matmul beside it waits for. Here they are split into t-1 `ppermute` steps around
the ring of the `t` ranks, each step running beside the matmul of the chunk already present:

    all_gather_matmul(fn, x, ws)       = fn(all_gather(x, T), ws)          (column-parallel entry)
        step s: send the chunk held on, compute fn(chunk (r+s) % t, ws)
    matmul_reduce_scatter(fn, o, ws)   = psum_scatter(fn(o, ws), T)        (row-parallel exit)
        step s: compute fn(o[chunk (r+s+1) % t], ws), add the accumulator received, send it on

`fn(x_chunk, ws)` is the matmul(s) as the model writes them (an einsum, the quantized kernels, or
several projections of the same input), applied to a [B, T_chunk, ...] slice: T is a batch
dimension of every matmul, so applying fn per chunk computes the same numbers. The backward is
written out (custom_vjp), as for the other collectives (collectives.py): the backward of an
all-gather-matmul is a matmul-reduce-scatter (dx) and the backward of a matmul-reduce-scatter is
an all-gather-matmul (do); the weight gradients are summed over the chunks locally.

Ring direction: rank r sends to rank r-1 (it receives from r+1). `axes` may name several mesh
axes; the ring runs over their linear index (major to minor), as `lax.all_gather` orders them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.parallel.collectives import axis_index


def _ring(axes):
    t = lax.axis_size(axes)
    return t, axis_index(axes), [(j, (j - 1) % t) for j in range(t)]


def _chunk(a, c, size: int, dim: int):
    return lax.dynamic_slice_in_dim(a, c * size, size, axis=dim)


def _gather_steps(x, axes, dim: int, visit):
    """The all-gather half: visit(c, x_c) for each chunk c of the gathered x, chunk c = rank c's x,
    with the t-1 ppermutes that bring the chunks issued one step ahead of the visit that uses them."""
    t, r, perm = _ring(axes)
    held = x
    for s in range(t):
        following = lax.ppermute(held, axes, perm) if s < t - 1 else None
        visit((r + s) % t, held)
        held = following


def _scatter_steps(axes, part):
    """The reduce-scatter half: sum over the ranks of part(c) for c = this rank's chunk, as a ring
    of t-1 ppermutes of the running sum, each beside the next part's compute."""
    t, r, perm = _ring(axes)
    acc = None
    for s in range(t):
        p = part((r + s + 1) % t)
        if acc is None:
            acc = p
            continue
        # The barrier keeps the compiler from fusing the add of the received sum into the matmul
        # that makes p (an output fusion): fused, that matmul would wait for the ppermute it is
        # meant to hide (seen in the TPU compiler's schedule, docs/comm_overlap.md).
        acc = jax.tree.map(jnp.add, lax.ppermute(acc, axes, perm), lax.optimization_barrier(p))
    return acc


def _place(buffers, values, c, size: int, dim: int):
    return jax.tree.map(
        lambda b, v: lax.dynamic_update_slice_in_dim(b, v.astype(b.dtype), c * size, axis=dim), buffers, values
    )


def _zeros_full(tree, t: int, dim: int):
    return jax.tree.map(lambda a: jnp.zeros(a.shape[:dim] + (a.shape[dim] * t,) + a.shape[dim + 1 :], a.dtype), tree)


def _add(a, b):
    return b if a is None else jax.tree.map(jnp.add, a, b)


def _ag_matmul(fn, x, ws, axes, dim):
    """(fn(all_gather(x)), all_gather(x)): the outputs and the gathered input (the residual)."""
    t = lax.axis_size(axes)
    size = x.shape[dim]
    state = {"y": None, "x": _zeros_full(x, t, dim)}

    def visit(c, x_c):
        y_c = fn(x_c, ws)
        if state["y"] is None:  # the output buffers, full T, from the first chunk's outputs
            state["y"] = _zeros_full(y_c, t, dim)
        state["y"] = _place(state["y"], y_c, c, size, dim)
        state["x"] = _place(state["x"], x_c, c, size, dim)

    _gather_steps(x, axes, dim, visit)
    return state["y"], state["x"]


def _matmul_rs(fn, o, ws, axes, dim):
    t = lax.axis_size(axes)
    size = o.shape[dim] // t
    return _scatter_steps(axes, lambda c: fn(_chunk(o, c, size, dim), ws))


@partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def all_gather_matmul(fn, x, ws, axes: tuple[str, ...], dim: int = 1):
    """fn(all_gather(x, axes, dim), ws) with the all-gather decomposed into t-1 ppermutes, each
    beside fn on the chunk already here. x[B, T/t, ...] -> fn's outputs over the full T.
    Backward: dx by a matmul-reduce-scatter, dws summed over the chunks."""
    if not axes:
        return fn(x, ws)
    return _ag_matmul(fn, x, ws, axes, dim)[0]


def _agm_fwd(fn, x, ws, axes, dim):
    if not axes:
        return fn(x, ws), (x, ws)
    y, x_full = _ag_matmul(fn, x, ws, axes, dim)
    return y, (x_full, ws)


def _agm_bwd(fn, axes, dim, res, dy):
    x_full, ws = res
    if not axes:
        _, vjp = jax.vjp(fn, x_full, ws)
        return vjp(dy)
    t = lax.axis_size(axes)
    size = x_full.shape[dim] // t
    dws = [None]

    def part(c):  # this rank's weights' share of dx for chunk c, and of dws
        _, vjp = jax.vjp(fn, _chunk(x_full, c, size, dim), ws)
        dx_c, dw_c = vjp(jax.tree.map(lambda g: _chunk(g, c, size, dim), dy))
        dws[0] = _add(dws[0], dw_c)
        return dx_c

    dx = _scatter_steps(axes, part)
    return dx, dws[0]


all_gather_matmul.defvjp(_agm_fwd, _agm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def matmul_reduce_scatter(fn, o, ws, axes: tuple[str, ...], dim: int = 1):
    """psum_scatter(fn(o, ws), axes, dim) with the reduce-scatter decomposed into t-1 ppermutes of
    the running sum, each beside fn on the next chunk of o. o[B, T, ...] -> y[B, T/t, ...].
    Backward: do by an all-gather-matmul of dy, dws summed over the chunks."""
    if not axes:
        return fn(o, ws)
    return _matmul_rs(fn, o, ws, axes, dim)


def _mrs_fwd(fn, o, ws, axes, dim):
    return matmul_reduce_scatter(fn, o, ws, axes, dim), (o, ws)


def _mrs_bwd(fn, axes, dim, res, dy):
    o, ws = res
    if not axes:
        _, vjp = jax.vjp(fn, o, ws)
        return vjp(dy)
    t = lax.axis_size(axes)
    size = o.shape[dim] // t
    state = {"do": jnp.zeros_like(o), "dws": None}

    def visit(c, dy_c):  # dy_c: rank c's cotangent, the one for chunk c of every rank's o
        _, vjp = jax.vjp(fn, _chunk(o, c, size, dim), ws)
        do_c, dw_c = vjp(dy_c)
        state["do"] = _place(state["do"], do_c, c, size, dim)
        state["dws"] = _add(state["dws"], dw_c)

    _gather_steps(dy, axes, dim, visit)
    return state["do"], state["dws"]


matmul_reduce_scatter.defvjp(_mrs_fwd, _mrs_bwd)
