"""The layout planner (jaxsys/plan.py) against the hand layouts of configs/ and against measured
step times.

    python experiments/planner/run.py                 # parts A and B, ~15 min on 2 cores
    python experiments/planner/run.py --parts b       # part B only (~10 min); --parts c: part C (~10 min)
    python experiments/planner/run.py --quick         # 64 devices only in part A, tiny only in part B
    python experiments/planner/run.py --replot        # tables and plots from results.json

Part A (formulas, no compiles): llama_1b, llama_8b and mixtral_8x7b at 8, 64 and 256 H100s. It
gives the planner's top 5 by predicted step time among the layouts that fit 80 GB by the memory
formula, and the hand layout of the config as shipped (its -1 axis resolved for N): its predicted
step, its memory, and its rank in the planner's list.

Part B (measured, 8 simulated CPU devices): for configs/tiny.py and configs/llama_1b.py:cpu, at
least 12 layouts spread over the planner's ranking (distinct mesh / remat / micro-batches; ring
attention under a pipeline is left out, since XLA:CPU cannot compile it). Each layout's predicted
step time (the `cpu` profile) is set against its measured step time: compiled, two warm-up steps,
then the minimum over 3 timed runs of 5 steps, in CPU seconds of the process (all its threads).
The simulated devices share the host's cores, so the CPU time is the work the 8 devices did
together, and it does not depend on what else runs on the machine; wall time does. Reported:
Spearman's rank correlation. The `cpu` profile's constants come from calibrate_cpu.py's
microbenchmarks (per kernel, per collective, per byte, per FLOP; CPU seconds per device), so the
prediction x 8 devices is in the measurement's unit; the ranking is what is tested. Each part B
run also re-scores the layouts measured before (results.json's previous part B) with the current
model: the same measurements, the old and the new prediction side by side ("rescored").

Part C (compile-only, the TPU compiler through libtpu): for configs/tiny.py on a v5e-8 and
configs/llama_1b.py on a v5p-8 (4 chips), layouts spread over the planner's predicted memory (one
per mesh and remat), each compiled for the target: `cost_model.predicted_memory` against the
compiler's peak bytes per chip (or the bytes it asked for, when it refused for lack of HBM);
Spearman and the ratio predicted / compiled. Bounded: at most PART_C layouts per config.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "llama_1b": "configs/llama_1b.py",
    "llama_8b": "configs/llama_8b.py",
    "mixtral_8x7b": "configs/mixtral_8x7b.py",
}
MEASURED = {"tiny": "configs/tiny.py", "llama_1b_cpu": "configs/llama_1b.py:cpu"}
N_MEASURED = 12
PART_C = {"tiny": ("configs/tiny.py", "v5e-8", 10), "llama_1b": ("configs/llama_1b.py", "v5p-8", 6)}


def spearman(a, b) -> float:
    import numpy as np

    rank = lambda x: np.argsort(np.argsort(np.asarray(x))).astype(float)
    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra**2).sum() * (rb**2).sum()))


def part_a(devices_list) -> list[dict]:
    from jaxsys.analysis import cost_model, hardware
    from jaxsys.analysis import planner as plan_lib
    from jaxsys.config import ConfigError, load_config, validate

    hw = hardware.profile("h100")
    rows = []
    for name, path in CONFIGS.items():
        for n in devices_list:
            start = time.perf_counter()
            base = load_config(os.path.join(common.ROOT, path))
            entry = {"model": name, "devices": n}
            try:
                result = plan_lib.plan(base, n, hw, top=0, log=lambda s: None)
            except ConfigError as e:
                rows.append({**entry, "error": str(e)[:300]})
                continue
            ranked = result["ranked"]
            entry["top"] = [
                dict(
                    layout=c.name,
                    step_ms=c.step["step_s"] * 1e3,
                    mfu=c.step["mfu"],
                    memory_gib=c.memory["total"] / 2**30,
                )
                for c in ranked[:5]
            ]
            entry["valid"], entry["fit"] = len(ranked) + len(result["too_big"]), len(ranked)
            hand = load_config(os.path.join(common.ROOT, path))
            try:
                validate(hand, num_devices=n)
                step, memory = cost_model.predicted_step(hand, hw), cost_model.predicted_memory(hand)
                axes = " x ".join(f"{a}={hand.mesh[a]}" for a in hand.mesh if hand.mesh[a] > 1)
                entry["hand"] = dict(
                    layout=f"{axes} (remat={hand.model.remat}, zero{hand.train.zero_stage})",
                    step_ms=step["step_s"] * 1e3,
                    mfu=step["mfu"],
                    memory_gib=memory["total"] / 2**30,
                    rank=1 + sum(c.step["step_s"] < step["step_s"] for c in ranked),
                    fits=memory["total"] <= hw.hbm_bytes,
                )
            except ConfigError as e:
                entry["hand"] = {"error": str(e).splitlines()[0][:200]}
            entry["seconds"] = time.perf_counter() - start
            print(
                f"part A: {name} on {n}: {entry['fit']} fit, top {entry['top'][0]['layout']}, "
                f"hand rank {entry['hand'].get('rank', '-')} ({entry['seconds']:.0f}s)",
                flush=True,
            )
            rows.append(entry)
    return rows


def pick_layouts(ranked, k: int):
    """k layouts spread evenly over the ranking, one per (mesh, remat, micro-batches)."""
    from jaxsys.config import MESH_AXES

    seen, distinct = set(), []
    for c in ranked:
        o = c.overrides
        if o["mesh.pipe"] > 1 and o["mesh.seq"] > 1:
            continue
        key = (tuple(o[f"mesh.{a}"] for a in MESH_AXES), o["model.remat"], o["train.microbatches"])
        if key not in seen and o["train.zero_stage"] in (0, 2):
            seen.add(key)
            distinct.append(c)
    if len(distinct) <= k:
        return distinct
    return [distinct[round(i * (len(distinct) - 1) / (k - 1))] for i in range(k)]


def worker(n: int, jobs: list) -> None:
    common.worker_devices(n)
    import jax

    from jaxsys.analysis import hardware
    from jaxsys.analysis import planner as plan_lib
    from jaxsys.config import load_config

    hw = hardware.profile("cpu")
    for job in jobs:
        if job.get("part") == "c":
            part_c_worker(job)
            continue
        base = load_config(os.path.join(common.ROOT, job["path"]))
        result = plan_lib.plan(base, n, hw, top=0, log=lambda s: None)
        picks = pick_layouts(result["ranked"], job["k"])
        by_name = {c.name: c for c in result["ranked"] + result["too_big"]}
        again = [by_name[name] for name in job.get("again", []) if name in by_name]  # measured before
        for c in picks + [c for c in again if c not in picks]:
            # CPU seconds of the process: the work, whatever else shares the cores
            runs = common.train_step_seconds(c.config, jax.devices()[:n], clock=time.process_time)
            common.emit(
                dict(
                    model=job["name"],
                    layout=c.name,
                    predicted_ms=c.step["step_s"] * 1e3,
                    measured_ms=min(runs) * 1e3,
                    memory_gib=c.memory["total"] / 2**30,
                    picked=c in picks,
                )
            )


def part_c_worker(job: dict) -> None:
    """Compile layouts of one config for a TPU target; emit predicted and compiled memory."""
    from jaxsys.analysis import planner as plan_lib
    from jaxsys.analysis import targets
    from jaxsys.config import MESH_AXES, load_config

    target = targets.parse(job["target"])
    devices = targets.devices(target)
    base = load_config(os.path.join(common.ROOT, job["path"]))
    result = plan_lib.plan(base, target.chips, targets.hardware(target), top=0, budget=float("inf"), log=lambda s: None)
    chosen: dict = {}
    for c in result["ranked"]:  # plain layouts, one per (mesh, remat), zero 0, fewest micro-batches
        o = c.overrides
        key = (tuple(o[f"mesh.{a}"] for a in MESH_AXES), o["model.remat"])
        if o["train.zero_stage"] == 0 and c.overlap == "-" and o["train.microbatches"] <= max(1, o["mesh.pipe"]):
            chosen.setdefault(key, c)
    ordered = sorted(chosen.values(), key=lambda c: c.memory["total"])
    k = min(job["k"], len(ordered))
    picks = [ordered[round(i * (len(ordered) - 1) / max(1, k - 1))] for i in range(k)]
    for c in picks:
        try:
            compiled = plan_lib.compile_memory(c, devices, target)
        except Exception as e:  # noqa: BLE001 - one layout failing must not stop the sweep
            common.emit(dict(model=job["name"], layout=c.name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        common.emit(
            dict(
                model=job["name"],
                target=job["target"],
                layout=c.name,
                predicted_gib=c.memory["total"] / 2**30,
                compiled_gib=compiled["peak_bytes"] / 2**30,
                compile_s=compiled["compile_s"],
            )
        )


def rescore(part_b: list[dict]) -> list[dict]:
    """The current model's prediction for layouts measured before (matched by name)."""
    from jaxsys.analysis import hardware
    from jaxsys.analysis import planner as plan_lib
    from jaxsys.config import load_config

    hw, out = hardware.profile("cpu"), []
    for name, path in MEASURED.items():
        rows = [r for r in part_b if r["model"] == name]
        if not rows:
            continue
        result = plan_lib.plan(load_config(os.path.join(common.ROOT, path)), 8, hw, top=0, log=lambda s: None)
        by_name = {c.name: c for c in result["ranked"] + result["too_big"]}
        for r in rows:
            c = by_name[r["layout"]]
            out.append({**r, "old_predicted_ms": r.get("old_predicted_ms", r["predicted_ms"])})
            out[-1]["predicted_ms"] = c.step["step_s"] * 1e3
    return out


