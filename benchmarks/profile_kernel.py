"""One kernel call, warmed up, then run inside a CUDA profiler range: what `ncu` profiles in
benchmarks/gpu_profile.sh to explain a gap to the vendor baseline (tensor-pipe and DRAM
utilisation, registers, occupancy), as issue 35 asks, rather than guessing it.

    python benchmarks/profile_kernel.py flash --impl mosaic --seq-len 4096 --head-dim 128 [--causal]
    python benchmarks/profile_kernel.py quant --impl w4a16 --m 16 --k 4096 --n 11008 [--split-k 1]
    python benchmarks/profile_kernel.py flash --impl pallas --interpret   # CPU: the script's own check

flash impls: pallas (Triton), mosaic (the Hopper kernels), mosaic_split (with the split backward),
cudnn, tokamax; --backward profiles the
forward+backward. quant impls: w8a16, w4a16, w8a8 (split-K chosen from the SM count unless
--split-k), bf16 (XLA's dot). Outside ncu the range markers do nothing and the script prints the
call's median time, so it is also a quick single-shape timer.

Where ncu cannot read the hardware counters (the lent machines' gVisor runtime: "Failed to
initialize the profiler"), `--jax-trace DIR` runs the same calls under JAX's profiler (CUPTI) and
prints each kernel's device time from its Perfetto trace (`trace_kernels`): which kernels a call
launches and how the time splits between them, without counters.

    python benchmarks/profile_kernel.py flash --impl mosaic --backward --jax-trace /tmp/t
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import gzip
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def _cudart():
    """libcudart for cudaProfilerStart / Stop (ncu --profile-from-start off), or None."""
    try:
        import nvidia.cuda_runtime as runtime  # the CUDA wheels that jax[cuda13] installs

        paths = glob.glob(os.path.join(list(runtime.__path__)[0], "lib", "libcudart.so*"))
    except ImportError:
        paths = []
    for path in paths + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def flash_call(args):
    from jaxsys.kernels.flash_attention import flash_attention

    b, n, k, t, h = max(1, args.tokens // args.seq_len), args.heads, args.kv_heads, args.seq_len, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kv = [jax.random.normal(keys[i], (b, t, k, h), jnp.bfloat16) for i in (1, 2)]
    if args.impl in ("pallas", "mosaic", "mosaic_split"):
        backend = "generic" if args.impl == "pallas" else "mosaic_gpu"
        attn = lambda q, k, v: flash_attention(
            q, k, v, causal=args.causal, backend=backend, interpret=args.interpret or None
        )
    elif args.impl == "cudnn":
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation="cudnn")
    elif args.impl == "tokamax":
        import tokamax

        attn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=args.causal, implementation="mosaic")
    else:
        raise SystemExit(f"flash --impl {args.impl!r}: choose pallas, mosaic, mosaic_split, cudnn or tokamax")
    if args.backward:
        do = jax.random.normal(keys[3], q.shape, q.dtype)
        return jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](do)), (q, *kv)
    return jax.jit(attn), (q, *kv)


def quant_call(args):
    from jaxsys.kernels.quantized_matmul import kernel as qk
    from jaxsys.kernels.quantized_matmul import reference as qr

    m, k, n = args.m, args.k, args.n
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.float32) * 0.05
    common = dict(split_k=args.split_k, interpret=args.interpret or None)
    if args.impl == "bf16":
        wb = w.astype(jnp.bfloat16)
        return jax.jit(lambda x: x @ wb), (x,)
    if args.impl == "w8a16":
        q8, s8 = qr.quantize_w8(w)
        return jax.jit(lambda x: qk.matmul_w8a16(x, q8, s8, **common)), (x,)
    if args.impl == "w8a8":
        q8, s8 = qr.quantize_w8(w)
        return jax.jit(lambda x: qk.matmul_w8a8(*qr.quantize_per_token(x), q8, s8, **common)), (x,)
    if args.impl == "w4a16":
        q4, s4, _ = qr.quantize_w4(w, 128, zero_point=False)
        packed = qr.repack_w4(qr.pack_int4(q4), 128)
        return jax.jit(lambda x: qk.matmul_w4a16(x, packed, s4, None, **common)), (x,)
    raise SystemExit(f"quant --impl {args.impl!r}: choose w8a16, w4a16, w8a8 or bf16")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=("flash", "quant"))
    p.add_argument("--impl", required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="flash: B * T")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="flash: profile forward+backward")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=11008)
    p.add_argument("--split-k", type=int, default=None)
    p.add_argument("--iters", type=int, default=3, help="calls inside the profiler range")
    p.add_argument("--interpret", action="store_true", help="CPU: Pallas interpret mode (a check of the script)")
    p.add_argument("--jax-trace", default=None, help="run the calls under JAX's profiler into this folder")
    p.add_argument("--trace-process", default="/device:GPU", help="--jax-trace: the trace's processes to sum")
    args = p.parse_args(argv)
    fn, inputs = (flash_call if args.kernel == "flash" else quant_call)(args)
    from jaxsys.kernels.flash_attention import kernel_mgpu

    # the Mosaic backward's variant is read when fn traces (its first call)
    with kernel_mgpu.backward_variant("split" if args.impl == "mosaic_split" else "fused"):
        jax.block_until_ready(fn(*inputs))
    for _ in range(2):  # compile and warm up outside the range
        jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    cudart = _cudart() if jax.default_backend() == "gpu" and not args.jax_trace else None
    if cudart is not None:
        cudart.cudaProfilerStart()
    with jax.profiler.trace(args.jax_trace, create_perfetto_trace=True) if args.jax_trace else contextlib.nullcontext():
        for _ in range(args.iters):
            jax.block_until_ready(fn(*inputs))
    if cudart is not None:
        cudart.cudaProfilerStop()
    device = jax.devices()[0]
    profiler = "jax trace" if args.jax_trace else "cudart" if cudart is not None else "none"
    print(
        f"{args.kernel} {args.impl} on {device.device_kind}: median {statistics.median(times) * 1e3:.3f} ms "
        f"(profiler range: {profiler})"
    )
    if args.jax_trace:
        rows = trace_kernels(args.jax_trace, args.trace_process)
        print(kernel_table(rows, args.iters))
    return 0


def trace_kernels(folder: str, process_prefix: str = "/device:GPU") -> list[tuple[str, int, float]]:
    """(name, calls, total microseconds) of the complete events in the newest Perfetto trace under
    `folder` whose process name starts with `process_prefix` (on a GPU, the kernels on its
    streams), the longest first."""
    traces = sorted(
        glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime
    )
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder}")
    with gzip.open(traces[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and names.get(e.get("pid"), "").startswith(process_prefix):
            entry = totals.setdefault(e["name"], [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0.0))
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


def kernel_table(rows, iters: int, top: int = 15) -> str:
    """A markdown table of `trace_kernels` rows: per call of the profiled function, and each share."""
    total = sum(t for _, _, t in rows) or 1.0
    lines = ["| kernel | launches / call | us / call | share |", "| --- | ---: | ---: | ---: |"]
    for name, calls, us in rows[:top]:
        lines.append(f"| {name[:90]} | {calls / iters:g} | {us / iters:.1f} | {us / total:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
