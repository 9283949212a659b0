"""The serving engine's quantized KV cache on the device (KIVI; docs/kv_quant.md), and the same
quantization applied to a contiguous forward (the reference the engine is tested against, and the
experiments' fake quantization).

A layer's cache under `config.serve.kv_quant` != "none" is two pools with their own page ids:
    k, v                  [Pf, page_size, K, H]  full precision: the pages still written or in the
                          residual window
    kq, vq, ks, kz, vs, vz                       the quantized ("sealed") pages, shapes
                          kernels/paged_attention/quant.page_shapes (Pq pages)
and two page tables per row, `page_table` (quantized ids; the engine's PagePool) and `fp_table`
(full-precision ids). The last page of each shard-local pool is its scratch page.

`paged_attention` is transformer._paged_attention for this cache: every row writes its key and
value to its slot of the full-precision pool; then every row whose token fills its page *seals*
that page (quantizes the whole full-precision page into its quantized slot; the other rows write
a throw-away quantization to the quantized scratch page); then each row attends with
kernels/paged_attention/kernel_quant.py: pages [0, n_quant) quantized, the rest full precision,
n_quant = max((p + 1) // page_size - residual, 0) for the row at position p. So what a query sees
depends only on its position, never on how the scheduler chunked or batched the sequence: the
query at p sees token t quantized iff t // page_size < n_quant(p) (t's page is full and is not
one of the last `residual` full pages). `kivi_attention` computes exactly that on a contiguous
sequence.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxsys.kernels.paged_attention import quant
from jaxsys.kernels.paged_attention.kernel_quant import paged_attention_quant

QUANT_LEAVES = ("kq", "vq", "ks", "kz", "vs", "vz")


def layer_shapes(mode: str, quant_pages: int, fp_pages: int, page_size: int, kv_heads: int, head_dim: int) -> dict:
    """{leaf: (shape of one layer, dtype or None for the cache's float dtype)} of the cache."""
    fp = (fp_pages, page_size, kv_heads, head_dim)
    out = {"k": (fp, None), "v": (fp, None)}
    for name, shape in quant.page_shapes(mode, quant_pages, page_size, kv_heads, head_dim).items():
        out[name] = (shape, jnp.uint8 if name in ("kq", "vq") else None)
    return out


def paged_attention(q, k, v, kv, positions):
    """One token per row (q, k, v [R, 1, ., H], positions [R, 1]) against the quantized paged
    cache `kv` (module docstring; kv["kv_quant"] = (mode, residual pages), static). Returns
    (o [R, 1, N, H], the updated kv)."""
    mode, residual = kv["kv_quant"]
    page_size = kv["k"].shape[1]
    tq, tf = kv["page_table"], kv["fp_table"]
    pos = positions[:, 0]
    page = (pos // page_size)[:, None]
    fp_page = jnp.take_along_axis(tf, page, axis=1)[:, 0]
    slot = fp_page * page_size + pos % page_size

    def write(cache, new):
        flat = cache.reshape(cache.shape[0] * page_size, *cache.shape[2:])
        return flat.at[slot].set(new[:, 0].astype(cache.dtype)).reshape(cache.shape)

    out = dict(kv, k=write(kv["k"], k), v=write(kv["v"], v))
    # seal the pages this step fills (after every row's write: a chunk may fill several pages)
    scratch = kv["kq"].shape[0] - 1
    dst = jnp.where((pos + 1) % page_size == 0, jnp.take_along_axis(tq, page, axis=1)[:, 0], scratch)
    sealed = quant.quantize_pages(out["k"][fp_page], out["v"][fp_page], mode, kv["ks"].dtype)
    for name in QUANT_LEAVES:
        out[name] = out[name].at[dst].set(sealed[name])
    o = paged_attention_quant(
        q[:, 0],
        out["k"].astype(q.dtype),
        out["v"].astype(q.dtype),
        {name: out[name] for name in QUANT_LEAVES},
        tq,
        tf,
        pos + 1,
        mode=mode,
        residual=residual,
    )
    return o[:, None], out


def kivi_attention(q, k, v, *, k_quant, v_quant, group: int, residual: int = 0):
    """Causal attention over a contiguous sequence (positions 0..T-1) with the cache quantized as
    the engine's: q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H] (q.dtype). The query at p sees
    token t quantized iff t // group < max((p + 1) // group - residual, 0), else in full
    precision. k_quant / v_quant: (bits, axis) for quant.fake_quant ("channel": statistics over
    the `group` tokens of a group; "token": over H), or None to leave that tensor in full
    precision. Softmax in fp32."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    fq = lambda x, spec: x.astype(jnp.float32) if spec is None else quant.fake_quant(x, spec[0], spec[1], group)
    kf, vf = fq(k, k_quant), fq(v, v_quant)
    qg = q.reshape(b, t, kh, n // kh, h).astype(jnp.float32) * h**-0.5
    dot = lambda a, c: jnp.einsum("bpkgh,btkh->bkgpt", a, c.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    p_idx, t_idx = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    quantized = t_idx // group < quant.n_quant(p_idx + 1, group, residual)  # [T (query), T (key)]
    s = jnp.where(quantized, dot(qg, kf), dot(qg, k))
    s = jnp.where(t_idx <= p_idx, s, -jnp.inf)
    w = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    mix = lambda weights, vals: jnp.einsum(
        "bkgpt,btkh->bpkgh", weights, vals.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    o = mix(jnp.where(quantized, w, 0.0), vf) + mix(jnp.where(quantized, 0.0, w), v)
    return o.reshape(b, t, n, h).astype(q.dtype)


def mode_attention(mode: str, page_size: int, residual: int = 0):
    """`kivi_attention` as the engine's cache format `mode` quantizes (for transformer.attention_override)."""
    bits, k_axis, v_axis = quant.MODES[mode]
    return lambda q, k, v: kivi_attention(
        q, k, v, k_quant=(bits, k_axis), v_quant=(bits, v_axis), group=page_size, residual=residual
    )
