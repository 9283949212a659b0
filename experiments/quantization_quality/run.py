"""Perplexity of quantized models on the held-out corpus, per format, method and group size.

    python experiments/quantization_quality/run.py [--steps-scale 1.0] [--eval-batches 16]

Trains (or reuses, under --cache) two float models on the embedded corpus, tiny (configs/tiny.py,
0.8M parameters, 300 steps) and small (3.3M: D=256, H=32, F=768, 400 steps); `--models hf` adds
the converted Hugging Face fixture (tests/golden/hf_llama/untied: a *random* tiny Llama), which
jaxsys now refuses to evaluate on the text corpus (no tokenizer: its ids are not bytes), so its
rows of the first run are not repeated. Each is quantized with
`jaxsys.quantization.workdir.quantize_workdir` for every row and evaluated with
`jaxsys.train.evaluate_workdir` (what `jaxsys.evaluate` runs) on the same held-out batches, so rows
differ only by the weights. Quantized rows run with bf16 activations
(the A16 of the formats; W8A8 and W4A8 quantize them to int8 per token, W4A4 to 4 bits per token and
group of G; "+rot" rows store H W and rotate the activations, QuaRot's block Hadamard); the float model is reported with fp32 and bf16 activations. Quantized
rows use `quant_impl=reference` (the kernels' integer semantics in XLA; the Pallas kernels in
interpret mode give the same sums, tests/test_quantized_model.py) except one pallas row per model
that checks it. Writes results.json and prints the README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "tiny": ["--config.train.progress=false"],
    "small": [
        "--config.model.d_model=256",
        "--config.model.n_heads=8",
        "--config.model.n_kv_heads=4",
        "--config.model.head_dim=32",
        "--config.model.d_ff=768",
        "--config.train.steps=400",
        "--config.train.eval_every=200",
        "--config.train.progress=false",
    ],
}
# (format, method, group size, zero point, rotated)
ROWS = [("w8a16", "rtn", 128, False, False), ("w8a16", "gptq", 128, False, False)]
ROWS += [("w4a16", method, g, False, False) for method in ("rtn", "gptq") for g in (32, 64, 128)]
ROWS += [("w4a16", method, 128, True, False) for method in ("rtn", "gptq")]
ROWS += [("w8a8", "rtn", 128, False, False), ("w8a8", "gptq", 128, False, False)]
# COMET's W4A8 / W4A4 (integer activations; W4A4's per token and group of G), and QuaRot's rotation
ROWS += [("w4a8", method, 128, False, False) for method in ("rtn", "gptq")]
ROWS += [("w4a4", method, g, False, rot) for rot in (False, True) for method in ("rtn", "gptq") for g in (32, 128)]
ROWS += [("w4a16", "gptq", 128, False, True), ("w4a8", "gptq", 128, False, True)]
ACTIVATIONS = {"w8a8": "int8/token", "w4a8": "int8/token", "w4a4": "int4/token/G"}


def _train(name: str, workdir: str, steps_scale: float) -> None:
    from jaxsys import train
    from jaxsys.config import load_config

    overrides = list(MODELS[name]) + ["--config.checkpoint.async_save=false"]
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"), overrides)
    config.train.steps = max(int(config.train.steps * steps_scale), 10)
    train.main(config, workdir)


def _convert_hf(workdir: str) -> None:
    from jaxsys.checkpoint import hf

    hf.from_hf(os.path.join(ROOT, "tests", "golden", "hf_llama", "untied"), workdir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and stop")
    parser.add_argument("--cache", default="/tmp/jaxsys_quantization_quality")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale the training steps (smoke runs)")
    parser.add_argument("--eval-batches", type=int, default=16)
    # hf: the converted fixture has no tokenizer, and jaxsys now refuses to read the text corpus's
    # byte ids into a converted model without one (evaluation and GPTQ both): not in the default set
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args(argv)
    if args.table_only:
        print(table(json.load(open(args.out))["rows"]))
        return 0

    from jaxsys.config import ConfigError
    from jaxsys.data import DataError
    from jaxsys.models import quant
    from jaxsys.quantization.workdir import quantize_workdir
    from jaxsys.train import evaluate_workdir

    os.makedirs(args.cache, exist_ok=True)
    names = args.models.split(",")
    # rows of the models not run now are kept (--models hf reruns one model)
    kept = [r for r in json.load(open(args.out))["rows"] if r["model"] not in names] if os.path.exists(args.out) else []
    results = []
    for name in names:
        source = os.path.join(args.cache, name)
        if not os.path.isdir(os.path.join(source, "checkpoints")):
            shutil.rmtree(source, ignore_errors=True)
            _convert_hf(source) if name == "hf" else _train(name, source, args.steps_scale)
        base = [f"--config.train.eval_batches={args.eval_batches}"]
        bf16 = base + ["--config.model.compute_dtype=bfloat16"]
        fp32 = evaluate_workdir(source, base)
        rows = [
            dict(model=name, format="float", method="-", activations="fp32", **_summary(fp32, None)),
            dict(
                model=name,
                format="float",
                method="-",
                activations="bf16",
                **_summary(evaluate_workdir(source, bf16), None),
            ),
        ]
        for fmt, method, group, zero, rot in ROWS:
            out = os.path.join(args.cache, f"{name}_{fmt}_{method}_g{group}{'_z' if zero else ''}{'_r' if rot else ''}")
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            try:
                info = quantize_workdir(source, out, fmt, method, group, zero, 8, log=None, rotate=rot)
            except (ConfigError, DataError) as e:  # a group size that does not divide K'; GPTQ without a tokenizer
                rows.append(
                    dict(
                        model=name,
                        format=fmt,
                        method=method,
                        group_size=group,
                        zero_point=zero,
                        rotated=rot,
                        refused=str(e),
                    )
                )
                print(f"{name} {fmt} {method} G={group}: refused ({e})", flush=True)
                continue
            seconds = time.perf_counter() - start
            ev = evaluate_workdir(out, bf16 + ["--config.model.quant_impl=reference"])
            row = dict(
                model=name,
                format=fmt,
                method=method,
                group_size=group if fmt.startswith("w4") else None,
                zero_point=zero,
                rotated=rot,
                activations=ACTIVATIONS.get(fmt, "bf16"),
                quantize_seconds=seconds,
                **_summary(ev, info),
                bits_per_dense_weight=quant.bits_per_weight(fmt, group, zero),
            )
            if (fmt, method, group, zero, rot) in (
                ("w4a16", "gptq", 32, False, False),
                ("w4a4", "gptq", 32, False, True),
            ):
                # the kernels themselves (interpret mode)
                row["eval_loss_pallas"] = evaluate_workdir(out, bf16)["eval_loss"]
            rows.append(row)
            print(
                f"{name} {fmt} {method} G={group}{' z' if zero else ''}{' rotated' if rot else ''}: loss {ev['eval_loss']:.4f} "
                f"(float {fp32['eval_loss']:.4f})",
                flush=True,
            )
        results += rows
        with open(args.out, "w") as f:  # after every model: a later failure keeps the rows so far
            json.dump({"eval_batches": args.eval_batches, "rows": kept + results}, f, indent=1)
    print(table(kept + results))
    return 0


def _summary(ev: dict, info: dict | None) -> dict:
    out = {
        "eval_loss": ev["eval_loss"],
        "perplexity": ev["perplexity"],
        "param_bytes": ev["param_bytes"],
        "tokens": ev["tokens"],
    }
    if info:
        out.update(dense_bytes_before=info["dense_bytes_before"], dense_bytes_after=info["dense_bytes_after"])
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| model | format | method | G | activations | eval loss | perplexity | vs float (bf16) | "
        "bits / dense weight | all params (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    reference = {}
    for r in rows:
        if r["format"] == "float" and r["activations"] == "bf16":
            reference[r["model"]] = r["perplexity"]
    for r in rows:
        marks = f"{' +z' if r.get('zero_point') else ''}{' +rot' if r.get('rotated') else ''}"
        if "refused" in r:
            group = f"{r['group_size']}{marks}"
            why = "G does not divide K'" if "group size" in r["refused"] else "no tokenizer to calibrate GPTQ with"
            lines.append(f"| {r['model']} | {r['format']} | {r['method']} | {group} | | refused: {why} | | | | |")
            continue
        group = f"{r['group_size']}{marks}" if r.get("group_size") else "-"
        bits = r.get("bits_per_dense_weight", 32)
        ratio = r["perplexity"] / reference[r["model"]]
        lines.append(
            f"| {r['model']} | {r['format']} | {r['method']} | {group} | {r['activations']} | "
            f"{r['eval_loss']:.4f} | {r['perplexity']:.3f} | {ratio:.4f}x | {bits:.2f} | "
            f"{r['param_bytes'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
