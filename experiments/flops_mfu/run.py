"""FLOPs: the analytic count (6N + attention, 8N-style under full remat) against XLA's count of the
compiled train step; and the MFU the tiny config reaches on this CPU.

    .venv/bin/python experiments/flops_mfu/run.py                # everything: ~20 min on 2 shared cores
    .venv/bin/python experiments/flops_mfu/run.py --only flops   # part (a) only
    .venv/bin/python experiments/flops_mfu/run.py --only mfu     # part (b) only
    .venv/bin/python experiments/flops_mfu/run.py --plot-only    # redraw the plot from results.json

Writes results.json and flops_mfu.png next to this file (or under --outdir). Every case runs in its
own subprocess, because the number of simulated CPU devices (XLA_FLAGS) must be set before JAX
starts. Nothing is materialised in part (a): `jaxsys.analysis.report.analyze` compiles the step
against abstract shardings, so the full 1.24B llama_1b compiles on a laptop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (name, config spec, overrides, fake devices, breakdown: also cost the forward and forward+backward)
FLOPS_CASES = [
    ("tiny", "configs/tiny.py", ["--config.model.remat=none"], 1, True),
    ("tiny", "configs/tiny.py", ["--config.model.remat=dots"], 1, False),
    ("tiny", "configs/tiny.py", ["--config.model.remat=full"], 1, False),
    ("tiny hybrid8 (per device)", "configs/tiny.py:hybrid8", ["--config.model.remat=none"], 8, False),
    ("llama_1b:cpu", "configs/llama_1b.py:cpu", ["--config.model.remat=none"], 1, True),
    ("llama_1b:cpu", "configs/llama_1b.py:cpu", ["--config.model.remat=full"], 1, False),
    # The full 1.24B shape (D=2048, L=16, V=128256, T=2048, B=64, bf16) on one device: abstract
    # state, so only compile time matters (~30 s per program on 2 cores; no layers were dropped).
    ("llama_1b (full shape)", "configs/llama_1b.py", ["--config.mesh.fsdp=1", "--config.model.remat=none"], 1, True),
    ("llama_1b (full shape)", "configs/llama_1b.py", ["--config.mesh.fsdp=1", "--config.model.remat=full"], 1, False),
    ("llama_1b (full shape)", "configs/llama_1b.py", ["--config.mesh.fsdp=1", "--config.model.remat=dots"], 1, False),
    ("llama_1b fsdp8 (per device)", "configs/llama_1b.py", ["--config.model.remat=dots"], 8, False),
]

MFU_STEPS = 40
MFU_LOG_EVERY = 5
MFU_CASES = [  # (name, config spec, overrides, fake devices)
    ("tiny, 1 device", "configs/tiny.py", [], 1),
    ("tiny dp8, 8 simulated devices", "configs/tiny.py:dp8", [], 8),
]


# ----------------------------------------------------------------------------- HLO dot FLOPs

_DEF = re.compile(r"%([\w.\-]+) = \(?(\w+)\[([\d,]*)\]")
_DOT = re.compile(
    r"%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* dot\((?:\w+\[[\d,]*\]\S* )?%([\w.\-]+), "
    r"(?:\w+\[[\d,]*\]\S* )?%([\w.\-]+)\),.*?lhs_contracting_dims=\{([\d,]*)\}"
)


def _dims(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def hlo_dot_flops(hlo_text: str) -> tuple[float, int]:
    """2 x (output elements) x (contracted size), summed over every `dot` of an optimized HLO
    module's text (fusion bodies included): the matmul FLOPs XLA executes. Returns (FLOPs, dots)."""
    shapes = {m.group(1): _dims(m.group(3)) for m in _DEF.finditer(hlo_text)}
    total, count = 0.0, 0
    for line in hlo_text.splitlines():
        if " dot(" not in line:
            continue
        m = _DOT.search(line)
        if m is None:
            raise ValueError(f"could not parse a dot: {line[:200]}")
        out, lhs, contracting = _dims(m.group(2)), m.group(3), _dims(m.group(5))
        k = math.prod(shapes[lhs][i] for i in contracting)
        total += 2.0 * math.prod(out) * k
        count += 1
    return total, count


