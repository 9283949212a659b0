"""Zeroth-order fine-tuning (MeZO) against first-order AdamW on a shifted corpus, and the device
bytes of ZO with and without ZO2's weight streaming as the model gets deeper.

    .venv/bin/python experiments/zeroth_order/run.py [--quick] [--training-only]

1. pretrain: configs/tiny.py (0.82M parameters) with AdamW for 200 steps on the Python stdlib
   sources (bytes), on one CPU device;
2. fine-tune from it (config.checkpoint.init_from) on English prose from the same Python install,
   IDLE's release notes and read-mes (idlelib/*.txt) and LICENSE.txt (132 KB; 5% held out):
   AdamW (lr 1e-3, weight decay 0.1, constant, 100 steps) and ZO (MeZO: eps 1e-3, lr 3e-4, no
   weight decay, constant, 2000 steps), the eval loss on the held-out tail at step 0 and every
   25 / 100 steps;
3. with the TPU compiler (ahead of time, v5p-8 = 4 chips): device bytes per chip of both
   fine-tuning steps (tiny, data=4), and of a Llama-shaped model (D=1024, N=16, K=4, H=64, F=2816,
   V=32000, T=1024, one sequence per chip, bf16 compute, fsdp=4) at L = 4, 8, 16 layers with AdamW,
   ZO, and ZO with config.offload.params (ZO2).
Writes results.json and zeroth_order.png next to this file and prints the README tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)  # one CPU device
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
RUNS = os.path.join(HERE, "runs")  # ignored by git

STDLIB = sysconfig.get_paths()["stdlib"]
SHIFTED = f"{STDLIB}/idlelib/*.txt,{STDLIB}/LICENSE.txt"
FORWARDS_PER_STEP = {"zo": 2, "adamw": 3}  # ZO: two forwards; first order: forward + backward (~2 forwards)


def tiny(overrides: list[str]):
    from jaxsys.config import load_config

    return load_config(os.path.join(ROOT, "configs", "tiny.py"), ["--config.train.progress=false"] + overrides)


def finetune_overrides(optimizer: str, lr: float, steps: int, eval_every: int) -> list[str]:
    return [
        "--config.data.source=text",
        f"--config.data.path={SHIFTED}",
        "--config.data.eval_fraction=0.05",
        f"--config.checkpoint.init_from={os.path.join(RUNS, 'pretrain')}",
        "--config.checkpoint.enabled=false",
        f"--config.train.optimizer={optimizer}",
        f"--config.train.lr={lr}",
        f"--config.train.steps={steps}",
        "--config.train.schedule=constant",
        "--config.train.warmup_steps=0",
        f"--config.train.eval_every={eval_every}",
        "--config.train.log_every=10",
    ]


# ----------------------------------------------------------------------------- training (CPU)


def step0_eval(config) -> float:
    """The fine-tuning corpus's eval loss of the pretrained parameters (both runs start there)."""
    import jax

    from jaxsys import checkpoint, data, train
    from jaxsys.mesh import make_mesh

    program = train.build(config, make_mesh(config, jax.devices()[:1]))
    params, _ = checkpoint.restore_params(config.checkpoint.init_from, program.abstract_state().params)
    return train.evaluate(program, program.eval_loss_fn(), params, data.load_corpus(config.data))


