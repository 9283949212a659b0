"""RL weight sync (trainer -> generator after each update) and the RL iteration-time model.

    python experiments/rl_weight_sync/run.py                 # parts A and B (a minute), then C (10-20 min)
    python experiments/rl_weight_sync/run.py --part A,B      # skip the iteration model

A  bytes by formula (analysis/rl.py) for configs/llama_1b.py and configs/llama_8b.py in bf16:
   the resharding transfer from the trainer's layout to a disjoint generator (each generator device
   receives its pieces once) vs a full all-gather onto every generator device vs a checkpoint round
   trip (every byte written once, then each generator device reads its pieces); time of the first
   two over one H100 node-to-node link (analysis/hardware.py h100 inter-node bandwidth).
B  measured on 8 simulated CPU devices, configs/llama_1b.py:cpu: trainer fsdp=4 on devices 0-3,
   generator data=2 x tensor=2 (and fsdp=2 x tensor=2) on 4-7: the transfer's counted bytes vs the formula and its
   time (median of 5), a full all-gather then slice, and a checkpoint round trip through
   jaxsys.checkpoint (Orbax save of the trainer's state, restore of the parameters into the
   generator's shardings).
C  the iteration-time model (analysis/rl.iteration_times) for configs/llama_8b.py on 64 H100s:
   512 samples (64 prompts x 8) of 256 + 1024 tokens per update, colocated vs disaggregated vs
   async, layouts and split chosen by the planner's cost model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import markdown_table, save_results  # noqa: E402
from jaxsys.analysis import hardware  # noqa: E402
from jaxsys.analysis import rl as rl_analysis  # noqa: E402
from jaxsys.config import MESH_AXES, load_config  # noqa: E402


def with_mesh(config, **sizes):
    c = config.copy_and_resolve_references()
    for a in MESH_AXES:
        c.mesh[a] = sizes.get(a, 1)
    c.parallel.sequence_parallel = False
    c.parallel.collective_matmul = False
    return c


def part_a() -> list[dict]:
    hw = hardware.profile("h100")
    rows = []
    cases = [
        ("configs/llama_1b.py", 8, dict(fsdp=8), dict(tensor=8)),
        ("configs/llama_1b.py", 8, dict(fsdp=8), dict(data=4, tensor=2)),
        ("configs/llama_8b.py", 32, dict(fsdp=32), dict(data=4, tensor=8)),
        ("configs/llama_8b.py", 32, dict(data=8, fsdp=4), dict(data=16, tensor=2)),
    ]
    for path, n_gen, trainer, gen in cases:
        base = load_config(path)
        g = with_mesh(base, **gen)
        dtype = "bfloat16"
        sync = rl_analysis.sync_bytes(g, dtype)
        gather = rl_analysis.all_gather_bytes(g, dtype)
        params = gather // n_gen
        ckpt = params + sync  # written once by the trainer, each generator device reads its pieces
        link = hw.inter_node_bytes_per_s
        rows.append(
            dict(
                config=path,
                trainer=" x ".join(f"{a}={s}" for a, s in trainer.items()),
                generator=" x ".join(f"{a}={s}" for a, s in gen.items()),
                params_gib=params / 2**30,
                sync_gib=sync / 2**30,
                all_gather_gib=gather / 2**30,
                checkpoint_gib=ckpt / 2**30,
                sync_ms=sync / n_gen / link * 1e3,
                all_gather_ms=gather / n_gen / link * 1e3,
            )
        )
    return rows


def median_time(fn, n=5):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_b() -> list[dict]:
    from jaxsys import checkpoint
    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh
    from jaxsys.serve.engine import reshard

    base = load_config("configs/llama_1b.py:cpu")
    trainer_config = with_mesh(base, fsdp=4)
    trainer = program_lib.build(trainer_config, make_mesh(trainer_config, jax.devices()[:4]))
    state = trainer.init(0)
    rows = []
    for gen in (dict(data=2, tensor=2), dict(fsdp=2, tensor=2)):
        g = with_mesh(base, **gen)
        gen_program = program_lib.build(g, make_mesh(g, jax.devices()[4:8]))
        shardings = gen_program.param_shardings
        placed, moved = reshard(state.params, shardings)
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(state.params)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        sync_s = median_time(lambda: reshard(state.params, shardings)[0])
        replicated = jax.tree.map(lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec()), shardings)
        gather_bytes = rl_analysis.all_gather_bytes(g)

        def gather_then_slice():
            full = jax.device_put(state.params, replicated)
            return jax.device_put(full, shardings)

        gather_s = median_time(gather_then_slice)
        workdir = tempfile.mkdtemp(prefix="rl_sync_")
        try:
            cfg = trainer_config.copy_and_resolve_references()
            cfg.checkpoint.async_save = False
            abstract = gen_program.abstract_state().params

            def round_trip():
                shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
                saver = checkpoint.Checkpointer(workdir, cfg.checkpoint)
                saver.save(1, state, cfg)
                saver.manager.wait_until_finished()
                saver.manager.close()
                return checkpoint.restore_params(workdir, abstract)[0]

            ckpt_s = median_time(round_trip, n=3)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        rows.append(
            dict(
                generator=" x ".join(f"{a}={s}" for a, s in gen.items()),
                bytes=moved,
                formula=rl_analysis.sync_bytes(g),
                all_gather_bytes=gather_bytes,
                sync_ms=sync_s * 1e3,
                all_gather_ms=gather_s * 1e3,
                checkpoint_ms=ckpt_s * 1e3,
            )
        )
    return rows


def part_c() -> dict:
    base = load_config("configs/llama_8b.py")
    start = time.perf_counter()
    out = rl_analysis.iteration_times(
        base, 64, hardware.profile("h100"), prompts=64, group=8, prompt=256, completion=1024, splits=[16, 32, 48]
    )
    out["model_s"] = time.perf_counter() - start
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="A,B,C")
    parts = parser.parse_args().part.split(",")
    results: dict = {}
    path = os.path.join(HERE, "results.json")
    if os.path.exists(path):
        import json

        results = json.load(open(path))
    if "A" in parts:
        results["A"] = part_a()
        print(
            "\n".join(
                markdown_table(
                    [
                        "config",
                        "trainer",
                        "generator",
                        "params",
                        "sync",
                        "all-gather",
                        "checkpoint r/w",
                        "sync",
                        "all-gather",
                    ],
                    "lllrrrrrr",
                    [
                        [r["config"], r["trainer"], r["generator"]]
                        + [f"{r[k]:.2f} GiB" for k in ("params_gib", "sync_gib", "all_gather_gib", "checkpoint_gib")]
                        + [f"{r['sync_ms']:.1f} ms", f"{r['all_gather_ms']:.1f} ms"]
                        for r in results["A"]
                    ],
                )
            ),
            flush=True,
        )
    if "B" in parts:
        results["B"] = part_b()
        print(
            "\n".join(
                markdown_table(
                    [
                        "generator",
                        "bytes moved",
                        "formula",
                        "all-gather bytes",
                        "sync",
                        "all-gather + slice",
                        "checkpoint round trip",
                    ],
                    "lrrrrrr",
                    [
                        [r["generator"], r["bytes"], r["formula"], r["all_gather_bytes"]]
                        + [f"{r[k]:.1f} ms" for k in ("sync_ms", "all_gather_ms", "checkpoint_ms")]
                        for r in results["B"]
                    ],
                )
            ),
            flush=True,
        )
    if "C" in parts:
        results["C"] = part_c()
        c = results["C"]
        rows = []
        for name in ("colocated", "disaggregated", "async"):
            if name in c:
                r = c[name]
                rows.append(
                    [name, r["split"], r["trainer"], r["generator"]]
                    + [f"{r[k]:.2f} s" for k in ("gen_s", "train_s", "sync_s", "seconds")]
                )
        print(
            "\n".join(
                markdown_table(
                    ["placement", "devices", "trainer", "generator", "gen", "train", "sync", "iteration"],
                    "llllrrrr",
                    rows,
                )
            )
        )
    save_results(HERE, results)


if __name__ == "__main__":
    main()
