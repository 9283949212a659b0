"""Replay a request trace against the serving engine in-process and report throughput, TTFT and
TPOT (the replay: jaxsys/serve/bench.py).

    python -m jaxsys.bench_serve --workdir W [--requests 64 --rate 8 --prompt-len 16:256
        --output-len 8:64 --seed 0] [--trace trace.jsonl] [--prompts FILE] [--policy chunked --chunk-size 64
        --token-budget 256 --pages 256 --page-size 16 --max-seqs 16 (default: config.serve)] [--json]
        [--config.key=value ...]
    python -m jaxsys.bench_serve --config configs/tiny.py ...     # random weights: timing only

Arrivals are Poisson at `--rate` requests per second, prompt and output lengths uniform over
`lo:hi` token ranges, or a JSONL `--trace`. Prompts are random token ids, or with `--prompts FILE`
text prompts (one a line; request i takes prompt i mod their number) through the model's tokenizer
(jaxsys/tokenizer.py), for a model that has one. On CPU the figures describe this machine; compare
policies within one run.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.config import ConfigError, parse_with_overrides


def _host_gap_both(program, params, args, rounds: int = 3) -> int:
    """The host gap of the engine with overlapped scheduling off and on (config.serve.overlap), in
    one process: the two engines measured in turn, `rounds` times; medians side by side."""
    import numpy as np

    from jaxsys.serve import bench
    from jaxsys.serve.engine import Engine

    engines = {overlap: Engine.from_config(program, params, overlap=overlap) for overlap in (False, True)}
    for eng in engines.values():
        eng.warmup()
    runs: dict = {False: [], True: []}
    for _ in range(rounds):
        for overlap, eng in engines.items():
            # rounds of 5 steps: an overlapped engine's step needs the one before it in flight
            runs[overlap].append(bench.host_gap(eng, args.host_gap, steps=5, rounds=max(1, args.host_gap_rounds // 5)))
    result = {
        ("overlap" if overlap else "sync"): {
            key: float(np.median([r[key] for r in rs]))
            for key in ("engine_step_s", "compiled_step_s", "host_gap_ratio")
        }
        | {"host_gap_ratios": [r["host_gap_ratio"] for r in rs]}
        for overlap, rs in runs.items()
    }
    if args.json:
        print(json.dumps(result))
        return 0
    for name, r in result.items():
        print(
            f"{args.host_gap} decoding sequences, {name:>7}: engine step {r['engine_step_s'] * 1e3:.2f} ms, compiled "
            f"step {r['compiled_step_s'] * 1e3:.2f} ms, host-gap ratio {r['host_gap_ratio']:.2f} (median of "
            + ", ".join(f"{x:.2f}" for x in r["host_gap_ratios"])
            + ")"
        )
    return 0


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
    parser.add_argument(
        "--lengths",
        choices=["uniform", "sharegpt"],
        default="uniform",
        help="sharegpt: lognormal lengths of ShareGPT's shape, within the ranges",
    )
    parser.add_argument("--length-scale", type=float, default=1.0, help="scales the sharegpt lengths")
    parser.add_argument(
        "--host-gap",
        type=int,
        metavar="N",
        default=0,
        help="instead: N decoding sequences, engine step vs its compiled function back to back",
    )
    parser.add_argument(
        "--overlap-both",
        action="store_true",
        help="with --host-gap: engines with serve.overlap off and on, measured in turn (3 rounds), side by side",
    )
    parser.add_argument(
        "--host-gap-rounds",
        type=int,
        default=100,
        metavar="R",
        help="with --host-gap: R engine steps, each followed by a compiled call (--overlap-both: R / 5 "
        "rounds of 5 and 5); the median of the paired ratios",
    )
    parser.add_argument("--trace", help="JSONL trace instead of the generated one")
    parser.add_argument("--prompts", metavar="FILE", help="text prompts, one a line, instead of random ids")
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
    from jaxsys import tokenizer as tokenizer_lib
    from jaxsys.mesh import cpu_unless_accelerator
    from jaxsys.serve import bench, build_engine

    cpu_unless_accelerator()
    try:
        trace = (
            bench.read_trace(args.trace)
            if args.trace
            else bench.make_trace(
                args.requests,
                args.rate,
                _range(args.prompt_len, "prompt-len"),
                _range(args.output_len, "output-len"),
                args.seed,
                args.lengths,
                args.length_scale,
            )
        )
        prompts = None
        if args.workdir:
            from jaxsys.checkpoint import load
            from jaxsys.serve.runner import check_servable

            if args.prompts:  # before the weights are read
                saved, _ = checkpoint_lib.saved_config(args.workdir, overrides)
                tok = tokenizer_lib.for_config(saved, args.workdir)
                prompts = tokenizer_lib.read_prompts(tok, args.prompts, args.workdir)
            program, params, config = load(args.workdir, overrides, check=check_servable)
        else:
            import math

            import jax

            from jaxsys import program as program_lib
            from jaxsys.config import load_config, resolve_mesh
            from jaxsys.mesh import make_mesh

            config = load_config(args.config, overrides)
            if args.prompts:
                prompts = tokenizer_lib.read_prompts(tokenizer_lib.for_config(config), args.prompts, args.config)
            resolve_mesh(config, len(jax.devices()))  # a -1 axis (configs/llama_1b.py's fsdp) takes the devices
            n = math.prod(config.mesh[a] for a in config.mesh)
            program = program_lib.build(config, make_mesh(config, jax.devices()[:n]))
            params = program.init().params
        if prompts:
            trace = bench.with_prompts(trace, prompts)
        if args.host_gap and args.overlap_both:
            return _host_gap_both(program, params, args)
        eng = build_engine(program, params)  # config.serve: disaggregated, speculative, the cache
        eng.warmup()  # compile every row bucket before the clock starts
        if args.host_gap:
            result = bench.host_gap(eng, args.host_gap, rounds=args.host_gap_rounds)
            print(
                json.dumps(result)
                if args.json
                else (
                    f"{args.host_gap} decoding sequences: engine step {result['engine_step_s'] * 1e3:.2f} ms, "
                    f"compiled step {result['compiled_step_s'] * 1e3:.2f} ms, host-gap ratio {result['host_gap_ratio']:.2f}"
                    f" (median of {len(result['round_ratios'])} paired ratios)"
                )
            )
            return 0
        result = bench.replay(eng, trace, args.seed, config.model.vocab_size, prompts)
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
            f"TTFT {ms(result['ttft_s'])}; TPOT {ms(result['tpot_s'])}; prefix-cache hit rate "
            f"{result['prefix_cache_hit_rate']:.0%}, {result['preemptions']} preemptions"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
