"""Muon (Jordan et al. 2024; Liu et al. 2025, Moonlight) against AdamW: loss at equal steps and
the steps Muon needs to reach AdamW's final loss, and the optimizer's compute overhead, measured
from XLA's compiled programs and against the formula.

    .venv/bin/python experiments/muon/run.py [--quick] [--replot]

Two parts:
  loss      configs/tiny.py (0.82M parameters, batch 16 x 128 bytes, 300 steps, lr 3e-3 cosine,
            weight decay 0.1) on 1 CPU device: AdamW, and Muon with Moonlight's update RMS (0.2:
            the same lr and weight decay) at 1x and 2x the learning rate, and AdamW at 2x (so that
            a gain at 2x is not the learning rate's alone); train and eval curves;
            the first step at which each Muon run's loss (a 20-step moving average) is at or below
            AdamW's final one. --quick: 80 steps.
  flops     the train step of configs/tiny.py and of a Llama-shaped 36M model (D=512, F=1536, L=8,
            8 heads, seq 512, batch 8) compiled for CPU with AdamW and with Muon: XLA's cost
            analysis FLOPs of each program, Muon's extra against the formula (per m x n matrix,
            m <= n, five Newton-Schulz steps of 2 m^2 n (X X^T) + 2 m^3 (A A) + 2 m^2 n (B X)
            FLOPs), and the overhead relative to the step, against Keller Jordan's "below 1%" at
            LM batch sizes (the overhead is ~ 5 (4 m + 2 m^2/n) / (6 T) per weight FLOP: T tokens);
            and the formula at configs/llama_1b.py and llama_8b.py's sizes: the tokens per step at
            which the Newton-Schulz FLOPs are 1% of the step's.
Writes results.json and muon.png next to this file and prints the README tables.
"""

from __future__ import annotations

import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import load_results, loss_curves, markdown_table, pyplot, save_figure, save_results  # noqa: E402

RUNS = {  # name: train overrides
    "adamw": {},
    "muon": {"optimizer": "muon"},
    "muon_lr2x": {"optimizer": "muon", "lr": 6e-3},
    "adamw_lr2x": {"lr": 6e-3},  # the same step up for AdamW: is Muon's gain the optimizer or the lr?
}
SMOOTH = 20  # moving-average window (logged every step) for the steps-to-target figure
FLOP_MODELS = {
    "tiny": ("configs/tiny.py", []),
    "llama_36m": (
        "configs/tiny.py",
        [
            "--config.model.d_model=512",
            "--config.model.d_ff=1536",
            "--config.model.n_layers=8",
            "--config.model.n_heads=8",
            "--config.model.n_kv_heads=8",
            "--config.model.head_dim=64",
            "--config.data.seq_len=512",
            "--config.train.batch_size=8",
        ],
    ),
}
KELLER_OVERHEAD = 0.01  # "the FLOP overhead of Muon is below 1% in typical LM training scenarios"


def loss_runs(steps: int) -> dict:
    return loss_curves(RUNS, steps, log_every=1)


def smoothed(curve: list[dict]) -> list[tuple[int, float]]:
    losses = [p["loss"] for p in curve]
    return [
        (p["step"], sum(losses[max(0, i - SMOOTH + 1) : i + 1]) / len(losses[max(0, i - SMOOTH + 1) : i + 1]))
        for i, p in enumerate(curve)
    ]


def steps_to_target(loss: dict) -> dict:
    """For each run, the first step whose smoothed loss is at or below AdamW's final smoothed loss."""
    target = smoothed(loss["adamw"]["curve"])[-1][1]
    out = {"target": target}
    for name, r in loss.items():
        hit = next((step for step, value in smoothed(r["curve"]) if value <= target), None)
        out[name] = hit
    return out


def ns_flops(config) -> int:
    """The formula: Newton-Schulz FLOPs of one Muon update of `config`'s chosen matrices."""
    from jaxsys.models import transformer
    from jaxsys.optim import galore, muon

    plans = muon.plan(config.train.muon, transformer.param_specs(config.model))
    total = 0
    for pl in jax_leaves(plans, galore.LeafPlan):
        if pl.side != "full":
            continue
        b = math.prod(pl.shape[d] for d in pl.batch_dims)
        m, n = min(pl.m, pl.n), max(pl.m, pl.n)
        total += b * config.train.muon.ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def jax_leaves(tree, cls):
    import jax

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))


