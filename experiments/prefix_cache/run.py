"""Prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention): TTFT and prefill
tokens saved vs the share of requests that begin with a common system prompt, and the hit rate vs
the pool's size.

    python experiments/prefix_cache/run.py            # ~15 min on 2 CPU cores; writes results.json
    python experiments/prefix_cache/run.py --quick    # one repeat, fewer requests (~3 min)
    python experiments/prefix_cache/run.py --replot   # tables and plot from results.json
    python experiments/prefix_cache/run.py --control  # the noise control alone: share 0%, off/on x 3 (~4 min)

The model is configs/tiny.py (random weights: timing only) served by jaxsys.serve.engine on one CPU
device. The trace (jaxsys.serve.bench.make_trace): 64 requests, Poisson at 4 per second, outputs of
16-48 tokens. Every prompt is a 384-token head (24 pages of 16) and a 32-128-token user part. For a
share s of the requests (the same requests at every s whose draw is below s, so the sets are
nested) the head is one common system prompt; for the others it is random tokens of their own. So
every prompt has the same length at every share and only what can be shared changes. Each trace
runs on two engines, prefix_cache False and True, otherwise equal (chunked prefill, 512-token
budget, 256-token chunks, 32 sequences, 1,024 pages: no request waits for a page), compiled before
the clock starts (`bench.replay`, as `jaxsys.bench_serve` does). Counted per step: the prefill
tokens the engine computed for prompts (a prefix recomputed after a preemption is counted apart);
saved = prompt tokens - computed. Hit rate (tokens) = saved / prompt
tokens; the engine's own counter (pages found / pages looked up at admission) is reported beside it.
The share sweep runs twice, each repeat the 8 runs in a row (off/on alternating which goes first);
the wall clock of this shared 2-core machine is noisy, and share 0% (identical work off and on) is
the control that shows how noisy; `--control` runs that control alone, three off/on pairs
(results_control.json). TTFT by class is timed from submission (the step boundary after
arrival) to the first token (added after the 2026-11-27 run: not in its results.json).

The pool sweep: share 60% with one system prompt, and a "multi-tenant" trace where 90% of requests
begin with one of 8 system prompts (chosen uniformly), on pools of 40-1,024 pages (prefix_cache
True): the hit rate, TTFT and preemptions as the pool shrinks. On CPU an engine step's time grows
with the pool (the compiled step copies every layer's pool; see README), so TTFT and TPOT across
pool sizes mix that cost in: the hit rate is the figure to read there.

The engines use the per-row paged kernel (ragged=False): on CPU the Pallas kernels run in interpret
mode, where the ragged kernel's step costs grow with the square of the row bucket
(experiments/chunked_prefill); the per-row kernel keeps a prefill token's cost close to its share of
the FLOPs, as on an accelerator.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import load_results, markdown_table, parse_args, save_results  # noqa: E402

SHARES = (0.0, 0.3, 0.6, 0.9)
RATE = 4.0  # requests per second: the engine keeps up (makespan ~17-20 s for arrivals over 16.5 s)
HEAD = 384  # tokens of the system prompt (or of a request's own head)
USER = (32, 128)
OUTPUT = (16, 48)
POOLS = (40, 64, 128, 256, 512, 1024)
SHARE_POOL = 1024  # pages in the share sweep: no request waits for a page, none is preempted
ENGINE = dict(page_size=16, token_budget=512, chunk_size=256, max_seqs=32, policy="chunked", ragged=False)


def prompts_for(trace, share: float, systems: int, seed: int, vocab: int) -> tuple[list, list]:
    """Each request's prompt: a head of HEAD tokens (one of `systems` system prompts for the
    requests whose draw is below `share`, else random tokens of its own) and a user part of
    USER tokens; and which requests share."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, size=(systems, HEAD))
    draw = rng.random(len(trace))  # nested: a request shared at share s is shared at every s' > s
    which = rng.integers(0, systems, size=len(trace))
    prompts, shared = [], []
    for i, _ in enumerate(trace):
        own = rng.integers(0, vocab, size=HEAD)  # drawn for every request: the user parts match across shares
        user = rng.integers(0, vocab, size=int(rng.integers(USER[0], USER[1] + 1)))
        head = system[which[i]] if draw[i] < share else own
        prompts.append([int(t) for t in np.concatenate([head, user])])
        shared.append(bool(draw[i] < share))
    return prompts, shared


