"""Length-adaptive context parallelism (ByteScale) vs fixed context parallelism on long-tailed
length distributions: per-device work imbalance, the keys/values that must cross devices and those
the program moves, the collectives of the step, and tokens/s on CPU (experiments/bytescale/README.md).

    python experiments/bytescale/run.py [--quick]

1. The plan (host only). Two mixes of 20,000 documents (quick: 5,000) with lognormal lengths
   capped at 256K: `plan` (median 800 tokens, sigma 1.6) and `plan_short` (median 100, sigma 2).
   They are cut into pieces of at most T + 1 = 16,385 tokens (`packing.pieces`) for a mesh
   seq=8 x data=4, B = 32 rows a step, on contiguous chunks and on the zigzag:
     fixed              best-fit decreasing rows (`config.data.packing`), shuffled into batches;
     adaptive_split     `bytescale.plan` over the whole split (what `config.data.adaptive_cp`
                        does), shuffled into batches (first mix only: minutes of host time);
     adaptive_batch     each fixed batch's pieces placed again by `bytescale.plan(min_rows=B,
                        shards=4)` over that step's 32 devices; pieces past B rows are deferred;
     adaptive_local<f>  the same with local regions, `adaptive_cp_local` = f: the batch's pieces
                        cut to fit the ring region (T (1 - f) + 1), then planned with `local`;
     adaptive_tiers<f>+<groups>  the same with subgroup tiers too, `adaptive_cp_groups`: rings
                        within groups of g devices over a share of each device's tokens; pieces
                        cut to fit the full ring region, planned with `local` and `groups`;
     adaptive_buckets0,0.25,0.5  `bytescale.plan_batches` (config.data.adaptive_cp_buckets): the
                        first 5,000 documents of the mix planned in whole batches, each batch on
                        the local share its short pieces fill; nothing deferred; its table row
                        divides the bytes moved by the rows it needs against best-fit's.
   Over 20 steps each device's work is summed over the rows it holds: a FLOPs per token + b per
   visible (query, key) pair, per layer of a model with d_model 4,096 (a = 24 d^2 for the
   projections and MLP, b = 4 d for QK^T and PV); also attention (pairs) and tokens alone.
   Imbalance = max / mean - 1 over the 32 devices, per step (mean and max over the steps).
   Keys/values crossing devices (forward, per row and layer, bf16, 8 KV heads of 128): what the
   plan's groups need (`bytescale.kv_traffic`) against what the program moves
   (`bytescale.ring_traffic`, T (1 - f) (S - 1), and with tiers sum_g S L_g (g - 1) for each group
   tier plus the full ring's); "moved per token" divides the latter by the tokens kept
   (1 - deferred), relative to fixed CP's full rows.
2. The step's collectives: the tiny model's step (T = 128, seq=4 x data=2, ring, zigzag, packed
   documents) lowered fixed, with adaptive_cp, with adaptive_cp_local 0.125 and 0.5, and with tiers
   (local 0.125 + groups "2:0.25"): the seq collectives in the HLO (count, bytes).
3. tokens/s on CPU: each program trains on its layout's first 8 batches, alternating, 5 rounds (8
   simulated devices on this machine's CPU, shared); trained tokens/s counts the targets of
   weight 1 per median step.

    python experiments/bytescale/run.py --replot   # the tables from results.json
    python experiments/bytescale/run.py --buckets  # only the adaptive_buckets rows, into results.json
    python experiments/bytescale/run.py --batch-only   # redo 1 without adaptive_split (minutes of
                                                       # host time) and 2-3; merge into results.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402

from experiments.common import emit, load_results, markdown_table, run_worker, save_results, worker_devices  # noqa: E402

S, D, B, T, STEPS, ROUNDS = 8, 4, 32, 16384, 20, 5
LOCALS = (0.125, 0.25, 0.5)  # adaptive_cp_local of the per-batch plans with local regions
# (adaptive_cp_local, adaptive_cp_groups) of the per-batch plans with subgroup tiers (S = 8)
TIERS = ((0.125, "2:0.25,4:0.25"), (0.0625, "2:0.125,4:0.25"))
SPLITS = [(f"adaptive_local{f:g}", f, "") for f in LOCALS] + [(f"adaptive_tiers{f:g}+{g}", f, g) for f, g in TIERS]
CPU_LOCALS = (0.125, 0.5)  # ... of the tiny model's split programs
CPU_TIERS = ((0.125, "2:0.25"),)  # ... and its tiered one (seq=4)
D_MODEL, KV_BYTES_PER_TOKEN = 4096, 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16


MIXES = {"plan": (800, 1.6), "plan_short": (100, 2.0)}  # lognormal median and sigma of each length mix


def lengths(n: int, seed: int = 0, median: float = 800, sigma: float = 1.6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(np.log(median), sigma, n).astype(np.int64) + 2, 262144)


def _device_loads(work: dict, rows: np.ndarray, shard: np.ndarray | None = None) -> dict:
    """Imbalance of each kind of work over the D x S devices holding `rows` (row i on data shard
    shard[i], by default i % D)."""
    shard = np.arange(rows.shape[0]) % D if shard is None else shard
    return {k: bytescale_imbalance(np.stack([w[rows[shard == d]].sum(0) for d in range(D)])) for k, w in work.items()}


def bytescale_imbalance(load):
    from jaxsys.data import bytescale

    return bytescale.imbalance(load)


def tiers(zigzag: bool, local: float, groups: str) -> tuple[int, tuple, int]:
    """(L, ((g, L_g), ...), full ring region's positions) of a row of T on S devices."""
    from jaxsys.parallel import context

    shares = context.parse_groups(groups)
    sizes = context.region_sizes(T, S, zigzag, local, shares)
    return sizes[0], tuple((g, n) for (g, _), n in zip(shares, sizes[1:-1])), S * sizes[-1]


def one_batch(stats, needed, deferred, name, placed, lens, chunks, kinds, n_local, groups=()) -> None:
    """One step's per-batch plan: rows past B do not fit this step (deferred to a later one)."""
    from jaxsys.data import bytescale

    kept = placed.row < B
    deferred[name] += int(lens[~kept].sum())
    sub = bytescale.Placement(placed.row[kept], placed.start[kept], B)
    w = {k: bytescale.work(sub, lens[kept], T, chunks, *ab, local=n_local, groups=groups) for k, ab in kinds.items()}
    stats[name].append(_device_loads(w, np.arange(B)))
    needed[name] += bytescale.kv_traffic(sub, lens[kept], T, chunks, local=n_local, groups=groups) / B


def plan_stats(doc_len: np.ndarray, whole_split: bool = True) -> dict:
    from jaxsys.data import bytescale, packing
    from jaxsys.parallel import context

    pieces = packing.pieces(doc_len, T)
    a, b = 24.0 * D_MODEL**2, 4.0 * D_MODEL
    kinds = {"flops": (a, b), "attention": (0.0, 1.0), "tokens": (1.0, 0.0)}
    fixed = bytescale.packed_placement(pieces.length, T)
    order = np.random.default_rng(1).permutation(fixed.num_rows)  # the loader's shuffle of the rows
    batches = [order[i * B : (i + 1) * B] for i in range(min(STEPS, fixed.num_rows // B))]
    out = {}
    for layout in ("contiguous", "zigzag"):
        chunks = context.chunk_table(S, layout == "zigzag")
        fixed_work = {k: bytescale.work(fixed, pieces.length, T, chunks, *ab) for k, ab in kinds.items()}
        if whole_split:  # the loader's plan, over the whole split (slow: minutes)
            t0 = time.perf_counter()
            whole = bytescale.plan(pieces.length, T, chunks, a, b, min_rows=fixed.num_rows)
            whole_s = time.perf_counter() - t0
            whole_work = {k: bytescale.work(whole, pieces.length, T, chunks, *ab) for k, ab in kinds.items()}
            whole_order = np.random.default_rng(1).permutation(whole.num_rows)
        split_names = [name for name, *_ in SPLITS]
        names = ["fixed"] + (["adaptive_split"] if whole_split else []) + ["adaptive_batch"] + split_names
        stats = {n: [] for n in names}
        needed = {n: 0.0 for n in stats}
        deferred = {n: 0 for n in stats}
        batch_s = 0.0
        for i, rows in enumerate(batches):
            stats["fixed"].append(_device_loads(fixed_work, rows))
            if whole_split:
                stats["adaptive_split"].append(_device_loads(whole_work, whole_order[i * B : (i + 1) * B]))
            # per batch: the fixed batch's pieces placed again on B rows over the D x S devices
            members = np.flatnonzero(np.isin(fixed.row, rows))
            t0 = time.perf_counter()
            placed = bytescale.plan(pieces.length[members], T, chunks, a, b, min_rows=B, shards=D)
            batch_s += time.perf_counter() - t0
            lens = pieces.length[members]
            one_batch(stats, needed, deferred, "adaptive_batch", placed, lens, chunks, kinds, 0)
            for name, f, g in SPLITS:
                # tiers: the batch's pieces cut to fit the full ring region, then planned again
                n_local, groups, ring_len = tiers(layout == "zigzag", f, g)
                cut = packing.pieces(lens, ring_len).length
                placed = bytescale.plan(cut, T, chunks, a, b, min_rows=B, shards=D, local=n_local, groups=groups)
                one_batch(stats, needed, deferred, name, placed, cut, chunks, kinds, n_local, groups)
        needed["fixed"] = bytescale.kv_traffic(fixed, pieces.length, T, chunks) / fixed.num_rows
        if whole_split:
            needed["adaptive_split"] = bytescale.kv_traffic(whole, pieces.length, T, chunks) / whole.num_rows
        batch_tokens = float(sum(pieces.length[np.isin(fixed.row, r)].sum() for r in batches))
        for name, per_step in stats.items():
            f, g = next(((f, g) for n, f, g in SPLITS if n == name), (0.0, ""))
            n_local, groups, _ = tiers(layout == "zigzag", f, g)
            out[f"{name}/{layout}"] = {
                **{f"imbalance_{k}_mean": float(np.mean([s[k] for s in per_step])) for k in kinds},
                **{f"imbalance_{k}_max": float(np.max([s[k] for s in per_step])) for k in kinds},
                "kv_needed_mib_per_row_layer": needed[name]
                / (len(batches) if name not in ("fixed", "adaptive_split") else 1)
                * KV_BYTES_PER_TOKEN
                / 2**20,
                "kv_static_ring_mib_per_row_layer": bytescale.ring_traffic(T, S, n_local, groups)
                * KV_BYTES_PER_TOKEN
                / 2**20,
                "local": f,
                "groups": g,
                "deferred_token_fraction": deferred[name] / batch_tokens,
            }
        out[f"fixed/{layout}"]["rows"] = fixed.num_rows
        if whole_split:
            out[f"adaptive_split/{layout}"].update(rows=whole.num_rows, plan_seconds=whole_s)
        out[f"adaptive_batch/{layout}"].update(plan_seconds_per_batch=batch_s / len(batches))
        for name in stats:
            print(name, layout, json.dumps(out[f"{name}/{layout}"]), flush=True)
    out["documents"] = {
        "count": int(doc_len.shape[0]),
        "median": float(np.median(doc_len)),
        "p90": float(np.percentile(doc_len, 90)),
        "p99": float(np.percentile(doc_len, 99)),
        "max": int(doc_len.max()),
        "pieces": len(pieces),
        "token_share_of_pieces_longer_than_a_zigzag_chunk": float(
            pieces.length[pieces.length > T // (2 * S)].sum() / pieces.length.sum()
        ),
    }
    return out


BUCKETS = (0.0, 0.25, 0.5)  # config.data.adaptive_cp_buckets of the batch-bucket plan
BUCKET_DOCS = 5000  # its documents (the first of the mix): the whole-split plan is minutes of host time


def bucket_stats(doc_len: np.ndarray, zigzag: bool) -> dict:
    """`plan_batches` (config.data.adaptive_cp_buckets = BUCKETS) over the first BUCKET_DOCS
    documents: per-step imbalance over STEPS batches of its shuffle (global row b on data shard
    b // (B / D), as the loader orders them), KV needed, and the bytes the programs move per
    trained token (each batch moves its bucket's ring region; nothing is deferred) against fixed CP
    on best-fit rows of the same documents."""
    from jaxsys.data import bytescale, packing
    from jaxsys.parallel import context

    a, b = 24.0 * D_MODEL**2, 4.0 * D_MODEL
    kinds = {"flops": (a, b), "attention": (0.0, 1.0), "tokens": (1.0, 0.0)}
    chunks = context.chunk_table(S, zigzag)
    locals_ = tuple(context.region_sizes(T, S, zigzag, f)[0] for f in BUCKETS)
    fixed_rows = bytescale.packed_placement(packing.pieces(doc_len[:BUCKET_DOCS], T).length, T).num_rows
    t0 = time.perf_counter()
    planned = bytescale.plan_batches(doc_len[:BUCKET_DOCS], T, chunks, locals_, B, D, a, b)
    seconds = time.perf_counter() - t0
    pieces = planned.pieces  # each bucket's documents cut at its own ring region
    row_pos = np.empty(planned.placement.num_rows, np.int64)  # each row's place in its batch
    row_pos[planned.batches.reshape(-1)] = np.tile(np.arange(B), planned.batches.shape[0])
    shard = np.arange(B) // (B // D)
    per_step, needed = [], 0.0
    for i in np.random.default_rng(1).permutation(planned.batches.shape[0])[:STEPS].tolist():
        n_local = locals_[int(planned.bucket[i])]
        members = np.flatnonzero(np.isin(planned.placement.row, planned.batches[i]))
        sub = bytescale.Placement(row_pos[planned.placement.row[members]], planned.placement.start[members], B)
        lens = pieces.length[members]
        w = {k: bytescale.work(sub, lens, T, chunks, *ab, local=n_local) for k, ab in kinds.items()}
        per_step.append(_device_loads(w, np.arange(B), shard))
        needed += bytescale.kv_traffic(sub, lens, T, chunks, local=n_local) / B
    moved = float(np.mean([bytescale.ring_traffic(T, S, locals_[k]) for k in planned.bucket.tolist()]))
    rows = planned.batches.size
    return {
        **{f"imbalance_{k}_mean": float(np.mean([s[k] for s in per_step])) for k in kinds},
        **{f"imbalance_{k}_max": float(np.max([s[k] for s in per_step])) for k in kinds},
        "kv_needed_mib_per_row_layer": needed / len(per_step) * KV_BYTES_PER_TOKEN / 2**20,
        "kv_static_ring_mib_per_row_layer": moved * KV_BYTES_PER_TOKEN / 2**20,
        "deferred_token_fraction": 0.0,
        # moved per trained token vs fixed CP: rows hold fewer tokens when the plan needs more of them
        "moved_per_token": moved / bytescale.ring_traffic(T, S, 0) * rows / fixed_rows,
        "batches_per_bucket": {f"{f:g}": int((planned.bucket == k).sum()) for k, f in enumerate(BUCKETS)},
        "rows": rows,
        "fixed_rows": fixed_rows,
        "documents": BUCKET_DOCS,
        "plan_seconds": seconds,
    }


def add_bucket_rows(plan: dict, doc_len: np.ndarray) -> None:
    for layout in ("contiguous", "zigzag"):
        name = f"adaptive_buckets{','.join(f'{f:g}' for f in BUCKETS)}/{layout}"
        plan[name] = bucket_stats(doc_len, layout == "zigzag")
        print(name, json.dumps(plan[name]), flush=True)


CPU_LAYOUTS = (
    (("fixed", False, 0.0, ""), ("adaptive", True, 0.0, ""))
    + tuple((f"adaptive_local{f:g}", True, f, "") for f in CPU_LOCALS)
    + tuple((f"adaptive_tiers{f:g}+{g}", True, f, g) for f, g in CPU_TIERS)
)


def worker(n: int, jobs: list) -> None:
    """Lower the step of each layout (fixed, adaptive_cp, adaptive_cp with local regions): the seq
    collectives; then time each program on its layout's batches, alternating, ROUNDS x 8 steps
    each (the median per layout)."""
    worker_devices(n)
    import jax

    from jaxsys import data, train
    from jaxsys.analysis import collectives, cost_model, report
    from jaxsys.data import loader
    from jaxsys.mesh import make_mesh
    from jaxsys.program import build
    from tests.helpers import config_file

    job = jobs[0]
    batches, out, steps, states = {}, {}, {}, {}
    for name, adaptive, local, groups in CPU_LAYOUTS:
        c = config_file("tiny")
        c.mesh.seq, c.mesh.data = 4, 2
        c.data.source, c.data.path, c.data.cache_dir = "jsonl", job["path"], job["cache"]
        c.data.eval_fraction, c.data.packing, c.data.adaptive_cp = 0.0, True, adaptive
        c.data.adaptive_cp_local, c.data.adaptive_cp_groups = local, groups
        c.train.batch_size = 16
        program = build(c, make_mesh(c, jax.devices()[:n]))
        sizes = dict(program.layout.mesh_sizes)
        found = collectives.parse(report.lower_unrolled(program).as_text(), sizes)
        seq_ops = [x for x in found if x.axes == ("seq",)]
        corpus = loader.load_corpus(c.data, chunks=train.adaptive_chunks(c))
        batches[name] = [
            data.global_batch(corpus, program.batch_sharding, c.seed, s, 16, c.data.seq_len) for s in range(8)
        ]
        steps[name], states[name] = program.train_step_fn(), program.init()
        out[name] = {
            "layout": name,
            "adaptive": adaptive,
            "local": local,
            "groups": groups,
            "seq_len": int(c.data.seq_len),
            "context_load_balance": bool(c.model.context_load_balance),
            "rows": corpus.splits["train"].num_rows,
            "padding": corpus.splits["train"].padding(c.data.seq_len),
            "seq_collectives": len(seq_ops),
            "seq_collective_mib_per_step": sum(
                cost_model.ring_bytes(x.kind, x.operand_bytes, sizes["seq"]) for x in seq_ops
            )
            / 2**20,
            "weighted_targets_per_step": float(np.mean([float(np.asarray(bt.weights).sum()) for bt in batches[name]])),
            "step_seconds": [],
        }
    for name in out:  # compile each step first
        states[name], m = steps[name](states[name], batches[name][0])
        jax.block_until_ready(m)
    for _ in range(ROUNDS):
        for name in out:
            start = time.perf_counter()
            for bt in batches[name]:
                states[name], m = steps[name](states[name], bt)
            jax.block_until_ready(m)
            out[name]["step_seconds"].append((time.perf_counter() - start) / len(batches[name]))
    for r in out.values():
        r["step_seconds_median"] = float(np.median(r["step_seconds"]))
        r["trained_tokens_per_s"] = r["weighted_targets_per_step"] / r["step_seconds_median"]
        emit(r)


def corpus_file(path: str, n: int) -> None:
    rng = np.random.default_rng(2)
    with open(path, "w") as f:
        for size in (rng.pareto(1.1, n) * 20).astype(int) + 2:
            f.write(json.dumps({"text": "".join(rng.choice(list("abcdefgh "), min(size, 2000)))}) + "\n")


def main() -> None:
    if "--replot" in sys.argv:
        print(report_tables(load_results(HERE)))
        return
    if "--worker" in sys.argv:
        worker(int(sys.argv[sys.argv.index("--worker") + 1]), json.loads(sys.stdin.read()))
        return
    quick, batch_only = "--quick" in sys.argv, "--batch-only" in sys.argv
    if "--buckets" in sys.argv:  # only the batch-bucket rows, added to results.json
        results = load_results(HERE)
        for key, (median, sigma) in MIXES.items():
            add_bucket_rows(results[key], lengths(5000 if quick else 20000, 0, median, sigma))
        print(save_results(HERE, results))
        print(report_tables(results))
        return
    results = {"mesh": {"seq": S, "data": D}, "batch_rows": B, "seq_len": T, "steps": STEPS}
    old = load_results(HERE) if batch_only else {}
    for key, (median, sigma) in MIXES.items():
        whole = key == "plan" and not batch_only
        doc_len = lengths(5000 if quick else 20000, 0, median, sigma)
        results[key] = plan_stats(doc_len, whole_split=whole)
        add_bucket_rows(results[key], doc_len)
        if batch_only:  # keep the earlier run's whole-split rows, in their place
            merged = {k: v for k, v in old.get(key, {}).items() if k.startswith("adaptive_split/")}
            results[key] = dict(sorted({**results[key], **merged}.items(), key=_row_order))
    work = tempfile.mkdtemp(prefix="bytescale-")
    path = os.path.join(work, "docs.jsonl")
    corpus_file(path, 1000)
    results["cpu"] = run_worker(__file__, 8, [{"path": path, "cache": os.path.join(work, "cache")}])
    shutil.rmtree(work, ignore_errors=True)
    print(save_results(HERE, results))
    print(report_tables(results))


def _row_order(item) -> tuple:
    """Rows by chunks, then fixed, adaptive_split, adaptive_batch, the local and tiered plans."""
    key = item[0]
    if "/" not in key:
        return (2, 0, "")
    name, layout = key.split("/")
    kinds = ["fixed", "adaptive_split", "adaptive_batch"] + [n for n, *_ in SPLITS]
    return (int(layout == "zigzag"), kinds.index(name) if name in kinds else len(kinds), name)


def report_tables(results: dict) -> str:
    return "\n\n".join([plan_table(results[k]) for k in MIXES if k in results] + [cpu_table(results)])


def plan_table(plan: dict) -> str:
    d = plan["documents"]
    ring = T * (S - 1) * KV_BYTES_PER_TOKEN / 2**20  # fixed CP's KV per row and layer
    rows = []
    for key, r in plan.items():
        if key == "documents":
            continue
        rows.append(
            [key]
            + [
                f"{r[f'imbalance_{k}_mean']:.3f} / {r[f'imbalance_{k}_max']:.3f}"
                for k in ("flops", "attention", "tokens")
            ]
            + [f"{r['kv_needed_mib_per_row_layer']:.0f} / {r['kv_static_ring_mib_per_row_layer']:.0f}"]
            + [f"{r.get('deferred_token_fraction', 0.0):.1%}"]
            # KV bytes the program moves per token it trains, against fixed CP's full rows
            + [
                f"{r.get('moved_per_token', r['kv_static_ring_mib_per_row_layer'] / ring / (1 - r.get('deferred_token_fraction', 0.0))):.2f}"
            ]
        )
    head = [
        "plan/chunks",
        "FLOP imbalance mean / max",
        "attention",
        "tokens",
        "KV MiB/row/layer needed / moved",
        "deferred",
        "moved per token",
    ]
    lines = [
        f"{d['count']} documents: median {d['median']:.0f}, p90 {d['p90']:.0f}, p99 {d['p99']:.0f}, max {d['max']} "
        f"tokens; {d['token_share_of_pieces_longer_than_a_zigzag_chunk']:.0%} of the tokens in pieces longer than a "
        "zigzag chunk",
        "",
    ] + markdown_table(head, "lrrrrrr", rows)
    return "\n".join(lines)


def cpu_table(results: dict) -> str:
    cpu = [
        [
            r.get("layout", "adaptive" if r["adaptive"] else "fixed"),
            r["rows"],
            f"{r['padding']:.2%}",
            r["seq_collectives"],
            f"{r['seq_collective_mib_per_step']:.3f}",
            f"{r['seq_collective_mib_per_step'] * 1024 / r['weighted_targets_per_step']:.2f}",
            f"{r['step_seconds_median']:.3f}",
            f"{r['trained_tokens_per_s']:.0f}",
        ]
        for r in results["cpu"]
    ]
    head = [
        "layout",
        "rows",
        "padding",
        "seq collectives",
        "MiB/step",
        "KiB/trained token",
        "step s (median)",
        "trained tokens/s",
    ]
    return "\n".join(markdown_table(head, "lrrrrrrr", cpu))


if __name__ == "__main__":
    main()
