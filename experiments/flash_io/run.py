"""HBM traffic of the Pallas flash-attention kernel vs block size, beside FlashAttention's bound.

    .venv/bin/python experiments/flash_io/run.py            # sweep + checks (~1 min on 2 cores)
    .venv/bin/python experiments/flash_io/run.py --quick    # T = 1K, 32K only, fewer sanity runs
    .venv/bin/python experiments/flash_io/run.py --check    # only the checks, no sweep
    .venv/bin/python experiments/flash_io/run.py --replot   # plot + tables from results.json

Claim (Dao et al. 2022, Theorem 2): standard attention makes Θ(N d + N²) HBM accesses,
FlashAttention Θ(N² d² / M) for an on-chip memory of M elements (d <= M <= N d).

The count. `hbm_bytes(...)` returns the bytes moved between HBM and on-chip memory by one call of
`jaxsys.kernels.flash_attention` (forward, or the backward's two kernels plus XLA's Delta
preprocessing), derived from the kernel module itself:

  * the block sizes actually used come from the kernel's `_prepare` (`_block_size`);
  * each `pl.pallas_call` the kernel issues is intercepted while `_forward` / `_backward` are
    traced abstractly (jax.eval_shape; nothing runs): its grid, its BlockSpecs' block shapes, its
    operand dtypes and the kernel's static keywords (cfg, num_kv_blocks, num_q_blocks, group);
  * the in-kernel loop trip counts per program come from the kernel's own `_causal_kv_range` /
    `_causal_q_range` (called on the vector of program ids) or from num_kv_blocks / num_q_blocks.

What the run.py side supplies is `KERNEL_IO`, a transcription of each kernel body: which operands
a program loads once (`q_ref[...]`), which it loads again on every loop iteration
(`k_ref[pl.ds(start, bk), :]`: one block_k x H slice; `q_ref[rows, g, :]`: one block_q x H slice
of one head of the group; `lse_ref[g, rows]`: block_q values), and that every output block is
written once. This is Triton's semantics for Pallas (a BlockSpec only offsets a pointer; a ref
index is a load), so a whole-sequence BlockSpec such as k's (S, H) costs only the slices indexed.
If a kernel body changes what it indexes, KERNEL_IO must change with it; if the grid, the specs,
the block resolution or the causal loop bounds change, the count follows on its own.

`--check` (also part of every run) holds the count to
  (1) independent closed forms (below, `closed_form`) on a set of shapes incl. GQA, B > 1,
      rectangular tiles, a shrunk block and padding, and
  (2) an interpret-mode run of the real kernel (T = 64, H = 16, blocks 16/32, GQA 2:1, causal and
      full, forward + backward) in which `lax.fori_loop` is wrapped (through the kernel module's
      `lax` name) so that every loop iteration a program executes reports (kernel, program ids,
      group head, block index) through jax.debug.callback; the observed iterations per program,
      the programs and the bytes they imply must equal the count, and the outputs must still equal
      the reference.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from jaxsys.kernels.flash_attention import kernel as FK  # noqa: E402
from jaxsys.kernels.flash_attention import reference_attention  # noqa: E402

LSE_BYTES = 4  # lse and Delta are fp32 in the kernel
ACC_BYTES = 4  # scores, probabilities, accumulators and row statistics are fp32 on chip
DTYPES = {2: jnp.bfloat16, 4: jnp.float32}

# ----------------------------------------------------------------------------------------------
# KERNEL_IO: what each kernel body loads and stores (transcribed from kernel.py).
#   args: the pallas_call operands in order; outs: its outputs (each block written once)
#   resident: loaded whole, once per program (the BlockSpec block)
#   streamed: loaded on every iteration of the kernel's fori_loop, as a slice of `rows` rows
#             (cfg.block_k or cfg.block_q) x H for [B, T, N, H] operands, `rows` values for the
#             [B, N, T] fp32 rows (lse, delta)
#   loop: "kv" = over kv blocks, bounds _causal_kv_range (fwd, dq);
#         "q_group" = over the G heads of the group x the q blocks, bounds _causal_q_range (dk/dv)
KERNEL_IO = {
    "flash_attention_fwd": dict(
        args=("q", "k", "v"),
        outs=("o", "lse"),
        resident=("q",),
        streamed={"k": "block_k", "v": "block_k"},
        loop="kv",
        body="_fwd_kernel",
    ),
    "flash_attention_bwd_dq": dict(
        args=("q", "k", "v", "do", "lse", "delta"),
        outs=("dq",),
        resident=("q", "do", "lse", "delta"),
        streamed={"k": "block_k", "v": "block_k"},
        loop="kv",
        body="_dq_kernel",
    ),
    "flash_attention_bwd_dkdv": dict(
        args=("q", "k", "v", "do", "lse", "delta"),
        outs=("dk", "dv"),
        resident=("k", "v"),
        streamed={"q": "block_q", "do": "block_q", "lse": "block_q", "delta": "block_q"},
        loop="q_group",
        body="_dkdv_kernel",
    ),
}


# ----------------------------------------------------------------------------------------------
# Intercepting the kernel's pallas_calls.


class _Call:
    """One pallas_call as the kernel issued it."""

    def __init__(self, name, grid, in_specs, out_specs, kernel, args, out_shape):
        self.name = name
        self.grid = tuple(int(g) for g in grid)
        self.in_blocks = [tuple(spec.block_shape) for spec in in_specs]
        if not isinstance(out_specs, (list, tuple)):  # a single output (the dq kernel)
            out_specs = [out_specs]
        self.out_blocks = [tuple(spec.block_shape) for spec in out_specs]
        self.keywords = dict(kernel.keywords)
        self.arg_shapes = [tuple(a.shape) for a in args]
        self.arg_itemsize = [np.dtype(a.dtype).itemsize for a in args]
        outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
        self.out_itemsize = [np.dtype(o.dtype).itemsize for o in outs]


class _PlProxy:
    """Stands in for the kernel module's `pl`: records each pallas_call, then either returns
    zeros of its out_shape (abstract tracing) or calls the real one (interpret-mode sanity)."""

    def __init__(self, calls: list, run: bool):
        self._calls, self._run = calls, run

    def __getattr__(self, name):
        return getattr(pl, name)

    def pallas_call(self, kernel, *, grid, in_specs, out_specs, out_shape, name, **kw):
        real = (
            pl.pallas_call(
                kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, name=name, **kw
            )
            if self._run
            else None
        )

        def call(*args):
            self._calls.append(_Call(name, grid, in_specs, out_specs, kernel, args, out_shape))
            if real is not None:
                return real(*args)
            if isinstance(out_shape, (list, tuple)):
                return [jnp.zeros(o.shape, o.dtype) for o in out_shape]
            return jnp.zeros(out_shape.shape, out_shape.dtype)

        return call


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _shapes(T, S, H, N, K, B, dtype):
    sd = jax.ShapeDtypeStruct
    return (sd((B, T, N, H), dtype), sd((B, S, K, H), dtype), sd((B, S, K, H), dtype))


@functools.lru_cache(maxsize=None)
def capture(
    pass_: str,
    T: int,
    S: int,
    H: int,
    block_q: int,
    block_k: int,
    causal: bool,
    dtype_bytes: int,
    N: int,
    K: int,
    B: int,
):
    """(cfg, [_Call]) of the kernel's forward or backward for these shapes, traced abstractly."""
    q, k, v = _shapes(T, S, H, N, K, B, DTYPES[dtype_bytes])
    # _prepare validates and resolves the block sizes (the kernel's _block_size); interpret=True
    # only so that it does not ask for a GPU; the grid and specs do not depend on it.
    plan, _, _ = FK._prepare(
        q,
        k,
        v,
        None,
        None,
        causal=causal,
        softmax_scale=None,
        block_q=block_q,
        block_k=block_k,
        block_q_bwd=None,
        block_k_bwd=None,
        interpret=True,
        backend="generic",
    )
    (cfg,) = [c for _, variant, c in plan.branches if variant == "generic"]
    calls: list[_Call] = []
    with _patched(FK, "pl", _PlProxy(calls, run=False)):
        if pass_ == "fwd":
            jax.eval_shape(lambda q, k, v: FK._forward(q, k, v, None, None, cfg), q, k, v)
        else:
            lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
            jax.eval_shape(
                lambda q, k, v, o, lse, do: FK._backward(q, k, v, None, None, o, lse, do, None, cfg), q, k, v, q, lse, q
            )
    return cfg, calls


