"""Replaying a request trace against a serving engine on the wall clock (`python -m
jaxsys.bench_serve` is its command; docs/serving.md).

Arrivals are Poisson at a rate (exponential gaps from a seed), prompt and output lengths uniform
over token ranges, or a JSONL trace with one {"arrival_s", "prompt_len", "output_len"} per line.
Prompts are token ids drawn from the vocabulary, or given (`bench_serve --prompts FILE`: text
prompts through the model's tokenizer). Each engine step admits the requests that have
arrived, and a request's tokens are timed when the step that produced them returns. TTFT = first
token - arrival; TPOT = (last token - first token) / (tokens - 1); throughput = generated tokens /
makespan.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

# ShareGPT-like lengths, in tokens (no download): lognormal fits of the shape of vLLM's ShareGPT
# benchmark (prompts median ~150, outputs median ~200, both with long tails), clipped to [4, 1024];
# `scale` shrinks both for small models (e.g. 0.25 on CPU). A shape, not the dataset.
SHAREGPT = {"prompt": (5.0, 1.0), "output": (5.3, 0.9)}  # (mean, sigma) of log length


def make_trace(
    n: int, rate: float, prompt_len: tuple, output_len: tuple, seed: int, lengths: str = "uniform", scale: float = 1.0
) -> list[dict]:
    """`n` requests with Poisson arrivals at `rate` per second (0: all at once); lengths uniform over
    the `prompt_len` / `output_len` ranges, or "sharegpt" (SHAREGPT's lognormals x `scale`, within
    the same ranges)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n)) if rate > 0 else np.zeros(n)

    def draw(kind: str, bounds: tuple) -> int:
        if lengths == "sharegpt":
            mu, sigma = SHAREGPT[kind]
            value = int(round(float(np.exp(rng.normal(mu, sigma))) * scale))
            return int(np.clip(value, bounds[0], bounds[1]))
        return int(rng.integers(bounds[0], bounds[1] + 1))

    return [
        {
            "arrival_s": float(arrivals[i]),
            "prompt_len": draw("prompt", prompt_len),
            "output_len": draw("output", output_len),
        }
        for i in range(n)
    ]


def engine_counters(eng) -> dict:
    """What the engine's pools and schedulers counted: prefix-cache pages found / looked for and
    preemptions (an Engine; zeros for engines without them)."""
    pools = getattr(eng, "pools", [])
    schedulers = getattr(eng, "schedulers", [])
    hits, queries = sum(p.hits for p in pools), sum(p.queries for p in pools)
    return {
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_pages_hit": hits,
        "preemptions": sum(s.preemptions for s in schedulers),
    }


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


def with_prompts(trace: list[dict], prompts: list[list[int]]) -> list[dict]:
    """The trace with given prompts (request i takes prompt i mod len(prompts)) and their lengths."""
    return [{**row, "prompt_len": len(prompts[i % len(prompts)])} for i, row in enumerate(trace)]


def replay(eng, trace: list[dict], seed: int = 0, vocab: int = 256, prompts: list[list[int]] | None = None) -> dict:
    """Run `trace` through `eng` (any serve.engine.EngineAPI) on the wall clock. Prompts are random
    ids of `vocab`, or request i takes `prompts[i % len(prompts)]` (`with_prompts`)."""
    rng = np.random.default_rng(seed + 1)
    pending = list(enumerate(trace))
    arrival, times = {}, {}
    step_times = []
    start = time.perf_counter()
    while pending or not eng.idle:
        now = time.perf_counter() - start
        while pending and pending[0][1]["arrival_s"] <= now:
            i, row = pending.pop(0)
            if prompts:
                prompt = list(prompts[i % len(prompts)])
            else:
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
        step_times.append(t1 - t0)
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
        "steps": len(step_times),
        "step_s": percentiles(step_times),
        **engine_counters(eng),
    }


def host_gap(eng, sequences: int = 64, prompt_len: int = 32, steps: int = 1, seed: int = 0, rounds: int = 100) -> dict:
    """How much of a decode step the host adds: `sequences` requests decoding together, the wall
    time of `eng.step()` against the step's compiled function (the runner) called back to back on
    the inputs of one engine step, captured (their tables already on the device), in one run.
    `rounds` rounds of `steps` engine steps then `steps` compiled calls, interleaved so that other
    load on the machine falls on both alike: per round the ratio of the medians (with steps=1, each
    engine step against the compiled call right after it), and their median. An overlapped engine
    needs steps > 1 (each round's first step finds no step in flight). `eng` is an idle, warmed-up
    Engine with room for them (max_seqs, pages)."""
    import jax

    if rounds < 1 or steps < 1:
        raise ValueError(f"host_gap: rounds={rounds} and steps={steps} must be >= 1 (--host-gap-rounds)")
    rng = np.random.default_rng(seed)
    vocab = eng.program.config.model.vocab_size
    for i in range(sequences):
        eng.submit(("host_gap", i), rng.integers(0, vocab, size=prompt_len).tolist(), (rounds + 1) * steps + 64)
    while any(not r.decoding for s in eng.schedulers for r in s.running) or any(s.waiting for s in eng.schedulers):
        eng.step()  # prefill them all
    for _ in range(3):
        eng.step()
    runner, captured = eng.runner, {}

    def capture(params, ids, positions, view):  # the step's inputs, its (donated) tables copied
        fields = {f: jax.numpy.copy(getattr(view, f)) for f in view.row_fields if getattr(view, f) is not None}
        captured.update(ids=ids, positions=positions, tables=fields)
        return runner(params, ids, positions, view)

    eng.runner = capture
    try:
        eng.step()
    finally:
        eng.runner = runner
    tables = captured["tables"]
    engine_s, device_s, ratios = [], [], []
    for _ in range(rounds):
        engine_r, device_r = [], []
        for _ in range(steps):
            start = time.perf_counter()
            eng.step()
            engine_r.append(time.perf_counter() - start)
        jax.block_until_ready(eng.cache)
        cache = dataclasses.replace(eng.cache, **tables)
        for _ in range(steps):  # the step returns the (donated) cache with its tables: the same inputs again
            start = time.perf_counter()
            logits, cache = runner(eng.params, captured["ids"], captured["positions"], cache)
            jax.block_until_ready(logits)
            device_r.append(time.perf_counter() - start)
        tables = {f: getattr(cache, f) for f in tables}
        eng.cache = eng.without_tables(cache)  # the calls rewrote the captured step's slots with the same values
        engine_s += engine_r
        device_s += device_r
        ratios.append(float(np.median(engine_r) / np.median(device_r)))
    for i in range(sequences):
        eng.abort(("host_gap", i))
    while not eng.idle:  # overlap: the step in flight
        eng.step()
    return {
        "sequences": sequences,
        "engine_step_s": float(np.median(engine_s)),
        "compiled_step_s": float(np.median(device_s)),
        "host_gap_ratio": float(np.median(ratios)),
        "round_ratios": ratios,
    }
