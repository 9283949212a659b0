"""FlashAttention-3-style attention for Hopper (sm_90a) in Mosaic GPU Pallas: forward and backward.

Same semantics as kernel.py's forward: q[B, T, N, H], k/v[B, S, K, H] -> o[B, T, N, H] in q's
dtype and lse[B, N, T] fp32 (natural log); causal is top-left aligned (T == S); query head n reads
kv head n // G with G = N / K. bf16 or fp16 inputs, H in {64, 128, 256}, optional segment ids
(`supported` says which calls this kernel takes; kernel.py sends the others to the Triton kernel).

One program (CUDA block) per (query head n, tile of 2 * block_q queries, batch b), three
warpgroups of 128 threads:

- warpgroup 2 (memory) only issues TMA loads of K and V blocks of kv head n // G into a ring of
  `stages` shared-memory slots. A load into a slot waits on that slot's "free" barrier, which both
  compute warpgroups arrive on once they have read it; each load arrives on the slot's "ready"
  barrier when its bytes have landed. It gives its registers away (set_max_registers) so the
  compute warpgroups can hold their fp32 tiles.
- warpgroups 0 and 1 (compute) each own block_q = 64 query rows (one wgmma M tile): Q is loaded
  once into shared memory, then for every kv block j
      S = Q K_j^T (wgmma, fp32 accumulators in registers),
      m' = max(m, c * rowmax(S)),  P = exp2(c * S - m'),  alpha = exp2(m - m'),
      l = alpha l + rowsum(P),     acc = alpha acc + P V_j (wgmma, P from registers in q's dtype)
  with c = softmax_scale * log2(e), so the scale is one FMA inside exp2 and m, l live in the base-2
  domain; at the end o = acc / l and lse = ln(2) (m + log2 l).
- Ping-pong: the two compute warpgroups share a "schedule" barrier (two arrivals) that they pass
  twice per kv block, once after issuing Q K^T and once after the softmax, and warpgroup 1 passes
  it once more before its loop. That offsets them by half a step, so one warpgroup's softmax
  (exp2 on the special-function units) runs while the other's matmuls hold the tensor cores.

Causal: a tile of queries [q0, q0 + 2 block_q) needs kv blocks up to the one holding its last
query; the memory warpgroup never loads the blocks past it, and each compute warpgroup stops at
its own diagonal. Only the blocks that straddle a warpgroup's diagonal are masked (a second loop);
the blocks wholly below it run without the iota compare. Warpgroup 0 finishes before warpgroup 1;
it keeps passing the free and schedule barriers for the steps it skips, so neither the ring nor the
ping-pong deadlocks. Programs are launched longest-first (the q tile index is reversed) so the
short causal tiles fill the tail of the grid.

Backward (`backward`, H = 64 / 128 / 256, S a multiple of 128; otherwise kernel.py's custom_vjp
uses the generic FlashAttention-2 backward). Delta = rowsum(dO * O) - dlse is computed in plain
JAX; both kernels recompute P = exp2(c S - log2(e) lse) from the forward's lse and use 64-row
blocks:
- dQ kernel, one program per (query head, 128 queries, batch): each compute warpgroup keeps its
  Q, dO, lse and Delta rows resident; the memory warpgroup streams K and V blocks of bk keys
  (causal: up to the tile's diagonal) through a ring; per block S = Q K^T, dP = dO V^T,
  dS = P (dP - Delta), dQ += dS K (three wgmmas), and dQ is scaled at the end. bk = 64, or 32 at
  H = 256 (the resident Q and dO alone take 128 KiB there; two 32 KiB slots fit beside them).
  Causal: the blocks before a warpgroup's rows are unmasked, the 64 / bk blocks of its own rows'
  keys are masked.
- dK/dV kernel, one program per (kv head, 128 keys, batch): each compute warpgroup keeps its K and
  V rows resident; the memory warpgroup streams, for each of the G query heads of the group in
  turn, the Q, dO, lse and Delta blocks from the tile's diagonal on (causal) through a ring; per
  block S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - Delta), dK += dS^T Q.
  The sum over the group happens in the kernel: no per-query-head dK/dV, no repeat of K/V.
  Causal: only a warpgroup's diagonal block is masked; warpgroup 1 skips (waits and frees)
  warpgroup 0's diagonal block of every head.
- dK/dV at H = 256 (BWD_SPLIT_HEAD_DIMS; FlashAttention-3's hdim-256 backward): a warpgroup's own
  dK and dV [64, 256] fp32 accumulators would need 256 registers a thread, so one program per
  (kv head, 64 keys, batch) and the two warpgroups share its resident K and V. Per streamed block
  of 64 queries, warpgroup w takes query columns [32 w, 32 w + 32): S^T_w = K Q_w^T [64, 32]
  (full H), P^T_w, dP^T_w = V dO_w^T, dS^T_w; it stores P^T_w and dS^T_w into its columns of a
  shared [64 keys, P^T | dS^T] exchange buffer, the two pass a two-arrival barrier, and warpgroup w
  accumulates its half of the head dim, dV[:, w] += P^T dO[:, w] and dK[:, w] += dS^T Q[:, w]
  ([64, 128] each: 128 accumulator registers). The same barrier, passed once more before the next
  block's stores, keeps either warpgroup from overwriting the buffer while the other's wgmmas still
  read it; at the end both stage their dK / dV halves into the K / V tiles and warpgroup 0 stores
  them. No product is computed twice: S^T and dP^T are split by queries, dK and dV by head columns.
  Both warpgroups run every block (the diagonal one masked), so neither skips. The 32-wide tiles
  (dQ's key blocks, the exchange halves) need the 64-byte swizzle, and a wgmma's two operands share
  one, so both H = 256 kernels use it throughout (128-byte elsewhere).
- Fused (H = 64 / 128, the default; `backward_variant("split")` keeps the two kernels above):
  FlashAttention-3's backward. The dK/dV kernel also computes, per block, its warpgroup's share
  of dQ, dS K over its 64 keys ([64 queries, H] fp32, dS read transposed from the dS^T it stores
  in shared memory), stages it in shared memory and adds it into an fp32 accumulator [B, T, N, H]
  by TMA reduce-add (`cp.reduce.async.bulk .add`); the accumulator is a zeroed `jax.new_ref` that
  the call aliases in place, scaled and cast after. Five matmuls a block instead of the split
  backward's seven (its dQ kernel recomputes S and dP), for an fp32 add of [64, H] per warpgroup
  and block into L2, more registers (ptxas spills at H = 128: docs) and a dQ that is not bitwise
  reproducible (the adds land in any order). Pallas' interpreter has no reduce-add, so there each
  warpgroup of each kv tile stores into its own slice of a [S / 64, B, T, N, H] buffer that plain
  JAX sums: the one place the interpreted fused kernel differs. Which variant is faster is for a
  GPU to say (bench.py's `mosaic` and `mosaic_split` columns).
There is no ping-pong in the backward (one schedule would need both kernels' softmax-like parts
to be long enough to hide; not measured).

Segment ids (kernel.py's semantics: query i sees key j iff q_seg[i] == kv_seg[j], AND causal):
the streamed blocks' int32 ids ride the ring (a TMA load into an id slot per stage, with its own
ready barrier, freed with the block's data), each compute warpgroup loads its resident rows' ids
once, and the mask is their outer equality (AND the causal compare on the diagonal), applied to
every visited block. Disjoint blocks are skipped by range: `_block_ranges` (plain JAX, before the
kernels) gives each tile the first and last streamed block whose [min, max] id range overlaps the
tile's; every block outside is disjoint (safe for any ids), so the memory warpgroup never loads it
and the compute warpgroups start and stop there (for packed rows, ids non-decreasing, the tile's
documents' blocks; disjoint blocks inside the range are masked, not skipped). Empty rows: the
forward keeps m at a finite MASK_VALUE, zeroes masked P and writes o = 0, lse = -inf where l = 0;
in the backward such a row's P is inf before the mask, which zeroes it, so its gradients are 0.
Without segment ids the code is unchanged (the -inf mask, which relies on every causal row seeing
key 0).

Interpret mode (cfg.interpret, backend="mosaic_gpu" on CPU): Pallas' GPU interpreter runs the same
warpgroups, barriers and TMA copies on the CPU, one thread per warpgroup. It cannot run two
constructs of the compiled kernels, so the interpreted variant differs in exactly these (jax
0.11.2): a wgmma operand held in registers (P in the forward, dS, P^T and dS^T in the backward)
goes through shared memory (the interpreter's wgmma reads only shared-memory operands; the H = 256
dK/dV exchange is shared memory on the GPU too), and an
accumulating wgmma goes into a fresh accumulator added to the old one (it cannot run
`pl.run_state` over an accumulator, which the GPU kernels use to accumulate in place): the
`_lhs` / `_accumulate` helpers and the forward's two `if cfg.interpret` branches. Everything else
(the rings, the ping-pong, the causal and segment ranges and masks, exp2 scaling, GQA, lse, Delta,
empty rows) is the code the GPU runs, and tests/test_flash_attention_mgpu.py checks its numerics
against the reference. `check_races` runs them under the interpreter's race detector, with the
wgmma operand reads it leaves out added (kernels/mgpu_races.py): the barriers and fences that
order shared memory between the warpgroups and the TMA engine are checked there.

What only a GPU settles: Mosaic's compile to PTX/SASS (a deviceless XLA:GPU compile succeeds but
carries the Mosaic module inside the custom call; the checks without a GPU stop at the Mosaic GPU
MLIR: wgmma / TMA ops, shared memory <= 227 KiB),
the register operands and in-place accumulation, register pressure (spills), real concurrency of
the warpgroups (timing; the interpreter's wgmma is synchronous), numerics of the compiled kernels (`check_on_gpu`, bench.py's error columns) and
speed. With segment ids also: the int32 id TMA loads and the scalar range reads from global memory
compiled, the registers the broadcast ids and the equality mask add, and what the skip saves on
packed rows (`check_on_gpu(segments=True)`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import tuning

__all__ = [
    "MgpuConfig",
    "backward",
    "check_on_gpu",
    "check_races",
    "forward",
    "gpu_capability",
    "make_config",
    "supported",
    "tiles",
    "why_not",
]

WG_ROWS = 64  # query rows per compute warpgroup: the M of one wgmma tile
COMPUTE_WGS = 2
SMEM_LIMIT_BYTES = 227 * 1024  # sm_90's largest dynamic shared memory per block
HEAD_DIMS = (64, 128, 256)
BWD_ROWS = 64  # rows per compute warpgroup, and the streamed block, in both backward kernels
BWD_HEAD_DIMS = (64, 128, 256)
# dK/dV at these H: both warpgroups share 64 keys and split the head dim (FA3's hdim-256 backward):
# a warpgroup's own dK and dV [64, H] fp32 accumulators would need 256 registers a thread
BWD_SPLIT_HEAD_DIMS = (256,)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LN2 = math.log(2.0)
# Finite stand-in for -inf with segment ids (kernel.py's): a row may see no key in a block, or at
# all, and -inf - (-inf) would put NaN into alpha; masked P is zeroed explicitly.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static parameters of one call (hashable: part of kernel.py's Plan). `backward` is the generic
    kernel's config that the custom_vjp's backward runs with; `interpret` runs the kernel in
    Pallas' GPU interpreter (module docstring)."""

    scale: float
    causal: bool
    block_k: int
    stages: int
    backward: Any = None
    mosaic_backward: bool = False  # this module's backward kernels, else the generic `backward` config's
    interpret: bool = False
    fused_dq: bool = True  # dQ accumulated by the dK/dV kernel (FA3), else its own kernel (`backward`)
    detect_races: bool = False  # interpreted with the race detector on (`check_races`)


