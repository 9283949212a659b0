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

from jaxsys.kernels.linear_attention import linear_attention  # noqa: E402

CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'
KERNELS = ("linear_attention_tpu_fwd", "linear_attention_tpu_bwd_dq",
           "linear_attention_tpu_bwd_dkdv")


def expected_kernels(backward: bool, decay: bool) -> tuple[str, ...]:
    """The Mosaic kernels a compiled case must hold. Forward + backward without decay has no
    forward kernel: its outputs are dead (the backward needs final_state only for d log_decay)."""
    if not backward:
        return KERNELS[:1]
    return KERNELS if decay else KERNELS[1:]


def tpu_mesh(target: str):
    """A one-axis ("data") mesh over the compile-only devices of a TPU target such as v5p:2x2x1."""
    from jaxsys.analysis import targets
    devices = targets.devices(targets.parse(target))
    return jax.sharding.Mesh(np.array(devices).reshape(-1), ("data",))


def compile_case(mesh, t: int, h: int, dtype, *, backward: bool, heads: int = 4, batch: int = 1,
                 hv: int | None = None, chunk_size: int = 64, decay: bool = True, **kwargs):
    """Lower and compile linear attention on q, k [B, T, N, H], v [B, T, N, Hv] with B = batch
    per device (and an initial state); returns the compiled executable. kwargs go to
    linear_attention (e.g. block_t=, backend=, interpret=)."""
    hv = h if hv is None else hv
    b = batch * mesh.size
    data = P("data")
    attend = functools.partial(linear_attention, chunk_size=chunk_size, scale=h ** -0.5, **kwargs)

    def local(q, k, v, ld, s0):
        return attend(q, k, v, log_decay=ld if decay else None, initial_state=s0)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(data, data, data, P(), data),
                            out_specs=(data, data), check_vma=False)

    def loss(q, k, v, ld, s0):  # both cotangents (o and final_state) reach the backward
        o, st = sharded(q, k, v, ld, s0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(st)

    fn = jax.grad(loss, argnums=(0, 1, 2, 3, 4)) if backward else sharded
    spec = lambda shape, dt, s=data: jax.ShapeDtypeStruct(shape, dt,
                                                          sharding=NamedSharding(mesh, s))
    args = (spec((b, t, heads, h), dtype), spec((b, t, heads, h), dtype),
            spec((b, t, heads, hv), dtype), spec((heads,), jnp.float32, P()),
            spec((b, heads, h, hv), jnp.float32))
    return jax.jit(fn).lower(*args).compile()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=lambda s: s.split(","), default=["v5p:2x2x1", "v6e:2x2"])
    p.add_argument("--seq-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=_ints, default=[64, 128, 256], help="H = Hv")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=4, help="heads N per device")
    p.add_argument("--batch", type=int, default=1, help="B per device")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--block-t", type=int, default=None, help="tokens per grid step (default: "
                   "the kernel's)")
    p.add_argument("--no-decay", action="store_true")
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
                                    heads=args.heads, batch=args.batch,
                                    chunk_size=args.chunk_size, decay=not args.no_decay,
                                    block_t=args.block_t)
                            text = compiled.as_text()
                            want = expected_kernels(backward, not args.no_decay)
                            calls = text.count(CUSTOM_CALL)
                            missing = [k for k in want if k not in text]
                            if calls != len(want) or missing:
                                raise AssertionError(f"{calls} Mosaic custom calls in the HLO, "
                                                     f"want {want}; missing {missing}")
                            cells[case] = f"{time.time() - t0:.1f} s"
                        except Exception as e:  # report every case, then fail at the end
                            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                            cells[case] = "FAIL"
                            failures.append((case, f"{type(e).__name__}: {first[:300]}"))
                        print(f"{' '.join(map(str, case))}: {cells[case]}", file=sys.stderr,
                              flush=True)

    libtpu = importlib.metadata.version("libtpu")
    block_t = args.block_t or "default"
    print(f"TPU compile of linear_attention, {datetime.date.today()}, jax {jax.__version__}, "
          f"libtpu {libtpu}; per device B={args.batch}, N={args.heads}, H = Hv, "
          f"chunk_size={args.chunk_size}, block_t={block_t}, "
          f"{'no decay' if args.no_decay else 'per-head decay'}, initial state; "
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