def instrument(eng) -> dict:
    """Count, per engine step, the prefill tokens computed for prompts the first time and for
    prefixes recomputed after a preemption, and the most sequences in one step; time each
    request's submission and first token (for TTFT by class)."""
    import time

    counts: dict = {"prefill_tokens": 0, "recomputed_tokens": 0, "peak_running": 0, "submitted": {}, "first": {}}
    step, submit = eng.step, eng.submit

    def counted():
        work, sampled = step()
        now = time.perf_counter()
        for rid in sampled:
            counts["first"].setdefault(rid, now)
        for w in work:
            if w.kind == "prefill":
                first = w.request.prefix is w.request.prompt  # a preempted request's prefix is a new list
                counts["prefill_tokens" if first else "recomputed_tokens"] += w.tokens
        counts["peak_running"] = max(counts["peak_running"], len({id(w.request) for w in work}))
        return work, sampled

    def submitted(request_id, *args, **kwargs):
        counts["submitted"][request_id] = time.perf_counter()
        return submit(request_id, *args, **kwargs)

    eng.step, eng.submit = counted, submitted
    return counts


def one_run(program, params, trace, prompts, shared, prefix_cache: bool, num_pages: int, vocab: int) -> dict:
    import numpy as np

    from jaxsys.serve import bench, engine

    eng = engine.Engine(program, params, num_pages=num_pages, prefix_cache=prefix_cache, **ENGINE)
    eng.warmup()
    counts = instrument(eng)
    r = bench.replay(eng, trace, seed=0, vocab=vocab, prompts=prompts)
    prompt_tokens = sum(len(p) for p in prompts[: len(trace)])
    saved = prompt_tokens - counts["prefill_tokens"]
    r.update(
        prefix_cache=prefix_cache,
        num_pages=num_pages,
        prompt_tokens=prompt_tokens,
        prefill_tokens=counts["prefill_tokens"],
        saved_tokens=saved,
        recomputed_tokens=counts["recomputed_tokens"],
        token_hit_rate=saved / prompt_tokens,
        peak_running=counts["peak_running"],
    )
    # TTFT from submission (the step boundary after arrival) by class: sharing the system prompt or not
    ttft = {i: counts["first"][i] - counts["submitted"][i] for i in counts["first"]}
    for name, members in (("shared", [i for i in ttft if shared[i]]), ("unshared", [i for i in ttft if not shared[i]])):
        r[f"ttft_{name}_p50_s"] = float(np.median([ttft[i] for i in members])) if members else None
    return r


def say(tag: str, r: dict) -> None:
    print(
        f"{tag}: TTFT p50 {r['ttft_s']['p50'] * 1e3:7.1f} ms p99 {r['ttft_s']['p99'] * 1e3:7.1f} ms | TPOT p50 "
        f"{r['tpot_s']['p50'] * 1e3:6.1f} ms | prefill {r['prefill_tokens']:6d} of {r['prompt_tokens']} "
        f"(hit {r['token_hit_rate']:.1%}, engine counter {r['prefix_cache_hit_rate']:.1%}) | "
        f"{r['throughput_tokens_per_s']:6.1f} tok/s | {r['preemptions']} preemptions",
        flush=True,
    )


def model() -> tuple:
    """configs/tiny.py's program and random weights on one CPU device, and its vocabulary size."""
    import jax

    from jaxsys import train
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh

    cpu_unless_accelerator()
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    return program, program.init().params, config.model.vocab_size


def trace_of(n: int) -> list:
    from jaxsys.serve import bench

    return bench.make_trace(n, RATE, (HEAD + USER[0], HEAD + USER[1]), OUTPUT, seed=0)


