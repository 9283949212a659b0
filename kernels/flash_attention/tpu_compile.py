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
import datetime  # noqa: E402
import functools  # noqa: E402
import importlib.metadata  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxsys.kernels.flash_attention import flash_attention  # noqa: E402

CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'


def tpu_mesh(target: str):
    """A one-axis ("data") mesh over the compile-only devices of a TPU target such as v5p:2x2x1."""
    from jaxsys.analysis import targets
    devices = targets.devices(targets.parse(target))
    return jax.sharding.Mesh(np.array(devices).reshape(-1), ("data",))


def compile_case(mesh, t: int, h: int, dtype, *, backward: bool, heads: int = 8,
                 kv_heads: int = 2, batch: int = 1, causal: bool = True, segments: bool = False,
                 block_q: int = 128, block_k: int = 128, **kwargs):
    """Lower and compile flash attention on q[B, T, N, H] with B = batch per device; returns the
    compiled executable. kwargs go to flash_attention (e.g. backend=, interpret=)."""
    b = batch * mesh.size
    data = P("data")
    attend = functools.partial(flash_attention, causal=causal, return_lse=True, block_q=block_q,
                               block_k=block_k, **kwargs)

    def local(q, k, v, seg):
        segs = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
        return attend(q, k, v, **segs)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(data,) * 4, out_specs=(data, data),
                            check_vma=False)

    def loss(q, k, v, seg):  # both cotangents (o and lse) reach the backward
        o, lse = sharded(q, k, v, seg)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else sharded
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, data))
    args = (spec((b, t, heads, h), dtype), spec((b, t, kv_heads, h), dtype),
            spec((b, t, kv_heads, h), dtype), spec((b, t), jnp.int32))
    return jax.jit(fn).lower(*args).compile()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=lambda s: s.split(","), default=["v5p:2x2x1", "v6e:2x2"])
    p.add_argument("--seq-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=_ints, default=[64, 128, 256])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=8, help="query heads N per device")
    p.add_argument("--kv-heads", type=int, default=2, help="kv heads K per device")
    p.add_argument("--batch", type=int, default=1, help="B per device")
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--full", action="store_true", help="not causal")
    p.add_argument("--segments", action="store_true", help="pass segment ids")
    args = p.parse_args(argv)
    from jaxsys.analysis import targets

    passes = (("fwd", False), ("fwd+bwd", True))
    cells, failures = {}, []
    start = time.time()
    for target in args.targets:
        mesh = tpu_mesh(target)
        for dtype in args.dtypes:
            for pass_name, backward in passes:
                for t in args.seq_lens:
                    for h in args.head_dims:
                        case = (target, dtype, pass_name, t, h)
                        t0 = time.time()
                        try:
                            with targets.quiet_libtpu():
                                compiled = compile_case(
                                    mesh, t, h, jnp.dtype(dtype), backward=backward,
                                    heads=args.heads, kv_heads=args.kv_heads, batch=args.batch,
                                    causal=not args.full, segments=args.segments,
                                    block_q=args.block_q, block_k=args.block_k)
                            calls = compiled.as_text().count(CUSTOM_CALL)
                            if calls != (3 if backward else 1):
                                raise AssertionError(f"{calls} Mosaic custom calls in the HLO")
                            cells[case] = f"{time.time() - t0:.1f} s"
                        except Exception as e:  # report every case, then fail at the end
                            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                            cells[case] = "FAIL"
                            failures.append((case, f"{type(e).__name__}: {first[:300]}"))
                        print(f"{' '.join(map(str, case))}: {cells[case]}", file=sys.stderr,
                              flush=True)

    libtpu = importlib.metadata.version("libtpu")
    print(f"TPU compile of flash_attention, {datetime.date.today()}, jax {jax.__version__}, "
          f"libtpu {libtpu}; per device B={args.batch}, N={args.heads}, K={args.kv_heads}, "
          f"{'full' if args.full else 'causal'}{', segment ids' if args.segments else ''}, "
          f"block_q={args.block_q}, block_k={args.block_k}; "
          f"compile seconds (lower + compile) per case\n")
    print("| target | dtype | pass | T | " + " | ".join(f"H={h}" for h in args.head_dims) + " |")
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in args.head_dims) + " |")
    for target in args.targets:
        for dtype in args.dtypes:
            for pass_name, _ in passes:
                for t in args.seq_lens:
                    row = [cells[(target, dtype, pass_name, t, h)] for h in args.head_dims]
                    print(f"| {target} | {dtype} | {pass_name} | {t} | " + " | ".join(row) + " |")
    print(f"\n{len(cells)} cases, {len(failures)} failed, {time.time() - start:.0f} s in all")
    for case, message in failures:
        print(f"- FAIL {' '.join(map(str, case))}: {message}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
