"""A LoRA-wrapped weight (Hu et al. 2021): the frozen base and two low-rank factors,

    W x  ->  W x + (alpha / r) (x A) B          A [in dims..., r], B [r, out dims...]

as one pytree node, `LoRA(base, lora_a, lora_b)`, whose scale alpha / r and dropout rate are static
(the node's metadata), so that they travel with the weight through the layer scan, jit and the
checkpoint's tree. The base is a float weight or a quantized one (models/quant.py: QLoRA,
Dettmers et al. 2023). `quant.linear`, the one matmul every dense projection goes through, adds
`low_rank(x, w)` when it sees a LoRA node, so the model code knows nothing of adapters.

Sharding follows from the factors' logical axes (models/adapters.py gives them their ParamSpecs):
A carries the base's contracted axes and an unsharded rank axis, B the rank axis and the base's
output axes. FSDP therefore gathers them like the base, and tensor parallelism splits them like
the base: a column-parallel projection (wq: [embed, heads, head_dim]) keeps A whole and splits B
over heads; a row-parallel one (wo: [heads, head_dim, embed]) splits A over heads and keeps B
whole, and its per-rank (x_i A_i) B is a partial sum that the block's existing all-reduce adds up
with the base's. The factor that a rank holds whole gets a partial gradient there (each rank
contracts only its heads), which `ParamSpec.partial` makes `zero.plan` sum over `tensor`.

Dropout (config.lora.dropout) applies to the adapter's input only, while training, with a key
the step gives the node (`key`, set for one layer by `execution.weights_as_used`'s hook).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LoRA:
    base: Any  # the frozen weight: an array, or a quantized weight's dict of codes and scales
    lora_a: Any  # A [lead..., in dims..., r]
    lora_b: Any  # B [lead..., r, out dims...], zero at initialisation
    scale: float = 1.0  # alpha / r (static)
    dropout: float = 0.0  # dropout rate on the adapter's input (static)
    key: Any = None  # a PRNG key while one layer runs with dropout; None at rest


jax.tree_util.register_dataclass(
    LoRA, data_fields=["base", "lora_a", "lora_b", "key"], meta_fields=["scale", "dropout"]
)


def is_lora(x) -> bool:
    return isinstance(x, LoRA)


def low_rank(x, w: LoRA, contracted: int):
    """scale * (dropout(x) A) B for x[..., in dims] (the last `contracted` dimensions of x are the
    base's contracted ones): [..., out dims]. With B = 0 this is exactly zero."""
    if w.dropout > 0 and w.key is not None:
        keep = jax.random.bernoulli(w.key, 1.0 - w.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - w.dropout), jnp.zeros_like(x))
    xa = jnp.tensordot(x, w.lora_a.astype(x.dtype), axes=contracted)  # [..., r]
    return jnp.tensordot(xa, w.lora_b.astype(x.dtype), axes=1) * jnp.asarray(w.scale, x.dtype)
