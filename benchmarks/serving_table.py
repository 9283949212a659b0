"""Issue 31's serving table from the JSON files benchmarks/gpu_serving.sh writes.

    python benchmarks/serving_table.py --dir $OUT [--device "NVIDIA H100 80GB HBM3"] [--summary FILE]

Reads, from --dir: serve.json (`bench_serve --json`: the 256-request replay), host_gap.json
(`bench_serve --host-gap 64 --json`), decode.json (`jaxsys.analyze --mode decode --json`: the
roofline) and, if present, host_gap_bigpool.json (the same host-gap run with a larger page pool).
Prints a markdown table and writes every figure, with the raw inputs, to --summary (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load(directory: str, name: str):
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # something printed before the JSON line: take the last one
        return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def roofline_row(decode: dict, batch: int, context: int) -> dict | None:
    rows = [r for r in decode.get("rows", []) if r["batch"] == batch]
    if not rows:
        return None
    return min(rows, key=lambda r: abs(r["context"] - context))


def summarize(directory: str, device: str) -> dict:
    serve, gap, decode = (load(directory, n) for n in ("serve.json", "host_gap.json", "decode.json"))
    big = load(directory, "host_gap_bigpool.json")
    out: dict = {"device": device, "raw": {"serve": serve, "host_gap": gap, "decode": decode, "host_gap_bigpool": big}}
    if serve:
        out["serve"] = {
            "requests": serve["requests"],
            "generated_tokens": serve["generated_tokens"],
            "output_tokens_per_s": serve["throughput_tokens_per_s"],
            "ttft_p50_s": serve["ttft_s"]["p50"],
            "ttft_p99_s": serve["ttft_s"]["p99"],
            "tpot_p50_s": serve["tpot_s"]["p50"],
            "tpot_p99_s": serve["tpot_s"]["p99"],
            "steps": serve["steps"],
            "step_p50_s": serve["step_s"]["p50"],
            "makespan_s": serve["makespan_s"],
            "prefix_cache_hit_rate": serve.get("prefix_cache_hit_rate"),
            "preemptions": serve.get("preemptions"),
        }
    if gap:
        out["host_gap"] = dict(gap)
        if decode:
            # the host-gap run decodes 64 sequences of a 32-token prompt for ~24-45 steps: context ~60
            row = roofline_row(decode, gap["sequences"], 64)
            if row:
                out["roofline"] = {
                    "batch": row["batch"],
                    "context": row["context"],
                    "latency_s": row["latency_s"],
                    "memory_s": row["memory_s"],
                    "compute_s": row["compute_s"],
                    "bound": row["bound"],
                    "weight_bytes": decode.get("weight_bytes_per_device"),
                    "hardware": decode.get("hardware"),
                    "compiled_step_over_roofline": gap["compiled_step_s"] / row["latency_s"],
                    "engine_step_over_roofline": gap["engine_step_s"] / row["latency_s"],
                }
    if gap and big:
        out["pool_size"] = {
            "compiled_step_s": big["compiled_step_s"],
            "engine_step_s": big["engine_step_s"],
            "compiled_step_ratio_to_small_pool": big["compiled_step_s"] / gap["compiled_step_s"],
        }
    return out


def table(s: dict) -> str:
    ms = lambda x: f"{x * 1e3:.2f} ms" if x is not None else "-"
    lines = [f"Device: {s['device'] or 'unknown'}", "", "| figure | value |", "|---|---:|"]
    if "serve" in s:
        v = s["serve"]
        lines += [
            f"| requests / output tokens | {v['requests']} / {v['generated_tokens']:,} |",
            f"| output tokens/s | {v['output_tokens_per_s']:,.0f} |",
            f"| TTFT p50 / p99 | {v['ttft_p50_s']:.3f} s / {v['ttft_p99_s']:.3f} s |",
            f"| TPOT p50 / p99 | {ms(v['tpot_p50_s'])} / {ms(v['tpot_p99_s'])} |",
            f"| steps, step p50, makespan | {v['steps']}, {ms(v['step_p50_s'])}, {v['makespan_s']:.1f} s |",
            f"| prefix-cache hit rate, preemptions | {v['prefix_cache_hit_rate'] or 0:.1%}, {v['preemptions']} |",
        ]
    if "host_gap" in s:
        g = s["host_gap"]
        lines += [
            f"| decode step at batch {g['sequences']}: engine / compiled | {ms(g['engine_step_s'])} / {ms(g['compiled_step_s'])} |",
            f"| host-gap ratio (engine / compiled) | {g['host_gap_ratio']:.2f} |",
        ]
    if "roofline" in s:
        r = s["roofline"]
        lines += [
            f"| roofline at batch {r['batch']}, context {r['context']} ({r['hardware']}) | {ms(r['latency_s'])} ({r['bound']} bound; weights {r['weight_bytes'] / 1e9:.2f} GB) |",
            f"| compiled / roofline, engine / roofline | {r['compiled_step_over_roofline']:.2f}x, {r['engine_step_over_roofline']:.2f}x |",
        ]
    if "pool_size" in s:
        p = s["pool_size"]
        lines.append(
            f"| compiled step, {p['pages']}-page pool (vs {p['small_pool_pages']}) | {ms(p['compiled_step_s'])} ({p['compiled_step_ratio_to_small_pool']:.2f}x) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where gpu_serving.sh wrote its JSON files")
    parser.add_argument("--device", default="", help="the device's name, for the record")
    parser.add_argument("--pages", type=int, default=0, help="pages of host_gap.json's pool")
    parser.add_argument("--big-pages", type=int, default=0, help="pages of host_gap_bigpool.json's pool")
    parser.add_argument("--summary", help="write the summary JSON here")
    args = parser.parse_args(argv)
    s = summarize(args.dir, args.device)
    if "pool_size" in s:
        s["pool_size"].update(pages=args.big_pages or None, small_pool_pages=args.pages or None)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(s, f, indent=1)
    print(table(s))
    return 0 if "serve" in s or "host_gap" in s else 1


if __name__ == "__main__":
    sys.exit(main())
