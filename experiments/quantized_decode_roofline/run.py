"""Decode tokens/s per weight format from a roofline: bf16, W8A16, W4A16 (G = 128) and W8A8 for
Llama-7B and Llama-70B on an H100 and a TPU v5p, batch 1..128, beside MARLIN's claim.

    .venv/bin/python experiments/quantized_decode_roofline/run.py            # tables, results.json, plot
    .venv/bin/python experiments/quantized_decode_roofline/run.py --measured q.json  # + bench.py figures

Claim (MARLIN, Frantar et al., PPoPP 2025; docs/papers.md): 4-bit weights x 16-bit activations
stay memory-bound at batch > 1: close to the ideal 4x over FP16 up to batch 16-32, decreasing but
significant to 64-128; up to 2.8x end-to-end in vLLM.

The model (per decode step of `batch` sequences, each at `context` tokens of KV cache), as the
issue states it:

    time = max((weight bytes + KV-cache bytes + activation bytes) / HBM bandwidth,
               matmul FLOPs / peak)

* weight bytes: every matmul of the transformer blocks (q, k, v, o, gate, up, down) in the format,
  codes + scales (+ zero points), `bench.bytes_moved`; the output layer (D x V) stays bf16 in every
  format (as GPTQ / AWQ / MARLIN keep it); embeddings read B rows (counted with activations);
* KV-cache bytes: 2 (K, V) x layers x context x kv heads x head dim x 2 B (bf16) per sequence;
* activation bytes: each matmul's input and output once (bf16; int8 x + fp32 scales for W8A8);
* FLOPs: 2 x matmul parameters x batch (attention's own FLOPs, 4 x layers x context x heads x
  head dim per token, are left out, as the claim's formula does; decode attention reads its KV
  cache at a few FLOPs per byte, far below any ridge point). The quantized matmuls run at the
  bf16 peak for W8A16 / W4A16 (the codes are dotted in bf16) and at the int8 peak for W8A8
  (analysis/hardware.py's `PROFILES`, datasheet dense figures); the bf16 output layer at the bf16 peak.

Chip figures come from jaxsys/analysis/hardware.py (PROFILES["h100"], ["tpu_v5p"]). The A10
line (MARLIN's GPU, datasheet: 600 GB/s, 125 TFLOP/s fp16 dense) only places the paper's crossover.
Nothing here is measured on an accelerator: no GPU or TPU was lent to this session. `--measured`
reads a `python -m jaxsys.kernels.quantized_matmul.bench --out F.json` record and adds the
kernels' measured speed-up over bf16 (the layer's matmuls at that batch, weighted by how often
each shape occurs per layer) beside the roofline's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsys.analysis import hardware  # noqa: E402
from jaxsys.kernels.quantized_matmul.bench import bytes_moved  # noqa: E402

FORMATS = ("bf16", "w8a16", "w4a16", "w8a8")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (0, 128, 2048)  # 0: weights only, the kernel-level claim
GROUP_SIZE = 128
MODELS = {  # Llama-2 shapes (the bench's layer shapes)
    "llama-7b": dict(layers=32, d=4096, f=11008, heads=32, kv_heads=32, head_dim=128, vocab=32000),
    "llama-70b": dict(layers=80, d=8192, f=28672, heads=64, kv_heads=8, head_dim=128, vocab=32000),
}
A10 = hardware.Hardware(
    "NVIDIA A10 (MARLIN's GPU; datasheet)", {"bfloat16": 125e12, "int8": 250e12}, 600e9, 24e9, 1, 0.0, 0.0
)
CHIPS = {"h100": hardware.PROFILES["h100"], "tpu_v5p": hardware.PROFILES["tpu_v5p"], "a10": A10}
MARLIN = dict(
    source="Frantar et al., MARLIN, PPoPP 2025 (abstract) and github.com/IST-DASLab/marlin README",
    kernel="close to the maximum (4x) quantization speed-up up to batch 16-32 (README: the 'optimal "
    "3.87x' with 0.125 bits of group-scale overhead, on an A10); gradually decreasing but "
    "significant speed-up to batch 64-128",
    end_to_end="up to 2.8x end-to-end in vLLM",
)


def matmuls(model: dict) -> list[tuple[int, int, int]]:
    """(K, N, count per layer) of a block's matmuls: q, k, v, o, gate, up, down."""
    d, f, hd = model["d"], model["f"], model["head_dim"]
    q, kv = model["heads"] * hd, model["kv_heads"] * hd
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    counts = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    return [(k, n, c) for (k, n), c in counts.items()]


