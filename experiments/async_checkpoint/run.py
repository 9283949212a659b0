"""DataStates-LLM / Orbax claim: an asynchronous checkpoint blocks training only for the copy off the
training buffers, a synchronous one for the whole write.

    .venv/bin/python experiments/async_checkpoint/run.py [--quick] [--sizes 10M,50M]

For each model size, in its own process on one CPU device (a 2-core machine, local disk):
  1. the train step alone, S steps: the baseline step time;
  2. S steps with a save after each through jaxsys.checkpoint.Checkpointer, synchronous
     (`checkpoint.async_save=False`) and asynchronous, twice:
     - settled: each write finishes (untimed) before the next step, so the time the loop is blocked
       inside `save()` is the save's own cost (the state is ready before it is called);
     - back to back, a save after every step: the end-to-end time of the S steps including the
       wait for the last write (an asynchronous save waits for the previous one to commit).
The modes alternate (sync, async, sync, async) so that load from other jobs hits both alike.
Writes results.json and async_checkpoint.png next to this file and prints the README table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from experiments.common import emit, run_worker  # noqa: E402

# name: (d_model, n_layers, d_ff); heads of 64, vocab 256 (bytes). Parameters ~ 12 L D^2.
SIZES = {
    "10M": (512, 3, 1536),
    "50M": (768, 7, 2304),
    "200M": (1024, 16, 3072),
    # 4.3 GB of state (fp32 params + Adam): with the step's gradients and a host copy of the state
    # in flight, the largest that ran on this 24 GB machine (500M, 6.1 GB of state, was OOM-killed)
    "350M": (1280, 18, 3840),
}
QUICK = ["10M", "50M"]


def worker(jobs: list[dict]) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jaxsys import train
    from jaxsys.checkpoint import Checkpointer
    from jaxsys.config import base_config
    from jaxsys.mesh import make_mesh
    from jaxsys.models import params as params_lib

    for job in jobs:
        d, layers, ff = SIZES[job["size"]]
        c = base_config()
        c.model.d_model, c.model.n_layers, c.model.d_ff = d, layers, ff
        c.model.n_heads = c.model.n_kv_heads = d // 64
        c.model.head_dim, c.model.remat = 64, "full"
        c.data.seq_len, c.train.batch_size = 64, 1  # small compute: the save is what is measured
        c.train.steps = 10**6
        program = train.build(c, make_mesh(c, jax.devices()[:1]))
        state = program.init()
        tokens = jax.device_put(jax.numpy.zeros((1, 65), jax.numpy.int32), program.batch_sharding)
        step_fn = program.train_step_fn()
        for _ in range(2):  # compile and warm up
            state, _ = step_fn(state, tokens)
        jax.block_until_ready(state)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

        def steps_alone(n):
            nonlocal state
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                state, _ = step_fn(state, tokens)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t0)
            return times

        def with_saves(n, async_save, settle):
            """n steps with a save after each. settle: wait (untimed) for each write to finish before
            the next step, so a save never waits for the one before (the per-save cost); otherwise
            the end-to-end time of saving every step."""
            nonlocal state
            workdir = tempfile.mkdtemp(prefix="jaxsys_async_ckpt_", dir=job["tmp"])
            c.checkpoint.async_save, c.checkpoint.keep, c.checkpoint.every_steps = async_save, 1, 1
            ckpt = Checkpointer(workdir, c.checkpoint)
            blocked, untimed, start = [], 0.0, time.perf_counter()
            for i in range(n):
                state, _ = step_fn(state, tokens)
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                ckpt.save(int(state.step), state, c)
                blocked.append(time.perf_counter() - t0)
                if settle:
                    t1 = time.perf_counter()
                    ckpt.manager.wait_until_finished()
                    untimed += time.perf_counter() - t1
            ckpt.close()  # waits for the last write
            total = time.perf_counter() - start - untimed
            shutil.rmtree(workdir)
            return blocked, total

        baseline = steps_alone(job["steps"])
        out = {
            "size": job["size"],
            "params": params_lib.count(program.specs),
            "state_bytes": state_bytes,
            "steps": job["steps"],
            "step_s": baseline,
            "sync": [],
            "async": [],
        }
        for rep in range(job["repeats"]):
            for mode in ("sync", "async"):
                blocked, _ = with_saves(job["steps"], mode == "async", settle=True)
                every_step_blocked, total = with_saves(job["steps"], mode == "async", settle=False)
                out[mode].append({"blocked_s": blocked, "every_step_blocked_s": every_step_blocked, "total_s": total})
        out["step_s"] += steps_alone(job["steps"])  # baseline before and after, against drift
        emit(out)


def summarise(r: dict) -> dict:
    step = statistics.median(r["step_s"])
    row = {"size": r["size"], "params": r["params"], "state_gb": r["state_bytes"] / 1e9, "step_s": step}
    for mode in ("sync", "async"):
        # the first save of a run also creates directories and metadata: report the steady state
        blocked = [b for rep in r[mode] for b in rep["blocked_s"][1:]]
        total = statistics.median(rep["total_s"] for rep in r[mode])
        row[f"{mode}_blocked_s"] = statistics.median(blocked)
        row[f"{mode}_every_step_blocked_s"] = statistics.median(
            b for rep in r[mode] for b in rep["every_step_blocked_s"][1:]
        )
        row[f"{mode}_slowdown"] = total / (r["steps"] * step)
    row["blocked_ratio"] = row["sync_blocked_s"] / row["async_blocked_s"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | state | step alone | blocked per save, sync | blocked per save, async | "
        "sync / async blocked | run time with a save every step, sync | same, async | "
        "async blocked per save when saving every step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['state_gb']:.2f} GB | {r['step_s']:.3f} s "
            f"| {r['sync_blocked_s']:.3f} s | {r['async_blocked_s']:.3f} s | {r['blocked_ratio']:.1f}x "
            f"| {r['sync_slowdown']:.2f}x | {r['async_slowdown']:.2f}x | {r['async_every_step_blocked_s']:.3f} s |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [r["params"] / 1e6 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(params, [r["sync_blocked_s"] for r in rows], "o-", label="synchronous")
    a.loglog(params, [r["async_blocked_s"] for r in rows], "s-", label="asynchronous")
    a.loglog(params, [r["step_s"] for r in rows], "k--", label="train step (B=1, T=64)")
    a.set(xlabel="parameters (M)", ylabel="seconds", title="training blocked per save")
    a.legend()
    b.semilogx(params, [r["sync_slowdown"] for r in rows], "o-", label="synchronous")
    b.semilogx(params, [r["async_slowdown"] for r in rows], "s-", label="asynchronous")
    b.axhline(1.0, color="k", lw=0.5)
    b.set(xlabel="parameters (M)", ylabel="run time / run time without saves", title="a save after every step")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    parser.add_argument("--sizes", help=f"comma-separated subset of {list(SIZES)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tmp", default=None, help="directory for the checkpoints (default: system temp)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.load(sys.stdin))
        return
    sizes = args.sizes.split(",") if args.sizes else (QUICK if args.quick else list(SIZES))
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}: choose from {list(SIZES)}")
    results = []
    for size in sizes:  # one process per size: each frees its memory on exit
        job = {"size": size, "steps": args.steps, "repeats": args.repeats, "tmp": args.tmp or tempfile.gettempdir()}
        t0 = time.time()
        [r] = run_worker(__file__, 1, [job], timeout=3600, what="size")
        results.append(r)
        print(f"{size}: done in {time.time() - t0:.0f}s", flush=True)
        rows = [summarise(r) for r in results]
        with open(os.path.join(HERE, "results.json"), "w") as f:  # after each size: a crash keeps the rest
            json.dump({"rows": rows, "raw": results, "command": " ".join(sys.argv)}, f, indent=1)
    plot(rows, os.path.join(HERE, "async_checkpoint.png"))
    print(table(rows))


if __name__ == "__main__":
    main()