def _interpret_params(cfg: MgpuConfig):
    """The interpreter's parameters for an interpreted call, else None (compiled)."""
    return plgpu.InterpretGPUParams(detect_races=cfg.detect_races) if cfg.interpret else None


def _smem_bytes(h: int, block_k: int, stages: int, itemsize: int, has_segments: bool = False) -> int:
    """Shared memory of one program: Q/O tiles of both compute warpgroups, the K and V ring, the
    lse staging rows, with segment ids their int32 rows (barriers and alignment come on top:
    checked against Mosaic's own count in the tests)."""
    seg = 4 * (COMPUTE_WGS * WG_ROWS + stages * block_k) if has_segments else 0
    return itemsize * (COMPUTE_WGS * WG_ROWS * h + 2 * stages * block_k * h) + 4 * COMPUTE_WGS * WG_ROWS + seg


def tiles(h: int, s: int, itemsize: int = 2, has_segments: bool = False) -> tuple[int, int] | None:
    """(block_k, stages) for head dim h and S = s keys, or None: the widest key block (256, 128 or
    64) that divides s, keeps the fp32 score tile plus accumulator within the compute warpgroups'
    registers (block_k * h <= 128 * 128) and whose two-slot ring fits in shared memory; then as
    many slots (up to 4) as fit. Wider key blocks mean fewer barrier round trips per row, more
    slots hide TMA latency. Not yet swept on a GPU."""
    budget = SMEM_LIMIT_BYTES - 4096  # barriers and 1 KiB alignment of the swizzled buffers
    fits = lambda bk, stages: _smem_bytes(h, bk, stages, itemsize, has_segments) <= budget
    block_k = next((bk for bk in (256, 128, 64) if s % bk == 0 and bk * h <= 128 * 128 and fits(bk, 2)), None)
    if block_k is None:
        return None
    return block_k, max(st for st in (2, 3, 4) if fits(block_k, st))


def supported(t: int, s: int, h: int, dtype, *, causal: bool, scale: float, has_segments: bool) -> str | None:
    """None when this kernel can run the call, else why not (kernel.py then uses Triton)."""
    if h not in HEAD_DIMS:
        return f"head dim {h} not in {HEAD_DIMS}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not bf16 or fp16"
    if not scale > 0:
        return "softmax_scale must be positive (the row max is taken before scaling)"
    if t % (COMPUTE_WGS * WG_ROWS):
        return f"T = {t} is not a multiple of {COMPUTE_WGS * WG_ROWS}"
    if tiles(h, s, jnp.dtype(dtype).itemsize, has_segments) is None:
        return f"S = {s} is not a multiple of 64"
    if causal and t != s:
        return "causal needs T == S"
    return None


