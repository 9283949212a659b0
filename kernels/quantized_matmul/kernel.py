"""Pallas kernels for quantized matmuls (W8A16, W4A16, W8A8), each lowered to Triton on GPU, to
Mosaic on TPU, or interpreted on CPU.

y[M, N] = x[M, K] @ W, with W given as int8 codes and per-channel scales (W8A16, W8A8) or as 4-bit
codes packed two per byte in the kernel layout (`reference.repack_w4`), per-group scales and optional
zero points (W4A16). reference.py defines the semantics and both nibble layouts.

Design (one program per (block_m, block_n) output tile, every grid axis parallel):
* the K loop runs inside the kernel, carrying the fp32 (int32) accumulator, as kernels/linear_attention
  does (Triton has no scratch memory and does not order grid programs);
* only codes cross memory: each K step loads one block of codes ([block_k, block_n] int8 or
  [group_size / 2, block_n] packed bytes) and turns it into dot operands in the tile;
* W4A16 steps one quantization group at a time. In the kernel layout a group's G / 2 byte rows hold
  its first G / 2 k in the low nibbles and its last G / 2 in the high nibbles, so the group's
  partial sum is x[:, gG : gG + G/2] @ lo + x[:, gG + G/2 : (g+1)G] @ hi: two contiguous slices of
  the activation tile, no even/odd split of x in HBM. The codes minus the zero point (|c| <= 15)
  are exact in bf16, and the group's scale multiplies the [block_m, block_n] partial sum, so no
  dequantized fp weight is formed at all;
* W8A16 applies the per-channel scale once, after the loop; W8A8 meets int8 x-blocks with int8
  weight blocks in an int32 accumulator and applies the per-token and per-channel scales once after
  the loop (the sum is exact, so the kernel equals the reference bit for bit).
Matmul operands: bf16 activations meet bf16 codes (exact) with fp32 accumulation; fp32 activations
use fp32 matmuls at Precision.HIGHEST. Scales may be fp32, bf16 or fp16: the generic variant reads
them as given (16-bit scales halve their bytes) and casts them to fp32 in the tile; the tpu variant
gets fp32 (what Mosaic was checked with).

Split-K (generic variant; docs/kernels_quantized_matmul.md): at decode sizes the grid above is
only N / block_n programs (32 for N = 4096) on a GPU of 132 SMs, each walking all of K alone.
`split_k` > 1 adds a third grid axis s: program (i, j, s) walks K steps [s * P, min((s + 1) * P,
steps)) with P = ceil(steps / split_k) (a K step is block_k, or one quantization group for W4A16,
so splits hold whole groups), and writes its fp32 (W8A8: int32) partial tile to [split_k, M, N].
The sum over splits, the scales that cannot be applied per split (W8A16's per-channel scale, W8A8's
per-token and per-channel ones; W4A16 scales each group inside the loop), the padding slice and the
cast are one XLA reduction fusion after the kernel: Pallas-Triton neither orders programs nor has
a grid barrier, atomics would make the float sum's order (and so its rounding) vary from run to
run, and a second Pallas kernel would cost the same launch as XLA's fusion. int32 partials add
exactly, so W8A8 stays bitwise. `split_k=None` (the default) asks `choose_split_k`: on a GPU of
`device_cores()` SMs and M <= 64, enough splits for two programs per SM while each split keeps at
least 512 of K and the partials (written and read back, M padded to 16 rows) cost at most the
weights' bytes; 1 elsewhere (CPU, TPU, M > 64). `split_k=1` is the unsplit kernel.

Two variants, chosen by the platform the program is lowered for (kernels/platforms.py), differ
only in tiling and in W4A16's group loop:
* generic (Triton on GPU; interpret mode on CPU): tiles are powers of two >= 16 (Triton's block
  shapes must be powers of two; 16 rows fill one mma tile; block_n may be 8 for N narrower than
  the requested tile); the W4A16 group loop is a `fori_loop` with dynamic offsets. Unrolled,
  Triton's compile time grows with K / G: 8.8 s at K = 4096, G = 128 but 417 s at K = 8192, G = 32
  (deviceless H100 compile, this machine).
* tpu (Mosaic): lane tiles (block_n, block_k) are multiples of 128 or the whole dimension, row
  tiles a multiple of the dtype's sublane tile (8 / 16 / 32 rows for 4 / 2 / 1-byte types); the
  W4A16 group loop is unrolled in Python: with a `fori_loop` Mosaic cannot prove the per-group lane
  slices of x aligned, nor the scale row ("CompileTimeMosaicUnprovenMemoryAccessAlignment"); with
  static offsets it can. The unrolled body grows with K / G (256 groups at K = 8192, G = 32).

Shapes: any M (padded to block_m). Any N: block_n becomes the largest allowed tile <= the requested
one that divides N; if none does, the weight, scale (and zero point) columns are padded to a
multiple of block_n inside the wrapper and the output sliced. That padding copies the weights on
every call: real layer shapes should use a block_n that divides N. K of W8A16 / W8A8 likewise
(padding puts zeros in both x and w, which add nothing); K of W4A16 is stepped in whole groups and
must be a multiple of the group size.

TPU: all three kernels compile with Mosaic ahead of time (v5p and v6e slices at K = N = 1024; W4A16
also checked by hand on v5p at K = 4096 with groups 32/64/128). GPU: all three, split-K included,
lower to Triton and compile to SASS deviceless for an H100 (docs/kernels_quantized_matmul.md); the
unsplit kernels ran on an H200 (correct, slower than bf16); split-K has not run on a GPU. The
W8A8 dot compiles to int8 tensor-core MMAs (SASS IMMA.16832.S8.S8, via the standalone Triton on
the same Triton IR; tests/test_quantized_splitk.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsys.kernels import platforms, tuning
from jaxsys.kernels.quantized_matmul import reference as ref

__all__ = [
    "matmul_w8a16",
    "matmul_w4a16",
    "matmul_w8a8",
    "matmul_w4ax",
    "Tiles",
    "tiles",
    "choose_split_k",
    "split_k_for",
    "device_cores",
]

LANES = 128  # Mosaic's lane width: the minor dimension of a TPU tile
TRITON_MIN = 16  # Triton block shapes are powers of two; 16 rows is one tensor-core (mma) tile


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The tiling one variant ("generic" or "tpu") uses for one call (hashable: a static kernel
    argument). block_k: the K step of W8A16 / W8A8 (W4A16 steps one group). k_padded / n_padded:
    the padded K and N (== K, N unless no allowed tile divides them)."""

    variant: str
    block_m: int
    block_n: int
    block_k: int
    n_padded: int
    k_padded: int
    interpret: bool = True
    num_warps: int | None = None  # Triton launch parameters; None: Triton's defaults (4 warps, 3 stages)
    num_stages: int | None = None
    split_k: int = 1  # K splits (a third grid axis); 1: one program walks the whole K (the tpu variant always)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _triton_tile(requested: int, dim: int, floor: int = TRITON_MIN) -> tuple[int, int]:
    """(tile, padded dim): the largest power of two in [floor, requested] (shrunk to the
    dimension's next power of two) that divides dim; if none does, the largest such tile with dim
    padded."""
    cap = min(max(TRITON_MIN, _pow2_floor(requested)), max(TRITON_MIN, pl.next_power_of_2(dim)))
    t = cap
    while t >= floor:
        if dim % t == 0:
            return t, dim
        t //= 2
    return cap, _round_up(dim, cap)


