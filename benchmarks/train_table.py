"""Side-by-side table of training runs from their metrics.jsonl: tokens/s and MFU (median over
the logged windows after the first, which holds the compile), the last logged loss, and each run
against the first (the baseline): tokens/s ratio, and the relative loss difference at the run's
last step (the baseline must have logged that step).

    python benchmarks/train_table.py --runs bf16=/tmp/w/bf16,fp8=/tmp/w/fp8 [--json out.json]

benchmarks/gpu_kernels.sh uses it for the fp8-vs-bf16 and Pallas-vs-cuDNN llama_1b rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def summarize(workdir: str) -> dict:
    """The run's figures; raises SystemExit naming the folder when it logged nothing."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no metrics (did the run fail? see its log)")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    logged = [r for r in records if "tokens_per_s" in r]
    if not logged:
        raise SystemExit(f"{path}: no step was logged")
    timed = logged[1:] or logged  # the first window holds the compile
    return {
        "steps": logged[-1]["step"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r.get("mfu", 0.0) for r in timed),
        "loss": logged[-1]["loss"],
        "losses": {r["step"]: r["loss"] for r in logged},
    }


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    base = runs[names[0]]
    rows = [
        f"| run | steps | tokens/s | MFU | last loss | tokens/s vs {names[0]} | loss vs {names[0]} at that step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        r = runs[name]
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        # at the run's own last step: a shorter run is compared with the baseline's loss there
        base_loss = base["losses"].get(r["steps"])
        dloss = f"{(r['loss'] - base_loss) / abs(base_loss):+.2%}" if base_loss is not None else "-"
        rows.append(
            f"| {name} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['loss']:.4f} "
            f"| {ratio:.3f}x | {dloss} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="name=workdir,... (the first is the baseline)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    pairs = [p.split("=", 1) for p in args.runs.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--runs {args.runs!r}: give name=workdir pairs, comma separated")
    runs = {}
    for name, workdir in pairs:
        try:
            runs[name] = summarize(workdir)
        except SystemExit as e:  # one failed run does not hide the others
            print(e, file=sys.stderr)
    if not runs:
        raise SystemExit("no run has metrics")
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
