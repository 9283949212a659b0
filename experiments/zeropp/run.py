"""ZeRO++ (hpZ, qwZ, qgZ): bytes over the slow and the fast links for llama_8b on 2 TPU slices, and
loss parity on a small model (docs/zeropp.md).

    .venv/bin/python experiments/zeropp/run.py [--quick] [--replot]

Bytes: `analysis.zeropp.link_bytes` for configs/llama_8b.py on 2 v5p-256 slices (mesh data=2 across
the slices, fsdp=16 and tensor=8 inside each), bf16 compute: ZeRO-3 over fsdp x data
(sharding.params.embed = "fsdp,data"), hpZ, hpZ + qwZ, hpZ + qwZ + qgZ (int8, and int4: bytes only,
`--bytes` recomputes this table alone). Per device and step (one
micro-batch), the weight and gradient collectives only, counted two ways (analysis/zeropp.py):
hierarchical (ZeRO-3's collectives over fsdp x data split into their data and fsdp hops) and flat
(a collective whose group spans data counted wholly on the slow links); seconds from the
hierarchical bytes at the v5p's per-chip DCN (6.25 GB/s) and ICI (2 links x 90 GB/s) rates from
analysis/hardware.py, no overlap. The flat count equals the compiled XLA:CPU step's collectives in
tests/test_zeropp.py.

Loss parity: a D=64, L=4 byte-level model trained for 300 steps (--quick: 60) on 8 simulated CPU
devices (data=2 x fsdp=4) under each of the four layouts, same data and seed; final train loss
and the held-out eval loss.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import (  # noqa: E402
    emit,
    load_results,
    markdown_table,
    parse_args,
    run_worker,
    save_results,
    worker_devices,
)

DEVICES = 8
VARIANTS = [
    ("ZeRO-3", dict()),
    ("hpZ", dict(zeropp_hpz=True)),
    ("hpZ+qwZ", dict(zeropp_hpz=True, zeropp_qwz=True)),
    ("hpZ+qwZ+qgZ", dict(zeropp_hpz=True, zeropp_qwz=True, zeropp_qgz=True)),
]
# bytes only (not trained): qgZ with int4 codes, the paper's setting for the gradients
BYTES_VARIANTS = VARIANTS + [
    ("hpZ+qwZ+qgZ(int4)", dict(zeropp_hpz=True, zeropp_qwz=True, zeropp_qgz=True, zeropp_qgz_bits=4))
]
SLICES, SLICE_CHIPS, TENSOR = 2, 128, 8  # 2 x v5p-256 (128 chips each)


def _apply(c, options: dict):
    c.sharding.params.embed = "fsdp,data"
    c.train.zero_stage = 0
    for key, value in options.items():
        c.parallel[key] = value
    return c


def llama_bytes() -> list[dict]:
    from jaxsys.analysis import hardware
    from jaxsys.analysis import zeropp as analysis
    from jaxsys.config import load_config

    chip = hardware.TPU_CHIPS["v5p"]
    rows = []
    for name, options in BYTES_VARIANTS:
        c = load_config(os.path.join(ROOT, "configs", "llama_8b.py"))
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = SLICES, SLICE_CHIPS // TENSOR, TENSOR
        c = _apply(c, options)
        b, h = analysis.link_bytes(c), analysis.link_bytes(c, hierarchical=True)
        rows.append(
            dict(
                name=name,
                inter=b["inter"],
                intra=b["intra"],
                inter_hier=h["inter"],
                intra_hier=h["intra"],
                inter_s=h["inter"] / chip.dcn_bytes_per_s,
                intra_s=h["intra"] / (2 * chip.ici_link_bytes_per_s),
            )
        )
    return rows


def small_config(steps: int):
    from jaxsys.config import base_config

    c = base_config()
    c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.n_kv_heads = 64, 4, 4, 2
    c.model.head_dim, c.model.d_ff = 16, 192
    c.data.seq_len = 64
    c.train.batch_size, c.train.steps, c.train.lr, c.train.warmup_steps = 16, steps, 3e-3, 20
    c.train.log_every, c.train.eval_every, c.train.eval_batches = 20, steps, 8
    c.train.progress = False
    c.checkpoint.enabled = False
    c.mesh.data, c.mesh.fsdp = 2, 4
    return c


def worker(n: int, jobs: list) -> None:
    worker_devices(n)
    from jaxsys import train

    for job in jobs:
        c = _apply(small_config(job["steps"]), job["options"])
        c.seed = job.get("seed", c.seed)
        with tempfile.TemporaryDirectory() as workdir:
            train.main(c, workdir)
            records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
        emit(
            dict(
                name=job["name"],
                train=[(r["step"], r["loss"]) for r in records if "loss" in r],
                eval=[(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r],
            )
        )


def report(results: dict) -> None:
    rows = results["bytes"]
    base = rows[0]
    print(
        "\n".join(
            markdown_table(
                [
                    "llama_8b, 2 x v5p-256",
                    "DCN GiB (hier.)",
                    "vs ZeRO-3",
                    "ICI GiB (hier.)",
                    "DCN s",
                    "ICI s",
                    "flat: slow GiB",
                    "flat: fast GiB",
                ],
                "lrrrrrrr",
                [
                    [
                        r["name"],
                        f"{r['inter_hier'] / 2**30:.3f}",
                        f"{r['inter_hier'] / base['inter_hier']:.3f}x",
                        f"{r['intra_hier'] / 2**30:.2f}",
                        f"{r['inter_s']:.3f}",
                        f"{r['intra_s']:.3f}",
                        f"{r['inter'] / 2**30:.2f}",
                        f"{r['intra'] / 2**30:.2f}",
                    ]
                    for r in rows
                ],
            )
        )
    )
    print()
    runs = results["parity"]
    ref = runs[0]
    print(
        "\n".join(
            markdown_table(
                ["small model, data=2 x fsdp=4", "final train loss", "eval loss", "eval vs ZeRO-3"],
                "lrrr",
                [
                    [
                        r["name"],
                        f"{r['train'][-1][1]:.4f}",
                        f"{r['eval'][-1][1]:.4f}",
                        f"{r['eval'][-1][1] - ref['eval'][-1][1]:+.4f}",
                    ]
                    for r in runs
                ],
            )
        )
    )


def seeds_report() -> None:
    """Eval loss minus ZeRO-3's per seed, from results_seed<N>.json (`--seed N`; hpZ left out)."""
    rows, names = [], []
    for name in sorted(f for f in os.listdir(HERE) if f.startswith("results_seed")):
        runs = load_results(HERE, name)["parity"]
        names = [r["name"] for r in runs[1:]]
        ref = runs[0]["eval"][-1][1]
        seed = name[len("results_seed") : -len(".json")]
        rows.append([seed, f"{ref:.4f}"] + [f"{r['eval'][-1][1] - ref:+.4f}" for r in runs[1:]])
    if rows:
        header = ["seed", "ZeRO-3 eval"] + [f"{n} vs ZeRO-3" for n in names]
        print("\n" + "\n".join(markdown_table(header, "l" + "r" * (len(header) - 1), rows)))


def main() -> None:
    def add(p):
        p.add_argument("--seed", type=int, default=0, help="loss parity only, with this seed (results_seed<N>.json)")
        p.add_argument("--bytes", action="store_true", help="recompute the bytes table only, keep the parity runs")

    args = parse_args(__doc__, worker, quick="60 training steps instead of 300", add=add)
    if args.bytes:
        save_results(HERE, load_results(HERE) | dict(bytes=llama_bytes()))
    elif not args.replot:
        steps = 60 if args.quick else 300
        jobs = [dict(name=name, options=o, steps=steps, seed=args.seed) for name, o in VARIANTS]
        if args.seed:
            jobs = [j for j in jobs if j["name"] != "hpZ"]  # bitwise ZeRO-3's (tests)
            parity = run_worker(__file__, DEVICES, jobs, timeout=3600, what="layouts")
            save_results(HERE, dict(parity=parity, steps=steps, seed=args.seed), f"results_seed{args.seed}.json")
        else:
            parity = run_worker(__file__, DEVICES, jobs, timeout=3600, what="layouts")
            save_results(HERE, dict(bytes=llama_bytes(), parity=parity, steps=steps))
    report(load_results(HERE))
    seeds_report()


if __name__ == "__main__":
    main()