MOSAIC_WHOLE = 512  # a lane dimension up to this long may be one whole-dimension tile


def _mosaic_lane_tile(requested: int, dim: int) -> tuple[int, int]:
    """(tile, padded dim) along a lane dimension: the whole dimension if it fits the request, else
    the largest power-of-two multiple of 128 <= requested that divides dim, else the whole
    dimension up to 512 (a block equal to the array's dimension is always legal), else padded."""
    if dim <= max(requested, LANES):
        return dim, dim
    cap = max(LANES, _pow2_floor(requested))
    t = cap
    while t >= LANES:
        if dim % t == 0:
            return t, dim
        t //= 2
    return (dim, dim) if dim <= MOSAIC_WHOLE else (cap, _round_up(dim, cap))


def _sublanes(*dtypes) -> int:
    """Rows of one Mosaic tile for the narrowest of these dtypes (8 for 4-byte, 16 for 2, 32 for 1)."""
    return max(8 * 4 // jnp.dtype(d).itemsize for d in dtypes)


def tiles(
    m: int,
    k: int,
    n: int,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    dtypes=(),
    variant: str = "generic",
    interpret: bool = True,
    num_warps=None,
    num_stages=None,
) -> Tiles:
    """The tiles a kernel uses for x[M, K] @ W[K, N] under `variant` ("generic": Triton's rules,
    also used in interpret mode; "tpu": Mosaic's). block_k = 0: K is not tiled here (W4A16). Row
    tiles shrink to M rounded up (a decode step of M = 1 gets 16 rows, not the requested 64)."""
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "block_k" else 1):
            raise ValueError(f"{name} must be a positive integer; got {name}={v!r}")
    if variant == "generic":
        bm = min(max(TRITON_MIN, _pow2_floor(block_m)), max(TRITON_MIN, pl.next_power_of_2(m)))
        # N narrower than one tile may take 8 columns (Triton compiles an 8-wide dot for sm_90)
        bn, np_ = _triton_tile(block_n, n, 8 if n < block_n else TRITON_MIN)
        bk, kp = _triton_tile(block_k, k) if block_k else (k, k)
    elif variant == "tpu":
        sub = _sublanes(*dtypes) if dtypes else 8
        bm = min(_round_up(block_m, sub), _round_up(m, sub))
        bn, np_ = _mosaic_lane_tile(block_n, n)
        bk, kp = _mosaic_lane_tile(block_k, k) if block_k else (k, k)
    else:
        raise ValueError(f"variant must be 'generic' or 'tpu'; got {variant!r}")
    return Tiles(variant, bm, bn, bk, np_, kp, interpret=interpret, num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- split-K

SPLIT_K_MAX_M = 64  # above this the (M / block_m) x (N / block_n) grid alone fills the GPU
SPLIT_K_MIN_K = 512  # each split walks at least this much K: its x / weight loads still pipeline
PROGRAMS_PER_CORE = 2  # the grid the chooser aims for: two programs per SM hide each other's latency
MAX_PARTIAL_RATIO = 1.0  # fp32 partials may add at most the weights' own bytes of traffic (a guess)


def choose_split_k(
    m: int,
    k: int,
    n: int,
    *,
    block_m: int,
    block_n: int,
    k_step: int,
    cores: int | None,
    weight_bits: int = 8,
    max_m: int = SPLIT_K_MAX_M,
    min_k: int = SPLIT_K_MIN_K,
    programs_per_core: int = PROGRAMS_PER_CORE,
    max_partial_ratio: float = MAX_PARTIAL_RATIO,
) -> int:
    """How many K splits a small-M call gets: enough that the grid (M / block_m) x (N / block_n) x
    splits reaches `programs_per_core` programs per SM, but no more than leaves each split
    `min_k` of K (K advances `k_step` per loop step: block_k, or one quantization group), and no
    more than keeps the fp32 partials' traffic (written, then read by the reduction: 8 bytes per
    split per padded row per column) within `max_partial_ratio` x the weight bytes (`weight_bits`
    per weight). 1 (no split) when M > max_m, when the SM count is unknown (`cores` None: CPU,
    TPU) or when the grid is already large enough. Pure: the arguments alone decide."""
    if m > max_m or not cores or cores < 1:
        return 1
    rows = -(-m // block_m) * block_m
    programs = (rows // block_m) * -(-n // block_n)
    steps = -(-k // k_step)
    wanted = -(-programs_per_core * cores // programs)
    most = max(1, steps // max(1, -(-min_k // k_step)))
    traffic = max(1, int(max_partial_ratio * k * weight_bits / 8 / (8 * rows)))
    return _even_splits(min(wanted, most, traffic), steps)


def _even_splits(split_k: int, steps: int) -> int:
    """split_k capped at the number of K steps and lowered until no split is empty: each split
    walks ceil(steps / split_k) steps, the last one the rest (10 steps in 6 splits would be 2 + 2 +
    2 + 2 + 2 + 0: 5 splits)."""
    split_k = max(1, min(split_k, steps))
    per = -(-steps // split_k)
    return -(-steps // per)


def device_cores() -> int | None:
    """The SM count of the GPU being compiled for: the abstract mesh's device inside shard_map
    (deviceless compiles: `analysis.targets.devices` report 132 for an H100), else the first local
    device's `core_count` if it is a GPU; None elsewhere (CPU, TPU): no split-K."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.num_cores if abstract.platform in ("gpu", "cuda", "rocm") else None
    device = jax.devices()[0]
    return getattr(device, "core_count", None) if device.platform == "gpu" else None


def _check_split_k(split_k) -> None:
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None (chosen from the SM count) or a positive integer; got {split_k!r}")


def split_k_for(
    m: int,
    k: int,
    n: int,
    *,
    block_m: int = 16,
    block_n: int = 128,
    block_k: int = 128,
    group_size: int = 0,
    split_k: int | None = None,
    cores: int | None = None,
) -> int:
    """The number of K splits the generic variant runs for x[M, K] @ W[K, N] with these arguments
    (what the kernels resolve; bench.py reports it): `split_k` if given, else `choose_split_k` on
    the tiles `tiles()` picks, for `cores` SMs; either made even (`_even_splits`). K steps are
    block_k, or one group of `group_size` (W4A16)."""
    _check_split_k(split_k)
    t = tiles(m, k, n, block_m=block_m, block_n=block_n, block_k=0 if group_size else block_k)
    k_step = group_size or t.block_k
    if split_k is None:
        split_k = choose_split_k(
            m,
            t.k_padded,
            t.n_padded,
            block_m=t.block_m,
            block_n=t.block_n,
            k_step=k_step,
            cores=cores,
            weight_bits=4 if group_size else 8,
        )
    return _even_splits(split_k, t.k_padded // k_step)


# Tiles when neither the caller nor the tuning cache gives one: 16 rows fill one mma tile (32 for
# W8A8, whose int8 mma is 32 deep), 128-wide N and K blocks.
DEFAULT_BLOCKS = {"w8a16": (16, 128, 128), "w4a16": (16, 128, 128), "w8a8": (32, 128, 128), "w4ax": (32, 128, 128)}


def _plan(
    kind,
    m,
    k,
    n,
    *,
    block_m,
    block_n,
    block_k,
    dtypes,
    interpret,
    backend,
    num_warps,
    num_stages,
    split_k,
    group_size=0,
):
    """The platform plan; tiles and Triton launch parameters left None come from the tuning cache for
    (kind, M bucket, K, N, group) on this device (kernels/tuning.py), else DEFAULT_BLOCKS / Triton's
    defaults; the generic variant's split_k resolved by `split_k_for` for the SMs of the GPU being
    compiled for (`device_cores`); the tpu variant never splits."""
    platforms.check_backend(backend)
    tuned = tuning.quantized_matmul_config(kind=kind, m=m, k=k, n=n, group_size=group_size or None)
    pick = lambda given, name, default: tuned.get(name, default) if given is None else given
    bm, bn, bk = DEFAULT_BLOCKS[kind]
    block_m, block_n = pick(block_m, "block_m", bm), pick(block_n, "block_n", bn)
    block_k = 0 if kind in ("w4a16", "w4ax") else pick(block_k, "block_k", bk)  # 4-bit kernels step whole groups
    num_warps, num_stages = pick(num_warps, "num_warps", None), pick(num_stages, "num_stages", None)
    make = lambda variant: tiles(
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        dtypes=dtypes,
        variant=variant,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    splits = split_k_for(
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        group_size=group_size,
        split_k=split_k,
        cores=device_cores() if split_k is None else None,
    )
    generic = dataclasses.replace(make("generic"), split_k=splits)
    return platforms.plan(backend, interpret, generic, make("tpu"))


def _compiler_params(cfg: Tiles):
    """Triton launch parameters when the generic variant is compiled and any were asked for."""
    if cfg.interpret or cfg.variant != "generic" or (cfg.num_warps is None and cfg.num_stages is None):
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _dot(a, b, dtype):
    if dtype == jnp.float32:
        return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    # explicit DEFAULT: bf16 operands are exact here, and Mosaic refuses a bf16 matmul asked for fp32
    # contract precision (what jax_default_matmul_precision="highest" would request)
    return jnp.dot(a, b, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


def _pad(a, axis: int, size: int):
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def _run(plan, fn, m: int, n: int, *args):
    """fn(*args, cfg=cfg)[:m, :n] of the variant the plan picks for the platform lowered for (each
    variant pads differently, so each slices its own output: lax.platform_dependent's branches
    must agree in shape)."""
    unpadded = lambda *a, cfg: fn(*a, cfg=cfg)[:m, :n]
    return platforms.dispatch(plan, {"generic": (unpadded,), "tpu": (unpadded,)}, 0, *args)


def _k_range(n_steps: int, split_k: int):
    """(first K step, step count) of this program: all of K, or split pl.program_id(2)'s share
    (ceil(n_steps / split_k) steps, the last split the rest). The count stays a Python int when
    the splits are even, so the loop keeps a static trip count."""
    if split_k == 1:
        return 0, n_steps
    per = -(-n_steps // split_k)
    first = pl.program_id(2) * per
    if per * split_k == n_steps:
        return first, per
    return first, jnp.minimum(per, n_steps - first)


def _grid_specs(cfg: Tiles, mp: int, out_dtype, partial_dtype):
    """(grid, out_specs, out_shape): (i, j) tiles of [Mp, Np] in out_dtype, or with split-K a
    third axis s over K and one partial tile per split, [split_k, Mp, Np] in partial_dtype."""
    bm, bn, np_ = cfg.block_m, cfg.block_n, cfg.n_padded
    if cfg.split_k == 1:
        return (
            (mp // bm, np_ // bn),
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            jax.ShapeDtypeStruct((mp, np_), out_dtype),
        )
    return (
        (mp // bm, np_ // bn, cfg.split_k),
        pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        jax.ShapeDtypeStruct((cfg.split_k, mp, np_), partial_dtype),
    )


SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_scales(name: str, s) -> None:
    if s.dtype not in SCALE_DTYPES:
        raise ValueError(f"{name} takes fp32, bf16 or fp16 scales; got {s.dtype}")


def _scales(s, cfg: Tiles):
    """Scales as the kernel takes them: fp32 / bf16 / fp16 as given for the generic variant (cast
    to fp32 in the tile: half the bytes for 16-bit scales); fp32 for Mosaic (checked only so)."""
    return s.astype(jnp.float32) if cfg.variant == "tpu" else s


# ----------------------------------------------------------------------------- W8A16


def _w8_kernel(x_ref, q_ref, *refs, block_k: int, n_k: int, split_k: int):
    *s_ref, o_ref = refs  # no scale with split-K: it is applied once, after the sum over splits
    dtype = x_ref.dtype
    first, count = _k_range(n_k, split_k)

    def body(i, acc):
        cols = pl.ds(pl.multiple_of((first + i) * block_k, block_k), block_k)
        qs = q_ref[cols, :].astype(dtype)  # int8 codes are exact in bf16
        return acc + _dot(x_ref[:, cols], qs, dtype)

    acc = lax.fori_loop(0, count, body, jnp.zeros(o_ref.shape, jnp.float32))
    if split_k > 1:
        o_ref[...] = acc
    else:
        o_ref[...] = (acc * s_ref[0][...].astype(jnp.float32)[None, :]).astype(o_ref.dtype)


def _w8a16(x, q, s, *, cfg: Tiles):
    m, n = x.shape[0], q.shape[1]
    mp = _round_up(m, cfg.block_m)
    x = _pad(_pad(x, 0, mp), 1, cfg.k_padded)
    q = _pad(_pad(q, 0, cfg.k_padded), 1, cfg.n_padded)
    kp, bm, bn = cfg.k_padded, cfg.block_m, cfg.block_n
    in_specs = [pl.BlockSpec((bm, kp), lambda i, j, *_: (i, 0)), pl.BlockSpec((kp, bn), lambda i, j, *_: (0, j))]
    args = [x, q]
    if cfg.split_k == 1:
        in_specs.append(pl.BlockSpec((bn,), lambda i, j: (j,)))
        args.append(_pad(_scales(s, cfg), 0, cfg.n_padded))
    grid, out_specs, out_shape = _grid_specs(cfg, mp, x.dtype, jnp.float32)
    out = pl.pallas_call(
        functools.partial(_w8_kernel, block_k=cfg.block_k, n_k=kp // cfg.block_k, split_k=cfg.split_k),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
    )(*args)
    if cfg.split_k == 1:
        return out
    # The sum over splits, the per-channel scale and the cast: one XLA reduction fusion
    return (jnp.sum(out[:, :m, :n], axis=0) * s.astype(jnp.float32)[None, :]).astype(x.dtype)


def matmul_w8a16(
    x,
    q,
    s,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
):
    """x[M, K] @ (int8 q[K, N] * s[N]) as `reference.matmul_w8a16`, tiled (block_m, block_n) with a
    K loop of block_k inside the kernel; blocks are adjusted to the shape and the variant (module
    docstring). s: fp32, bf16 or fp16. split_k (generic variant only): the number of K splits,
    None chooses it from the GPU's SM count (`choose_split_k`: 1 on CPU / TPU and for M > 64), 1 is
    the unsplit kernel. interpret / backend as in kernels/platforms.py: None interprets when
    lowered for CPU and compiles elsewhere (Mosaic on TPU, Triton otherwise)."""
    if x.ndim != 2 or q.ndim != 2 or q.dtype != jnp.int8 or x.shape[1] != q.shape[0] or s.shape != (q.shape[1],):
        raise ValueError(
            f"matmul_w8a16 takes x[M, K], int8 q[K, N], s[N]; got x{x.shape}, q{q.shape} {q.dtype}, s{s.shape}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"matmul_w8a16 takes floating-point activations; got {x.dtype}")
    _check_scales("matmul_w8a16", s)
    (m, k), n = x.shape, q.shape[1]
    plan = _plan(
        "w8a16",
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        dtypes=(x.dtype,),
        interpret=interpret,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=split_k,
    )
    return _run(plan, _w8a16, m, n, x, q, s)


# ----------------------------------------------------------------------------- W4A16


def _nibble_codes(nibble, z, signed: bool, dtype):
    """int32 nibbles [rows, bn] -> codes in `dtype`: sign-extended ((c ^ 8) - 8, two bit ops) for
    symmetric codes, minus the group's zero points z [bn] (int32) when given; |c| <= 15, exact
    in bf16 and in int8."""
    c = (nibble ^ 8) - 8 if signed else nibble
    if z is not None:
        c = c - z[None, :]
    return c.astype(dtype)


def _over_groups(group, acc, *, group_size: int, n_groups: int, unroll: bool, split_k: int):
    """acc after `group(g, packed rows, low-nibble x columns, high-nibble x columns, the group's
    one-wide column, acc)` for every quantization group g of this program: unrolled with static
    offsets for Mosaic (whose alignment it can see), else one `fori_loop` body over this split's
    whole groups (Triton: compile time independent of K / G)."""
    half = group_size // 2  # packed rows per group; also the k of each nibble's half-group
    if unroll:
        for g in range(n_groups):
            k0 = g * group_size
            acc = group(
                g,
                slice(g * half, (g + 1) * half),
                slice(k0, k0 + half),
                slice(k0 + half, k0 + group_size),
                slice(g, g + 1),
                acc,
            )
        return acc
    first, count = _k_range(n_groups, split_k)

    def body(i, acc):
        g = first + i
        k0 = pl.multiple_of(g * group_size, group_size)
        return group(
            g,
            pl.ds(pl.multiple_of(g * half, half), half),
            pl.ds(k0, half),
            pl.ds(pl.multiple_of(k0 + half, half), half),
            pl.ds(g, 1),
            acc,
        )

    return lax.fori_loop(0, count, body, acc)


def _w4_call(kernel_fn, lead, lead_specs, packed, s, z, *, cfg: Tiles, m: int, out_dtype):
    """pallas_call of a 4-bit kernel: the activation operands `lead` (already padded to the row
    tile) with their specs, then the packed codes, scales and zero points tiled over N; split-K's
    fp32 partials summed after (one XLA reduction fusion)."""
    k, groups = 2 * packed.shape[0], s.shape[0]
    np_, bn = cfg.n_padded, cfg.block_n
    args = [*lead, _pad(packed, 1, np_), _pad(_scales(s, cfg), 1, np_)]
    in_specs = [
        *lead_specs,
        pl.BlockSpec((k // 2, bn), lambda i, j, *_: (0, j)),
        pl.BlockSpec((groups, bn), lambda i, j, *_: (0, j)),
    ]
    if z is not None:
        in_specs.append(pl.BlockSpec((groups, bn), lambda i, j, *_: (0, j)))
        args.append(_pad(z.astype(jnp.int8), 1, np_))
    grid, out_specs, out_shape = _grid_specs(cfg, lead[0].shape[0], out_dtype, jnp.float32)
    out = pl.pallas_call(
        functools.partial(
            kernel_fn,
            group_size=k // groups,
            n_groups=groups,
            signed=z is None,
            has_zero=z is not None,
            unroll=cfg.variant == "tpu",
            split_k=cfg.split_k,
        ),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
    )(*args)
    if cfg.split_k == 1:
        return out
    return jnp.sum(out[:, :m, : packed.shape[1]], axis=0).astype(out_dtype)


def _w4_kernel(*refs, group_size: int, n_groups: int, signed: bool, has_zero: bool, unroll: bool, split_k: int):
    x_ref, p_ref, s_ref, *rest = refs
    z_ref, o_ref = rest if has_zero else (None, rest[0])
    dtype = x_ref.dtype

    def group(g, rows, lo_cols, hi_cols, _, acc):
        packed = p_ref[rows, :].astype(jnp.int32)  # uint8 -> int32: zero-extended
        z = z_ref[g, :].astype(jnp.int32) if has_zero else None
        lo, hi = _nibble_codes(packed & 15, z, signed, dtype), _nibble_codes(packed >> 4, z, signed, dtype)
        part = _dot(x_ref[:, lo_cols], lo, dtype) + _dot(x_ref[:, hi_cols], hi, dtype)
        return acc + part * s_ref[g, :].astype(jnp.float32)[None, :]  # each group's own scale, in fp32

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    acc = _over_groups(group, acc, group_size=group_size, n_groups=n_groups, unroll=unroll, split_k=split_k)
    o_ref[...] = acc.astype(o_ref.dtype)  # with split-K: the fp32 partial, already scaled


def _w4a16(x, packed, s, z, *, cfg: Tiles):
    m, k = x.shape
    x = _pad(x, 0, _round_up(m, cfg.block_m))
    spec = pl.BlockSpec((cfg.block_m, k), lambda i, j, *_: (i, 0))
    return _w4_call(_w4_kernel, [x], [spec], packed, s, z, cfg=cfg, m=m, out_dtype=x.dtype)


def _check_w4_weights(name: str, act_name: str, act, packed, s, z) -> tuple[int, int, int]:
    """(K, N, G) of a 4-bit kernel's operands: the activations' K against the packed codes', the
    scales (and integer zero points) [K / G, N], G one of reference.GROUP_SIZES; else a ValueError
    naming `name`."""
    _check_scales(name, s)
    k, n = 2 * packed.shape[0], packed.shape[1]
    if act.shape[1] != k:
        raise ValueError(f"{name}: {act_name} has K={act.shape[1]}, the packed weights K={k}")
    if s.ndim != 2 or s.shape[1] != n or s.shape[0] == 0 or k % s.shape[0] or (z is not None and z.shape != s.shape):
        raise ValueError(
            f"{name}: scales {s.shape} (zero points {None if z is None else z.shape}) "
            f"do not match weights [K={k}, N={n}] in groups along K"
        )
    if z is not None and not jnp.issubdtype(z.dtype, jnp.integer):  # the kernels cast them to int8
        raise ValueError(f"{name} takes integer zero points; got {z.dtype}")
    group_size = k // s.shape[0]
    if group_size not in ref.GROUP_SIZES:
        raise ValueError(f"{name}: group size K / groups = {group_size}; choose one of {ref.GROUP_SIZES}")
    return k, n, group_size


def matmul_w4a16(
    x,
    packed,
    s,
    z=None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
):
    """x[M, K] @ W as `reference.matmul_w4a16(x, reference.unrepack_w4(packed, G), s, z)`.

    `packed` [K / 2, N] uint8 MUST BE IN THE KERNEL LAYOUT, `reference.repack_w4(pack_int4(q), G)`,
    not the canonical `pack_int4` layout: byte row g*G/2 + r holds k = g*G + r (low nibble) and
    k = g*G + G/2 + r (high nibble). Both layouts have the same shape and dtype, so a canonical
    array passed here is not detected: it silently gives wrong results. The group size G is
    K / s.shape[0]. s [K / G, N] fp32, bf16 or fp16 scales (applied in fp32); z [K / G, N] integer
    zero points, or None for symmetric codes. One group per K step inside the kernel; split-K
    splits K in whole groups; blocks and split_k as in `matmul_w8a16`."""
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(
            f"matmul_w4a16 takes x[M, K] and uint8 packed[K / 2, N]; got x{x.shape}, "
            f"packed{packed.shape} {packed.dtype}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"matmul_w4a16 takes floating-point activations; got {x.dtype}")
    k, n, group_size = _check_w4_weights("matmul_w4a16", "x", x, packed, s, z)
    m = x.shape[0]
    plan = _plan(
        "w4a16",
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=0,
        dtypes=(x.dtype,),
        interpret=interpret,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=split_k,
        group_size=group_size,
    )
    return _run(plan, _w4a16, m, n, x, packed, s, z)


# ----------------------------------------------------------------------------- W8A8


def _w8a8_kernel(x_ref, q_ref, *refs, block_k: int, n_k: int, split_k: int):
    *scale_refs, o_ref = refs  # no scales with split-K: applied to the exact int32 sum after it
    first, count = _k_range(n_k, split_k)

    def body(i, acc):
        cols = pl.ds(pl.multiple_of((first + i) * block_k, block_k), block_k)
        # int8 x int8 -> int32: Triton's integer tensor-core mma (docs/kernels_quantized_matmul.md)
        return acc + jnp.dot(
            x_ref[:, cols], q_ref[cols, :], precision=lax.Precision.DEFAULT, preferred_element_type=jnp.int32
        )

    acc = lax.fori_loop(0, count, body, jnp.zeros(o_ref.shape, jnp.int32))
    if split_k > 1:
        o_ref[...] = acc
    else:
        sx_ref, sw_ref = scale_refs
        o_ref[...] = (acc.astype(jnp.float32) * sx_ref[...][:, None] * sw_ref[...][None, :]).astype(o_ref.dtype)


def _w8a8(xq, sx, wq, sw, *, cfg: Tiles, out_dtype):
    m, n = xq.shape[0], wq.shape[1]
    mp, kp, np_, bm, bn = _round_up(m, cfg.block_m), cfg.k_padded, cfg.n_padded, cfg.block_m, cfg.block_n
    in_specs = [pl.BlockSpec((bm, kp), lambda i, j, *_: (i, 0)), pl.BlockSpec((kp, bn), lambda i, j, *_: (0, j))]
    args = [_pad(_pad(xq, 0, mp), 1, kp), _pad(_pad(wq, 0, kp), 1, np_)]
    if cfg.split_k == 1:
        in_specs += [pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec((bn,), lambda i, j: (j,))]
        args += [_pad(sx.astype(jnp.float32), 0, mp), _pad(sw.astype(jnp.float32), 0, np_)]
    grid, out_specs, out_shape = _grid_specs(cfg, mp, out_dtype, jnp.int32)
    out = pl.pallas_call(
        functools.partial(_w8a8_kernel, block_k=cfg.block_k, n_k=kp // cfg.block_k, split_k=cfg.split_k),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
    )(*args)
    if cfg.split_k == 1:
        return out
    # int32 partial sums add exactly, so the scaled result is the reference's bit for bit
    acc = jnp.sum(out[:, :m, :n], axis=0, dtype=jnp.int32)
    return (acc.astype(jnp.float32) * sx.astype(jnp.float32)[:, None] * sw.astype(jnp.float32)[None, :]).astype(
        out_dtype
    )


def matmul_w8a8(
    xq,
    sx,
    wq,
    sw,
    out_dtype=jnp.bfloat16,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
):
    """int8 xq[M, K] @ int8 wq[K, N] with an int32 accumulator, times sx[M] and sw[N], as
    `reference.matmul_w8a8` (bit for bit, split-K included: int32 partial sums add exactly). Blocks
    and split_k as in `matmul_w8a16` (block_m 32: int8 tiles on TPU are (32, 128))."""
    if xq.dtype != jnp.int8 or wq.dtype != jnp.int8:
        raise ValueError(f"matmul_w8a8 takes int8 operands; got {xq.dtype} and {wq.dtype}")
    if (
        xq.ndim != 2
        or wq.ndim != 2
        or xq.shape[1] != wq.shape[0]
        or sx.shape != (xq.shape[0],)
        or sw.shape != (wq.shape[1],)
    ):
        raise ValueError(
            f"matmul_w8a8 takes xq[M, K], sx[M], wq[K, N], sw[N]; got xq{xq.shape}, "
            f"sx{sx.shape}, wq{wq.shape}, sw{sw.shape}"
        )
    (m, k), n = xq.shape, wq.shape[1]
    out_dtype = jnp.dtype(out_dtype)
    plan = _plan(
        "w8a8",
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        dtypes=(jnp.int8, out_dtype),
        interpret=interpret,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=split_k,
    )
    return _run(plan, functools.partial(_w8a8, out_dtype=out_dtype), m, n, xq, sx, wq, sw)


# ----------------------------------------------------------------------------- W4Ax (W4A8, W4A4)


def _w4ax_kernel(*refs, group_size: int, n_groups: int, signed: bool, has_zero: bool, unroll: bool, split_k: int):
    x_ref, sx_ref, p_ref, s_ref, *rest = refs
    z_ref, o_ref = rest if has_zero else (None, rest[0])
    per_group = len(sx_ref.shape) == 2  # W4A4: one activation scale per (token, group)

    def int_dot(a, b):  # int8 x int8 -> int32: the integer tensor-core mma, as in W8A8
        return jnp.dot(a, b, precision=lax.Precision.DEFAULT, preferred_element_type=jnp.int32)

    def group(g, rows, lo_cols, hi_cols, g_col, acc):
        packed = p_ref[rows, :].astype(jnp.int32)
        z = z_ref[g, :].astype(jnp.int32) if has_zero else None
        lo, hi = _nibble_codes(packed & 15, z, signed, jnp.int8), _nibble_codes(packed >> 4, z, signed, jnp.int8)
        part = (int_dot(x_ref[:, lo_cols], lo) + int_dot(x_ref[:, hi_cols], hi)).astype(jnp.float32)
        part = part * s_ref[g, :].astype(jnp.float32)[None, :]
        if per_group:
            part = part * sx_ref[:, g_col].astype(jnp.float32)  # [bm, 1]: this group's activation scales
        return acc + part

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    acc = _over_groups(group, acc, group_size=group_size, n_groups=n_groups, unroll=unroll, split_k=split_k)
    if not per_group:
        acc = acc * sx_ref[...].astype(jnp.float32)[:, None]  # per token: linear, so per split too
    o_ref[...] = acc.astype(o_ref.dtype)  # with split-K: the fp32 partial, already scaled


def _w4ax(xq, sx, packed, s, z, *, cfg: Tiles, out_dtype):
    m, k = xq.shape
    mp, bm = _round_up(m, cfg.block_m), cfg.block_m
    sx = _pad(sx.astype(jnp.float32), 0, mp)
    sx_spec = (
        pl.BlockSpec((bm, s.shape[0]), lambda i, j, *_: (i, 0))
        if sx.ndim == 2
        else pl.BlockSpec((bm,), lambda i, j, *_: (i,))
    )
    lead, specs = [_pad(xq, 0, mp), sx], [pl.BlockSpec((bm, k), lambda i, j, *_: (i, 0)), sx_spec]
    return _w4_call(_w4ax_kernel, lead, specs, packed, s, z, cfg=cfg, m=m, out_dtype=out_dtype)


def matmul_w4ax(
    xq,
    sx,
    packed,
    s,
    z=None,
    out_dtype=jnp.bfloat16,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    interpret=None,
    backend=None,
    num_warps=None,
    num_stages=None,
):
    """Integer activations @ 4-bit weights, as `reference.matmul_w4ax(xq, sx, unrepack_w4(packed,
    G), s, z, out_dtype)`: xq[M, K] int8 codes (8-bit per token, or 4-bit values per token and
    group), sx[M] (W4A8) or sx[M, K / G] (W4A4) fp32 scales; `packed` [K / 2, N] IN THE KERNEL
    LAYOUT (`reference.repack_w4`, as `matmul_w4a16`), s [K / G, N] and z as there. Each group is
    two int8 x int8 -> int32 dots (the integer tensor cores; the 4-bit codes minus their zero point
    fit int8), scaled per group in fp32: the sums equal the reference's, the fp32 sum over groups
    may differ from it in the last place. Blocks and split_k as in `matmul_w4a16` (block_m 32:
    int8 rows)."""
    if xq.ndim != 2 or xq.dtype != jnp.int8 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(
            f"matmul_w4ax takes int8 xq[M, K] and uint8 packed[K / 2, N]; got xq{xq.shape} {xq.dtype}, "
            f"packed{packed.shape} {packed.dtype}"
        )
    k, n, group_size = _check_w4_weights("matmul_w4ax", "xq", xq, packed, s, z)
    m = xq.shape[0]
    if sx.shape not in ((m,), (m, s.shape[0])):
        raise ValueError(f"matmul_w4ax: sx{sx.shape} must be [M] = ({m},) or [M, K / G] = ({m}, {s.shape[0]})")
    out_dtype = jnp.dtype(out_dtype)
    plan = _plan(
        "w4ax",
        m,
        k,
        n,
        block_m=block_m,
        block_n=block_n,
        block_k=0,
        dtypes=(jnp.int8, out_dtype),
        interpret=interpret,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=split_k,
        group_size=group_size,
    )
    return _run(plan, functools.partial(_w4ax, out_dtype=out_dtype), m, n, xq, sx, packed, s, z)