def params(model: dict) -> dict:
    block = model["layers"] * sum(k * n * c for k, n, c in matmuls(model))
    head = model["d"] * model["vocab"]
    return dict(blocks=block, head=head, matmul=block + head)


def step(name: str, fmt: str, batch: int, context: int, hw, group_size: int = GROUP_SIZE) -> dict:
    """One decode step of `batch` sequences on one device, by the module docstring's roofline."""
    model = MODELS[name]
    weights = acts = compute = per_kernel = 0.0
    bw = hw.hbm_bytes_per_s
    peak = hw.peak("int8" if fmt == "w8a8" else "bfloat16")
    for k, n, count in matmuls(model):
        b = bytes_moved(fmt, batch, k, n, group_size)
        weights += model["layers"] * count * b["weights"]
        acts += model["layers"] * count * (b["activations"] + b["out"])
        compute += model["layers"] * count * 2.0 * batch * k * n / peak
        per_kernel += model["layers"] * count * max(b["total"] / bw, 2.0 * batch * k * n / peak)
    head = bytes_moved("bf16", batch, model["d"], model["vocab"])
    head_flops = 2.0 * batch * model["d"] * model["vocab"]
    weights += head["weights"]
    acts += head["activations"] + head["out"] + 2 * batch * model["d"]  # + embedding rows
    compute += head_flops / hw.peak("bfloat16")
    kv = 2.0 * model["layers"] * context * model["kv_heads"] * model["head_dim"] * 2 * batch
    memory = (weights + kv + acts) / bw
    seconds = max(memory, compute)
    # the stricter variant: each kernel at its own roofline, attention reading the KV cache apart
    per_kernel += max(head["total"] / bw, head_flops / hw.peak("bfloat16")) + (kv + 2 * batch * model["d"]) / bw
    return dict(
        model=name,
        format=fmt,
        batch=batch,
        context=context,
        chip=hw.name,
        weight_bytes=weights,
        kv_bytes=kv,
        activation_bytes=acts,
        memory_s=memory,
        compute_s=compute,
        seconds=seconds,
        tokens_per_s=batch / seconds,
        per_kernel_s=per_kernel,
        bound="compute" if compute > memory else "memory",
        fits=weights + kv <= hw.hbm_bytes,
    )


def crossover(name: str, fmt: str, context: int, hw, group_size: int = GROUP_SIZE, limit: int = 1 << 14):
    """The smallest batch at which the step turns compute bound; None if not by `limit` (with a
    KV cache the bytes grow with the batch too, and may outgrow the FLOPs: then never)."""
    lo, hi = 1, limit
    if step(name, fmt, hi, context, hw, group_size)["bound"] == "memory":
        return None
    while lo < hi:  # memory time and compute time both grow linearly in batch: bisect
        mid = (lo + hi) // 2
        if step(name, fmt, mid, context, hw, group_size)["bound"] == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo


def ideal_crossover_weights_only(bytes_per_weight: float, hw, dtype: str = "bfloat16") -> float:
    """Closed form for a matmul with negligible activations: bytes/weight / BW = 2 B / peak."""
    return bytes_per_weight * hw.peak(dtype) / (2 * hw.hbm_bytes_per_s)


def sweep(batches=BATCHES, contexts=CONTEXTS, chips=("h100", "tpu_v5p")) -> list[dict]:
    """Every (chip, model, context, batch, format) step, with the speed-up over bf16."""
    rows = []
    for chip in chips:
        hw = CHIPS[chip]
        for name in MODELS:
            for context in contexts:
                for batch in batches:
                    base = step(name, "bf16", batch, context, hw)
                    for fmt in FORMATS:
                        r = step(name, fmt, batch, context, hw) | dict(chip_key=chip)
                        r["speedup_vs_bf16"] = base["seconds"] / r["seconds"]
                        r["per_kernel_speedup_vs_bf16"] = base["per_kernel_s"] / r["per_kernel_s"]
                        rows.append(r)
    return rows


