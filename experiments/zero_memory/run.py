"""ZeRO stages 0-3: per-device model-state bytes (parameters, gradients, Adam state) of the compiled
train step for N data-parallel devices, beside the ZeRO formula and the paper's mixed-precision one.

    .venv/bin/python experiments/zero_memory/run.py [--quick]

Two sweeps, each device count in its own subprocess (a process can fake only one device count):
  small: configs/tiny.py (0.8M parameters) on N = 1, 2, 4, 8 simulated devices
  large: configs/llama_1b.py (1.24B parameters, all 16 layers) on N = 8, 64, 512 fake devices
         (--quick: 64, 512), one sequence of 2048 tokens per device (batch_size = N); and
         configs/llama_8b.py (8.03B, all 32 layers, tensor=1) on N = 64, 512 (--quick: 512),
         one sequence of 4096 tokens per device
Stages 0, 1, 2 are `mesh.data=N` with `train.zero_stage`; stage 3 is `mesh.fsdp=N`.
Writes results.json and zero_memory.png next to this file and prints the README tables.
"""

from __future__ import annotations

import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments import common  # noqa: E402

SWEEPS = {
    # name: (config, hardware profile, device counts, quick device counts, extra overrides)
    "tiny": ("configs/tiny.py", "cpu", [1, 2, 4, 8], [1, 8], []),
    "llama_1b": ("configs/llama_1b.py", "h100", [8, 64, 512], [64, 512], []),
    # the 8B layout without its tensor parallelism (Ψ is then the whole model on every data rank)
    "llama_8b": (
        "configs/llama_8b.py",
        "h100",
        [64, 512],
        [512],
        ["--config.mesh.tensor=1", "--config.parallel.sequence_parallel=false"],
    ),
}
STEP_COUNTER_BYTES = 4  # TrainState.step, an int32 scalar argument of the step


def stage_overrides(n: int, stage: int, per_device_batch: int | None) -> list[str]:
    o = [
        f"--config.mesh.data={1 if stage == 3 else n}",
        f"--config.mesh.fsdp={n if stage == 3 else 1}",
        f"--config.train.zero_stage={0 if stage == 3 else stage}",
    ]
    if per_device_batch is not None:
        o.append(f"--config.train.batch_size={per_device_batch * n}")
    return o


# ----------------------------------------------------------------------------- worker


def worker(n: int, jobs: list[dict]) -> None:
    """Analyse each job's config on n fake CPU devices; print one JSON line per job."""
    common.worker_devices(n)
    import jax

    from jaxsys.analysis import report
    from jaxsys.config import load_config

    for job in jobs:
        config = load_config(job["config"], job["overrides"])
        t0 = time.time()
        r = report.analyze(config, job["hardware"], jax.devices()[:n], flops=False)
        seconds = time.time() - t0
        batch_bytes = config.train.batch_size // (config.mesh.data * config.mesh.fsdp) * (config.data.seq_len + 1) * 4
        out = dict(
            job,
            seconds=seconds,
            params_count=r["params_count"],
            memory=r["memory"],
            batch_bytes_per_device=batch_bytes,
            collectives=r["collectives"],
            collectives_formula=r["collectives_formula"],
            fits=r["fits"],
        )
        common.emit(out)


# ----------------------------------------------------------------------------- formulas


def jaxsys_formula(psi: float, n: float, stage: int, b_p: int = 4) -> dict:
    """cost_model.zero_memory for a config without tensor parallelism, as a function of N."""
    k = 2 * b_p
    if stage == 3:
        return {"params": b_p * psi / n, "grads": b_p * psi / n, "optimizer": k * psi / n}
    return {
        "params": b_p * psi,
        "grads": b_p * psi / (n if stage >= 2 else 1),
        "optimizer": k * psi / (n if stage >= 1 else 1),
    }


def paper_formula(psi: float, n: float, stage: int, k: int = 12) -> float:
    from jaxsys.analysis.cost_model import paper_zero_memory

    return paper_zero_memory(psi, n, stage, k)


# ----------------------------------------------------------------------------- main


