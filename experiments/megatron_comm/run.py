"""Megatron tensor parallelism (TP) and TP + sequence parallelism (SP): collective bytes per layer read
from the compiled train step, beside the closed form, and the activation memory SP saves.

    .venv/bin/python experiments/megatron_comm/run.py [--quick]

Model: configs/tiny.py (D=128, L=4, N=8 heads, head_dim 16, F=384, V=256, B=16) with n_kv_heads=8 so
that the heads split over t = 8, remat none. Grid: t in {2, 4, 8} x T in {64, 128, 256} x compute
dtype {float32, bfloat16} x SP {off, on}; plus L=2 at T=128 fp32 (per-layer bytes by difference),
t=1 (no TP) as the memory baseline, and remat full at T=256 fp32 for the memory comparison.
--quick: T=128, float32 only, no remat full. Each t runs in its own subprocess (one fake device
count per process). Memory (XLA's buffer assignment) is compiled at the largest T only; the other
points take the collective half of `report.analyze` (lower the written-out step, parse, formula). Writes results.json and megatron_comm.png next to this file and prints tables.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments import common  # noqa: E402

CONFIG = "configs/tiny.py"
SHORT = {"float32": "f32", "bfloat16": "bf16"}
BYTES = {"float32": 4, "bfloat16": 2}


def job(
    t: int, T: int, dtype: str, sp: bool, remat: str = "none", layers: int | None = None, memory: bool = False
) -> dict:
    o = [
        f"--config.mesh.tensor={t}",
        "--config.model.n_kv_heads=8",
        f"--config.data.seq_len={T}",
        f"--config.model.compute_dtype={dtype}",
        f"--config.parallel.sequence_parallel={str(sp).lower()}",
        f"--config.model.remat={remat}",
    ]
    if layers is not None:
        o.append(f"--config.model.n_layers={layers}")
    return dict(t=t, T=T, dtype=dtype, sp=sp, remat=remat, layers_override=layers, memory_job=memory, overrides=o)


def plan_jobs(quick: bool) -> dict[int, list[dict]]:
    """Memory needs the compiled step (XLA's buffer assignment: the slow part, 5-20 s per job on
    2 shared cores), so only T_mem compiles; the other points only lower the written-out step."""
    Ts = [128] if quick else [64, 128, 256]
    dtypes = ["float32"] if quick else ["float32", "bfloat16"]
    T_mem = max(Ts)
    jobs = {1: [job(1, T_mem, d, False, memory=True) for d in dtypes]}
    if not quick:
        jobs[1].append(job(1, T_mem, "float32", False, remat="full", memory=True))
    for t in (2, 4, 8):
        jobs[t] = [job(t, T, d, sp, memory=T == T_mem) for T in Ts for d in dtypes for sp in (False, True)]
        jobs[t] += [job(t, 128, "float32", sp, layers=2) for sp in (False, True)]
        if not quick:
            jobs[t] += [job(t, T_mem, "float32", sp, remat="full", memory=True) for sp in (False, True)]
    return jobs


# ----------------------------------------------------------------------------- worker


def worker(n: int, jobs: list[dict]) -> None:
    """Analyse each job on n fake CPU devices: the report's collectives and formula rows (and its
    memory for memory jobs), and every tensor-axis collective op by op."""
    common.worker_devices(n)
    import jax

    from jaxsys import train
    from jaxsys.analysis import collectives as collectives_lib
    from jaxsys.analysis import cost_model, report
    from jaxsys.config import MESH_AXES, load_config
    from jaxsys.mesh import make_mesh

    # keep the op-by-op list that report.analyze parses (it calls collectives_lib.parse once), to
    # tell the Megatron activation collectives ([B, T, D] or [B, T/t, D]) from the others
    parse, parsed = collectives_lib.parse, []
    collectives_lib.parse = lambda *args: parsed.append(parse(*args)) or parsed[-1]

    for j in jobs:
        config = load_config(CONFIG, j["overrides"])
        t0 = time.time()
        devices = jax.devices()[:n]
        parsed.clear()
        if j["memory_job"]:
            r = report.analyze(config, "cpu", devices, flops=False)
        else:  # the collective half of report.analyze, without compiling the step
            program = train.build(config, make_mesh(config, devices))
            sizes = {a: int(config.mesh[a]) for a in MESH_AXES}
            predicted, caveats = cost_model.predicted_collectives(config)
            r = dict(
                memory=None,
                collectives=report.measured_collectives(
                    collectives_lib.parse(report.lower_unrolled(program).as_text()), sizes
                ),
                collectives_formula=[
                    dict(technique=p.technique, kind=p.kind, axes=list(p.axes), count=p.count, bytes=p.bytes)
                    for p in predicted
                ],
                formula_caveats=caveats,
                metric_scalars_formula=cost_model.metric_collectives(config),
            )
        assert len(parsed) == 1, len(parsed)
        ops = [
            dict(kind=c.kind, axes=list(c.axes), shape=list(c.shape), dtype=c.dtype, operand_bytes=c.operand_bytes)
            for c in parsed[0]
        ]
        m = config.model
        out = dict(
            j,
            seconds=time.time() - t0,
            B=config.train.batch_size,
            D=m.d_model,
            L=m.n_layers,
            memory=r["memory"],
            collectives=r["collectives"],
            collectives_formula=r["collectives_formula"],
            formula_caveats=r["formula_caveats"],
            metric_scalars_formula=r["metric_scalars_formula"],
            ops=ops,
        )
        common.emit(out)


# ----------------------------------------------------------------------------- analysis


def ring_bytes(kind: str, operand_bytes: float, n: int) -> float:
    from jaxsys.analysis.cost_model import ring_bytes as rb

    return rb(kind, operand_bytes, n)


def activation_ops(r: dict) -> list[dict]:
    """The Megatron f/g (TP) or all-gather/reduce-scatter (SP) ops: tensor axis, compute dtype,
    operand [B, T, D] (all-reduce, reduce-scatter) or [B, T/t, D] (SP all-gather)."""
    B, T, D, t = r["B"], r["T"], r["D"], r["t"]
    shapes = {("all_reduce", (B, T, D)), ("reduce_scatter", (B, T, D)), ("all_gather", (B, T // t, D))}
    return [
        op
        for op in r["ops"]
        if op["axes"] == ["tensor"] and op["dtype"] == SHORT[r["dtype"]] and (op["kind"], tuple(op["shape"])) in shapes
    ]


def summarise(r: dict) -> dict:
    """Per-layer activation bytes measured vs formula, and the whole step's rows vs formula."""
    t, B, T, D, b_c = r["t"], r["B"], r["T"], r["D"], BYTES[r["dtype"]]
    acts = activation_ops(r)
    kinds = collections.Counter(op["kind"] for op in acts)
    act_bytes = sum(ring_bytes(op["kind"], op["operand_bytes"], t) for op in acts)
    units = kinds["all_reduce"] if not r["sp"] else kinds["all_gather"]  # TP all-reduce, or SP AG+RS pair
    formula_layer = 4 * ring_bytes("all_reduce", B * T * D * b_c, t)  # 4 x 2 B T D b_c (t-1)/t
    formula_rows = [row for row in r["collectives_formula"] if row["technique"].startswith("Megatron")]
    formula_units = formula_rows[0]["count"]  # 4L + 2
    formula_layer_from_rows = sum(row["bytes"] for row in formula_rows) * 4 / formula_units
    from jaxsys.analysis.report import by_kind_axes

    measured, formula = by_kind_axes(r["collectives"]), by_kind_axes(r["collectives_formula"])
    step_exact = set(measured) == set(formula) and all(
        measured[k][0] == formula[k][0] and math.isclose(measured[k][1], formula[k][1], rel_tol=1e-12) for k in formula
    )
    scalars = sum(row["count"] for row in r["collectives"] if row["scalar"])
    return dict(
        act_ops=dict(kinds),
        act_units=units,
        act_units_formula=formula_units,
        act_ops_same_size=len({(op["kind"], op["operand_bytes"]) for op in acts}) == len(kinds),
        act_bytes_step=act_bytes,
        act_bytes_step_formula=sum(row["bytes"] for row in formula_rows),
        per_layer_measured=act_bytes * 4 / units if units else 0.0,
        per_layer_formula=formula_layer,
        per_layer_formula_from_rows=formula_layer_from_rows,
        step_rows_exact=step_exact,
        scalars_ok=scalars == r["metric_scalars_formula"],
        other_tensor_ops=[
            dict(kind=op["kind"], shape=op["shape"], dtype=op["dtype"])
            for op in r["ops"]
            if op["axes"] == ["tensor"] and op not in acts and op["shape"] != []
        ],
        measured_rows={f"{k[0]}[{','.join(k[1])}]": v for k, v in measured.items()},
        formula_rows={f"{k[0]}[{','.join(k[1])}]": v for k, v in formula.items()},
    )


