"""Sliding-window attention's cost: the flash kernel's work scales with T W, not T^2 / 2.

Claim (Beltagy et al. 2020, Longformer; Jiang et al. 2023, Mistral 7B): attention restricted to
each query's last W keys costs O(T W) instead of O(T^2). jaxsys's flash kernels
(kernels/flash_attention/kernel.py) get it by never visiting the kv blocks that lie wholly
behind every row's window of a q block. Here: the kv blocks the kernel's own loop ranges visit
(forward / dq and dk/dv), and the wall time of forward + backward of the generic kernel in Pallas
interpret mode on XLA:CPU (every visited block is real work there, every skipped one none), each
with a window against plain causal attention at the same T, side by side in one run. The
time ratio should follow the visited-block ratio (and tend to T / 2W).

    .venv/bin/python experiments/sliding_window/run.py            # ~2 min on 2 idle cores
    .venv/bin/python experiments/sliding_window/run.py --quick    # T = 1K, 4K only

Not measured here: a GPU's time (benchmarks in docs/benchmarks/gpu_pending.md: `bench --window`).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import markdown_table, save_results  # noqa: E402
from jaxsys.kernels.flash_attention import flash_attention, reference_attention  # noqa: E402
from jaxsys.kernels.flash_attention import kernel as FK  # noqa: E402

BLOCK, H, N, K = 128, 64, 2, 1


def visited_blocks(t: int, window: int | None) -> int:
    """(q block, kv block) pairs the forward visits: the kernel's own _causal_kv_range per q
    block (the dq kernel visits the same; the dk/dv kernel the same pairs from the other side)."""
    nq = nk = t // BLOCK
    n_start, _, _, n_end = FK._causal_kv_range(jnp.arange(nq), BLOCK, BLOCK, nk, window)
    return int(np.sum(np.asarray(n_end) - np.asarray(n_start)))


def timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seq_lens = [1024, 4096] if args.quick else [1024, 4096, 16384]
    windows = [None, 128, 1024]
    rows, results = [], []
    for t in seq_lens:
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (1, t, N, H), jnp.float32)
        k = jax.random.normal(keys[1], (1, t, K, H), jnp.float32)
        v = jax.random.normal(keys[2], (1, t, K, H), jnp.float32)
        do = jax.random.normal(keys[3], (1, t, N, H), jnp.float32)
        fns = {}
        for w in windows:
            attn = functools.partial(flash_attention, causal=True, block_q=BLOCK, block_k=BLOCK, window=w)
            fns[w] = jax.jit(lambda q, k, v, do, attn=attn: jax.vjp(attn, q, k, v)[1](do))
            # correctness beside the cost: the kernel against the reference at this shape
            want = reference_attention(q, k, v, causal=True, window=w)
            err = float(jnp.max(jnp.abs(attn(q, k, v) - want)))
            assert err < 1e-4, (t, w, err)
        seconds = {w: [] for w in windows}
        for _ in range(args.repeats):  # interleaved, so that load on the machine hits all alike
            for w in windows:
                seconds[w].append(timed(fns[w], (q, k, v, do), 1))
        base_time, base_blocks = statistics.median(seconds[None]), visited_blocks(t, None)
        for w in windows:
            blocks, sec = visited_blocks(t, w), statistics.median(seconds[w])
            result = dict(T=t, window=w, blocks=blocks, seconds=sec)
            results.append(result)
            rows.append(
                [
                    t,
                    "causal" if w is None else w,
                    blocks,
                    f"{base_blocks / blocks:.2f}",
                    f"{sec * 1e3:.0f}",
                    f"{base_time / sec:.2f}",
                    "-" if w is None else f"{t / (2 * w):.1f}",
                ]
            )
            print(result, flush=True)
    # time = a (visited blocks) + c T^2, least squares on relative error: the blocks' work, and
    # interpret mode's per-program overhead (each of the T / 128 grid programs of a kernel is an
    # iteration of XLA:CPU code that touches whole [T, ...] operands), which has nothing to do with
    # the window. A skipped block that still cost something would not fit one slope a
    design = np.asarray([[r["blocks"], float(r["T"]) ** 2] for r in results], np.float64)
    seconds = np.asarray([r["seconds"] for r in results])
    (a, c), *_ = np.linalg.lstsq(design / seconds[:, None], np.ones_like(seconds), rcond=None)
    worst = float(np.max(np.abs(design @ np.asarray([a, c]) - seconds) / seconds))
    print(f"fit: {a * 1e3:.3f} ms per visited block + {c * 1e9:.2f} ns x T^2; worst relative residual {worst:.1%}")
    header = [
        "T",
        "window",
        "kv blocks visited",
        "causal / window (blocks)",
        "fwd+bwd ms",
        "causal / window (time)",
        "T / 2W",
    ]
    print("\n".join(markdown_table(header, "rrrrrrr", rows)))
    save_results(
        os.path.dirname(os.path.abspath(__file__)),
        {
            "device": jax.devices()[0].device_kind,
            "block": BLOCK,
            "H": H,
            "N": N,
            "K": K,
            "fit_seconds_per_block": a,
            "fit_seconds_per_t_squared": c,
            "fit_worst_relative_residual": worst,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