def compiled_flops(config) -> float:
    """XLA's cost analysis FLOPs of the compiled train step (1 CPU device, nothing run)."""
    import jax

    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    program = program_lib.build(config, make_mesh(config, jax.devices()[:1]))
    state = program.abstract_state()
    batch = jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len + 1), "int32")
    compiled = program.train_step_fn().lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def flop_rows() -> list[dict]:
    from jaxsys.config import load_config

    rows = []
    for name, (path, keys) in FLOP_MODELS.items():
        adamw = load_config(path, keys)
        muon_config = load_config(path, keys + ["--config.train.optimizer=muon"])
        a, m = compiled_flops(adamw), compiled_flops(muon_config)
        tokens = adamw.train.batch_size * adamw.data.seq_len
        rows.append(
            dict(
                model=name,
                tokens=tokens,
                adamw_flops=a,
                muon_flops=m,
                extra=m - a,
                formula=ns_flops(muon_config),
                overhead=(m - a) / a,
            )
        )
        r = rows[-1]
        print(
            f"flops {name}: extra {r['extra']:.3e} formula {r['formula']:.3e} overhead {r['overhead']:.2%}", flush=True
        )
    return rows


def scale_rows() -> list[dict]:
    """The formula at released sizes: Newton-Schulz FLOPs per step against the model's training
    FLOPs per token (analysis.flops), as the tokens per step at which Muon adds 1%."""
    from jaxsys.analysis import flops
    from jaxsys.config import load_config

    rows = []
    for name in ("llama_1b", "llama_8b"):
        config = load_config(f"configs/{name}.py", ["--config.train.optimizer=muon"])
        per_token = flops.train_flops_per_token(config.model, config.data.seq_len)
        ns = ns_flops(config)
        rows.append(dict(model=name, ns_flops=ns, flops_per_token=per_token, tokens_for_1pct=ns / (0.01 * per_token)))
    return rows


def tables(results: dict) -> str:
    loss, reach = results["loss"], results["reach"]
    out = markdown_table(
        [
            "run",
            "final train loss",
            "eval losses",
            f"first step at AdamW's final loss ({reach['target']:.3f})",
            "seconds",
        ],
        "lrrrr",
        [
            [
                name,
                f"{r['curve'][-1]['loss']:.3f}",
                ", ".join(f"{p['eval_loss']:.3f}" for p in r["curve"] if "eval_loss" in p),
                "-" if reach[name] is None else str(reach[name]),
                f"{r['seconds']:.0f}",
            ]
            for name, r in loss.items()
        ],
    )
    out += [""]
    out += markdown_table(
        [
            "model",
            "tokens / step",
            "AdamW step FLOPs (XLA)",
            "Muon step FLOPs (XLA)",
            "extra (XLA)",
            "NS formula",
            "extra / formula",
            "overhead",
        ],
        "lrrrrrrr",
        [
            [
                r["model"],
                str(r["tokens"]),
                f"{r['adamw_flops']:.3e}",
                f"{r['muon_flops']:.3e}",
                f"{r['extra']:.3e}",
                f"{r['formula']:.3e}",
                f"{r['extra'] / r['formula']:.3f}",
                f"{r['overhead']:.2%}",
            ]
            for r in results["flops"]
        ],
    )
    out += [""]
    out += markdown_table(
        ["model", "NS FLOPs / step (formula)", "train FLOPs / token", "tokens / step at 1% overhead"],
        "lrrr",
        [
            [r["model"], f"{r['ns_flops']:.3e}", f"{r['flops_per_token']:.3e}", f"{r['tokens_for_1pct']:.3e}"]
            for r in results["scale"]
        ],
    )
    return "\n".join(out)


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(results["loss"].items()):
        s = smoothed(r["curve"])
        ax.plot([p[0] for p in s], [p[1] for p in s], color=f"C{i}", label=f"{name} ({SMOOTH}-step mean)")
        ev = [p for p in r["curve"] if "eval_loss" in p]
        ax.plot([p["step"] for p in ev], [p["eval_loss"] for p in ev], "s--", color=f"C{i}", ms=4)
    ax.axhline(results["reach"]["target"], color="k", ls=":", lw=0.8, label="AdamW's final loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte); squares: eval")
    ax.set_title("configs/tiny.py on the embedded corpus, 1 CPU device")
    ax.set_ylim(top=3.5)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def check(results: dict) -> list[str]:
    problems = []
    for r in results["flops"]:  # XLA counts the NS matmuls as the formula does (elementwise work besides)
        if not 0.95 <= r["extra"] / r["formula"] <= 1.10:
            problems.append(f"{r['model']}: XLA's extra FLOPs {r['extra']:.3e} vs formula {r['formula']:.3e}")
    return problems


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="80 training steps")
    parser.add_argument("--replot", action="store_true", help="tables and plot from results.json")
    args = parser.parse_args()
    os.environ.pop("XLA_FLAGS", None)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.replot:
        results = load_results(HERE)
    else:
        loss = loss_runs(80 if args.quick else 300)
        results = {"loss": loss, "reach": steps_to_target(loss), "flops": flop_rows(), "scale": scale_rows()}
        problems = check(results)
        results["checks"] = (
            problems or "XLA's extra FLOPs of the Muon step equal the Newton-Schulz formula (within 10%)"
        )
        results["keller_overhead"] = KELLER_OVERHEAD
        save_results(HERE, results)
    plot(results, os.path.join(HERE, "muon.png"))
    print(tables(results))
    print("checks:", results["checks"])


if __name__ == "__main__":
    main()
