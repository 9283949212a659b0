"""Reservation vs on-demand page growth with recompute preemption (vLLM's PagedAttention
scheduler): sequences held at once, throughput, TTFT/TPOT, preemptions and the pool pages reserved
but unused, on the same trace and pool.

    python experiments/preemption/run.py            # ~11 min on 2 CPU cores; writes results.json
    python experiments/preemption/run.py --quick    # one repeat, one pool (~2 min)
    python experiments/preemption/run.py --replot   # tables and plot from results.json
    python experiments/preemption/run.py --swap     # adds swap vs recompute (one repeat, ~6 min)

The model is configs/tiny.py (random weights: timing only) served by jaxsys.serve.engine on one CPU
device. The trace (jaxsys.serve.bench.make_trace, lengths="sharegpt", scale 0.5): 96 requests, all
arriving at once (an offline batch: the pool, not the arrivals, limits what runs), ShareGPT-like
lognormal prompt and output lengths halved (medians ~74 and ~110 tokens, within 4-512). A request
generates exactly its output length (random weights, no stop ids), so max_new_tokens is the true
output length: reservation wastes only the output not yet generated, its best case. Pools of 96
and 192 pages of 16 tokens: the requests' prompt + max_new_tokens come to 1,587 pages, so neither
pool holds them all. Engine: chunked prefill, 512-token budget, 256-token chunks, max_seqs 64 (the
pool binds first), the per-row paged kernel (ragged=False; experiments/prefix_cache says why on CPU),
compiled before the clock starts (`bench.replay`, as `jaxsys.bench_serve`).

Three engines per pool, otherwise equal:
  reserve                     pages for prompt + max_new_tokens at admission (never preempts);
  on_demand                   pages as the sequence grows; when the pool runs out the most recently
                              admitted running sequence is preempted and later re-prefills its
                              prompt and generated tokens (recompute; there is no swap to host);
  on_demand + prefix_cache    the same, but a preempted sequence finds its own full pages again in
                              the prefix cache when they were not evicted (the engine's default).

Counted at every step (after the scheduler's plan): running sequences, pages held and the tokens
they will hold after the step; reserved-but-unused = held pages holding no token yet, as a share of
the pool, and slot waste = 1 - tokens / held slots (experiments/paged_kv's measure), both averaged
over steps. Recomputed tokens = prefill tokens computed - prompt tokens. Every request's greedy
tokens are compared with the reservation run's (recompute must not change the output).

--swap: swap preemption (config.serve.preemption="swap": the preempted sequence's cached pages go
to host memory and back on resume) against recompute, both on demand with the prefix cache, back
to back in one process on the same trace and pools; the rows go to results.json's "swap" (the
other rows are kept). Tokens are compared with the recompute run's.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import load_results, markdown_table, parse_args, save_results  # noqa: E402

REQUESTS = 96
SCALE = 0.5
POOLS = (96, 192)
MODES = (("reserve", False), ("on_demand", False), ("on_demand", True))
ENGINE = dict(page_size=16, token_budget=512, chunk_size=256, max_seqs=64, policy="chunked", ragged=False)


def label(allocation: str, prefix_cache: bool) -> str:
    return allocation + (" + prefix_cache" if prefix_cache else "")


def instrument(eng) -> dict:
    """Per step of the (one) scheduler: running sequences, pages held, tokens held after the step;
    and the prefill tokens computed."""
    s, pool = eng.schedulers[0], eng.pools[0]
    counts: dict = {"running": [], "held": [], "empty_pages": [], "slot_waste": [], "prefill_tokens": 0}
    plan = s.plan

    def counted():
        work = plan()
        end = {id(w.request): w.start + w.tokens for w in work}
        tokens = [max(r.cached, end.get(id(r), 0)) for r in s.running]
        held = pool.used_pages
        counts["running"].append(len(s.running))
        counts["held"].append(held)
        counts["empty_pages"].append(held - sum(pool.pages_for(t) for t in tokens))
        counts["slot_waste"].append(1 - sum(tokens) / (held * pool.page_size) if held else 0.0)
        counts["prefill_tokens"] += sum(w.tokens for w in work if w.kind == "prefill")
        return work

    s.plan = counted
    return counts


def one_run(
    program, params, trace, vocab: int, pages: int, allocation: str, prefix_cache: bool, preemption: str = "recompute"
) -> tuple:
    import numpy as np

    from jaxsys.serve import bench, engine

    eng = engine.Engine(
        program,
        params,
        num_pages=pages,
        allocation=allocation,
        prefix_cache=prefix_cache,
        preemption=preemption,
        **ENGINE,
    )
    eng.warmup()
    c = instrument(eng)
    r = bench.replay(eng, trace, seed=0, vocab=vocab)
    prompt_tokens = sum(t["prompt_len"] for t in trace)
    held = np.asarray(c["held"], float)
    r.update(
        allocation=allocation,
        prefix_cache=prefix_cache,
        num_pages=pages,
        peak_running=int(max(c["running"])),
        mean_running=float(np.mean(c["running"])),
        mean_held_pages=float(held.mean()),
        unused_reserved_share_of_pool=float(np.mean(c["empty_pages"]) / pages),
        slot_waste=float(np.mean(c["slot_waste"])),
        prompt_tokens=prompt_tokens,
        prefill_tokens=c["prefill_tokens"],
        recomputed_tokens=c["prefill_tokens"] - prompt_tokens,
        preemption=preemption,
        swapped_tokens=eng.stats["swapped_out"],
    )
    tokens = {req.id: list(req.generated) for req in eng.finished}
    return r, tokens


def schedule_only(trace, pages: int, prefix_cache: bool) -> dict:
    """The on-demand schedule of `trace` by the scheduler alone (no model: every sampled token 0);
    the engine's schedule is the same (its preemption counts equal these): how often each request
    is preempted, and how many preemptions hit a request within two steps of its (re-)admission."""
    import collections

    from jaxsys.serve.scheduler import PagePool, Request, Scheduler

    e = ENGINE
    s = Scheduler(
        PagePool(pages, e["page_size"]),
        e["token_budget"],
        e["chunk_size"],
        e["max_seqs"],
        e["policy"],
        allocation="on_demand",
        prefix_cache=prefix_cache,
    )
    requests = [
        Request(i, [i * 1024 + j for j in range(t["prompt_len"])], t["output_len"]) for i, t in enumerate(trace)
    ]
    for r in requests:
        s.add(r)
    admitted: dict = {}
    step, soon = 0, 0
    preempt = s.preempt

    def counted(r):
        nonlocal soon
        soon += step - admitted.get(r.id, -10) <= 2
        preempt(r)

    s.preempt = counted
    while not s.idle:
        before = {id(r) for r in s.running}
        work = s.plan()
        admitted.update({r.id: step for r in s.running if id(r) not in before})
        s.commit(work, {w.request.id: 0 for w in work})
        step += 1
    times = collections.Counter(r.preempted for r in requests)
    return {
        "preemptions": s.preemptions,
        "requests_preempted": sum(1 for r in requests if r.preempted),
        "most_preemptions_of_one_request": max(times),
        "preempted_times_histogram": {str(k): v for k, v in sorted(times.items())},
        "preempted_within_two_steps_of_admission": soon,
    }


def say(tag: str, r: dict) -> None:
    print(
        f"{tag}: peak {r['peak_running']:3d} mean {r['mean_running']:5.1f} running | "
        f"{r['throughput_tokens_per_s']:6.1f} tok/s | TTFT p50 {r['ttft_s']['p50']:6.2f} s p99 "
        f"{r['ttft_s']['p99']:6.2f} s | TPOT p50 {r['tpot_s']['p50'] * 1e3:6.1f} ms p99 "
        f"{r['tpot_s']['p99'] * 1e3:6.1f} ms | {r['preemptions']:3d} preemptions, "
        f"{r['recomputed_tokens']:6d} recomputed | unused reserved {r['unused_reserved_share_of_pool']:.1%} "
        f"of pool, slot waste {r['slot_waste']:.1%} | same tokens {r.get('same_tokens_as_reserve', 1):.1%}",
        flush=True,
    )


def setup() -> tuple:
    import jax

    from jaxsys import train
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh
    from jaxsys.serve import bench

    cpu_unless_accelerator()
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    params = program.init().params
    trace = bench.make_trace(REQUESTS, 0.0, (4, 512), (4, 512), seed=0, lengths="sharegpt", scale=SCALE)
    return program, params, config.model.vocab_size, trace


def measure_swap() -> list:
    """Recompute then swap preemption (on demand, prefix cache on) per pool, one repeat."""
    program, params, vocab, trace = setup()
    rows = []
    for pages in POOLS:
        runs = {p: one_run(program, params, trace, vocab, pages, "on_demand", True, p) for p in ("recompute", "swap")}
        reference = runs["recompute"][1]
        for preemption, (r, tokens) in runs.items():
            r.update(same_tokens_as_recompute=sum(tokens[i] == reference[i] for i in reference) / len(reference))
            rows.append(r)
            say(f"pool {pages} {preemption:>9}", r)
    return rows


def swap_table(rows: list) -> str:
    body = [
        [
            str(r["num_pages"]),
            r["preemption"],
            f"{r['steps']:,}",
            f"{r['throughput_tokens_per_s']:.0f}",
            f"{r['ttft_s']['p50']:.2f}",
            f"{r['tpot_s']['p50'] * 1e3:.0f}",
            f"{r['tpot_s']['p99'] * 1e3:.0f}",
            str(r["preemptions"]),
            f"{r['recomputed_tokens']:,}",
            f"{r['swapped_tokens']:,}",
            f"{r['same_tokens_as_recompute']:.0%}",
        ]
        for r in rows
    ]
    header = ["pool", "preemption", "engine steps", "tokens/s", "TTFT p50 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)"]
    header += ["preemptions", "recomputed tokens", "swapped tokens", "tokens == recompute's"]
    return "\n".join(markdown_table(header, "rlrrrrrrrrr", body))


def measure(quick: bool) -> dict:
    program, params, vocab, trace = setup()
    pools, repeats = (POOLS[:1], 1) if quick else (POOLS, 2)
    rows = []
    for rep in range(repeats):
        for pages in pools:
            reference = None
            modes = MODES if rep % 2 == 0 else MODES[::-1]
            results = {}
            for allocation, cache in modes:
                results[(allocation, cache)] = one_run(program, params, trace, vocab, pages, allocation, cache)
            reference = results[("reserve", False)][1]
            for (allocation, cache), (r, tokens) in results.items():
                r.update(
                    repeat=rep,
                    same_tokens_as_reserve=sum(tokens[i] == reference[i] for i in reference) / len(reference),
                )
                rows.append(r)
                say(f"rep {rep} pool {pages} {label(allocation, cache):>26}", r)
    prompts = [t["prompt_len"] for t in trace]
    outputs = [t["output_len"] for t in trace]
    need = sum(-(-(p + o) // ENGINE["page_size"]) for p, o in zip(prompts, outputs))
    return {"trace": trace, "engine": ENGINE, "pages_for_all_reserved": need, "rows": rows}


def thrash(res: dict) -> str:
    lines = []
    for pages in sorted({r["num_pages"] for r in res["rows"]}):
        for cache in (False, True):
            t = schedule_only(res["trace"], pages, cache)
            lines.append(
                f"pool {pages}, {label('on_demand', cache)}: {t['preemptions']} preemptions of "
                f"{t['requests_preempted']} requests (at most {t['most_preemptions_of_one_request']} of one; "
                f"times preempted: {t['preempted_times_histogram']}); {t['preempted_within_two_steps_of_admission']} "
                "within two steps of the request's (re-)admission"
            )
    return "\n".join(lines)


def tables(res: dict) -> str:
    import numpy as np

    pools = sorted({r["num_pages"] for r in res["rows"]})
    out = []
    for pages in pools:
        body = []
        for allocation, cache in MODES:
            rs = [
                r
                for r in res["rows"]
                if r["num_pages"] == pages and (r["allocation"], r["prefix_cache"]) == (allocation, cache)
            ]
            join = lambda f: " / ".join(f(r) for r in rs)
            body.append(
                [
                    label(allocation, cache),
                    join(lambda r: str(r["peak_running"])),
                    join(lambda r: f"{r['mean_running']:.1f}"),
                    join(lambda r: f"{r['steps']:,}"),
                    join(lambda r: f"{r['throughput_tokens_per_s']:.0f}"),
                    join(lambda r: f"{r['ttft_s']['p50']:.2f}"),
                    join(lambda r: f"{r['ttft_s']['p99']:.2f}"),
                    join(lambda r: f"{r['tpot_s']['p50'] * 1e3:.0f}"),
                    join(lambda r: f"{r['tpot_s']['p99'] * 1e3:.0f}"),
                    join(lambda r: str(r["preemptions"])),
                    join(lambda r: f"{r['recomputed_tokens']:,}"),
                    join(lambda r: f"{r['unused_reserved_share_of_pool']:.1%}"),
                    join(lambda r: f"{r['slot_waste']:.1%}"),
                    join(lambda r: f"{r['same_tokens_as_reserve']:.0%}"),
                ]
            )
        base = [r for r in res["rows"] if r["num_pages"] == pages and r["allocation"] == "reserve"]
        demand = [
            r for r in res["rows"] if r["num_pages"] == pages and r["allocation"] == "on_demand" and r["prefix_cache"]
        ]
        ratio = np.median([d["throughput_tokens_per_s"] / b["throughput_tokens_per_s"] for d, b in zip(demand, base)])
        out.append(
            f"Pool of {pages} pages ({pages * res['engine']['page_size']:,} tokens); on_demand + prefix_cache / reserve throughput (median of the repeats): {ratio:.2f}x"
        )
        out.append("")
        out += markdown_table(
            [
                "allocation",
                "peak running",
                "mean running",
                "engine steps",
                "tokens/s",
                "TTFT p50 (s)",
                "TTFT p99 (s)",
                "TPOT p50 (ms)",
                "TPOT p99 (ms)",
                "preemptions",
                "recomputed tokens",
                "reserved unused (of pool)",
                "slot waste (of held)",
                "tokens == reserve's",
            ],
            "lrrrrrrrrrrrrr",
            body,
        )
        out.append("")
    return "\n".join(out)


def plot(res: dict) -> None:
    from experiments.common import pyplot, save_figure, style_axes

    plt = pyplot()
    pools = sorted({r["num_pages"] for r in res["rows"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.25
    for i, (allocation, cache) in enumerate(MODES):
        rs = [
            [
                r
                for r in res["rows"]
                if r["num_pages"] == p and (r["allocation"], r["prefix_cache"]) == (allocation, cache)
            ]
            for p in pools
        ]
        xs = [j + (i - 1) * width for j in range(len(pools))]
        axes[0].bar(xs, [max(r["peak_running"] for r in g) for g in rs], width, label=label(allocation, cache))
        axes[1].bar(
            xs,
            [sum(r["throughput_tokens_per_s"] for r in g) / len(g) for g in rs],
            width,
            label=label(allocation, cache),
        )
    for ax, ylabel in zip(axes, ("peak running sequences", "output tokens/s (mean of repeats)")):
        ax.set_xticks(range(len(pools)), [f"{p} pages" for p in pools])
        style_axes(ax, "pool", ylabel, grid="major", legend=7)
    save_figure(fig, os.path.join(HERE, "preemption.png"))


def main() -> int:
    add = lambda p: p.add_argument("--swap", action="store_true", help="add swap vs recompute to results.json")
    args = parse_args(__doc__, None, "one repeat, the smaller pool", add=add)
    if args.swap:
        res = load_results(HERE)
        res["swap"] = measure_swap()
        save_results(HERE, res)
    else:
        res = load_results(HERE) if args.replot else {**measure(args.quick), "swap": []}
    if not args.replot and not args.swap:
        save_results(HERE, res)
    print(tables(res))
    if res.get("swap"):
        print(swap_table(res["swap"]))
    print(thrash(res))  # the scheduler alone, on the same trace (deterministic; < 1 s)
    plot(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
