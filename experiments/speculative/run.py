"""Speculative decoding: accepted tokens per target forward vs k, greedy and sampled, with a small
trained draft and with the target as its own draft; roofline speed-up.

    python experiments/speculative/run.py --target W --draft W_draft    # ~2 min on 2 CPU cores

The target and the draft are jaxsys workdirs of the same vocabulary (here configs/tiny.py, 0.82M
parameters, and a 4x narrower 2-layer model, 0.12M, both trained 300 steps on the embedded corpus).
8 prompts of 32 held-out bytes each, 48 new tokens, k = 1, 2, 4, 8. tokens per target forward =
generated tokens / target forwards (prefill included), one request at a time on the engine with a
contiguous cache and the draft model as its drafter. Roofline speed-up on a memory-bound
device, per round: (n + 1) tokens for one target forward + k draft forwards, each costing its
weight bytes: (accepted + 1) / (1 + k x draft_bytes / target_bytes) relative to plain decoding.

`--part engine` (or `all`, the default) measures the same inside the continuous-batching engine
(jaxsys/serve/speculation.py's drafters), ~1.5 min: 8 held-out prompts of 64 bytes, 48 new tokens each, submitted
together with k = 1, 2, 4, 8 per request (32 requests in one batch, each with its own k), for the
small draft (T = 0 and 1) and for self-speculation (the target over its attention sinks, 4 tokens,
and a recent window of W = 8, 16, 32 tokens, pages of 4; T = 0, and T = 1 at W = 16). Per k: tokens
per target forward of a speculating sequence (1 + accepted per round), acceptance, and the roofline
speed-up: small draft as above; self-speculation, whose draft reads the target's weights and a
fraction f of its cache (f measured), (n + 1)(1 + rho) / (1 + rho + k (1 + rho f)) with rho = KV
bytes / weight bytes of the batch (this run's rho, and rho -> infinity: (n + 1) / (1 + k f)).
Writes results_engine.json and engine.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--part", choices=("contiguous", "engine", "all"), default="all")
    args = parser.parse_args(argv)
    if args.part in ("engine", "all"):
        engine_part(args)
    if args.part == "engine":
        return 0
    import jax

    from jaxsys import data as data_lib
    from jaxsys.checkpoint import load
    from jaxsys.serve import engine, speculation
    from jaxsys.serve.runner import check_servable

    target, tparams, tconfig = load(args.target, check=check_servable)
    draft, dparams, _ = load(args.draft, check=check_servable)
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    ratio = nbytes(dparams) / nbytes(tparams)
    corpus = data_lib.load_corpus(tconfig.data)
    held = corpus.split("eval")
    prompts = [held[i * 4000 : i * 4000 + 32].astype(int).tolist() for i in range(8)]
    rows = []
    for draft_name, (d_prog, d_params, r) in {
        "small draft": (draft, dparams, ratio),
        "self (target)": (target, tparams, 1.0),
    }.items():
        for temperature in (0.0, 1.0):
            for k in (1, 2, 4, 8):
                eng = engine.Engine(
                    target,
                    tparams,
                    token_budget=128,
                    chunk_size=96,
                    max_seqs=1,
                    cache="contiguous",
                    max_len=96,
                    drafter=speculation.DraftModel(d_prog, d_params),
                    k=k,
                )
                total = {"tokens": 0}
                for i, prompt in enumerate(prompts):
                    sampling = engine.Sampling(temperature, seed=i)
                    total["tokens"] += len(engine.generate(eng, [prompt], 48, sampling)[0])
                total.update(
                    forwards=eng.stats["target_steps"],
                    **{key: eng.stats[key] for key in ("accepted", "drafted", "rounds")},
                )
                acc = total["accepted"] / total["drafted"]
                per_round = total["accepted"] / max(total["rounds"], 1)
                row = {
                    "draft": draft_name,
                    "temperature": temperature,
                    "k": k,
                    "tokens_per_target_forward": total["tokens"] / total["forwards"],
                    "acceptance": acc,
                    "roofline_speedup": (per_round + 1) / (1 + k * r),
                    "draft_bytes_ratio": r,
                }
                rows.append(row)
                print(
                    f"{draft_name:>14} T={temperature} k={k}: {row['tokens_per_target_forward']:.2f} tokens/forward, "
                    f"acceptance {acc:.1%}, roofline x{row['roofline_speedup']:.2f}",
                    flush=True,
                )
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def engine_part(args) -> None:
    import jax
    import numpy as np

    from jaxsys import data as data_lib
    from jaxsys.checkpoint import load
    from jaxsys.serve import engine, speculation
    from jaxsys.serve.runner import check_servable

    target, tparams, tconfig = load(args.target, check=check_servable)
    draft, dparams, _ = load(args.draft, check=check_servable)
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    weights = nbytes(tparams)
    ratio = nbytes(dparams) / weights
    m = tconfig.model
    kv_per_token = 2 * m.n_layers * m.n_kv_heads * m.head_dim * np.dtype(m.compute_dtype).itemsize
    held = data_lib.load_corpus(tconfig.data).split("eval")
    prompts = [held[i * 4000 : i * 4000 + 64].astype(int).tolist() for i in range(8)]
    ks, new = (1, 2, 4, 8), 48
    kw = dict(num_pages=512, page_size=4, token_budget=256, chunk_size=64, max_seqs=32)
    rows = []

    def run(eng, name, temperature, window=None):
        if window is not None:
            eng.drafter.window = window  # host-side only: the same compiled steps
        before = dict(eng.stats)
        for k in ks:
            for i, prompt in enumerate(prompts):
                eng.submit((name, temperature, window, k, i), prompt, new, engine.Sampling(temperature, seed=i), k=k)
        eng.run()
        read = {key: eng.stats[key] - before[key] for key in ("draft_read", "full_read")}
        f = read["draft_read"] / read["full_read"] if read["full_read"] else None
        for k in ks:
            stats = [r.stats for r in eng.finished if r.id[:4] == (name, temperature, window, k)]
            rounds, acc, drafted = (sum(s[key] for s in stats) for key in ("rounds", "accepted", "drafted"))
            n = acc / rounds
            row = {
                "draft": name,
                "temperature": temperature,
                "window": window,
                "k": k,
                "tokens_per_target_forward": 1 + n,
                "acceptance": acc / drafted,
            }
            if window is None:
                row["roofline_speedup"] = (1 + n) / (1 + k * ratio)
            else:  # the batch's KV: 8 sequences at their mean context (prompt + half the output)
                rho = len(prompts) * (len(prompts[0]) + new / 2) * kv_per_token / weights
                row.update(
                    draft_read_fraction=f,
                    rho=rho,
                    roofline_speedup=(1 + n) * (1 + rho) / (1 + rho + k * (1 + rho * f)),
                    roofline_speedup_kv_bound=(1 + n) / (1 + k * f),
                )
            rows.append(row)
            print(
                f"engine {name:>5} T={temperature} W={window} k={k}: {1 + n:.2f} tokens/forward, acceptance "
                f"{row['acceptance']:.1%}, roofline x{row['roofline_speedup']:.2f}"
                + (f" (f={f:.2f}, KV-bound x{row['roofline_speedup_kv_bound']:.2f})" if window else ""),
                flush=True,
            )

    small = engine.Engine(target, tparams, **kw, drafter=speculation.DraftModel(draft, dparams), k=1)
    for temperature in (0.0, 1.0):
        run(small, "small", temperature)
    del small
    self_eng = engine.Engine(target, tparams, **kw, drafter=speculation.SelfSpeculation(window=8, sink=4), k=1)
    for window, temperature in ((8, 0.0), (16, 0.0), (32, 0.0), (16, 1.0)):
        run(self_eng, "self", temperature, window)
    with open(os.path.join(HERE, "results_engine.json"), "w") as f:
        json.dump(
            {"draft_bytes_ratio": ratio, "kv_bytes_per_token": kv_per_token, "weight_bytes": weights, "rows": rows},
            f,
            indent=1,
        )
    plot(rows)


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    series = {}
    for r in rows:
        label = (
            f"small draft, T={r['temperature']:g}"
            if r["window"] is None
            else f"self, sink 4 + window {r['window']}, T={r['temperature']:g}"
        )
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        ax.plot([r["k"] for r in rs], [r["tokens_per_target_forward"] for r in rs], "o-", label=label)
        (line,) = bx.plot([r["k"] for r in rs], [r["roofline_speedup"] for r in rs], "o-", label=label)
        if "roofline_speedup_kv_bound" in rs[0]:  # self-speculation when the KV cache dominates the bytes
            bx.plot(
                [r["k"] for r in rs],
                [r["roofline_speedup_kv_bound"] for r in rs],
                "x--",
                color=line.get_color(),
                lw=0.8,
            )
    for a, title in (
        (ax, "tokens per target forward (in the engine)"),
        (bx, "roofline speed-up (dashed: self, KV-bound)"),
    ):
        a.set_xscale("log", base=2)
        a.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        a.set_xlabel("k (drafted tokens per step)")
        a.set_title(title)
        a.grid(alpha=0.3)
    bx.axhline(1.0, color="gray", lw=0.8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "engine.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
