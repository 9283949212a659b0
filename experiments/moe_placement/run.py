"""MoE systems claim (FSMoE, SE-MoE, MoETuner; shared/papers.md): placing the experts on the devices
by their routing statistics evens out the per-device token load and the all-to-all traffic, and
(MoETuner) keeps the experts that consecutive layers route a token to on one device.

    .venv/bin/python experiments/moe_placement/run.py [--steps 300] [--eval-batches 16] [--quick]

For each balance-loss weight (0.01, the default, and 0: no balancing, so the routers skew freely),
in a process with 8 simulated CPU devices:
  1. train a MoE LM (configs/moe.py with every MoE layer: 4 layers of 32 experts, top-2, dropless)
     on the embedded corpus with expert parallelism over all 8 devices (4 experts each), through
     jaxsys.train.main; the run leaves its routing statistics of the last steps in moe_routing.npz;
  2. choose placements from them (jaxsys.parallel.expert_placement.balance): `balanced` (load only)
     and `balanced+colocated` (MoETuner's locality as well);
  3. apply each to the final state (Program.place_experts_fn) and run the training step's forward and
     backward on batches the run never saw, reading what the step itself counts: the copies per
     expert (device load), the traffic matrix (copies from each device to each other: what a
     ragged all-to-all sends) and the co-routing pairs of consecutive layers; and the loss, which a
     placement must not change.
All-to-all bytes per step and device: the padded dispatch (what runs here) sends a fixed
[ep, M, D] buffer whatever the routing (jaxsys.analysis.cost_model, equal to the lowered program);
a ragged all-to-all would send each remote copy's D values 4 times (dispatch and combine, forward
and backward). Writes results.json and moe_placement.png next to this file; prints the README tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import emit, run_worker  # noqa: E402

DEVICES = 8
PLACEMENTS = ("default", "balanced", "balanced+colocated")


def experiment_config(aux_weight: float, steps: int):
    from jaxsys.config import load_config
    c = load_config(os.path.join(ROOT, "configs", "moe.py:ep8"))
    c.model.mlp_pattern = "moe"
    c.model.moe.experts, c.model.moe.d_ff = 32, 48
    c.model.moe.aux_loss_weight = aux_weight
    c.train.steps, c.train.log_every, c.train.eval_every = steps, 50, 0
    c.train.progress = False
    c.checkpoint.every_steps = 0  # the final state only
    return c


def worker(jobs: list[dict]) -> None:
    import jax
    import numpy as np

    from jaxsys import data, train
    from jaxsys.analysis import cost_model
    from jaxsys.checkpoint import Checkpointer
    from jaxsys.mesh import make_mesh
    from jaxsys.parallel import expert_placement as ep_lib

    for job in jobs:
        config = experiment_config(job["aux_weight"], job["steps"])
        workdir = tempfile.mkdtemp(prefix="moe_placement_")
        records = train.main(config, workdir)
        routing = np.load(os.path.join(workdir, "moe_routing.npz"))
        program = train.build(config, make_mesh(config))
        checkpointer = Checkpointer(workdir, config.checkpoint, read_only=True)
        final = checkpointer.restore(program.abstract_state())
        checkpointer.close()

        ep = program.expert_devices
        window_load, window_pairs = routing["load"], routing["pairs"]
        perms = {"default": np.tile(np.arange(config.model.moe.experts), (window_load.shape[0], 1)),
                 "balanced": ep_lib.balance(window_load, ep, colocate=False),
                 "balanced+colocated": ep_lib.balance(window_load, ep, window_pairs, colocate=True)}
        corpus = data.load_corpus(config.data)
        batches = [data.global_batch(corpus, program.batch_sharding, config.seed, job["steps"] + i,
                                     config.train.batch_size, config.data.seq_len)
                   for i in range(job["eval_batches"])]
        grads_fn = program.loss_and_grads_fn(metrics=True)
        place = program.place_experts_fn()
        d, bytes_c = config.model.d_model, 4  # fp32 compute
        padded = [r for r in cost_model.expert_parallel_rows(config) if "dispatch + combine" in r.technique][0]
        result = {"aux_weight": job["aux_weight"], "steps": job["steps"], "ep": ep,
                  "experts": config.model.moe.experts, "layers": int(window_load.shape[0]),
                  "final_loss": records[-1]["loss"], "window_steps": int(routing["steps"]),
                  "padded_bytes_per_step_device": padded.bytes, "placements": {}}
        for name, perm in perms.items():
            state = place(jax.tree.map(lambda a: a.copy(), final), perm)
            loads, pairs, traffic, losses, per_batch_imbalance = 0, 0, 0, [], []
            for batch in batches:
                loss, _, metrics = grads_fn(state.params, batch)
                metrics = jax.tree.map(np.asarray, metrics)
                losses.append(float(loss))
                loads = loads + metrics["moe_load"]
                pairs = pairs + metrics["moe_pairs"]
                traffic = traffic + metrics["moe_traffic"]
                per_batch_imbalance.append(ep_lib.imbalance(metrics["moe_load"], ep))
            n = len(batches)
            remote = traffic * (1 - np.eye(ep, dtype=traffic.dtype))  # [L, src, dst], off the diagonal
            received, sent = remote.sum(1) / n, remote.sum(2) / n  # [L, device] per step
            ragged = lambda rows: rows * d * bytes_c * 4  # dispatch + combine, forward + backward
            result["placements"][name] = {
                "loss": float(np.mean(losses)),
                "device_load": (ep_lib.device_load(loads, ep) / n).tolist(),
                "imbalance": ep_lib.imbalance(loads, ep).tolist(),
                "imbalance_per_batch": np.mean(per_batch_imbalance, axis=0).tolist(),
                "colocation": ep_lib.colocation(pairs, ep),
                "ragged_max_received_bytes": [float(ragged(x)) for x in received.max(1)],
                "ragged_mean_received_bytes": [float(ragged(x)) for x in received.mean(1)],
                "ragged_max_sent_bytes": [float(ragged(x)) for x in sent.max(1)],
                "remote_fraction": float(remote.sum() / traffic.sum()),
            }
        window_placed = {name: ep_lib.imbalance(ep_lib.permute_stats(window_load, None, perm)[0], ep).tolist()
                         for name, perm in perms.items()}
        result["window_imbalance"] = window_placed  # on the statistics the placement was chosen from
        result["expert_load_max_over_mean"] = (window_load.max(1) / window_load.mean(1)).tolist()
        emit(result)


def _table(results: list[dict]) -> str:
    out = []
    for r in results:
        p = r["placements"]
        out += [f"\n### balance-loss weight {r['aux_weight']}: {r['steps']} steps, final loss "
                f"{r['final_loss']:.3f}; {r['experts']} experts x {r['layers']} layers on ep = {r['ep']}\n",
                "| MoE layer | expert load max/mean | device imbalance default | balanced | balanced+colocated "
                "| ragged a2a max received / device, default | balanced | balanced+colocated |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for l in range(r["layers"]):
            mib = lambda name: p[name]["ragged_max_received_bytes"][l] / 2**20
            out.append(f"| {l} | {r['expert_load_max_over_mean'][l]:.2f} | {p['default']['imbalance'][l]:.3f} | "
                       f"{p['balanced']['imbalance'][l]:.3f} | {p['balanced+colocated']['imbalance'][l]:.3f} | "
                       f"{mib('default'):.3f} MiB | {mib('balanced'):.3f} MiB | {mib('balanced+colocated'):.3f} MiB |")
        mean_recv = sum(p["default"]["ragged_mean_received_bytes"]) / 2**20
        out += ["",
                f"- padded all-to-all (what runs here): {r['padded_bytes_per_step_device'] / 2**20:.3f} MiB per step "
                f"and device for all {r['layers']} layers, whatever the placement",
                f"- ragged all-to-all, mean received per device and step (all layers): {mean_recv:.3f} MiB; "
                f"remote share of the copies: " + ", ".join(f"{name} {p[name]['remote_fraction']:.3f}" for name in PLACEMENTS),
                "- co-location of consecutive layers: " + ", ".join(
                    f"{name} {p[name]['colocation']:.3f}" for name in PLACEMENTS),
                "- loss on the held-out batches: " + ", ".join(f"{name} {p[name]['loss']:.6f}" for name in PLACEMENTS)]
    return "\n".join(out)


def _plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 1 + len(results), figsize=(5 * (1 + len(results)), 4))
    width = 0.27
    for i, r in enumerate(results):
        ax = axes[i]
        layers = np.arange(r["layers"])
        for j, name in enumerate(PLACEMENTS):
            ax.bar(layers + (j - 1) * width, r["placements"][name]["imbalance"], width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"device imbalance (max/mean), balance-loss weight {r['aux_weight']}")
        ax.set_xlabel("MoE layer")
        ax.set_xticks(layers)
        ax.legend(fontsize=8)
    worst = max(results, key=lambda r: max(r["placements"]["default"]["imbalance"]))
    layer = int(np.argmax(worst["placements"]["default"]["imbalance"]))
    ax = axes[-1]
    devices = np.arange(worst["ep"])
    for j, name in enumerate(("default", "balanced")):
        ax.bar(devices + (j - 0.5) * 0.4, worst["placements"][name]["device_load"][layer], 0.4, label=name)
    ax.set_title(f"copies per device and step, layer {layer} (weight {worst['aux_weight']})")
    ax.set_xlabel("device of the expert axis")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="30 steps, 4 held-out batches")
    args = parser.parse_args()
    if args.worker:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.worker}"
        os.environ["JAX_PLATFORMS"] = "cpu"
        worker(json.load(sys.stdin))
        return
    steps, evals = (30, 4) if args.quick else (args.steps, args.eval_batches)
    jobs = [dict(aux_weight=w, steps=steps, eval_batches=evals) for w in (0.01, 0.0)]
    results = []
    for job in jobs:  # one process each: a fresh 8-device runtime
        results += run_worker(__file__, DEVICES, [job], timeout=7200, what="aux_weight")
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(HERE, "moe_placement.png"))
    print(_table(results))


if __name__ == "__main__":
    main()
