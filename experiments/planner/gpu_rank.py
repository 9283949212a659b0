"""Part D of the planner experiment: does the cost model rank one accelerator's layouts as they measure?

On one GPU the planner's layout choices reduce to the remat policy and the shape of the batch, so
this sweep holds the tokens per step fixed and varies (batch B, sequence T) x remat: 4 x 3 = 12
layouts of a ~0.2B Llama-shaped model. For each: `cost_model.predicted_step` on the device's
hardware profile (h100 / h200) beside the measured wall time per step (median of 3 x 5 steps after
2 warm-up steps), and Spearman's rho over the 12.

    python experiments/planner/gpu_rank.py --hardware h200 --out results/gpu_rank_h200.json   # on the GPU
    python experiments/planner/gpu_rank.py --quick                                             # CPU smoke test
    python experiments/planner/gpu_rank.py --rescore ../../docs/benchmarks/h200_2026-11-26/session3/gpu_rank_h200.json
        # the measured rows again, predicted by the current cost model (no device needed)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import common  # noqa: E402
from experiments.planner.run import spearman  # noqa: E402

SHAPES = ((32, 1024), (16, 2048), (8, 4096), (4, 8192))  # (B, T): 32K tokens per step
REMATS = ("none", "dots", "full")


def model_config(batch: int, seq_len: int, remat: str, quick: bool, attention_impl: str = "reference"):
    from jaxsys.config import base_config, validate

    c = base_config()
    m = c.model
    if quick:  # tiny, for a CPU smoke test of the script itself
        m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 256, 64, 2, 4, 2, 16, 128
        batch, seq_len = max(1, batch // 16), max(16, seq_len // 64)
    else:
        m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = (
            32000,
            1024,
            12,
            16,
            4,
            64,
            4096,
        )
    m.compute_dtype, m.remat, m.attention_impl = "bfloat16", remat, attention_impl
    c.data.seq_len, c.train.batch_size = seq_len, batch
    validate(c, num_devices=1)
    return c


def measure(config) -> float:
    import jax

    return statistics.median(common.train_step_seconds(config, jax.devices()[:1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h200", help="cost-model profile to predict with (h100, h200, cpu)")
    parser.add_argument("--out", help="write the rows and rho as JSON here")
    parser.add_argument("--attention-impl", default="reference", help="config.model.attention_impl (cudnn on a GPU)")
    parser.add_argument("--rescore", help="a JSON this script wrote: predict its rows again, print rho")
    parser.add_argument("--quick", action="store_true", help="a tiny model (CPU smoke test)")
    args = parser.parse_args(argv)

    import jax

    from jaxsys.analysis import cost_model, hardware

    hw = hardware.profile(args.hardware)
    if args.rescore:
        with open(args.rescore) as f:
            saved = json.load(f)
        hw = hardware.profile(saved["hardware"])
        for r in saved["rows"]:
            b, t, remat = (part.split("=")[1] for part in r["layout"].split())
            config = model_config(int(b), int(t), remat, False, saved.get("attention_impl", "reference"))
            r["predicted_ms"] = cost_model.predicted_step(config, hw)["step_s"] * 1e3
            print(f"{r['layout']:>24}  predicted {r['predicted_ms']:7.1f} ms  measured {r['measured_ms']:7.1f} ms")
        rho = spearman([r["predicted_ms"] for r in saved["rows"]], [r["measured_ms"] for r in saved["rows"]])
        print(f"Spearman rho over {len(saved['rows'])} layouts: {rho:.3f}")
        return 0
    rows = []
    for batch, seq_len in SHAPES:
        for remat in REMATS:
            config = model_config(batch, seq_len, remat, args.quick, args.attention_impl)
            predicted = cost_model.predicted_step(config, hw)
            try:
                measured = measure(config)
            except Exception as e:  # out of memory for a layout is a result too
                print(f"B={batch} T={seq_len} remat={remat}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            row = dict(
                layout=f"B={config.train.batch_size} T={config.data.seq_len} remat={remat}",
                predicted_ms=predicted["step_s"] * 1e3,
                predicted_mfu=predicted.get("mfu"),
                measured_ms=measured * 1e3,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows]) if len(rows) > 2 else None
    result = dict(
        attention_impl=args.attention_impl,
        device=str(jax.devices()[0].device_kind),
        hardware=args.hardware,
        rows=rows,
        spearman=rho,
    )
    print(f"Spearman rho over {len(rows)} layouts: {rho}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
