"""FlashAttention-2 for TPU (Pallas Mosaic): forward, and the backward as a dq kernel and a dk/dv
kernel. Same semantics as `reference.attention` and kernel.py; kernel.py's public functions pick
this variant when the program is lowered for TPU (see there) and hold the custom_vjp.

Layout. Mosaic wants the last two dims of every block to be multiples of (8, 128) or the whole
array dims, so the kernels see heads-major arrays: q/o/dO [B, N, T, H], k/v [B, K, S, H] (the
transposes happen in XLA outside), blocks (block_q, H) and (block_k, H). Per-row values (lse,
Delta) and segment ids travel lane-dense as [B, N, 1, T] / [B, 1, T] with blocks (1, block): one
row of 128-multiples of lanes, no 128x broadcast in HBM.

Grid. Nothing holds a whole sequence in VMEM: the reduction axis is the last grid axis, marked
"arbitrary", and fp32 accumulators live in VMEM scratch across its steps.
- forward, grid (N, B, T/block_q, S/block_k): scratch m, l [block_q, 128] (the row max and sum,
  equal over the 128 lanes so they combine with [block_q, block_k] tiles without relayout) and acc
  [block_q, H]; the last kv step writes o = acc / l and lse = m + log l (transposed to a row).
- dq, grid (N, B, T/block_q, S/block_k): scratch dq [block_q, H]; dS = P * (dO V^T - Delta),
  dQ = scale * sum dS K.
- dk/dv, grid (K, B, S/block_k, G, T/block_q), the last two "arbitrary": the G = N / K query heads
  of a kv head come one after another on the grid, so the dk, dv scratch [block_k, H] sums over the
  group and the q blocks, and the output block (the same for all of them) is written once. Computed
  transposed, keys on sublanes and queries on lanes (S^T = K Q^T), so lse and Delta are used as the
  rows they are stored as: dV = sum P^T dO, dK = scale * sum dS^T Q.
Heads lead the grid (then batch), because B is often 1 per device and a megacore chip (v4, v5p)
splits "parallel" grid axes over its two TensorCores: heads split evenly, and unlike q or kv
blocks they carry equal causal work. (How Mosaic splits them is not checked here: no TPU.)

Causal. A (q block, kv block) pair entirely above the diagonal does nothing (`pl.when`), and its
index maps point at the next block that is needed (kv block 0 of the next q block in the forward
and dq; the first q block on the diagonal in dk/dv), so skipped steps start no DMA. Pairs
entirely below the diagonal run without building a mask. With segment ids, a pair whose id
ranges do not overlap is skipped too (`pl.when`; its blocks are still fetched).

Sliding window W (causal): a tile wholly behind every row's window does nothing either, and its
index maps point at the next tile that runs (the first of the q block's window, or of the next q
block's); tiles straddling the window's far edge get the mask.

Logit soft-capping c (`softcap`, Gemma 2; reference.softcapped): every kernel computes the scores
as c * tanh(q.k * (scale / c)) before any mask, and the dq and dk/dv kernels multiply dS by the
cap's derivative 1 - tanh^2 (their final factor of scale stays).

Empty rows (no visible key: segment ids) give o = 0 and lse = -inf. In the backward, lse = -inf is
replaced by +inf before the kernels, so P = exp(s - lse) = 0 there without relying on the mask.

Tiles: block sizes are multiples of 128 (lanes of the score tiles and of the lse/segment rows);
a request below 128 or above the padded sequence is adjusted (see `tile`), never refused. T and S
are padded up to the tiles: padded keys are masked by index where they can be seen, padded queries
carry dO = 0, Delta = 0, lse = 0 and are sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxsys.kernels import platforms

__all__ = ["TpuConfig", "tile", "forward", "backward"]

LANES = 128
# Finite stand-in for -inf (as in kernel.py): masked scores never win a row max and never make
# inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Static parameters of one call (hashable: part of the custom_vjp's static argument)."""

    scale: float
    causal: bool
    block_q: int
    block_k: int
    bwd_block_q: int
    bwd_block_k: int
    interpret: bool
    window: int | None = None  # sliding window (causal): a query sees its last `window` keys
    softcap: float | None = None  # logit soft-cap c: scaled scores s -> c * tanh(s / c)


