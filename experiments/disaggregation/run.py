"""Disaggregated prefill and decode (DistServe) vs one colocated engine at equal device count, under a
bursty trace: TTFT and TPOT p50/p99, decode steps stalled behind prefill chunks, KV bytes moved.

    python experiments/disaggregation/run.py     # writes results.json, results.png (9 min on 2 shared cores)

Eight simulated CPU devices. configs/tiny.py (random weights, n_kv_heads=4: timing and schedules
only) served three ways:
  colocated     one Engine on all 8 devices, data=2 x tensor=4 (two batch shards of 4 devices)
  disagg        prefill tensor=4 + decode data=2 x tensor=2, placement by the cost model
  disagg-all    the same, every prompt prefilled on the prefill side (DistServe proper)
  disagg-all-t4 the same with decode on tensor=4 (one batch shard: the 8B decode step's weight
                read is then as short as colocated's); model clock only
Every engine shard has the same token budget, chunk and pool. Two clocks:
  wall     the CPU's wall clock (bench_serve's method). The 8 devices share 2 cores, so the two
           sides of a disaggregated engine run one after the other: wall times cannot show what
           running them side by side buys; the stall counts can.
  model    a virtual clock: the same engines and schedules, each step timed by the roofline of
           configs/llama_8b.py (bf16 weights and KV) on H100s in that step's layout
           (analysis/serving.py step_seconds: max(compute at 50% MFU, weight + KV reads) + tensor all-reduces);
           the two disaggregated sides keep their own clocks and a handed-off sequence may decode
           once its transfer (bytes / 450 GB/s NVLink + 20 us) has landed. The placement cost model
           is priced on the same 8B/H100 figures.
The trace: bursts of requests at once (prompts 128-1024 tokens, 16-48 output tokens), bursts
spaced so that each burst's prefills collide with the previous burst's decodes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

BURSTS, PER_BURST, PROMPT, OUTPUT = int(os.environ.get("BURSTS", 4)), 8, (128, 1024), (16, 48)
WALL_GAP_S, MODEL_GAP_S = 4.0, 0.06  # between bursts, on each clock
PAGES, PAGE, BUDGET, CHUNK, SEQS = 512, 16, 256, 256, 32  # per batch shard, every engine: the pool never binds
# (name, placement, decode sub-mesh, clocks); every disaggregated run prefills on tensor=4
RUNS = [
    ("colocated", None, None, ("model", "wall")),
    ("disagg", "cost", "data=2,tensor=2", ("model", "wall")),
    ("disagg-all", "prefill", "data=2,tensor=2", ("model", "wall")),
    ("disagg-all-t4", "prefill", "tensor=4", ("model",)),
]


def bursty_trace(bursts, per_burst, gap_s, prompt_len, output_len, seed=0, spread_s=0.0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for b in range(bursts):
        for _ in range(per_burst):
            rows.append(
                {
                    "arrival_s": b * gap_s + float(rng.uniform(0, spread_s)),
                    "prompt_len": int(rng.integers(prompt_len[0], prompt_len[1] + 1)),
                    "output_len": int(rng.integers(output_len[0], output_len[1] + 1)),
                }
            )
    return sorted(rows, key=lambda r: r["arrival_s"])


def replay(eng, trace, vocab, clock, timer=None):
    """Run `trace` through `eng` (Engine or DisaggregatedEngine). clock 'wall': the wall clock;
    'model': a virtual clock advanced by timer(side, shard_rows) per step (side: 'prefill',
    'decode' or 'colocated'), each disaggregated side on its own clock."""
    import numpy as np

    from jaxsys.serve import disagg

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, size=r["prompt_len"]).tolist() for r in trace]
    pending = list(enumerate(trace))
    times = {i: [] for i in range(len(trace))}
    split = isinstance(eng, disagg.DisaggregatedEngine)
    stalls = [0, 0, 0]  # steps with decodes, of them with a prefill chunk too, decode tokens in those

    def submit(i):
        row = trace[i]
        eng.submit(i, prompts[i], row["output_len"])

    def count(work):
        kinds = [w.kind for w in work]
        if "decode" in kinds:
            stalls[0] += 1
            if "prefill" in kinds:
                stalls[1] += 1
                stalls[2] += kinds.count("decode")

    start = time.perf_counter()
    if clock == "wall":
        while pending or not eng.idle:
            now = time.perf_counter() - start
            while pending and pending[0][1]["arrival_s"] <= now:
                submit(pending.pop(0)[0])
            if eng.idle:
                time.sleep(max(pending[0][1]["arrival_s"] - now, 0.0))
                continue
            if split:
                work, sampled = eng.step_decode()
                count(work)
                t = time.perf_counter() - start
                for rid in sampled:
                    times[rid].append(t)
                work, sampled = eng.step_prefill()
            else:
                work, sampled = eng.step()
                count(work)
            t = time.perf_counter() - start
            for rid in sampled:
                times[rid].append(t)
        makespan = time.perf_counter() - start
    elif not split:
        t = 0.0
        while pending or not eng.idle:
            while pending and pending[0][1]["arrival_s"] <= t:
                submit(pending.pop(0)[0])
            if eng.idle:
                t = pending[0][1]["arrival_s"]
                continue
            shard_of = dict(eng.shard_of)
            work, sampled = eng.step()
            count(work)
            t += timer("colocated", disagg.step_rows(work, shard_of, eng.shards))
            for rid in sampled:
                times[rid].append(t)
        makespan = t
    else:
        tp = td = 0.0
        while pending or not eng.idle:
            cand = []
            if eng.has_work("prefill"):
                cand.append((tp, "prefill"))
            if eng.has_work("decode"):
                cand.append((td if not eng.decode.idle else max(td, eng.next_ready()), "decode"))
            nxt = min(cand) if cand else (math.inf, None)
            if pending and pending[0][1]["arrival_s"] <= nxt[0]:
                a = pending[0][1]["arrival_s"]
                busy = eng.has_work("prefill"), eng.has_work("decode")
                submit(pending.pop(0)[0])
                tp = tp if busy[0] else max(tp, a)
                td = td if busy[1] else max(td, a)
                continue
            if nxt[1] is None:
                raise RuntimeError("nothing to run and nothing pending, yet the engine is not idle")
            if nxt[1] == "prefill":
                work, sampled = eng.step_prefill()
                tp += timer("prefill", eng.last_shard_rows[1]) if work else 0.0
                eng.land_at(tp)  # this step's handoffs reach the decode side after their transfer
                t = tp
            else:
                td = nxt[0]
                work, sampled = eng.step_decode(now=td)
                count(work)
                td += timer("decode", eng.last_shard_rows[1]) if work else 0.0
                t = td
            for rid in sampled:
                times[rid].append(t)
        makespan = max(tp, td)
    arrival = {i: r["arrival_s"] for i, r in enumerate(trace)}
    ttft = [times[i][0] - arrival[i] for i in times]
    tpot = [(times[i][-1] - times[i][0]) / (len(times[i]) - 1) for i in times if len(times[i]) > 1]
    from jaxsys.serve.bench import percentiles

    out = {
        "requests": len(times),
        "generated_tokens": sum(len(v) for v in times.values()),
        "makespan_s": makespan,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "decode_steps": stalls[0],
        "stalled_decode_steps": stalls[1],
        "stalled_decode_tokens": stalls[2],
    }
    assert all(len(times[i]) == trace[i]["output_len"] for i in times)
    if split:
        moved = [t["bytes"] for t in eng.transfers]
        out.update(
            handoffs=len(moved),
            transfer_bytes_total=sum(moved),
            transfer_bytes_match_formula=all(t["bytes"] == t["formula_bytes"] for t in eng.transfers),
            placements={k: list(eng.placement.values()).count(k) for k in ("prefill", "colocated")},
            leaked_pages=sum(p.used_pages for e in (eng.prefill, eng.decode) for p in e.pools),
        )
    else:
        out.update(leaked_pages=sum(p.used_pages for p in eng.pools))
    return out


def main() -> int:
    import jax

    from jaxsys import program as program_lib
    from jaxsys.analysis import hardware, serving
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh
    from jaxsys.serve import disagg, engine

    cpu_unless_accelerator()
    assert jax.device_count() == 8, jax.devices()
    started = time.perf_counter()
    over = ["--config.model.n_kv_heads=4", f"--config.serve.chunk_size={CHUNK}"]
    served = load_config(
        os.path.join(ROOT, "configs", "tiny.py"), over + ["--config.mesh.data=2", "--config.mesh.tensor=4"]
    )
    colo = program_lib.build(served, make_mesh(served, jax.devices()))
    params = colo.init().params
    sides = {}
    for _, placement, decode_mesh, _ in RUNS:
        if placement is not None and decode_mesh not in sides:
            c = load_config(
                os.path.join(ROOT, "configs", "tiny.py"), over + [f"--config.serve.decode_mesh={decode_mesh}"]
            )
            sides[decode_mesh] = disagg.build_programs(c)
    # what the model clock prices: configs/llama_8b.py (bf16) in each layout, on H100s
    hw = hardware.profile("h100")
    big_over = [
        "--config.mesh.fsdp=1",
        "--config.mesh.data=2",
        "--config.mesh.tensor=4",
        "--config.parallel.sequence_parallel=false",
        "--config.model.param_dtype=bfloat16",
        f"--config.serve.chunk_size={CHUNK}",
        f"--config.serve.page_size={PAGE}",
    ]
    big = load_config(os.path.join(ROOT, "configs", "llama_8b.py"), big_over)
    priced = {}
    for mesh in sides:
        b = load_config(os.path.join(ROOT, "configs", "llama_8b.py"), big_over + [f"--config.serve.decode_mesh={mesh}"])
        priced[mesh] = disagg.side_configs(b, 8)
    wall_trace = bursty_trace(BURSTS, PER_BURST, WALL_GAP_S, PROMPT, OUTPUT)
    model_trace = [dict(r, arrival_s=r["arrival_s"] * MODEL_GAP_S / WALL_GAP_S) for r in wall_trace]
    kw = dict(num_pages=PAGES, page_size=PAGE, token_budget=BUDGET, chunk_size=CHUNK, max_seqs=SEQS)
    rows = []
    engines = {}  # one compiled Engine per layout, reused by the runs (each starts idle, pools empty)

    def reuse(key, eng):
        if key in engines:
            for s in engines[key].schedulers:
                s.finished.clear()
            return engines[key]
        engines[key] = eng
        return eng

    only = os.environ.get("ONLY")  # e.g. ONLY=disagg:model for a quick look at one run
    for name, placement, decode_mesh, clocks in RUNS:
        for clock in clocks:
            if only and only != f"{name}:{clock}":
                continue
            trace = model_trace if clock == "model" else wall_trace
            if placement is None:
                eng = reuse("colocated", engine.Engine(colo, params, **kw))
                prices = {"colocated": big}
            else:
                big_pre, big_dec = priced[decode_mesh]
                prices = {"prefill": big_pre, "decode": big_dec}
                cost = serving.CostModel.for_configs(
                    big_pre,
                    big_dec,
                    hw,
                    placement=placement,
                    interference=float(os.environ.get("INTERFERENCE", big.serve.interference)),
                )
                eng = disagg.DisaggregatedEngine(*sides[decode_mesh], params, cost=cost, **kw)
                eng.prefill = reuse(("prefill", decode_mesh), eng.prefill)
                eng.decode = reuse(("decode", decode_mesh), eng.decode)
            timer = lambda side, rows, prices=prices: serving.step_seconds(prices[side], hw, rows)
            if clock == "wall":
                eng.warmup()  # no compilation on the wall clock
            t0 = time.perf_counter()
            r = replay(eng, trace, served.model.vocab_size, clock, timer)
            r.update(
                engine=name,
                clock=clock,
                run_s=time.perf_counter() - t0,
                decode_mesh=decode_mesh or "data=2,tensor=4",
                prefill_mesh="tensor=4" if placement else "(shared)",
            )
            rows.append(r)
            ms = lambda d: f"p50 {d['p50'] * 1e3:8.1f} p99 {d['p99'] * 1e3:8.1f} ms"
            extra = (
                f" | {r['handoffs']} handoffs, {r['transfer_bytes_total'] / 2**20:.1f} MiB "
                f"(== formula: {r['transfer_bytes_match_formula']}), placed {r['placements']}"
                if "handoffs" in r
                else ""
            )
            print(
                f"{name:>10} {clock:>5}: TTFT {ms(r['ttft_s'])} | TPOT {ms(r['tpot_s'])} | stalled decode "
                f"steps {r['stalled_decode_steps']}/{r['decode_steps']} ({r['stalled_decode_tokens']} tokens)"
                f"{extra} | {r['run_s']:.0f}s",
                flush=True,
            )
    result = {
        "trace": wall_trace,
        "model_gap_s": MODEL_GAP_S,
        "wall_gap_s": WALL_GAP_S,
        "engine": kw,
        "rows": rows,
        "total_s": time.perf_counter() - started,
    }
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows)
    return 0


def plot(rows):
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, clock in zip(axes, ("model", "wall")):
        sub = {r["engine"]: r for r in rows if r["clock"] == clock}
        names = [n for n, *_ in RUNS if n in sub]
        x = range(len(names))
        for k, (metric, pct) in enumerate([("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")]):
            vals = [sub[n][metric][pct] / sub["colocated"][metric][pct] for n in names]
            ax.bar([i + 0.2 * k - 0.3 for i in x], vals, 0.2, label=f"{metric[:4].upper()} {pct}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(x), names)
        ax.set_title(f"{'modelled (8B on H100s)' if clock == 'model' else 'CPU wall clock'}: relative to colocated")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
