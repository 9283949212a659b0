"""Sequence parallelism vs tensor parallelism: the longest sequence whose compiled per-device peak
memory fits a fixed byte budget, for P = 2, 4, 8 devices and four layouts.

    .venv/bin/python experiments/sp_vs_tp_memory/run.py            # P = 2, 4, 8, T resolution 64
    .venv/bin/python experiments/sp_vs_tp_memory/run.py --quick    # P = 8 only, resolution 256
    .venv/bin/python experiments/sp_vs_tp_memory/run.py --replot   # tables and plot from results.json

Model: configs/tiny.py (D=128, L=4, N=8 heads, head_dim 16, F=384, V=256, fp32) with n_kv_heads=8
(so that tensor=8 divides the key/value heads; every layout uses the same model), remat full,
reference (materialised-score) attention. Global batch B = 8 sequences for every layout and P, so
every layout processes the same B*T/P tokens per device per step (data=8 holds one sequence per
device).

Layouts (mesh axes over P devices):
  ring    seq=P, ring attention, zigzag load balance (context parallelism: T/P tokens per device)
  tp      tensor=P (Megatron TP; norms, residuals and the embedding output replicated over tensor)
  tp_sp   tensor=P with parallel.sequence_parallel=true (Megatron SP over tensor)
  dp      data=P (nothing split along T: B/P whole sequences per device)

Measure: `report.memory_report(...)["peak_bytes_per_device"]` of the compiled step (XLA's buffer
assignment: arguments + outputs - aliased + temporaries). Budget: 256 MiB per device. The search
over T (multiples of 64) is a bracketing search on "peak <= budget": a quadratic fitted to the
points compiled so far proposes the next T inside the bracket (plain bisection when it would not
shrink the bracket), until the bracket is one step wide. Each P runs in its own subprocess (one
fake device count per process). Writes results.json and sp_vs_tp_memory.png next to this file.
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

CONFIG = "configs/tiny.py"
BUDGET = 256 * 2**20
BATCH = 8
BASE = ["--config.model.n_kv_heads=8", "--config.model.remat=full", f"--config.train.batch_size={BATCH}"]
LAYOUTS = {
    "ring": (
        "seq=P, ring, zigzag",
        lambda p: [
            f"--config.mesh.seq={p}",
            "--config.model.context_parallel=ring",
            "--config.model.context_load_balance=true",
        ],
    ),
    "tp": ("tensor=P (TP)", lambda p: [f"--config.mesh.tensor={p}"]),
    "tp_sp": (
        "tensor=P + Megatron SP",
        lambda p: [f"--config.mesh.tensor={p}", "--config.parallel.sequence_parallel=true"],
    ),
    "dp": ("data=P (baseline)", lambda p: [f"--config.mesh.data={p}"]),
}
MiB = 2**20


# ----------------------------------------------------------------------------- worker


def fit_quadratic(points):
    """peak(T) ~ a T^2 + b T + c through the (T, peak) points (least squares; with two points c is
    fixed at the first point's state bytes, passed as a third point at T = 0)."""
    import numpy as np

    Ts = np.array([p[0] for p in points], float)
    ys = np.array([p[1] for p in points], float)
    A = np.stack([Ts**2, Ts, np.ones_like(Ts)], 1)
    coef, *_ = np.linalg.lstsq(A, ys, rcond=None)
    return coef


def solve(coef, budget):
    a, b, c = coef
    if abs(a) < 1e-30:
        return (budget - c) / b if b > 0 else float("inf")
    disc = b * b - 4 * a * (c - budget)
    if disc < 0:
        return float("inf")
    return (-b + math.sqrt(disc)) / (2 * a)


def search(peak_of, unit, state_bytes, budget, start):
    """Largest multiple of `unit` with peak_of(T) <= budget. peak_of compiles (cached by caller)."""
    points = {}

    def ev(T):
        if T not in points:
            points[T] = peak_of(T)
        return points[T]

    lo, hi = None, None  # largest known fit, smallest known non-fit
    T = start
    for _ in range(40):
        if ev(T) <= budget:
            lo = max(lo or 0, T)
        else:
            hi = min(hi or 10**9, T)
        if lo is not None and hi is not None and hi - lo <= unit:
            break
        # propose from the quadratic through the compiled points (and the state bytes at T = 0)
        pts = sorted(points.items()) + [(0, state_bytes)]
        guess = solve(fit_quadratic(pts), budget)
        cand = int(guess // unit) * unit
        if lo is None and hi is not None:  # nothing fits yet: go below
            cand = min(cand, hi - unit) if cand >= unit else max(unit, (hi // 2) // unit * unit)
        elif hi is None:  # everything fits so far: go above
            cand = max(cand, lo + unit)
            if cand in points:
                cand = lo * 2
        else:
            # inside the bracket; the model's guess and the step above it pin the answer in two
            # compiles when the model is right; otherwise bisect
            if not lo < cand < hi or cand in points:
                cand = (
                    cand + unit
                    if lo < cand + unit < hi and cand + unit not in points
                    else (lo + hi) // 2 // unit * unit
                )
            if cand in points or not lo < cand < hi:
                cand = (lo + hi) // 2 // unit * unit
        T = max(unit, cand)
    return lo, hi, sorted(points.items())


def worker(n: int, jobs: list[dict]) -> None:
    common.worker_devices(n)
    import jax

    from jaxsys import train
    from jaxsys.analysis import report
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh

    devices = jax.devices()[:n]
    for job in jobs:
        layout, unit, budget = job["layout"], job["unit"], job["budget"]
        overrides = BASE + LAYOUTS[layout][1](n)
        log, state, cache = [], {}, {}

        def peak_of(T):
            if T in cache:
                return cache[T]
            config = load_config(CONFIG, overrides + [f"--config.data.seq_len={T}"])
            t0 = time.time()
            program = train.build(config, make_mesh(config, devices))
            compiled = program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()
            mem = report.memory_report(program, compiled)
            mem.pop("formula")
            state.setdefault("bytes", mem["params_bytes"] + mem["optimizer_bytes"] + mem["grads_bytes"])
            log.append(dict(T=T, seconds=time.time() - t0, **mem))
            print(
                f"  P={n} {layout:6s} T={T:6d} peak {mem['peak_bytes_per_device'] / MiB:8.1f} MiB "
                f"({time.time() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            cache[T] = mem["peak_bytes_per_device"]
            return cache[T]

        peak_of(job["start"])  # sets the state bytes used as the fit's T = 0 point
        lo, hi, _ = search(peak_of, unit, state["bytes"], budget, job["start"])
        common.emit(dict(job, P=n, max_T=lo, first_T_over=hi, state_bytes=state["bytes"], evaluations=log))


# ----------------------------------------------------------------------------- output


def fit_ab(r):
    """peak(T) - state = a T^2 + b T, least squares over the compiled points of one search (the
    state bytes, params + optimizer + gradients, are the T-independent part). None below 2 points."""
    import numpy as np

    pts = [(e["T"], e["peak_bytes_per_device"]) for e in r["evaluations"]]
    if len(pts) < 2:
        return None
    T = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts], float) - r["state_bytes"]
    A = np.stack([T**2, T], 1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(a), float(b), float(np.abs(y - A @ np.array([a, b])).max())


def table(results):
    Ps = sorted({r["P"] for r in results})
    out = [
        f"Longest T with XLA peak <= {BUDGET / MiB:.0f} MiB per device (global batch {BATCH}, "
        f"tiny model, remat full), resolution {results[0]['unit']} tokens",
        "",
    ]
    rows = []
    for key, (label, _) in LAYOUTS.items():
        row = [next((r for r in results if r["layout"] == key and r["P"] == p), None) for p in Ps]
        rows.append([label] + [f"{r['max_T']:,}" if r and r["max_T"] else "–" for r in row])
    out += common.markdown_table(["layout"] + [f"P = {p}" for p in Ps], "l" + "r" * len(Ps), rows)
    out += ["", "Ratio of max T to data=P and to TP at the same P:", ""]
    rows = []
    for key, (label, _) in LAYOUTS.items():
        cells = []
        for p in Ps:
            r = next((x for x in results if x["layout"] == key and x["P"] == p), None)
            d = next((x for x in results if x["layout"] == "dp" and x["P"] == p), None)
            t = next((x for x in results if x["layout"] == "tp" and x["P"] == p), None)
            cells.append(
                f"{r['max_T'] / d['max_T']:.2f} / {r['max_T'] / t['max_T']:.2f}"
                if r and d and t and r["max_T"] and d["max_T"] and t["max_T"]
                else "–"
            )
        rows.append([label] + cells)
    out += common.markdown_table(["layout"] + [f"P = {p} vs DP / vs TP" for p in Ps], "l" + "r" * len(Ps), rows)
    out += ["", "Every compiled point (peak, temporaries, activations+workspace in MiB):", ""]
    ordered = sorted(results, key=lambda r: (r["P"], list(LAYOUTS).index(r["layout"])))
    out += common.markdown_table(
        ["P", "layout", "T", "peak", "temp", "act+ws", "compile s"],
        "rlrrrrr",
        [
            [
                r["P"],
                r["layout"],
                f"{e['T']:,}",
                f"{e['peak_bytes_per_device'] / MiB:.1f}",
                f"{e['temp_bytes'] / MiB:.1f}",
                f"{e['activations_and_workspace_bytes'] / MiB:.1f}",
                f"{e['seconds']:.0f}",
            ]
            for r in ordered
            for e in sorted(r["evaluations"], key=lambda e: e["T"])
        ],
    )
    out += ["", "Fit peak = state + a T^2 + b T over the compiled points of each search:", ""]
    rows = []
    for r in ordered:
        f = fit_ab(r)
        if f:
            a, b, res = f
            rows.append(
                [
                    r["P"],
                    r["layout"],
                    len(r["evaluations"]),
                    f"{a:.1f}",
                    f"{b / 1024:.1f}",
                    f"{res / MiB:.2f}",
                    f"{r['state_bytes'] / MiB:.1f}",
                ]
            )
    out += common.markdown_table(
        [
            "P",
            "layout",
            "points",
            "a (B/token^2)",
            "b (KiB/token)",
            "max residual (MiB)",
            "state (params+opt+grads, MiB)",
        ],
        "rlrrrrr",
        rows,
    )
    return "\n".join(out)


def plot(results, path):
    plt = common.pyplot()
    colors = {"ring": "tab:red", "tp": "tab:blue", "tp_sp": "tab:cyan", "dp": "tab:gray"}
    styles = {"ring": "o-", "tp": "s-", "tp_sp": "^-", "dp": "x--"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    Ps = sorted({r["P"] for r in results})
    for key, (label, _) in LAYOUTS.items():
        pts = sorted((r["P"], r["max_T"]) for r in results if r["layout"] == key and r["max_T"])
        ax.plot(
            [p for p, _ in pts],
            [t for _, t in pts],
            styles[key],
            color=colors[key],
            label=label,
            ms=8,
            mfc="none" if key == "tp" else None,
        )
    common.style_axes(
        ax,
        "devices P",
        "longest sequence T that fits",
        f"max T with XLA peak <= {BUDGET / MiB:.0f} MiB/device (B = {BATCH})",
        xlog=2,
        grid="major",
    )
    ax.set_xticks(Ps, [str(p) for p in Ps])
    ax = axes[1]
    Pmax = max(Ps)
    for key, (label, _) in LAYOUTS.items():
        r = next((x for x in results if x["layout"] == key and x["P"] == Pmax), None)
        if not r:
            continue
        pts = sorted((e["T"], e["peak_bytes_per_device"] / MiB) for e in r["evaluations"])
        ax.plot(
            [t for t, _ in pts],
            [m for _, m in pts],
            styles[key][0],
            color=colors[key],
            label=label,
            ms=8,
            mfc="none" if key == "tp" else None,
        )
        f = fit_ab(r)
        if f:
            import numpy as np

            grid = np.linspace(0, max(t for t, _ in pts) * 1.1, 100)
            a, b, _ = f
            ax.plot(grid, (a * grid**2 + b * grid + r["state_bytes"]) / MiB, "-", color=colors[key], lw=1, alpha=0.6)
    ax.axhline(BUDGET / MiB, color="k", ls="--", lw=1, label="budget")
    common.style_axes(
        ax,
        "sequence length T",
        "XLA peak per device (MiB)",
        f"compiled points of the search, P = {Pmax} (lines: state + a T^2 + b T)",
        grid="major",
    )
    ax.set_ylim(0, BUDGET / MiB * 1.6)
    common.save_figure(fig, path)


def finish(results, extra):
    for r in results:
        r.pop("coef", None)  # older results.json: a 3-parameter fit, replaced by fit_ab
    common.save_results(
        HERE, dict(extra, budget_bytes=BUDGET, batch=BATCH, config=CONFIG, base_overrides=BASE, results=results)
    )
    plot(results, os.path.join(HERE, "sp_vs_tp_memory.png"))
    print(table(results))


def main() -> int:
    args = common.parse_args(__doc__, worker, quick="P = 8 only, T resolution 256")
    if args.replot:
        old = common.load_results(HERE)
        finish(old["results"], {k: old[k] for k in ("quick", "seconds")})
        return 0
    t_start = time.time()
    unit = 256 if args.quick else 64
    results = []
    for p in [8] if args.quick else [2, 4, 8]:
        t0 = time.time()
        jobs = [dict(layout=key, unit=unit, budget=BUDGET, start=1024) for key in LAYOUTS]
        results += common.run_worker(__file__, p, jobs, what="P")
        print(
            f"P={p}: {sum(len(r['evaluations']) for r in results if r['P'] == p)} compiles in {time.time() - t0:.0f} s",
            flush=True,
        )
    finish(results, dict(quick=args.quick, seconds=time.time() - t_start))
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