# ----------------------------------------------------------------------------- formulas


def remat_full_dot_flops_per_token(m, seq_len: int) -> float:
    """What full remat really recomputes in matmuls: each layer's forward *except* its last
    projection w_down, whose output the layer's backward never reads (XLA removes it as dead code;
    wo's output is still needed, it feeds the MLP's norm), and never the unembedding (outside the
    rematerialised layer scan). The analytic 8N-style count adds 2N + 4LTNH, i.e. also 2FD per
    layer and 2DV."""
    D, N, K, H, F, L = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.n_layers
    return L * (2.0 * (2 * D * N * H + 2 * D * K * H + 2 * D * F) + 4.0 * seq_len * N * H)


# ----------------------------------------------------------------------------- workers


def _start_jax(devices: int) -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def worker_flops(spec: str, overrides: list[str], devices: int, breakdown_parts: bool) -> dict:
    _start_jax(devices)
    import jax
    import jax.numpy as jnp

    from jaxsys import train
    from jaxsys.analysis import flops as flops_lib
    from jaxsys.analysis import report
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh

    config = load_config(spec, overrides)
    start = time.perf_counter()
    r = report.analyze(config)  # compiles the step twice: rolled (memory) and written out (FLOPs)
    analyze_s = time.perf_counter() - start
    # The same written-out program analyze() costs, compiled again to read its matmuls.
    program = train.build(config, make_mesh(config))
    compiled = report.lower_unrolled(program).compile()
    dots, n_dots = hlo_dot_flops(compiled.as_text())
    cost = compiled.cost_analysis()
    assert float(cost["flops"]) == r["flops_per_device"], (cost["flops"], r["flops_per_device"])

    breakdown = None
    if breakdown_parts:  # XLA's count of the forward alone and of forward + backward, same program
        unrolled = train.build(config, make_mesh(config), unroll_layers=True)
        batch = jax.ShapeDtypeStruct(
            (config.train.batch_size, config.data.seq_len + 1), jnp.int32, sharding=unrolled.batch_sharding
        )
        params = unrolled.abstract_state().params
        parts = {"forward": unrolled.eval_loss_fn(), "forward+backward": unrolled.loss_and_grads_fn()}
        breakdown = {}
        for part, fn in parts.items():
            c = fn.lower(params, batch).compile()
            breakdown[part] = {"flops": float(c.cost_analysis()["flops"]), "dot_flops": hlo_dot_flops(c.as_text())[0]}
        breakdown["step"] = {"flops": r["flops_per_device"], "dot_flops": dots}

    m, T = config.model, config.data.seq_len
    tokens_per_device = config.train.batch_size * T / devices
    layer_matmul_params = flops_lib.matmul_params(m) - m.d_model * m.vocab_size
    expected_dots = r["model_flops_per_device"]
    if m.remat == "full":
        expected_dots += remat_full_dot_flops_per_token(m, T) * tokens_per_device
    return {
        "params": r["params_count"],
        "matmul_params": flops_lib.matmul_params(m),
        "layer_matmul_params": layer_matmul_params,
        "tokens_per_device": tokens_per_device,
        "remat": m.remat,
        "compute_dtype": m.compute_dtype,
        "shape": dict(
            V=m.vocab_size,
            D=m.d_model,
            L=m.n_layers,
            N=m.n_heads,
            K=m.n_kv_heads,
            H=m.head_dim,
            F=m.d_ff,
            T=T,
            B=config.train.batch_size,
        ),
        "flops_per_device": r["flops_per_device"],  # XLA cost analysis, all ops
        "flops_per_device_analytic": r["flops_per_device_analytic"],  # 6N+attn (+2N+attn_fwd: full)
        "model_flops_per_device": r["model_flops_per_device"],  # 6N+attn
        "hlo_dot_flops_per_device": dots,  # matmuls in XLA's optimized HLO
        "hlo_dots": n_dots,
        "expected_dot_flops_per_device": expected_dots,  # 6N+attn + what full remat recomputes
        "non_dot_flops_per_device": r["flops_per_device"] - dots,
        "transcendentals_per_device": float(cost.get("transcendentals", 0.0)),
        "analyze_seconds": analyze_s,
        "breakdown": breakdown,
    }