def layer_difference(results: list[dict]) -> list[dict]:
    """Per-layer bytes as (step at L=4 - step at L=2) / 2: every tensor-axis collective, no
    classification, and the activation ops alone."""
    out = []
    for short in (r for r in results if r["layers_override"] == 2):
        full = next(
            r
            for r in results
            if r["layers_override"] is None
            and r["remat"] == "none"
            and all(r[k] == short[k] for k in ("t", "T", "dtype", "sp"))
        )
        tensor_bytes = lambda r: sum(
            row["bytes"] for row in r["collectives"] if row["axes"] == ["tensor"] and not row["scalar"]
        )
        dL = full["L"] - short["L"]
        out.append(
            dict(
                t=full["t"],
                T=full["T"],
                dtype=full["dtype"],
                sp=full["sp"],
                all_tensor=(tensor_bytes(full) - tensor_bytes(short)) / dL,
                activation=(full["summary"]["act_bytes_step"] - short["summary"]["act_bytes_step"]) / dL,
                formula=full["summary"]["per_layer_formula"],
                sp_norm_grads=(2 * full["D"] * 4 * 2 * (full["t"] - 1) / full["t"]) if full["sp"] else 0.0,
            )
        )
    return out


# ----------------------------------------------------------------------------- output


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.3f}"


