"""MoE systems claim (FSMoE, SE-MoE, MoETuner; docs/papers.md): placing the experts on the devices
by their routing statistics evens out the per-device token load and the all-to-all traffic, and
(MoETuner) keeps the experts that consecutive layers route a token to on one device.

    .venv/bin/python experiments/moe_placement/run.py [--steps 300] [--batches 16] [--quick]

For each balance-loss weight (0.01, the default, and 0: no balancing, so the routers skew freely),
in processes with 8 simulated CPU devices, a MoE LM (configs/moe.py with every layer MoE: 4 layers
of 32 experts, top-2, dropless) is trained on the embedded corpus with expert parallelism over all 8
devices (4 experts each), through jaxsys.train.main:

  A. placement of the trained model. Placements are chosen (jaxsys.parallel.expert_placement.balance)
     from the final model's routing on `batches` calibration batches: `balanced` (load only) and
     `balanced+colocated` (MoETuner's locality as well); and, to show what stale statistics cost,
     `balanced (run stats)` from what the run itself accumulated over all its steps
     (moe_routing.npz). Each is applied to the final state (Program.place_experts_fn) and the
     training step's forward and backward run on `batches` other held-out batches, reading what the
     step counts: copies per expert (device load), the traffic matrix (copies from each device to
     each other: what a ragged all-to-all sends), the co-routing pairs; and the loss, which a
     placement must not change.
  B. placement during training: the same run with parallel.expert_rebalance_every = steps / 6,
     against the run without; per-step device imbalance and loss from metrics.jsonl.

All-to-all bytes per step and device: the padded dispatch (what runs here) sends a fixed
[ep, M, D] buffer whatever the routing (jaxsys.analysis.cost_model, equal to the lowered program);
a ragged all-to-all sends each remote copy's D values 4 times (dispatch and combine, forward and
backward): max over devices of the received bytes is the straggler's. Writes results.json and
moe_placement.png next to this file; prints the README tables.
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
PLACEMENTS = ("default", "balanced", "balanced+colocated", "balanced (run stats)")


def experiment_config(aux_weight: float, steps: int, rebalance_every: int = 0):
    from jaxsys.config import load_config

    c = load_config(os.path.join(ROOT, "configs", "moe.py:ep8"))
    c.model.mlp_pattern = "moe"
    c.model.moe.experts, c.model.moe.d_ff = 32, 48
    c.model.moe.aux_loss_weight = aux_weight
    c.train.steps, c.train.log_every, c.train.eval_every = steps, 10, 0
    c.train.progress = False
    c.checkpoint.every_steps = 0  # the final state only
    c.parallel.expert_rebalance_every = rebalance_every
    return c


def _curve(records) -> dict:
    return {
        "step": [r["step"] for r in records],
        "loss": [r["loss"] for r in records],
        "imbalance_max": [r["moe_device_imbalance_max"] for r in records],
    }


def worker(jobs: list[dict]) -> None:
    import jax
    import numpy as np

    from jaxsys import data, train
    from jaxsys.analysis import cost_model
    from jaxsys.checkpoint import Checkpointer
    from jaxsys.mesh import make_mesh
    from jaxsys.parallel import expert_placement as ep_lib

    for job in jobs:
        config = experiment_config(job["aux_weight"], job["steps"], job["rebalance_every"])
        workdir = tempfile.mkdtemp(prefix="moe_placement_")
        records = train.main(config, workdir)
        result = {
            "aux_weight": job["aux_weight"],
            "steps": job["steps"],
            "rebalance_every": job["rebalance_every"],
            "curve": _curve(records),
            "placement_notes": [
                {k: v for k, v in r.items() if k.startswith("moe_window")} | {"step": r["step"]}
                for r in records
                if "moe_window_imbalance_after" in r
            ],
        }
        if job["rebalance_every"]:
            emit(result)
            continue
        routing = np.load(os.path.join(workdir, "moe_routing.npz"))
        program = train.build(config, make_mesh(config))
        checkpointer = Checkpointer(workdir, config.checkpoint, read_only=True)
        final = checkpointer.restore(program.abstract_state())
        checkpointer.close()
        ep, n = program.expert_devices, job["batches"]
        corpus = data.load_corpus(config.data)
        batch = lambda i: data.global_batch(
            corpus, program.batch_sharding, config.seed, job["steps"] + i, config.train.batch_size, config.data.seq_len
        )
        grads_fn = program.loss_and_grads_fn(metrics=True)

        def measure(state, batches):
            totals, losses, per_batch = None, [], []
            for b in batches:
                loss, _, metrics = grads_fn(state.params, b)
                metrics = {
                    k: np.asarray(v) for k, v in metrics.items() if k in ("moe_load", "moe_pairs", "moe_traffic")
                }
                totals = metrics if totals is None else {k: totals[k] + metrics[k] for k in totals}
                losses.append(float(loss))
                per_batch.append(ep_lib.imbalance(metrics["moe_load"], ep))
            return totals, losses, per_batch

        calibration, _, _ = measure(final, [batch(i) for i in range(n)])
        held_out = [batch(n + i) for i in range(n)]
        experts = config.model.moe.experts
        perms = {
            "default": np.tile(np.arange(experts), (calibration["moe_load"].shape[0], 1)),
            "balanced": ep_lib.balance(calibration["moe_load"], ep, colocate=False),
            "balanced+colocated": ep_lib.balance(calibration["moe_load"], ep, calibration["moe_pairs"]),
            "balanced (run stats)": ep_lib.balance(routing["load"], ep, colocate=False),
        }
        place = program.place_experts_fn()
        d, bytes_c = config.model.d_model, 4  # fp32 compute
        padded = [r for r in cost_model.expert_parallel_rows(config) if "dispatch + combine" in r.technique][0]
        result.update(
            ep=ep,
            experts=experts,
            layers=int(calibration["moe_load"].shape[0]),
            final_loss=records[-1]["loss"],
            run_stats_steps=int(routing["steps"]),
            padded_bytes_per_step_device=padded.bytes,
            placements={},
            expert_load_max_over_mean=(calibration["moe_load"].max(1) / calibration["moe_load"].mean(1)).tolist(),
            calibration_imbalance={
                name: ep_lib.imbalance(ep_lib.permute_stats(calibration["moe_load"], None, perm)[0], ep).tolist()
                for name, perm in perms.items()
            },
        )
        for name, perm in perms.items():
            totals, losses, per_batch = measure(place(jax.tree.map(lambda a: a.copy(), final), perm), held_out)
            traffic = totals["moe_traffic"]
            remote = traffic * (1 - np.eye(ep, dtype=traffic.dtype))  # [L, src, dst], off the diagonal
            received = remote.sum(1) / n  # [L, device] per step
            ragged = lambda rows: float(rows * d * bytes_c * 4)  # dispatch + combine, forward + backward
            result["placements"][name] = {
                "loss": float(np.mean(losses)),
                "device_load": (ep_lib.device_load(totals["moe_load"], ep) / n).tolist(),
                "imbalance": ep_lib.imbalance(totals["moe_load"], ep).tolist(),
                "imbalance_per_batch": np.mean(per_batch, axis=0).tolist(),
                "colocation": ep_lib.colocation(totals["moe_pairs"], ep),
                "ragged_max_received_bytes": [ragged(x) for x in received.max(1)],
                "ragged_mean_received_bytes": [ragged(x) for x in received.mean(1)],
                "remote_fraction": float(remote.sum() / traffic.sum()),
            }
        emit(result)


def _table(results: list[dict]) -> str:
    out = []
    for r in [r for r in results if not r["rebalance_every"]]:
        p = r["placements"]
        out += [
            f"\n### A. balance-loss weight {r['aux_weight']}: {r['steps']} steps, final loss "
            f"{r['final_loss']:.3f}; {r['experts']} experts x {r['layers']} layers on ep = {r['ep']}\n",
            "Device imbalance (max/mean copies per device) on the held-out batches, and the most any device "
            "receives by a ragged all-to-all per step:\n",
            "| MoE layer | expert load max/mean | "
            + " | ".join(f"imbalance {n}" for n in PLACEMENTS)
            + " | "
            + " | ".join(f"ragged max received, {n}" for n in PLACEMENTS[:3])
            + " |",
            "| --- | ---: | " + " | ".join(["---:"] * (len(PLACEMENTS) + 3)) + " |",
        ]
        for l in range(r["layers"]):
            mib = lambda name: p[name]["ragged_max_received_bytes"][l] / 2**20
            out.append(
                f"| {l} | {r['expert_load_max_over_mean'][l]:.2f} | "
                + " | ".join(f"{p[n]['imbalance'][l]:.3f}" for n in PLACEMENTS)
                + " | "
                + " | ".join(f"{mib(n):.3f} MiB" for n in PLACEMENTS[:3])
                + " |"
            )
        mean_recv = sum(p["default"]["ragged_mean_received_bytes"]) / 2**20
        out += [
            "",
            f"- padded all-to-all (what runs here): {r['padded_bytes_per_step_device'] / 2**20:.3f} MiB per step "
            f"and device for all {r['layers']} layers, whatever the placement",
            f"- ragged all-to-all, mean received per device and step (all layers): {mean_recv:.3f} MiB, every "
            "placement; remote share of the copies: "
            + ", ".join(f"{n} {p[n]['remote_fraction']:.3f}" for n in PLACEMENTS[:3]),
            "- co-location of consecutive layers: "
            + ", ".join(f"{n} {p[n]['colocation']:.3f}" for n in PLACEMENTS[:3]),
            "- imbalance on the calibration batches the placements were chosen from: "
            + "; ".join(f"{n} " + "/".join(f"{x:.3f}" for x in r["calibration_imbalance"][n]) for n in PLACEMENTS[:3]),
            "- loss on the held-out batches: " + ", ".join(f"{n} {p[n]['loss']:.6f}" for n in PLACEMENTS),
        ]
    rebalanced = {r["aux_weight"]: r for r in results if r["rebalance_every"]}
    plain = {r["aux_weight"]: r for r in results if not r["rebalance_every"]}
    if rebalanced:
        out += [
            "\n### B. re-placement during training (parallel.expert_rebalance_every)\n",
            "| balance-loss weight | re-placed after steps | mean device imbalance (max over layers) at the "
            "logged steps after the first re-placement: fixed placement | re-placed | loss bitwise equal "
            "through step | first loss difference | loss difference at the end |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for w, r in rebalanced.items():
            base, curve = plain[w]["curve"], r["curve"]
            replaced = list(range(r["rebalance_every"], r["steps"], r["rebalance_every"]))  # train.main's rule
            first = replaced[0] + 1 if replaced else 0
            after = lambda c: [x for s, x in zip(c["step"], c["imbalance_max"]) if s >= first]
            diffs = [(s, abs(a - b)) for s, a, b in zip(base["step"], base["loss"], curve["loss"])]
            differ = [(s, d) for s, d in diffs if d > 0]
            equal_through = max((s for s, _ in diffs if all(d == 0 for s2, d in diffs if s2 <= s)), default=0)
            out.append(
                f"| {w} | {', '.join(map(str, replaced))} | {sum(after(base)) / len(after(base)):.3f} | "
                f"{sum(after(curve)) / len(after(curve)):.3f} | {equal_through} | "
                + (f"{differ[0][1]:.1e} at step {differ[0][0]}" if differ else "none")
                + f" | {diffs[-1][1]:.1e} |"
            )
    return "\n".join(out)


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    plain = [r for r in results if not r["rebalance_every"]]
    rebalanced = {r["aux_weight"]: r for r in results if r["rebalance_every"]}
    fig, axes = plt.subplots(1, len(plain) + 1, figsize=(5.5 * (len(plain) + 1), 4))
    width = 0.2
    for i, r in enumerate(plain):
        ax = axes[i]
        layers = np.arange(r["layers"])
        for j, name in enumerate(PLACEMENTS):
            ax.bar(layers + (j - 1.5) * width, r["placements"][name]["imbalance"], width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"A. held-out device imbalance, balance loss {r['aux_weight']}", fontsize=9)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("max / mean copies per device")
        ax.set_xticks(layers)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for r in plain:
        c = r["curve"]
        ax.plot(c["step"], c["imbalance_max"], label=f"weight {r['aux_weight']}, fixed placement")
        if r["aux_weight"] in rebalanced:
            c2 = rebalanced[r["aux_weight"]]["curve"]
            ax.plot(
                c2["step"],
                c2["imbalance_max"],
                "--",
                label=f"weight {r['aux_weight']}, re-placed every {rebalanced[r['aux_weight']]['rebalance_every']}",
            )
    ax.set_title("B. device imbalance during training (max over layers)", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batches", type=int, default=16, help="calibration and held-out batches each")
    parser.add_argument("--quick", action="store_true", help="30 steps, 4 batches")
    args = parser.parse_args()
    if args.worker:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.worker}"
        os.environ["JAX_PLATFORMS"] = "cpu"
        worker(json.load(sys.stdin))
        return
    steps, batches = (30, 4) if args.quick else (args.steps, args.batches)
    jobs = [
        dict(aux_weight=w, steps=steps, batches=batches, rebalance_every=every)
        for w in (0.01, 0.0)
        for every in (0, steps // 6)
    ]
    results = []
    for job in jobs:  # one process each: a fresh 8-device runtime
        results += run_worker(__file__, DEVICES, [job], timeout=7200, what="aux_weight")
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(HERE, "moe_placement.png"))
    print(_table(results))


if __name__ == "__main__":
    main()
