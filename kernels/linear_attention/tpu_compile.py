"""Compile the linear-attention kernels for TPU ahead of time, from this (CPU) machine.

    python -m jaxsys.kernels.linear_attention.tpu_compile

For each target (libtpu's compile-only devices, jaxsys.analysis.targets), sequence length T, head
dim H = Hv and dtype, lowers and compiles the public `linear_attention` (backend chosen
automatically, as the model calls it; per-head decay, a carried-in initial state) inside a jitted
`jax.shard_map` over all the target's devices (batch split over them; Mosaic kernels cannot be
partitioned by GSPMD), once forward only and once forward + backward (`jax.grad` through the
custom_vjp for q, k, v, log_decay and initial_state, with cotangents on o and final_state). A case
passes when the TPU compiler accepts it and the compiled HLO holds the Mosaic custom calls: 1
(forward) or 3 (forward, dq pass, dk/dv pass; 2 with --no-decay, where XLA drops the forward as
dead code: jax.grad needs neither o nor, without decay, final_state).

Nothing runs: there is no TPU here. This checks what Mosaic and XLA:TPU accept (block shapes,
layouts, VMEM use at these blocks), not numerics or speed. Prints a markdown table (compile
seconds per case) and exits 1 if any case failed.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu serves only ahead-of-time compiles here

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxsys.kernels.linear_attention import linear_attention  # noqa: E402
from jaxsys.kernels.tpu_compile_grid import CUSTOM_CALL, add_grid_arguments, run_grid, tpu_mesh  # noqa: E402,F401
from jaxsys.parallel.spmd import per_shard

KERNELS = ("linear_attention_tpu_fwd", "linear_attention_tpu_bwd_dq", "linear_attention_tpu_bwd_dkdv")


def expected_kernels(backward: bool, decay: bool) -> tuple[str, ...]:
    """The Mosaic kernels a compiled case must hold. Forward + backward without decay has no
    forward kernel: its outputs are dead (the backward needs final_state only for d log_decay)."""
    if not backward:
        return KERNELS[:1]
    return KERNELS if decay else KERNELS[1:]


def compile_case(
    mesh,
    t: int,
    h: int,
    dtype,
    *,
    backward: bool,
    heads: int = 4,
    batch: int = 1,
    hv: int | None = None,
    chunk_size: int = 64,
    decay: bool = True,
    **kwargs,
):
    """Lower and compile linear attention on q, k [B, T, N, H], v [B, T, N, Hv] with B = batch
    per device (and an initial state); returns the compiled executable. kwargs go to
    linear_attention (e.g. block_t=, backend=, interpret=)."""
    hv = h if hv is None else hv
    b = batch * mesh.size
    data = P("data")
    attend = functools.partial(linear_attention, chunk_size=chunk_size, scale=h**-0.5, **kwargs)

    def local(q, k, v, ld, s0):
        return attend(q, k, v, log_decay=ld if decay else None, initial_state=s0)

    sharded = per_shard(local, mesh, (data, data, data, P(), data), (data, data))

    def loss(q, k, v, ld, s0):  # both cotangents (o and final_state) reach the backward
        o, st = sharded(q, k, v, ld, s0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(st)

    fn = jax.grad(loss, argnums=(0, 1, 2, 3, 4)) if backward else sharded
    spec = lambda shape, dt, s=data: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, s))
    args = (
        spec((b, t, heads, h), dtype),
        spec((b, t, heads, h), dtype),
        spec((b, t, heads, hv), dtype),
        spec((heads,), jnp.float32, P()),
        spec((b, heads, h, hv), jnp.float32),
    )
    return jax.jit(fn).lower(*args).compile()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grid_arguments(p, head_dims_help="H = Hv")
    p.add_argument("--heads", type=int, default=4, help="heads N per device")
    p.add_argument("--batch", type=int, default=1, help="B per device")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--block-t", type=int, default=None, help="tokens per grid step (default: the kernel's)")
    p.add_argument("--no-decay", action="store_true")
    args = p.parse_args(argv)

    def check(mesh, t, h, dtype, backward):
        compiled = compile_case(
            mesh,
            t,
            h,
            dtype,
            backward=backward,
            heads=args.heads,
            batch=args.batch,
            chunk_size=args.chunk_size,
            decay=not args.no_decay,
            block_t=args.block_t,
        )
        text = compiled.as_text()
        want = expected_kernels(backward, not args.no_decay)
        calls = text.count(CUSTOM_CALL)
        missing = [k for k in want if k not in text]
        if calls != len(want) or missing:
            raise AssertionError(f"{calls} Mosaic custom calls in the HLO, want {want}; missing {missing}")

    title = (
        f"TPU compile of linear_attention; per device B={args.batch}, N={args.heads}, H = Hv, "
        f"chunk_size={args.chunk_size}, block_t={args.block_t or 'default'}, "
        f"{'no decay' if args.no_decay else 'per-head decay'}, initial state"
    )
    return run_grid(args, check, title)


if __name__ == "__main__":
    sys.exit(main())