# Hopper parts by device kind, for abstract devices (AOT meshes), which carry no compute capability.
_HOPPER_KINDS = re.compile(r"\bG?H(100|200|800|20)\b")


def gpu_capability() -> tuple[int, int] | None:
    """Compute capability of the GPU the program is being traced for, or None (not a GPU, or not
    known). The mesh in context wins (its abstract device: an AOT compile for deviceless H100s
    traced on a CPU host, or shard_map over real GPUs); without one, the default device."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if dev is not None:
        if dev.platform != "gpu":
            return None
        return (9, 0) if _HOPPER_KINDS.search(dev.device_kind) else None
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
    if not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def why_not(capability, t: int, s: int, h: int, dtype, *, causal: bool, scale: float, has_segments: bool):
    """None when backend=None should run this kernel on CUDA, else the reason it does not. Hopper
    only (major 9): wgmma is an sm_90a instruction, which Blackwell (sm_100) does not have."""
    if capability is None or capability[0] != 9:
        return f"not a Hopper GPU (compute capability {capability})"
    return supported(t, s, h, dtype, causal=causal, scale=scale, has_segments=has_segments)


def backward_variant(name: str):
    """Trace the Mosaic backward as `name` inside this block (a `with` context): "fused" (one dK/dV
    kernel that also adds dQ = dS K into an fp32 accumulator, five matmuls a block) or "split" (a
    dQ kernel beside it that recomputes S and dP: seven). Outside such a block the tuning cache
    chooses for the shape and device (kernels/tuning.py, kernel "flash_attention_mgpu"), else
    "fused". Read when a function is traced: one jitted before the block keeps its variant."""
    return tuning.use_config("flash_attention_mgpu", {"backward": name})


def make_config(
    h: int, s: int, dtype, *, scale: float, causal: bool, backward=None, has_segments: bool = False
) -> MgpuConfig:
    """The config for a supported call (`supported` returned None)."""
    block_k, stages = tiles(h, s, jnp.dtype(dtype).itemsize, has_segments) or (0, 0)
    mosaic_backward = h in BWD_HEAD_DIMS and s % (COMPUTE_WGS * BWD_ROWS) == 0
    tuned = tuning.flash_attention_mgpu_config(head_dim=h, dtype=dtype, causal=causal, seq_len=s)
    tuned_backward = tuned.get("backward", "fused")
    return MgpuConfig(
        scale=scale,
        causal=causal,
        block_k=block_k,
        stages=stages,
        backward=backward,
        mosaic_backward=mosaic_backward,
        fused_dq=tuned_backward == "fused",
    )


def _kernel(q_ref, k_ref, v_ref, segs, o_ref, lse_ref, *scratch, cfg: MgpuConfig, group: int, num_q_tiles: int, s: int):
    (q_smem2, k_smem, v_smem, lse_smem2, *p_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), sched, *seg = scratch
    # segment ids: segs = (q ids [B, T], kv ids [B, S], `_block_ranges` [B, tiles, 2]) in gmem;
    # seg = ((own q ids, kv id ring), (their ready barriers)); the kv id slot is freed with the V
    # slot (read before V's free)
    (qseg_smem2, kseg_smem), (qseg_ready, kseg_ready) = seg[0] if seg else ((None, None), (None, None))
    bq, bk, h = WG_ROWS, cfg.block_k, q_ref.shape[-1]
    dtype = q_ref.dtype
    b = lax.axis_index("batch")
    n = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    tile = num_q_tiles - 1 - lax.axis_index("q_tile")  # longest causal rows first
    tile_q0 = tile * (COMPUTE_WGS * bq)
    num_kv = s // bk
    stages = min(cfg.stages, num_kv)
    # kv blocks this program needs: all of them, or (causal) up to the one holding its last query
    tile_steps = lax.div(tile_q0 + COMPUTE_WGS * bq + bk - 1, jnp.int32(bk)) if cfg.causal else num_kv
    first = 0  # the tile's first kv block: with segment ids, [first, tile_steps) holds all it can see
    if segs:  # the blocks outside the tile's range (`_block_ranges`) share no id with it: never loaded
        tile_steps = jnp.minimum(tile_steps, segs[2][b, tile, 1])
        first = jnp.minimum(segs[2][b, tile, 0], tile_steps)
    ring = lambda j: lax.rem(j - first, jnp.int32(stages))  # the ring slot of kv block j
    c = cfg.scale * math.log2(math.e)

    def pass_schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_smem, lse_smem = q_smem2.at[wg], lse_smem2.at[wg]
        q0 = tile_q0 + wg * bq
        # this warpgroup's kv blocks: up to its own diagonal when causal; [0, n_full) need no mask
        steps = lax.div(q0 + bq + bk - 1, jnp.int32(bk)) if cfg.causal else num_kv
        n_full = lax.div(q0, jnp.int32(bk)) if cfg.causal else num_kv
        if segs:
            steps = jnp.maximum(jnp.minimum(steps, tile_steps), first)
            n_full = jnp.maximum(jnp.minimum(n_full, steps), first)
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), n], q_smem, q_ready.at[wg])
        row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        if segs:
            plgpu.copy_gmem_to_smem(segs[0].at[b, pl.ds(q0, bq)], qseg_smem2.at[wg], qseg_ready.at[wg])
            plgpu.barrier_wait(qseg_ready.at[wg])
            q_ids = lax.broadcast_in_dim(plgpu.load(qseg_smem2.at[wg], layout=row), (bq, bk), [0])
        plgpu.barrier_wait(q_ready.at[wg])

        m = plgpu.layout_cast(jnp.full((bq,), MASK_VALUE if segs else -jnp.inf, jnp.float32), row)
        l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row)
        acc = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(steps > first)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(pass_schedule)  # the half-step offset of the ping-pong

        def step(j, carry, *, masked: bool):
            acc, m, l = carry
            slot = ring(j)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                pass_schedule()  # let the other warpgroup's softmax run while ours multiplies
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            visible = None
            if masked:
                rows = q0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
                cols = j * bk + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                visible = rows >= cols
            if segs:
                plgpu.barrier_wait(kseg_ready.at[slot])
                kv_ids = plgpu.load(kseg_smem.at[slot], layout=col)
                same = q_ids == lax.broadcast_in_dim(kv_ids, (bq, bk), [1])
                visible = same if visible is None else jnp.logical_and(visible, same)
                # a row may see nothing here (or anywhere): finite mask value, P zeroed below
                s2 = jnp.where(visible, sc * c, MASK_VALUE)
                m_new = jnp.maximum(m, s2.max(axis=1))
                p = jnp.where(visible, jnp.exp2(s2 - lax.broadcast_in_dim(m_new, sc.shape, [0])), 0.0)
            else:
                if masked:  # -inf is safe: every row sees key 0 in block 0, so m is finite from the first step
                    sc = jnp.where(visible, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1) * c)
                p = jnp.exp2(sc * c - lax.broadcast_in_dim(m_new, sc.shape, [0]))
            alpha = jnp.exp2(m - m_new)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p = p.astype(dtype)
            plgpu.barrier_arrive(sched)  # softmax done: the other warpgroup may use the tensor cores
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(sched)

            if cfg.interpret:  # the interpreter's wgmma reads operands from shared memory only
                p_smem2[0].at[wg][...] = p
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem2[0].at[wg] if cfg.interpret else p, v_smem.at[slot])
                nxt = j + 1

                @pl.when(nxt < steps)  # wait for the next K while P V runs
                def _():
                    plgpu.barrier_wait(k_ready.at[ring(nxt)])

            if cfg.interpret:  # the interpreter cannot run run_state over an accumulator: add a fresh one
                acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1], plgpu.ACC((bq, h), jnp.float32))
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (acc, m, l)
        carry = lax.fori_loop(first, n_full, lambda j, cr: step(j, cr, masked=False), carry)
        if cfg.causal:
            carry = lax.fori_loop(n_full, steps, lambda j, cr: step(j, cr, masked=True), carry)
        if cfg.causal or segs:
            # Blocks only the other warpgroup reads: free them and keep the ping-pong in step. The
            # ready waits keep this warpgroup's view of every barrier phase complete (the GPU
            # interpreter insists; on the GPU they cost idle time of a finished warpgroup).
            @pl.loop(steps, tile_steps)
            def _skipped(j):
                slot = ring(j)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                if segs:
                    plgpu.barrier_wait(kseg_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                pass_schedule()
                pass_schedule()

        acc, m, l = carry
        pl.when(wg == 0)(pass_schedule)  # matches warpgroup 1's extra pass before its loop

        if segs:  # empty rows (l = 0): o = 0 (acc is 0) and lse = -inf
            nonempty = l > 0.0
            l = jnp.where(nonempty, l, 1.0)
            lse = jnp.where(nonempty, (m + jnp.log2(l)) * LN2, -jnp.inf)
        else:
            lse = (m + jnp.log2(l)) * LN2
        o = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        q_smem[...] = o.astype(dtype)  # Q is no longer needed: stage O in its place
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(q0, bq), n])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, n, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(n, jnp.int32(group))

        def load(j, slot):
            rows = (b, pl.ds(j * bk, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            if segs:
                plgpu.copy_gmem_to_smem(segs[1].at[b, pl.ds(j * bk, bk)], kseg_smem.at[slot], kseg_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        for i in range(stages):  # fill the ring, skipping blocks past the tile's diagonal

            @pl.when(first + i < tile_steps)
            def _():
                load(first + i, i)

        @pl.loop(first + stages, tile_steps)
        def _refill(j):
            slot = ring(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            load(j, slot)

        # Observe the last frees too, so no barrier phase is left unseen when the scratch goes.
        @pl.loop(jnp.maximum(tile_steps - stages, first), tile_steps)
        def _drain(j):
            slot = ring(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def _block_ranges(own_ids, other_ids, tile: int, block: int):
    """[B, own tiles, 2] int32 (first, end): the blocks of `block` other ids, in order, from the
    first to the last whose [min, max] id range overlaps that of the own tile's `tile` ids. Every
    block outside is disjoint from the tile (shares no id: nothing visible), so the kernels never
    load it; blocks inside are masked as usual (for packed rows, ids non-decreasing, they are the
    blocks of the tile's documents). No overlap at all: (0, 0)."""
    bsz = own_ids.shape[0]
    own, other = own_ids.reshape(bsz, -1, tile), other_ids.reshape(bsz, -1, block)
    lo_own, hi_own = own.min(-1)[:, :, None], own.max(-1)[:, :, None]
    meet = (lo_own <= other.max(-1)[:, None, :]) & (other.min(-1)[:, None, :] <= hi_own)
    first = jnp.argmax(meet, axis=-1)
    end = meet.shape[-1] - jnp.argmax(meet[..., ::-1], axis=-1)
    any_ = meet.any(-1)
    return jnp.stack([jnp.where(any_, first, 0), jnp.where(any_, end, 0)], axis=-1).astype(jnp.int32)


def forward(q, k, v, q_seg, kv_seg, cfg: MgpuConfig):
    """(o[B, T, N, H], lse[B, N, T] fp32) on a Hopper GPU; `supported` must hold."""
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both q_seg and kv_seg, or neither")
    has_segments = q_seg is not None
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    why = supported(t, s, h, q.dtype, causal=cfg.causal, scale=cfg.scale, has_segments=has_segments)
    if why is not None:
        raise ValueError(f"the Mosaic GPU kernel cannot run this call: {why}")
    bq, bk = WG_ROWS, cfg.block_k
    stages = min(cfg.stages, s // bk)
    num_q_tiles = t // (COMPUTE_WGS * bq)
    # 128-byte swizzled (8, 64) tiles: the shared-memory layout wgmma reads without bank conflicts
    # (jax declares transform_array abstract on these concrete transforms, hence the ignores)
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # type: ignore[abstract]
    scratch = (
        (
            plgpu.SMEM((COMPUTE_WGS, bq, h), q.dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, h), k.dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, h), v.dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),
            *([plgpu.SMEM((COMPUTE_WGS, bq, bk), q.dtype, transforms=transforms)] if cfg.interpret else []),
        ),
        (
            plgpu.Barrier(num_barriers=stages),  # K slot ready
            plgpu.Barrier(num_barriers=stages),  # V slot ready
            plgpu.Barrier(num_barriers=COMPUTE_WGS),  # Q ready
        ),
        (
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # K slot free
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # V slot free
        ),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # schedule (ping-pong)
    )
    if has_segments:
        scratch += (
            (
                (plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32), plgpu.SMEM((stages, bk), jnp.int32)),
                (plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=stages)),
            ),
        )
    segs = (q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)) if has_segments else ()
    if has_segments:
        segs += (_block_ranges(segs[0], segs[1], COMPUTE_WGS * bq, bk),)

    def body(q_ref, k_ref, v_ref, *refs):
        seg_refs, (o_ref, lse_ref, *scratch_refs) = refs[: len(segs)], refs[len(segs) :]  # ids, ids, ranges
        _kernel(
            q_ref,
            k_ref,
            v_ref,
            seg_refs,
            o_ref,
            lse_ref,
            *scratch_refs,
            cfg=cfg,
            group=n // kh,
            num_q_tiles=num_q_tiles,
            s=s,
        )

    body.__name__ = "flash_attention_mgpu_fwd"
    o, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)),
        scratch_types=scratch,
        grid=(n, num_q_tiles, b),
        grid_names=("heads", "q_tile", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(cfg),
    )(q, k, v, *segs)
    return o, lse