def control(pairs: int = 3) -> dict:
    """Share 0% (no request shares anything: the same work with the cache off and on), `pairs`
    off/on pairs in a row, alternating which goes first: how far the wall-clock figures of
    identical runs move on this machine."""
    program, params, vocab = model()
    trace = trace_of(64)
    prompts, shared = prompts_for(trace, 0.0, 1, seed=1, vocab=vocab)
    rows = []
    for pair in range(pairs):
        for cache in (False, True) if pair % 2 == 0 else (True, False):
            r = one_run(program, params, trace, prompts, shared, cache, SHARE_POOL, vocab)
            r.update(share=0.0, pair=pair)
            rows.append(r)
            say(f"control pair {pair} prefix_cache {cache!s:>5}", r)
    return {"requests": len(trace), "rate": RATE, "engine": ENGINE, "rows": rows}


def control_table(res: dict) -> str:
    rows = [
        [
            r["pair"],
            str(r["prefix_cache"]),
            r["steps"],
            r["peak_running"],
            f"{r['ttft_s']['p50'] * 1e3:.0f}",
            f"{r['ttft_s']['p99'] * 1e3:.0f}",
            f"{r['tpot_s']['p50'] * 1e3:.0f}",
            f"{r['throughput_tokens_per_s']:.0f}",
        ]
        for r in res["rows"]
    ]
    header = ["pair", "prefix_cache", "steps", "peak sequences", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)"]
    return "\n".join(markdown_table(header + ["tokens/s"], "rlrrrrrr", rows))


def measure(quick: bool) -> dict:
    program, params, vocab = model()
    n, repeats = (32, 1) if quick else (64, 2)
    trace = trace_of(n)
    out: dict = {"requests": n, "rate": RATE, "head": HEAD, "user": USER, "output": OUTPUT, "engine": ENGINE}
    out["share_rows"] = []
    for rep in range(repeats):
        for share in SHARES:
            prompts, shared = prompts_for(trace, share, 1, seed=1, vocab=vocab)
            for cache in (False, True) if rep % 2 == 0 else (True, False):
                r = one_run(program, params, trace, prompts, shared, cache, SHARE_POOL, vocab)
                r.update(share=share, repeat=rep, shared_requests=sum(shared))
                out["share_rows"].append(r)
                say(f"rep {rep} share {share:.0%} prefix_cache {cache!s:>5}", r)
    out["pool_rows"] = []
    for name, share, systems in (("one system prompt, 60%", 0.6, 1), ("8 system prompts, 90%", 0.9, 8)):
        prompts, shared = prompts_for(trace, share, systems, seed=1, vocab=vocab)
        for pages in POOLS:
            r = one_run(program, params, trace, prompts, shared, True, pages, vocab)
            r.update(trace_kind=name, share=share, systems=systems, shared_requests=sum(shared))
            out["pool_rows"].append(r)
            say(f"{name}, {pages:5d} pages", r)
    return out


