"""Communication overlap variants (issue 22) in the compiled schedules: TPU targets and XLA:CPU.

    .venv/bin/python experiments/comm_overlap/run.py                   # 17 min wall on 2 cores shared with CI
    .venv/bin/python experiments/comm_overlap/run.py --repeat-timings  # the CPU timings again (~5 min)
    .venv/bin/python experiments/comm_overlap/run.py --quick           # the tiny test model, ~4 min
    .venv/bin/python experiments/comm_overlap/run.py --replot          # tables and plot from results.json

Four variants, each against its plain layout on 8 chips (docs/comm_overlap.md):

  collective_matmul  data 2 x tensor 4, sequence parallelism: plain vs collective matmul
  fsdp_prefetch      fsdp 8: plain vs FSDP prefetch (with the delayed reduce-scatter)
  ladder             data 2 x tensor 4, no SP: standard vs ladder residual
  pipeline_overlap   pipe 4 x data 2, 1F1B, 8 micro-batches: plain vs send/receive overlap

Schedules: the train step of one model (D 1024, F 4096, N 8, H 128, L 4, T 1024, B 16: 2,048 tokens
per chip; fp32 parameters and compute) compiled ahead of time by the TPU compiler (libtpu, no TPU)
for v5p:2x2x2 and v5e-8, and by XLA:CPU on 8 simulated devices. `report.overlap_summary` of each
compiled text: collectives, how many are asynchronous, the share of ring bytes with any compute /
matmuls scheduled between start and done, and the roofline's communication time, hidden (behind the
matmul FLOPs in the window at the target's fp32 peak) and exposed; for all collectives of the step
and for those over the variant's own axis. Beside it the cost model (`cost_model.predicted_step` on
the same hardware profile): its communication time, what its overlap-aware `comm_hidden_s` hides
for the variant's option, and its compute time (the denominator of the exposed share).

Measured (XLA:CPU, 8 simulated devices): step time of plain and variant on a smaller model (D 256,
F 1024, L 4, T 128, B 16; the schedule model takes ~1 min of CPU a step), in CPU seconds of the
process, minimum of 3 runs of 5 steps after 2 warm-up steps. XLA:CPU runs collectives
synchronously, so the ratio says what the variant costs there, not what it hides.

The ladder's loss against the standard residual is ladder_loss.py's (results/ladder_loss.json): not
rerun here, only tabled. Writes results/results.json (--quick: results/results_quick.json, no plot)
and overlap.png next to this file.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from experiments import common  # noqa: E402

NAME = {False: "results.json", True: "results_quick.json"}  # --quick leaves the full run's results alone
TARGETS = ("v5p:2x2x2", "v5e-8", "cpu")
BIG = dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=4096, n_layers=4)
SMALL = dict(d_model=256, n_heads=8, n_kv_heads=8, head_dim=32, d_ff=1024, n_layers=4)
SHAPE = {"big": (16, 1024), "small": (16, 128), "tiny": (16, 32)}  # batch, sequence length
MODELS = {"big": BIG, "small": SMALL, "tiny": dict(n_kv_heads=4, n_layers=4)}
VARIANTS = {
    # name: (mesh, axis of the variant's collectives, plain overrides, variant overrides)
    "collective_matmul": (
        dict(data=2, tensor=4),
        "tensor",
        {"parallel.sequence_parallel": True},
        {"parallel.sequence_parallel": True, "parallel.collective_matmul": True},
    ),
    "fsdp_prefetch": (dict(fsdp=8), "fsdp", {}, {"parallel.fsdp_prefetch": True}),
    "ladder": (dict(data=2, tensor=4), "tensor", {}, {"model.residual": "ladder"}),
    "pipeline_overlap": (
        dict(pipe=4, data=2),
        "pipe",
        {"train.microbatches": 8, "train.pipeline_schedule": "1f1b"},
        {"train.microbatches": 8, "train.pipeline_schedule": "1f1b", "parallel.pipeline_overlap": True},
    ),
}
LABEL = {
    "collective_matmul": "collective matmul (d2 x t4, SP)",
    "fsdp_prefetch": "FSDP prefetch (fsdp 8)",
    "ladder": "ladder residual (d2 x t4)",
    "pipeline_overlap": "pipeline overlap (p4 x d2, 1F1B, m 8)",
}
PAPERS = "Ladder residual: ~30% faster 70B inference at TP 8; T3: ~30% faster communication-heavy sublayers"


def make_config(variant: str, which: str, model: str):
    from tests.helpers import small_config

    mesh, _, plain, over = VARIANTS[variant]
    c = small_config(mesh, **MODELS[model])
    c.train.batch_size, c.data.seq_len = SHAPE[model]
    for key, value in (plain if which == "plain" else over).items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def _summary(s: dict) -> dict:
    keep = ("count", "async", "overlapped", "ring_bytes", "overlapped_fraction", "beside_matmul_fraction")
    return {k: s[k] for k in keep + ("time_s", "hidden_s", "exposed_s")}


def predicted(config, hw, variant: str, which: str) -> dict:
    """The cost model's step for one schedule entry (`cost_model.predicted_step` on the same hardware)."""
    from jaxsys.analysis import cost_model

    step = cost_model.predicted_step(config, hw)
    option = variant if variant in step["comm_hidden_s"] else None  # the ladder: no option in the model
    return dict(
        compute_s=step["compute_s"],
        link_s=step["link_s"],
        comm_s=step["comm_s"],
        exposed_s=step["comm_exposed_s"],
        hidden_s=step["comm_hidden_s"].get(option, 0.0) if option and which == "variant" else 0.0,
        step_s=step["step_s"],
    )


