"""The interface every KV cache implements (jaxsys/cache/__init__.py says which caches exist).

A cache is a pytree dataclass. Its *layer fields* hold one array per layer, stacked on a leading
L dimension ([L, ...]); its other fields (page tables, read views) are shared by every layer and
its static fields (a quantization mode) are part of its type. The layer stack scans the layer
fields beside the weights: `per_layer()` gives them, `with_layers(...)` puts a layer's (or all
layers') arrays back, and the model's attention calls one method on one layer's cache:

    o, cache = cache.attend(q, k, v, positions)

which writes this step's keys and values k, v [B, T, K, H] at `positions` [B, T] and attends to
the cache with q [B, T, N, H], returning o [B, T, N, H] and the cache with the writes. H here is
`head_dim(m)` (the model's, padded to a power of two). Shapes are
per device (this device's sequences or rows, and its K / tensor kv heads). A sliding-window layer
passes `window=W`: each query then sees only its last W positions. A model with attention logit
soft-capping (Gemma 2) passes `softcap=c`: the scaled scores s become c * tanh(s / c) before the
mask and the softmax (None or 0: no cap).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

# where a cache's arrays live on the mesh: pools split like the activations (the batch over the
# batch axes, kv heads over `tensor`), per-row metadata split with the rows
POOL = ("layers", "batch", None, "kv_heads", None)  # [L, B or pages, S or page slots, K, H]
ROWS = ("batch", None)  # [rows, ...]
ROW = ("batch",)  # [rows]


def head_dim(m) -> int:
    """H_c, the head dim the caches hold: the model's head_dim rounded up to a power of two (the
    paged kernels' Triton tiles need one; 12 -> 16, 96 -> 128, MLA's 192 -> 256). The model pads
    q, k and v to it before `attend`, q scaled by (H_c / H)^0.5 so that every score is unchanged,
    and cuts the output back (transformer.block)."""
    return 1 << (m.head_dim - 1).bit_length()


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

    def per_layer(self) -> dict:
        """The layer fields {name: [L, ...]} (of one layer inside the layer scan: [...])."""
        return {name: getattr(self, name) for name in self.layer_fields}

    def with_layers(self, layers: dict):
        """This cache with its layer fields replaced (by one layer's arrays, or the stacked result)."""
        return dataclasses.replace(self, **layers)  # type: ignore[type-var]  # subclasses are dataclasses

    def pspecs(self, layout):
        """A tree like this cache of PartitionSpecs (for shard_map's in/out specs): pools as POOL,
        per-row metadata split over the batch axes with the rows."""
        pool, rows, row = (layout.compute_spec(spec) for spec in (POOL, ROWS, ROW))
        specs = {name: pool for name in self.layer_fields}
        for name in self.row_fields:
            value = getattr(self, name)
            if value is not None:
                specs[name] = row if getattr(value, "ndim", 2) == 1 else rows
        return dataclasses.replace(self, **specs)  # type: ignore[type-var]

    @property
    def layers(self) -> int:
        return getattr(self, self.layer_fields[0]).shape[0]