def worker_mfu(spec: str, overrides: list[str], devices: int) -> dict:
    _start_jax(devices)
    from jaxsys import train
    from jaxsys.analysis import flops as flops_lib
    from jaxsys.analysis import hardware
    from jaxsys.config import base_config, load_config

    overrides = [
        f"--config.train.steps={MFU_STEPS}",
        f"--config.train.log_every={MFU_LOG_EVERY}",
        "--config.train.eval_every=0",
        "--config.train.progress=false",
    ] + overrides
    if "checkpoint" in base_config():  # the final save is not what this measures
        overrides.append("--config.checkpoint.enabled=false")
    config = load_config(spec, overrides)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir:
        metrics_path = os.path.join(workdir, "run", "metrics.jsonl")
        seen, stop = {}, threading.Event()  # records written -> (wall, process CPU) when first seen

        def watch():  # the other jobs on these cores: how much CPU did this process get per window?
            while not stop.is_set():
                try:
                    with open(metrics_path) as f:
                        n = sum(1 for _ in f)
                except OSError:
                    n = 0
                if n not in seen:
                    seen[n] = (time.perf_counter(), time.process_time())
                stop.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        train.main(config, os.path.join(workdir, "run"))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        stop.set()
        watcher.join()
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f]
    # Step 1's window includes the first execution. The record of the step that coincides with the
    # final evaluation is left out too: train.main subtracts the evaluation's wall time from the
    # window, but that evaluation first waits for the asynchronously dispatched training steps, so
    # their compute is subtracted as well and the record's tokens/s and MFU come out far too high.
    later = [r for r in records if r["step"] > 1 and "eval_loss" not in r]
    tokens_per_step = config.train.batch_size * config.data.seq_len
    # CPU time this process got between the record before the first window used and the last one
    # used: the number of cores it had, on average, while the measured steps ran.
    index = {r["step"]: i for i, r in enumerate(records)}
    first, last = index[later[0]["step"]], index[later[-1]["step"]] + 1  # lines written
    cores_obtained = None
    if first in seen and last in seen and seen[last][0] > seen[first][0]:
        cores_obtained = (seen[last][1] - seen[first][1]) / (seen[last][0] - seen[first][0])
    return {
        "records": records,
        "steps_used": [r["step"] for r in later],
        "median_mfu": statistics.median(r["mfu"] for r in later),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
        "train_flops_per_token": flops_lib.train_flops_per_token(config.model, config.data.seq_len),
        "tokens_per_step": tokens_per_step,
        "peak_flops": hardware.job_peak_flops(config.model.compute_dtype),
        "cpu_count": os.cpu_count(),
        "cpu_mhz": hardware.cpu_peak_flops() / (os.cpu_count() or 1) / hardware.CPU_FLOPS_PER_CYCLE / 1e6,
        "flops_per_cycle_per_core": hardware.CPU_FLOPS_PER_CYCLE,
        "wall_seconds": wall,
        "cpu_seconds": cpu,  # this process's CPU time over train.main (compile included)
        "cores_obtained": cores_obtained,  # average over the measured windows (of os.cpu_count())
        "load_average_1min": [load_before, os.getloadavg()[0]],  # other jobs share these cores
    }


# ----------------------------------------------------------------------------- driver


def _subprocess(kind: str, spec: str, overrides: list[str], devices: int, breakdown=False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            kind,
            "--spec",
            spec,
            "--devices",
            str(devices),
            "--out",
            out,
        ]
        + (["--breakdown"] if breakdown else [])
        + ["--", *overrides]
    )
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def run_flops() -> list[dict]:
    rows = []
    for name, spec, overrides, devices, breakdown in FLOPS_CASES:
        print(f"[flops] {name} {' '.join(overrides)} on {devices} device(s)", flush=True)
        r = _subprocess("flops", spec, overrides, devices, breakdown)
        r.update(name=name, spec=spec, overrides=overrides, devices=devices)
        print(
            f"  XLA {r['flops_per_device']:.4e}  analytic {r['flops_per_device_analytic']:.4e}  "
            f"model {r['model_flops_per_device']:.4e}  dots {r['hlo_dot_flops_per_device']:.4e}  "
            f"({r['analyze_seconds']:.0f} s)",
            flush=True,
        )
        rows.append(r)
    return rows