def tables(res: dict) -> str:
    import numpy as np

    ms = lambda x: f"{x * 1e3:.0f}"
    lines, rows = [], []
    by_class = all(r.get("ttft_shared_p50_s", None) is not None for r in res["share_rows"] if r["shared_requests"])
    for share in SHARES:
        rs = [r for r in res["share_rows"] if r["share"] == share]
        off = sorted((r for r in rs if not r["prefix_cache"]), key=lambda r: r["repeat"])
        on = sorted((r for r in rs if r["prefix_cache"]), key=lambda r: r["repeat"])
        med = lambda group, f: float(np.median([f(r) for r in group]))
        pairs = lambda f: float(np.median([f(b) / f(a) for a, b in zip(off, on)]))  # per repeat, on / off
        p50 = lambda r: r["ttft_s"]["p50"]
        shared_p50 = lambda group: (
            "-" if group[0].get("ttft_shared_p50_s") is None else ms(med(group, lambda r: r["ttft_shared_p50_s"]))
        )
        rows.append(
            [
                f"{share:.0%}",
                on[0]["shared_requests"],
                f"{off[0]['prefill_tokens']:,} -> {on[0]['prefill_tokens']:,}",
                f"{1 - on[0]['prefill_tokens'] / off[0]['prefill_tokens']:.1%}",
                f"{med(on, lambda r: r['prefix_cache_hit_rate']):.1%}",
                f"{ms(med(off, p50))} -> {ms(med(on, p50))}",
                " ".join(f"{p50(b) / p50(a):.2f}" for a, b in zip(off, on)),
                f"{pairs(p50):.2f}",
                f"{ms(med(off, lambda r: r['ttft_s']['p99']))} -> {ms(med(on, lambda r: r['ttft_s']['p99']))}",
                *([f"{shared_p50(off)} -> {shared_p50(on)}"] if by_class else []),
                f"{ms(med(off, lambda r: r['tpot_s']['p50']))} -> {ms(med(on, lambda r: r['tpot_s']['p50']))}",
                f"{med(off, lambda r: r['throughput_tokens_per_s']):.0f} -> {med(on, lambda r: r['throughput_tokens_per_s']):.0f}",
            ]
        )
    lines += markdown_table(
        [
            "shared",
            "requests sharing",
            "prefill tokens off -> on",
            "saved",
            "engine hit counter",
            "TTFT p50 off -> on (ms)",
            "on / off, each repeat",
            "median",
            "TTFT p99 (ms)",
            *(["TTFT p50 of sharing requests (ms)"] if by_class else []),
            "TPOT p50 (ms)",
            "tokens/s",
        ],
        "rrrrrrlrr" + "r" * by_class + "rr",
        rows,
    )
    lines.append("")
    rows = [
        [
            r["trace_kind"],
            r["num_pages"],
            f"{r['token_hit_rate']:.1%}",
            f"{r['prefix_cache_hit_rate']:.1%}",
            f"{r['prefill_tokens']:,}",
            f"{r.get('recomputed_tokens', 0):,}",
            r["preemptions"],
            ms(r["ttft_s"]["p50"]),
            ms(r["ttft_s"]["p99"]),
            ms(r["tpot_s"]["p50"]),
            f"{r['step_s']['p50'] * 1e3:.1f}",
            r["peak_running"],
        ]
        for r in res["pool_rows"]
    ]
    lines += markdown_table(
        [
            "trace",
            "pool pages",
            "prompt tokens found cached",
            "engine hit counter",
            "prefill tokens",
            "recomputed after preemption",
            "preemptions",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TPOT p50 (ms)",
            "engine step p50 (ms)",
            "peak sequences in a step",
        ],
        "lrrrrrrrrrrr",
        rows,
    )
    return "\n".join(lines)


def plot(res: dict) -> None:
    import numpy as np

    from experiments.common import pyplot, save_figure, style_axes

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for cache, style in ((False, "o--"), (True, "s-")):
        p50 = [
            np.median([r["ttft_s"]["p50"] for r in res["share_rows"] if r["share"] == s and r["prefix_cache"] == cache])
            for s in SHARES
        ]
        a.plot([s * 100 for s in SHARES], np.asarray(p50) * 1e3, style, label=f"prefix_cache={cache}")
    style_axes(a, "requests with the common system prompt (%)", "TTFT p50 (ms)", "TTFT vs shared share")
    for kind in dict.fromkeys(r["trace_kind"] for r in res["pool_rows"]):
        rs = [r for r in res["pool_rows"] if r["trace_kind"] == kind]
        b.plot([r["num_pages"] for r in rs], [100 * r["token_hit_rate"] for r in rs], "o-", label=kind)
    style_axes(b, "pool pages (16 tokens each)", "prompt tokens found cached (%)", "hit rate vs pool", xlog=2)
    save_figure(fig, os.path.join(HERE, "prefix_cache.png"))


def main() -> int:
    args = parse_args(
        __doc__,
        None,
        "one repeat of 32 requests",
        add=lambda p: p.add_argument(
            "--control", action="store_true", help="only the share-0%% control (results_control.json)"
        ),
    )
    if args.control:
        res = load_results(HERE, "results_control.json") if args.replot else control()
        if not args.replot:
            save_results(HERE, res, "results_control.json")
        print(control_table(res))
        return 0
    res = load_results(HERE) if args.replot else measure(args.quick)
    if not args.replot:
        save_results(HERE, res)
    print(tables(res))
    plot(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
