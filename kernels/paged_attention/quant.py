"""A quantized paged KV cache (KIVI, Liu et al. 2024): the quantizer, the page layout, and the
pure-JAX reference of decode attention over it. kernel_quant.py is the Pallas kernel; the cache's
place in the serving engine (which pages are quantized, the seal step) is docs/kv_quant.md.

Quantizer. Asymmetric uniform quantization to b bits (2, 4 or 8) with statistics over one axis:
    mn = min x, s = (max x - mn) / (2^b - 1)  (s = 1 where max == min),
both rounded to the storage dtype of the scales (the cache's dtype), then
    q = clip(round((x - mn) / s), 0, 2^b - 1),   x ~ q s + mn
with the rounded s and mn, so dequantization reproduces exactly what the codes were chosen for.
Rounding is round-half-to-even (jnp.round) in fp32. `quantize` / `dequantize` take the axis (or
axes) to reduce: KIVI quantizes keys PER CHANNEL (statistics over the tokens of a group: one
(scale, zero) per group, kv head and channel; key outliers live in fixed channels) and values
PER TOKEN (statistics over the head dim: one per token and kv head). `fake_quant` is both, on a
contiguous [B, T, K, H] tensor, along either axis and for any group size.

Pages. A quantized page of one layer, P pages of page_size tokens, K kv heads, head dim H:
    codes   uint8 [P, page_size, K, H * b / 8]   b-bit codes packed along H (below)
    scale   [P, 1, K, H] per channel (keys of kivi2 / kivi4) or [P, page_size, K, 1] per token
    zero    as scale: the minimum mn (a float zero point, as KIVI's)
in the scale dtype. Scales and zeros broadcast against [P, page_size, K, H], so one dequantize
serves both axes. MODES gives each cache format's (bits, key axis, value axis):
    int8    8 bits, keys and values per token (the simplest baseline)
    kivi4   4 bits, keys per channel over the page, values per token
    kivi2   2 bits, likewise
Packing ("split halves" along H, as quantized_matmul's repack_w4 splits a group): with
n = 8 / b codes per byte and Hp = H / n, byte j holds the codes of channels j, Hp + j, 2 Hp + j,
..., channel i Hp + j in bits [i b, (i + 1) b). Part i of a page (channels [i Hp, (i + 1) Hp)) is
then one shift and mask of the whole byte tile: the kernel never interleaves lanes.

Reference attention (`paged_attention_quant_reference`). A sequence's page i is read from the
quantized pool (page id quant_table[b, i], dequantized) when i < n_quant = max(length //
page_size - residual, 0), i.e. when the page is full and at least `residual` full pages precede
the current one; otherwise from the full-precision pool (page id fp_table[b, i]). Then the same
attention as reference.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxsys.kernels.paged_attention.reference import contiguous_attention

__all__ = [
    "MODES",
    "AXES",
    "quantize",
    "dequantize",
    "fake_quant",
    "pack",
    "unpack",
    "quantize_pages",
    "dequantize_pages",
    "page_shapes",
    "bytes_per_token",
    "n_quant",
    "paged_attention_quant_reference",
]

AXES = ("channel", "token")
# cache format -> (bits, key axis, value axis)
MODES = {"int8": (8, "token", "token"), "kivi4": (4, "channel", "token"), "kivi2": (2, "channel", "token")}
BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits}: choose one of {BITS}")


def quantize(x, bits: int, axis, scale_dtype=jnp.float32):
    """x -> (codes uint8, one per element, in [0, 2^bits); scale; zero), statistics reduced over
    `axis` (an int or a tuple; kept as size-1 dims), scale and zero in `scale_dtype`."""
    _check_bits(bits)
    x = x.astype(jnp.float32)
    top = float(2**bits - 1)
    mn, mx = jnp.min(x, axis=axis, keepdims=True), jnp.max(x, axis=axis, keepdims=True)
    s = jnp.where(mx > mn, (mx - mn) / top, 1.0).astype(scale_dtype)
    z = mn.astype(scale_dtype)
    codes = jnp.clip(jnp.round((x - z.astype(jnp.float32)) / s.astype(jnp.float32)), 0, top)
    return codes.astype(jnp.uint8), s, z


def dequantize(codes, scale, zero):
    """codes * scale + zero in fp32 (broadcasting the statistics' size-1 dims)."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32) + zero.astype(jnp.float32)


def fake_quant(x, bits: int, axis: str, group: int | None = None):
    """Quantize and dequantize x[B, T, K, H] (fp32 out). axis "token": one (scale, zero) per token
    and head, over H. axis "channel": one per group of `group` consecutive tokens, head and
    channel (T is padded to whole groups by repeating the last token, which changes no min/max;
    group None: the whole T is one group)."""
    if axis not in AXES:
        raise ValueError(f"axis={axis!r}: choose one of {AXES}")
    if axis == "token":
        return dequantize(*quantize(x, bits, axis=-1))
    b, t, kh, h = x.shape
    g = t if group is None else group
    pad = -t % g
    xp = jnp.concatenate([x, jnp.repeat(x[:, -1:], pad, axis=1)], axis=1) if pad else x
    xg = xp.reshape(b, (t + pad) // g, g, kh, h)
    return dequantize(*quantize(xg, bits, axis=2)).reshape(b, t + pad, kh, h)[:, :t]


# ----------------------------------------------------------------------------- packing


def pack(codes, bits: int):
    """uint8 codes [..., H] (values < 2^bits) -> uint8 [..., H * bits / 8], split halves (module
    docstring)."""
    _check_bits(bits)
    n = 8 // bits
    h = codes.shape[-1]
    if h % n:
        raise ValueError(f"the head dim H={h} must be a multiple of {n} to pack {bits}-bit codes")
    parts = codes.reshape(*codes.shape[:-1], n, h // n)
    out = parts[..., 0, :]
    for i in range(1, n):
        out = out | (parts[..., i, :] << jnp.uint8(bits * i))
    return out


def unpack(packed, bits: int):
    """The inverse of `pack`: uint8 [..., Hp] -> codes uint8 [..., Hp * 8 / bits]."""
    _check_bits(bits)
    n = 8 // bits
    mask = jnp.uint8(2**bits - 1)
    parts = [(packed >> jnp.uint8(bits * i)) & mask for i in range(n)]
    return jnp.concatenate(parts, axis=-1)


# ----------------------------------------------------------------------------- pages


def _stat_axis(axis: str):
    """Axis of page tensors [..., page_size, K, H] that statistics reduce over."""
    return -3 if axis == "channel" else -1


def page_shapes(mode: str, num_pages: int, page_size: int, kv_heads: int, head_dim: int) -> dict:
    """Shapes of one layer's quantized pool: {"kq", "vq" (codes), "ks", "kz", "vs", "vz"}."""
    bits, k_axis, v_axis = MODES[mode]
    stat = lambda axis: (num_pages, 1, kv_heads, head_dim) if axis == "channel" else (num_pages, page_size, kv_heads, 1)
    codes = (num_pages, page_size, kv_heads, head_dim * bits // 8)
    return {"kq": codes, "vq": codes, "ks": stat(k_axis), "kz": stat(k_axis), "vs": stat(v_axis), "vz": stat(v_axis)}


def quantize_pages(k_pages, v_pages, mode: str, scale_dtype) -> dict:
    """Full-precision pages k/v [..., page_size, K, H] (e.g. [P, ...] or [L, P, ...]) -> the
    quantized pages of `page_shapes` (with the same leading dims)."""
    bits, k_axis, v_axis = MODES[mode]
    kc, ks, kz = quantize(k_pages, bits, _stat_axis(k_axis), scale_dtype)
    vc, vs, vz = quantize(v_pages, bits, _stat_axis(v_axis), scale_dtype)
    return {"kq": pack(kc, bits), "vq": pack(vc, bits), "ks": ks, "kz": kz, "vs": vs, "vz": vz}


def dequantize_pages(pages: dict, mode: str):
    """The quantized pages of `page_shapes` -> fp32 (k, v) [P, page_size, K, H]."""
    bits = MODES[mode][0]
    return (
        dequantize(unpack(pages["kq"], bits), pages["ks"], pages["kz"]),
        dequantize(unpack(pages["vq"], bits), pages["vs"], pages["vz"]),
    )


def bytes_per_token(
    mode: str, page_size: int, kv_heads: int, head_dim: int, layers: int = 1, fp_bytes: int = 2, scale_bytes: int = 2
) -> float:
    """KV bytes per cached token (keys and values, all layers), scales and zeros amortised over
    their page; mode "none" stores fp_bytes per element."""
    if mode == "none":
        return 2.0 * layers * kv_heads * head_dim * fp_bytes
    shapes = page_shapes(mode, 1, page_size, kv_heads, head_dim)
    per_page = sum(int(np.prod(s)) * (1 if name in ("kq", "vq") else scale_bytes) for name, s in shapes.items())
    return layers * per_page / page_size


def n_quant(lengths, page_size: int, residual: int):
    """Pages read from the quantized pool for a query at cache length `lengths`: the full pages
    but the last `residual` of them."""
    return jnp.maximum(lengths // page_size - residual, 0)


def paged_attention_quant_reference(
    q,
    k_pages,
    v_pages,
    quant: dict,
    quant_table,
    fp_table,
    lengths,
    *,
    mode: str,
    residual: int = 0,
    quant_pages=None,
    scale=None,
    window=None,
    softcap=None,
):
    """Decode attention over a quantized paged cache (module docstring): q [B, N, H]; k/v_pages
    [Pf, page_size, K, H] the full-precision pool; `quant` the quantized pool (`page_shapes`, Pq
    pages); quant_table, fp_table [B, max_pages]; lengths [B]; quant_pages [B] the pages read
    quantized (default n_quant(lengths, page_size, residual)); window / softcap as
    reference.contiguous_attention. Returns [B, N, H] in q.dtype."""
    b, max_pages = quant_table.shape
    page_size = k_pages.shape[1]
    kd, vd = dequantize_pages(quant, mode)
    if quant_pages is None:
        quant_pages = n_quant(lengths, page_size, residual)
    use_q = jnp.arange(max_pages)[None, :] < quant_pages[:, None]  # [B, max_pages]
    sel = lambda deq, fp: jnp.where(
        use_q[:, :, None, None, None], deq[quant_table], fp.astype(jnp.float32)[fp_table]
    ).reshape(b, max_pages * page_size, *fp.shape[2:])
    return contiguous_attention(q, sel(kd, k_pages), sel(vd, v_pages), lengths, scale, window, softcap)