def run_mfu() -> list[dict]:
    rows = []
    for name, spec, overrides, devices in MFU_CASES:
        print(f"[mfu] {name}: {MFU_STEPS} steps", flush=True)
        r = _subprocess("mfu", spec, overrides, devices)
        r.update(name=name, spec=spec, overrides=overrides, devices=devices)
        print(
            f"  median MFU {r['median_mfu']:.2%}, {r['median_tokens_per_s']:,.0f} tokens/s "
            f"(peak {r['peak_flops'] / 1e9:.0f} GFLOP/s)",
            flush=True,
        )
        rows.append(r)
    return rows


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flops, mfu = results.get("flops", []), results.get("mfu", [])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    if flops:
        labels = [f"{r['name']}\nremat {r['remat']}" for r in flops]
        base = [r["model_flops_per_device"] for r in flops]
        x = range(len(flops))
        dots = [r["hlo_dot_flops_per_device"] / b for r, b in zip(flops, base)]
        other = [r["non_dot_flops_per_device"] / b for r, b in zip(flops, base)]
        ax.bar(x, dots, color="tab:blue", label="XLA: matmuls (dots in the optimized HLO)")
        ax.bar(
            x, other, bottom=dots, color="tab:orange", label="XLA: everything else (softmax, norms, rope, AdamW, loss)"
        )
        ax.scatter(
            x,
            [r["flops_per_device_analytic"] / b for r, b in zip(flops, base)],
            marker="_",
            s=600,
            color="black",
            zorder=3,
            label="analytic (report.analyze): 6N+attn, 8N-style if full",
        )
        ax.scatter(
            x,
            [r["expected_dot_flops_per_device"] / b for r, b in zip(flops, base)],
            marker="x",
            color="red",
            zorder=3,
            label="6N+attn + what full remat really recomputes",
        )
        ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("FLOPs per device / model FLOPs (6N + attention)")
        ax.set_ylim(0.8, 1.62)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7, loc="upper center", ncol=2)
        ax.set_title("XLA's FLOP count of the compiled train step vs the analytic count", fontsize=9)
    ax = axes[1]
    for r in mfu:
        used = [rec for rec in r["records"] if rec["step"] in r["steps_used"]]
        got = f", had {r['cores_obtained']:.2f} of {r['cpu_count']} cores" if r.get("cores_obtained") else ""
        ax.plot(
            [rec["step"] for rec in used],
            [rec["mfu"] * 100 for rec in used],
            marker="o",
            label=f"{r['name']}: median {r['median_mfu']:.1%}{got}",
        )
    if mfu:
        peak = mfu[0]["peak_flops"]
        ax.set_title(f"MFU of the tiny config on this CPU (peak {peak / 1e9:.0f} GFLOP/s)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("MFU over the logging window (%)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("flops", "mfu"), default=None)
    parser.add_argument("--outdir", default=HERE)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from results.json")
    parser.add_argument("--worker", choices=("flops", "mfu"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        if args.worker == "flops":
            result = worker_flops(args.spec, args.overrides, args.devices, args.breakdown)
        else:
            result = worker_mfu(args.spec, args.overrides, args.devices)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    os.makedirs(args.outdir, exist_ok=True)
    path = os.path.join(args.outdir, "results.json")
    results = {}
    if os.path.exists(path):  # keep the other part's results when one part is rerun
        with open(path) as f:
            results = json.load(f)
    if args.plot_only:
        plot(results, os.path.join(args.outdir, "flops_mfu.png"))
        return 0
    import platform

    results["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
    }
    if args.only in (None, "flops"):
        results["flops"] = run_flops()
    if args.only in (None, "mfu"):
        results["mfu"] = run_mfu()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.outdir, "flops_mfu.png"))
    print(f"wrote {path} and flops_mfu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
