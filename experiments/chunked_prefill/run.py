"""Decode latency (TPOT) and throughput under a mixed prefill/decode load: prefill-first vs
decode-first vs chunked prefill at several chunk sizes (Sarathi-Serve's claim).

    python experiments/chunked_prefill/run.py     # ~3 min on 2 CPU cores; writes results.json

The model is configs/tiny.py (random weights: timing only) served by jaxsys.serve.engine on one CPU
device. The trace (jaxsys.serve.bench.make_trace): 48 requests, Poisson at 12 per second, prompts
of 64-448 tokens and 16-48 output tokens, so long prefills keep arriving while earlier requests
decode. Every policy has the same token budget (512 per step) and page pool; only the packing
differs. Each engine compiles all its row buckets before the clock starts. The figures are this
CPU's; the comparison between policies, in one run, is the result.
"""

from __future__ import annotations

import json
import os
import sys

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


def main() -> int:
    import jax

    from jaxsys import train
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh
    from jaxsys.serve import bench, engine

    cpu_unless_accelerator()
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    params = program.init().params
    trace = bench.make_trace(48, 12.0, (64, 448), (16, 48), seed=0)
    rows = []
    for policy, chunk in RUNS:
        eng = engine.Engine(
            program,
            params,
            num_pages=2048,
            page_size=16,
            token_budget=512,
            chunk_size=chunk,
            max_seqs=32,
            policy=policy,
        )
        eng.warmup()
        r = bench.replay(eng, trace, seed=0, vocab=config.model.vocab_size)
        r.update(policy=policy, chunk_size=chunk if policy == "chunked" else None)
        rows.append(r)
        print(
            f"{policy:>13} chunk {chunk:>4}: TPOT p50 {r['tpot_s']['p50'] * 1e3:6.1f} ms p99 "
            f"{r['tpot_s']['p99'] * 1e3:6.1f} ms | TTFT p50 {r['ttft_s']['p50'] * 1e3:7.1f} ms p99 "
            f"{r['ttft_s']['p99'] * 1e3:7.1f} ms | {r['throughput_tokens_per_s']:6.1f} tokens/s",
            flush=True,
        )
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"trace": trace, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
