"""Sweep launch configurations of a kernel on this device and store the winners in the tuning cache.

    python -m jaxsys.kernels.tune --kernel flash_attention            # a GPU; writes kernels/tuning_cache/<device>.json
    python -m jaxsys.kernels.tune --kernel quantized_matmul --out my_h100.json
    python -m jaxsys.kernels.tune --kernel flash_attention_mgpu --seq-lens 4096,16384   # a Hopper GPU
    python -m jaxsys.kernels.tune --kernel flash_attention --interpret --smoke --out /tmp/smoke.json   # any machine

For each listed shape (one per shape class of kernels/tuning.py) the candidates are swept in stages,
each stage varying some keys with the best of the earlier stages fixed:

  flash_attention   1. forward tiles (block_q, block_k), timed on the forward;
                    2. backward tiles (block_q_bwd, block_k_bwd), timed on forward + backward;
                    3. Triton's num_warps, num_stages (shared by the three kernels), forward + backward.
  quantized_matmul  1. tiles (block_m, block_n, and block_k for W8A16 / W8A8);  2. num_warps, num_stages.
  flash_attention_mgpu  the Hopper (Mosaic GPU) kernels' backward, fused or split, timed on forward +
                    backward at H = 64 / 128 (a Hopper GPU; kernels/flash_attention/kernel_mgpu.py).

Every candidate's output (and for attention the gradients) is compared with the pure-JAX reference
before it is timed; a candidate that fails to compile or is off by more than the tolerance is
dropped. Timing as in kernels/flash_attention/bench.py (median of --repeats samples after warm-up).
The winners are merged into --out (default: this device's file in the package's tuning_cache/):
entries of other shape classes are kept, those swept here replaced. A file written for another
device kind is refused.

Without a GPU the sweep refuses to run, except with --interpret --smoke: tiny shapes in Pallas
interpret mode and two candidates per kernel, to test this code path (its timings mean nothing and
its file is keyed by the CPU's device kind). docs/kernels_tuning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.kernels import platforms, tuning
from jaxsys.kernels.flash_attention import flash_attention, kernel_mgpu, reference_attention
from jaxsys.kernels.flash_attention.bench import median_seconds
from jaxsys.kernels.quantized_matmul import kernel as qkernel
from jaxsys.kernels.quantized_matmul import reference as qref

FLASH_TOL = 2.0**-6  # bf16 attention against an fp32 reference (the tolerance of the GPU checks)
QUANT_TOL = 2.0**-7


@dataclasses.dataclass
class Problem:
    """One shape to tune: its shape class, a description, and how to build, check and time a candidate."""

    kernel: str
    shape_class: tuple
    shape: dict  # the concrete shape measured, recorded with the entry
    stages: list  # [(metric name, [partial configs])]
    build: Callable  # (config, metric) -> (jitted fn, inputs)
    error: Callable  # (outputs, metric) -> max relative error against the reference
    tolerance: float


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _grid(**axes) -> list[dict]:
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]


# ----------------------------------------------------------------------------------------------
# flash attention


def flash_stages(h: int, smoke: bool = False) -> list:
    """[(metric, candidates)] of the flash sweep at head dim h."""
    if smoke:
        return [("fwd_bwd", [dict(block_q=16, block_k=16), dict(block_q=32, block_k=16)])]
    # At H > 64 the kernel caps block_k at 64 (shared memory), so larger key tiles are not tried.
    ks = [32, 64] if h > 64 else [32, 64, 128]
    qs = [64, 128]
    return [
        ("fwd", _grid(block_q=qs, block_k=ks)),
        ("fwd_bwd", _grid(block_q_bwd=qs, block_k_bwd=ks)),
        ("fwd_bwd", _grid(num_warps=[4, 8], num_stages=[1, 2, 3])),
    ]


def mgpu_stages() -> list:
    """The Hopper kernels' one choice: the fused backward (dQ by TMA reduce-add) or the split one."""
    return [("fwd_bwd", [dict(backward=b) for b in tuning.MGPU_BACKWARDS])]