# ----------------------------------------------------------------------------------------------
# The count.


def _elems(block, arg_ndim=None) -> int:
    return int(np.prod([d for d in block if d is not None], dtype=np.int64))


def trips_per_program(call: _Call) -> np.ndarray:
    """Loop iterations (block loads of the streamed operands) of each program along grid axis 0,
    from the kernel's own loop bounds; the same for every (b, head) of grid axes 1, 2."""
    io, kw = KERNEL_IO[call.name], call.keywords
    cfg = kw["cfg"]
    bq, bk = cfg.block_q, cfg.block_k
    p = np.arange(call.grid[0])

    def span(lo, hi):  # trip count of lax.fori_loop(lo, hi, ...)
        return np.maximum(np.asarray(hi) - np.asarray(lo), 0)

    if io["loop"] == "kv":
        nk = kw["num_kv_blocks"]
        if not cfg.causal:
            return np.full(p.shape, nk, np.int64)
        # loops [n_start, n_inner) (a window's far edge; empty without one), [n_inner, n_full), [n_full, n_end)
        n_start, n_inner, n_full, n_end = FK._causal_kv_range(p, bq, bk, nk)
        return (span(n_start, n_inner) + span(n_inner, n_full) + span(n_full, n_end)).astype(np.int64)
    nq, group = kw["num_q_blocks"], kw["group"]
    if not cfg.causal:
        return np.full(p.shape, group * nq, np.int64)
    # loops [n_start, n_full), [n_full, n_outer) and [n_outer, n_stop) (n_outer = n_stop = nq without a window)
    n_start, n_full, n_outer, n_stop = FK._causal_q_range(p, bq, bk, nq)
    return (group * (span(n_start, n_full) + span(n_full, n_outer) + span(n_outer, n_stop))).astype(np.int64)


