"""Pod-size layouts compiled by the TPU compiler on this machine (no TPU): the table of
docs/benchmarks/tpu_aot.md.

    PYTHONPATH=. .venv/bin/python benchmarks/tpu_aot.py --json /tmp/tpu_aot.json [--cases a,b]

Each case runs `python -m jaxsys.analyze --target ... --json --no-flops` in its own process (the
fake-CPU half needs its own device count), so the figures are exactly what a user gets from the
command printed beside them. Per case: compile time of the TPU compiler and of the whole command,
HBM per chip from the TPU compiler, from XLA:CPU on as many fake devices, and the ZeRO formula for
the state; host bytes; collective bytes per chip (compiled HLO, fake CPU, formula); the roofline
step time and MFU on the chip's profile. Needs libtpu (`pip install -e '.[tpu]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {  # name: (config, target, overrides)
    "llama_8b-fsdp16-tp8": ("configs/llama_8b.py", "v5p-256", []),
    "llama_8b-data2-fsdp8-tp8": ("configs/llama_8b.py", "v5p-256", ["--config.mesh.data=2"]),
    "llama_8b-pipe4-fsdp4-tp8": (
        "configs/llama_8b.py",
        "v5p-256",
        ["--config.mesh.pipe=4", "--config.train.microbatches=8", "--config.train.pipeline_schedule=1f1b"],
    ),
    # 32K context: 32 sequences x 32K = 1M tokens; ring context parallelism over 8 with the TPU
    # flash kernel (the reference attention would hold B x N x T x T scores)
    "llama_8b-32k-seq8-fsdp2-tp8": (
        "configs/llama_8b.py",
        "v5p-256",
        [
            "--config.mesh.seq=8",
            "--config.data.seq_len=32768",
            "--config.train.batch_size=32",
            "--config.model.attention_impl=pallas",
            "--config.model.attention_block=512",
            "--config.model.context_parallel=ring",
        ],
    ),
    # two slices of 64 chips: data across the data-centre network
    "llama_8b-2x-v5p-128-dcn-data2": (
        "configs/llama_8b.py",
        "v5p-128",
        ["--slices=2", "--config.mesh.data=2", "--config.dcn.data=2"],
    ),
    "mixtral_8x7b-ep8-fsdp4": ("configs/mixtral_8x7b.py", "v5p-64", []),
    "mixtral_8x7b-ep8-fsdp4-capacity": ("configs/mixtral_8x7b.py:capacity", "v5p-64", []),
    "llama_1b-fsdp16": ("configs/llama_1b.py", "v5e-16", []),  # remat dots: does not fit 16 GiB
    "llama_1b-fsdp16-remat-full": ("configs/llama_1b.py", "v5e-16", ["--config.model.remat=full"]),
}


def run(name: str) -> dict:
    config, target, overrides = CASES[name]
    slices = [o for o in overrides if o.startswith("--slices")]
    rest = [o for o in overrides if not o.startswith("--slices")]
    cmd = [
        sys.executable,
        "-m",
        "jaxsys.analyze",
        "--config",
        config,
        "--target",
        target,
        *slices,
        "--json",
        "--no-flops",
        *rest,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    shown = " ".join(["python -m jaxsys.analyze", "--config", config, "--target", target, *slices, *rest])
    if out.returncode:
        return {"name": name, "command": shown, "error": out.stderr.strip().splitlines()[-1][:400], "wall_s": wall}
    return {"name": name, "command": shown, "wall_s": wall, "result": json.loads(out.stdout)}


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def row(entry: dict) -> str:
    if "error" in entry:
        return f"| {entry['name']} | error: {entry['error']} |"
    r = entry["result"]
    t = r["target"]
    layout = " x ".join(f"{a}={s}" for a, s in r["config"]["mesh"].items() if s > 1)
    f = r["memory_formula"]
    cpu_peak = _gib(r["memory"]["peak_bytes_per_device"])
    if "device" not in t["memory"]:
        m = t["memory"]
        return (
            f"| {entry['name']} | {t['name']} | {layout} | {t['compile_s']:.0f} / {entry['wall_s']:.0f} | "
            f"does not fit: needs {_gib(m.get('required_bytes', 0))} of {_gib(m.get('available_bytes', 0))} | "
            f"{cpu_peak} | {_gib(f['params'] + f['optimizer'])} | - | - | - | - |"
        )
    m, rl = t["memory"], t["roofline"]
    comm = lambda rows: sum(x["bytes"] for x in rows if not x.get("scalar"))
    return (
        f"| {entry['name']} | {t['name']} | {layout} | {t['compile_s']:.0f} / {entry['wall_s']:.0f} | "
        f"{_gib(m['device']['peak_bytes'])} | {cpu_peak} | {_gib(f['params'] + f['optimizer'])} | "
        f"{_gib(m['host']['peak_bytes'])} | "
        f"{_gib(comm(t['collectives']))} / {_gib(comm(r['collectives']))} / {_gib(comm(r['collectives_formula']))} | "
        f"{rl['step_s_overlapped'] * 1e3:.0f} / {rl['step_s_schedule'] * 1e3:.0f} | "
        f"{rl['mfu_overlapped']:.1%} / {rl['mfu_schedule']:.1%} |"
    )


HEADER = (
    "| case | target | mesh | compile s (TPU / whole command) | HBM peak GiB/chip, TPU compiler | "
    "same, XLA:CPU | state GiB, ZeRO formula | host GiB | collective GiB/chip/step: TPU / XLA:CPU / "
    "formula | roofline step ms: all comm hidden / TPU schedule | MFU: hidden / schedule |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    entries = []
    for name in args.cases.split(","):
        entry = run(name)
        entries.append(entry)
        print(row(entry), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(entries, f, indent=1)
    print("\n" + HEADER)
    for entry in entries:
        print(row(entry))
    for entry in entries:
        print(f"- {entry['name']}: `{entry['command']}`")
    return int(any("error" in e for e in entries))


if __name__ == "__main__":
    sys.exit(main())