def tile(requested: int, length: int, name: str) -> int:
    """The tile actually used for `requested` rows over a sequence of `length`: rounded up to a
    multiple of 128 (Mosaic's lane width; smaller requests, such as the 16 of CPU tests, become
    128), and no longer than the sequence rounded up to 128."""
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 1:
        raise ValueError(f"{name} must be a positive integer; got {name}={requested!r}")
    want = -(-int(requested) // LANES) * LANES
    return min(want, -(-length // LANES) * LANES)


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def _dot(a, b, dims):
    """fp32-accumulated matmul. bf16 operands always take DEFAULT precision: a higher one (e.g.
    from jax_default_matmul_precision="highest") makes Mosaic ask for an fp32 contraction, which
    it rejects on bf16 operands ("Bad lhs type"). fp32 operands follow JAX's default precision."""
    precision = None if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _scores(qk, cfg: TpuConfig):
    """(s, t) for fp32 q.k products: s = scale * q.k, or with a soft-cap c, s = c * tanh(t) with
    t = tanh(q.k * scale / c) (reference.softcapped, one multiply before the tanh and one after),
    whose 1 - t^2 the backward needs; t is None without a cap."""
    if cfg.softcap is None:
        return qk * cfg.scale, None
    t = jnp.tanh(qk * (cfg.scale / cfg.softcap))
    return t * cfg.softcap, t


def _cap_grad(ds, t):
    """dS with respect to scale * q.k: times the soft-cap's derivative 1 - t^2 (none without one)."""
    return ds if t is None else ds * (1.0 - t * t)


def _runs(i, j, bq: int, bk: int, window=None):
    """Causal: q block i and kv block j share a visible pair (the block's last query is at or
    past its first key, and with a sliding window the block's last key is less than `window`
    behind its first query)."""
    runs = (i + 1) * bq - 1 >= j * bk
    if window is None:
        return runs
    return jnp.logical_and(runs, i * bq - ((j + 1) * bk - 1) < window)


def _first_kv(i, bq: int, bk: int, window, nk: int):
    """The first kv block q block i visits (0 without a window)."""
    if window is None:
        return 0
    return jnp.minimum(lax.div(jnp.maximum(i * bq - window + 1, 0), bk), nk - 1)


def _segments_meet(q_seg, kv_seg):
    """Whether tiles of query and key segment ids can share a visible pair: their [min, max]
    ranges overlap (kernel.py's rule: disjoint ranges share no id; for packed rows, ids not
    decreasing, overlapping ones do). Reduced in fp32, exact for ids below 2^24."""
    f32 = lambda x: x.astype(jnp.float32)
    return jnp.logical_and(jnp.min(f32(q_seg)) <= jnp.max(f32(kv_seg)), jnp.min(f32(kv_seg)) <= jnp.max(f32(q_seg)))


def _needs_mask(i, j, bq: int, bk: int, *, causal: bool, padded_kv: bool, nk: int, segments: bool, window=None):
    """Python True/False, or a traced bool: whether tile (i, j) needs the element mask."""
    if segments:
        return True
    need = False
    if causal:  # the tile straddles the diagonal: some key is after some query
        need = (j + 1) * bk - 1 > i * bq
        if window is not None:  # ... or the window's far edge: some key is window or more behind
            need = jnp.logical_or(need, (i + 1) * bq - 1 - j * bk >= window)
    elif padded_kv:  # only the last kv tile holds padded keys; causal masks them anyway
        need = j == nk - 1
    return need


def _mask(q_start, k_start, shape, *, keys_on_rows: bool, causal: bool, kv_len, q_seg, kv_seg, window=None):
    """Boolean tile of the visible pairs; [bq, bk], or [bk, bq] when keys_on_rows (dk/dv)."""
    q_axis, k_axis = (1, 0) if keys_on_rows else (0, 1)
    qi = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    ki = k_start + lax.broadcasted_iota(jnp.int32, shape, k_axis)
    mask = None
    if causal:
        mask = qi >= ki if window is None else (qi >= ki) & (qi - ki < window)
    if kv_len is not None:
        mask = ki < kv_len if mask is None else mask & (ki < kv_len)
    if q_seg is not None:
        seg = q_seg == kv_seg  # a column against a row: broadcasts to the tile
        mask = seg if mask is None else mask & seg
    return mask


def _run_tile(runs, need_mask, step):
    """Call step(masked) under pl.when: with the mask where needed, without it elsewhere."""
    if need_mask is True or need_mask is False:
        pl.when(runs)(functools.partial(step, need_mask))
        return
    pl.when(jnp.logical_and(runs, need_mask))(functools.partial(step, True))
    pl.when(jnp.logical_and(runs, jnp.logical_not(need_mask)))(functools.partial(step, False))


def _params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _visited(nq: int, nk: int, bq: int, bk: int, causal: bool, window=None) -> int:
    """Number of (q block, kv block) tiles that run."""
    if not causal:
        return nq * nk
    first = lambda i: 0 if window is None else max(i * bq - window + 1, 0) // bk
    return sum(min(nk, ((i + 1) * bq - 1) // bk + 1) - first(i) for i in range(nq))


def _kv_index(i, j, bq: int, bk: int, nk: int, cfg: TpuConfig):
    """The kv block tile (i, j) fetches: j where it runs; else the next one that runs, q block i's
    first before its window, q block i + 1's first past the diagonal (0 without a window), so that
    skipped steps start no DMA."""
    if not cfg.causal:
        return j
    first = _first_kv(i, bq, bk, cfg.window, nk)
    after = _first_kv(i + 1, bq, bk, cfg.window, nk)
    return lax.select(_runs(i, j, bq, bk, cfg.window), j, lax.select(j < first, first, after))


def _nbytes(*arrays) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


# ----------------------------------------------------------------------------------------------
# Forward.


def _fwd_kernel(*refs, cfg: TpuConfig, kv_len, nk: int, has_segments: bool, padded_kv: bool):
    if has_segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
        qs_ref = ks_ref = None
    bq, bk, h = cfg.block_q, cfg.block_k, q_ref.shape[-1]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s, _ = _scores(_dot(q, k, _NT), cfg)  # [bq, bk]
        mask = None
        if masked:
            mask = _mask(
                i * bq,
                j * bk,
                (bq, bk),
                keys_on_rows=False,
                causal=cfg.causal,
                window=cfg.window,
                kv_len=kv_len if padded_kv else None,
                q_seg=None if qs_ref is None else qs_ref[0][:, None],
                kv_seg=None if ks_ref is None else ks_ref[...],
            )
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - platforms.lanes(m_next, bk))
        if masked:  # an all-masked row has s == m_next == MASK_VALUE, so p would be 1
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        acc_ref[...] = acc_ref[...] * platforms.lanes(alpha, h) + _dot(p.astype(v.dtype), v, _NN)

    runs = _runs(i, j, bq, bk, cfg.window) if cfg.causal else True
    if has_segments:  # wholly masked by the segment ids: skipped
        runs = jnp.logical_and(runs, _segments_meet(qs_ref[...], ks_ref[...]))
    _run_tile(
        runs,
        _needs_mask(
            i, j, bq, bk, causal=cfg.causal, padded_kv=padded_kv, nk=nk, segments=has_segments, window=cfg.window
        ),
        step,
    )

    @pl.when(j == nk - 1)
    def _finish():
        l, m = l_ref[...], m_ref[...]
        nonempty = l > 0.0
        l_safe = jnp.where(nonempty, l, 1.0)
        o_ref[...] = (acc_ref[...] / platforms.lanes(l_safe, h)).astype(o_ref.dtype)
        lse = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)  # [bq, 128], equal lanes
        lse_ref[...] = lse.T[:1, :]  # one lane-dense row [1, bq]


def _forward_padded(qt, kt, vt, q_seg, kv_seg, cfg: TpuConfig, kv_len: int):
    """qt [B, N, Tp, H], kt/vt [B, K, Sp, H], segment ids [B, 1, Tp] / [B, 1, Sp] or None ->
    (o [B, N, Tp, H], lse [B, N, 1, Tp])."""
    b, n, tp, h = qt.shape
    kh, sp = kt.shape[1], kt.shape[2]
    g, bq, bk = n // kh, cfg.block_q, cfg.block_k
    nq, nk = tp // bq, sp // bk
    padded_kv = sp != kv_len

    def kv_index(i, j):  # skipped causal tiles fetch the next kv block that runs
        return _kv_index(i, j, bq, bk, nk, cfg)

    q_spec = pl.BlockSpec((None, None, bq, h), lambda n_, b_, i, j: (b_, n_, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, h), lambda n_, b_, i, j: (b_, lax.div(n_, g), kv_index(i, j), 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda n_, b_, i, j: (b_, n_, 0, i))
    in_specs, args = [q_spec, kv_spec, kv_spec], [qt, kt, vt]
    if q_seg is not None:
        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda n_, b_, i, j: (b_, 0, i)),
            pl.BlockSpec((None, 1, bk), lambda n_, b_, i, j: (b_, 0, kv_index(i, j))),
        ]
        args += [q_seg, kv_seg]
    out_shape = [jax.ShapeDtypeStruct(qt.shape, qt.dtype), jax.ShapeDtypeStruct((b, n, 1, tp), jnp.float32)]
    tiles = b * n * _visited(nq, nk, bq, bk, cfg.causal, cfg.window)
    cost = pl.CostEstimate(
        flops=4 * tiles * bq * bk * h,  # S = Q K^T and P V on every tile that runs
        transcendentals=tiles * bq * bk * (1 if cfg.softcap is None else 2),  # exp (and tanh)
        bytes_accessed=_nbytes(qt, *out_shape) + 2 * tiles * bk * h * kt.dtype.itemsize,
    )
    kernel = functools.partial(
        _fwd_kernel, cfg=cfg, kv_len=kv_len, nk=nk, has_segments=q_seg is not None, padded_kv=padded_kv
    )
    return pl.pallas_call(
        kernel,
        grid=(n, b, nq, nk),  # heads first: see the module docstring (megacore)
        in_specs=in_specs,
        out_specs=[q_spec, row_spec],
        out_shape=out_shape,
        scratch_shapes=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, h), jnp.float32),
        ],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=cfg.interpret,
        name="flash_attention_tpu_fwd",
    )(*args)


