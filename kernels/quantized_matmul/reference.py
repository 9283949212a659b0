"""Pure-JAX quantized matmuls: the exact semantics the Pallas kernels will be tested against.

Weights are [K, N] (K the contracted input dimension, N the output channels), as jaxsys stores a
dense layer (`w_up [D, F]`); activations are [M, K] (M = tokens).

W8A16   int8 weights, one fp32 scale per output channel (symmetric, q in [-127, 127]):
        w ~ q * s[n];   y = (x @ q) * s, accumulated in fp32.
W4A16   4-bit weights in groups of G consecutive k (G = 32 / 64 / 128) with one fp32 scale per
        (group, channel) and, optionally, a zero point:
          symmetric:   q in [-8, 7],  w ~ q * s
          asymmetric:  q in [0, 15],  w ~ (q - z) * s,  z an integer in [0, 15]
        Two values per byte along K (`pack_int4`, the canonical layout): byte [k // 2, n] holds k
        even in its low nibble and k odd in its high nibble, as two's complement (symmetric) or
        unsigned (asymmetric) nibbles. y = x @ dequantize(W), accumulated in fp32.
        The kernel layout (`repack_w4`, what kernel.matmul_w4a16 takes) reorders the nibbles within
        each group: byte row g*G/2 + r holds k = g*G + r (low) and k = g*G + G/2 + r (high), r < G/2.
        Each group's rows hold that group only, so any row range covering whole groups (a
        tensor-parallel shard over K) is itself valid kernel layout.
W8A8    int8 activations with one fp32 scale per token (row of x) and int8 weights with one per
        channel: y[m, n] = (sum_k xq[m, k] wq[k, n]) * sx[m] * sw[n], the sum in int32 (exact:
        |sum| <= K * 127^2 < 2^31 for K < 133,000).
W4Ax    W4A16's 4-bit weights (symmetric, or with zero points) met by integer activations, COMET's
        W4A8 and W4A4: 8-bit codes with one scale per token (`quantize_per_token`, sx[M]), or 4-bit
        codes in [-8, 7] with one scale per token and group of G k (`quantize_per_token_group`,
        sx[M, K / G], Atom's activation groups). Each group's product is an exact int32 sum:
            y[m, n] = sum_g (sum_{k in g} xq[m, k] (q[k, n] - z[g, n])) * sw[g, n] * sx[m(, g)]
        the sum over groups in fp32.
Rotation (QuaRot's incoherence, on blocks): `hadamard(G)` is the orthonormal Sylvester matrix,
        symmetric, so H H = I and x W = (x H_blocks)(H_blocks W) with H_blocks block-diagonal in
        blocks of G along K (`rotate_groups`). Stored weights may be H_blocks W; the activations are
        then rotated at run time, which spreads an outlier channel over its block before rounding.

Rounding is round-half-to-even (jnp.round), the quantizers' scales are max|.| / qmax (a zero
channel or group gets scale 1 so that nothing divides by zero), and every result is cast to the
activation dtype at the end.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "quantize_w8",
    "matmul_w8a16",
    "quantize_w4",
    "pack_int4",
    "unpack_int4",
    "repack_w4",
    "unrepack_w4",
    "dequantize_w4",
    "matmul_w4a16",
    "quantize_per_token",
    "matmul_w8a8",
    "quantize_per_token_group",
    "matmul_w4ax",
    "hadamard",
    "rotate_groups",
    "GROUP_SIZES",
]

GROUP_SIZES = (32, 64, 128)


def _scale(absmax, qmax):
    return jnp.where(absmax > 0, absmax / qmax, 1.0).astype(jnp.float32)


def _check_2d(name, a):
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D; got shape {a.shape}")


# ----------------------------------------------------------------------------- W8A16


def quantize_w8(w):
    """int8 weights [K, N] and per-channel fp32 scales [N] (symmetric, round to nearest)."""
    _check_2d("w", w)
    s = _scale(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0), 127.0)
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / s), -127, 127).astype(jnp.int8)
    return q, s


def matmul_w8a16(x, q, s):
    """x[M, K] (bf16 / fp32) @ int8 q[K, N] with scales s[N]: (x @ q) * s in fp32, cast to x.dtype."""
    _check_2d("x", x)
    _check_2d("q", q)
    if q.dtype != jnp.int8 or x.shape[1] != q.shape[0] or s.shape != (q.shape[1],):
        raise ValueError(
            f"matmul_w8a16 takes x[M, K], int8 q[K, N], s[N]; got x{x.shape}, q{q.shape} {q.dtype}, s{s.shape}"
        )
    acc = jnp.dot(x.astype(jnp.float32), q.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return (acc * s[None, :]).astype(x.dtype)


# ----------------------------------------------------------------------------- W4A16


def _check_groups(k, group_size):
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: choose one of {GROUP_SIZES}")
    if k % group_size:
        raise ValueError(
            f"K={k} is not a multiple of group_size={group_size}: pick a group size that divides the input dimension"
        )


def quantize_w4(w, group_size: int = 128, zero_point: bool = False):
    """4-bit weights of w[K, N] in groups of `group_size` along K: (q int8 holding the 4-bit values,
    scales [K / G, N] fp32, zero points [K / G, N] int8 or None)."""
    _check_2d("w", w)
    k, n = w.shape
    _check_groups(k, group_size)
    g = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
    if zero_point:
        lo, hi = jnp.min(g, axis=1), jnp.max(g, axis=1)
        s = _scale(hi - lo, 15.0)
        z = jnp.clip(jnp.round(-lo / s), 0, 15)
        q = jnp.clip(jnp.round(g / s[:, None]) + z[:, None], 0, 15)
        return q.reshape(k, n).astype(jnp.int8), s, z.astype(jnp.int8)
    s = _scale(jnp.max(jnp.abs(g), axis=1), 7.0)
    q = jnp.clip(jnp.round(g / s[:, None]), -8, 7)
    return q.reshape(k, n).astype(jnp.int8), s, None


def pack_int4(q):
    """int8 q[K, N] holding 4-bit values ([-8, 7] or [0, 15]) -> uint8 [K / 2, N], two per byte:
    row 2i in the low nibble, row 2i + 1 in the high nibble."""
    _check_2d("q", q)
    if q.shape[0] % 2:
        raise ValueError(f"pack_int4 needs an even K; got q{q.shape}")
    nibbles = q.astype(jnp.uint8) & jnp.uint8(0xF)
    return nibbles[0::2] | (nibbles[1::2] << jnp.uint8(4))


def unpack_int4(packed, signed: bool):
    """uint8 [K / 2, N] -> int8 [K, N]: the inverse of `pack_int4` (two's complement if `signed`)."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed int4 weights must be uint8; got {packed.dtype}")
    lo, hi = packed & jnp.uint8(0xF), packed >> jnp.uint8(4)
    q = jnp.stack([lo, hi], axis=1).reshape(2 * packed.shape[0], packed.shape[1]).astype(jnp.int8)
    return jnp.where(q > 7, q - 16, q).astype(jnp.int8) if signed else q


def _nibble_groups(packed, group_size: int, what: str):
    if packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(f"{what} takes uint8 packed[K / 2, N]; got {packed.shape} {packed.dtype}")
    _check_groups(2 * packed.shape[0], group_size)
    return 2 * packed.shape[0] // group_size, group_size // 2, packed.shape[1]


def repack_w4(packed, group_size: int):
    """Canonical `pack_int4` bytes [K / 2, N] -> the kernel layout [K / 2, N] (uint8): in group g,
    byte row g*G/2 + r holds k = g*G + r in its low nibble and k = g*G + G/2 + r in its high one,
    so the kernel multiplies the low nibbles by x[:, gG : gG + G/2] and the high ones by
    x[:, gG + G/2 : (g+1)G], two contiguous slices. Works on nibbles: signedness is kept."""
    groups, half, n = _nibble_groups(packed, group_size, "repack_w4")
    nib = jnp.stack([packed & jnp.uint8(0xF), packed >> jnp.uint8(4)], axis=1)  # [K/2, 2, N]: k = 2i, 2i+1
    nib = nib.reshape(groups, 2, half, n)  # k within the group = 0..G/2-1, then G/2..G-1
    return (nib[:, 0] | (nib[:, 1] << jnp.uint8(4))).reshape(groups * half, n)


def unrepack_w4(repacked, group_size: int):
    """The inverse of `repack_w4`: kernel-layout bytes [K / 2, N] -> canonical `pack_int4` bytes."""
    groups, half, n = _nibble_groups(repacked, group_size, "unrepack_w4")
    r = repacked.reshape(groups, half, n)
    nib = jnp.stack([r & jnp.uint8(0xF), r >> jnp.uint8(4)], axis=1).reshape(2 * groups * half, n)
    return nib[0::2] | (nib[1::2] << jnp.uint8(4))


def dequantize_w4(packed, s, z=None):
    """fp32 W[K, N] from canonically packed (`pack_int4`) 4-bit weights, scales [K / G, N] and zero
    points (or None)."""
    q = unpack_int4(packed, signed=z is None).astype(jnp.float32)
    k, n = q.shape
    groups = s.shape[0]
    if s.shape[1] != n or k % groups or (z is not None and z.shape != s.shape):
        raise ValueError(
            f"scales {s.shape} (and zero points {None if z is None else z.shape}) do not "
            f"match weights [K={k}, N={n}] in groups along K"
        )
    q = q.reshape(groups, k // groups, n)
    if z is not None:
        q = q - z.astype(jnp.float32)[:, None]
    return (q * s[:, None]).reshape(k, n)


def matmul_w4a16(x, packed, s, z=None):
    """x[M, K] @ dequantize_w4(packed, s, z), accumulated in fp32, cast to x.dtype; `packed` in the
    canonical `pack_int4` layout (the kernel's takes `repack_w4` of it)."""
    _check_2d("x", x)
    w = dequantize_w4(packed, s, z)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x{x.shape} and packed weights of K={w.shape[0]} do not contract")
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)


# ----------------------------------------------------------------------------- W8A8


def quantize_per_token(x):
    """int8 x[M, K] and per-token fp32 scales [M] (symmetric)."""
    _check_2d("x", x)
    s = _scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 127.0)
    return jnp.clip(jnp.round(x.astype(jnp.float32) / s[:, None]), -127, 127).astype(jnp.int8), s


