"""Paged decode attention over a quantized KV cache (KIVI) in Pallas: dequantization in the tile.

Semantics and layout: quant.py (`paged_attention_quant_reference`): a sequence's first n_quant =
max(length // page_size - residual, 0) pages come from the quantized pool (codes packed along H,
scales and zeros per channel or per token), the rest from the full-precision pool, each through
its own page table.

Generic variant (interpret mode on CPU, Triton on GPU), grid (B, K) as kernel.py's: the [G, H]
query tile of a kv head, an online softmax, and two `fori_loop`s sharing its carry, over the
quantized pages [0, n_quant) then the full-precision pages [n_quant, ceil(length / page_size)).
A quantized step loads the page's code bytes [page_size, H b / 8] and its scales and zeros by
dynamic index (the page id read from the table inside the kernel, as kernel.py) and computes in
n = 8 / b parts of Hp = H / n channels: part i is (bytes >> i b) & (2^b - 1) times its scale plus
its zero, in fp32. The query, the accumulator and the output are kept as the same n parts (static
slices of the refs), so no lane interleave or concatenate happens in the kernel. Scores and P V
are broadcast products reduced in fp32, as in kernel.py (G is 1-8). A logit soft-cap c (`softcap`)
maps a page's scaled scores s to c * tanh(s / c) before the mask, as kernel.py.

No Mosaic (TPU) variant yet: on TPU this kernel would take the Triton branch and fail to lower.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention.reference import check_softcap
from jaxsys.kernels.paged_attention import quant
from jaxsys.kernels.paged_attention.kernel import MASK_VALUE, _pad_rows, first_page, triton_params, window_visible
from jaxsys.kernels.paged_attention.reference import check_inputs

__all__ = ["paged_attention_quant"]


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    scale: float
    bits: int
    interpret: bool = True
    num_warps: int | None = None
    num_stages: int | None = None
    window: int | None = None  # sliding window: the last `window` positions only
    softcap: float | None = None  # logit soft-cap c: scores s -> c * tanh(s / c)


def _kernel(
    tq_ref,
    tf_ref,
    len_ref,
    nq_ref,
    q_ref,
    k_ref,
    v_ref,
    kq_ref,
    vq_ref,
    ks_ref,
    kz_ref,
    vs_ref,
    vz_ref,
    o_ref,
    *,
    page_size: int,
    scale: float,
    bits: int,
    window: int | None,
    softcap: float | None,
):
    b, kh = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    n_pages = lax.div(length + page_size - 1, page_size)
    n_q = nq_ref[b]
    n = 8 // bits
    g, h = q_ref.shape
    hp = h // n
    parts = [pl.ds(i * hp, hp) for i in range(n)]
    qs = [q_ref[:, part].astype(jnp.float32) * scale for part in parts]  # n x [G, Hp]
    mask = 2**bits - 1

    def stat(ref, page, part):
        """A scale / zero tile: [1, Hp] of part `part` (per channel) or [page_size, 1] (per token)."""
        per_channel = ref.shape[3] > 1
        return ref[page, :, kh, parts[part] if per_channel else pl.ds(0, 1)].astype(jnp.float32)

    def quant_page(i):
        page = tq_ref[b, i]
        kb = kq_ref[page, :, kh, :].astype(jnp.int32)  # [page_size, Hp]
        vb = vq_ref[page, :, kh, :].astype(jnp.int32)
        ks = [
            ((kb >> (bits * j)) & mask).astype(jnp.float32) * stat(ks_ref, page, j) + stat(kz_ref, page, j)
            for j in range(n)
        ]
        vs = [
            ((vb >> (bits * j)) & mask).astype(jnp.float32) * stat(vs_ref, page, j) + stat(vz_ref, page, j)
            for j in range(n)
        ]
        return ks, vs

    def fp_page(i):
        page = tf_ref[b, i]
        return (
            [k_ref[page, :, kh, part].astype(jnp.float32) for part in parts],
            [v_ref[page, :, kh, part].astype(jnp.float32) for part in parts],
        )

    def body(load):
        def step(i, carry):
            m, l, acc = carry
            ks, vs = load(i)
            s = sum(jnp.sum(qj[:, None, :] * kj[None, :, :], axis=2) for qj, kj in zip(qs, ks))  # [G, page_size]
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            pos = i * page_size + lax.broadcasted_iota(jnp.int32, (g, page_size), 1)
            visible = window_visible(pos, length, window)
            s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
            l = alpha * l + jnp.sum(p, axis=1)
            acc = tuple(alpha[:, None] * a + jnp.sum(p[:, :, None] * vj[None, :, :], axis=1) for a, vj in zip(acc, vs))
            return m_new, l, acc

        return step

    carry = (
        jnp.full((g,), MASK_VALUE, jnp.float32),
        jnp.zeros((g,), jnp.float32),
        tuple(jnp.zeros((g, hp), jnp.float32) for _ in range(n)),
    )
    start = first_page(length, page_size, window)  # pages before the window are not read
    carry = lax.fori_loop(start, jnp.maximum(n_q, start), body(quant_page), carry)
    _, l, acc = lax.fori_loop(jnp.maximum(n_q, start), n_pages, body(fp_page), carry)
    for part, a in zip(parts, acc):
        o_ref[:, part] = (a / l[:, None]).astype(o_ref.dtype)


def _generic(q, k_pages, v_pages, qp, quant_table, fp_table, lengths, quant_pages, *, cfg: QuantConfig):
    """q [B, K, G, H] (G padded by the caller) -> o [B, K, G, H]."""
    b, kh, g, h = q.shape
    page_size = k_pages.shape[1]
    compiler_params = triton_params(cfg, page_size, h)
    whole = lambda a: pl.BlockSpec(a.shape, lambda bi, hi, nd=a.ndim: (0,) * nd)
    q_spec = pl.BlockSpec((None, None, g, h), lambda bi, hi: (bi, hi, 0, 0))
    names = ("kq", "vq", "ks", "kz", "vs", "vz")
    operands = (
        quant_table.astype(jnp.int32),
        fp_table.astype(jnp.int32),
        lengths.astype(jnp.int32),
        quant_pages.astype(jnp.int32),
        q,
        k_pages,
        v_pages,
    ) + tuple(qp[name] for name in names)
    return pl.pallas_call(
        functools.partial(
            _kernel, page_size=page_size, scale=cfg.scale, bits=cfg.bits, window=cfg.window, softcap=cfg.softcap
        ),
        grid=(b, kh),
        in_specs=[whole(a) for a in operands[:4]] + [q_spec] + [whole(a) for a in operands[5:]],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=cfg.interpret,
        name="paged_attention_quant",
    )(*operands)


def _run(q, k_pages, v_pages, qp, quant_table, fp_table, lengths, quant_pages, *, cfg):
    g = q.shape[2]
    out = _generic(
        _pad_rows(q, int(pl.next_power_of_2(g))),
        k_pages,
        v_pages,
        qp,
        quant_table,
        fp_table,
        lengths,
        quant_pages,
        cfg=cfg,
    )
    return out[:, :, :g]


def check_quant_inputs(k_pages, qp: dict, mode: str) -> None:
    if mode not in quant.MODES:
        raise ValueError(f"mode={mode!r}: choose one of {tuple(quant.MODES)}")
    pq, page_size, kh, h = qp["kq"].shape[0], k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    want = quant.page_shapes(mode, pq, page_size, kh, h)
    got = {name: tuple(qp[name].shape) for name in want}
    if got != want:
        raise ValueError(
            f"quantized pages for mode {mode!r} with page_size={page_size}, K={kh}, H={h} "
            f"must have shapes {want}; got {got}"
        )
    for name in ("kq", "vq"):
        if qp[name].dtype != jnp.uint8:
            raise ValueError(f"{name} (packed codes) must be uint8; got {qp[name].dtype}")


def paged_attention_quant(
    q,
    k_pages,
    v_pages,
    qp: dict,
    quant_table,
    fp_table,
    lengths,
    *,
    mode: str,
    residual: int = 0,
    quant_pages=None,
    scale=None,
    interpret=None,
    num_warps=None,
    num_stages=None,
    window=None,
    softcap: float | None = None,
):
    """Decode attention over a quantized paged cache, as `quant.paged_attention_quant_reference`.

    q [B, N, H]; k_pages, v_pages [Pf, page_size, K, H] the full-precision pool; qp the quantized
    pool {"kq", "vq", "ks", "kz", "vs", "vz"} (quant.page_shapes(mode, Pq, ...)); quant_table,
    fp_table [B, max_pages] int32 page ids into each pool (entries a sequence does not read from
    that pool are never read); lengths [B] in [1, max_pages * page_size]; `residual` full pages
    before the current one stay full precision; `quant_pages` [B] (optional) overrides how many
    leading pages each row reads quantized (default quant.n_quant(lengths, page_size, residual);
    a read view of a subset of the pages sets its own); `window`: sliding-window attention (the last
    `window` positions; pages before them are not read); `softcap`: logit soft-capping, None (or 0)
    or c > 0 (scaled scores s -> c * tanh(s / c) before the mask). Returns [B, N, H] in q.dtype. interpret None
    interprets when lowered for CPU and uses Triton elsewhere (no Mosaic variant)."""
    check_inputs(q, k_pages, v_pages, quant_table, lengths)
    check_quant_inputs(k_pages, qp, mode)
    if fp_table.shape != quant_table.shape:
        raise ValueError(f"fp_table must have quant_table's shape {quant_table.shape}; got {fp_table.shape}")
    b, n, h = q.shape
    kh = k_pages.shape[2]
    scale = float(h**-0.5 if scale is None else scale)
    cfg = QuantConfig(
        scale,
        quant.MODES[mode][0],
        num_warps=num_warps,
        num_stages=num_stages,
        window=window,
        softcap=check_softcap(softcap),
    )
    plan = platforms.plan("generic", interpret, cfg, None)
    if quant_pages is None:
        quant_pages = quant.n_quant(lengths, k_pages.shape[1], int(residual))
    qg = q.reshape(b, kh, n // kh, h)
    out = platforms.dispatch(
        plan,
        {"generic": (_run,)},
        0,
        qg,
        k_pages,
        v_pages,
        qp,
        quant_table.astype(jnp.int32),
        fp_table.astype(jnp.int32),
        lengths.astype(jnp.int32),
        quant_pages.astype(jnp.int32),
    )
    return out.reshape(b, n, h)