def training(quick: bool) -> dict:
    from jaxsys import train

    shutil.rmtree(RUNS, ignore_errors=True)
    pre_steps = 60 if quick else 200
    t0 = time.time()
    pre = train.main(
        tiny([f"--config.train.steps={pre_steps}", "--config.train.eval_every=0"]), os.path.join(RUNS, "pretrain")
    )
    out = {"pretrain": {"steps": pre_steps, "seconds": time.time() - t0, "records": pre}}
    # ZO: lr 3e-4, no weight decay (MeZO's setting). A sweep at 1000 steps gave eval 2.654 (lr 1e-4),
    # 2.639 (3e-4); lr 1e-3 fell to 2.680 by step 100 and then rose to 2.720 by step 500 (too noisy).
    plans = {"adamw": (1e-3, 40 if quick else 100, 25, 0.1), "zo": (3e-4, 200 if quick else 2000, 100, 0.0)}
    for name, (lr, steps, every, wd) in plans.items():
        config = tiny(finetune_overrides(name, lr, steps, every) + [f"--config.train.weight_decay={wd}"])
        start = step0_eval(config)
        t0 = time.time()
        records = train.main(config, os.path.join(RUNS, name))
        seconds = time.time() - t0
        # per-step time from the logged windows (tokens/s), compile and eval excluded
        tokens = config.train.batch_size * config.data.seq_len
        step_s = sorted(tokens / r["tokens_per_s"] for r in records if r["step"] > 10)
        out[name] = {
            "lr": lr,
            "weight_decay": wd,
            "eps": config.train.zo.eps,
            "steps": steps,
            "seconds": seconds,
            "step_seconds_median": step_s[len(step_s) // 2],
            "forwards_per_step": FORWARDS_PER_STEP[name],
            "eval_step0": start,
            "eval": [[0, start]] + [[r["step"], r["eval_loss"]] for r in records if "eval_loss" in r],
            "train": [[r["step"], r["loss"]] for r in records],
        }
        print(
            f"{name}: eval {start:.3f} -> {out[name]['eval'][-1][1]:.3f} in {steps} steps ({seconds:.0f} s)", flush=True
        )
    return out


# ----------------------------------------------------------------------------- device bytes (TPU compiler)


def llama_like(layers: int, optimizer: str, offload_params: bool):
    from jaxsys.config import base_config

    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 32000, 1024, layers
    m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 16, 4, 64, 2816
    m.compute_dtype, m.remat = "bfloat16", "full"
    c.data.seq_len, c.train.batch_size = 1024, 4
    c.mesh.fsdp = 4
    c.train.optimizer, c.offload.params = optimizer, offload_params
    return c


def state_bytes_per_chip(config, devices) -> dict:
    """Bytes of device 0's shards of the train state, by memory kind (from the shardings)."""
    import math

    import jax

    from jaxsys import train
    from jaxsys.mesh import make_mesh

    program = train.build(config, make_mesh(config, devices))
    out = {"device": 0, "pinned_host": 0}
    for leaf in jax.tree.leaves(program.abstract_state()):
        kind = leaf.sharding.memory_kind or "device"
        out[kind] += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return out


def device_bytes(quick: bool) -> list[dict]:
    from jaxsys.analysis import report, targets
    from jaxsys.models import params as params_lib
    from jaxsys.models import transformer

    target = targets.parse("v5p-8")
    devices = targets.devices(target)
    jobs = [
        ("tiny", 4, opt, False, tiny(["--config.mesh.data=4", f"--config.train.optimizer={opt}"]))
        for opt in ("adamw", "zo")
    ]
    for layers in (4, 8) if quick else (4, 8, 16):
        for opt, off in (("adamw", False), ("zo", False), ("zo", True)):
            jobs.append(("llama_like", layers, opt, off, llama_like(layers, opt, off)))
    rows = []
    for model, layers, opt, off, config in jobs:
        t0 = time.time()
        r = report.target_analysis(config, target, devices)
        row = {
            "model": model,
            "layers": layers if model != "tiny" else config.model.n_layers,
            "optimizer": opt,
            "offload_params": off,
            "compile_s": time.time() - t0,
            "params": params_lib.count(transformer.param_specs(config.model)),
            "memory": r["memory"],
            "state_bytes": state_bytes_per_chip(config, devices),
        }
        rows.append(row)
        print(
            f"{model} L={row['layers']} {opt}{' + offload.params' if off else ''}: device peak "
            f"{r['memory']['device']['peak_bytes'] / 2**20:.1f} MiB/chip ({row['compile_s']:.0f} s)",
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------- report


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def tables(results: dict) -> str:
    t = results["training"]
    out = [
        "#### Fine-tuning on the shifted corpus (eval loss on its held-out tail; tiny, 1 CPU device)",
        "",
        "| optimizer | lr | weight decay | steps | forward passes | eval loss at 0 | eval loss at end | s / step (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("adamw", "zo"):
        r = t[name]
        out.append(
            f"| {name} | {r['lr']:g} | {r['weight_decay']:g} | {r['steps']} | {r['steps'] * r['forwards_per_step']} | "
            f"{r['eval_step0']:.3f} | {r['eval'][-1][1]:.3f} | {r['step_seconds_median']:.3f} |"
        )
    out += [
        "",
        "Eval loss against forward passes (ZO 2 per step, AdamW ~3):",
        "",
        "| forward passes | AdamW | ZO |",
        "|---:|---:|---:|",
    ]
    curves = {n: {s * t[n]["forwards_per_step"]: v for s, v in t[n]["eval"]} for n in ("adamw", "zo")}
    for f in sorted(set(curves["adamw"]) | set(curves["zo"])):
        a, z = curves["adamw"].get(f), curves["zo"].get(f)
        out.append(f"| {f} | {'' if a is None else f'{a:.3f}'} | {'' if z is None else f'{z:.3f}'} |")
    out += [
        "",
        "#### Device bytes per chip, TPU compiler (v5p-8: 4 chips), MiB",
        "",
        "| model | L | optimizer | params at rest | state on device (shardings) | state on host | "
        "XLA device arguments | XLA device temporaries | XLA device peak | XLA host peak |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["device_bytes"]:
        m, s = r["memory"], r["state_bytes"]
        opt = r["optimizer"] + (" + offload.params (ZO2)" if r["offload_params"] else "")
        out.append(
            f"| {r['model']} | {r['layers']} | {opt} | {'host' if r['offload_params'] else 'device'} | "
            f"{mib(s['device'])} | {mib(s['pinned_host'])} | {mib(m['device']['argument_bytes'])} | "
            f"{mib(m['device']['temp_bytes'])} | {mib(m['device']['peak_bytes'])} | "
            f"{mib(m['host']['peak_bytes'])} |"
        )
    return "\n".join(out)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = results["training"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"adamw": "tab:blue", "zo": "tab:red"}
    labels = {"adamw": "AdamW (first order)", "zo": "ZO (MeZO)"}
    for name in ("adamw", "zo"):
        r = t[name]
        steps, ev = zip(*r["eval"])
        axes[0].plot(steps, ev, "o-", color=colors[name], label=labels[name])
        tr_steps, tr = zip(*r["train"])
        axes[0].plot(tr_steps, tr, "-", color=colors[name], alpha=0.25)
        k = r["forwards_per_step"]
        axes[1].plot([s * k for s in steps], ev, "o-", color=colors[name], label=f"{labels[name]}, {k} fwd/step")
    axes[0].set(xlabel="step", ylabel="loss (nats/byte)", title="fine-tuning: eval (o) and train (faint) loss")
    axes[1].set(xlabel="forward passes (forward-equivalents)", ylabel="eval loss", title="eval loss vs forward passes")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    rows = [r for r in results["device_bytes"] if r["model"] == "llama_like"]
    for (opt, off), style, label in (
        (("adamw", False), "s-", "AdamW"),
        (("zo", False), "o-", "ZO, params on device"),
        (("zo", True), "^-", "ZO2: ZO + offload.params"),
    ):
        sel = [r for r in rows if r["optimizer"] == opt and r["offload_params"] == off]
        axes[2].plot(
            [r["layers"] for r in sel], [r["memory"]["device"]["peak_bytes"] / 2**20 for r in sel], style, label=label
        )
    axes[2].set(
        xlabel="layers L", ylabel="device peak per chip (MiB)", title="Llama-shaped D=1024, v5p-8 (TPU compiler)"
    )
    axes[2].set_ylim(bottom=0)
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps and layers (a smoke test)")
    parser.add_argument(
        "--training-only",
        action="store_true",
        help="rerun the training part; keep results.json's TPU-compiler device bytes",
    )
    args = parser.parse_args()
    t0 = time.time()
    if args.training_only:
        with open(os.path.join(HERE, "results.json")) as f:
            kept = json.load(f)["device_bytes"]
    results = {
        "training": training(args.quick),
        "device_bytes": kept if args.training_only else device_bytes(args.quick),
        "quick": args.quick,
        "shifted_corpus": SHIFTED,
    }
    results["seconds"] = time.time() - t0
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(HERE, "zeroth_order.png"))
    print(tables(results))
    print(f"total {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
