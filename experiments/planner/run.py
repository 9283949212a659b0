"""The layout planner (jaxsys/plan.py) against the hand layouts of configs/ and against measured
step times.

    python experiments/planner/run.py             # ~15 min on 2 cores
    python experiments/planner/run.py --quick     # 64 devices only in part A, tiny only in part B
    python experiments/planner/run.py --replot    # tables and plot from results.json

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
Spearman's rank correlation. The absolute predictions do not apply; the ranking is what is tested.
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


def spearman(a, b) -> float:
    import numpy as np

    rank = lambda x: np.argsort(np.argsort(np.asarray(x))).astype(float)
    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra**2).sum() * (rb**2).sum()))


def part_a(devices_list) -> list[dict]:
    from jaxsys import plan as plan_lib
    from jaxsys.analysis import cost_model
    from jaxsys.config import ConfigError, load_config, validate

    hw = cost_model.hardware("h100")
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
    import numpy as np

    from jaxsys import plan as plan_lib
    from jaxsys import program as program_lib
    from jaxsys.analysis import cost_model
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh

    hw = cost_model.hardware("cpu")
    for job in jobs:
        base = load_config(os.path.join(common.ROOT, job["path"]))
        result = plan_lib.plan(base, n, hw, top=0, log=lambda s: None)
        for c in pick_layouts(result["ranked"], job["k"]):
            program = program_lib.build(c.config, make_mesh(c.config, jax.devices()[:n]))
            state = program.init()
            cfg = c.config
            tokens = np.random.default_rng(0).integers(
                0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1), dtype=np.int32
            )
            batch = jax.device_put(tokens, program.batch_sharding)
            step = program.train_step_fn().lower(state, batch).compile()
            for _ in range(2):
                state, metrics = step(state, batch)
            jax.block_until_ready(state)
            runs = []
            for _ in range(3):  # CPU seconds of the process: the work, whatever else shares the cores
                start = time.process_time()
                for _ in range(5):
                    state, metrics = step(state, batch)
                jax.block_until_ready(state)
                runs.append((time.process_time() - start) / 5)
            common.emit(
                dict(
                    model=job["name"],
                    layout=c.name,
                    predicted_ms=c.step["step_s"] * 1e3,
                    measured_ms=min(runs) * 1e3,
                    memory_gib=c.memory["total"] / 2**30,
                )
            )


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


def main() -> int:
    args = common.parse_args(__doc__, worker, quick="64 devices in part A; tiny only in part B")
    if not args.replot:
        part_a_rows = part_a([64] if args.quick else [8, 64, 256])
        jobs = [
            dict(name=name, path=path, k=N_MEASURED)
            for name, path in MEASURED.items()
            if not (args.quick and name != "tiny")
        ]
        part_b = common.run_worker(__file__, 8, jobs, timeout=3600)
        names = sorted({r["model"] for r in part_b})
        rho = {
            name: spearman(
                [r["predicted_ms"] for r in part_b if r["model"] == name],
                [r["measured_ms"] for r in part_b if r["model"] == name],
            )
            for name in names
        }
        common.save_results(HERE, {"part_a": part_a_rows, "part_b": part_b, "spearman": rho})
    results = common.load_results(HERE)
    print("\n".join(tables(results)))
    plot(results, os.path.join(HERE, "spearman.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
