"""Flash-attention throughput on one GPU: this Pallas kernel, cuDNN and the XLA reference.

    python -m jaxsys.kernels.flash_attention.bench --out flash_attention_gpu.json

Measures TFLOP/s of the forward and of forward+backward, causal and full, bf16, for sequence
lengths 1K..32K and head dims 64 and 128, all in one run on the same device, for:

  pallas  jaxsys.kernels.flash_attention.flash_attention(backend="generic") (Triton on GPU)
  mosaic  flash_attention(backend="mosaic_gpu"): the Hopper kernels (kernel_mgpu.py), forward and
          backward (H = 64 / 128 / 256; at 64 / 128 the fused backward, dQ added by TMA
          reduce-add from the dK/dV kernel); only on compute capability 9.x for supported shapes
          (else skipped, with the reason)
  mosaic_split  the same with the split backward at H = 64 / 128 (a dQ kernel beside dK/dV,
          kernel_mgpu.backward_variant("split")): which of the two to keep is this column's question
  cudnn   jax.nn.dot_product_attention(..., implementation="cudnn")
  tokamax tokamax.dot_product_attention(..., implementation="mosaic"): tokamax's Mosaic GPU kernel,
          a vendor-grade Pallas baseline (needs the `tokamax` package and a GPU; else skipped)
  xla     jaxsys.kernels.flash_attention.reference_attention (the materialised [B, N, T, S] scores;
          skipped where those scores alone would pass --xla-max-gib)

Shapes keep the work per step fixed, as the FlashAttention papers do: B = tokens / T (at least 1),
N = hidden / H query heads, K = N / --group kv heads.

Correctness beside every speed: fwd_err is max |o - o_ref| and fwd_bwd_err the largest of
max |dX - dX_ref| over dq, dk, dv (cotangent do), against reference_attention in fp32 on the same
inputs, computed on batch 0 and the query heads of kv head 0 (an exact sub-problem: same T, S, H,
causal, and the same kernel code on a smaller grid) so that the fp32 reference fits in memory.
max|o_ref| and max|dX_ref| are stored with them to read the errors against. Ratio columns give
each implementation's speed over cuDNN's on the same shape.

FLOP convention: forward 4 * B * N * T * S * H (two matmuls of 2 * T * S * H per head), halved
when causal; backward 2.5x the forward (five matmuls against two), so forward+backward counts
3.5x the forward. Recomputation inside the backward is not counted: the figure is useful work.

Timing: each function is jitted, compiled and run twice before timing; then each of --repeats
samples runs the function enough times back to back to take >= --min-time seconds, ending with
jax.block_until_ready, and the median time per call is reported.

--window W benchmarks sliding-window attention (causal only) and --softcap C Gemma 2's logit
soft-capping (scores C * tanh(s / C)); the implementations without them (Mosaic GPU and tokamax
without either, cuDNN without a soft-cap) are skipped, with the reason, and the "x cuDNN" ratios
are then "-". The xla baseline and the correctness checks use the reference with the same options.

Rows run shortest sequence first (every head dim at T = 4K before 16K) and --out is rewritten after
each row, so a run cut by a time limit keeps what it measured; `--table OUT.json` prints its table.

On a machine without a GPU the script says so and exits 0; with --interpret-smoke it instead runs
one tiny shape in Pallas interpret mode (pallas and xla only) to check that the script works.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention import flash_attention, kernel_mgpu, reference_attention

IMPLS = ("pallas", "mosaic", "mosaic_split", "cudnn", "tokamax", "xla")


def flops(b, n, t, s, h, causal: bool, backward: bool, window: int | None = None) -> float:
    """Useful FLOPs of attention by the convention in the module docstring; with a sliding window
    W < T the visible pairs, T W - W (W - 1) / 2, in place of T S / 2."""
    pairs = t * s * (0.5 if causal else 1.0)
    if window is not None and window < t:
        pairs = t * window - window * (window - 1) / 2
    forward = 4.0 * b * n * pairs * h
    return forward * (3.5 if backward else 1.0)


def attention_fn(impl: str, causal: bool, args):
    """q, k, v -> o for one implementation (with args.window: sliding-window attention; with
    args.softcap: logit soft-capping)."""
    window, softcap = args.window, args.softcap
    if impl in ("pallas", "mosaic", "mosaic_split"):
        return lambda q, k, v: flash_attention(
            q,
            k,
            v,
            causal=causal,
            block_q=args.block_q,
            block_k=args.block_k,
            block_q_bwd=args.block_q_bwd,
            block_k_bwd=args.block_k_bwd,
            interpret=args.interpret_smoke or None,
            backend="generic" if impl == "pallas" else "mosaic_gpu",
            window=window,
            softcap=softcap,
        )
    if impl == "cudnn":
        local = None if window is None else (window - 1, 0)
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn", local_window_size=local
        )
    if impl == "tokamax":
        import tokamax

        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")
    if impl == "xla":
        return lambda q, k, v: reference_attention(q, k, v, causal=causal, window=window, softcap=softcap)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def median_seconds(fn, inputs, repeats: int, min_time: float) -> float:
    """Median wall time of one call of the jitted fn, after compile and warm-up."""
    for _ in range(2):
        jax.block_until_ready(fn(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    once = time.perf_counter() - start
    calls = max(1, min(1000, int(min_time / max(once, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*inputs)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def errors(attn, causal, q, k, v, do, window=None, softcap=None):
    """Max abs errors of o and of (dq, dk, dv) against the fp32 reference, and the reference's
    max abs values, on batch 0 and the query heads of kv head 0 (module docstring)."""
    g = q.shape[2] // k.shape[2]
    qs, ks, vs, dos = q[:1, :, :g], k[:1, :, :1], v[:1, :, :1], do[:1, :, :g]
    f32 = lambda x: x.astype(jnp.float32)
    want_o, want_vjp = jax.vjp(
        lambda *a: reference_attention(*a, causal=causal, window=window, softcap=softcap), f32(qs), f32(ks), f32(vs)
    )
    want_g = want_vjp(f32(dos))
    got_o, got_vjp = jax.vjp(attn, qs, ks, vs)
    got_g = got_vjp(dos)
    amax = lambda x: float(jnp.max(jnp.abs(x)))
    return dict(
        fwd_err=amax(f32(got_o) - want_o),
        fwd_ref_max=amax(want_o),
        fwd_bwd_err=max(amax(f32(a) - b) for a, b in zip(got_g, want_g)),
        fwd_bwd_ref_max=max(amax(b) for b in want_g),
    )


def measure(impl, t, h, causal, args):
    """One row: forward and forward+backward times, TFLOP/s and errors (or why it was skipped)."""
    b, n = max(1, args.tokens // t), args.hidden // h
    kh = n // args.group
    row = dict(
        impl=impl,
        T=t,
        S=t,
        H=h,
        B=b,
        N=n,
        K=kh,
        causal=causal,
        dtype=args.dtype,
        window=args.window,
        softcap=args.softcap,
    )
    if args.window is not None and (impl.startswith("mosaic") or impl == "tokamax"):
        return row | dict(skipped=f"{impl} has no sliding window here")
    if args.softcap and impl != "pallas" and impl != "xla":  # n/a: no soft-cap in those kernels here
        return row | dict(skipped=f"{impl} has no logit soft-capping here")
    if impl in ("cudnn", "tokamax") and jax.default_backend() != "gpu":
        return row | dict(skipped=f"{impl} needs a GPU")
    if impl == "tokamax" and importlib.util.find_spec("tokamax") is None:
        return row | dict(skipped="tokamax is not installed (benchmarks/gpu_wheels.sh)")
    if impl.startswith("mosaic") and not args.interpret_smoke:
        why = kernel_mgpu.why_not(
            kernel_mgpu.gpu_capability(), t, t, h, args.dtype, causal=causal, scale=h**-0.5, has_segments=False
        )
        if why is not None:
            return row | dict(skipped=f"Mosaic GPU kernel: {why}")
    scores_gib = 4.0 * b * n * t * t / 2**30
    if impl == "xla" and scores_gib > args.xla_max_gib:
        return row | dict(skipped=f"[B, N, T, S] fp32 scores would take {scores_gib:.0f} GiB")
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, t, kh, h), dtype)
    v = jax.random.normal(keys[2], (b, t, kh, h), dtype)
    do = jax.random.normal(keys[3], (b, t, n, h), dtype)
    attn = attention_fn(impl, causal, args)
    forward = jax.jit(attn)
    forward_backward = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    # the backward variant is read when the functions trace, at their first call
    variant = kernel_mgpu.backward_variant("split" if impl == "mosaic_split" else "fused")
    try:
        with variant:
            fwd_s = median_seconds(forward, (q, k, v), args.repeats, args.min_time)
            row |= dict(fwd_ms=fwd_s * 1e3, fwd_tflops=flops(b, n, t, t, h, causal, False, args.window) / fwd_s / 1e12)
            bwd_s = median_seconds(forward_backward, (q, k, v, do), args.repeats, args.min_time)
            row |= dict(
                fwd_bwd_ms=bwd_s * 1e3, fwd_bwd_tflops=flops(b, n, t, t, h, causal, True, args.window) / bwd_s / 1e12
            )
            sub_gib = 4.0 * (n // kh) * t * t / 2**30  # the reference's scores on the sub-problem
            if sub_gib <= args.xla_max_gib:
                row |= errors(attn, causal, q, k, v, do, args.window, args.softcap)
            else:
                row["err_skipped"] = f"reference scores would take {sub_gib:.0f} GiB"
    except Exception as e:  # one failing configuration must not lose the others
        row["error"] = platforms.error_line(e)
    return row


def markdown(rows) -> str:
    """One line per row; "x cuDNN" is this row's TFLOP/s over cuDNN's on the same shape."""
    cudnn = {(r["T"], r["H"], r["causal"]): r for r in rows if r["impl"] == "cudnn"}
    lines = [
        "| T | H | B | N | K | causal | impl | fwd ms | fwd TFLOP/s | fwd x cuDNN | fwd err (max ref) "
        "| fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd x cuDNN | fwd+bwd err (max ref) | note |",
        "|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|---|---|",
    ]
    fmt = lambda r, key, spec: format(r[key], spec) if key in r else "-"

    def ratio(r, key):
        base = cudnn.get((r["T"], r["H"], r["causal"]), {})
        return f"{r[key] / base[key]:.2f}" if key in r and base.get(key) else "-"

    def err(r, key):
        return f"{r[key]:.1e} ({r[key.replace('err', 'ref_max')]:.1f})" if key in r else "-"

    for r in rows:
        note = r.get("skipped") or r.get("error") or r.get("err_skipped") or ""
        lines.append(
            f"| {r['T']} | {r['H']} | {r['B']} | {r['N']} | {r['K']} | {r['causal']} | {r['impl']} "
            f"| {fmt(r, 'fwd_ms', '.3f')} | {fmt(r, 'fwd_tflops', '.1f')} | {ratio(r, 'fwd_tflops')} "
            f"| {err(r, 'fwd_err')} | {fmt(r, 'fwd_bwd_ms', '.3f')} | {fmt(r, 'fwd_bwd_tflops', '.1f')} "
            f"| {ratio(r, 'fwd_bwd_tflops')} | {err(r, 'fwd_bwd_err')} | {note} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=ints, default=[64, 128])
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding-window attention of W keys (causal only; cuDNN's local window)",
    )
    p.add_argument(
        "--softcap",
        type=float,
        default=None,
        help="Gemma 2's attention logit soft-capping: scores C * tanh(s / C) (pallas and xla only)",
    )
    p.add_argument("--tokens", type=int, default=16384, help="B * T")
    p.add_argument("--hidden", type=int, default=2048, help="N * H")
    p.add_argument("--group", type=int, default=1, help="query heads per kv head, N / K")
    p.add_argument("--dtype", default="bfloat16")
    # None: the tiles of the tuning cache for the shape on this device, else 128 (kernels/tuning.py)
    p.add_argument("--block-q", type=int, default=None)
    p.add_argument("--block-k", type=int, default=None)
    p.add_argument("--block-q-bwd", type=int, default=None)
    p.add_argument("--block-k-bwd", type=int, default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timing sample")
    p.add_argument("--xla-max-gib", type=float, default=8.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--table", default=None, help="print the table of a JSON written by --out (a cut run's too) and exit"
    )
    p.add_argument(
        "--interpret-smoke", action="store_true", help="no GPU needed: one tiny shape in Pallas interpret mode"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(f"{saved['device']} ({saved['backend']}), jax {saved['jax']}, {saved['date']}\n")
        print(markdown(saved["results"]))
        return 0
    backend = jax.default_backend()
    if args.interpret_smoke:
        # 128 queries: the Mosaic GPU kernel's smallest tile (two warpgroups of 64 rows)
        args.seq_lens, args.head_dims, args.tokens, args.hidden = [128], [64], 128, 128
        args.block_q = args.block_k = 32
        args.repeats, args.min_time = 1, 0.0
    elif backend != "gpu":
        print(
            f"bench.py measures GPU kernels; the default JAX backend here is {backend!r}, so "
            "nothing was measured. Run it on a GPU machine, or pass --interpret-smoke to check "
            "the script in Pallas interpret mode."
        )
        return 0
    device = jax.devices()[0]
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    if args.window is not None:
        causals = (True,)  # a window is causal
    record = platforms.bench_record(
        "jaxsys.kernels.flash_attention.bench",
        argv,
        numpy=np.__version__,
        flop_convention="fwd 4*B*N*T*S*H (x0.5 causal); fwd+bwd 3.5x fwd",
        interpret_smoke=args.interpret_smoke,
        args=vars(args),
        results=[],
    )
    # the shortest sequence first for every head dim, and --out rewritten after every row: a run
    # cut by a time limit keeps the rows it measured (T = 4K, the targets' shapes, before 16K)
    for t in args.seq_lens:
        for h in args.head_dims:
            for causal in causals:
                for impl in args.impls:
                    row = measure(impl, t, h, causal, args)
                    record["results"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(record, f, indent=1)
    print(
        f"\n{device.device_kind} ({backend}), jax {jax.__version__}, {args.dtype}; "
        "fwd+bwd FLOPs = 3.5x fwd, causal FLOPs halved"
        + (f"; sliding window of {args.window} keys (FLOPs of the visible pairs)" if args.window else "")
        + (f"; logit soft-cap {args.softcap:g} (its tanh not counted)" if args.softcap else "")
        + "\n"
    )
    print(markdown(record["results"]))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
