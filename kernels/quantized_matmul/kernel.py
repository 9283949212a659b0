"""Pallas kernels for weight-only quantized matmuls (W8A16, W4A16): the generic variant
(interpret mode on CPU; written for the Triton lowering, not yet compiled on a GPU).

y[M, N] = x[M, K] @ W, with W given as int8 codes and per-channel scales (W8A16) or as 4-bit codes
packed two per byte, per-group scales and optional zero points (W4A16; reference.py defines the
semantics and the packing).

Design (one program per (block_m, block_n) output tile, every grid axis parallel):
* the K loop runs inside the kernel (`lax.fori_loop`), carrying the fp32 accumulator, as
  kernels/linear_attention does (Triton has no scratch memory and does not order grid programs);
* only codes cross memory: each iteration loads one K-block of codes ([block_k, block_n] int8 or
  [block_k / 2, block_n] packed bytes) and dequantizes it in the tile;
* W4A16 iterates one quantization group per step (block_k = group_size): the dot runs on the
  integer codes minus the zero point, which are exact in bf16, and the group's scale multiplies
  the [block_m, block_n] partial sum, so no dequantized fp weight is formed at all. The two nibbles
  of a byte are rows 2i and 2i + 1 of W; instead of interleaving them in the tile, the wrapper
  splits x into its even and odd columns once (x_even @ W_lo + x_odd @ W_hi);
* W8A16 applies the per-channel scale once, after the loop.
Matmul operands: bf16 activations meet bf16 codes (exact) with fp32 accumulation; fp32 activations
use fp32 matmuls at Precision.HIGHEST.

TPU: the three kernels, lowered with interpret=False, compile with Mosaic (tested on v5p and v6e
slices at K = N = 1024; W4A16 also checked by hand on v5p at K = 4096 with groups 32/64/128, zero
points or not, bf16 and fp32 x). W4A16's group
loop is unrolled in Python: with a `fori_loop` Mosaic cannot prove its per-group lane slices
(group_size / 2 columns of x_even / x_odd) 128-aligned, nor the scale row 8-aligned
("CompileTimeMosaicUnprovenMemoryAccessAlignment"); static offsets it can. The unrolled body grows
with K / group_size (256 groups at K = 8192, G = 32).

W8A8: int8 x-blocks meet int8 weight blocks in an int32 accumulator (`preferred_element_type`), the
per-token and per-channel scales applied once after the loop; the sum is exact, so the kernel
equals the reference bit for bit.

Not yet: MARLIN's offline re-layout of the packed weights for the
kernel's tiles, GPU compilation and benchmarks (issue 18).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels.quantized_matmul import reference as ref

__all__ = ["matmul_w8a16", "matmul_w4a16", "matmul_w8a8"]


def _interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _dot(a, b, dtype):
    if dtype == jnp.float32:
        return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    # explicit DEFAULT: bf16 operands are exact here, and Mosaic refuses a bf16 matmul asked for fp32
    # contract precision (what jax_default_matmul_precision="highest" would request)
    return jnp.dot(a, b, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


def _pad_rows(x, block_m):
    m = x.shape[0]
    mp = -(-m // block_m) * block_m
    return (jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x), m


def _check_blocks(k, n, block_k, block_n, what):
    if n % block_n:
        raise ValueError(f"{what}: N={n} is not a multiple of block_n={block_n}; choose a block_n "
                         "that divides the output channels")
    if k % block_k:
        raise ValueError(f"{what}: K={k} is not a multiple of block_k={block_k}")


# ----------------------------------------------------------------------------- W8A16


def _w8_kernel(x_ref, q_ref, s_ref, o_ref, *, block_k: int, n_k: int):
    dtype = x_ref.dtype

    def body(i, acc):
        xs = x_ref[:, pl.ds(i * block_k, block_k)]
        qs = q_ref[pl.ds(i * block_k, block_k), :].astype(dtype)  # int8 codes are exact in bf16
        return acc + _dot(xs, qs, dtype)

    acc = lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)


def matmul_w8a16(x, q, s, *, block_m: int = 16, block_n: int = 128, block_k: int = 128, interpret=None):
    """x[M, K] @ (int8 q[K, N] * s[N]) as `reference.matmul_w8a16`, tiled (block_m, block_n) with a
    K loop of block_k inside the kernel. M is padded to a multiple of block_m."""
    if x.ndim != 2 or q.ndim != 2 or q.dtype != jnp.int8 or x.shape[1] != q.shape[0] or s.shape != (q.shape[1],):
        raise ValueError(f"matmul_w8a16 takes x[M, K], int8 q[K, N], s[N]; got x{x.shape}, "
                         f"q{q.shape} {q.dtype}, s{s.shape}")
    k, n = q.shape
    block_k = min(block_k, k)
    block_n = min(block_n, n)
    _check_blocks(k, n, block_k, block_n, "matmul_w8a16")
    xp, m = _pad_rows(x, block_m)
    out = pl.pallas_call(
        functools.partial(_w8_kernel, block_k=block_k, n_k=k // block_k),
        grid=(xp.shape[0] // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((block_n,), lambda i, j: (j,))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype),
        interpret=_interpret(interpret),
    )(xp, q, s.astype(jnp.float32))
    return out[:m]


# ----------------------------------------------------------------------------- W4A16


def _w4_kernel(*refs, group_size: int, n_groups: int, signed: bool, has_zero: bool):
    if has_zero:
        xe_ref, xo_ref, p_ref, s_ref, z_ref, o_ref = refs
    else:
        xe_ref, xo_ref, p_ref, s_ref, o_ref = refs
    dtype = xe_ref.dtype
    half = group_size // 2  # packed rows per group

    def codes(nibble, z):
        c = nibble.astype(jnp.int32)
        if signed:
            c = jnp.where(c > 7, c - 16, c)
        if z is not None:
            c = c - z[None, :]
        return c.astype(dtype)  # |c| <= 15: exact in bf16

    def body(g, acc):
        rows = pl.ds(g * half, half)
        packed = p_ref[rows, :].astype(jnp.int32)
        z = z_ref[g, :].astype(jnp.int32) if has_zero else None
        lo, hi = codes(packed & 15, z), codes(packed >> 4, z)
        part = _dot(xe_ref[:, rows], lo, dtype) + _dot(xo_ref[:, rows], hi, dtype)
        return acc + part * s_ref[g, :][None, :]

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for g in range(n_groups):  # static offsets: Mosaic can see the slices' alignment
        acc = body(g, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def matmul_w4a16(x, packed, s, z=None, *, block_m: int = 16, block_n: int = 128, interpret=None):
    """x[M, K] @ W, W given by `reference.pack_int4` codes [K / 2, N] (uint8), scales [K / G, N] and
    zero points [K / G, N] (or None: symmetric codes), as `reference.matmul_w4a16`; one group per
    K step inside the kernel. M is padded to a multiple of block_m."""
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(f"matmul_w4a16 takes x[M, K] and uint8 packed[K / 2, N]; got x{x.shape}, "
                         f"packed{packed.shape} {packed.dtype}")
    k, n = 2 * packed.shape[0], packed.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"matmul_w4a16: x has K={x.shape[1]}, the packed weights K={k}")
    if s.ndim != 2 or s.shape[1] != n or k % s.shape[0] or (z is not None and z.shape != s.shape):
        raise ValueError(f"matmul_w4a16: scales {s.shape} (zero points {None if z is None else z.shape}) "
                         f"do not match weights [K={k}, N={n}] in groups along K")
    group_size = k // s.shape[0]
    if group_size not in ref.GROUP_SIZES:
        raise ValueError(f"matmul_w4a16: group size K / groups = {group_size}; choose one of {ref.GROUP_SIZES}")
    block_n = min(block_n, n)
    _check_blocks(k, n, group_size, block_n, "matmul_w4a16")
    xp, m = _pad_rows(x, block_m)
    pairs = xp.reshape(xp.shape[0], k // 2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    groups = s.shape[0]
    in_specs = [pl.BlockSpec((block_m, k // 2), lambda i, j: (i, 0)),
                pl.BlockSpec((block_m, k // 2), lambda i, j: (i, 0)),
                pl.BlockSpec((k // 2, block_n), lambda i, j: (0, j)),
                pl.BlockSpec((groups, block_n), lambda i, j: (0, j))]
    args = [x_even, x_odd, packed, s.astype(jnp.float32)]
    if z is not None:
        in_specs.append(pl.BlockSpec((groups, block_n), lambda i, j: (0, j)))
        args.append(z.astype(jnp.int8))
    out = pl.pallas_call(
        functools.partial(_w4_kernel, group_size=group_size, n_groups=groups, signed=z is None,
                          has_zero=z is not None),
        grid=(xp.shape[0] // block_m, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), x.dtype),
        interpret=_interpret(interpret),
    )(*args)
    return out[:m]


# ----------------------------------------------------------------------------- W8A8


def _w8a8_kernel(x_ref, q_ref, sx_ref, sw_ref, o_ref, *, block_k: int, n_k: int):
    def body(i, acc):
        xs = x_ref[:, pl.ds(i * block_k, block_k)]
        qs = q_ref[pl.ds(i * block_k, block_k), :]
        return acc + jnp.dot(xs, qs, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.int32)

    acc = lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, jnp.int32))
    o_ref[...] = (acc.astype(jnp.float32) * sx_ref[...][:, None] * sw_ref[...][None, :]).astype(o_ref.dtype)


def matmul_w8a8(xq, sx, wq, sw, out_dtype=jnp.bfloat16, *, block_m: int = 32, block_n: int = 128,
                block_k: int = 128, interpret=None):
    """int8 xq[M, K] @ int8 wq[K, N] with an int32 accumulator, times sx[M] and sw[N], as
    `reference.matmul_w8a8`. M is padded to a multiple of block_m (32: int8 tiles are (32, 128))."""
    if xq.dtype != jnp.int8 or wq.dtype != jnp.int8:
        raise ValueError(f"matmul_w8a8 takes int8 operands; got {xq.dtype} and {wq.dtype}")
    if (xq.ndim != 2 or wq.ndim != 2 or xq.shape[1] != wq.shape[0] or sx.shape != (xq.shape[0],)
            or sw.shape != (wq.shape[1],)):
        raise ValueError(f"matmul_w8a8 takes xq[M, K], sx[M], wq[K, N], sw[N]; got xq{xq.shape}, "
                         f"sx{sx.shape}, wq{wq.shape}, sw{sw.shape}")
    k, n = wq.shape
    block_k, block_n = min(block_k, k), min(block_n, n)
    _check_blocks(k, n, block_k, block_n, "matmul_w8a8")
    xp, m = _pad_rows(xq, block_m)
    sxp = jnp.pad(sx.astype(jnp.float32), (0, xp.shape[0] - m))
    out = pl.pallas_call(
        functools.partial(_w8a8_kernel, block_k=block_k, n_k=k // block_k),
        grid=(xp.shape[0] // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((block_m,), lambda i, j: (i,)),
                  pl.BlockSpec((block_n,), lambda i, j: (j,))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], n), out_dtype),
        interpret=_interpret(interpret),
    )(xp, wq, sxp, sw.astype(jnp.float32))
    return out[:m]