def repredict(results: dict) -> None:
    """The cost model's figures of every schedule entry again, with the current model (no compile)."""
    from jaxsys.analysis import hardware, targets

    for r in results["schedules"]:
        hw = hardware.profile("cpu") if r["target"] == "cpu" else targets.hardware(targets.parse(r["target"]))
        r["predicted"] = predicted(make_config(r["variant"], r["which"], r["model"]), hw, r["variant"], r["which"])


def worker(n: int, jobs: list) -> None:
    common.worker_devices(n)
    import jax

    from jaxsys import train
    from jaxsys.analysis import hardware, report, targets
    from jaxsys.mesh import make_mesh

    for job in jobs:
        variant, which, model = job["variant"], job["which"], job["model"]
        c = make_config(variant, which, model)
        axis = VARIANTS[variant][1]
        if job["kind"] == "time":
            runs = common.train_step_seconds(c, jax.devices()[:n], clock=time.process_time)
            common.emit(dict(kind="time", variant=variant, which=which, model=model, runs_s=runs))
            continue
        if job["target"] == "cpu":
            devices, hw = jax.devices()[:n], hardware.profile("cpu")
        else:
            target = targets.parse(job["target"])
            devices, hw = targets.devices(target)[:n], targets.hardware(target)
        program = train.build(c, make_mesh(c, devices))
        start = time.perf_counter()
        with targets.quiet_libtpu():
            compiled = program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()
        compile_s = time.perf_counter() - start
        text = compiled.as_text()
        whole = report.overlap_summary(text, c, hw)
        own = report.overlap_summary(text, c, hw, select=lambda k: axis in k.axes)
        common.emit(
            dict(
                kind="schedule",
                variant=variant,
                which=which,
                model=model,
                target=job["target"],
                hardware=hw.name,
                compile_s=compile_s,
                temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                step=_summary(whole),
                axis=axis,
                own=_summary(own),
                rows=whole["rows"],
                predicted=predicted(c, hw, variant, which),
            )
        )
        print(f"{variant} {which} {job['target']}: compiled in {compile_s:.0f} s", file=sys.stderr, flush=True)


def _model(model: str) -> dict:
    m = make_config("fsdp_prefetch", "plain", model).model
    keys = ("d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim", "n_layers", "vocab_size", "remat", "compute_dtype")
    return dict({k: m[k] for k in keys}, shape=SHAPE[model])


