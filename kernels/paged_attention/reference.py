"""Pure-JAX paged decode attention: the semantics the Pallas kernels are tested against.

Layout (one layer):
- k_pages, v_pages [P, page_size, K, H]: a global pool of P pages shared by all sequences; K kv
  heads, head dim H.
- page_table [B, max_pages] int32: the page ids of sequence b's cache, in order (token t of
  sequence b lives in page page_table[b, t // page_size], slot t % page_size). Entries past the
  sequence's ceil(length / page_size) pages are never read by the kernels and may hold anything
  in [0, P) (e.g. 0); the reference gathers them too but masks them out.
- lengths [B] int32: tokens in each sequence's cache, 1 <= length <= max_pages * page_size.
- q [B, N, H]: one query per sequence (decode), N a multiple of K (GQA: query head n reads kv
  head n // (N / K)).
Output [B, N, H] in q.dtype: softmax(scale * q.k) v over the first `length` cached tokens, scores
and softmax in fp32, scale defaulting to H ** -0.5. With a sliding window W (a model's "local"
layers) only the last W of them: positions length - W .. length - 1 (the query's own included).
With a logit soft-cap c (Gemma 2's `softcap`) the scaled scores s become c * tanh(s / c) before
the mask and the softmax (None or 0: no cap; flash_attention/reference.py's `softcapped`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.kernels.flash_attention.reference import check_softcap, softcapped

__all__ = ["paged_attention_reference", "contiguous_attention", "gather_pages", "check_inputs"]


def check_inputs(q, k_pages, v_pages, page_table, lengths) -> None:
    """Raise ValueError, naming the constraint and the values, for inputs paged attention cannot
    take. Lengths above max_pages * page_size are caught when `lengths` is concrete (not traced)."""
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(
            f"paged attention takes q[B, N, H] and k_pages/v_pages[P, page_size, K, H]; "
            f"got q{q.shape}, k_pages{k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape; got {k_pages.shape}, {v_pages.shape}")
    b, n, h = q.shape
    _, page_size, kh, hk = k_pages.shape
    if hk != h:
        raise ValueError(f"head dims differ: q has H={h}, k_pages/v_pages have H={hk}")
    if kh == 0 or n % kh:
        raise ValueError(
            f"the number of query heads N must be a multiple of the number of kv heads K; got N={n}, K={kh}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype; got {k_pages.dtype}, {v_pages.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] == 0:
        raise ValueError(
            f"page_table must have shape [B, max_pages] with B={b}, max_pages >= 1; got {page_table.shape}"
        )
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have shape [B] = {(b,)}; got {lengths.shape}")
    for name, a in (("page_table", page_table), ("lengths", lengths)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer (int32); got {a.dtype}")
    try:  # concrete lengths only (a traced array raises a TracerArrayConversionError here)
        lens = np.asarray(lengths)
    except Exception:  # noqa: BLE001 - traced: nothing to check
        return
    cap = page_table.shape[1] * page_size
    if lens.size and (lens.min() < 1 or lens.max() > cap):
        raise ValueError(
            f"lengths must lie in [1, max_pages * page_size] = [1, {cap}] "
            f"(max_pages={page_table.shape[1]}, page_size={page_size}); got "
            f"min {lens.min()}, max {lens.max()}"
        )


def gather_pages(pages, page_table):
    """pages [P, page_size, K, H], page_table [B, max_pages] -> [B, max_pages * page_size, K, H]:
    each sequence's pages laid out contiguously (entries past its length included)."""
    b, mp = page_table.shape
    _, ps, kh, h = pages.shape
    return pages[page_table].reshape(b, mp * ps, kh, h)


def contiguous_attention(q, k, v, lengths, scale=None, window=None, softcap=None):
    """Decode attention over a contiguous cache: q [B, N, H], k/v [B, S, K, H], lengths [B]
    (positions >= length are masked, and with `window` those < length - window) -> [B, N, H] in
    q.dtype; fp32 scores and softmax; with `softcap` c the scaled scores s are c * tanh(s / c)."""
    softcap = check_softcap(softcap)
    b, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, kh, g, h).astype(jnp.float32)
    scores = jnp.einsum("bkgh,bskh->bkgs", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    scores = softcapped(scores, softcap)
    visible = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    if window is not None:
        visible = visible & (jnp.arange(s)[None, :] >= lengths[:, None] - window)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgs,bskh->bkgh", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o.reshape(b, n, h).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, page_table, lengths, scale=None, window=None, softcap=None):
    """Gather each sequence's pages into a contiguous [B, max_pages * page_size, K, H] cache, mask
    positions >= length (and with `window` those before it), soft-cap the scores with `softcap`,
    softmax in fp32 -> [B, N, H] in q.dtype (module docstring)."""
    check_inputs(q, k_pages, v_pages, page_table, lengths)
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    return contiguous_attention(q, k, v, lengths, scale, window, softcap)
