"""DiLoCo / Streaming DiLoCo / CO2: loss against bytes communicated, at equal tokens, on the embedded
corpus, with 4 islands of 2 simulated CPU devices each (FSDP inside an island).

    .venv/bin/python experiments/diloco/run.py [--quick] [--replot]

Every run trains the same small byte-level model (D=64, L=4, F=192, 0.21M parameters; T=64, global
batch 16, so 4 rows per island and step, 2 per device; AdamW lr 3e-3, cosine, 20 warmup steps) for the same
steps, and is evaluated on the same held-out batches every 100 steps (the outer parameters theta
for the island runs). Variants: plain data parallelism (a gradient all-reduce every step); DiLoCo
with H = 10, 50, 100 (outer Nesterov SGD, lr 0.7, momentum 0.9: the paper's); DiLoCo H = 50 with
int4 outer gradients; Streaming DiLoCo (H = 100, 4 fragments of one layer each, int4); CO2 (H = 50,
the outer update one round late). Bytes: per device, read from the compiled programs' collectives
over `data` (hlo.parse): the step's (DP: the gradients; islands: two scalars of metrics) every
step, plus each outer synchronisation's: every collective whose group spans islands; "wire" is
what a ring moves into each device (all-reduce 2 (g-1)/g x operand, all-gather (g-1) x operand,
g the group size), the outer syncs' operands checked against `outer.round_bytes` of the per-device
shards. The FSDP gathers inside an island are not counted (they stay on the fast links).

Scaled down from the papers (DiLoCo: 8 islands, 150M-parameter models, H = 500 of 88K steps;
Streaming DiLoCo: up to 4B parameters): 500 steps here (--quick: 100), so H = 100 is five rounds.
Writes results.json and diloco.png next to this file and prints the README table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import (  # noqa: E402
    emit,
    load_results,
    markdown_table,
    parse_args,
    pyplot,
    run_worker,
    save_figure,
    save_results,
    style_axes,
    worker_devices,
)

ISLANDS = 4
DEVICES = 8  # mesh data=4 (islands) x fsdp=2 (inside an island)
PAPER = "two orders of magnitude less bandwidth at similar quality (Streaming DiLoCo, Douillard et al. 2025)"

VARIANTS = [
    ("DP", {}),
    ("DiLoCo H=10", dict(method="diloco", every=10)),
    ("DiLoCo H=50", dict(method="diloco", every=50)),
    ("DiLoCo H=100", dict(method="diloco", every=100)),
    ("DiLoCo H=50 int4", dict(method="diloco", every=50, quantize="int4")),
    ("Streaming H=100 P=4 int4", dict(method="diloco", every=100, fragments=4, quantize="int4")),
    ("CO2 H=50", dict(method="co2", every=50)),
    # Streaming DiLoCo's overlap (tau = 5 steps, merge alpha = 0.5), CO2's stabilisers, error feedback
    (
        "Streaming H=100 P=4 int4 tau=5 a=0.5",
        dict(method="diloco", every=100, fragments=4, quantize="int4", overlap_steps=5, merge=0.5),
    ),
    ("CO2 H=50 gap penalty", dict(method="co2", every=50, co2_penalty=True)),
    ("CO2 H=50 gap penalty + clip 1", dict(method="co2", every=50, co2_penalty=True, momentum_clip=1.0)),
    ("DiLoCo H=50 int4 error feedback", dict(method="diloco", every=50, quantize="int4", error_feedback=True)),
    # controls: where the gap to DP comes from, and CO2 without outer momentum
    ("DiLoCo H=1 lr 1 no momentum", dict(method="diloco", every=1, lr=1.0, momentum=0.0, nesterov=False)),
    ("CO2 H=50 no momentum", dict(method="co2", every=50, momentum=0.0, nesterov=False)),
    ("DiLoCo H=50 lr 1 no momentum", dict(method="diloco", every=50, lr=1.0, momentum=0.0, nesterov=False)),
]


def config(steps: int, outer: dict):
    from jaxsys.config import base_config

    c = base_config()
    c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads = 64, 4, 4, 2
    c.model.head_dim, c.model.d_ff = 16, 192
    c.data.seq_len = 64
    c.train.batch_size, c.train.steps, c.train.lr, c.train.warmup_steps = 16, steps, 3e-3, 20
    c.train.log_every, c.train.eval_every, c.train.eval_batches = 50, 100, 8
    c.train.progress = False
    c.checkpoint.enabled = False
    c.mesh.data, c.mesh.fsdp = ISLANDS, DEVICES // ISLANDS
    for key, value in outer.items():
        c.train.outer[key] = value
    return c


def _wire(collective) -> float:
    g = collective.group_size
    factor = {"all_reduce": 2 * (g - 1) / g, "all_gather": g - 1}.get(collective.kind, 1.0)
    return factor * collective.operand_bytes * collective.executions


def worker(n: int, jobs: list) -> None:
    worker_devices(n)
    import dataclasses

    import jax
    from jax.sharding import NamedSharding

    from jaxsys import train
    from jaxsys.analysis import hlo
    from jaxsys.mesh import make_mesh
    from jaxsys.models import params as params_lib
    from jaxsys.optim import outer

    for job in jobs:
        c = config(job["steps"], job["outer"])
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as workdir:
            c.compile_cache.dir = cache  # the byte count below loads the run's programs from it
            train.main(c, workdir)
            records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
            goodput = json.loads(open(os.path.join(workdir, "goodput.jsonl")).readline())
            program = train.build(c, make_mesh(c, jax.devices()[:n]))
            sizes = {a: c.mesh[a] for a in c.mesh}
            state = program.abstract_state()

            def data_collectives(compiled):
                return [x for x in hlo.parse(compiled.as_text()).collectives(sizes) if "data" in x.axes]

            step = data_collectives(program.train_step_fn().lower(state, program.abstract_batch()).compile())
            step_wire = sum(_wire(x) for x in step)
            syncs, formula = [], None
            if outer.enabled(c.train):
                for p in range(c.train.outer.fragments):
                    found = data_collectives(outer.sync_fn(program, p).lower(state).compile())
                    syncs.append(
                        dict(
                            operand=sum(x.operand_bytes * x.executions for x in found),
                            wire=sum(_wire(x) for x in found),
                            kinds=sorted({x.kind for x in found}),
                        )
                    )
                shard = lambda s, p: dataclasses.replace(s, shape=NamedSharding(program.mesh, p).shard_shape(s.shape))
                local = jax.tree.map(shard, program.specs, program.param_pspecs, is_leaf=params_lib.is_spec)
                formula = outer.round_bytes(local, c.train, ISLANDS)
                n_syncs = [
                    sum(p in outer.fragment_due(c.train, s) for s in range(1, c.train.steps + 1))
                    for p in range(c.train.outer.fragments)
                ]
            else:
                n_syncs = []
            total = c.train.steps * step_wire + sum(k * s["wire"] for k, s in zip(n_syncs, syncs))
            peak = max([step_wire] + [s["wire"] for s in syncs])
        emit(
            dict(
                name=job["name"],
                outer=job["outer"],
                steps=c.train.steps,
                tokens=c.train.steps * c.train.batch_size * c.data.seq_len,
                params=params_lib.count(program.specs),
                eval=[(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r],
                train=[(r["step"], r["loss"]) for r in records],
                step_wire=step_wire,
                step_collectives=[dict(kind=x.kind, operand=x.operand_bytes) for x in step],
                syncs=syncs,
                syncs_run=n_syncs,
                formula=formula,
                total_wire=total,
                peak_wire=peak,
                wall_s=goodput["wall_s"],
            )
        )


def report(results: dict) -> None:
    runs = results["runs"]
    dp = next(r for r in runs if r["name"] == "DP")
    rows = []
    for r in runs:
        final = r["eval"][-1][1]
        formula = r["formula"]
        check = (
            "" if formula is None else ("yes" if sum(s["operand"] for s in r["syncs"]) == formula["operand"] else "NO")
        )
        rows.append(
            [
                r["name"],
                f"{final:.3f}",
                f"{final - dp['eval'][-1][1]:+.3f}",
                f"{r['total_wire'] / 2**20:.1f}",
                f"{dp['total_wire'] / r['total_wire']:.0f}x",
                f"{r['peak_wire'] / 2**10:.0f}",
                check,
            ]
        )
    header = ["run", "eval loss", "vs DP", "MiB in / device", "less than DP", "peak KiB / sync", "HLO == formula"]
    print("\n".join(markdown_table(header, "lrrrrrl", rows)))
    print(f"\npaper: {PAPER}")


def plot(results: dict) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.get_cmap("tab20").colors  # more rows than the default cycle's 10 colors
    for i, r in enumerate(results["runs"]):
        steps, losses = zip(*r["eval"])
        color = colors[(2 * i) % 20 + (2 * i) // 20]
        ax1.plot(steps, losses, marker="o", label=r["name"], color=color)
        ax2.scatter(r["total_wire"] / 2**20, r["eval"][-1][1], label=r["name"], color=color)
    top = 3.7  # CO2 with outer momentum oscillates far above: clipped, named in the title
    off = [r["name"] for r in results["runs"] if max(loss for _, loss in r["eval"]) > top]
    for ax in (ax1, ax2):
        ax.set_ylim(1.9, top)
    note = f"\n({', '.join(off)}: above the top)" if off else ""
    style_axes(ax1, "step", "eval loss (theta)", "eval loss at equal tokens" + note, legend=6)
    style_axes(ax2, "MiB received per device", "final eval loss", "loss vs bytes communicated", xlog=10, legend=None)
    save_figure(fig, os.path.join(HERE, "diloco.png"))


def main() -> None:
    add = lambda p: p.add_argument("--only", default="", help="comma-separated variant names: run these, keep the rest")
    args = parse_args(__doc__, worker, quick="100 steps instead of 500", add=add)
    if not args.replot:
        steps = 100 if args.quick else 500
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        jobs = [dict(name=name, outer=o, steps=steps) for name, o in VARIANTS if not only or name in only]
        runs = run_worker(__file__, DEVICES, jobs, timeout=3600, what="islands")
        if only:  # merged into the earlier results, in VARIANTS' order
            done = {r["name"]: r for r in load_results(HERE)["runs"]} | {r["name"]: r for r in runs}
            runs = [done[name] for name, _ in VARIANTS if name in done]
        save_results(HERE, dict(runs=runs, islands=ISLANDS, devices=DEVICES, paper=PAPER))
    results = load_results(HERE)
    report(results)
    plot(results)


if __name__ == "__main__":
    main()
