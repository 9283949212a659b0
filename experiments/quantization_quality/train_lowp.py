"""Int8 and fp8 training (config.model.quant_train) against float training on the tiny config.

    python experiments/quantization_quality/train_lowp.py [--workdir /tmp/jaxsys_lowp_training]

Trains configs/tiny.py four times from the same seed and batches: fp32, bf16 compute, bf16
compute with every dense matmul int8 forward and backward (straight-through estimator,
`quant_impl=reference`: XLA's int8 dot, bitwise equal to the W8A8 Pallas kernel), and bf16
compute with fp8 dense matmuls (e4m3 operands, e5m2 gradient, current per-tensor scales: on the
CPU the float8 casts are exact and the products are fp32, so the numerics are a GPU's up to the
order of its fp32 sums). Writes training.json (the eval losses, the loss curves, the losses at
step 200: the issue's fp8 target is "within 1% of bf16 after 200 steps") beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

RUNS = {
    "fp32": [],
    "bf16": ["--config.model.compute_dtype=bfloat16"],
    "bf16+int8": [
        "--config.model.compute_dtype=bfloat16",
        "--config.model.quant_train=int8",
        "--config.model.quant_impl=reference",
    ],
    "bf16+fp8": ["--config.model.compute_dtype=bfloat16", "--config.model.quant_train=fp8"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/jaxsys_lowp_training")
    args = parser.parse_args(argv)
    from jaxsys import train
    from jaxsys.config import load_config

    out = {}
    for name, overrides in RUNS.items():
        workdir = os.path.join(args.workdir, name)
        shutil.rmtree(workdir, ignore_errors=True)
        config = load_config(
            os.path.join(ROOT, "configs", "tiny.py"),
            overrides + ["--config.train.progress=false", "--config.checkpoint.enabled=false"],
        )
        records = train.main(config, workdir)
        out[name] = {
            "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r][-1],
            "curve": [(r["step"], r["loss"]) for r in records],
            "loss_at_200": next(r["loss"] for r in records if r["step"] >= 200 and "loss" in r),
            "tokens_per_s_cpu": records[-1]["tokens_per_s"],
        }
        print(f"{name}: eval loss {out[name]['eval_loss']:.4f}", flush=True)
    with open(os.path.join(HERE, "training.json"), "w") as f:
        json.dump(out, f, indent=1)
    for low in ("bf16+int8", "bf16+fp8"):
        gap = out[low]["eval_loss"] - out["bf16"]["eval_loss"]
        at_200 = out[low]["loss_at_200"] / out["bf16"]["loss_at_200"] - 1
        print(f"{low} - bf16: eval loss {gap:+.4f}, train loss at step 200 {at_200:+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
