"""The paged KV cache (PagedAttention's block table): pools of pages shared by all sequences.

    k, v        [L, P, page_size, K, H]   this device's pages (a batch shard's pool plus its
                                          scratch page) and its K / tensor kv heads; a latent
                                          cache (MLA, base.py): k [L, P, page_size, 1, H_c]
                                          whole on every tensor rank, v None
    page_table  [R, max_pages]            each query row's sequence's pages, in order: position t
                                          lives in slot t % page_size of page page_table[t // page_size]

The serving engine's rows are one token each (q [R, 1, N, H] at positions [R, 1]), so decodes and
prefill chunks of any lengths share one program. `attend` writes every row's key and value to its
slot first, then each row attends to its sequence's slots up to its position with the Pallas
paged-attention kernel (one query per row): the rows of one prefill chunk see each other causally.
A read view (`window.WindowView`, self-speculation's draft) reads through another table of the
same pages with its own lengths; the writes always go through `page_table`.

With the step's rows grouped by sequence (the engine's: a sequence's rows are consecutive, at
consecutive positions), the per-sequence fields select the ragged kernel instead
(kernels/paged_attention/ragged.py): each sequence's queries attend in blocks over its pages, so a
prefill chunk of C rows reads its pages once per block instead of C times.

    seq_table  [S, max_pages]  each sequence's pages      cu_q_lens  [S + 1]  its rows' offsets
    kv_lens    [S]             its cache length after     num_seqs   [1]      sequences in use
                               this step's writes
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsys.cache.base import KVCache
from jaxsys.kernels.paged_attention.kernel import paged_attention
from jaxsys.kernels.paged_attention.ragged import ragged_paged_attention


def slots(page_table, positions, page_size: int):
    """Flat slot ids [R] (page id x page_size + offset) of rows at positions [R]."""
    page = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    return page * page_size + positions % page_size


def write_rows(pool, new, slot):
    """pool [P, page_size, ...] with row r's new[r] written at flat slot slot[r]."""
    pages, page_size = pool.shape[:2]
    flat = pool.reshape(pages * page_size, *pool.shape[2:])
    return flat.at[slot].set(new.astype(pool.dtype)).reshape(pool.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache(KVCache):
    k: jax.Array
    v: jax.Array | None  # None: a latent cache, whose rows k are keys and values (base.py)
    page_table: jax.Array | None = None
    seq_table: jax.Array | None = None
    cu_q_lens: jax.Array | None = None
    kv_lens: jax.Array | None = None
    num_seqs: jax.Array | None = None

    layer_fields = ("k", "v")
    row_fields = ("page_table", "seq_table", "cu_q_lens", "kv_lens", "num_seqs")

    @property
    def page_size(self) -> int:
        return self.k.shape[-3]

    def attend(self, q, k, v, positions, window=None, softcap=None, read=None):
        """One token per row: q [R, 1, N, H], k, v [R, 1, K, H] at positions [R, 1] (v None: a latent
        cache's, rows read as keys and values). `read`:
        (table [R, max_pages], lengths [R]) to read through instead of page_table and position + 1."""
        pos = positions[:, 0]
        slot = slots(self.page_table, pos, self.page_size)
        kc = write_rows(self.k, k[:, 0], slot)
        vc = None if self.v is None else write_rows(self.v, v[:, 0], slot)
        keys = kc.astype(q.dtype)
        values = keys if vc is None else vc.astype(q.dtype)  # a latent cache's rows are both
        if read is None and self.cu_q_lens is not None:
            o = ragged_paged_attention(
                q[:, 0],
                keys,
                values,
                self.seq_table,
                self.cu_q_lens,
                self.kv_lens,
                self.num_seqs,
                window=window,
                softcap=softcap,
            )
        else:
            table, lengths = (self.page_table, pos + 1) if read is None else read[:2]
            o = paged_attention(q[:, 0], keys, values, table, lengths, window=window, softcap=softcap)
        return o[:, None], self.with_layers({"k": kc, "v": vc})