def call_bytes(call: _Call) -> dict:
    """Bytes read and written by one pallas_call, per operand."""
    io, cfg = KERNEL_IO[call.name], call.keywords["cfg"]
    assert len(call.in_blocks) == len(io["args"]), (call.name, "segment ids are not counted")
    programs = int(np.prod(call.grid))
    per_axis0 = programs // call.grid[0]  # programs per axis-0 index (B x heads)
    trips = trips_per_program(call)
    visits = int(trips.sum()) * per_axis0
    reads, writes = {}, {}
    for a, name in enumerate(io["args"]):
        isz = call.arg_itemsize[a]
        if name in io["resident"]:
            reads[name] = programs * _elems(call.in_blocks[a]) * isz
        elif name in io["streamed"]:
            rows = getattr(cfg, io["streamed"][name])
            per_row = call.in_blocks[a][-1] if len(call.arg_shapes[a]) == 4 else 1
            reads[name] = visits * rows * per_row * isz
        else:
            reads[name] = 0
    for o, name in enumerate(io["outs"]):
        writes[name] = programs * _elems(call.out_blocks[o]) * call.out_itemsize[o]
    return dict(name=call.name, grid=call.grid, programs=programs, loop_iterations=visits, reads=reads, writes=writes)


def hbm_bytes(T, H, block_q, block_k, causal, dtype_bytes, N=1, K=1, B=1, pass_="fwd", S=None):
    """HBM <-> on-chip bytes of one forward (pass_="fwd") or backward ("bwd") of the kernel.

    The backward includes XLA's Delta = rowsum(dO * O) preprocessing (reads dO and O, writes the
    fp32 Delta), which runs outside the Pallas kernels, as the component "xla_delta"."""
    S = T if S is None else S
    cfg, calls = capture(pass_, T, S, H, block_q, block_k, bool(causal), dtype_bytes, N, K, B)
    kernels = [call_bytes(c) for c in calls]
    reads = sum(sum(k["reads"].values()) for k in kernels)
    writes = sum(sum(k["writes"].values()) for k in kernels)
    extra = {}
    if pass_ == "bwd":
        extra = dict(name="xla_delta", reads=2 * B * T * N * H * dtype_bytes, writes=B * N * T * LSE_BYTES)
        reads, writes = reads + extra["reads"], writes + extra["writes"]
    return dict(
        reads=reads,
        writes=writes,
        total=reads + writes,
        kernels=kernels,
        xla_delta=extra or None,
        block_q=cfg.block_q,
        block_k=cfg.block_k,
    )


# ----------------------------------------------------------------------------------------------
# Independent closed forms (no kernel code), for the check.


