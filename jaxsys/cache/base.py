"""The interface every KV cache implements (jaxsys/cache/__init__.py says which caches exist).

A cache is a pytree dataclass. Its *layer fields* hold one array per layer, stacked on a leading
L dimension ([L, ...]); its other fields (page tables, read views) are shared by every layer and
its static fields (a quantization mode) are part of its type. The layer stack scans the layer
fields beside the weights: `per_layer()` gives them, `with_layers(...)` puts a layer's (or all
layers') arrays back, and the model's attention calls one method on one layer's cache:

    o, cache = cache.attend(q, k, v, positions)

which writes this step's keys and values k, v [B, T, K, H] at `positions` [B, T] and attends to
the cache with q [B, T, N, H], returning o [B, T, N, H] and the cache with the writes. H here is
`head_dim(m)` (the model's padded to a power of two, or a latent cache's row). Shapes are
per device (this device's sequences or rows, and its K / tensor kv heads). A sliding-window layer
passes `window=W`: each query then sees only its last W positions. A model with attention logit
soft-capping (Gemma 2) passes `softcap=c`: the scaled scores s become c * tanh(s / c) before the
mask and the softmax (None or 0: no cap).

A *latent* cache (multi-head latent attention with `config.model.mla.cache = "latent"`, the
default; models/mla.py) holds one row per token, MLA's normed latent and rotated key tail
[C + R] (padded to a multiple of 16, H_c): K = 1 "kv head", its `v` None, and `attend(q, k, None, ...)` reads each
row as both key and value (the model takes the value's first C dims). The row is the same on every
tensor rank (every rank computes all the latents), so its pool is replicated over `tensor`
(LATENT_POOL), not split over kv heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

# where a cache's arrays live on the mesh: pools split like the activations (the batch over the
# batch axes, kv heads over `tensor`), per-row metadata split with the rows
POOL = ("layers", "batch", None, "kv_heads", None)  # [L, B or pages, S or page slots, K, H]
LATENT_POOL = ("layers", "batch", None, None, None)  # [L, B or pages, S or slots, 1, H_c]: whole on every tensor rank
ROWS = ("batch", None)  # [rows, ...]
ROW = ("batch",)  # [rows]


def latent(m) -> bool:
    """Whether the caches hold MLA's latent per token (config.model.mla.cache = "latent") rather
    than the expanded per-head keys and values."""
    return bool(m.mla.kv_lora_rank) and m.mla.cache == "latent"


def head_dim(m) -> int:
    """H_c, the head dim the caches hold: the model's head_dim rounded up to a power of two (the
    quantized paged kernels' Triton tiles need one; 12 -> 16, 96 -> 128, MLA's expanded 192 ->
    256), or a latent cache's row C + R rounded up to a multiple of 16 (512 + 64 = 576 as it is:
    the plain paged kernels take a head dim in power-of-two parts, `kernel.head_parts`). The model
    pads q, k and v to it before `attend`, q scaled by (H_c / H)^0.5 so that every score is
    unchanged, and cuts the output back (transformer.block)."""
    if latent(m):
        return -(-(m.mla.kv_lora_rank + m.mla.rope_head_dim) // 16) * 16
    return 1 << (m.head_dim - 1).bit_length()


def kv_heads(m) -> int:
    """K_c, the kv heads a cache row holds: the model's n_kv_heads, or 1 (a latent cache)."""
    return 1 if latent(m) else m.n_kv_heads


def pool_spec(m) -> tuple:
    """The logical axes of the model's cache pools: POOL, or LATENT_POOL for a latent cache."""
    return LATENT_POOL if latent(m) else POOL


def pools(m, pages: int, slots: int) -> tuple[tuple[int, ...], int]:
    """The shape [L, pages, slots, K_c, H_c] of each of the model's cache pools and how many
    there are (2: keys and values; 1: a latent cache's rows)."""
    return (m.n_layers, pages, slots, kv_heads(m), head_dim(m)), 1 if latent(m) else 2


def empty_pools(program, pages: int, slots: int) -> tuple[Any, Any]:
    """(k, v) zero pools [L, pages, slots, K_c, H_c] of `program`'s model on its mesh, in the
    compute dtype, split as `pool_spec` says; v None for a latent cache."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    m = program.config.model
    shape, count = pools(m, pages, slots)
    sharding = NamedSharding(program.mesh, program.layout.compute_spec(pool_spec(m)))
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(m.compute_dtype)), out_shardings=sharding)
    return zeros(), zeros() if count == 2 else None


def token_bytes(m, tensor: int = 1) -> float:
    """Bytes of cache one token takes on one device of `tensor` tensor ranks, all layers, in the
    compute dtype: keys and values of its share of the kv heads (K_c / min(tensor, K_c) each), or
    the whole latent row on every rank."""
    (layers, _, _, k, h), n = pools(m, 1, 1)
    share = k if latent(m) else k / min(tensor, k)
    return n * layers * share * h * np.dtype(m.compute_dtype).itemsize


def static(default=None):
    """A static (hashable, part of the type) dataclass field."""
    return dataclasses.field(default=default, metadata=dict(static=True))


class KVCache:
    """Base of the cache types: `layer_fields` names the [L, ...] arrays; subclasses give `attend`
    and, when they carry more than pools, `row_fields` (their [rows, ...] metadata)."""

    layer_fields: ClassVar[tuple[str, ...]] = ()
    row_fields: ClassVar[tuple[str, ...]] = ()

    def attend(self, q, k, v, positions, window=None, softcap=None):
        """Write this step's k, v at `positions`, then attend with q over the cache (with `window`
        W, a sliding-window layer's: each query's last W positions only; with `softcap` c, scores
        soft-capped to c * tanh(s / c)) -> (o, cache)."""
        raise NotImplementedError

    @property
    def latent(self) -> bool:
        """A latent cache (MLA): one pool of rows that are keys and values both (`v` is None)."""
        return "v" in self.layer_fields and getattr(self, "v") is None

    def per_layer(self) -> dict:
        """The layer fields {name: [L, ...]} (of one layer inside the layer scan: [...]) that are
        present (a latent cache has no `v`)."""
        return {name: getattr(self, name) for name in self.layer_fields if getattr(self, name) is not None}

    def with_layers(self, layers: dict):
        """This cache with its layer fields replaced (by one layer's arrays, or the stacked result)."""
        return dataclasses.replace(self, **layers)  # type: ignore[type-var]  # subclasses are dataclasses

    def pspecs(self, layout):
        """A tree like this cache of PartitionSpecs (for shard_map's in/out specs): pools as POOL,
        per-row metadata split over the batch axes with the rows."""
        pool_axes = LATENT_POOL if self.latent else POOL
        pool, rows, row = (layout.compute_spec(spec) for spec in (pool_axes, ROWS, ROW))
        specs = {name: pool for name in self.per_layer()}
        for name in self.row_fields:
            value = getattr(self, name)
            if value is not None:
                specs[name] = row if getattr(value, "ndim", 2) == 1 else rows
        return dataclasses.replace(self, **specs)  # type: ignore[type-var]

    @property
    def layers(self) -> int:
        return getattr(self, self.layer_fields[0]).shape[0]