def flash_problem(
    t: int, h: int, causal: bool, args, *, dtype=jnp.bfloat16, smoke: bool = False, mgpu: bool = False
) -> Problem:
    """The generic kernel's tiles, or with `mgpu` the Hopper kernels' backward variant."""
    b, n = (1, 2) if smoke else (max(1, args.tokens // t), max(1, args.hidden // h))
    key = jax.random.split(jax.random.PRNGKey(t * 1000 + h + int(causal)), 4)
    q = jax.random.normal(key[0], (b, t, n, h), dtype)
    k = jax.random.normal(key[1], (b, t, n, h), dtype)  # K = N: head 0's dk/dv depend on query head 0 only
    v = jax.random.normal(key[2], (b, t, n, h), dtype)
    w = jax.random.normal(key[3], (b, t, n, h), dtype)
    interpret = True if args.interpret else None

    backend = "mosaic_gpu" if mgpu else None

    def attn(q, k, v):
        return flash_attention(q, k, v, causal=causal, return_lse=True, interpret=interpret, backend=backend)

    def fwd(q, k, v):
        return attn(q, k, v)

    def fwd_bwd(q, k, v, w):
        (o, _), vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp((w.astype(o.dtype), jnp.zeros((b, n, t), jnp.float32))))

    # The reference on batch row 0, head 0 only (its [T, S] scores fit at long T), in fp32.
    one = lambda x: x[:1, :, :1].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref_o, ref_lse = jax.jit(lambda q, k, v: reference_attention(q, k, v, causal=causal, return_lse=True))(
            one(q), one(k), one(v)
        )
        _, ref_vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=causal), one(q), one(k), one(v))
        ref_grads = ref_vjp(one(w))

    def build(config, metric):
        # a new function per candidate: jit caches traces by function, and the config is read when tracing
        if metric == "fwd":
            return jax.jit(lambda q, k, v: fwd(q, k, v)), (q, k, v)
        return jax.jit(lambda q, k, v, w: fwd_bwd(q, k, v, w)), (q, k, v, w)

    def error(out, metric):
        if metric == "fwd":
            o, lse = out
            return max(_rel_err(one(o), ref_o), _rel_err(lse[:1, :1], ref_lse))
        return max(_rel_err(one(got), want) for got, want in zip(out, (ref_o, *ref_grads)))

    return Problem(
        kernel="flash_attention_mgpu" if mgpu else "flash_attention",
        shape_class=tuning.flash_attention_class(head_dim=h, dtype=dtype, causal=causal, seq_len=t),
        shape=dict(B=b, T=t, N=n, K=n, H=h, causal=causal, dtype=jnp.dtype(dtype).name),
        stages=mgpu_stages() if mgpu else flash_stages(h, smoke),
        build=build,
        error=error,
        tolerance=FLASH_TOL,
    )


def flash_problems(args):
    """The problems one at a time (each holds its operands and reference on the device). The Hopper
    kernels' choice exists at H = 64 / 128 only (H = 256 has the split backward alone)."""
    mgpu = args.kernel == "flash_attention_mgpu"
    if args.smoke:  # the Mosaic kernels take bf16 / fp16 and T a multiple of 128
        yield flash_problem(
            128 if mgpu else 32,
            64 if mgpu else 16,
            True,
            args,
            dtype=jnp.bfloat16 if mgpu else jnp.float32,
            smoke=True,
            mgpu=mgpu,
        )
        return
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for h in args.head_dims:
        if mgpu and h not in (64, 128):
            print(f"flash_attention_mgpu: H = {h} has one backward (split): nothing to choose", flush=True)
            continue
        for t in args.seq_lens:
            for c in causals:
                yield flash_problem(t, h, c, args, mgpu=mgpu)


# ----------------------------------------------------------------------------------------------
# quantized matmul (its public functions' block_m / block_n / block_k / num_warps / num_stages)


