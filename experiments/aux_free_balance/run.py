"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3) against the Switch balance
loss and against no balancing: expert-load violation and loss at equal steps.

    .venv/bin/python experiments/aux_free_balance/run.py [--quick] [--replot]

configs/moe.py (4 layers, every second one 8 experts of 192 units, top 2, dropless) with DeepSeek-V3's
sigmoid router and renormalised gates, on 1 CPU device, same data, seed and schedule, three runs:
  none       no balancing (aux_loss_weight 0, no bias)
  aux_loss   the Switch balance loss at weight 0.01 (GShard / Switch's usual value)
  aux_free   the choice bias moved by u = 0.001 per step (the paper's), no balance loss
  aux_free_u0.01  the same at u = 0.01 (the bias travels as far in 300 steps as in 3000 at 0.001)
Per step the global load of each expert (metrics.jsonl's moe_expert_load); MaxVio = max_e load_e /
mean_e load_e - 1 per MoE layer (the paper's measure, per batch), its mean over the last quarter of
the steps and over layers; the final train loss (a 20-step mean) and the last eval loss.
--quick: 60 steps. Writes results.json and balance.png next to this file and prints the README table.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import load_results, markdown_table, parse_args, pyplot, save_figure, save_results  # noqa: E402

COMMON = [
    "--config.model.moe.router=sigmoid",
    "--config.model.moe.renormalize=true",
    "--config.model.moe.z_loss_weight=0",
]
RUNS = {
    "none": ["--config.model.moe.aux_loss_weight=0"],
    "aux_loss": ["--config.model.moe.aux_loss_weight=0.01"],
    "aux_free": [
        "--config.model.moe.aux_loss_weight=0",
        "--config.model.moe.score_bias=true",
        "--config.model.moe.bias_update_rate=0.001",
    ],
    # ten times the paper's rate: a 300-step run moves the bias as far as 3000 steps at u = 0.001
    "aux_free_u0.01": [
        "--config.model.moe.aux_loss_weight=0",
        "--config.model.moe.score_bias=true",
        "--config.model.moe.bias_update_rate=0.01",
    ],
}
SMOOTH = 20


def max_violation(shares: list[list[float]]) -> list[float]:
    """Per MoE layer, max_e load_e / mean_e load_e - 1 from the layer's load shares."""
    return [len(row) * max(row) - 1.0 for row in shares]


def one_run(name: str, steps: int) -> dict:
    from jaxsys import train
    from jaxsys.config import load_config

    c = load_config(
        os.path.join(ROOT, "configs", "moe.py"),
        COMMON
        + RUNS[name]
        + [
            f"--config.train.steps={steps}",
            "--config.train.log_every=1",
            "--config.train.progress=false",
            f"--config.train.eval_every={max(steps // 3, 1)}",
        ],
    )
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.time()
        records = train.main(c, workdir)
        seconds = time.time() - t0
    curve = [
        dict(
            step=r["step"],
            loss=r["loss"],
            maxvio=max_violation(r["moe_expert_load"]),
            **({"eval_loss": r["eval_loss"]} if "eval_loss" in r else {}),
        )
        for r in records
        if "moe_expert_load" in r
    ]
    tail = curve[-max(1, len(curve) // 4) :]
    result = dict(
        seconds=seconds,
        curve=curve,
        maxvio_tail=sum(sum(p["maxvio"]) / len(p["maxvio"]) for p in tail) / len(tail),
        maxvio_tail_max=max(max(p["maxvio"]) for p in tail),
        loss_tail=sum(p["loss"] for p in curve[-SMOOTH:]) / len(curve[-SMOOTH:]),
        eval_loss=[p["eval_loss"] for p in curve if "eval_loss" in p][-1],
    )
    print(
        f"{name}: MaxVio (last quarter) {result['maxvio_tail']:.3f}, loss {result['loss_tail']:.3f}, "
        f"eval {result['eval_loss']:.3f} ({seconds:.0f} s)",
        flush=True,
    )
    return result


def table(results: dict) -> str:
    rows = [
        [
            name,
            f"{r['maxvio_tail']:.3f}",
            f"{r['maxvio_tail_max']:.3f}",
            f"{r['loss_tail']:.3f}",
            f"{r['eval_loss']:.3f}",
            f"{r['seconds']:.0f}",
        ]
        for name, r in results["runs"].items()
    ]
    header = [
        "run",
        "MaxVio, mean of the last quarter",
        "MaxVio, worst layer-step of it",
        f"train loss ({SMOOTH}-step mean)",
        "eval loss",
        "seconds",
    ]
    return "\n".join(markdown_table(header, "lrrrrr", rows))


def plot(results: dict) -> None:
    plt = pyplot()
    fig, (ax_vio, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in results["runs"].items():
        steps = [p["step"] for p in r["curve"]]
        ax_vio.plot(steps, [sum(p["maxvio"]) / len(p["maxvio"]) for p in r["curve"]], label=name, lw=1)
        ax_loss.plot(steps, [p["loss"] for p in r["curve"]], label=name, lw=1)
    ax_vio.set(xlabel="step", ylabel="MaxVio (mean over MoE layers)", title="expert-load violation")
    ax_loss.set(xlabel="step", ylabel="train loss", title="loss")
    ax_loss.set_ylim(top=3.5)
    ax_vio.legend()
    save_figure(fig, os.path.join(HERE, "balance.png"))


def main() -> None:
    args = parse_args(__doc__, lambda n, jobs: None, "60 steps")
    if args.replot:
        results = load_results(HERE)
    else:
        steps = 60 if args.quick else 300
        results = {"steps": steps, "runs": {name: one_run(name, steps) for name in RUNS}}
        save_results(HERE, results)
    plot(results)
    print(table(results))


if __name__ == "__main__":
    main()