# ----------------------------------------------------------------------------------------------
# Backward.


def _dq_kernel(*refs, cfg: TpuConfig, kv_len, nk: int, has_segments: bool, padded_kv: bool):
    if has_segments:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref, acc_ref) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref = refs
        qs_ref = ks_ref = None
    bq, bk = cfg.block_q, cfg.block_k
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        lse = lse_ref[0][:, None]  # the stored row as a column [bq, 1]
        delta = delta_ref[0][:, None]
        s, t = _scores(_dot(q, k, _NT), cfg)  # [bq, bk]
        p = jnp.exp(s - lse)
        if masked:
            mask = _mask(
                i * bq,
                j * bk,
                (bq, bk),
                keys_on_rows=False,
                causal=cfg.causal,
                window=cfg.window,
                kv_len=kv_len if padded_kv else None,
                q_seg=None if qs_ref is None else qs_ref[0][:, None],
                kv_seg=None if ks_ref is None else ks_ref[...],
            )
            p = jnp.where(mask, p, 0.0)
        ds = _cap_grad(p * (_dot(do, v, _NT) - delta), t)
        acc_ref[...] += _dot(ds.astype(k.dtype), k, _NN)

    runs = _runs(i, j, bq, bk, cfg.window) if cfg.causal else True
    if has_segments:  # wholly masked by the segment ids: skipped
        runs = jnp.logical_and(runs, _segments_meet(qs_ref[...], ks_ref[...]))
    _run_tile(
        runs,
        _needs_mask(
            i, j, bq, bk, causal=cfg.causal, padded_kv=padded_kv, nk=nk, segments=has_segments, window=cfg.window
        ),
        step,
    )

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: TpuConfig, kv_len, nq: int, nk: int, group: int, has_segments: bool, padded_kv: bool):
    if has_segments:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dk_ref, dv_ref, dk_acc, dv_acc) = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
        qs_ref = ks_ref = None
    bq, bk = cfg.block_q, cfg.block_k
    j, gi, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when(jnp.logical_and(gi == 0, i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        st, tt = _scores(_dot(k, q, _NT), cfg)  # S^T [bk, bq]
        pt = jnp.exp(st - lse_ref[...])  # P^T
        if masked:
            mask = _mask(
                i * bq,
                j * bk,
                (bk, bq),
                keys_on_rows=True,
                causal=cfg.causal,
                window=cfg.window,
                kv_len=kv_len if padded_kv else None,
                q_seg=None if qs_ref is None else qs_ref[...],
                kv_seg=None if ks_ref is None else ks_ref[0][:, None],
            )
            pt = jnp.where(mask, pt, 0.0)
        dv_acc[...] += _dot(pt.astype(do.dtype), do, _NN)
        dst = _cap_grad(pt * (_dot(v, do, _NT) - delta_ref[...]), tt)  # dS^T [bk, bq]
        dk_acc[...] += _dot(dst.astype(q.dtype), q, _NN)

    runs = _runs(i, j, bq, bk, cfg.window) if cfg.causal else True
    if has_segments:  # wholly masked by the segment ids: skipped
        runs = jnp.logical_and(runs, _segments_meet(qs_ref[...], ks_ref[...]))
    _run_tile(
        runs,
        _needs_mask(
            i, j, bq, bk, causal=cfg.causal, padded_kv=padded_kv, nk=nk, segments=has_segments, window=cfg.window
        ),
        step,
    )

    @pl.when(jnp.logical_and(gi == group - 1, i == nq - 1))
    def _finish():
        dk_ref[...] = (dk_acc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward_padded(qt, kt, vt, q_seg, kv_seg, dot_, lse, delta, cfg: TpuConfig, kv_len: int):
    """Padded heads-major inputs (lse, delta [B, N, 1, Tp]) -> (dq, dk, dv), heads-major."""
    b, n, tp, h = qt.shape
    kh, sp = kt.shape[1], kt.shape[2]
    g, bq, bk = n // kh, cfg.block_q, cfg.block_k
    nq, nk = tp // bq, sp // bk
    padded_kv = sp != kv_len
    has_segments = q_seg is not None
    tiles = b * n * _visited(nq, nk, bq, bk, cfg.causal, cfg.window)
    isz = qt.dtype.itemsize

    # dq: grid (N, B, q blocks, kv blocks).
    def kv_index(i, j):
        return _kv_index(i, j, bq, bk, nk, cfg)

    q_spec = pl.BlockSpec((None, None, bq, h), lambda n_, b_, i, j: (b_, n_, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, h), lambda n_, b_, i, j: (b_, lax.div(n_, g), kv_index(i, j), 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda n_, b_, i, j: (b_, n_, 0, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [qt, kt, vt, dot_, lse, delta]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda n_, b_, i, j: (b_, 0, i)),
            pl.BlockSpec((None, 1, bk), lambda n_, b_, i, j: (b_, 0, kv_index(i, j))),
        ]
        args += [q_seg, kv_seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, kv_len=kv_len, nk=nk, has_segments=has_segments, padded_kv=padded_kv),
        grid=(n, b, nq, nk),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, qt.dtype),
        scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(  # S, dP = dO V^T, dQ += dS K
            flops=6 * tiles * bq * bk * h,
            transcendentals=tiles * bq * bk * (1 if cfg.softcap is None else 2),  # exp (and tanh)
            bytes_accessed=_nbytes(qt, dot_, lse, delta, qt) + 2 * tiles * bk * h * isz,
        ),
        interpret=cfg.interpret,
        name="flash_attention_tpu_bwd_dq",
    )(*args)

    # dk/dv: grid (K, B, kv blocks, G, q blocks); the G query heads of kv head kh are
    # kh * G + gi, the layout of reference.attention.
    def q_index(j, i):  # skipped causal tiles fetch the first q block that runs for kv block j
        if not cfg.causal:
            return i
        return lax.select(_runs(i, j, bq, bk, cfg.window), i, lax.div(j * bk, bq))

    qg_spec = pl.BlockSpec((None, None, bq, h), lambda k_, b_, j, gi, i: (b_, k_ * g + gi, q_index(j, i), 0))
    kvb_spec = pl.BlockSpec((None, None, bk, h), lambda k_, b_, j, gi, i: (b_, k_, j, 0))
    rowg_spec = pl.BlockSpec((None, None, 1, bq), lambda k_, b_, j, gi, i: (b_, k_ * g + gi, 0, q_index(j, i)))
    in_specs = [qg_spec, kvb_spec, kvb_spec, qg_spec, rowg_spec, rowg_spec]
    args = [qt, kt, vt, dot_, lse, delta]
    if has_segments:
        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda k_, b_, j, gi, i: (b_, 0, q_index(j, i))),
            pl.BlockSpec((None, 1, bk), lambda k_, b_, j, gi, i: (b_, 0, j)),
        ]
        args += [q_seg, kv_seg]
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, cfg=cfg, kv_len=kv_len, nq=nq, nk=nk, group=g, has_segments=has_segments, padded_kv=padded_kv
        ),
        grid=(kh, b, nk, g, nq),
        in_specs=in_specs,
        out_specs=[kvb_spec, kvb_spec],
        out_shape=[jax.ShapeDtypeStruct(kt.shape, kt.dtype), jax.ShapeDtypeStruct(vt.shape, vt.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(  # S^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q
            flops=8 * tiles * bq * bk * h,
            transcendentals=tiles * bq * bk * (1 if cfg.softcap is None else 2),  # exp (and tanh)
            bytes_accessed=_nbytes(kt, vt, kt, vt) + tiles * (2 * bq * h * isz + 2 * bq * 4),
        ),
        interpret=cfg.interpret,
        name="flash_attention_tpu_bwd_dkdv",
    )(*args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Layout, padding, entry points (unpadded [B, T, N, H] in and out, as kernel.py's).


def _heads_major(x, length: int):
    """[B, L, heads, H] -> [B, heads, Lp, H], padded along L with zeros."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0))) if length != x.shape[2] else x


def _seg_row(seg, length: int):
    """[B, L] int32 -> [B, 1, Lp] (padding gets id -1; padded rows/keys are masked anyway)."""
    if seg is None:
        return None
    seg = seg.astype(jnp.int32)
    if length != seg.shape[1]:
        seg = jnp.pad(seg, ((0, 0), (0, length - seg.shape[1])), constant_values=-1)
    return seg[:, None, :]


def _padded(length: int, block: int) -> int:
    return -(-length // block) * block


def forward(q, k, v, q_seg, kv_seg, cfg: TpuConfig):
    """q[B, T, N, H], k/v[B, S, K, H] -> (o[B, T, N, H], lse[B, N, T] fp32)."""
    t, s = q.shape[1], k.shape[1]
    tp, sp = _padded(t, cfg.block_q), _padded(s, cfg.block_k)
    o, lse = _forward_padded(
        _heads_major(q, tp),
        _heads_major(k, sp),
        _heads_major(v, sp),
        _seg_row(q_seg, tp),
        _seg_row(kv_seg, sp),
        cfg,
        kv_len=s,
    )
    return jnp.swapaxes(o[:, :, :t], 1, 2), lse[:, :, 0, :t]


def backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg: TpuConfig):
    """(dq, dk, dv) in the dtypes of q, k, v; see kernel.flash_attention_backward."""
    cfg = dataclasses.replace(cfg, block_q=cfg.bwd_block_q, block_k=cfg.bwd_block_k)
    t, s = q.shape[1], k.shape[1]
    tp, sp = _padded(t, cfg.block_q), _padded(s, cfg.block_k)
    # Delta = rowsum(dO * O) - dlse in XLA (fused), [B, N, T] fp32.
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    # Empty rows: lse = -inf -> +inf, so exp(s - lse) = 0 in every tile, masked or not.
    lse = lse.astype(jnp.float32)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    row = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, tp - t)))[:, :, None, :]  # [B, N, 1, Tp]
    dq, dk, dv = _backward_padded(
        _heads_major(q, tp),
        _heads_major(k, sp),
        _heads_major(v, sp),
        _seg_row(q_seg, tp),
        _seg_row(kv_seg, sp),
        _heads_major(do.astype(q.dtype), tp),
        row(lse),
        row(delta),
        cfg,
        kv_len=s,
    )
    return (jnp.swapaxes(dq[:, :, :t], 1, 2), jnp.swapaxes(dk[:, :, :s], 1, 2), jnp.swapaxes(dv[:, :, :s], 1, 2))
