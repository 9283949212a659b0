"""Replay a request trace against the serving engine in-process and report throughput, TTFT and TPOT.

    python -m jaxsys.bench_serve --workdir W [--requests 64 --rate 8 --prompt-len 16:256
        --output-len 8:64 --seed 0] [--trace trace.jsonl] [--policy chunked --chunk-size 64
        --token-budget 256 --pages 256 --page-size 16 --max-seqs 16 (default: config.serve)] [--json]
        [--config.key=value ...]
    python -m jaxsys.bench_serve --config configs/tiny.py ...     # random weights: timing only

Arrivals are Poisson at `--rate` requests per second (exponential gaps from `--seed`), prompt and
output lengths uniform over `lo:hi` token ranges, or a JSONL trace with one {"arrival_s",
"prompt_len", "output_len"} per line. Prompts are token ids drawn from the vocabulary. The clock
is the wall clock: each engine step admits the requests that have arrived, and a request's tokens
are timed when the step that produced them returns. TTFT = first token - arrival; TPOT = (last
token - first token) / (tokens - 1); throughput = generated tokens / makespan. On CPU the figures
describe this machine; compare policies within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jaxsys.config import ConfigError, parse_with_overrides


def make_trace(n: int, rate: float, prompt_len: tuple, output_len: tuple, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n)) if rate > 0 else np.zeros(n)
    return [
        {
            "arrival_s": float(arrivals[i]),
            "prompt_len": int(rng.integers(prompt_len[0], prompt_len[1] + 1)),
            "output_len": int(rng.integers(output_len[0], output_len[1] + 1)),
        }
        for i in range(n)
    ]


def read_trace(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if not {"arrival_s", "prompt_len", "output_len"} <= set(row):
                raise ValueError(f"{path}:{i + 1}: each line needs arrival_s, prompt_len and output_len")
            out.append(row)
    return sorted(out, key=lambda r: r["arrival_s"])


def percentiles(values) -> dict:
    if not len(values):
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values, np.float64)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def replay(eng, trace: list[dict], seed: int = 0, vocab: int = 256) -> dict:
    """Run `trace` through `eng` (a jaxsys.serve.engine.Engine) on the wall clock."""
    rng = np.random.default_rng(seed + 1)
    pending = list(enumerate(trace))
    arrival, times = {}, {}
    eng.step_times = []
    start = time.perf_counter()
    while pending or not eng.idle:
        now = time.perf_counter() - start
        while pending and pending[0][1]["arrival_s"] <= now:
            i, row = pending.pop(0)
            prompt = rng.integers(0, vocab, size=row["prompt_len"]).tolist()
            eng.submit(i, prompt, row["output_len"])
            arrival[i] = row["arrival_s"]
            times[i] = []
        if eng.idle:  # nothing to do until the next arrival
            time.sleep(max(pending[0][1]["arrival_s"] - now, 0.0))
            continue
        t0 = time.perf_counter()
        _, sampled = eng.step()
        t1 = time.perf_counter()
        eng.step_times.append(t1 - t0)
        for rid, out in sampled.items():  # a speculative decode emits several tokens at once
            times[rid].extend([t1 - start] * (len(out) if isinstance(out, list) else 1))
    makespan = time.perf_counter() - start
    ttft = [times[i][0] - arrival[i] for i in times]
    tpot = [(times[i][-1] - times[i][0]) / (len(times[i]) - 1) for i in times if len(times[i]) > 1]
    generated = sum(len(t) for t in times.values())
    return {
        "requests": len(times),
        "generated_tokens": generated,
        "makespan_s": makespan,
        "throughput_tokens_per_s": generated / makespan,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "steps": len(eng.step_times),
        "step_s": percentiles(eng.step_times),
    }


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        first, _, last = text.partition(":")
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"--{name} {text!r}: give a token range lo:hi (or one number)") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"--{name} {text!r}: need 1 <= lo <= hi")
    return lo, hi


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="serve this checkpoint")
    source.add_argument("--config", help="or a config with random weights (timing only)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--prompt-len", default="16:256")
    parser.add_argument("--output-len", default="8:64")
    parser.add_argument("--trace", help="JSONL trace instead of the generated one")
    parser.add_argument("--seed", type=int, default=0)
    # the engine's settings: config.serve, unless given here
    parser.add_argument("--policy", choices=["chunked", "prefill_first", "decode_first"])
    parser.add_argument("--chunk-size", type=int)
    parser.add_argument("--token-budget", type=int)
    parser.add_argument("--pages", type=int)
    parser.add_argument("--page-size", type=int)
    parser.add_argument("--max-seqs", type=int)
    parser.add_argument("--json", action="store_true")
    args, overrides = parse_with_overrides(parser, argv, "--config.mesh.tensor=2")
    flags = {
        "policy": args.policy,
        "chunk_size": args.chunk_size,
        "token_budget": args.token_budget,
        "pages": args.pages,
        "page_size": args.page_size,
        "max_seqs": args.max_seqs,
    }
    overrides = overrides + [f"--config.serve.{k}={v}" for k, v in flags.items() if v is not None]
    from jaxsys import checkpoint as checkpoint_lib
    from jaxsys import data as data_lib
    from jaxsys.mesh import cpu_unless_accelerator
    from jaxsys.serve import spec_engine

    cpu_unless_accelerator()
    try:
        trace = (
            read_trace(args.trace)
            if args.trace
            else make_trace(
                args.requests,
                args.rate,
                _range(args.prompt_len, "prompt-len"),
                _range(args.output_len, "output-len"),
                args.seed,
            )
        )
        if args.workdir:
            from jaxsys import generate

            program, params, config = generate.load_program(args.workdir, overrides)
        else:
            import math

            import jax

            from jaxsys import program as program_lib
            from jaxsys.config import load_config, resolve_mesh
            from jaxsys.mesh import make_mesh

            config = load_config(args.config, overrides)
            resolve_mesh(config, len(jax.devices()))  # a -1 axis (configs/llama_1b.py's fsdp) takes the devices
            n = math.prod(config.mesh[a] for a in config.mesh)
            program = program_lib.build(config, make_mesh(config, jax.devices()[:n]))
            params = program.init().params
        if config.serve.disaggregate:  # prefill and decode on two sub-meshes (serve/disagg.py)
            from jaxsys.serve import disagg

            eng = disagg.DisaggregatedEngine.from_config(config, params)
        else:
            eng = spec_engine.engine_from_config(program, params)  # speculative when config.serve.spec_k >= 1
        eng.warmup()  # compile every row bucket before the clock starts
        result = replay(eng, trace, args.seed, config.model.vocab_size)
    except (ValueError, ConfigError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sv = config.serve
    result.update(policy=sv.policy, chunk_size=sv.chunk_size, token_budget=sv.token_budget)
    if args.json:
        print(json.dumps(result))
    else:
        ms = lambda d: f"p50 {d['p50'] * 1e3:.1f} ms, p99 {d['p99'] * 1e3:.1f} ms" if d["p50"] is not None else "-"
        print(
            f"{result['requests']} requests, {result['generated_tokens']} tokens in {result['makespan_s']:.2f}s "
            f"({result['throughput_tokens_per_s']:.1f} tokens/s, {result['steps']} steps); "
            f"TTFT {ms(result['ttft_s'])}; TPOT {ms(result['tpot_s'])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