def _gib(x: float) -> str:
    return f"{x / 2**30:.4f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def tables(results: list[dict]) -> str:
    out = []
    for sweep in SWEEPS:
        rows = [r for r in results if r["sweep"] == sweep]
        if not rows:
            continue
        unit, fmt = ("MiB", _mib) if sweep == "tiny" else ("GiB", _gib)
        psi = rows[0]["params_count"]
        out += [f"### {sweep} (Ψ = {psi:,} parameters), {unit} per device", ""]
        cells = []
        for r in rows:
            m, f = r["memory"], r["memory"]["formula"]
            states = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
            cells.append(
                [
                    r["n"],
                    r["stage"],
                    fmt(m["params_bytes"]),
                    fmt(f["params"]),
                    fmt(m["grads_bytes"]),
                    fmt(f["grads"]),
                    fmt(m["optimizer_bytes"]),
                    fmt(f["optimizer"]),
                    fmt(states),
                    fmt(sum(f.values())),
                    fmt(r["paper_k12_bytes"]),
                    fmt(m["argument_bytes"] - r["batch_bytes_per_device"] - STEP_COUNTER_BYTES),
                    fmt(m["peak_bytes_per_device"]),
                ]
            )
        out += common.markdown_table(
            [
                "N",
                "stage",
                "params meas.",
                "params formula",
                "grads meas.",
                "grads formula",
                "optimizer meas.",
                "optimizer formula",
                "states meas.",
                "states formula",
                "paper K=12",
                "XLA args − batch − step",
                "XLA peak",
            ],
            "r" * 13,
            cells,
        )
        out.append("")
        # Communication per step: the claim's other half ("close to plain DP")
        out += [f"#### {sweep}: collective bytes sent per device per step, measured vs formula ({unit})", ""]
        cells = []
        for r in rows:
            if r["n"] == 1:
                continue
            meas = sum(c["bytes"] for c in r["collectives"] if not c["scalar"])
            form = sum(c["bytes"] for c in r["collectives_formula"])
            base = next(b for b in rows if b["n"] == r["n"] and b["stage"] == 0)
            meas0 = sum(c["bytes"] for c in base["collectives"] if not c["scalar"])
            dp = 2 * psi * 4 * (r["n"] - 1) / r["n"]
            cells.append([r["n"], r["stage"], fmt(meas), fmt(form), f"{meas / meas0:.3f}", f"{meas / dp:.3f}"])
        out += common.markdown_table(
            [
                "N",
                "stage",
                "measured (non-scalar collectives)",
                "formula",
                "measured / stage 0",
                "measured / (2Ψb_p(N−1)/N)",
            ],
            "r" * 6,
            cells,
        )
        out.append("")
        # What XLA's buffer assignment shows of each stage's saving, against stage 0 at the same N
        out += [f"#### {sweep}: XLA's peak per device against stage 0 at the same N ({unit})", ""]
        cells = []
        for r in rows:
            if r["n"] == 1 and r["stage"] > 0:
                continue
            base = next(b for b in rows if b["n"] == r["n"] and b["stage"] == 0)
            m, mb = r["memory"], base["memory"]
            states = lambda x: sum(x["formula"].values())
            cells.append(
                [
                    r["n"],
                    r["stage"],
                    fmt(m["peak_bytes_per_device"]),
                    fmt(m["temp_bytes"]),
                    fmt(m["activations_and_workspace_bytes"]),
                    fmt(mb["peak_bytes_per_device"] - m["peak_bytes_per_device"]),
                    fmt(states(mb) - states(m)),
                ]
            )
        out += common.markdown_table(
            [
                "N",
                "stage",
                "XLA peak",
                "XLA temporaries",
                "activations + workspace (peak − states − batch)",
                "peak saving vs stage 0",
                "model-state saving vs stage 0 (formula)",
            ],
            "r" * 7,
            cells,
        )
        out.append("")
    return "\n".join(out)


def check(results: list[dict]) -> list[str]:
    """Measured vs formula: exact for params and grads, optimizer within optax's int32 step counters."""
    problems = []
    for r in results:
        m, f = r["memory"], r["memory"]["formula"]
        g = jaxsys_formula(r["params_count"], r["n"], r["stage"])
        tag = f"{r['sweep']} N={r['n']} stage {r['stage']}"
        for key in ("params", "grads", "optimizer"):
            if not math.isclose(g[key], f[key], rel_tol=1e-12):
                problems.append(f"{tag}: run.py's formula {key} {g[key]} != cost_model {f[key]}")
        if m["params_bytes"] != f["params"]:
            problems.append(f"{tag}: params {m['params_bytes']} != formula {f['params']}")
        if m["grads_bytes"] != f["grads"]:
            problems.append(f"{tag}: grads {m['grads_bytes']} != formula {f['grads']}")
        extra = m["optimizer_bytes"] - f["optimizer"]
        if not 0 <= extra <= 16:
            problems.append(f"{tag}: optimizer {m['optimizer_bytes']} vs formula {f['optimizer']} (+{extra})")
        # communication: every non-scalar collective row (kind, axes) equals the formula's, count and bytes
        meas, form = {}, {}
        for rows_, out_ in ((r["collectives"], meas), (r["collectives_formula"], form)):
            for c in rows_:
                if not c.get("scalar", False):
                    key = (c["kind"], tuple(c["axes"]))
                    count, b = out_.get(key, (0, 0.0))
                    out_[key] = (count + c["count"], b + c["bytes"])
        if set(meas) != set(form) or any(
            meas[k][0] != form[k][0] or not math.isclose(meas[k][1], form[k][1], rel_tol=1e-12) for k in form
        ):
            problems.append(f"{tag}: collectives {meas} != formula {form}")
        # XLA's own buffer assignment: the step's arguments are the state and the batch
        xla_state = m["argument_bytes"] - r["batch_bytes_per_device"] - STEP_COUNTER_BYTES
        if xla_state != m["params_bytes"] + m["optimizer_bytes"]:
            problems.append(
                f"{tag}: XLA argument bytes - batch = {xla_state} != params + optimizer "
                f"{m['params_bytes'] + m['optimizer_bytes']}"
            )
    return problems


