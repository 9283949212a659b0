"""Pipeline schedules (Megatron PTD-P): bubble fraction, activation memory and step time of GPipe,
1F1B, eager 1F1B and interleaved 1F1B, for several micro-batch counts m and chunks v.

    .venv/bin/python experiments/pipeline_schedules/run.py [--quick] [--replot]

Two parts:
  tables    (pure Python, jaxsys/parallel/schedules.py and pipeline.lockstep): for p = 4 and 8, the
            bubble fraction of the asynchronous schedule table beside Megatron's formula, the peak
            in-flight micro-batches, and how the lockstep executor packs the same order: its ticks,
            stashed stage inputs and lockstep time (each tick as long as its busiest device;
            backward = 3 forwards, since the stage forward is recomputed).
  measured  (8 simulated CPU devices, pipe = 4 x data = 2): XLA's per-device temporary memory of
            the compiled train step for an activation-heavy model (8 linear-attention layers,
            D = 128, T = 2048: a stage input is 1 MiB, the stage weights 2 MiB), m = 4..32; and
            the CPU step time for an 8.4M-parameter softmax model (D = 256, T = 256), m = 4, 8, 16
            (--quick: m = 4, 8 for both).
Writes results.json and pipeline_schedules.png next to this file and prints the README tables.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments import common  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("eager_1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]
BACKWARD_COST = 3  # the executor recomputes the stage forward in the backward: 1 + 2
DEVICES, PIPE = 8, 4
TIME_MODEL = [
    "--config.model.d_model=256",
    "--config.model.n_layers=8",
    "--config.model.n_heads=4",
    "--config.model.n_kv_heads=4",
    "--config.model.head_dim=64",
    "--config.model.d_ff=1024",
    "--config.data.seq_len=256",
    "--config.checkpoint.enabled=false",
]
MEMORY_MODEL = [
    "--config.model.d_model=128",
    "--config.model.n_layers=8",
    "--config.model.n_heads=4",
    "--config.model.n_kv_heads=4",
    "--config.model.head_dim=32",
    "--config.model.d_ff=512",
    "--config.model.layer_pattern=linear",
    "--config.data.seq_len=2048",
    "--config.checkpoint.enabled=false",
]


def label(name: str, v: int) -> str:
    return f"{name} v={v}" if name == "interleaved_1f1b" else name


# ----------------------------------------------------------------------------- tables


def table_rows(p: int, ms: list[int]) -> list[dict]:
    from jaxsys.parallel import pipeline, schedules

    rows = []
    for m in ms:
        for name, v in SCHEDULES:
            if name == "interleaved_1f1b" and m % p:
                continue
            s = pipeline.make_schedule(name, p, m, v)
            prog = pipeline.lockstep(s)
            formula = Fraction(p - 1, v * m + p - 1)
            # lockstep time in units of a whole device's forward: chunk actions cost 1/v
            t_lock = Fraction(pipeline.lockstep_time(prog, BACKWARD_COST)) / v
            ideal = m * (1 + BACKWARD_COST)
            rows.append(
                dict(
                    p=p,
                    m=m,
                    schedule=name,
                    v=v,
                    bubble=float(schedules.bubble_fraction(s)),
                    bubble_formula=float(formula),
                    bubble_exact=schedules.bubble_fraction(s) == formula,
                    in_flight=max(schedules.peak_in_flight(s)) / v,
                    ticks=prog.ticks,
                    stashed=prog.act_slots / v,
                    lockstep_time=float(t_lock),
                    lockstep_bubble=float(1 - ideal / t_lock),
                )
            )
    return rows


# ----------------------------------------------------------------------------- measured


def worker(n: int, jobs: list[dict]) -> None:
    common.worker_devices(n)

    from jaxsys import data, train
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh

    for job in jobs:
        c = load_config("configs/tiny.py", job["overrides"])
        program = train.build(c, make_mesh(c))
        corpus = data.load_corpus(c.data)
        batch = lambda s: data.global_batch(
            corpus, program.batch_sharding, c.seed, s, c.train.batch_size, c.data.seq_len
        )
        t0 = time.perf_counter()
        step = program.train_step_fn().lower(program.abstract_state(), batch(0)).compile()
        compile_s = time.perf_counter() - t0
        mem = step.memory_analysis()
        state = program.init() if job["steps"] else None
        times, losses = [], []
        for s in range(job["steps"]):
            t0 = time.perf_counter()
            state, metrics = step(state, batch(s))
            losses.append(float(metrics["loss"]))  # blocks: the step is done
            times.append(time.perf_counter() - t0)
        common.emit(
            dict(
                job,
                compile_s=compile_s,
                temp_bytes=mem.temp_size_in_bytes,
                argument_bytes=mem.argument_size_in_bytes,
                step_s=statistics.median(times[1:]) if times else None,
                losses=losses,
                act_slots=program.pipeline_train.act_slots,
                stage_input_bytes=c.train.batch_size
                // c.mesh.data
                // c.train.microbatches
                * c.data.seq_len
                * c.model.d_model
                * 4,
                ticks=program.pipeline_train.ticks,
            )
        )


def measured_jobs(part: str, ms: list[int]) -> list[dict]:
    """part "memory": compile only; "time": also 4 steps."""
    jobs = []
    for m in ms:
        for name, v in SCHEDULES:
            if v > 2 or (name == "interleaved_1f1b" and m % PIPE):
                continue  # 8 layers: at most 8 stages, so v <= 2 on pipe = 4
            model = MEMORY_MODEL if part == "memory" else TIME_MODEL
            overrides = model + [
                f"--config.mesh.pipe={PIPE}",
                f"--config.mesh.data={DEVICES // PIPE}",
                f"--config.train.batch_size={2 * m}",
                f"--config.train.microbatches={m}",
                f"--config.train.pipeline_schedule={name}",
                f"--config.train.virtual_stages={v}",
            ]
            jobs.append(dict(part=part, schedule=name, v=v, m=m, overrides=overrides, steps=4 if part == "time" else 0))
    return jobs


# ----------------------------------------------------------------------------- report


def tables(results: dict) -> str:
    out = []
    for p in sorted({r["p"] for r in results["tables"]}):
        out += [f"### p = {p}: schedule tables and their lockstep packing", ""]
        out += common.markdown_table(
            [
                "m",
                "schedule",
                "bubble (table)",
                "Megatron (p-1)/(vm+p-1)",
                "peak in flight (async)",
                "lockstep ticks",
                "stashed inputs (lockstep)",
                "lockstep bubble",
            ],
            "rlrrrrrr",
            [
                [
                    r["m"],
                    label(r["schedule"], r["v"]),
                    f"{r['bubble']:.3f}",
                    f"{r['bubble_formula']:.3f}{'' if r['bubble_exact'] else ' (differs!)'}",
                    f"{r['in_flight']:g}",
                    r["ticks"],
                    f"{r['stashed']:g}",
                    f"{r['lockstep_bubble']:.3f}",
                ]
                for r in results["tables"]
                if r["p"] == p
            ],
        )
        out.append("")
    mem = [r for r in results["measured"] if r["part"] == "memory"]
    if mem:
        out += [
            f"### measured: XLA temporaries, pipe = {PIPE} x data = {DEVICES // PIPE}, 8 linear-attention "
            "layers, D = 128, T = 2048 (one stage input = 1 MiB)",
            "",
        ]
        rows = []
        for r in mem:
            base = next(b for b in mem if b["m"] == r["m"] and b["schedule"] == "gpipe")
            stash = r["act_slots"] * r["stage_input_bytes"]
            rows.append(
                [
                    r["m"],
                    label(r["schedule"], r["v"]),
                    f"{r['act_slots'] / r['v']:g}",
                    f"{r['temp_bytes'] / 2**20:.2f}",
                    f"{r['temp_bytes'] / base['temp_bytes']:.2f}",
                    f"{(r['temp_bytes'] - stash) / 2**20:.2f}",
                ]
            )
        out += common.markdown_table(
            [
                "m",
                "schedule",
                "stashed inputs (lockstep)",
                "XLA temp MiB/device",
                "vs GPipe",
                "temp − stashed inputs, MiB",
            ],
            "rlrrrr",
            rows,
        )
        out.append("")
    rows = [r for r in results["measured"] if r["part"] == "time"]
    if rows:
        out += [
            f"### measured: CPU step time, pipe = {PIPE} x data = {DEVICES // PIPE}, 8.4M-parameter "
            "softmax model (D = 256, T = 256)",
            "",
        ]
        gpipe = {b["m"]: b for b in rows if b["schedule"] == "gpipe"}
        out += common.markdown_table(
            ["m", "schedule", "lockstep ticks", "CPU step s", "vs GPipe", "loss step 1"],
            "rlrrrr",
            [
                [
                    r["m"],
                    label(r["schedule"], r["v"]),
                    r["ticks"],
                    f"{r['step_s']:.3f}",
                    f"{r['step_s'] / gpipe[r['m']]['step_s']:.2f}",
                    f"{r['losses'][0]:.6f}",
                ]
                for r in rows
            ],
        )
        out.append("")
    return "\n".join(out)


def plot(results: dict, path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    colors = {
        "gpipe": "tab:gray",
        "1f1b": "tab:blue",
        "eager_1f1b": "tab:cyan",
        "interleaved_1f1b v=2": "tab:orange",
        "interleaved_1f1b v=4": "tab:red",
    }
    p = 8 if any(r["p"] == 8 for r in results["tables"]) else 4
    for name, v in SCHEDULES:
        key = label(name, v)
        rows = [r for r in results["tables"] if r["p"] == p and r["schedule"] == name and r["v"] == v]
        ms = [r["m"] for r in rows]
        axes[0].plot(ms, [r["bubble"] for r in rows], "o-", color=colors[key], label=f"{key} (table)")
        axes[0].plot(ms, [r["lockstep_bubble"] for r in rows], "x--", color=colors[key], alpha=0.7)
        axes[1].plot(ms, [r["stashed"] for r in rows], "o-", color=colors[key], label=key)
        meas = [r for r in results["measured"] if r["part"] == "memory" and r["schedule"] == name and r["v"] == v]
        if meas:
            axes[2].plot(
                [r["m"] for r in meas], [r["temp_bytes"] / 2**20 for r in meas], "s-", color=colors[key], label=key
            )
    axes[0].set_title(f"bubble fraction, p = {p}: table (solid) and lockstep executor (dashed)")
    axes[1].set_title(f"stage inputs stashed per device (micro-batches), p = {p}, lockstep")
    axes[2].set_title(f"XLA temporaries per device, pipe = {PIPE}, T = 2048 linear model")
    for ax, ylabel in zip(axes, ("bubble fraction", "micro-batches of activations", "MiB")):
        common.style_axes(ax, "micro-batches m", ylabel, xlog=2)
    common.save_figure(fig, path)


def main() -> int:
    args = common.parse_args(__doc__, worker, quick="m = 4, 8 only in the measured part")
    if args.replot:
        results = common.load_results(HERE)
    else:
        results = {"tables": table_rows(4, [4, 8, 16, 32, 64]) + table_rows(8, [8, 16, 32, 64, 128])}
        bad = [r for r in results["tables"] if not r["bubble_exact"]]
        if bad:
            raise SystemExit(f"schedule bubbles differ from Megatron's formula: {bad}")
        t0 = time.time()
        jobs = measured_jobs("memory", [4, 8] if args.quick else [4, 8, 16, 32]) + measured_jobs(
            "time", [4, 8] if args.quick else [4, 8, 16]
        )
        results["measured"] = common.run_worker(__file__, DEVICES, jobs, timeout=3600, what="devices")
        results["seconds"] = time.time() - t0
        common.save_results(HERE, results)
    plot(results, os.path.join(HERE, "pipeline_schedules.png"))
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
