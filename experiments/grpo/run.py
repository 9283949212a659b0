"""GRPO on the toy reversal task (configs/grpo_tiny.py): the reward curve of the byte-level tiny
model, synchronous and asynchronous (k = 1, 2), disaggregated (trainer fsdp=4 on devices 0-3,
engine data=2 x tensor=2 on 4-7) and colocated (all 8 devices, taking turns); tokens generated and
trained per second, the weight transfer's bytes and time.

    python experiments/grpo/run.py            # writes results.json, results.png (about 10 min on 2 shared cores)

Eight simulated CPU devices on a 2-core host: the two sides of a disaggregated run share the cores,
so async overlap cannot show as wall-clock gain here (it shows as staleness and reward per update).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from experiments.common import markdown_table, save_results  # noqa: E402
from jaxsys.config import load_config  # noqa: E402
from jaxsys.rl import loop  # noqa: E402

VARIANTS = [
    ("disagg sync", ""),
    ("disagg async k=1", ":async"),
    ("disagg async k=2", ":async2"),
    ("colocated sync", ":colocated"),
]


def one(name: str, arg: str) -> dict:
    config = load_config(f"configs/grpo_tiny.py{arg}")
    run = loop.Run(config)
    before = run.evaluate()
    records = run.sync() if config.rl.mode == "sync" else run.asynchronous()
    after = run.evaluate()
    rewards = [r["reward"] for r in records]
    window = 10
    return dict(
        name=name,
        config=f"configs/grpo_tiny.py{arg}",
        rewards=rewards,
        staleness=[r["staleness"] for r in records],
        first10=float(np.mean(rewards[:window])),
        last10=float(np.mean(rewards[-window:])),
        greedy_before=before,
        greedy_after=after,
        mean_staleness=float(np.mean([r["staleness"] for r in records])),
        **loop._rates(records),
    )


def main():
    results = []
    for name, arg in VARIANTS:
        r = one(name, arg)
        print(
            f"{name}: sampled reward {r['first10']:.3f} -> {r['last10']:.3f}, greedy {r['greedy_before']:.3f} -> "
            f"{r['greedy_after']:.3f}, {r['generated_tokens_per_s']:.0f} gen tok/s, {r['trained_tokens_per_s']:.0f} "
            f"trained tok/s, wall {r['wall_s']:.0f} s",
            flush=True,
        )
        results.append(r)
    save_results(os.path.dirname(os.path.abspath(__file__)), dict(runs=results))
    rows = [
        [
            r["name"],
            f"{r['first10']:.3f}",
            f"{r['last10']:.3f}",
            f"{r['greedy_before']:.3f}",
            f"{r['greedy_after']:.3f}",
            f"{r['mean_staleness']:.2f}",
            f"{r['generated_tokens_per_s']:.0f}",
            f"{r['trained_tokens_per_s']:.0f}",
            f"{r['sync_bytes'] / 2**20:.2f} MiB / {r['sync_s_mean'] * 1e3:.1f} ms",
            f"{r['wall_s']:.0f}",
        ]
        for r in results
    ]
    header = [
        "run",
        "sampled reward, first 10",
        "last 10",
        "greedy before",
        "greedy after",
        "mean staleness",
        "generated tok/s",
        "trained tok/s",
        "weight sync (bytes / time)",
        "wall s",
    ]
    print("\n".join(markdown_table(header, "l" + "r" * (len(header) - 1), rows)))
    try:
        from experiments.common import pyplot, save_figure

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            x = np.arange(1, len(r["rewards"]) + 1)
            smooth = np.convolve(r["rewards"], np.ones(10) / 10, mode="valid")
            ax.plot(x[9:], smooth, label=r["name"])
        ax.axhline(0.25, color="gray", ls=":", label="uniform letters (0.25)")
        ax.set_xlabel("update")
        ax.set_ylabel("sampled reward (mean of 10 updates)")
        ax.legend()
        save_figure(fig, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.png"))
    except Exception as e:  # the plot is optional
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
