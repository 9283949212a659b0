"""Compile the flash-attention kernels for TPU ahead of time, from this (CPU) machine.

    python -m jaxsys.kernels.flash_attention.tpu_compile

For each target (libtpu's compile-only devices, jaxsys.analysis.targets), sequence length T, head
dim H and dtype, lowers and compiles the public `flash_attention` (backend chosen automatically,
as the model calls it) inside a jitted `jax.shard_map` over all the target's devices (batch split
over them; Mosaic kernels cannot be partitioned by GSPMD), once forward only and once forward +
backward (`jax.grad` through the custom_vjp). A case passes when the TPU compiler accepts it and
the compiled HLO holds the Mosaic custom calls: 1 (forward) or 3 (forward, dq, dk/dv).

Nothing runs: there is no TPU here. This checks what Mosaic and XLA:TPU accept (block shapes,
layouts, VMEM use at these tiles), not numerics or speed. Prints a markdown table (compile seconds
per case) and exits 1 if any case failed.
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

from jaxsys.kernels.flash_attention import flash_attention  # noqa: E402
from jaxsys.kernels.tpu_compile_grid import CUSTOM_CALL, add_grid_arguments, run_grid, tpu_mesh  # noqa: E402,F401
from jaxsys.parallel.spmd import per_shard


def compile_case(
    mesh,
    t: int,
    h: int,
    dtype,
    *,
    backward: bool,
    heads: int = 8,
    kv_heads: int = 2,
    batch: int = 1,
    causal: bool = True,
    segments: bool = False,
    block_q: int = 128,
    block_k: int = 128,
    **kwargs,
):
    """Lower and compile flash attention on q[B, T, N, H] with B = batch per device; returns the
    compiled executable. kwargs go to flash_attention (e.g. backend=, interpret=)."""
    b = batch * mesh.size
    data = P("data")
    attend = functools.partial(
        flash_attention, causal=causal, return_lse=True, block_q=block_q, block_k=block_k, **kwargs
    )

    def local(q, k, v, seg):
        segs = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
        return attend(q, k, v, **segs)

    sharded = per_shard(local, mesh, (data,) * 4, (data, data))

    def loss(q, k, v, seg):  # both cotangents (o and lse) reach the backward
        o, lse = sharded(q, k, v, seg)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else sharded
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, data))
    args = (
        spec((b, t, heads, h), dtype),
        spec((b, t, kv_heads, h), dtype),
        spec((b, t, kv_heads, h), dtype),
        spec((b, t), jnp.int32),
    )
    return jax.jit(fn).lower(*args).compile()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grid_arguments(p)
    p.add_argument("--heads", type=int, default=8, help="query heads N per device")
    p.add_argument("--kv-heads", type=int, default=2, help="kv heads K per device")
    p.add_argument("--batch", type=int, default=1, help="B per device")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--full", action="store_true", help="not causal")
    p.add_argument("--segments", action="store_true", help="pass segment ids")
    args = p.parse_args(argv)

    def check(mesh, t, h, dtype, backward):
        compiled = compile_case(
            mesh,
            t,
            h,
            dtype,
            backward=backward,
            heads=args.heads,
            kv_heads=args.kv_heads,
            batch=args.batch,
            causal=not args.full,
            segments=args.segments,
            block_q=args.block_q,
            block_k=args.block_k,
        )
        calls = compiled.as_text().count(CUSTOM_CALL)
        if calls != (3 if backward else 1):
            raise AssertionError(f"{calls} Mosaic custom calls in the HLO")

    title = (
        f"TPU compile of flash_attention; per device B={args.batch}, N={args.heads}, "
        f"K={args.kv_heads}, {'full' if args.full else 'causal'}"
        f"{', segment ids' if args.segments else ''}, block_q={args.block_q}, block_k={args.block_k}"
    )
    return run_grid(args, check, title)


if __name__ == "__main__":
    sys.exit(main())
