"""Decode latency (TPOT) and throughput under a mixed prefill/decode load: prefill-first vs
decode-first vs chunked prefill at several chunk sizes (Sarathi-Serve's claim), with each paged
attention kernel side by side.

    python experiments/chunked_prefill/run.py     # ~14 min on 2 CPU cores; writes results.json
    python experiments/chunked_prefill/run.py --kernels per_row   # the 2026-11-25 run's setting (~3 min)

The model is configs/tiny.py (random weights: timing only) served by jaxsys.serve.engine on one CPU
device. The trace (jaxsys.serve.bench.make_trace): 48 requests, Poisson at 12 per second, prompts
of 64-448 tokens and 16-48 output tokens, so long prefills keep arriving while earlier requests
decode. Every policy has the same token budget (512 per step) and page pool; only the packing
differs. Each engine compiles all its row buckets before the clock starts. The figures are this
CPU's; the comparison between policies, in one run, is the result.

Kernels (--kernels), run one after another for each policy, in a rotating order:
  per_row       ragged=False: every row attends alone with the one-query paged kernel (the kernel
                of the 2026-11-25 run, results_2026-11-25.json);
  ragged        ragged=True, the engine's default: steps where a sequence has several rows (prefill
                chunks) use the ragged kernel (kernels/paged_attention/ragged.py); decode-only steps
                keep the one-query kernel. In results.json this row is the engine as it was when
                measured, with one ragged sequence slot per row (the README's finding);
  ragged_slots  the ragged kernel's sequence slots sized min(row bucket, max_seqs): measured with
                an Engine subclass, since adopted by Engine.tables, so a rerun of `ragged` or
                `ragged_slots` now runs the same engine.
On CPU the Pallas kernels run in interpret mode: the times say what this machine does, not what a
GPU would. Every request's greedy tokens are compared with the per_row engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

RUNS = [
    ("prefill_first", 512),
    ("decode_first", 512),
    ("chunked", 256),
    ("chunked", 128),
    ("chunked", 64),
    ("chunked", 32),
]
KERNELS = ("per_row", "ragged", "ragged_slots")


def engine_class(kernel: str):
    """Every kernel runs jaxsys's Engine (`ragged` and `ragged_slots` are the same engine now)."""
    from jaxsys.serve import engine

    del kernel
    return engine.Engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"some of {','.join(KERNELS)}")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if not set(kernels) <= set(KERNELS):
        parser.error(f"--kernels: choose from {KERNELS}")

    import jax

    from jaxsys import train
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh
    from jaxsys.serve import bench

    cpu_unless_accelerator()
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    params = program.init().params
    trace = bench.make_trace(48, 12.0, (64, 448), (16, 48), seed=0)
    rows = []
    for i, (policy, chunk) in enumerate(RUNS):
        order = kernels[i % len(kernels) :] + kernels[: i % len(kernels)]
        tokens = {}
        for kernel in order:
            eng = engine_class(kernel)(
                program,
                params,
                num_pages=2048,
                page_size=16,
                token_budget=512,
                chunk_size=chunk,
                max_seqs=32,
                policy=policy,
                ragged=kernel != "per_row",
            )
            eng.warmup()
            r = bench.replay(eng, trace, seed=0, vocab=config.model.vocab_size)
            r.update(policy=policy, chunk_size=chunk if policy == "chunked" else None, kernel=kernel)
            tokens[kernel] = {req.id: list(req.generated) for req in eng.finished}
            rows.append(r)
            print(
                f"{policy:>13} chunk {chunk:>4} {kernel:>12}: TPOT p50 {r['tpot_s']['p50'] * 1e3:6.1f} ms p99 "
                f"{r['tpot_s']['p99'] * 1e3:6.1f} ms | TTFT p50 {r['ttft_s']['p50'] * 1e3:7.1f} ms p99 "
                f"{r['ttft_s']['p99'] * 1e3:7.1f} ms | {r['throughput_tokens_per_s']:6.1f} tokens/s | "
                f"step p50 {r['step_s']['p50'] * 1e3:6.1f} ms, {r['steps']} steps",
                flush=True,
            )
        base = tokens.get("per_row")
        for r in rows[-len(order) :]:
            if base is not None:
                mine = tokens[r["kernel"]]
                r["same_tokens_as_per_row"] = sum(mine[k] == base[k] for k in base) / len(base)
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "trace": trace, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