def _quant_operands(kind, m, k, n, group, copies, key):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    weights = []
    for kk in jax.random.split(kw, copies):
        kq, ks = jax.random.split(kk)
        if kind in ("w4a16", "w4ax"):  # random bytes are valid codes in the kernel layout
            packed = jax.random.bits(kq, (k // 2, n), jnp.uint8)
            weights.append((packed, jax.random.uniform(ks, (k // group, n), jnp.float32, 1e-3, 1e-2)))
        else:
            q = jax.random.randint(kq, (k, n), -127, 128, jnp.int32).astype(jnp.int8)
            weights.append((q, jax.random.uniform(ks, (n,), jnp.float32, 1e-4, 1e-3)))
    data = qref.quantize_per_token(x) if kind in ("w8a8", "w4ax") else (x,)  # w4ax: W4A8's per-token codes
    return data, weights


def _quant_call(kind, config, interpret):
    common = dict(config, interpret=True if interpret else False, backend="generic")
    if kind == "w8a16":
        return lambda data, w: qkernel.matmul_w8a16(data[0], *w, **common)
    if kind == "w4a16":
        return lambda data, w: qkernel.matmul_w4a16(data[0], *w, **common)
    if kind == "w4ax":
        return lambda data, w: qkernel.matmul_w4ax(*data, *w, None, jnp.bfloat16, **common)
    return lambda data, w: qkernel.matmul_w8a8(*data, *w, jnp.bfloat16, **common)


def _quant_reference(kind, group):
    if kind == "w8a16":
        return lambda data, w: qref.matmul_w8a16(data[0], *w)
    if kind == "w4a16":
        return lambda data, w: qref.matmul_w4a16(data[0], qref.unrepack_w4(w[0], group), w[1])
    if kind == "w4ax":
        return lambda data, w: qref.matmul_w4ax(*data, qref.unrepack_w4(w[0], group), w[1], None, jnp.bfloat16)
    return lambda data, w: qref.matmul_w8a8(*data, *w, jnp.bfloat16)


def quant_stages(kind: str, m: int, smoke: bool = False) -> list:
    """[(metric, candidates)] of the quantized-matmul sweep for one format and M."""
    if smoke:
        extra = {} if kind in ("w4a16", "w4ax") else dict(block_k=32)
        return [("call", [dict(block_m=16, block_n=16, **extra), dict(block_m=16, block_n=32, **extra)])]
    tiles = dict(block_m=[b for b in (16, 32, 64, 128) if b <= max(16, tuning.pow2_bucket(m))])
    tiles["block_n"] = [32, 64, 128, 256]
    if kind not in ("w4a16", "w4ax"):  # the 4-bit kernels step one quantization group at a time: no block_k
        tiles["block_k"] = [64, 128, 256]
    return [("call", _grid(**tiles)), ("call", _grid(num_warps=[2, 4, 8], num_stages=[2, 3, 4]))]


def quant_problem(kind, m, k, n, args, *, smoke: bool = False) -> Problem:
    group = args.group_size if kind in ("w4a16", "w4ax") else None
    weight_bytes = k * n // (2 if kind in ("w4a16", "w4ax") else 1)
    # enough weight copies per timed program that they come from HBM, not from the L2
    copies = 1 if smoke else int(min(16, max(2, math.ceil(2 * args.l2_mib * 2**20 / weight_bytes))))
    data, weights = _quant_operands(kind, m, k, n, group, copies, jax.random.PRNGKey(m + k + n))
    want = np.asarray(jax.jit(_quant_reference(kind, group))(data, weights[0]), np.float32)

    def build(config, metric):
        fn = _quant_call(kind, config, args.interpret)
        many = jax.jit(lambda d, ws: [fn(*lax.optimization_barrier((d, w))) for w in ws])  # new per candidate
        return many, (data, weights)

    def error(out, metric):
        return _rel_err(out[0], want)

    return Problem(
        kernel="quantized_matmul",
        shape_class=tuning.quantized_matmul_class(kind=kind, m=m, k=k, n=n, group_size=group),
        shape=dict(kind=kind, M=m, K=k, N=n, group=group or 0, weight_copies=copies),
        stages=quant_stages(kind, m, smoke),
        build=build,
        error=error,
        tolerance=QUANT_TOL,
    )


def quant_problems(args):
    """The problems one at a time (each holds its weight copies on the device)."""
    if args.smoke:
        args.group_size = 32
        for kind in args.formats:
            yield quant_problem(kind, 4, 64, 64, args, smoke=True)
        return
    for kind in args.formats:
        for k, n in args.layers:
            for m in args.batches:
                yield quant_problem(kind, m, k, n, args)


# ----------------------------------------------------------------------------------------------
# the sweep


def sweep(problem: Problem, args, log=print) -> dict | None:
    """The winning entry of one problem (config, metric, time, counts), or None if no candidate passed."""
    best: dict = {}
    best_seconds, metric = None, None
    tried = dropped = 0
    for metric, candidates in problem.stages:
        results = []
        for partial in candidates:
            config = {**best, **partial}
            tried += 1
            label = ", ".join(f"{k}={v}" for k, v in config.items())
            try:
                with tuning.use_config(problem.kernel, config):
                    # traced (so the config is read) inside the block, then only run
                    fn, inputs = problem.build(config, metric)
                    out = jax.block_until_ready(fn(*inputs))
                err = problem.error(out, metric)
                if not err <= problem.tolerance:
                    dropped += 1
                    log(f"  drop {label}: error {err:.2e} > {problem.tolerance:.2e}")
                    continue
                seconds = median_seconds(fn, inputs, args.repeats, args.min_time)
            except Exception as e:  # a candidate that does not compile (e.g. shared memory) is dropped
                dropped += 1
                log(f"  drop {label}: {platforms.error_line(e, 200)}")
                continue
            log(f"  {metric} {seconds * 1e3:9.4f} ms  err {err:.1e}  {label}")
            results.append((seconds, config))
        if not results:
            return None
        best_seconds, best = min(results, key=lambda r: r[0])
    return dict(
        config=best,
        metric=f"{metric} time, median of {args.repeats}",
        time_ms=best_seconds * 1e3,
        shape=problem.shape,
        candidates=tried,
        dropped=dropped,
    )


def merge(path: str, device_kind: str, kernel: str, entries: dict, header: dict) -> dict:
    """The cache file at `path` with `entries` (shape key -> entry) set under `kernel`."""
    if os.path.exists(path):
        data = tuning.read_file(path)
        if data.get("device_kind") != device_kind:
            raise ValueError(f"{path} holds entries for {data.get('device_kind')!r}, not this {device_kind!r}")
    else:
        data = dict(format=tuning.FORMAT_VERSION, device_kind=device_kind, header={}, kernels={})
    data["header"] = header
    data["kernels"].setdefault(kernel, {}).update(entries)
    return data


def write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    layers = lambda s: [tuple(int(d) for d in x.split("x")) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", required=True, choices=tuning.KERNELS)
    p.add_argument("--out", default=None, help="cache file to merge into (default: this device's in the package)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (only with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two candidates: tests the code path")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timing sample")
    p.add_argument("--seq-lens", type=ints, default=[1024, 4096, 16384], help="flash_attention: T")
    p.add_argument("--head-dims", type=ints, default=[64, 128], help="flash_attention: H")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="flash_attention")
    p.add_argument("--tokens", type=int, default=16384, help="flash_attention: B = tokens / T")
    p.add_argument("--hidden", type=int, default=2048, help="flash_attention: N = hidden / H")
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(tuning.QUANTIZED_KINDS))
    p.add_argument("--batches", type=ints, default=[1, 16, 128], help="quantized_matmul: M")
    p.add_argument("--layers", type=layers, default=[(4096, 4096), (4096, 11008), (11008, 4096)], help="KxN,...")
    p.add_argument("--group-size", type=int, default=128, help="quantized_matmul: W4A16 group")
    p.add_argument("--l2-mib", type=float, default=50.0, help="the GPU's L2 (weights cycled past it)")
    return p.parse_args(argv)


def refusal(args, backend: str) -> str | None:
    """Why this run must not happen, or None."""
    if args.interpret and not args.smoke:
        return "--interpret is only for --smoke: interpret-mode timings say nothing about a GPU"
    if backend != "gpu" and not (args.interpret and args.smoke):
        return (
            f"the sweep times kernels on a GPU; this machine's backend is {backend!r}. "
            "Use --interpret --smoke (tiny shapes, interpret mode) to test the code path here"
        )
    if args.smoke and args.out is None:
        return "--smoke needs --out: its entries must not go into the shipped cache"
    if args.kernel == "quantized_matmul" and any(f not in tuning.QUANTIZED_KINDS for f in args.formats):
        return f"--formats must be among {tuning.QUANTIZED_KINDS}; got {args.formats}"
    if args.kernel == "flash_attention_mgpu" and not args.interpret:
        capability = kernel_mgpu.gpu_capability()
        if capability is None or capability[0] != 9:
            return f"flash_attention_mgpu tunes the Hopper kernels; this GPU's compute capability is {capability}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    why = refusal(args, jax.default_backend())
    if why:
        print(f"jaxsys.kernels.tune: refusing: {why}", file=sys.stderr)
        return 2
    device_kind = tuning.current_device_kind()
    out = args.out or os.path.join(tuning.CACHE_DIR, tuning.device_file_name(device_kind) + ".json")
    if args.smoke:
        args.repeats, args.min_time = 1, 0.0
    command = "python -m jaxsys.kernels.tune " + " ".join(sys.argv[1:] if argv is None else argv)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = dict(jax=jax.__version__, date=now, command=command, device_kind=device_kind)
    if args.smoke:
        header["note"] = "smoke run: tiny shapes, interpret mode; the timings mean nothing"
    try:
        merge(out, device_kind, args.kernel, {}, header)  # refuse a foreign or malformed file before sweeping
    except (OSError, ValueError) as e:
        print(f"jaxsys.kernels.tune: refusing: {e}", file=sys.stderr)
        return 2
    problems = quant_problems(args) if args.kernel == "quantized_matmul" else flash_problems(args)
    entries, count = {}, 0
    for problem in problems:
        count += 1
        print(f"{problem.kernel} {tuning.shape_key(problem.shape_class)}  shape {problem.shape}", flush=True)
        entry = sweep(problem, args)
        if entry is None:
            print("  no candidate passed: nothing stored for this shape class", flush=True)
            continue
        entry |= dict(date=now, jax=jax.__version__, interpret=bool(args.interpret))
        key = tuning.shape_key(problem.shape_class)
        entries[key] = entry
        print(f"  winner {entry['config']}  {entry['time_ms']:.4f} ms", flush=True)
        write(out, merge(out, device_kind, args.kernel, {key: entry}, header))  # after each: a crash keeps them
    tuning.clear_cache()
    print(f"wrote {len(entries)} of {count} shape classes to {out}")
    return 0 if entries or not count else 1


if __name__ == "__main__":
    sys.exit(main())