def tables(results) -> list[str]:
    out = ["## Part A: the planner's top 5 against the hand layout (H100 profile, formulas)", ""]
    for e in results["part_a"]:
        if "error" in e:
            out.append(f"- {e['model']} on {e['devices']}: {e['error']}")
            continue
        out.append(f"**{e['model']} on {e['devices']} devices**: {e['valid']} valid layouts, {e['fit']} fit 80 GB")
        out.append("")
        rows = [
            [i, t["layout"], f"{t['step_ms']:.0f}", f"{t['mfu']:.1%}", f"{t['memory_gib']:.1f}"]
            for i, t in enumerate(e["top"], 1)
        ]
        h = e["hand"]
        if "error" in h:
            rows.append(["hand", f"not valid here: {h['error']}", "-", "-", "-"])
        else:
            rows.append(
                [
                    f"hand (#{h['rank']})",
                    h["layout"],
                    f"{h['step_ms']:.0f}",
                    f"{h['mfu']:.1%}",
                    f"{h['memory_gib']:.1f}" + ("" if h["fits"] else " (does not fit)"),
                ]
            )
        out += common.markdown_table(["#", "layout", "step ms", "MFU", "GiB"], "rlrrr", rows) + [""]
    out += ["## Part B: predicted vs measured step time, 8 simulated CPU devices", ""]
    for name, rho in results["spearman"].items():
        rows = [
            [r["layout"], f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}"]
            for r in results["part_b"]
            if r["model"] == name
        ]
        out += [f"**{name}**: Spearman rho = {rho:.2f} over {len(rows)} layouts", ""]
        out += common.markdown_table(["layout", "predicted ms", "measured CPU ms"], "lrr", rows) + [""]
    for name, rho in results.get("rescored_spearman", {}).items():
        rows = [
            [r["layout"], f"{r['old_predicted_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}"]
            for r in results["rescored"]
            if r["model"] == name
        ]
        out += [
            f"**{name}, the earlier layouts re-scored**: Spearman old model {rho['old']:.2f}, new model "
            f"{rho['new']:.2f}; measured again: new model {rho.get('new_on_remeasured', float('nan')):.2f}, "
            f"first vs second measurement {rho.get('measured_vs_remeasured', float('nan')):.2f}",
            "",
        ]
        for row, r in zip(rows, [r for r in results["rescored"] if r["model"] == name]):
            row.append(f"{r['remeasured_ms']:.1f}" if r.get("remeasured_ms") else "-")
        out += common.markdown_table(
            ["layout", "old predicted ms", "new predicted ms", "measured CPU ms", "measured again"], "lrrrr", rows
        )
        out += [""]
    if results.get("part_c"):
        out += ["## Part C: predicted memory against the TPU compiler's", ""]
        for name, summary in results["part_c_summary"].items():
            rows = [
                [
                    r["layout"],
                    f"{r['predicted_gib']:.2f}",
                    f"{r['compiled_gib']:.2f}",
                    f"{r['predicted_gib'] / r['compiled_gib']:.2f}",
                ]
                for r in results["part_c"]
                if r["model"] == name and "compiled_gib" in r
            ]
            out += [
                f"**{name} on {summary['target']}**: Spearman {summary['spearman']:.2f} over {len(rows)} layouts, "
                f"predicted / compiled {summary['ratio_min']:.2f} - {summary['ratio_max']:.2f} "
                f"(median {summary['ratio_median']:.2f})",
                "",
            ]
            out += common.markdown_table(["layout", "predicted GiB", "compiled GiB", "ratio"], "lrrr", rows) + [""]
            out += [f"- {r['layout']}: {r['error']}" for r in results["part_c"] if r["model"] == name and "error" in r]
    return out


