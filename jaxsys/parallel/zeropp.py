"""ZeRO++ (Wang et al. 2023): hierarchical partitioning (hpZ), quantized weight all-gather (qwZ)
and quantized gradient reduce-scatter (qgZ), over a mesh whose `data` axis crosses the slow links
(between hosts, or the DCN between TPU slices) and whose `fsdp` axis stays on the fast ones.

The parameters and their optimizer state are ZeRO-3 over every rank (`sharding.params.embed =
"fsdp,data"`, `data` minor: the primary partition). Under hpZ (`config.parallel.zeropp_hpz`) the
forward first gathers every weight over `data` once, in the compute dtype: the secondary partition,
sharded over `fsdp` only and held for the step (`secondary`). The layers then gather over `fsdp`
alone (`fsdp.gathered_axes` leaves `data` out), in the forward and again in the backward, so the
per-layer traffic never leaves the fast group. Gradients follow the transposes: each layer's
reduce-scatter over `fsdp`, then one reduce-scatter over `data` per step, the transpose of the
secondary gather. Same sums in the same order as ZeRO-3 over `fsdp` with ZeRO-2 over `data`
(tests/test_zeropp.py checks bitwise equality); the update then runs on the same (fsdp, data) slice.

qwZ (`zeropp_qwz`) sends the secondary gather as int8 codes with one fp32 absmax scale per row
(`quantize_rows`) and dequantizes after; its backward is the reduce-scatter of the unquantized
weights' cotangent (straight through). qgZ (`zeropp_qgz`) replaces the `data` reduce-scatter with
an all-to-all of int8 codes and scales: each rank quantizes its fsdp-reduced gradient block, sends
rank j its j-th chunk, and sums the chunks it receives in fp32 (the paper's all-to-all reduce-
scatter for the inter-node hop; the intra-node hop stays in the compute dtype); with
`zeropp_qgz_bits = 4` the codes are int4, packed two to a byte along the row. 1-D leaves (norm
scales) go unquantized: one scale per element would cost more than it saves.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.sharding import Layout

AXIS = "data"  # the slow axis: replicas of the secondary partition
SCALE_BYTES = 4  # one fp32 scale per row


def quantized(ndim: int) -> bool:
    """Whether a leaf of this rank is sent in int8 (1-D leaves are not)."""
    return ndim >= 2


def scale_axis(ndim: int, dim: int) -> int:
    """The axis a row's absmax runs over: the last one other than the gathered `dim`."""
    return ndim - 1 if dim != ndim - 1 else ndim - 2


def grad_bits(layout: Layout, shape, dim: int) -> int:
    """qgZ's code width for a leaf of this local `shape` gathered along `dim`: config's 4 where the
    rows pack two codes to a byte (an even `scale_axis`), else 8."""
    return 4 if layout.qgz_bits == 4 and shape[scale_axis(len(shape), dim)] % 2 == 0 else 8


def quantize_rows(x, dim: int, bits: int = 8):
    """Symmetric codes of x (q = 2^(bits-1) - 1 levels each side) and fp32 scales, one per row along
    `scale_axis` (kept as size 1, so the scales split along `dim` like the codes). 4 bits: packed
    two to a uint8 along the row (`_pack`)."""
    axis = scale_axis(x.ndim, dim)
    q = 2.0 ** (bits - 1) - 1
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=axis, keepdims=True) / q
    scale = jnp.where(scale == 0, 1.0, scale)
    codes = jnp.clip(jnp.round(x32 / scale), -q, q).astype(jnp.int8)
    return (_pack(codes, axis) if bits == 4 else codes), scale


def dequantize_rows(codes, scale, dtype, dim: int | None = None):
    if codes.dtype == jnp.uint8:  # int4, packed along the row
        codes = _unpack(codes, scale_axis(codes.ndim, dim))
    return (codes.astype(jnp.float32) * scale).astype(dtype)