# ----------------------------------------------------------------------------------------------
# Backward: a dQ kernel and a dK/dV kernel, both recomputing P = exp2(c S - log2(e) lse) from the
# forward's lse (no softmax statistics are rebuilt), with Delta = rowsum(dO * O) - dlse.


def _lhs(x, scratch, interpret: bool):
    """A wgmma left operand from registers; through shared memory under the interpreter."""
    if not interpret:
        return x
    scratch[...] = x
    plgpu.commit_smem()
    return scratch


def _accumulate(acc, a, b, interpret: bool):
    """acc + a @ b by wgmma, in place on the GPU; into a fresh accumulator under the interpreter."""
    if interpret:
        return acc + _product(a, b, acc.shape)

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(mma)(plgpu.ACC.init(acc))


def _product(a, b, shape):
    """a @ b by wgmma into a fresh fp32 accumulator."""

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _bwd_stages(
    h: int, block: int, per_stage_arrays: int, resident: int, itemsize: int = 2, has_segments: bool = False
) -> int:
    """Ring slots of `per_stage_arrays` [block, H] tiles that fit beside `resident` [64, H] tiles
    and two [64, block] P / dS tiles; with segment ids, int32 id rows in the ring and resident."""
    budget = SMEM_LIMIT_BYTES - 4096
    fixed = itemsize * resident * BWD_ROWS * h + itemsize * COMPUTE_WGS * BWD_ROWS * block
    fixed += 4 * COMPUTE_WGS * BWD_ROWS if has_segments else 0
    per_stage = itemsize * per_stage_arrays * block * h + (12 if has_segments else 8) * block
    return max(1, min(4, (budget - fixed) // per_stage))


def _seg_mask(own_ids, ring_ids, shape):
    """[shape] bool: the warpgroup's resident ids (rows) equal the streamed block's (columns)."""
    return lax.broadcast_in_dim(own_ids, shape, [0]) == lax.broadcast_in_dim(ring_ids, shape, [1])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, group, s, stages, has_segments):
    segs, (dq_ref, *scratch) = (refs[:3], refs[3:]) if has_segments else ((), refs)  # ids, ids, ranges
    own, (k_ready, v_ready, own_ready), free, *seg = scratch
    # segment ids: own q ids and a kv id ring (freed with the K/V slot), their ready barriers
    (qseg_smem2, kseg_smem), (qseg_ready, kseg_ready) = seg[0] if seg else ((None, None), (None, None))
    q_smem2, do_smem2, lse_smem2, delta_smem2, ds_smem2, k_smem, v_smem = own
    bq, bk = BWD_ROWS, k_smem.shape[1]  # bk: 64, or 32 at H = 256 (`backward`)
    h, dtype = q_ref.shape[-1], q_ref.dtype
    b, n, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    tile_q0 = lax.axis_index("q_tile") * (COMPUTE_WGS * bq)
    num_kv = s // bk
    tile_steps = lax.div(tile_q0 + COMPUTE_WGS * bq, jnp.int32(bk)) if cfg.causal else num_kv
    first = 0  # as in the forward: with segment ids the tile's kv blocks are [first, tile_steps)
    if segs:
        tile_q = lax.axis_index("q_tile")
        tile_steps = jnp.minimum(tile_steps, segs[2][b, tile_q, 1])
        first = jnp.minimum(segs[2][b, tile_q, 0], tile_steps)
    c = cfg.scale * math.log2(math.e)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        # FA3's 240 / 24 split, as in dK/dV: at H = 256 the [64, 256] fp32 dQ accumulator plus the
        # causal kernel's two loop bodies spilled 36 / 56 B with 232 / 40 (docs: Mosaic GPU)
        plgpu.set_max_registers(240, action="increase")
        q_smem, do_smem, ds_smem = q_smem2.at[wg], do_smem2.at[wg], ds_smem2.at[wg]
        q0 = tile_q0 + wg * bq
        rows = (b, pl.ds(q0, bq), n)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, own_ready.at[wg * 4])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, own_ready.at[wg * 4 + 1])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, n, pl.ds(q0, bq)], lse_smem2.at[wg], own_ready.at[wg * 4 + 2])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, n, pl.ds(q0, bq)], delta_smem2.at[wg], own_ready.at[wg * 4 + 3])
        for i in range(4):
            plgpu.barrier_wait(own_ready.at[wg * 4 + i])
        row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        if segs:
            plgpu.copy_gmem_to_smem(segs[0].at[b, pl.ds(q0, bq)], qseg_smem2.at[wg], qseg_ready.at[wg])
            plgpu.barrier_wait(qseg_ready.at[wg])
            q_ids = plgpu.load(qseg_smem2.at[wg], layout=row)
        lse2 = plgpu.load(lse_smem2.at[wg], layout=row) * math.log2(math.e)
        delta = plgpu.load(delta_smem2.at[wg], layout=row)
        # causal: the blocks before q0 are wholly visible, the bq / bk blocks of the rows' own keys
        # straddle the diagonal (masked)
        steps = lax.div(q0 + bq, jnp.int32(bk)) if cfg.causal else num_kv
        n_full = lax.div(q0, jnp.int32(bk)) if cfg.causal else num_kv
        if segs:
            steps = jnp.maximum(jnp.minimum(steps, tile_steps), first)
            n_full = jnp.maximum(jnp.minimum(n_full, steps), first)

        def step(j, dq, *, masked: bool):
            slot = lax.rem(j - first, jnp.int32(stages))
            plgpu.barrier_wait(k_ready.at[slot])
            sc = _product(q_smem, k_smem.at[slot].transpose((1, 0)), (bq, bk))
            # an empty row has lse = -inf and P = inf before the mask, which covers all its keys
            p = jnp.exp2(sc * c - lax.broadcast_in_dim(lse2, sc.shape, [0]))
            visible = None
            if masked:
                qi = q0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
                kj = j * bk + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                visible = qi >= kj
            if segs:
                plgpu.barrier_wait(kseg_ready.at[slot])
                same = _seg_mask(q_ids, plgpu.load(kseg_smem.at[slot], layout=col), (bq, bk))
                visible = same if visible is None else jnp.logical_and(visible, same)
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
            plgpu.barrier_wait(v_ready.at[slot])
            dp = _product(do_smem, v_smem.at[slot].transpose((1, 0)), (bq, bk))
            ds = (p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))).astype(dtype)
            dq = _accumulate(dq, _lhs(ds, ds_smem, cfg.interpret), k_smem.at[slot], cfg.interpret)
            plgpu.barrier_arrive(free.at[slot])
            return dq

        dq = plgpu.layout_cast(jnp.full((bq, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        dq = lax.fori_loop(first, n_full, lambda j, a: step(j, a, masked=False), dq)
        if cfg.causal:
            dq = lax.fori_loop(n_full, steps, lambda j, a: step(j, a, masked=True), dq)
        if cfg.causal or segs:

            @pl.loop(steps, tile_steps)  # blocks only warpgroup 1 reads
            def _skipped(j):
                slot = lax.rem(j - first, jnp.int32(stages))
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                if segs:
                    plgpu.barrier_wait(kseg_ready.at[slot])
                plgpu.barrier_arrive(free.at[slot])

        q_smem[...] = (dq * cfg.scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(24, action="decrease")
        kv_head = lax.div(n, jnp.int32(group))

        def load(j, slot):
            blk = (b, pl.ds(j * bk, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_ready.at[slot])
            if segs:
                plgpu.copy_gmem_to_smem(segs[1].at[b, pl.ds(j * bk, bk)], kseg_smem.at[slot], kseg_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_ready.at[slot])

        _stream(lambda j, slot: load(first + j, slot), free, tile_steps - first, stages)


def _stream(load, free, total, stages: int):
    """The memory warpgroup's ring: fill `stages` slots, then refill each slot once both compute
    warpgroups freed it, then observe the last frees (the interpreter checks every phase is seen)."""
    for j in range(stages):

        @pl.when(j < total)
        def _():
            load(j, j)

    @pl.loop(stages, total)
    def _refill(j):
        slot = lax.rem(j, jnp.int32(stages))
        plgpu.barrier_wait(free.at[slot])
        load(j, slot)

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(j):
        plgpu.barrier_wait(free.at[lax.rem(j, jnp.int32(stages))])


def _add_dq(ds_t, k_smem, dq_smem, dq_acc, part, b, i, n, cfg):
    """Add one warpgroup's share of query block i's dQ, dS K over its 64 keys (fp32, unscaled; dS
    read transposed from `ds_t` = dS^T in shared memory), into the accumulator: staged in shared
    memory (once the previous add has read it out), then a TMA reduce-add, FlashAttention-3's dQ
    accumulation. The adds of different kv tiles land in any order: dQ is not bitwise
    reproducible on the GPU. (Computing it in 64-column halves at H = 128 spilled more.)"""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dq_smem[...] = _product(ds_t.transpose((1, 0)), k_smem, dq_smem.shape)
    plgpu.commit_smem()
    dst = dq_acc.at[part, b, pl.ds(i * BWD_ROWS, BWD_ROWS), n]
    plgpu.copy_smem_to_gmem(dq_smem, dst, reduction_op=None if cfg.interpret else "add")


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, group, t, stages, has_segments, split, fused_dq
):
    segs, refs = (refs[:3], refs[3:]) if has_segments else ((), refs)  # ids, ids, ranges
    # fused_dq: the dQ accumulator [parts, B, T, N, H] fp32 (an input ref, zeros, written in place)
    dq_acc, refs = (refs[0], refs[1:]) if fused_dq else (None, refs)
    dk_ref, dv_ref, *scratch = refs
    own, ring, (q_ready, do_ready, lse_ready, delta_ready, own_ready), free, *rest = scratch
    xchg = rest.pop(0) if split else None  # split: the two-arrival barrier guarding the P^T / dS^T exchange
    # segment ids: own kv ids and a q id ring (freed with the Q/dO/lse/Delta slot), their barriers
    (kseg_smem2, qseg_smem), (kseg_ready, qseg_ready) = rest[0] if rest else ((None, None), (None, None))
    k_smem2, v_smem2, p_smem2, *dq_smem2 = own
    q_smem, do_smem, lse_smem, delta_smem = ring
    bk = bq = BWD_ROWS
    h, dtype = k_ref.shape[-1], k_ref.dtype
    b, kvh, wg = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("wg")
    keys = bk if split else COMPUTE_WGS * bk  # per program: shared by both warpgroups when split
    tile_k0 = lax.axis_index("kv_tile") * keys
    num_q = t // bq
    # q blocks this tile needs, per query head of the group: causal starts at the tile's diagonal
    tile_first = lax.div(tile_k0, jnp.int32(bq)) if cfg.causal else jnp.int32(0)
    q_end = num_q  # with segment ids: the q blocks [tile_first, q_end) hold all the tile can see
    if segs:
        tile_kv = lax.axis_index("kv_tile")
        q_end = jnp.minimum(q_end, segs[2][b, tile_kv, 1])
        tile_first = jnp.minimum(jnp.maximum(tile_first, segs[2][b, tile_kv, 0]), q_end)
    per_head = q_end - tile_first
    c = cfg.scale * math.log2(math.e)
    n_of = lambda g: kvh * group + g  # the query head of the group's g-th member

    def pass_xchg():
        plgpu.barrier_arrive(xchg)
        plgpu.barrier_wait(xchg)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        # FA3's split for two consumers (the producer keeps 24): dK and dV, two [64, H] fp32
        # accumulators (split: [64, H / 2]), spilled 52 / 72 B at H = 128 causal with 232 (docs: Mosaic GPU)
        plgpu.set_max_registers(240, action="increase")
        mine = 0 if split else wg  # the warpgroup's own K and V rows (split: the program's, shared)
        k_smem, v_smem = k_smem2.at[mine], v_smem2.at[mine]
        k0 = tile_k0 + (0 if split else wg * bk)
        # split: this warpgroup's query columns of each block (S^T, dP^T) and head columns (dK, dV)
        nq, hw = (bq // 2, h // 2) if split else (bq, h)
        qcols, hcols = pl.ds(wg * nq if split else 0, nq), pl.ds(wg * hw if split else 0, hw)
        # fused: the accumulator slice this warpgroup adds to, by TMA reduce-add on the GPU; the
        # interpreter has no reduce-add, so there each warpgroup of each tile stores its own part
        dq_smem = dq_smem2[0].at[wg] if fused_dq else None
        part = lax.axis_index("kv_tile") * COMPUTE_WGS + wg if cfg.interpret else 0
        rows = (b, pl.ds(k0, bk), kvh)
        col = plgpu.Layout.WGMMA.reduce(0)

        def load_own():
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, own_ready.at[mine * 2])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, own_ready.at[mine * 2 + 1])
            if segs:
                plgpu.copy_gmem_to_smem(segs[1].at[b, pl.ds(k0, bk)], kseg_smem2.at[mine], kseg_ready.at[mine])

        pl.when(wg == 0)(load_own) if split else load_own()
        plgpu.barrier_wait(own_ready.at[mine * 2])
        plgpu.barrier_wait(own_ready.at[mine * 2 + 1])
        if segs:
            plgpu.barrier_wait(kseg_ready.at[mine])
            kv_ids = plgpu.load(kseg_smem2.at[mine], layout=plgpu.Layout.WGMMA.reduce(1))
        first = lax.div(k0, jnp.int32(bq)) if cfg.causal else jnp.int32(0)  # this warpgroup's diagonal block
        if segs:
            first = jnp.minimum(jnp.maximum(first, tile_first), q_end)

        def step(g, i, carry, *, masked: bool):
            dk, dv = carry
            slot = lax.rem(g * per_head + i - tile_first, jnp.int32(stages))
            q_blk, do_blk = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(lse_ready.at[slot])
            st = _product(k_smem, q_blk.at[qcols].transpose((1, 0)), (bk, nq))  # S^T
            lse2 = plgpu.load(lse_smem.at[slot, qcols], layout=col) * math.log2(math.e)
            pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse2, st.shape, [1]))
            visible = None
            if masked:  # query i*bq + q_col + c sees key k0 + r iff c - r >= k0 - i*bq - q_col
                r = plgpu.broadcasted_iota(jnp.int32, (bk, nq), 0, layout=plgpu.Layout.WGMMA)
                c_ = plgpu.broadcasted_iota(jnp.int32, (bk, nq), 1, layout=plgpu.Layout.WGMMA)
                visible = c_ - r >= k0 - i * bq - (wg * nq if split else 0)
            if segs:
                plgpu.barrier_wait(qseg_ready.at[slot])
                same = _seg_mask(kv_ids, plgpu.load(qseg_smem.at[slot, qcols], layout=col), (bk, nq))
                visible = same if visible is None else jnp.logical_and(visible, same)
            if visible is not None:  # also zeroes empty rows' P (inf: their lse is -inf)
                pt = jnp.where(visible, pt, 0.0)
            plgpu.barrier_wait(do_ready.at[slot])
            plgpu.barrier_wait(delta_ready.at[slot])
            if not split:  # dV first: P^T's registers are free again before dP^T takes its own
                dv = _accumulate(dv, _lhs(pt.astype(dtype), p_smem2.at[wg], cfg.interpret), do_blk, cfg.interpret)
            dpt = _product(v_smem, do_blk.at[qcols].transpose((1, 0)), (bk, nq))
            delta = plgpu.load(delta_smem.at[slot, qcols], layout=col)
            dst = (pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))).astype(dtype)
            if split:  # exchange the query halves through shared memory: [64 keys, P^T | dS^T]
                pass_xchg()  # the other warpgroup's wgmmas have read the last block's P^T, dS^T
                p_smem2.at[:, pl.ds(wg * nq, nq)][...] = pt.astype(dtype)
                p_smem2.at[:, pl.ds(bq + wg * nq, nq)][...] = dst
                plgpu.commit_smem()
                pass_xchg()  # both halves written
                # (static column slices: an integer index would enter run_state as a constant)
                dv = _accumulate(dv, p_smem2.at[:, pl.ds(0, bq)], do_blk.at[:, hcols], cfg.interpret)
                dk = _accumulate(dk, p_smem2.at[:, pl.ds(bq, bq)], q_blk.at[:, hcols], cfg.interpret)
            else:
                p_smem = p_smem2.at[wg]
                if fused_dq:  # dS^T to shared memory: dQ's wgmma reads it transposed from there
                    _lhs(dst, p_smem, True)  # (dK's operand stays in registers: fewer spills, ptxas 13.5)
                dk = _accumulate(dk, _lhs(dst, p_smem, cfg.interpret), q_blk, cfg.interpret)
                if fused_dq:
                    _add_dq(p_smem, k_smem, dq_smem, dq_acc, part, b, i, n_of(g), cfg)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        def skip(g, i):
            slot = lax.rem(g * per_head + i - tile_first, jnp.int32(stages))
            for ready in (q_ready, do_ready, lse_ready, delta_ready, *([qseg_ready] if segs else [])):
                plgpu.barrier_wait(ready.at[slot])
            plgpu.barrier_arrive(free.at[slot])

        def head(g, carry):
            # split: k0 is the tile's, so first == tile_first and no warpgroup skips a block
            if segs:  # every block masked; the causal compare is all true past the diagonal block
                if cfg.causal:
                    pl.loop(tile_first, first)(lambda i: skip(g, i))
                return lax.fori_loop(first, q_end, lambda i, cr: step(g, i, cr, masked=cfg.causal), carry)
            if cfg.causal:
                pl.loop(tile_first, first)(lambda i: skip(g, i))  # warpgroup 1 skips warpgroup 0's diagonal
                carry = step(g, first, carry, masked=True)
                start = first + 1
            else:
                start = jnp.int32(0)
            return lax.fori_loop(start, num_q, lambda i, cr: step(g, i, cr, masked=False), carry)

        zeros = plgpu.layout_cast(jnp.full((bk, hw), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
        if fused_dq:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last dQ add has left dq_smem
        # K and V are free: split, both warpgroups are past the last block's exchange (and its S^T, dP^T)
        k_smem.at[:, hcols][...] = (dk * cfg.scale).astype(dtype)
        v_smem.at[:, hcols][...] = dv.astype(dtype)
        plgpu.commit_smem()

        def store():
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        if split:
            pass_xchg()  # both head halves staged
            pl.when(wg == 0)(store)
        else:
            store()

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(24, action="decrease")

        def load(j, slot):
            g, i = lax.div(j, per_head), tile_first + lax.rem(j, per_head)
            n = n_of(g)
            blk = (b, pl.ds(i * bq, bq), n)
            plgpu.copy_gmem_to_smem(q_ref.at[blk], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[blk], do_smem.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, n, pl.ds(i * bq, bq)], lse_smem.at[slot], lse_ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, n, pl.ds(i * bq, bq)], delta_smem.at[slot], delta_ready.at[slot])
            if segs:
                plgpu.copy_gmem_to_smem(segs[0].at[b, pl.ds(i * bq, bq)], qseg_smem.at[slot], qseg_ready.at[slot])

        _stream(load, free, group * per_head, stages)


def backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg: MgpuConfig):
    """(dq, dk, dv) in the dtypes of q, k, v from the forward's o and lse; `supported` must hold
    and H in BWD_HEAD_DIMS. dK/dV sum the group's query heads inside the kernel (no repeat)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if h not in BWD_HEAD_DIMS or s % (COMPUTE_WGS * BWD_ROWS) or t % (COMPUTE_WGS * BWD_ROWS):
        raise ValueError(f"the Mosaic GPU backward cannot run this call (H = {h}, T = {t}, S = {s})")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both q_seg and kv_seg, or neither")
    has_segments = q_seg is not None
    segs = (q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)) if has_segments else ()
    # the kv blocks each dQ tile can see, and the q blocks each dK/dV tile can (`_block_ranges`)
    r, w = BWD_ROWS, COMPUTE_WGS
    # split: dK/dV programs of 64 keys shared by both warpgroups; dQ streams 32-key blocks (its
    # resident Q and dO take 128 KiB at H = 256). The 32-wide tiles (dQ's key block, the halves of
    # the P^T / dS^T exchange) need the 64-byte swizzle, and a wgmma's operands share one swizzle.
    split = h in BWD_SPLIT_HEAD_DIMS
    dq_block, dkdv_keys, swizzle = (r // 2, r, 64) if split else (r, w * r, 128)
    dq_segs = (*segs, _block_ranges(segs[0], segs[1], w * r, dq_block)) if has_segments else ()
    dkdv_segs = (*segs, _block_ranges(segs[1], segs[0], dkdv_keys, r)) if has_segments else ()
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    do = do.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    tiling = (8, swizzle // q.dtype.itemsize)
    transforms = (plgpu.TilingTransform(tiling), plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]
    tile = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)
    rows = lambda *shape: plgpu.SMEM(shape, jnp.float32)
    interp = _interpret_params(cfg)
    params = plgpu.CompilerParams(approx_math=True)

    # with segment ids: (own ids [mine, r], ring of streamed ids [stages, block]) and their barriers
    seg_scratch = lambda stages, block, mine=w: (
        (
            (
                (plgpu.SMEM((mine, r), jnp.int32), plgpu.SMEM((stages, block), jnp.int32)),
                (plgpu.Barrier(num_barriers=mine), plgpu.Barrier(num_barriers=stages)),
            ),
        )
        if has_segments
        else ()
    )

    # fused (H = 64 / 128): the dK/dV kernel adds dS K into this fp32 accumulator, one part per
    # warpgroup and kv tile when interpreted (no TMA reduce-add there), summed here
    fused = cfg.fused_dq and not split
    if fused:
        parts = (s // r) if cfg.interpret else 1
        dq_acc = jax.new_ref(jnp.zeros((parts, b, t, n, h), jnp.float32))
    else:
        stages = min(_bwd_stages(h, dq_block, 2, 2 * w, has_segments=has_segments), s // dq_block)
        dq = plgpu.kernel(
            functools.partial(_dq_kernel, cfg=cfg, group=n // kh, s=s, stages=stages, has_segments=has_segments),
            out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
            scratch_types=(
                (
                    tile(w, r, h),
                    tile(w, r, h),
                    rows(w, r),
                    rows(w, r),
                    tile(w, r, dq_block),
                    tile(stages, dq_block, h),
                    tile(stages, dq_block, h),
                ),
                (
                    plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_barriers=4 * w),
                ),
                plgpu.Barrier(num_arrivals=w, num_barriers=stages),
                *seg_scratch(stages, dq_block),
            ),
            grid=(n, t // (w * r), b),
            grid_names=("heads", "q_tile", "batch"),
            num_threads=w + 1,
            thread_name="wg",
            compiler_params=params,
            interpret=interp,
            kernel_name="flash_attention_mgpu_bwd_dq",
        )(q, k, v, do, lse, delta, *dq_segs)

    mine = 1 if split else w  # own K, V (and key ids) rows: split, the program's, shared
    # fused: a [64, H] fp32 dQ staging tile per warpgroup, the shared memory of two [64, H] bf16 ones
    resident = 2 * mine + (2 * w if fused else 0)
    stages = min(_bwd_stages(h, r, 2, resident, has_segments=has_segments), (n // kh) * (t // r))
    dk, dv = plgpu.kernel(
        functools.partial(
            _dkdv_kernel,
            cfg=cfg,
            group=n // kh,
            t=t,
            stages=stages,
            has_segments=has_segments,
            split=split,
            fused_dq=fused,
        ),
        out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        scratch_types=(
            # P^T [64 keys, 64 queries] per warpgroup for the second wgmma; split, the exchanged
            # P^T and dS^T side by side; fused, the dQ staging tiles
            (
                tile(mine, r, h),
                tile(mine, r, h),
                tile(r, 2 * r) if split else tile(w, r, r),
                *([plgpu.SMEM((w, r, h), jnp.float32)] if fused else []),
            ),
            (tile(stages, r, h), tile(stages, r, h), rows(stages, r), rows(stages, r)),
            (*(plgpu.Barrier(num_barriers=stages) for _ in range(4)), plgpu.Barrier(num_barriers=2 * mine)),
            plgpu.Barrier(num_arrivals=w, num_barriers=stages),
            *([plgpu.Barrier(num_arrivals=w)] if split else []),
            *seg_scratch(stages, r, mine),
        ),
        grid=(kh, s // dkdv_keys, b),
        grid_names=("kv_heads", "kv_tile", "batch"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=params,
        interpret=interp,
        kernel_name="flash_attention_mgpu_bwd_fused" if fused else "flash_attention_mgpu_bwd_dkdv",
    )(q, k, v, do, lse, delta, *dkdv_segs, *([dq_acc] if fused else []))
    if fused:
        dq = (jnp.sum(dq_acc[...], axis=0) * cfg.scale).astype(q.dtype)
    return dq, dk, dv


def _check_inputs(b, t, n, k, h, dtype, seed: int, segments: bool):
    """Random q, k, v, do of a check and, with `segments`, ids of 300-token documents shifted by 97
    a row (boundaries inside blocks), else None."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
    v = jax.random.normal(keys[2], (b, t, k, h), dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), dtype)
    seg = ((jnp.arange(t)[None] + 97 * jnp.arange(b)[:, None]) // 300).astype(jnp.int32) if segments else None
    return q, kk, v, do, seg


def check_on_gpu(
    b=2, t=1024, n=4, k=2, h=128, causal=True, dtype=jnp.bfloat16, seed=0, interpret=False, segments=False
) -> dict:
    """Run the kernels on this process's GPU (or, interpret=True, in the GPU interpreter) and compare
    with the fp32 reference: max abs errors of o, lse and (where the Mosaic backward applies) dq,
    dk, dv for the cotangent do, with the reference's max abs values to read them against. Within
    2^-7 (o) and 2^-6 (gradients) of those maxima is what the interpret-mode tests require.
    segments=True: packed rows, documents of 300 tokens shifted by 97 a row (boundaries inside
    blocks), as q and kv segment ids."""
    from .reference import attention as reference_attention

    q, kk, v, do, seg = _check_inputs(b, t, n, k, h, dtype, seed, segments)
    cfg = make_config(h, t, dtype, scale=h**-0.5, causal=causal, has_segments=segments)
    cfg = dataclasses.replace(cfg, interpret=interpret)
    o, lse = jax.jit(lambda q_, k_, v_: forward(q_, k_, v_, seg, seg, cfg))(q, kk, v)
    f32 = lambda x: x.astype(jnp.float32)
    amax = lambda x: float(jnp.max(jnp.abs(x)))
    ref = lambda *a: reference_attention(*a, causal=causal, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
    (want_o, want_lse), ref_vjp = jax.vjp(ref, f32(q), f32(kk), f32(v))
    out = dict(o_err=amax(f32(o) - want_o), o_max=amax(want_o), lse_err=amax(lse - want_lse))
    if cfg.mosaic_backward:
        bwd = lambda q_, k_, v_, o_, lse_, do_: backward(q_, k_, v_, seg, seg, o_, lse_, do_, None, cfg)
        grads = jax.jit(bwd)(q, kk, v, o, lse, do)
        wants = ref_vjp((f32(do), jnp.zeros_like(want_lse)))
        for name, g, w in zip(("dq", "dk", "dv"), grads, wants):
            out |= {f"{name}_err": amax(f32(g) - w), f"{name}_max": amax(w)}
    return out


def check_races(
    b=1, t=512, n=2, k=1, h=64, causal=True, backward_variant_name="fused", segments=False, module=None
) -> dict:
    """Run the forward and the Mosaic backward (`backward_variant_name`) in Pallas' GPU interpreter
    with its race detector, wgmma operand reads included (kernels/mgpu_races.py), on random bf16
    inputs: {"kernels": how many kernels ran, "races": indices of those with a race, "finite":
    whether o and the gradients are finite}. Pick T so that the rings wrap (more kv blocks than
    slots) to check their refills. segments=True: documents of 300 tokens (as `check_on_gpu`).
    `module`: another build of this module to check (the tests' mutants), else this one."""
    from .. import mgpu_races

    mod = module or sys.modules[__name__]
    q, kk, v, do, seg = _check_inputs(b, t, n, k, h, jnp.bfloat16, 0, segments)
    cfg = mod.make_config(h, t, jnp.bfloat16, scale=h**-0.5, causal=causal, has_segments=segments)
    if not cfg.mosaic_backward:
        raise ValueError(f"the Mosaic backward does not run H = {h}, T = {t}")
    fused = {"fused": True, "split": False}[backward_variant_name]
    cfg = dataclasses.replace(cfg, interpret=True, detect_races=True, fused_dq=fused)
    with mgpu_races.detecting_races() as report:  # traced inside: the wgmma reads are counted
        o, lse = mod.forward(q, kk, v, seg, seg, cfg)
        grads = mod.backward(q, kk, v, seg, seg, o, lse, do, None, cfg)
        jax.block_until_ready(grads)
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (o, *grads))
    return {"kernels": report.kernels, "races": report.found, "finite": finite}
