"""Microbenchmarks that set the `cpu` profile of jaxsys/analysis/cost_model.py (issue 22's planner):
what one simulated CPU device pays per operation, per collective and per byte, measured on 8
simulated devices in CPU seconds of the process (all threads, as part B of run.py measures a
step) divided by the 8 devices. Nothing here looks at a transformer or at the layouts part B
ranks: the profile is calibrated on these kernels and then evaluated on the layouts.

    python experiments/planner/calibrate_cpu.py           # ~1-2 min on 2 cores; writes cpu_calibration.json

Measured (each the minimum over 5 repeats of a jitted call, after a warm-up):
- op_overhead_s: a chain of K dependent [8, 8] dots per device (each dot is one kernel: XLA does
  not fuse dot into dot), slope over K = 1 -> 129: the fixed cost of one kernel;
- collective_latency_s, hop_latency_s: chains of K dependent collectives of a 32-byte array per
  device (psum, all_gather, psum_scatter, ppermute) over mesh axes of 2, 4 and 8 devices, the
  per-collective slope less one kernel (the multiply between collectives). Least squares over
  all of them of  t = alpha + hops(kind, n) * alpha_hop, hops as in a ring: n-1 (all-gather,
  reduce-scatter), 2(n-1) (all-reduce), 1 (permute);
- link_bytes_per_s: the same psum on 1 MiB per device, beta = (t - t_small) / ring bytes;
- flops_per_s: a chain of 8 [256, 256] fp32 dots per device, FLOPs / CPU seconds;
- bytes_per_s: x * 1.0001 + 1 on 2^21 fp32 per device (read + write), bytes / CPU seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time

DEVICES = 8
HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def cpu_seconds(fn, *args, repeats: int = 5, calls: int = 5) -> float:
    """CPU seconds of the process per call per device (min over repeats)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.process_time() - start) / calls)
    return best / DEVICES


def mesh_for(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:DEVICES]).reshape(DEVICES // n, n), ("o", "g"))


def chain(mesh: Mesh, body, k: int, shape):
    spec = P(("o", "g"))

    def f(x):
        for _ in range(k):
            x = body(x)
        return x

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.device_put(jnp.ones((DEVICES * shape[0], *shape[1:]), jnp.float32), NamedSharding(mesh, spec))
    return fn, x


def slope(mesh, body, shape, k0: int = 1, k1: int = 129) -> float:
    t0 = cpu_seconds(*chain(mesh, body, k0, shape))
    t1 = cpu_seconds(*chain(mesh, body, k1, shape))
    return (t1 - t0) / (k1 - k0)


HOPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}
HOPS["collective_permute"] = lambda n: 1


def collective(kind: str, n: int):
    if kind == "all_reduce":
        return lambda x: jax.lax.psum(x, "g") * 0.5
    if kind == "all_gather":  # gather n chunks, keep one: the shape stays
        return lambda x: jax.lax.all_gather(x, "g", tiled=True)[: x.shape[0]] * 0.5
    if kind == "reduce_scatter":  # scatter a tiled copy back to the shape
        return lambda x: jax.lax.psum_scatter(jnp.tile(x, (n,)), "g", tiled=True) * 0.5
    perm = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, "g", perm) * 0.5


def main() -> int:
    start = time.perf_counter()
    mesh8 = mesh_for(DEVICES)
    w = jnp.eye(8, dtype=jnp.float32) * 0.5
    op = slope(mesh8, lambda x: x @ w, (8, 8))
    print(f"op overhead: {op * 1e6:.2f} us per kernel per device", flush=True)

    samples = []
    for kind in HOPS:
        for n in (2, 4, 8):
            t = slope(mesh_for(n), collective(kind, n), (8,), k1=65) - op
            samples.append({"kind": kind, "n": n, "seconds": t, "hops": HOPS[kind](n)})
            print(f"{kind} over {n}: {t * 1e6:.2f} us per collective per device", flush=True)
    a = np.array([[1.0, s["hops"]] for s in samples])
    y = np.array([s["seconds"] for s in samples])
    (alpha, alpha_hop), *_ = np.linalg.lstsq(a, y, rcond=None)
    alpha_hop = max(float(alpha_hop), 0.0)
    print(f"alpha {alpha * 1e6:.2f} us + {alpha_hop * 1e6:.2f} us per hop", flush=True)

    big = 1 << 18  # 1 MiB of fp32 per device
    t_big = slope(mesh8, collective("all_reduce", DEVICES), (big,), k1=9) - op
    ring = 2 * 4 * big * (DEVICES - 1) / DEVICES
    small = samples[[i for i, s in enumerate(samples) if s["kind"] == "all_reduce" and s["n"] == DEVICES][0]]
    link = ring / max(t_big - small["seconds"], 1e-9)
    print(f"all-reduce of 1 MiB: {t_big * 1e3:.2f} ms per device: {link / 1e9:.2f} GB/s of ring bytes", flush=True)

    x = jnp.ones((256, 256), jnp.float32) / 256
    t_dot = cpu_seconds(*chain(mesh8, lambda v: v @ x, 8, (256, 256))) - 8 * op
    flops = 8 * 2 * 256**3 / t_dot
    print(f"dots: {flops / 1e9:.1f} GFLOP per CPU second per device", flush=True)
    n_stream = 1 << 21
    t_stream = cpu_seconds(*chain(mesh8, lambda v: v * 1.0001 + 1.0, 1, (n_stream,))) - op
    stream = 2 * 4 * n_stream / t_stream
    print(f"stream: {stream / 1e9:.1f} GB per CPU second per device", flush=True)

    out = {
        "what": "per simulated CPU device, in CPU seconds of the process / 8 devices (calibrate_cpu.py)",
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "op_overhead_s": op,
        "collective_latency_s": float(alpha),
        "hop_latency_s": alpha_hop,
        "link_bytes_per_s": link,
        "flops_per_s": flops,
        "bytes_per_s": stream,
        "samples": samples,
        "seconds": time.perf_counter() - start,
    }
    with open(os.path.join(HERE, "cpu_calibration.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
