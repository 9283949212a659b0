"""DiLoCo's one collective (Douillard et al. 2023; Streaming DiLoCo, Douillard et al. 2025): the mean
over the islands (the ranks of the `data` axis) of their outer gradients, every H inner steps
instead of a gradient all-reduce every step (jaxsys/optim/outer.py, docs/diloco.md).

    full precision: one all-reduce of the fragment's f32 outer gradient over `data`
    quantized (int8 / int4): each island's codes (int4 packed two to a byte) and per-block f32
        scales are all-gathered over `data`; every island dequantizes the M copies and averages them
        in f32 (Streaming DiLoCo's "communicate in low precision, accumulate in f32"). An all-reduce
        cannot sum the codes: islands' scales differ.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

ISLAND_AXIS = "data"


def island_mean(x):
    """The mean of `x` over the islands (an all-reduce over `data`, f32)."""
    return lax.psum(x, ISLAND_AXIS) / lax.axis_size(ISLAND_AXIS)


def island_mean_quantized(x, quantize, dequantize):
    """(the mean over the islands of `dequantize(*quantize(x))` of every island, this island's own
    `dequantize(*quantize(x))`): all-gather of the codes and scales (`quantize(x) -> (codes,
    scales)`, both arrays), dequantized and averaged here. `dequantize(codes, scales) -> array
    shaped as x`."""
    codes, scales = quantize(x)
    all_codes = lax.all_gather(codes, ISLAND_AXIS)  # [M, ...codes]
    all_scales = lax.all_gather(scales, ISLAND_AXIS)
    total = jnp.zeros(x.shape, jnp.float32)
    for i in range(all_codes.shape[0]):  # M is small (islands): unrolled
        total = total + dequantize(all_codes[i], all_scales[i])
    return total / all_codes.shape[0], dequantize(codes, scales)
