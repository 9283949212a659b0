"""GaLore (Zhao et al. 2024): optimizer-state bytes vs rank (formula == measured) on Llama-shaped
models, per device on sharded layouts, and loss curves against AdamW on the embedded corpus at
equal steps.

    .venv/bin/python experiments/galore/run.py [--quick]

Three parts:
  memory   the paper's LLaMA 1B and 7B shapes (its configs/llama_{1b,7b}.json: D=2048/4096,
           F=5461/11008, L=24/32, 32 heads, V=32000, untied) and configs/llama_1b.py (Llama 3.2 1B
           shape, GQA), for a sweep of ranks: the state of `optimizer.make_optimizer` measured with
           jax.eval_shape of its init (no memory allocated), against `galore.state_bytes` + the two
           int32 step counts, and against AdamW's state. One process, no devices needed.
  sharded  the paper's 7B at rank 1024 on 8 fake CPU devices (a subprocess): per-device bytes of
           the built program's optimizer-state shards == `cost_model.zero_memory(config)`, and
           GaLore's collectives per step by `cost_model.galore_rows`.
  loss     configs/tiny.py (0.82M parameters, 300 steps, batch 16 x 128 bytes) on 1 CPU device:
           AdamW and GaLore at ranks 8 and 32 (K = 50, alpha = 0.25, the paper's default) and at
           rank 32 with alpha = 1, same learning rate and schedule; train and eval loss curves.
           --quick: 60 steps.
Writes results.json and galore.png next to this file and prints the README tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import emit, loss_curves, run_worker  # noqa: E402

PAPER_SAVING = 0.655  # "reduces memory usage by up to 65.5% in optimizer states" (abstract)

# the paper's models (jiaweizzhao/GaLore configs/llama_1b.json, llama_7b.json) on configs/llama_8b.py
PAPER_SHAPE = {
    "paper_llama_1b": dict(d_model=2048, d_ff=5461, n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64),
    "paper_llama_7b": dict(d_model=4096, d_ff=11008, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128),
}
MODELS = {  # name: (config, overrides, ranks, the paper's rank for it)
    "paper_llama_1b": ("configs/llama_8b.py", PAPER_SHAPE["paper_llama_1b"], [128, 256, 512, 1024], 512),
    "paper_llama_7b": ("configs/llama_8b.py", PAPER_SHAPE["paper_llama_7b"], [256, 512, 1024, 2048], 1024),
    # GQA: wk, wv are D x K H = 2048 x 512, so 512 is the largest rank all seven weights take
    "llama_1b": ("configs/llama_1b.py", {}, [64, 128, 256, 512], None),
    "tiny": ("configs/tiny.py", {}, [8, 32], None),  # the loss runs' model
}
COUNTS = 8  # GaLore's (or Adam's) int32 step count and the learning-rate schedule's


def overrides(model: dict, extra: dict | None = None) -> list[str]:
    keys = {f"model.{k}": v for k, v in model.items()}
    if model:
        keys.update({"model.vocab_size": 32000, "model.tie_embeddings": False})
    keys.update(extra or {})
    return [f"--config.{k}={v}" for k, v in keys.items()]


# ----------------------------------------------------------------------------- memory


def memory_rows() -> list[dict]:
    import jax
    import numpy as np

    from jaxsys.config import load_config
    from jaxsys.models import params as params_lib
    from jaxsys.models import transformer
    from jaxsys.optim import galore
    from jaxsys.optim import optimizer as optimizer_lib

    def measured(optimizer, abstract) -> int:
        return sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(jax.eval_shape(optimizer.init, abstract))
        )

    rows = []
    for name, (path, model, ranks, paper_rank) in MODELS.items():
        config = load_config(path, overrides(model, {"mesh.tensor": 1, "mesh.fsdp": 1}))
        specs = transformer.param_specs(config.model)
        abstract = params_lib.abstract_params(specs, np.dtype(config.model.param_dtype))
        psi = params_lib.count(specs)
        adamw = measured(optimizer_lib.make_optimizer(config.train, specs), abstract)
        for rank in ranks:
            config.train.optimizer, config.train.galore.rank = "galore", rank
            plans = galore.plan(config.train.galore, specs)
            flat = jax.tree.leaves(plans, is_leaf=lambda x: isinstance(x, galore.LeafPlan))
            chosen = [p for p in flat if p.side != "adam"]
            got = measured(optimizer_lib.make_optimizer(config.train, specs), abstract)
            formula = galore.state_bytes(plans, 4) + COUNTS
            rows.append(
                dict(
                    model=name,
                    params=psi,
                    rank=rank,
                    paper_rank=rank == paper_rank,
                    measured_bytes=got,
                    formula_bytes=formula,
                    adamw_bytes=adamw,
                    saving=1 - got / adamw,
                    projected_params=sum(math.prod(p.shape) for p in chosen),
                    projected_saving=1
                    - sum(p.state_elements() for p in chosen) / sum(2 * math.prod(p.shape) for p in chosen),
                    sides=sorted({p.side for p in chosen}),
                )
            )
            print(
                f"memory {name} r={rank}: {got / 2**30:.3f} GiB vs AdamW {adamw / 2**30:.3f} GiB "
                f"({1 - got / adamw:.1%} less); formula {'==' if got == formula else '!='} measured",
                flush=True,
            )
    return rows


# ----------------------------------------------------------------------------- sharded (worker)

SHARDED = [  # the paper's 7B at its rank on 8 devices
    dict(name="fsdp8", mesh={"mesh.fsdp": 8}),
    dict(name="data8_zero1", mesh={"mesh.data": 8, "train.zero_stage": 1}),
    dict(
        name="data2_fsdp2_tensor2_zero1", mesh={"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.zero_stage": 1}
    ),
]


def worker(n: int, jobs: list[dict]) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jaxsys import train
    from jaxsys.analysis import cost_model
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh

    for job in jobs:
        config = load_config(
            "configs/llama_8b.py",
            overrides(
                PAPER_SHAPE["paper_llama_7b"],
                {
                    "mesh.fsdp": 1,
                    "mesh.tensor": 1,
                    "parallel.sequence_parallel": False,
                    "train.batch_size": n,
                    "train.optimizer": "galore",
                    "train.galore.rank": 1024,
                    **job["mesh"],
                },
            ),
        )
        program = train.build(config, make_mesh(config, jax.devices()[:n]))
        opt = program.abstract_state().opt_state
        shards = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(opt))
        adamw_config = load_config(
            "configs/llama_8b.py",
            overrides(
                PAPER_SHAPE["paper_llama_7b"],
                {"mesh.fsdp": 1, "mesh.tensor": 1, "parallel.sequence_parallel": False, **job["mesh"]},
            ),
        )
        emit(
            dict(
                job,
                measured_bytes=shards,
                formula_bytes=cost_model.zero_memory(config)["optimizer"] + COUNTS,
                adamw_formula_bytes=cost_model.zero_memory(adamw_config)["optimizer"],
                layout_collective_bytes=sum(r.bytes for r in cost_model.predicted_collectives(adamw_config)[0]),
                collectives=[
                    dict(technique=r.technique, kind=r.kind, axes=list(r.axes), count=r.count, bytes=r.bytes)
                    for r in cost_model.galore_rows(config)
                ],
            )
        )


# ----------------------------------------------------------------------------- loss curves

RUNS = {  # name: train overrides
    "adamw": {},
    "galore_r8": {"optimizer": "galore", "galore.rank": 8, "galore.update_every": 50},
    "galore_r32": {"optimizer": "galore", "galore.rank": 32, "galore.update_every": 50},
    "galore_r32_alpha1": {"optimizer": "galore", "galore.rank": 32, "galore.update_every": 50, "galore.scale": 1.0},
}


def loss_runs(steps: int) -> dict:
    return loss_curves(RUNS, steps, log_every=10)


# ----------------------------------------------------------------------------- tables and plot


SHORT = {
    "GaLore projection reduce-scatter (every step)": "R reduce-scatter",
    "GaLore normalised update all-gather (every step)": "N all-gather",
    "GaLore projection all-reduce (every step)": "R all-reduce",
    "GaLore refresh all-gather of G for the SVD (1 step in K)": "refresh: G all-gather",
}


def tables(results: dict) -> str:
    out = [
        "| model | Ψ | rank | GaLore state (measured) | formula + 8 B | AdamW state | saving | "
        "saving on the projected weights |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["memory"]:
        mark = " (paper)" if r["paper_rank"] else ""
        size = (lambda x: f"{x / 2**30:.3f} GiB") if r["adamw_bytes"] >= 2**30 else (lambda x: f"{x / 2**20:.3f} MiB")
        params = f"{r['params'] / 1e9:.3f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.2f}M"
        out.append(
            f"| {r['model']} | {params} | {r['rank']}{mark} | {size(r['measured_bytes'])} | "
            f"{size(r['formula_bytes'])} | {size(r['adamw_bytes'])} | {r['saving']:.1%} | "
            f"{r['projected_saving']:.1%} |"
        )
    out += [
        "",
        "| paper 7B, r = 1024, 8 devices | GaLore per device (measured) | formula + 8 B | "
        "AdamW per device (formula) | saving | GaLore collectives per step (refresh counted once) | "
        "the layout's own (AdamW) collectives per step |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in results.get("sharded", []):
        coll = (
            "; ".join(
                f"{SHORT[c['technique']]}: {c['count']} {c['kind']}[{','.join(c['axes'])}] {c['bytes'] / 2**30:.2f} GiB"
                for c in r["collectives"]
            )
            or "none"
        )
        out.append(
            f"| {r['name']} | {r['measured_bytes'] / 2**20:.1f} MiB | {r['formula_bytes'] / 2**20:.1f} MiB | "
            f"{r['adamw_formula_bytes'] / 2**20:.1f} MiB | "
            f"{1 - r['measured_bytes'] / r['adamw_formula_bytes']:.1%} | {coll} | "
            f"{r['layout_collective_bytes'] / 2**30:.2f} GiB |"
        )
    out += ["", "| run | final train loss | eval loss (last) | eval losses | seconds |", "|---|---:|---:|---|---:|"]
    for name, r in results["loss"].items():
        evals = [p["eval_loss"] for p in r["curve"] if "eval_loss" in p]
        out.append(
            f"| {name} | {r['curve'][-1]['loss']:.3f} | {evals[-1]:.3f} | "
            f"{', '.join(f'{e:.3f}' for e in evals)} | {r['seconds']:.0f} |"
        )
    return "\n".join(out)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(MODELS):
        rows = [r for r in results["memory"] if r["model"] == name]
        color = f"C{i}"
        ax0.plot(
            [r["rank"] for r in rows],
            [1 - r["formula_bytes"] / r["adamw_bytes"] for r in rows],
            "-",
            color=color,
            label=f"{name} formula",
        )
        ax0.plot(
            [r["rank"] for r in rows],
            [r["saving"] for r in rows],
            "o",
            color=color,
            mfc="none",
            label=f"{name} measured",
        )
        ax0.plot(
            [r["rank"] for r in rows if r["paper_rank"]],
            [r["saving"] for r in rows if r["paper_rank"]],
            "*",
            color=color,
            ms=12,
        )
    ax0.axhline(PAPER_SAVING, color="k", ls=":", label="paper: up to 65.5%")
    ax0.set_xscale("log", base=2)
    ax0.set_xlabel("rank r")
    ax0.set_ylabel("optimizer-state saving vs AdamW")
    ax0.set_title("optimizer bytes vs rank (whole model; stars: the paper's rank)")
    ax0.legend(fontsize=7)
    for i, (name, r) in enumerate(results["loss"].items()):
        steps = [p["step"] for p in r["curve"]]
        ax1.plot(steps, [p["loss"] for p in r["curve"]], color=f"C{i}", label=name)
        ev = [p for p in r["curve"] if "eval_loss" in p]
        ax1.plot([p["step"] for p in ev], [p["eval_loss"] for p in ev], "s--", color=f"C{i}", ms=4)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte); squares: eval")
    ax1.set_title("configs/tiny.py on the embedded corpus, 1 CPU device")
    ax1.set_ylim(top=4.0)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check(results: dict) -> list[str]:
    problems = []
    for r in results["memory"]:
        if r["measured_bytes"] != r["formula_bytes"]:
            problems.append(
                f"{r['model']} r={r['rank']}: measured {r['measured_bytes']} != formula {r['formula_bytes']}"
            )
    for r in results.get("sharded", []):
        if r["measured_bytes"] != r["formula_bytes"]:
            problems.append(f"sharded {r['name']}: measured {r['measured_bytes']} != formula {r['formula_bytes']}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-loss", action="store_true", help="reuse the loss runs of results.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, json.load(sys.stdin))
        return
    os.environ.pop("XLA_FLAGS", None)  # the loss runs use 1 CPU device
    os.environ["JAX_PLATFORMS"] = "cpu"
    path = os.path.join(HERE, "results.json")
    results = {"memory": memory_rows(), "sharded": run_worker(__file__, 8, SHARDED, what="devices")}
    if args.skip_loss:
        with open(path) as f:
            results["loss"] = json.load(f)["loss"]
    else:
        results["loss"] = loss_runs(60 if args.quick else 300)
    results["paper_saving"] = PAPER_SAVING
    problems = check(results)
    results["checks"] = problems or "all measured optimizer-state bytes equal the formula"
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(HERE, "galore.png"))
    print(tables(results))
    print("checks:", results["checks"])


if __name__ == "__main__":
    main()
