"""Tokens/s of the Pallas linear-attention kernel vs the pure-JAX chunked form (XLA), bf16.

On a GPU or a TPU (one command, from the repository root; `linear_attention` picks the Triton
kernel on a GPU and the Mosaic variant of kernel_tpu.py on a TPU):

    python -m jaxsys.kernels.linear_attention.bench --out /tmp/linear_attention_bench.json

For each T and head dim it times forward (o and final_state) and forward+backward (grads of q, k,
v), with B = max(1, tokens // T) so every row processes about the same number of tokens. Reported:
median over --repeats after --warmup calls, each call ended by block_until_ready. "TFLOP/s" uses the
chunked-algorithm model count per token and head, forward 2C(H + Hv) + 4 H Hv (the causal half of
the C x C blocks is not skipped) and backward 2x forward; it is a model figure, not a counter.

On CPU there is nothing to measure: the script says so and exits 0. `--interpret-smoke` runs one tiny
shape in Pallas interpret mode to check that the script itself works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxsys.kernels import platforms
from jaxsys.kernels.linear_attention import chunked, linear_attention


def _time(fn, args, warmup, repeats):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _flops_per_token_head(c, h, hv):
    return 2 * c * (h + hv) + 4 * h * hv


def bench_one(*, b, t, n, h, chunk_size, decay, dtype, warmup, repeats, interpret):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(kq, (b, t, n, h), jnp.float32) * h**-0.5).astype(dtype)
    k = (jax.random.normal(kk, (b, t, n, h), jnp.float32) * h**-0.5).astype(dtype)
    v = jax.random.normal(kv, (b, t, n, h), jnp.float32).astype(dtype)
    ld = jnp.log(1.0 - 2.0 ** (-5.0 - jnp.arange(n, dtype=jnp.float32))) if decay else None

    impls = {
        "pallas": lambda q, k, v: linear_attention(q, k, v, log_decay=ld, chunk_size=chunk_size, interpret=interpret),
        "xla_chunked": lambda q, k, v: chunked(q, k, v, log_decay=ld, chunk_size=chunk_size),
    }
    row = dict(B=b, T=t, N=n, H=h, chunk_size=chunk_size, decay=decay, dtype=jnp.dtype(dtype).name)
    outs = {}
    for name, f in impls.items():
        fwd = jax.jit(f)
        fwd_bwd = jax.jit(
            jax.value_and_grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)[0].astype(jnp.float32)), argnums=(0, 1, 2))
        )
        outs[name] = fwd(q, k, v)[0]
        row[f"{name}_fwd_s"] = _time(fwd, (q, k, v), warmup, repeats)
        row[f"{name}_fwdbwd_s"] = _time(fwd_bwd, (q, k, v), warmup, repeats)
    tokens = b * t
    fl = _flops_per_token_head(chunk_size, h, h) * tokens * n
    for name in impls:
        row[f"{name}_fwd_tok_s"] = tokens / row[f"{name}_fwd_s"]
        row[f"{name}_fwdbwd_tok_s"] = tokens / row[f"{name}_fwdbwd_s"]
        row[f"{name}_fwd_tflops"] = fl / row[f"{name}_fwd_s"] / 1e12
        row[f"{name}_fwdbwd_tflops"] = 3 * fl / row[f"{name}_fwdbwd_s"] / 1e12
    diff = jnp.abs(outs["pallas"].astype(jnp.float32) - outs["xla_chunked"].astype(jnp.float32))
    row["max_abs_diff_o"] = float(jnp.max(diff))
    return row


def _table(rows):
    head = (
        "| T | B | H | pallas fwd tok/s | xla fwd tok/s | fwd speed-up | pallas fwd+bwd tok/s "
        "| xla fwd+bwd tok/s | fwd+bwd speed-up | pallas fwd TFLOP/s | max abs diff o |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['B']} | {r['H']} | {r['pallas_fwd_tok_s']:.3g} | "
            f"{r['xla_chunked_fwd_tok_s']:.3g} | "
            f"{r['xla_chunked_fwd_s'] / r['pallas_fwd_s']:.2f}x | "
            f"{r['pallas_fwdbwd_tok_s']:.3g} | {r['xla_chunked_fwdbwd_tok_s']:.3g} | "
            f"{r['xla_chunked_fwdbwd_s'] / r['pallas_fwdbwd_s']:.2f}x | "
            f"{r['pallas_fwd_tflops']:.3g} | {r['max_abs_diff_o']:.2g} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="1024,4096,16384,32768")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32768, help="B = max(1, tokens // T)")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--no-decay", action="store_true", help="gamma = 1 (default: per-head decay)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="write the rows and the environment as JSON here")
    p.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="on CPU: run one tiny shape in Pallas interpret mode (checks the script)",
    )
    args = p.parse_args(argv)

    backend = jax.default_backend()
    interpret = False
    if args.interpret_smoke:
        interpret = backend == "cpu"
        configs = [dict(t=64, h=16)]
        args.heads, args.tokens, args.chunk_size = 2, 64, 16
        args.warmup, args.repeats = 1, 2
    elif backend not in ("gpu", "tpu"):
        print(
            f"bench.py measures the Pallas kernel on a GPU or TPU; the backend here is "
            f"'{backend}', so there is nothing to measure. Run it on a GPU or TPU, or pass "
            "--interpret-smoke to check that the script works."
        )
        return 0
    else:
        configs = [dict(t=int(t), h=int(h)) for h in args.head_dims.split(",") for t in args.seq_lens.split(",")]

    rows = []
    for cfg in configs:
        rows.append(
            bench_one(
                b=max(1, args.tokens // cfg["t"]),
                t=cfg["t"],
                n=args.heads,
                h=cfg["h"],
                chunk_size=args.chunk_size,
                decay=not args.no_decay,
                dtype=jnp.bfloat16,
                warmup=args.warmup,
                repeats=args.repeats,
                interpret=interpret,
            )
        )
    device = jax.devices()[0]
    print(
        f"linear attention, bf16, N={args.heads}, C={args.chunk_size}, decay={not args.no_decay}, "
        f"device={device.device_kind}, interpret={interpret}, jax {jax.__version__}\n"
    )
    print(_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            record = platforms.bench_record(
                "jaxsys.kernels.linear_attention.bench", argv, interpret=interpret, rows=rows
            )
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