def plot(results: list[dict], path: str) -> None:
    import numpy as np

    plt = common.pyplot()

    sweeps = [s for s in SWEEPS if any(r["sweep"] == s for r in results)]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6.2 * len(sweeps), 9.5), squeeze=False)
    colors = {0: "tab:gray", 1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    for col, sweep in enumerate(sweeps):
        rows = [r for r in results if r["sweep"] == sweep]
        psi = rows[0]["params_count"]
        ns = sorted({r["n"] for r in rows})
        grid = np.geomspace(ns[0], ns[-1], 64) if ns[-1] > ns[0] else np.array([ns[0]])
        top, bottom = axes[0][col], axes[1][col]
        for stage in range(4):
            srows = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["n"])
            x = [r["n"] for r in srows]
            meas = [
                r["memory"]["params_bytes"] + r["memory"]["grads_bytes"] + r["memory"]["optimizer_bytes"] for r in srows
            ]
            top.plot(
                grid, [sum(jaxsys_formula(psi, n, stage).values()) for n in grid], "-", color=colors[stage], lw=1.5
            )
            top.plot(grid, [paper_formula(psi, n, stage) for n in grid], ":", color=colors[stage], lw=1.2)
            top.plot(x, meas, "o", color=colors[stage], ms=7, mfc="none", mew=1.8)
            bottom.plot(x, [r["memory"]["peak_bytes_per_device"] for r in srows], "s-", color=colors[stage])
            bottom.plot(x, meas, "o:", color=colors[stage], mfc="none", alpha=0.6)
        common.style_axes(
            top,
            "data-parallel devices N",
            "model-state bytes per device",
            f"{sweep}: Ψ = {psi / 1e6:,.1f}M parameters, params + grads + Adam",
            xlog=2,
            ylog=2,
            legend=None,
        )
        common.style_axes(
            bottom,
            "data-parallel devices N",
            "bytes per device",
            f"{sweep}: XLA peak per device (squares)",
            xlog=2,
            ylog=2,
            legend=None,
        )
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[s], lw=6, label=f"stage {s}") for s in range(4)] + [
        Line2D([], [], color="k", marker="o", mfc="none", ls="none", label="measured (state shardings)"),
        Line2D([], [], color="k", ls="-", label="jaxsys formula: fp32 params, (4 + 4 + 8)Ψ split by stage"),
        Line2D([], [], color="k", ls=":", label="paper, mixed precision: (2 + 2 + 12)Ψ split by stage"),
        Line2D([], [], color="k", marker="s", ls="-", label="XLA peak (buffer assignment)"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=9, frameon=False)
    common.save_figure(fig, path, rect=(0, 0, 1, 0.93))


def main() -> int:
    args = common.parse_args(
        __doc__,
        worker,
        quick="fewer device counts",
        replot="redraw the plot and reprint the tables from results.json, no analysis",
    )
    if args.replot:
        results = common.load_results(HERE)["results"]
        plot(results, os.path.join(HERE, "zero_memory.png"))
        print(tables(results))
        return 0

    from jaxsys.analysis.cost_model import paper_zero_memory

    t_start = time.time()
    results = []
    for sweep, (config, hw, ns, quick_ns, extra) in SWEEPS.items():
        per_device_batch = None if sweep == "tiny" else 1
        for n in quick_ns if args.quick else ns:
            stages = [0] if n == 1 else [0, 1, 2, 3]  # at N = 1 every stage is the same program
            jobs = [
                dict(
                    sweep=sweep,
                    n=n,
                    stage=s,
                    config=config,
                    hardware=hw,
                    overrides=stage_overrides(n, s, per_device_batch) + extra,
                )
                for s in stages
            ]
            t0 = time.time()
            got = common.run_worker(__file__, n, jobs, what="N")
            if n == 1:  # report N = 1 under every stage label
                got = [dict(got[0], stage=s) for s in range(4)]
            print(f"{sweep} N={n}: {len(jobs)} analyses in {time.time() - t0:.0f} s", flush=True)
            results += got
    for r in results:
        r["paper_k12_bytes"] = paper_zero_memory(r["params_count"], r["n"], r["stage"])
        r["paper_k8_bytes"] = paper_zero_memory(r["params_count"], r["n"], r["stage"], k=8)
    problems = check(results)
    summary = {"quick": args.quick, "seconds": time.time() - t_start, "problems": problems, "results": results}
    common.save_results(HERE, summary)
    plot(results, os.path.join(HERE, "zero_memory.png"))
    print(tables(results))
    print(
        "checks:", "all measured state bytes and collectives equal the formula" if not problems else "\n".join(problems)
    )
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