def n_heads() -> int:
    from jaxsys.config import load_config

    return load_config(CONFIG).model.n_heads


def korthikanti_ratio(t: int, s: int, h: int, a: int, remat: str) -> float:
    """Activation bytes per layer with SP over without, by Korthikanti et al. 2022 (Table 2):
    TP  s b h (10 + 24/t + 5 a s/(h t)),  TP+SP  s b h (34/t + 5 a s/(h t));  with full
    recomputation only the layer input is kept, 2 s b h, which SP splits t ways: 1/t."""
    if remat == "full":
        return 1 / t
    attn = 5 * a * s / (h * t)
    return (34 / t + attn) / (10 + 24 / t + attn)


def tables(results: list[dict], diffs: list[dict]) -> str:
    out = ["### Per-layer activation collectives (remat none, L = 4, B = 16, D = 128), KiB sent per device", ""]
    comm = sorted(
        (r for r in results if r["t"] > 1 and r["remat"] == "none" and r["layers_override"] is None),
        key=lambda r: (r["dtype"] != "float32", r["t"], r["T"], r["sp"]),
    )
    rows = []
    for r in comm:
        s = r["summary"]
        ops = ", ".join(f"{v} {k}" for k, v in sorted(s["act_ops"].items()))
        rows.append(
            [
                r["dtype"],
                r["t"],
                r["T"],
                "on" if r["sp"] else "off",
                ops,
                f"{s['act_units']} / {s['act_units_formula']}",
                _kib(s["per_layer_measured"]),
                _kib(s["per_layer_formula"]),
                _kib(s["per_layer_formula_from_rows"]),
                "yes" if s["step_rows_exact"] and s["scalars_ok"] else "NO",
            ]
        )
    out += common.markdown_table(
        [
            "dtype",
            "t",
            "T",
            "SP",
            "ops in step (measured)",
            "units (measured / 4L+2)",
            "per layer measured",
            "per layer formula 8BTDb_c(t−1)/t",
            "formula row × 4/(4L+2)",
            "whole step: every tensor row = formula",
        ],
        "lrrllrrrrl",
        rows,
    )
    out += ["", "### Per layer by difference, (step at L=4 − step at L=2) / 2, KiB (T = 128)", ""]
    out += common.markdown_table(
        [
            "dtype",
            "t",
            "SP",
            "all tensor-axis bytes / layer",
            "activation ops / layer",
            "formula",
            "SP norm-weight grads / layer (2D fp32 all-reduced)",
        ],
        "lrlrrrr",
        [
            [
                d["dtype"],
                d["t"],
                "on" if d["sp"] else "off",
                _kib(d["all_tensor"]),
                _kib(d["activation"]),
                _kib(d["formula"]),
                _kib(d["sp_norm_grads"]),
            ]
            for d in sorted(diffs, key=lambda d: (d["t"], d["sp"]))
        ],
    )
    T_mem = max(r["T"] for r in results)
    out += ["", f"### Activation memory per device with and without SP (T = {T_mem}), MiB", ""]
    rows = []
    mem = [r for r in results if r["memory"] is not None]
    for dtype in ("float32", "bfloat16"):
        for remat in ("none", "full"):
            for t in (1, 2, 4, 8):
                off = next(
                    (r for r in mem if (r["t"], r["dtype"], r["remat"], r["sp"]) == (t, dtype, remat, False)), None
                )
                on = next(
                    (r for r in mem if (r["t"], r["dtype"], r["remat"], r["sp"]) == (t, dtype, remat, True)), None
                )
                if off is None:
                    continue
                a0, p0 = off["memory"]["activations_and_workspace_bytes"], off["memory"]["peak_bytes_per_device"]
                if on is None:
                    rows.append([dtype, remat, t, _mib(a0), "–", "–", "–", _mib(p0), "–", "–"])
                    continue
                a1, p1 = on["memory"]["activations_and_workspace_bytes"], on["memory"]["peak_bytes_per_device"]
                model = korthikanti_ratio(t, T_mem, off["D"], n_heads(), remat)
                model = f"{model:.3f}" if remat == "none" else f"({model:.3f}, stored inputs only)"
                rows.append(
                    [dtype, remat, t, _mib(a0), _mib(a1), f"{a1 / a0:.3f}", model, _mib(p0), _mib(p1), f"{p1 / p0:.3f}"]
                )
    out += common.markdown_table(
        [
            "dtype",
            "remat",
            "t",
            "activations+workspace SP off",
            "SP on",
            "SP on / off",
            "Korthikanti et al. per-layer model, on / off",
            "XLA peak SP off",
            "SP on",
            "peak on / off",
        ],
        "llrrrrrrrr",
        rows,
    )
    full = [r for r in results if r["remat"] == "full" and r["t"] > 1]
    if full:
        out += [
            "",
            f"### Remat full (T = {T_mem}, float32): tensor-axis activation collectives vs the Megatron count",
            "",
        ]
        rows = []
        for r in sorted(full, key=lambda r: (r["t"], r["sp"])):
            s = r["summary"]
            ops = ", ".join(f"{v} {k}" for k, v in sorted(s["act_ops"].items()))
            rows.append(
                [
                    r["t"],
                    "on" if r["sp"] else "off",
                    ops,
                    f"{s['act_units']} / {s['act_units_formula']}",
                    _kib(s["act_bytes_step"]),
                    _kib(s["act_bytes_step_formula"]),
                    "; ".join(r["formula_caveats"]),
                ]
            )
        out += common.markdown_table(
            [
                "t",
                "SP",
                "ops in step (measured)",
                "units measured / formula 4L+2",
                "step bytes measured",
                "formula",
                "caveat",
            ],
            "rllrrrl",
            rows,
        )
    return "\n".join(out)