def crossovers(contexts=CONTEXTS, chips=("h100", "tpu_v5p", "a10")) -> list[dict]:
    out = []
    for chip in chips:
        for name in MODELS:
            for context in contexts:
                for fmt in FORMATS:
                    out.append(
                        dict(
                            chip_key=chip,
                            model=name,
                            context=context,
                            format=fmt,
                            batch=crossover(name, fmt, context, CHIPS[chip]),
                        )
                    )
    return out


# ----------------------------------------------------------------------------- measured (bench.py)


def measured_speedups(path: str) -> dict:
    """{(chip_key, model, batch, format): speed-up over bf16} from a bench.py JSON record: the
    block's matmul time at that batch, sum over its shapes weighted by their count per layer
    (shapes the bench did not time, e.g. 70B's 8192 x 1024 k / v, are left out of both)."""
    with open(path) as f:
        record = json.load(f)
    kind = record["device"].lower()
    chip = next((c for c in ("h100", "h200", "v5p") if c in kind), kind)
    chip = {"v5p": "tpu_v5p"}.get(chip, chip)
    best = {
        (r["model"], r["K"], r["N"], r["M"], r["format"]): r["us"]
        for r in record["results"]
        if r.get("best") and "us" in r
    }
    out = {}
    for name, model in MODELS.items():
        for m in sorted({key[3] for key in best if key[0] == name}):
            for fmt in FORMATS:
                num = den = 0.0
                for k, n, count in matmuls(model):
                    if (name, k, n, m, fmt) in best and (name, k, n, m, "bf16") in best:
                        num += count * best[(name, k, n, m, "bf16")]
                        den += count * best[(name, k, n, m, fmt)]
                if den:
                    out[(chip, name, m, fmt)] = num / den
    return out


# ----------------------------------------------------------------------------- output


def markdown_tokens(rows, chip, name, context, measured=None) -> str:
    sel = {
        (r["batch"], r["format"]): r
        for r in rows
        if r["chip_key"] == chip and r["model"] == name and r["context"] == context
    }
    batches = sorted({b for b, _ in sel})
    head = "| batch | bf16 tok/s | " + " | ".join(f"{f} tok/s (× bf16)" for f in FORMATS[1:])
    lines = [
        head + " | bound (bf16 / w4a16) | fits (bf16) |",
        "|---:|---:|" + "---:|" * (len(FORMATS) - 1) + "---|---|",
    ]
    for b in batches:
        cells = []
        for fmt in FORMATS[1:]:
            r = sel[(b, fmt)]
            cell = f"{r['tokens_per_s']:,.0f} ({r['speedup_vs_bf16']:.2f})"
            if measured is not None and context == 0:
                got = measured.get((chip, name, b, fmt))
                cell += f" [meas. {got:.2f}]" if got else " [meas. –]"
            cells.append(cell)
        lines.append(
            f"| {b} | {sel[(b, 'bf16')]['tokens_per_s']:,.0f} | "
            + " | ".join(cells)
            + f" | {sel[(b, 'bf16')]['bound']} / {sel[(b, 'w4a16')]['bound']} "
            f"| {'yes' if sel[(b, 'bf16')]['fits'] else 'no'} |"
        )
    return "\n".join(lines)


def markdown_crossovers(xs) -> str:
    lines = ["| chip | model | context | " + " | ".join(FORMATS) + " |", "|---|---|---:|" + "---:|" * len(FORMATS)]
    keyed = {(x["chip_key"], x["model"], x["context"], x["format"]): x["batch"] for x in xs}
    order = list(dict.fromkeys(k[:3] for k in keyed))  # as computed: chip, model, context
    for chip, name, context in order:
        lines.append(
            f"| {chip} | {name} | {context} | "
            + " | ".join(
                "never" if keyed[(chip, name, context, f)] is None else str(keyed[(chip, name, context, f)])
                for f in FORMATS
            )
            + " |"
        )
    return "\n".join(lines)


