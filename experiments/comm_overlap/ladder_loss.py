"""Ladder residual vs the standard residual: training loss of configs/tiny.py at equal steps.

    .venv/bin/python experiments/comm_overlap/ladder_loss.py [--quick] [--replot]

configs/tiny.py (D 128, L 4, 8 heads, 0.82M parameters; batch 16 x 128 bytes of the embedded
corpus, AdamW, lr 3e-3 with 20 warm-up steps and cosine decay) on 1 CPU device, trained twice from
the same seed on the same batches: config.model.residual="standard" and "ladder" (each module reads
the residual stream without the previous module's output, added one module later; Zhang et al.
2025, docs/comm_overlap.md). Every step's loss is logged, and the eval loss every 100 steps.
--quick: 60 steps. Writes results/ladder_loss.json and results/ladder_loss.png next to this file
and prints a table (final loss, mean of the last 50 steps, last eval loss, seconds).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import (  # noqa: E402
    load_results,
    markdown_table,
    parse_args,
    pyplot,
    save_figure,
    save_results,
    style_axes,
)

RESIDUALS = ("standard", "ladder")
LAST = 50  # steps averaged at the end (one step's loss is one batch: noisy)


def train_run(residual: str, steps: int) -> dict:
    from jaxsys import train
    from jaxsys.config import load_config

    config = load_config(
        "configs/tiny.py",
        [
            f"--config.model.residual={residual}",
            f"--config.train.steps={steps}",
            "--config.train.log_every=1",
            f"--config.train.eval_every={min(100, steps)}",
            "--config.train.progress=false",
        ],
    )
    with tempfile.TemporaryDirectory() as workdir:
        start = time.time()
        records = train.main(config, workdir)
        seconds = time.time() - start
    curve = [
        dict(step=r["step"], loss=r["loss"], **({"eval_loss": r["eval_loss"]} if "eval_loss" in r else {}))
        for r in records
    ]
    losses = [p["loss"] for p in curve]
    evals = [p for p in curve if "eval_loss" in p]
    summary = dict(
        final_loss=losses[-1],
        mean_last=sum(losses[-LAST:]) / len(losses[-LAST:]),
        final_eval_loss=evals[-1]["eval_loss"] if evals else None,
    )
    print(f"{residual}: {summary} ({seconds:.0f} s)", flush=True)
    return dict(residual=residual, steps=steps, seconds=seconds, curve=curve, **summary)


def table(results: dict) -> str:
    rows = [
        [
            r["residual"],
            r["steps"],
            f"{r['final_loss']:.4f}",
            f"{r['mean_last']:.4f}",
            f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-",
            f"{r['seconds']:.0f}",
        ]
        for r in results["runs"]
    ]
    header = ["residual", "steps", "final loss", f"mean of last {LAST}", "final eval loss", "seconds"]
    return "\n".join(markdown_table(header, "lrrrrr", rows))


def plot(results: dict, path: str) -> None:
    plt = pyplot()
    fig, (full, tail) = plt.subplots(1, 2, figsize=(10, 4))
    for i, r in enumerate(results["runs"]):
        steps = [p["step"] for p in r["curve"]]
        losses = [p["loss"] for p in r["curve"]]
        for ax in (full, tail):
            ax.plot(steps, losses, color=f"C{i}", lw=0.8, alpha=0.8, label=f"{r['residual']} (train)")
            ev = [p for p in r["curve"] if "eval_loss" in p]
            ax.plot(
                [p["step"] for p in ev],
                [p["eval_loss"] for p in ev],
                "s--",
                color=f"C{i}",
                ms=4,
                label=f"{r['residual']} (eval)",
            )
    last = [p["loss"] for r in results["runs"] for p in r["curve"][-2 * LAST :]]
    tail.set_xlim(max(1, results["runs"][0]["steps"] - 2 * LAST), results["runs"][0]["steps"])
    tail.set_ylim(min(last) - 0.05, max(last) + 0.05)
    style_axes(full, "step", "loss (nats per byte)", "configs/tiny.py, 1 CPU device")
    style_axes(tail, "step", "loss (nats per byte)", f"last {2 * LAST} steps")
    save_figure(fig, path)


def main() -> None:
    def no_worker(n, jobs):
        raise SystemExit("ladder_loss.py has no workers")

    args = parse_args(__doc__, no_worker, "60 steps instead of 300", "table and plot from results/ladder_loss.json")
    os.makedirs(RESULTS, exist_ok=True)
    if args.replot:
        results = load_results(RESULTS, "ladder_loss.json")
    else:
        os.environ.pop("XLA_FLAGS", None)  # 1 CPU device
        os.environ["JAX_PLATFORMS"] = "cpu"
        steps = 60 if args.quick else 300
        results = {"config": "configs/tiny.py", "runs": [train_run(residual, steps) for residual in RESIDUALS]}
        save_results(RESULTS, results, "ladder_loss.json")
    plot(results, os.path.join(RESULTS, "ladder_loss.png"))
    print(table(results))


if __name__ == "__main__":
    main()