def check(results: list[dict], diffs: list[dict]) -> list[str]:
    problems = []
    for r in results:
        if r["t"] == 1:
            continue
        s = r["summary"]
        tag = f"t={r['t']} T={r['T']} {r['dtype']} SP={r['sp']} remat={r['remat']} L={r['L']}"
        if not s["act_ops_same_size"]:
            problems.append(f"{tag}: activation ops of one kind differ in size")
        if r["remat"] != "none":
            continue
        if s["act_units"] != s["act_units_formula"]:
            problems.append(f"{tag}: {s['act_units']} activation collectives, formula {s['act_units_formula']}")
        if not math.isclose(s["per_layer_measured"], s["per_layer_formula"], rel_tol=1e-12):
            problems.append(f"{tag}: per layer {s['per_layer_measured']} != {s['per_layer_formula']}")
        if not math.isclose(s["per_layer_formula"], s["per_layer_formula_from_rows"], rel_tol=1e-12):
            problems.append(f"{tag}: closed form {s['per_layer_formula']} != rows {s['per_layer_formula_from_rows']}")
        if not (s["step_rows_exact"] and s["scalars_ok"]):
            problems.append(f"{tag}: step rows measured {s['measured_rows']} vs formula {s['formula_rows']}")
    for d in diffs:
        if not math.isclose(d["activation"], d["formula"], rel_tol=1e-12):
            problems.append(f"L-difference t={d['t']} SP={d['sp']}: {d['activation']} != {d['formula']}")
        if not math.isclose(d["all_tensor"], d["formula"] + d["sp_norm_grads"], rel_tol=1e-12):
            problems.append(
                f"L-difference t={d['t']} SP={d['sp']}: all tensor bytes {d['all_tensor']} != "
                f"{d['formula'] + d['sp_norm_grads']}"
            )
    return problems