def plot(path, measured=None) -> None:
    """Speed-up over bf16 vs batch on one H100 (a dense batch grid, 1..256), each format at
    contexts 0 / 128 / 2048, with MARLIN's claim and bench.py's figures when given."""
    rows = sweep(batches=sorted({round(2 ** (i / 8)) for i in range(65)}), chips=("h100",))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), sharey=True)
    colors = {"w8a16": "tab:blue", "w4a16": "tab:red", "w8a8": "tab:green"}
    styles = {0: "-", 128: "--", 2048: ":"}
    for ax, name in zip(axes, MODELS):
        for fmt in FORMATS[1:]:
            for context, ls in styles.items():
                sel = sorted(
                    (r["batch"], r["speedup_vs_bf16"])
                    for r in rows
                    if r["chip_key"] == "h100" and r["model"] == name and r["format"] == fmt and r["context"] == context
                )
                if sel:
                    ax.plot(
                        *zip(*sel),
                        ls,
                        color=colors[fmt],
                        label=f"{fmt}, context {context}" if context else f"{fmt}, weights only",
                    )
            if measured:
                pts = sorted((m, s) for (c, n, m, f), s in measured.items() if c == "h100" and n == name and f == fmt)
                if pts:
                    ax.plot(*zip(*pts), "o", color=colors[fmt], label=f"{fmt} measured (bench)")
        ax.axhline(3.87, color="black", lw=0.8, ls="-.", label="MARLIN's ideal 3.87x (fp16 scales)")
        ax.axvspan(16, 32, color="orange", alpha=0.15, label="MARLIN: close to it up to batch 16-32 (A10)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoded together)")
        ax.set_title(f"{name} on one H100 (roofline)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode speed-up over bf16")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default=None, help="a bench.py JSON record (a GPU run)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    rows = sweep()
    xs = crossovers()
    measured = measured_speedups(args.measured) if args.measured else None
    for chip in ("h100", "tpu_v5p"):
        for name in MODELS:
            for context in CONTEXTS:
                print(
                    f"\n{name} on {CHIPS[chip].name}, context {context} "
                    f"({'weights only' if not context else 'tokens of KV cache per sequence'})\n"
                )
                print(markdown_tokens(rows, chip, name, context, measured))
    print("\nbatch at which the step turns compute bound\n")
    print(markdown_crossovers(xs))
    closed = {
        chip: {
            fmt: ideal_crossover_weights_only(bpw, CHIPS[chip], "int8" if fmt == "w8a8" else "bfloat16")
            for fmt, bpw in (
                ("bf16", 2.0),
                ("w8a16", 1.0),
                ("w4a16", 0.5 + 4 / GROUP_SIZE),
                ("w4a16_fp16_scales", 0.5 + 2 / GROUP_SIZE),
                ("w8a8", 1.0),
            )
        }
        for chip in CHIPS
    }
    print("\nclosed form, weights only: bytes per weight x peak / (2 x HBM bandwidth)")
    for chip, by_fmt in closed.items():
        print(f"  {chip}: " + ", ".join(f"{f} {b:.0f}" for f, b in by_fmt.items()))
    record = dict(
        claim=MARLIN,
        measured_on_accelerator=False,
        note="roofline only: no GPU or TPU was lent to this session; pass --measured F.json "
        "(bench.py on a GPU) to add the kernels' measured speed-ups",
        model="time = max((weights + KV + activations) / HBM BW, matmul FLOPs / peak)",
        chips={
            k: dict(name=hw.name, hbm_bytes_per_s=hw.hbm_bytes_per_s, peak=hw.peak_flops, hbm_bytes=hw.hbm_bytes)
            for k, hw in CHIPS.items()
        },
        models={k: dict(v, params=params(v)) for k, v in MODELS.items()},
        group_size=GROUP_SIZE,
        steps=rows,
        crossovers=xs,
        closed_form_crossovers=closed,
        measured=None
        if measured is None
        else [dict(chip=c, model=n, batch=m, format=f, speedup=s) for (c, n, m, f), s in measured.items()],
    )
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nwrote {os.path.join(HERE, 'results.json')}")
    if not args.no_plot:
        plot(os.path.join(HERE, "quantized_decode_roofline.png"), measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