def closed_form(T, S, H, bq, bk, causal, isz, N=1, K=1, B=1, pass_="fwd") -> int:
    """Total bytes, from the algorithm on paper. bq, bk: the blocks in use; tp, sp: padded
    lengths. kv rows a q head streams: full nq * sp; causal (T = S, both multiples of the
    blocks) nq * (S + max(bq, bk)) / 2 (the lower triangle of blocks plus the diagonal band).
    q rows a kv block streams per group head: full nk * tp, causal nk * (T + max(bq, bk)) / 2."""
    tp, sp = -(-T // bq) * bq, -(-S // bk) * bk
    nq, nk, G = tp // bq, sp // bk, N // K
    if causal:
        assert T == S and T % bq == 0 and T % bk == 0
        kv_rows = nq * (S + max(bq, bk)) // 2
        q_rows = nk * (T + max(bq, bk)) // 2
    else:
        kv_rows, q_rows = nq * sp, nk * tp
    if pass_ == "fwd":
        per_head = tp * H * isz + 2 * kv_rows * H * isz + tp * H * isz + tp * LSE_BYTES
        return B * N * per_head
    dq = 2 * tp * H * isz + 2 * tp * LSE_BYTES + 2 * kv_rows * H * isz + tp * H * isz
    dkdv = 2 * sp * H * isz + G * q_rows * (2 * H * isz + 2 * LSE_BYTES) + 2 * sp * H * isz
    delta = 2 * T * H * isz + T * LSE_BYTES
    return B * (N * dq + K * dkdv + N * delta)


def standard_bytes(T, S, H, isz, pass_="fwd") -> int:
    """Standard attention per (batch, head), the paper's Algorithms 0 and 3 with every element
    in the input dtype. Forward: read Q, K, write S; read S, write P; read P, V, write O:
    4TS + 2TH + 2SH. Backward: dV = P^T dO (TS + TH + SH), dP = dO V^T (TH + SH + TS),
    dS from P, dP (3TS), dQ = dS K (TS + SH + TH), dK = dS^T Q (TS + TH + SH): 7TS + 4TH + 4SH."""
    if pass_ == "fwd":
        return (4 * T * S + 2 * T * H + 2 * S * H) * isz
    return (7 * T * S + 4 * T * H + 4 * S * H) * isz


def sram_bytes(bq, bk, H, isz, score_tile=True) -> int:
    """On-chip bytes one forward program holds: q (bq H), k and v (2 bk H) tiles in the input
    dtype; the score/probability tile (bq bk), the output accumulator (bq H) and the row max and
    sum (2 bq) in fp32. score_tile=False leaves out the bq bk tile (the 'I/O tiles only' M)."""
    return (bq * H + 2 * bk * H) * isz + ((bq * bk if score_tile else 0) + bq * H + 2 * bq) * ACC_BYTES


def sram_bytes_bwd(bq, bk, H, isz) -> int:
    """The larger backward kernel (dk/dv): k, v, q, dO tiles; P and dS (fp32); dk, dv
    accumulators (fp32); lse, Delta rows. The dq kernel holds less (one bq H accumulator)."""
    return (2 * bk * H + 2 * bq * H) * isz + (2 * bq * bk + 2 * bk * H + 2 * bq) * ACC_BYTES


def bound_bytes(T, S, H, M_bytes, isz) -> float:
    """The paper's N^2 d^2 / M per (batch, head), with M in elements of the input dtype, times the
    element size: isz * T S H^2 / (M_bytes / isz)."""
    return isz * T * S * H * H / (M_bytes / isz)


# ----------------------------------------------------------------------------------------------
# Checks.

CHECK_CASES = [
    # (T, S, H, bq, bk, N, K, B)
    (1024, 1024, 64, 16, 16, 1, 1, 1),
    (1024, 1024, 128, 128, 32, 1, 1, 1),
    (1024, 1024, 128, 32, 128, 1, 1, 1),
    (2048, 2048, 64, 64, 256, 8, 2, 2),  # GQA 4:1, B = 2
    (512, 512, 128, 256, 16, 4, 1, 3),  # MQA
    (4096, 4096, 128, 128, 128, 2, 2, 1),
]
PADDED_CASES = [  # full attention only (closed form with padded lengths)
    (1000, 1000, 64, 128, 64, 2, 1, 1),
    (300, 700, 128, 64, 128, 1, 1, 2),
]
SHRUNK_CASES = [  # the kernel shrinks 256 to next_power_of_2(T) = 64; the closed form is told 64
    ((48, 48, 64, 256, 256, 1, 1, 1), (64, 64)),
]


def check_closed_forms() -> list[str]:
    problems = []
    cases = [(c, c[3:5], caus) for c in CHECK_CASES for caus in (False, True)]
    cases += [(c, c[3:5], False) for c in PADDED_CASES]
    cases += [(c, used, caus) for c, used in SHRUNK_CASES for caus in (False,)]
    n = 0
    for (T, S, H, bq, bk, N, K, B), (uq, uk), causal in cases:
        if H > 64:  # the kernel caps the key tile at wide heads (shared memory of a GPU block)
            uk = min(uk, FK.GPU_MAX_BLOCK_K_WIDE_HEADS)
        for pass_ in ("fwd", "bwd"):
            for isz in (2, 4):
                got = hbm_bytes(T, H, bq, bk, causal, isz, N=N, K=K, B=B, pass_=pass_, S=S)
                want = closed_form(T, S, H, uq, uk, causal, isz, N, K, B, pass_)
                n += 1
                if got["total"] != want or (got["block_q"], got["block_k"]) != (uq, uk):
                    problems.append(
                        f"closed form: T={T} S={S} H={H} blocks {bq}x{bk} N={N} K={K} "
                        f"B={B} causal={causal} {pass_} isz={isz}: count "
                        f"{got['total']} != closed form {want}"
                    )
    print(f"check: count == closed form at {n} points" + ("" if not problems else " -- FAILED"))
    return problems


def interpret_sanity(configs) -> tuple[list[dict], list[str]]:
    """Run the real kernel (fwd + bwd) in interpret mode with every loop iteration reported, and
    compare the iterations, programs and bytes with the count."""
    B, T, N, K, H = 1, 64, 2, 1, 16
    isz = 2
    dtype = DTYPES[isz]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, K, H)), dtype)
    do = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    problems, out = [], []
    body_to_call = {io["body"]: name for name, io in KERNEL_IO.items()}
    for bq, bk, causal in configs:
        t0 = time.time()
        visits: list[tuple] = []
        calls: list[_Call] = []
        pids = {}

        def wrap_kernel(orig):
            def kern(*refs, **kw):  # program ids read at the kernel's top level, as it does
                pids["ids"] = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
                return orig(*refs, **kw)

            return kern

        def fori_loop(lo, hi, body, carry, **kw):
            # the kernels' block loops have a functools.partial of their `body` as the body
            if isinstance(body, functools.partial) and body.func.__name__ == "body":
                tag = body.func.__qualname__.split(".")[0]
                g = body.keywords.get("g", -1)
                p0, p1, p2 = pids["ids"]

                def counted(j, c):
                    jax.debug.callback(
                        lambda *a, tag=tag: visits.append((tag,) + tuple(int(x) for x in a)), p0, p1, p2, g, j
                    )
                    return body(j, c)

                return jax.lax.fori_loop(lo, hi, counted, carry, **kw)
            return jax.lax.fori_loop(lo, hi, body, carry, **kw)

        class LaxProxy:
            def __getattr__(self, name):
                return getattr(jax.lax, name)

        lax_proxy = LaxProxy()
        lax_proxy.fori_loop = fori_loop

        f = functools.partial(FK.flash_attention, causal=causal, block_q=bq, block_k=bk, interpret=True)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(FK, "lax", lax_proxy))
            stack.enter_context(_patched(FK, "pl", _PlProxy(calls, run=True)))
            for body_name in body_to_call:
                stack.enter_context(_patched(FK, body_name, wrap_kernel(getattr(FK, body_name))))

            def fwd_bwd(q, k, v, do):
                o, vjp = jax.vjp(f, q, k, v)
                return (o,) + vjp(do)

            compiled = jax.jit(fwd_bwd).lower(q, k, v, do).compile({"xla_backend_optimization_level": 0})
        o, dq, dk, dv = jax.block_until_ready(compiled(q, k, v, do))
        # numerics unchanged by the instrumentation (bf16 kernel vs fp32 reference; 2e-2 as in
        # tests/test_flash_attention.py)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        ref = lambda q, k, v: reference_attention(q, k, v, causal=causal)  # noqa: E731
        ro, rvjp = jax.vjp(ref, f32(q), f32(k), f32(v))
        rdq, rdk, rdv = rvjp(f32(do))
        err = max(
            float(jnp.max(jnp.abs(f32(a) - b) / (1 + jnp.abs(b))))
            for a, b in ((o, ro), (dq, rdq), (dk, rdk), (dv, rdv))
        )
        if err > 2e-2:
            problems.append(f"sanity {bq}x{bk} causal={causal}: kernel vs reference err {err:.3g}")
        # observed vs counted, per kernel
        row = dict(block_q=bq, block_k=bk, causal=causal, max_rel_err=err, kernels={})
        for pass_ in ("fwd", "bwd"):
            counted = hbm_bytes(T, H, bq, bk, causal, isz, N=N, K=K, B=B, pass_=pass_)
            for kc in counted["kernels"]:
                name = kc["name"]
                body = KERNEL_IO[name]["body"]
                seen = [vv for vv in visits if vv[0] == body]
                call = next(c for c in calls if c.name == name)
                per_prog = collections.Counter(vv[1:4] for vv in seen)
                trips = trips_per_program(call)
                expect = {
                    (p0, p1, p2): int(trips[p0])
                    for p0 in range(call.grid[0])
                    for p1 in range(call.grid[1])
                    for p2 in range(call.grid[2])
                    if trips[p0] > 0
                }
                distinct = len(set(seen))
                # bytes implied by the observed iterations (streamed) + per-program loads/stores
                bytes_seen = (
                    sum(kc["reads"][a] for a in KERNEL_IO[name]["resident"])
                    + sum(kc["writes"].values())
                    + sum(kc["reads"][a] for a in KERNEL_IO[name]["streamed"])
                    // max(kc["loop_iterations"], 1)
                    * len(seen)
                )
                bytes_counted = sum(kc["reads"].values()) + sum(kc["writes"].values())
                ok = (
                    dict(per_prog) == expect
                    and distinct == len(seen) == kc["loop_iterations"]
                    and call.grid == kc["grid"]
                    and bytes_seen == bytes_counted
                )
                row["kernels"][name] = dict(
                    grid=list(call.grid),
                    programs=kc["programs"],
                    programs_seen=len(per_prog),
                    iterations_counted=kc["loop_iterations"],
                    iterations_seen=len(seen),
                    bytes_counted=bytes_counted,
                    bytes_seen=bytes_seen,
                    ok=ok,
                )
                if not ok:
                    problems.append(
                        f"sanity {bq}x{bk} causal={causal} {name}: seen "
                        f"{len(seen)} iterations over {len(per_prog)} programs, "
                        f"counted {kc['loop_iterations']} over {kc['programs']}"
                    )
        row["seconds"] = time.time() - t0
        out.append(row)
        print(
            f"sanity interpret {bq}x{bk} causal={causal}: "
            + ", ".join(
                f"{n.replace('flash_attention_', '')} {r['iterations_seen']}/{r['iterations_counted']} "
                f"iterations, {r['programs_seen']}/{r['programs']} programs"
                for n, r in row["kernels"].items()
            )
            + f"; err {err:.1e}; {row['seconds']:.1f} s",
            flush=True,
        )
    return out, problems