def matmul_w8a8(xq, sx, wq, sw, out_dtype=jnp.bfloat16):
    """int8 xq[M, K] @ int8 wq[K, N], int32 accumulate, times sx[M] sw[N], in `out_dtype`."""
    if xq.dtype != jnp.int8 or wq.dtype != jnp.int8:
        raise ValueError(f"matmul_w8a8 takes int8 operands; got {xq.dtype} and {wq.dtype}")
    if xq.shape[1] != wq.shape[0] or sx.shape != (xq.shape[0],) or sw.shape != (wq.shape[1],):
        raise ValueError(
            f"matmul_w8a8 takes xq[M, K], sx[M], wq[K, N], sw[N]; got xq{xq.shape}, "
            f"sx{sx.shape}, wq{wq.shape}, sw{sw.shape}"
        )
    acc = lax.dot(xq, wq, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * sx[:, None] * sw[None, :]).astype(out_dtype)


# ----------------------------------------------------------------------------- W4Ax (W4A8, W4A4)


def quantize_per_token_group(x, group_size: int, bits: int = 4):
    """Codes of x[M, K] with one fp32 scale per token and group of `group_size` k: int8 [M, K]
    holding `bits`-bit values in [-2^(b-1), 2^(b-1) - 1] (scale = max|.| / (2^(b-1) - 1), as
    `quantize_w4`), scales [M, K / G]."""
    _check_2d("x", x)
    m, k = x.shape
    _check_groups(k, group_size)
    qmax = float(2 ** (bits - 1) - 1)
    g = x.astype(jnp.float32).reshape(m, k // group_size, group_size)
    s = _scale(jnp.max(jnp.abs(g), axis=2), qmax)
    q = jnp.clip(jnp.round(g / s[:, :, None]), -qmax - 1, qmax)
    return q.reshape(m, k).astype(jnp.int8), s


def matmul_w4ax(xq, sx, packed, sw, z=None, out_dtype=jnp.bfloat16):
    """Integer activations xq[M, K] (int8 codes) with scales sx[M] (per token: W4A8) or sx[M, K / G]
    (per token and group: W4A4) @ canonically packed (`pack_int4`) 4-bit weights with scales
    sw[K / G, N] and zero points z (or None): each group's sum exact in int32, scaled and summed
    over groups in fp32, cast to `out_dtype`."""
    _check_2d("xq", xq)
    if xq.dtype != jnp.int8:
        raise ValueError(f"matmul_w4ax takes int8 activation codes; got {xq.dtype}")
    q = unpack_int4(packed, signed=z is None).astype(jnp.int32)
    (m, k), n = xq.shape, q.shape[1]
    groups = sw.shape[0]
    if q.shape[0] != k or sw.shape[1] != n or k % groups or (z is not None and z.shape != sw.shape):
        raise ValueError(
            f"matmul_w4ax: xq{xq.shape}, weights [K={q.shape[0]}, N={n}], scales {sw.shape} and zero "
            f"points {None if z is None else z.shape} do not match in groups along K"
        )
    if sx.shape not in ((m,), (m, groups)):
        raise ValueError(f"matmul_w4ax: sx{sx.shape} must be [M] = ({m},) or [M, K / G] = ({m}, {groups})")
    q = q.reshape(groups, k // groups, n)
    if z is not None:
        q = q - z.astype(jnp.int32)[:, None]
    xg = xq.astype(jnp.int32).reshape(m, groups, k // groups)
    partial = jnp.einsum("mgk,gkn->mgn", xg, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    partial = partial * sw[None].astype(jnp.float32)
    if sx.ndim == 2:
        return jnp.einsum("mgn,mg->mn", partial, sx.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(
            out_dtype
        )
    return (jnp.sum(partial, axis=1) * sx.astype(jnp.float32)[:, None]).astype(out_dtype)


# ----------------------------------------------------------------------------- rotation


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two), fp32: symmetric, its
    own inverse, every entry +-1 / sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard({n}): the size must be a power of two")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate_groups(a, group_size: int, axis: int = -1):
    """a with each block of `group_size` along `axis` multiplied by `hadamard(group_size)` (in fp32,
    returned in a's dtype): x H_blocks for activations (axis -1), H_blocks W for a weight's K rows
    (axis 0; H is symmetric). Applied twice it is the identity."""
    axis = axis % a.ndim
    k = a.shape[axis]
    _check_groups(k, group_size)
    moved = jnp.moveaxis(a.astype(jnp.float32), axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], k // group_size, group_size)
    out = jnp.einsum("...gi,ij->...gj", blocks, jnp.asarray(hadamard(group_size)), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(out.reshape(moved.shape), -1, axis).astype(a.dtype)
