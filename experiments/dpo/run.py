"""DPO on a generated preference task with a known answer (experiments/dpo/README.md).

    python experiments/dpo/run.py [--quick] [--base W]   # W: a pretrained tiny (e.g. experiments/sft_lora's)
    python experiments/dpo/run.py --pairs FILE     # only write the pairs (configs/tiny_dpo.py reads them)

The task (`pairs`): the prompt "is N even? " with N uniform in 1..999; the chosen completion is the
right answer ("yes\n" or "no\n"), the rejected one the wrong answer. Which completion is right is
known for every pair and depends on the prompt (the last digit), not on a fixed preference for one
answer, so the held-out reward accuracy (the fraction of held-out pairs whose DPO margin is > 0)
and margin measure what was learnt; the starting model answers both ways alike. 3,000 pairs as
JSON lines (config.data.format=preference, byte tokenizer, the last 10% held out), rows of 33
tokens, 16 rows (8 pairs) a step.

The starting model is configs/tiny.py pretrained on the stdlib corpus (PRETRAIN steps, bytes).
Two runs of STEPS steps from it, beta = 0.1: DPO of every weight (lr 5e-4; the reference is the
starting parameters, passed to each step) and DPO of LoRA adapters of rank 16, alpha 32 (lr 1e-3;
the reference is the base itself, the adapters left out: no second copy of the weights). Logged every EVAL_EVERY steps: the
held-out DPO loss, reward accuracy and chosen-minus-rejected margin, and the chosen and rejected
rewards.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402

from experiments.common import save_results  # noqa: E402

WORK = "/tmp/jaxsys_dpo"
PRETRAIN, STEPS, EVAL_EVERY, PAIRS = 200, 200, 25, 3000
RUNS = {"dpo_full": (0, 5e-4), "dpo_lora_r16": (16, 1e-3)}  # name: (lora rank, learning rate)


def pairs(path: str, n: int, seed: int = 0) -> None:
    """`n` preference records: "is N even? " answered right (chosen) and wrong (rejected)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            number = int(rng.integers(1, 1000))
            right, wrong = ("yes\n", "no\n") if number % 2 == 0 else ("no\n", "yes\n")
            f.write(json.dumps({"prompt": f"is {number} even? ", "chosen": right, "rejected": wrong}) + "\n")


def overrides(work: str, steps: int, rank: int, lr: float, base: str) -> list[str]:
    return [
        "--config.data.source=jsonl",
        f"--config.data.path={work}/pairs.jsonl",
        "--config.data.format=preference",
        "--config.data.tokenizer=bytes",
        "--config.data.seq_len=32",
        "--config.data.eval_fraction=0.1",
        "--config.data.tokenize_workers=1",
        "--config.train.objective=dpo",
        "--config.train.dpo.beta=0.1",
        f"--config.train.steps={steps}",
        f"--config.train.lr={lr}",
        "--config.train.warmup_steps=10",
        "--config.train.log_every=5",
        f"--config.train.eval_every={min(EVAL_EVERY, steps)}",
        "--config.train.eval_batches=8",
        "--config.train.progress=False",
        "--config.checkpoint.every_steps=0",
        f"--config.checkpoint.init_from={base}",
        f"--config.lora.rank={rank}",
        f"--config.lora.alpha={2 * rank if rank else 16}",
    ]


def main() -> None:
    if "--pairs" in sys.argv:
        path = sys.argv[sys.argv.index("--pairs") + 1]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pairs(path, PAIRS)
        return
    quick = "--quick" in sys.argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxsys import train
    from jaxsys.config import load_config

    pretrain, steps = (60, 50) if quick else (PRETRAIN, STEPS)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    pairs(f"{WORK}/pairs.jsonl", PAIRS)
    if "--base" in sys.argv:
        base = sys.argv[sys.argv.index("--base") + 1]
        pretrain = json.load(open(os.path.join(base, "config.json")))["train"]["steps"]
    else:
        base = f"{WORK}/base"
        pre = load_config(os.path.join(HERE, "..", "..", "configs", "tiny.py"))
        pre.train.steps, pre.train.eval_every, pre.train.progress = pretrain, pretrain, False
        train.main(pre, base)
    results: dict = {"pretrain_steps": pretrain, "steps": steps, "pairs": PAIRS, "runs": {}}
    for name, (rank, lr) in RUNS.items():
        config = load_config(os.path.join(base, "config.json"), overrides(WORK, steps, rank, lr, base))
        records = train.main(config, f"{WORK}/{name}")
        keep = ("step", "loss", "dpo_margin", "dpo_accuracy", "dpo_reward_chosen", "dpo_reward_rejected")
        results["runs"][name] = {
            "lora_rank": rank,
            "lr": lr,
            "train": [{k: r[k] for k in keep} for r in records],
            "eval": [
                {
                    "step": r["step"],
                    "loss": r["eval_loss"],
                    **{k[len("eval_dpo_") :]: v for k, v in r.items() if k.startswith("eval_dpo_")},
                }
                for r in records
                if "eval_loss" in r
            ],
            "tokens_per_s_median": float(np.median([r["tokens_per_s"] for r in records if r["step"] > 1])),
        }
        print(name, results["runs"][name]["eval"][-1], flush=True)
    print(save_results(HERE, results))


if __name__ == "__main__":
    main()
