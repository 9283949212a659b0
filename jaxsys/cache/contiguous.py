"""The contiguous KV cache: one row of S slots per sequence, slot s holding position s.

    k, v        [L, B, S, K, H]   B sequence slots (this device's, split over the batch axes), its
                                  K kv heads (split over `tensor`)
    page_table  [R, 1] or None    the slot each query row writes and reads (the serving engine's
                                  rows; a PagePool whose one page per sequence is a whole row);
                                  None: query row b is slot b (a batch of B sequences)
    quant       static            None, or a `kivi.FakeQuant`: attention sees the keys and values
                                  quantized exactly as the quantized paged cache stores them (the
                                  reference the KIVI engine is tested against, and the experiments'
                                  way to measure KIVI without paging)

`attend` writes every row's keys and values at its positions first, then each query attends to
its slot's positions <= its own, so the rows of one prompt see each other causally whatever the
order they come in. Padding positions (a right-padded prompt, a padding row) write slots that no
query reads before they are written again: attention masks by position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxsys.cache.base import KVCache, empty_pools
from jaxsys.models import layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache(KVCache):
    k: jax.Array
    v: jax.Array | None  # None: a latent cache, whose rows k are keys and values (base.py)
    page_table: jax.Array | None = None
    quant: object = None  # a kivi.FakeQuant (a pytree: its residual may be traced)

    layer_fields = ("k", "v")
    row_fields = ("page_table",)

    @classmethod
    def zeros(cls, program, batch: int, max_len: int, quant=None) -> "ContiguousCache":
        """An empty cache of `batch` sequences of `max_len` slots on `program`'s mesh (batch must
        split over the batch shards)."""
        return cls(*empty_pools(program, batch, max_len), None, quant)

    def pspecs(self, layout):
        specs = super().pspecs(layout)
        return (
            specs if self.quant is None else dataclasses.replace(specs, quant=jax.tree.map(lambda _: P(), self.quant))
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[-3]

    def attend(self, q, k, v, positions, window=None, softcap=None):
        """q [R, T, N, H], k, v [R, T, K, H] at positions [R, T] (one layer)."""
        rows = q.shape[0]
        slots = jnp.arange(rows) if self.page_table is None else self.page_table[:, 0]
        write = lambda cache, new: cache.at[slots[:, None], positions].set(new.astype(cache.dtype))
        kc = write(self.k, k)
        vc = None if self.v is None else write(self.v, v)  # None: a latent cache's rows are both
        read = lambda cache: (cache if self.page_table is None else cache[slots]).astype(q.dtype)
        keys = read(kc)
        values = keys if vc is None else read(vc)
        if self.quant is None:
            o = layers.attention(q, keys, values, q_positions=positions, window=window, softcap=softcap)
        else:
            from jaxsys.cache import kivi

            o = kivi.fake_quant_attention(q, keys, values, positions, self.quant, window, softcap)
        return o, ContiguousCache(kc, vc, self.page_table, self.quant)