def run(quick: bool) -> dict:
    big, small = ("tiny", "tiny") if quick else ("big", "small")
    schedule = [
        dict(kind="schedule", variant=v, which=w, model=big, target=t)
        for t in TARGETS
        for v in VARIANTS
        for w in ("plain", "variant")
    ]
    timing = [dict(kind="time", variant=v, which=w, model=small) for v in VARIANTS for w in ("plain", "variant")]
    # two workers on the two cores: the v5p compiles and the CPU timings / the v5e and CPU compiles
    lists = [
        [j for j in schedule if j["target"] == TARGETS[0]] + timing,
        [j for j in schedule if j["target"] != TARGETS[0]],
    ]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda jobs: common.run_worker(__file__, 8, jobs, timeout=3000, what="devices"), lists))
    found = [r for rs in done for r in rs]
    return dict(
        quick=quick,
        models={"schedule": _model(big), "timing": _model(small)},
        schedules=[r for r in found if r["kind"] == "schedule"],
        timings=[r for r in found if r["kind"] == "time"],
        seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------- tables and plot


def _pair(results, variant, target):
    by = {r["which"]: r for r in results["schedules"] if r["variant"] == variant and r["target"] == target}
    return by.get("plain"), by.get("variant")


def _pairs(results):
    """(variant, target, plain, variant) for every variant and target with both schedules."""
    for v in VARIANTS:
        for t in TARGETS:
            a, b = _pair(results, v, t)
            if a is not None and b is not None:
                yield v, t, a, b


def _us(s: float) -> str:
    return f"{s * 1e6:,.0f}"


def share(r: dict, scope: str = "step") -> float:
    """Exposed communication over (compute + exposed communication): compute from the cost model."""
    e = r[scope]["exposed_s"]
    return e / (r["predicted"]["compute_s"] + e)


def tables(results) -> list[str]:
    out = ["### Compiled schedules, whole train step (per chip and step; times in us)", ""]
    header = [
        "variant",
        "target",
        "layout",
        "collectives",
        "async",
        "bytes overlapped: any / matmuls",
        "comm",
        "hidden",
        "exposed",
        "cost model: comm / hidden",
        "compile s",
    ]
    rows = []
    for v in VARIANTS:
        for t in TARGETS:
            for r in _pair(results, v, t):
                if r is None:
                    continue
                s, p = r["step"], r["predicted"]
                rows.append(
                    [
                        LABEL[v] if r["which"] == "plain" and t == TARGETS[0] else "",
                        t if r["which"] == "plain" else "",
                        r["which"],
                        s["count"],
                        s["async"],
                        f"{s['overlapped_fraction']:.0%} / {s['beside_matmul_fraction']:.0%}",
                        _us(s["time_s"]),
                        _us(s["hidden_s"]),
                        _us(s["exposed_s"]),
                        f"{_us(p['link_s'])} / {_us(p['hidden_s'])}",
                        f"{r['compile_s']:.0f}",
                    ]
                )
    out += common.markdown_table(header, "lllrrrrrrrr", rows) + [""]
    out += ["### The variant's own axis (tensor, fsdp, pipe): plain -> variant", ""]
    header = ["variant", "target", "collectives", "async", "bytes overlapped: any / matmuls", "comm us", "hidden us"]
    header += ["exposed us"]
    rows = []
    for v, t, a, b in _pairs(results):
        arrow = lambda f: f"{f(a['own'])} -> {f(b['own'])}"
        rows.append(
            [
                f"{LABEL[v]} [{a['axis']}]",
                t,
                arrow(lambda s: s["count"]),
                arrow(lambda s: s["async"]),
                arrow(lambda s: f"{s['overlapped_fraction']:.0%} / {s['beside_matmul_fraction']:.0%}"),
                arrow(lambda s: _us(s["time_s"])),
                arrow(lambda s: _us(s["hidden_s"])),
                arrow(lambda s: _us(s["exposed_s"])),
            ]
        )
    out += common.markdown_table(header, "llrrrrrr", rows) + [""]
    out += [
        "### Exposed communication: share of the step and reduction against plain",
        "",
        "share = exposed / (compute + exposed), compute from the cost model (formula FLOPs at the fp32 peak;"
        " the pipeline's includes the bubble); reduction = 1 - exposed(variant) / exposed(plain), whole step;"
        " compute + exposed: the same difference over the plain layout's compute + exposed (a roofline step with"
        " memory time left out)."
        " Cost model: its link time less what `hidden_communication` hides for the option (latency left out, as in"
        " the compiled roofline; for the ladder the model has no option: nothing hidden).",
        "",
    ]
    header = ["variant", "target", "compute us", "exposed us: plain -> variant", "share: plain -> variant"]
    header += ["exposed comm reduction", "compute + exposed: reduction"]
    header += ["cost model exposed link us: plain -> variant", "cost model reduction"]
    rows = []
    for v, t, a, b in _pairs(results):
        ea, eb = a["step"]["exposed_s"], b["step"]["exposed_s"]
        pa, pb = (r["predicted"]["link_s"] - r["predicted"]["hidden_s"] for r in (a, b))
        rows.append(
            [
                LABEL[v],
                t,
                _us(a["predicted"]["compute_s"]),
                f"{_us(ea)} -> {_us(eb)}",
                f"{share(a):.0%} -> {share(b):.0%}",
                f"{1 - eb / ea:.0%}" if ea else "-",
                f"{(ea - eb) / (a['predicted']['compute_s'] + ea):.1%}",
                f"{_us(pa)} -> {_us(pb)}",
                f"{1 - pb / pa:.0%}" if pa else "-",
            ]
        )
    out += common.markdown_table(header, "llrrrrrrr", rows) + [""]
    if results.get("timings"):
        m = results["models"]["timing"]
        out += [
            f"### Measured on XLA:CPU, 8 simulated devices (D {m['d_model']}, L {m['n_layers']}, "
            f"B {m['shape'][0]}, T {m['shape'][1]}; CPU seconds of the process, min of 3 x 5 steps)",
            "",
        ]
        t = {(r["variant"], r["which"]): min(r["runs_s"]) for r in results["timings"]}
        again = {(r["variant"], r["which"]): min(r["runs_s"]) for r in results.get("timings_repeat", [])}
        rows = [
            [
                LABEL[v],
                f"{t[(v, 'plain')] * 1e3:.0f}",
                f"{t[(v, 'variant')] * 1e3:.0f}",
                f"{t[(v, 'variant')] / t[(v, 'plain')]:.3f}",
            ]
            + (
                [f"{again[(v, 'plain')] * 1e3:.0f} / {again[(v, 'variant')] * 1e3:.0f}"]
                + [f"{again[(v, 'variant')] / again[(v, 'plain')]:.3f}"]
                if again
                else []
            )
            for v in VARIANTS
            if (v, "plain") in t and (v, "variant") in t
        ]
        header = ["variant", "plain ms", "variant ms", "variant / plain"]
        header += ["again: plain / variant ms", "again: variant / plain"] if again else []
        out += common.markdown_table(header, "lrrr" + "rr" * bool(again), rows) + [""]
    ladder = ladder_table()
    if ladder:
        out += ["### Ladder vs standard residual: loss at equal steps (ladder_loss.py, configs/tiny.py)", ""] + ladder
    return out


def ladder_table() -> list[str]:
    path = os.path.join(RESULTS, "ladder_loss.json")
    if not os.path.exists(path):
        return []
    runs = common.load_results(RESULTS, "ladder_loss.json")["runs"]
    rows = []
    for r in runs:
        curve = r["curve"]
        losses = [p["loss"] for p in curve]
        evals = " / ".join(f"{p['eval_loss']:.3f}" for p in curve if "eval_loss" in p)
        rows.append([r["residual"], f"{losses[-1]:.3f}", f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", evals])
    return common.markdown_table(["residual", "final loss", "mean of last 50", "eval at 100 / 200 / 300"], "lrrr", rows)


def plot(results) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.12
    names = list(VARIANTS)
    x = range(len(names))
    colors = {"v5p:2x2x2": "tab:blue", "v5e-8": "tab:orange", "cpu": "tab:gray"}
    for k, t in enumerate(TARGETS):
        pairs = [_pair(results, v, t) for v in names]
        for j, which in enumerate(("plain", "variant")):
            off = (2 * k + j - 2.5) * width
            rs = [pair[j] for pair in pairs]
            style = dict(
                color=colors[t], alpha=0.45 if which == "plain" else 1.0, hatch="//" if which == "plain" else ""
            )
            label = f"{t} {which}"
            frac = [r["step"]["overlapped_fraction"] * 100 for r in rs]
            axes[0].bar([i + off for i in x], frac, width, label=label, **style)
            matmul = [r["step"]["beside_matmul_fraction"] * 100 for r in rs]
            axes[0].scatter([i + off for i in x], matmul, marker="_", color="k", s=60, zorder=3)
            if t != "cpu":  # CPU's exposed times (~100x, its own roofline) would flatten the TPU bars
                axes[1].bar(
                    [i + off for i in x], [r["step"]["exposed_s"] * 1e3 for r in rs], width, label=label, **style
                )
        off = (k - 1) * 2 * width
        reduction = [100 * (1 - b["step"]["exposed_s"] / a["step"]["exposed_s"]) for a, b in pairs]
        predicted = [100 * (1 - _cm_exposed(b) / _cm_exposed(a)) for a, b in pairs]
        axes[2].bar([i + off for i in x], reduction, 2 * width, color=colors[t], label=f"{t}: compiled schedule")
        axes[2].scatter([i + off for i in x], predicted, marker="D", color=colors[t], edgecolor="k", zorder=3)
    axes[2].scatter([], [], marker="D", color="w", edgecolor="k", label="cost model (same hardware)")
    axes[2].axhline(30, color="k", ls=":", lw=1)
    axes[2].axhline(0, color="k", lw=0.6)
    axes[2].text(3.6, 31.5, "Ladder / T3: ~30% measured speed-up on GPUs (another quantity)", ha="right", fontsize=7)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels([LABEL[v].replace(" (", "\n(") for v in names], fontsize=7)
    common.style_axes(axes[0], "", "% of collective ring bytes", grid="major", legend=7)
    common.style_axes(axes[1], "", "exposed communication per step, ms (roofline)", grid="major", legend=7)
    common.style_axes(axes[2], "", "exposed communication removed vs plain, %", grid="major", legend=7)
    axes[0].set_title("overlapped: async with compute between (bar), with matmuls (tick)", fontsize=9)
    axes[1].set_title("exposed communication, TPU targets (CPU: all exposed, ~100x)", fontsize=9)
    axes[2].set_title("reduction of exposed communication by the variant", fontsize=9)
    common.save_figure(fig, os.path.join(HERE, "overlap.png"))


def _cm_exposed(r: dict) -> float:
    return r["predicted"]["link_s"] - r["predicted"]["hidden_s"]


def main() -> int:
    args = common.parse_args(
        __doc__,
        worker,
        quick="the tiny test model (D 64, L 4, B 16, T 32) everywhere, ~4 min",
        add=lambda p: (
            p.add_argument(
                "--repeat-timings",
                action="store_true",
                help="only time the CPU steps again (results.json's timings_repeat)",
            ),
            p.add_argument("--repredict", action="store_true", help="only the cost model's figures again (no compile)"),
        ),
    )
    if args.repredict:
        results = common.load_results(RESULTS)
        repredict(results)
        common.save_results(RESULTS, results)
    elif args.repeat_timings:
        results = common.load_results(RESULTS)
        jobs = [dict(kind="time", variant=v, which=w, model="small") for v in VARIANTS for w in ("plain", "variant")]
        results["timings_repeat"] = common.run_worker(__file__, 8, jobs, timeout=3000, what="devices")
        common.save_results(RESULTS, results)
    elif not args.replot:
        results = run(args.quick)
        common.save_results(RESULTS, results, NAME[args.quick])
    results = common.load_results(RESULTS, NAME[args.quick])
    print("\n".join(tables(results)))
    if not args.quick:
        plot(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
