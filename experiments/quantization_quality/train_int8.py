"""Int8 training (config.model.quant_train='int8') against float training on the tiny config.

    python experiments/quantization_quality/train_int8.py [--workdir /tmp/jaxsys_int8_training]

Trains configs/tiny.py three times from the same seed and batches: fp32, bf16 compute, and bf16
compute with every dense matmul int8 forward and backward (straight-through estimator,
`quant_impl=reference`: XLA's int8 dot, bitwise equal to the W8A8 Pallas kernel). Writes
training.json (the eval losses and the loss curves) beside this file.
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
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/jaxsys_int8_training")
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
            "tokens_per_s_cpu": records[-1]["tokens_per_s"],
        }
        print(f"{name}: eval loss {out[name]['eval_loss']:.4f}", flush=True)
    with open(os.path.join(HERE, "training.json"), "w") as f:
        json.dump(out, f, indent=1)
    gap = out["bf16+int8"]["eval_loss"] - out["bf16"]["eval_loss"]
    print(f"int8 - bf16 eval loss: {gap:+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