def _pack(codes, axis: int):
    """int8 codes in [-7, 7] -> uint8, elements 2i and 2i + 1 along `axis` in one byte."""
    moved = jnp.moveaxis(codes, axis, 0)
    packed = qref.pack_int4(moved.reshape(moved.shape[0], -1))
    return jnp.moveaxis(packed.reshape(packed.shape[0], *moved.shape[1:]), 0, axis)


def _unpack(packed, axis: int):
    moved = jnp.moveaxis(packed, axis, 0)
    codes = qref.unpack_int4(moved.reshape(moved.shape[0], -1), signed=True)
    return jnp.moveaxis(codes.reshape(codes.shape[0], *moved.shape[1:]), 0, axis)


def _gather(w, dim: int, quantize: bool):
    if not quantize:
        return lax.all_gather(w, AXIS, axis=dim, tiled=True)
    codes, scale = quantize_rows(w, dim)
    codes = lax.all_gather(codes, AXIS, axis=dim, tiled=True)
    scale = lax.all_gather(scale, AXIS, axis=dim, tiled=True)
    return dequantize_rows(codes, scale, w.dtype)


def _reduce_scatter(g, dim: int, quantize: bool, bits: int = 8):
    if not quantize:
        return lax.psum_scatter(g, AXIS, scatter_dimension=dim, tiled=True)
    n = lax.axis_size(AXIS)
    codes, scale = quantize_rows(g, dim, bits)
    # chunk j of `dim` goes to rank j; the chunks received sit along `dim` in rank order
    codes = lax.all_to_all(codes, AXIS, dim, dim, tiled=True)
    scale = lax.all_to_all(scale, AXIS, dim, dim, tiled=True)
    parts = dequantize_rows(codes, scale, jnp.float32, dim)
    parts = parts.reshape(parts.shape[:dim] + (n, parts.shape[dim] // n) + parts.shape[dim + 1 :])
    total = parts[(slice(None),) * dim + (0,)]
    for j in range(1, n):  # in rank order, in fp32
        total = total + parts[(slice(None),) * dim + (j,)]
    return total.astype(g.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _quantized_gather(w, dim: int, qwz: bool, qgz: bool, bits: int):
    return _gather(w, dim, qwz)


def _qg_fwd(w, dim, qwz, qgz, bits):
    return _gather(w, dim, qwz), None


def _qg_bwd(dim, qwz, qgz, bits, _, g):
    return (_reduce_scatter(g, dim, qgz, bits),)


_quantized_gather.defvjp(_qg_fwd, _qg_bwd)


def gather_data(w, dim: int, qwz: bool = False, qgz: bool = False, qgz_bits: int = 8):
    """All-gather over `data` along `dim` (int8 under qwZ); backward: the reduce-scatter over `data`
    (an all-to-all of `qgz_bits` codes under qgZ). Plain `lax.all_gather` without either: its
    transpose."""
    qwz, qgz = qwz and quantized(w.ndim), qgz and quantized(w.ndim)
    if not (qwz or qgz):
        return lax.all_gather(w, AXIS, axis=dim, tiled=True)
    return _quantized_gather(w, dim, qwz, qgz, qgz_bits)


def data_dim(layout: Layout, names) -> int | None:
    """The dimension of a leaf sharded over `data` at rest (ZeRO-3 over data), if any."""
    return next((d for d, n in enumerate(names) if AXIS in layout.param_axes(n)), None)


def secondary(params, axes, compute_dtype, layout: Layout):
    """hpZ's secondary partition: every leaf of `params` cast to the compute dtype and gathered over
    `data` (the dimension `data` shards), so that it is sharded over `fsdp` only. `axes`: the leaves'
    logical names, same structure. The identity without hpZ."""
    if not layout.hpz:
        return params

    def one(w, names):
        dim = data_dim(layout, names)
        if dim is None:
            return w
        if jnp.issubdtype(w.dtype, jnp.floating):
            w = w.astype(compute_dtype)
        return gather_data(w, dim, layout.qwz, layout.qgz, grad_bits(layout, w.shape, dim))

    return jax.tree.map(one, params, axes, is_leaf=lambda x: isinstance(x, tuple))