# ----------------------------------------------------------------------------------------------
# Sweep.

SEQS = [1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SEQS = [1024, 32768]
HEAD_DIMS = [64, 128]
SQUARE = [16, 32, 64, 128, 256]
RECT_BK = [32, 64, 128, 256]  # with block_q = 128
ISZ = 2  # bf16


def sweep(seqs) -> list[dict]:
    tiles = [(b, b) for b in SQUARE] + [(128, bk) for bk in RECT_BK if bk != 128]
    rows = []
    for T in seqs:
        for H in HEAD_DIMS:
            for bq, bk in tiles:
                for causal in (False, True):
                    for pass_ in ("fwd", "bwd"):
                        c = hbm_bytes(T, H, bq, bk, causal, ISZ, pass_=pass_)
                        M = sram_bytes(bq, bk, H, ISZ)
                        M_io = sram_bytes(bq, bk, H, ISZ, score_tile=False)
                        M_bwd = sram_bytes_bwd(bq, bk, H, ISZ)
                        bound = bound_bytes(T, T, H, M, ISZ)
                        std = standard_bytes(T, T, H, ISZ, pass_)
                        rows.append(
                            dict(
                                T=T,
                                H=H,
                                block_q=bq,
                                block_k=bk,
                                causal=causal,
                                pass_=pass_,
                                square=bq == bk,
                                reads=c["reads"],
                                writes=c["writes"],
                                total=c["total"],
                                kernels=c["kernels"],
                                xla_delta=c["xla_delta"],
                                M_bytes=M,
                                M_io_bytes=M_io,
                                M_bwd_bytes=M_bwd,
                                bound_bytes=bound,
                                ratio=c["total"] / bound,
                                ratio_io=c["total"] / bound_bytes(T, T, H, M_io, ISZ),
                                ratio_bwd_M=c["total"] / bound_bytes(T, T, H, M_bwd, ISZ),
                                standard_bytes=std,
                                standard_over_flash=std / c["total"],
                            )
                        )
    return rows


# ----------------------------------------------------------------------------------------------
# Tables and plot.


def _mib(x):
    return f"{x / 2**20:,.1f}"


def _find(rows, **kw):
    for r in rows:
        if all(r[k] == v for k, v in kw.items()):
            return r
    return None


def tables(rows: list[dict]) -> str:
    seqs = sorted({r["T"] for r in rows})
    out = []
    for H in HEAD_DIMS:
        for pass_ in ("fwd", "bwd"):
            for causal in (False, True):
                out += [
                    f"#### {pass_}, {'causal' if causal else 'full'}, d = {H}: traffic MiB "
                    f"per (batch, head) and ratio traffic / (N² d² / M), square tiles b",
                    "",
                    "| N | "
                    + " | ".join(f"b={b}" for b in SQUARE)
                    + " | 16 → 256 | standard attn. MiB | standard / flash (b=128) |",
                    "|---:|" + "---:|" * (len(SQUARE) + 3),
                ]
                for T in seqs:
                    cells = []
                    for b in SQUARE:
                        r = _find(rows, T=T, H=H, block_q=b, block_k=b, causal=causal, pass_=pass_)
                        cells.append(f"{_mib(r['total'])} ({r['ratio']:.2f})")
                    r16 = _find(rows, T=T, H=H, block_q=16, block_k=16, causal=causal, pass_=pass_)
                    r256 = _find(rows, T=T, H=H, block_q=256, block_k=256, causal=causal, pass_=pass_)
                    r128 = _find(rows, T=T, H=H, block_q=128, block_k=128, causal=causal, pass_=pass_)
                    out.append(
                        f"| {T // 1024}K | " + " | ".join(cells) + f" | {r16['total'] / r256['total']:.1f}x | "
                        f"{_mib(r128['standard_bytes'])} | "
                        f"{r128['standard_over_flash']:.1f}x |"
                    )
                out.append("")
    # rectangular: block_q = 128, block_k varies
    out += [
        "#### block_q = 128, block_k varies (N = 32K if run, else the largest): traffic MiB "
        "per (batch, head), M KiB and ratio",
        "",
        "| d | pass | mask | " + " | ".join(f"bk={b}" for b in RECT_BK) + " |",
        "|---:|---|---|" + "---:|" * len(RECT_BK),
    ]
    T = seqs[-1]
    for H in HEAD_DIMS:
        for pass_ in ("fwd", "bwd"):
            for causal in (False, True):
                cells = []
                for bk in RECT_BK:
                    r = _find(rows, T=T, H=H, block_q=128, block_k=bk, causal=causal, pass_=pass_)
                    cells.append(f"{_mib(r['total'])}; M {r['M_bytes'] / 1024:.0f}; {r['ratio']:.2f}")
                out.append(f"| {H} | {pass_} | {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")
    out.append("")
    # ratio summary: spread over N (at fixed tile) and over tiles
    out += [
        "#### ratio traffic / (N² d² / M): spread over N at each square tile, and with M "
        "without the score tile (ratio_io)",
        "",
        "| d | pass | mask | b | ratio N=1K | ratio N=32K | max/min over N | ratio_io N=32K |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for H in HEAD_DIMS:
        for pass_ in ("fwd", "bwd"):
            for causal in (False, True):
                for b in SQUARE:
                    rs = [
                        r
                        for r in rows
                        if r["H"] == H
                        and r["pass_"] == pass_
                        and r["causal"] == causal
                        and r["block_q"] == b
                        and r["block_k"] == b
                    ]
                    ratios = [r["ratio"] for r in sorted(rs, key=lambda r: r["T"])]
                    out.append(
                        f"| {H} | {pass_} | {'causal' if causal else 'full'} | {b} | "
                        f"{ratios[0]:.2f} | {ratios[-1]:.2f} | "
                        f"{max(ratios) / min(ratios):.3f} | "
                        f"{sorted(rs, key=lambda r: r['T'])[-1]['ratio_io']:.2f} |"
                    )
    out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["T"] for r in rows})
    cmap = plt.get_cmap("viridis")
    color = {T: cmap(i / max(len(seqs) - 1, 1)) for i, T in enumerate(seqs)}
    fig, axes = plt.subplots(2, 3, figsize=(18, 10.5))
    H = 128

    def sq(**kw):
        return sorted(
            (r for r in rows if r["square"] and all(r[k] == v for k, v in kw.items())), key=lambda r: r["block_q"]
        )

    few = [T for T in (1024, 4096, 32768) if T in seqs] or seqs  # fewer lines in the top panels
    for ax, pass_ in ((axes[0][0], "fwd"), (axes[0][1], "bwd")):
        for T in few:
            rs = sq(T=T, H=H, causal=False, pass_=pass_)
            x = [r["block_q"] for r in rs]
            ax.plot(x, [r["total"] for r in rs], "o-", color=color[T], label=f"N={T // 1024}K")
            rc = sq(T=T, H=H, causal=True, pass_=pass_)
            ax.plot(x, [r["total"] for r in rc], "s:", color=color[T], mfc="none", ms=5)
            ax.plot(x, [r["bound_bytes"] for r in rs], "--", color=color[T], lw=1, alpha=0.8)
            ax.axhline(rs[0]["standard_bytes"], color=color[T], lw=0.8, ls="-.", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(SQUARE, [str(b) for b in SQUARE])
        ax.set_xlabel("square tile b = block_q = block_k")
        ax.set_ylabel("HBM bytes per (batch, head)")
        ax.set_title(
            f"{pass_}, d = {H}, bf16: counted traffic (o full, □ causal),\n"
            "-- N²d²/M (M = tile footprint), -. standard attention"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)

    ax = axes[0][2]
    for T in seqs:
        rs = sorted(
            (r for r in rows if r["T"] == T and r["H"] == H and r["block_q"] == 128 and not r["causal"]),
            key=lambda r: r["block_k"],
        )
        for pass_, mk in (("fwd", "o-"), ("bwd", "s--")):
            rr = [r for r in rs if r["pass_"] == pass_]
            ax.plot(
                [r["block_k"] for r in rr],
                [r["ratio"] for r in rr],
                mk,
                color=color[T],
                label=f"N={T // 1024}K" if pass_ == "fwd" else None,
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(RECT_BK, [str(b) for b in RECT_BK])
    ax.set_xlabel("block_k (block_q = 128)")
    ax.set_ylabel("traffic / (N²d²/M)")
    ax.set_title(f"block_q = 128, d = {H}, full: ratio (o fwd, □ bwd);\nfwd traffic does not depend on block_k, M does")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)

    ax = axes[1][0]
    T = seqs[-1]
    for H_, ls in ((64, "-"), (128, "--")):
        for pass_, causal, c in (
            ("fwd", False, "tab:blue"),
            ("fwd", True, "tab:cyan"),
            ("bwd", False, "tab:red"),
            ("bwd", True, "tab:orange"),
        ):
            rs = sq(T=T, H=H_, causal=causal, pass_=pass_)
            ax.plot(
                [r["block_q"] for r in rs],
                [r["ratio"] for r in rs],
                "o" + ls,
                color=c,
                label=f"{pass_} {'causal' if causal else 'full'} d={H_}",
            )
            if not causal:
                ax.plot([r["block_q"] for r in rs], [r["ratio_io"] for r in rs], "x" + ls, color=c, alpha=0.45)
    ax.set_xscale("log", base=2)
    ax.set_xticks(SQUARE, [str(b) for b in SQUARE])
    ax.set_xlabel("square tile b")
    ax.set_ylabel("traffic / (N²d²/M)")
    ax.set_title(
        f"ratio vs tile at N = {T // 1024}K (o: M = full tile footprint;\nx faint: M without the b² score tile)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)

    ax = axes[1][1]
    bcol = {b: plt.get_cmap("plasma")(i / (len(SQUARE) - 1) * 0.85) for i, b in enumerate(SQUARE)}
    for b in SQUARE:
        for pass_, ls in (("fwd", "o-"), ("bwd", "s--")):
            rs = sorted(
                (
                    r
                    for r in rows
                    if r["H"] == 128
                    and r["block_q"] == b
                    and r["block_k"] == b
                    and not r["causal"]
                    and r["pass_"] == pass_
                ),
                key=lambda r: r["T"],
            )
            ax.plot(
                [r["T"] for r in rs],
                [r["ratio"] for r in rs],
                ls,
                color=bcol[b],
                label=f"b={b}" if pass_ == "fwd" else None,
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [f"{T // 1024}K" for T in seqs])
    ax.set_xlabel("N (sequence length)")
    ax.set_ylabel("traffic / (N²d²/M)")
    ax.set_title("ratio vs N, d = 128, full (o fwd, □ bwd):\nconstant as N grows (q, o, dq terms are O(Nd))")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[1][2]
    for b in SQUARE:
        for pass_, ls in (("fwd", "o-"), ("bwd", "s--")):
            rs = sorted(
                (
                    r
                    for r in rows
                    if r["H"] == 128
                    and r["block_q"] == b
                    and r["block_k"] == b
                    and not r["causal"]
                    and r["pass_"] == pass_
                ),
                key=lambda r: r["T"],
            )
            ax.plot(
                [r["T"] for r in rs],
                [r["standard_over_flash"] for r in rs],
                ls,
                color=bcol[b],
                label=f"b={b}" if pass_ == "fwd" else None,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(seqs, [f"{T // 1024}K" for T in seqs])
    ax.set_xlabel("N (sequence length)")
    ax.set_ylabel("standard / flash HBM bytes")
    ax.set_title("standard attention Θ(Nd + N²) over flash, d = 128, full\n(o fwd, □ bwd)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ----------------------------------------------------------------------------------------------

SANITY = [(16, 16, True), (16, 16, False), (16, 32, True), (32, 16, True)]
QUICK_SANITY = [(16, 16, True), (16, 32, True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 1K, 32K; two sanity runs")
    parser.add_argument("--check", action="store_true", help="only the checks")
    parser.add_argument("--replot", action="store_true", help="plot + tables from results.json")
    args = parser.parse_args()
    if args.replot:
        with open(os.path.join(HERE, "results.json")) as f:
            rows = json.load(f)["results"]
        plot(rows, os.path.join(HERE, "flash_io.png"))
        print(tables(rows))
        return 0

    t_start = time.time()
    problems = check_closed_forms()
    sanity, p = interpret_sanity(QUICK_SANITY if args.quick else SANITY)
    problems += p
    if args.check:
        print("checks:", "all passed" if not problems else "\n".join(problems))
        return 1 if problems else 0
    t0 = time.time()
    rows = sweep(QUICK_SEQS if args.quick else SEQS)
    print(f"sweep: {len(rows)} configurations counted in {time.time() - t0:.1f} s")
    summary = dict(quick=args.quick, seconds=None, problems=problems, dtype_bytes=ISZ, sanity=sanity, results=rows)
    plot(rows, os.path.join(HERE, "flash_io.png"))
    print(tables(rows))
    summary["seconds"] = time.time() - t_start
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(
        "checks:",
        "all passed (closed forms, interpret-mode iterations and bytes)" if not problems else "\n".join(problems),
    )
    print(f"total {summary['seconds']:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
