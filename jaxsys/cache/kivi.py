"""The quantized paged KV cache (KIVI, Liu et al. 2024; docs/kv_quant.md): its device type, the
host bookkeeping of its full-precision pages, and the same quantization on a contiguous sequence.

Device (`QuantizedPagedCache`, one layer's arrays shown; each has a leading L):
    k, v                    [Pf, page_size, K, H]  full precision: the pages being written and the
                            residual window (the last page of each shard's pool: scratch)
    kq, vq, ks, kz, vs, vz  the quantized ("sealed") pages, shapes
                            kernels/paged_attention/quant.page_shapes (Pq pages)
    page_table              [R, max_pages] quantized page ids (the engine's PagePool)
    fp_table                [R, max_pages] full-precision page ids (`ResidualPages`)
    mode, residual          static: int8 | kivi4 | kivi2, and the full pages kept in full precision
                            before each row's open page

`attend`: every row writes its key and value to its slot of the full-precision pool; then every
row whose token fills its page *seals* that page (quantizes the whole full-precision page into its
quantized slot; the other rows write a throw-away quantization to the quantized scratch page); then
each row attends with kernels/paged_attention/kernel_quant.py: pages [0, n_quant) quantized, the
rest full precision, n_quant = max((p + 1) // page_size - residual, 0) for the row at position p.
So what a query sees depends only on its position, never on how the scheduler chunked or batched
the sequence: the query at p sees token t quantized iff t // page_size < n_quant(p) (t's page is
full and is not one of the last `residual` full pages). `fake_quant_attention` computes exactly
that on a contiguous sequence (`FakeQuant`, the contiguous cache's `quant`).

Host (`ResidualPages`, plain Python, one per batch shard). A sequence's logical page i has a slot
in the quantized pool (its PagePool page, reserved at admission as without quantization) and,
while it is being written or is in the residual window, a page of the small full-precision pool.
A row at p needs the full-precision pages [first(p), p // page_size], first(p) =
min(n_quant(p + 1), p // page_size). `prepare` hands them out before a step (every page a row of
the step writes or reads in full precision, and the page it seals); `advance` takes back after it
the pages no later row writes or reads, and `free` all of a finished sequence's.

Pool size (`fp_pages`). At a step a sequence holds the pages [first(start), (start + T - 1) //
page_size] of its T rows from `start`: at most residual + 2 + (T - 1) // page_size. Over the at
most max_seqs running sequences and a token budget of `budget` rows that is at most
max_seqs (residual + 2) + ceil(budget / page_size) pages: the pool never runs out.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.cache.base import KVCache, static
from jaxsys.cache.paged import slots, write_rows
from jaxsys.kernels.flash_attention.reference import check_softcap, softcapped
from jaxsys.kernels.paged_attention import quant
from jaxsys.kernels.paged_attention.kernel_quant import paged_attention_quant
from jaxsys.kernels.paged_attention.ragged import ragged_paged_attention_quant

QUANT_LEAVES = ("kq", "vq", "ks", "kz", "vs", "vz")


def layer_shapes(mode: str, quant_pages: int, fp_pages: int, page_size: int, kv_heads: int, head_dim: int) -> dict:
    """{leaf: (shape of one layer, dtype or None for the cache's float dtype)} of the cache."""
    fp = (fp_pages, page_size, kv_heads, head_dim)
    out = {"k": (fp, None), "v": (fp, None)}
    for name, shape in quant.page_shapes(mode, quant_pages, page_size, kv_heads, head_dim).items():
        out[name] = (shape, jnp.uint8 if name in ("kq", "vq") else None)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPagedCache(KVCache):
    k: jax.Array
    v: jax.Array
    kq: jax.Array
    vq: jax.Array
    ks: jax.Array
    kz: jax.Array
    vs: jax.Array
    vz: jax.Array
    page_table: jax.Array | None = None
    fp_table: jax.Array | None = None
    # per sequence (the ragged kernel; paged.PagedCache's fields), and its full-precision pages
    seq_table: jax.Array | None = None
    seq_fp_table: jax.Array | None = None
    cu_q_lens: jax.Array | None = None
    kv_lens: jax.Array | None = None
    num_seqs: jax.Array | None = None
    mode: str = static("kivi4")
    residual: int = static(0)

    layer_fields = ("k", "v") + QUANT_LEAVES
    row_fields = ("page_table", "fp_table", "seq_table", "seq_fp_table", "cu_q_lens", "kv_lens", "num_seqs")

    @property
    def page_size(self) -> int:
        return self.k.shape[-3]

    def attend(self, q, k, v, positions, window=None, softcap=None, read=None):
        """One token per row (q [R, 1, N, H], k, v [R, 1, K, H], positions [R, 1]). `read`:
        (quantized table, lengths, full-precision table, quantized pages per row) to read through
        instead of the row's own tables (window.WindowView)."""
        page_size = self.page_size
        tq, tf = self.page_table, self.fp_table
        pos = positions[:, 0]
        fp_page = jnp.take_along_axis(tf, (pos // page_size)[:, None], axis=1)[:, 0]
        slot = slots(tf, pos, page_size)
        pools = {"k": write_rows(self.k, k[:, 0], slot), "v": write_rows(self.v, v[:, 0], slot)}
        # seal the pages this step fills (after every row's write: a chunk may fill several pages)
        scratch = self.kq.shape[0] - 1
        page = (pos // page_size)[:, None]
        dst = jnp.where((pos + 1) % page_size == 0, jnp.take_along_axis(tq, page, axis=1)[:, 0], scratch)
        sealed = quant.quantize_pages(pools["k"][fp_page], pools["v"][fp_page], self.mode, self.ks.dtype)
        for name in QUANT_LEAVES:
            pools[name] = getattr(self, name).at[dst].set(sealed[name])
        if read is None and self.cu_q_lens is not None:
            o = ragged_paged_attention_quant(
                q[:, 0],
                pools["k"].astype(q.dtype),
                pools["v"].astype(q.dtype),
                {name: pools[name] for name in QUANT_LEAVES},
                self.seq_table,
                self.seq_fp_table,
                self.cu_q_lens,
                self.kv_lens,
                self.num_seqs,
                mode=self.mode,
                residual=self.residual,
                window=window,
                softcap=softcap,
            )
            return o[:, None], self.with_layers(pools)
        table_q, lengths, table_f, quant_pages = (tq, pos + 1, tf, None) if read is None else read
        o = paged_attention_quant(
            q[:, 0],
            pools["k"].astype(q.dtype),
            pools["v"].astype(q.dtype),
            {name: pools[name] for name in QUANT_LEAVES},
            table_q,
            table_f,
            lengths,
            mode=self.mode,
            residual=self.residual,
            quant_pages=quant_pages,
            window=window,
            softcap=softcap,
        )
        return o[:, None], self.with_layers(pools)


# ----------------------------------------------------------------------------- the same on a contiguous sequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeQuant:
    """How a contiguous cache's attention sees its keys and values (ContiguousCache.quant): each
    quantized and dequantized by `k_quant` / `v_quant` ((bits, "channel" | "token") for
    quant.fake_quant, or None for full precision) in groups of `group` tokens, the last `residual`
    full groups before a query's open one in full precision (an int, or traced)."""

    residual: object = 0
    k_quant: tuple | None = static()
    v_quant: tuple | None = static()
    group: int = static(16)

    @classmethod
    def of_mode(cls, mode: str, page_size: int, residual: int = 0) -> "FakeQuant":
        """What the quantized paged cache of `mode` stores, pages of `page_size` tokens."""
        bits, k_axis, v_axis = quant.MODES[mode]
        return cls(residual, (bits, k_axis), (bits, v_axis), page_size)


def fake_quant_attention(q, k, v, q_positions, fq: FakeQuant, window=None, softcap=None):
    """Causal attention of q [B, T, N, H] at q_positions [B, T] over the contiguous k, v [B, S, K,
    H] (slot s = position s) quantized as the paged cache stores them: the query at p sees token t
    quantized iff t // group < max((p + 1) // group - residual, 0), else in full precision (with
    `window`, only tokens t > p - window; with `softcap` c, the scaled scores s soft-capped to
    c * tanh(s / c) before the mask). Softmax in fp32; -> [B, T, N, H] in q.dtype."""
    softcap = check_softcap(softcap)
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    fq_ = lambda x, spec: x.astype(jnp.float32) if spec is None else quant.fake_quant(x, spec[0], spec[1], fq.group)
    kf, vf = fq_(k, fq.k_quant), fq_(v, fq.v_quant)
    qg = q.reshape(b, t, kh, n // kh, h).astype(jnp.float32) * h**-0.5
    dot = lambda a, c: jnp.einsum("bpkgh,btkh->bkgpt", a, c.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    p_idx, t_idx = q_positions[:, :, None], jnp.arange(s_len)[None, None, :]  # [B, T, 1], [1, 1, S]
    quantized = (t_idx // fq.group < quant.n_quant(p_idx + 1, fq.group, fq.residual))[:, None, None]
    visible = t_idx <= p_idx if window is None else (t_idx <= p_idx) & (t_idx > p_idx - window)
    visible = visible[:, None, None]  # [B, 1, 1, T, S]
    s = softcapped(jnp.where(quantized, dot(qg, kf), dot(qg, k)), softcap)
    s = jnp.where(visible, s, -jnp.inf)
    w = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    mix = lambda weights, vals: jnp.einsum(
        "bkgpt,btkh->bpkgh", weights, vals.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    o = mix(jnp.where(quantized, w, 0.0), vf) + mix(jnp.where(quantized, 0.0, w), v)
    return o.reshape(b, t, n, h).astype(q.dtype)


# ----------------------------------------------------------------------------- host: full-precision pages


def fp_pages(max_seqs: int, token_budget: int, page_size: int, residual: int) -> int:
    """Full-precision pages a batch shard needs (module docstring)."""
    return max_seqs * (residual + 2) + math.ceil(token_budget / page_size)


def n_quant(length: int, page_size: int, residual: int) -> int:
    """As kernels/paged_attention/quant.n_quant, in Python."""
    return max(length // page_size - residual, 0)


def first_fp_page(pos: int, page_size: int, residual: int) -> int:
    """The first logical page the row at `pos` needs in full precision (to read or to seal)."""
    return min(n_quant(pos + 1, page_size, residual), pos // page_size)


class ResidualPages:
    def __init__(self, num_pages: int, page_size: int, residual: int):
        self.num_pages, self.page_size, self.residual = num_pages, page_size, residual
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict = {}  # sequence -> {logical page: full-precision page id}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def prepare(self, seq, start: int, tokens: int) -> None:
        """Give `seq` a page for every logical page its rows start .. start + tokens - 1 write or
        read in full precision."""
        own = self._pages.setdefault(seq, {})
        lo = first_fp_page(start, self.page_size, self.residual)
        for i in range(lo, (start + tokens - 1) // self.page_size + 1):
            if i not in own:
                if not self._free:
                    raise RuntimeError("the full-precision page pool is exhausted (fp_pages sized it too small)")
                own[i] = self._free.pop()

    def table(self, seq, max_pages: int, scratch: int) -> np.ndarray:
        """[max_pages] full-precision page ids of `seq`'s logical pages (`scratch` where it has none)."""
        out = np.full(max_pages, scratch, np.int32)
        for i, page in self._pages.get(seq, {}).items():
            if i < max_pages:
                out[i] = page
        return out

    def pages(self, seq) -> dict:
        """{logical page: full-precision page id} of `seq`."""
        return dict(self._pages.get(seq, {}))

    def advance(self, seq, cached: int) -> None:
        """`seq` has `cached` tokens: free the pages its next row (position `cached`) and the later
        ones never write nor read in full precision."""
        own = self._pages.get(seq, {})
        lo = first_fp_page(cached, self.page_size, self.residual)
        for i in [i for i in own if i < lo]:
            self._free.append(own.pop(i))

    def free(self, seq) -> None:
        self._free.extend(self._pages.pop(seq, {}).values())