def plot(results, path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(results["spearman"]), figsize=(5 * len(results["spearman"]), 4))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (name, rho) in zip(axes, results["spearman"].items()):
        rows = [r for r in results["part_b"] if r["model"] == name]
        ax.scatter([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
        common.style_axes(
            ax,
            "predicted step (ms, cpu profile)",
            "measured step (CPU ms of the process)",
            f"{name}: Spearman {rho:.2f}",
            xlog=10,
            ylog=10,
            legend=None,
        )
    common.save_figure(fig, path)


def plot_memory(results, path: str) -> None:
    plt = common.pyplot()
    summary = results["part_c_summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 4))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (name, s) in zip(axes, summary.items()):
        rows = [r for r in results["part_c"] if r["model"] == name and "compiled_gib" in r]
        ax.scatter([r["predicted_gib"] for r in rows], [r["compiled_gib"] for r in rows])
        lo = min(min(r["predicted_gib"], r["compiled_gib"]) for r in rows)
        hi = max(max(r["predicted_gib"], r["compiled_gib"]) for r in rows)
        ax.plot([lo, hi], [lo, hi], color="gray", linestyle=":", label="y = x")
        common.style_axes(
            ax,
            "predicted memory (GiB, cost_model)",
            f"compiled peak per chip (GiB, TPU compiler, {s['target']})",
            f"{name}: Spearman {s['spearman']:.2f}",
            xlog=10,
            ylog=10,
        )
    common.save_figure(fig, path)


def _rho(rows, key: str = "predicted_ms") -> float:
    return spearman([r[key] for r in rows], [r["measured_ms"] for r in rows])


def main() -> int:
    args = common.parse_args(
        __doc__,
        worker,
        quick="64 devices in part A; tiny only in part B",
        add=lambda p: p.add_argument("--parts", default="ab", help="which parts to run: a, b, c (e.g. --parts bc)"),
    )
    results = common.load_results(HERE) if os.path.exists(os.path.join(HERE, "results.json")) else {}
    if not args.replot:
        if "a" in args.parts:
            results["part_a"] = part_a([64] if args.quick else [8, 64, 256])
        if "b" in args.parts:
            if results.get("part_b"):  # the earlier measurements, re-scored by the current model
                results["rescored"] = rescore(results.get("rescored") or results["part_b"])
                results["rescored_spearman"] = {
                    name: {
                        "old": _rho([r for r in results["rescored"] if r["model"] == name], "old_predicted_ms"),
                        "new": _rho([r for r in results["rescored"] if r["model"] == name]),
                    }
                    for name in sorted({r["model"] for r in results["rescored"]})
                }
                common.save_results(HERE, results)
            before = results.get("rescored", [])
            jobs = [
                dict(name=name, path=path, k=N_MEASURED, again=[r["layout"] for r in before if r["model"] == name])
                for name, path in MEASURED.items()
                if not (args.quick and name != "tiny")
            ]
            measured = common.run_worker(__file__, 8, jobs, timeout=3600)
            results["part_b"] = [r for r in measured if r["picked"]]
            names = sorted({r["model"] for r in results["part_b"]})
            results["spearman"] = {n: _rho([r for r in results["part_b"] if r["model"] == n]) for n in names}
            # the earlier layouts measured again: the new model on fresh measurements, and how well
            # two measurements of the same layouts agree (the ceiling of any model's rho)
            again = {(r["model"], r["layout"]): r["measured_ms"] for r in measured}
            for r in before:
                r["remeasured_ms"] = again.get((r["model"], r["layout"]))
            for name, rho in results.get("rescored_spearman", {}).items():
                rows = [r for r in before if r["model"] == name and r["remeasured_ms"] is not None]
                rho["new_on_remeasured"] = spearman(
                    [r["predicted_ms"] for r in rows], [r["remeasured_ms"] for r in rows]
                )
                rho["measured_vs_remeasured"] = spearman(
                    [r["measured_ms"] for r in rows], [r["remeasured_ms"] for r in rows]
                )
        if "c" in args.parts:
            jobs = [dict(part="c", name=n, path=p, target=t, k=k) for n, (p, t, k) in PART_C.items()]
            results["part_c"] = common.run_worker(__file__, 1, jobs, timeout=3000)
            results["part_c_summary"] = {}
            for name, (_, target, _) in PART_C.items():
                rows = [r for r in results["part_c"] if r["model"] == name and "compiled_gib" in r]
                if len(rows) < 2:
                    continue
                ratios = sorted(r["predicted_gib"] / r["compiled_gib"] for r in rows)
                results["part_c_summary"][name] = dict(
                    target=target,
                    spearman=spearman([r["predicted_gib"] for r in rows], [r["compiled_gib"] for r in rows]),
                    ratio_min=ratios[0],
                    ratio_max=ratios[-1],
                    ratio_median=ratios[len(ratios) // 2],
                )
        keys = {"a": ["part_a"], "b": ["part_b", "spearman", "rescored", "rescored_spearman"]}
        keys["c"] = ["part_c", "part_c_summary"]
        done = {k: results[k] for p in args.parts for k in keys.get(p, []) if k in results}
        if os.path.exists(os.path.join(HERE, "results.json")):  # another part may have run meanwhile
            results = {**common.load_results(HERE), **done}
        common.save_results(HERE, results)
    print("\n".join(tables(results)))
    plot(results, os.path.join(HERE, "spearman.png"))
    if results.get("part_c_summary"):
        plot_memory(results, os.path.join(HERE, "memory_tpu.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
