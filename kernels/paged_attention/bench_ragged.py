"""Ragged paged attention against the per-row decode kernel on one mixed serving step.

    python -m jaxsys.kernels.paged_attention.bench_ragged --traffic-only   # any machine (CPU)
    python -m jaxsys.kernels.paged_attention.bench_ragged                  # + GPU timings on a GPU

The step (default): 32 decodes at kv_len 1024 and two prefill chunks of 256 queries, a prompt's
first (positions 0..255) and a later one (positions 768..1023); N = 32 query heads, K = 8 kv heads,
H = 128, bf16, pages of 16 tokens.

Traffic (no device needed): the KV bytes each kernel loads, counted from the offsets. The per-row
decode kernel (kernel.py, as the engine calls it today: one row per query token, length position
+ 1) reads ceil((p + 1) / page_size) pages of every kv head for the query at position p; the ragged
kernel reads, per work item (block_q queries of one sequence), ceil((last position + 1) /
page_size) pages of every kv head. A page of one kv head is page_size * H elements of K and as
many of V. These are the bytes the kernels request; on a GPU the rows of one chunk run
concurrently and may hit in L2, so DRAM traffic can be lower than the per-row count (that is what
the timings measure). The q / o bytes are counted too: the ragged wrapper gathers q into W static
item tiles of block_q rows (W = ragged.num_items) and scatters o back from them; the per-row kernel
reads q and writes o once.

Timings (GPU only): both kernels jitted with interpret=False (Triton), each compiled and run twice,
then the median of --repeats samples of back-to-back calls; the ragged time includes its schedule,
gather and scatter; the per-row call gets its [T, max_pages] row tables and lengths precomputed.
The two outputs are compared (max abs difference printed). Without a GPU the timing part says so;
--interpret-smoke runs a tiny step in Pallas interpret mode to check the script instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.kernels.paged_attention import kernel, ragged


def mixed_step(decodes: int = 32, decode_ctx: int = 1024, chunk: int = 256, chunk_starts=(0, 768)):
    """(q_lens, kv_lens) of the step: `decodes` decodes at kv_len decode_ctx, then one chunk of
    `chunk` queries starting at each of chunk_starts."""
    q_lens = [1] * decodes + [chunk] * len(chunk_starts)
    kv_lens = [decode_ctx] * decodes + [start + chunk for start in chunk_starts]
    return q_lens, kv_lens


def kv_traffic(q_lens, kv_lens, *, page_size: int, block_q: int, kv_heads: int, head_dim: int, itemsize: int) -> dict:
    """Pages (per kv head) and KV bytes (K and V, all kv heads) each kernel reads for the step."""
    per_row = ragged_pages = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        first = kv_len - q_len
        per_row += sum(-(-(p + 1) // page_size) for p in range(first, kv_len))
        for j in range(-(-q_len // block_q)):
            last = first + min((j + 1) * block_q, q_len) - 1
            ragged_pages += -(-(last + 1) // page_size)
    page_bytes = 2 * kv_heads * page_size * head_dim * itemsize
    return {
        "per_row_pages": per_row,
        "ragged_pages": ragged_pages,
        "per_row_bytes": per_row * page_bytes,
        "ragged_bytes": ragged_pages * page_bytes,
        "ratio": per_row / ragged_pages,
    }


def qo_bytes(num_tokens: int, num_seqs: int, block_q: int, heads: int, head_dim: int, itemsize: int) -> dict:
    """q and o bytes moved: per row, read q and write o once; ragged, additionally the W * block_q
    row tiles written by the gather and read by the kernel, and written by the kernel and read by
    the scatter."""
    row = heads * head_dim * itemsize
    tiles = ragged.num_items(num_tokens, num_seqs, block_q) * block_q
    return {"per_row_qo_bytes": 2 * num_tokens * row, "ragged_qo_bytes": (2 * num_tokens + 4 * tiles) * row}


def traffic_table(args) -> str:
    q_lens, kv_lens = mixed_step(args.decodes, args.decode_ctx, args.chunk, args.chunk_starts)
    itemsize = jnp.dtype(args.dtype).itemsize
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = [
        f"step: {args.decodes} decodes at kv_len {args.decode_ctx} + chunks of {args.chunk} at positions "
        f"{list(args.chunk_starts)}; T = {sum(q_lens)} query rows, {len(q_lens)} sequences; page_size "
        f"{args.page_size}, K = {args.kv_heads}, H = {args.head_dim}, N = {args.heads}, {args.dtype}",
        "",
        "| block_q | pages read per kv head: per row | ragged | KV MiB: per row | ragged | KV ratio "
        "| q/o MiB: per row | ragged | (KV + q/o) ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bq in args.block_qs:
        t = kv_traffic(
            q_lens,
            kv_lens,
            page_size=args.page_size,
            block_q=bq,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            itemsize=itemsize,
        )
        qo = qo_bytes(sum(q_lens), len(q_lens), bq, args.heads, args.head_dim, itemsize)
        lines.append(
            f"| {bq} | {t['per_row_pages']} | {t['ragged_pages']} | {mib(t['per_row_bytes'])} "
            f"| {mib(t['ragged_bytes'])} | {t['ratio']:.2f} | {mib(qo['per_row_qo_bytes'])} "
            f"| {mib(qo['ragged_qo_bytes'])} "
            f"| {(t['per_row_bytes'] + qo['per_row_qo_bytes']) / (t['ragged_bytes'] + qo['ragged_qo_bytes']):.2f} |"
        )
    return "\n".join(lines)


def make_step(args, seed: int = 0):
    """Random pools and the step's ragged inputs, plus the per-row decode kernel's row tables and
    lengths for the same queries."""
    q_lens, kv_lens = mixed_step(args.decodes, args.decode_ctx, args.chunk, args.chunk_starts)
    ps = args.page_size
    s = len(q_lens)
    pages = [-(-kv // ps) for kv in kv_lens]
    max_pages = max(pages)
    rng = np.random.default_rng(seed)
    pool = sum(pages) + 1
    ids = rng.permutation(pool)
    table = np.zeros((s, max_pages), np.int32)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = ids[at : at + n]
        at += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (t, args.heads, args.head_dim), dtype)
    kp = jax.random.normal(keys[1], (pool, ps, args.kv_heads, args.head_dim), dtype)
    vp = jax.random.normal(keys[2], (pool, ps, args.kv_heads, args.head_dim), dtype)
    rag = (q, kp, vp, jnp.asarray(table), jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.int32(s))
    seq = np.repeat(np.arange(s), q_lens)
    pos = np.concatenate([np.arange(kv - ql, kv) for ql, kv in zip(q_lens, kv_lens)])
    per_row = (q, kp, vp, jnp.asarray(table[seq]), jnp.asarray(pos + 1, jnp.int32))
    return rag, per_row


def median_seconds(fn, inputs, repeats: int, min_time: float) -> float:
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


def timings(args, interpret: bool) -> str:
    rag, per_row = make_step(args)
    lines = ["| block_q | per-row ms | ragged ms | per-row / ragged | max abs diff |", "|---:|---:|---:|---:|---:|"]
    row_fn = jax.jit(lambda *a: kernel.paged_attention(*a, interpret=interpret))
    row_s = median_seconds(row_fn, per_row, args.repeats, args.min_time)
    want = row_fn(*per_row)
    for bq in args.block_qs:
        fn = jax.jit(lambda *a, bq=bq: ragged.ragged_paged_attention(*a, block_q=bq, interpret=interpret))
        rag_s = median_seconds(fn, rag, args.repeats, args.min_time)
        diff = float(jnp.max(jnp.abs(fn(*rag).astype(jnp.float32) - want.astype(jnp.float32))))
        lines.append(f"| {bq} | {row_s * 1e3:.3f} | {rag_s * 1e3:.3f} | {row_s / rag_s:.2f} | {diff:.1e} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=32)
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunk-starts", type=ints, default=[0, 768])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-qs", type=ints, default=[8, 16, 32, 64, 128])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timing sample")
    p.add_argument("--traffic-only", action="store_true", help="only the KV traffic analysis (no kernels run)")
    p.add_argument(
        "--interpret-smoke", action="store_true", help="no GPU needed: time a tiny step in Pallas interpret mode"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print("KV traffic of one step (pages and bytes the kernels load)\n")
    print(traffic_table(args))
    if args.traffic_only:
        return 0
    backend = jax.default_backend()
    if args.interpret_smoke:
        args.decodes, args.decode_ctx, args.chunk, args.chunk_starts = 2, 24, 12, [0, 8]
        args.page_size, args.heads, args.kv_heads, args.head_dim = 8, 4, 2, 16
        args.block_qs, args.repeats, args.min_time = [4, 16], 1, 0.0
        print(f"\ninterpret-mode smoke run on {backend} (not a measurement)\n")
        print(timings(args, interpret=True))
        return 0
    if backend != "gpu":
        print(
            f"\nGPU timings: the default JAX backend here is {backend!r}, so nothing was timed. Run this "
            "on a GPU machine, or pass --interpret-smoke to check the script in Pallas interpret mode."
        )
        return 0
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, Triton kernels, median of {args.repeats}\n")
    print(timings(args, interpret=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