def plot(results: list[dict], path: str) -> None:
    import numpy as np
    from matplotlib.lines import Line2D

    plt = common.pyplot()

    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:orange", 8: "tab:green"}
    dtypes = [d for d in ("float32", "bfloat16") if any(r["dtype"] == d for r in results)]
    fig, axes = plt.subplots(1, len(dtypes) + 1, figsize=(5.6 * (len(dtypes) + 1), 5), squeeze=False)
    axes = axes[0]
    comm = [r for r in results if r["t"] > 1 and r["remat"] == "none" and r["layers_override"] is None]
    for ax, dtype in zip(axes, dtypes):
        for t in (2, 4, 8):
            rows = [r for r in comm if r["t"] == t and r["dtype"] == dtype]
            if not rows:
                continue
            B, D, b_c = rows[0]["B"], rows[0]["D"], BYTES[dtype]
            Ts = sorted({r["T"] for r in rows})
            grid = np.linspace(min(Ts) * 0.9, max(Ts) * 1.1, 50)
            ax.plot(grid, [8 * B * T * D * b_c * (t - 1) / t for T in grid], "-", color=colors[t], lw=1.2)
            for sp, marker in ((False, "o"), (True, "x")):
                pts = sorted((r["T"], r["summary"]["per_layer_measured"]) for r in rows if r["sp"] == sp)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker,
                    color=colors[t],
                    ms=9 if sp else 8,
                    mfc="none",
                    mew=1.8,
                )
        common.style_axes(
            ax,
            "sequence length T",
            "bytes sent per device per layer (fwd + bwd)",
            f"Megatron collectives per layer, {dtype} compute",
            xlog=2,
            ylog=2,
            legend=None,
        )
        ax.legend(
            handles=[Line2D([], [], color=colors[t], lw=5, label=f"t = {t}") for t in (2, 4, 8)]
            + [
                Line2D([], [], color="k", ls="-", label="formula 8 B T D b_c (t−1)/t"),
                Line2D([], [], color="k", marker="o", mfc="none", ls="none", label="TP: 4 all-reduces"),
                Line2D([], [], color="k", marker="x", ls="none", label="TP+SP: 4 AG + 4 RS"),
            ],
            fontsize=8,
        )
    ax = axes[-1]
    T_mem = max(r["T"] for r in results)
    mem = [r for r in results if r["memory"] is not None]
    styles = {
        ("float32", "none"): ("tab:blue", "fp32, remat none"),
        ("bfloat16", "none"): ("tab:orange", "bf16, remat none"),
        ("float32", "full"): ("tab:green", "fp32, remat full"),
    }
    for (dtype, remat), (color, label) in styles.items():
        for sp, ls, marker in ((False, "-", "o"), (True, "--", "x")):
            pts = sorted(
                (r["t"], r["memory"]["activations_and_workspace_bytes"])
                for r in mem
                if r["dtype"] == dtype and r["remat"] == remat and (r["sp"] == sp or (sp and r["t"] == 1))
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] / 2**20 for p in pts],
                    ls,
                    marker=marker,
                    color=color,
                    label=f"{label}, SP {'on' if sp else 'off'}",
                )
    common.style_axes(
        ax,
        "tensor-parallel size t",
        "activations + workspace per device (MiB)",
        f"XLA memory per device, T = {T_mem} (t = 1: no TP)",
        xlog=2,
        ylog=2,
    )
    common.save_figure(fig, path)


def finish(results: list[dict], extra: dict) -> None:
    for r in results:
        if r["t"] > 1:
            r["summary"] = summarise(r)
    diffs = layer_difference(results)
    problems = check(results, diffs)
    common.save_results(HERE, dict(extra, problems=problems, layer_difference=diffs, results=results))
    plot(results, os.path.join(HERE, "megatron_comm.png"))
    print(tables(results, diffs))
    print("checks:", "every measured figure equals the formula" if not problems else "\n".join(problems))


def main() -> int:
    args = common.parse_args(
        __doc__,
        worker,
        quick="T=128, float32 only, no remat full",
        replot="recompute tables and plot from results.json, no analysis",
    )
    if args.replot:
        old = common.load_results(HERE)
        finish(old["results"], {k: old[k] for k in ("quick", "seconds")})
        return 0
    t_start = time.time()
    results = []
    for t, jobs in plan_jobs(args.quick).items():
        t0 = time.time()
        results += common.run_worker(__file__, t, jobs, what="t")
        print(f"t={t}: {len(jobs)} analyses in {time.time() - t0:.0f} s", flush=True)
    finish(results, dict(quick=args.quick, seconds=time.time() - t_start))
    print(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
