"""Does a serving step's cost grow with the KV pool? The engine's compiled step (serve/runner.py's
ModelRunner) against the pool's size: XLA's temporaries and the ops over whole pools, compiled for
a GPU without one (XLA:GPU deviceless, as `jaxsys.analyze --target h100-8`), and on this CPU the
measured time of a decode step.

    python benchmarks/serving_step_pool.py --config configs/llama_1b.py --pages 1024,4096 --rows 64   # GPU AOT
    python benchmarks/serving_step_pool.py --config configs/tiny.py --pages 64,256,1024,4096 --cpu-time

A decode step writes one key and value per row and reads the pages its rows attend to, so neither
its bytes nor its temporaries should depend on the pages nobody reads. The stack of layers
(jaxsys/execution/stack.py) scans the cache's per-layer pools beside the weights and stacks the
updated pools as the scan's output, which XLA compiles to copies of whole pools (a fresh output
stack, each layer's pool sliced out and written back, a final relayout copy). The AOT part needs
the CUDA plugin (`pip install -e '.[gpu-aot]'`), not a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def gpu_aot(config_path: str, pages: int, rows: int, target_name: str, overrides: list) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxsys import program as program_lib
    from jaxsys.analysis import targets
    from jaxsys.cache import PagedCache
    from jaxsys.cache.base import POOL, ROW, ROWS
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh
    from jaxsys.serve.runner import ModelRunner

    target = targets.parse(target_name)
    devices = targets.devices(target)
    config = load_config(config_path, ["--config.mesh.fsdp=1", *overrides])
    program = program_lib.build(config, make_mesh(config, devices[:1]))
    m = config.model
    sharding = lambda spec: NamedSharding(program.mesh, program.layout.compute_spec(spec))
    dtype = jnp.dtype(m.compute_dtype)
    pool = jax.ShapeDtypeStruct((m.n_layers, pages + 1, 16, m.n_kv_heads, m.head_dim), dtype, sharding=sharding(POOL))
    table = jax.ShapeDtypeStruct((rows, 64), jnp.int32, sharding=sharding(ROWS))
    vector = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding(ROW))
    cache = PagedCache(pool, pool, table)  # a decode step: one query per row, the one-query kernel
    fn = ModelRunner(program)._compile(cache)
    with targets.quiet_libtpu():
        compiled = fn.lower(program.abstract_state().params, vector, vector, cache).compile()
    text = compiled.as_text()
    layer = f"{pages + 1},16,{m.n_kv_heads},{m.head_dim}]"
    ops = [
        re.sub(r",? ?metadata=.*", "", line.strip())[:160]
        for line in text.splitlines()
        if layer in line and re.search(r"= \S+ (copy|fusion|dynamic-update-slice|broadcast)\(", line.strip())
    ]
    stats = compiled.memory_analysis()
    pool_bytes = 2 * pool.size * dtype.itemsize
    return {"pages": pages, "pool_bytes": pool_bytes, "temp_bytes": stats.temp_size_in_bytes, "ops": ops}


def cpu_time(config_path: str, pages_list: list, rows: int, overrides: list) -> dict:
    import jax
    import numpy as np

    from jaxsys import program as program_lib
    from jaxsys.config import load_config
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh
    from jaxsys.serve import engine

    cpu_unless_accelerator()
    config = load_config(config_path, ["--config.mesh.fsdp=1", *overrides])
    program = program_lib.build(config, make_mesh(config, jax.devices()[:1]))
    params = program.init().params
    rng = np.random.default_rng(0)
    engines = {}
    for pages in pages_list:
        eng = engine.Engine(
            program, params, num_pages=pages, page_size=16, token_budget=rows, chunk_size=rows, max_seqs=rows
        )
        eng.warmup()
        for i in range(rows // 2):
            eng.submit(i, rng.integers(0, config.model.vocab_size, 32).tolist(), 200)
        for _ in range(4):
            eng.step()
        engines[pages] = eng
    out: dict = {p: [] for p in pages_list}
    for _ in range(3):  # interleaved: the machine's load changes
        for pages, eng in engines.items():
            start = time.perf_counter()
            for _ in range(10):
                eng.step()
            jax.block_until_ready(eng.cache)
            out[pages].append((time.perf_counter() - start) / 10)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/llama_1b.py")
    parser.add_argument("--pages", default="1024,4096", help="pool sizes (pages of 16 tokens)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the step (decoding sequences)")
    parser.add_argument("--target", default="h100-1", help="the GPU to compile for (jaxsys.analyze's names)")
    parser.add_argument("--cpu-time", action="store_true", help="instead: time decode steps on this CPU")
    args, overrides = parser.parse_known_args(argv)
    pages_list = [int(p) for p in args.pages.split(",")]
    if args.cpu_time:
        for pages, times in cpu_time(args.config, pages_list, args.rows, overrides).items():
            print(
                f"{pages:6d} pages: decode step ({args.rows // 2} sequences) "
                + ", ".join(f"{t * 1e3:.1f}" for t in times)
                + " ms"
            )
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for pages in pages_list:
        r = gpu_aot(args.config, pages, args.rows, args.target, overrides)
        print(
            f"{pages} pages: pools (k + v) {r['pool_bytes'] / 2**20:,.0f} MiB, XLA temporaries "
            f"{r['temp_bytes'] / 2**20:,.0f} MiB; ops over whole pools:"
        )
        for op in r["ops"]:
            print("   ", op)
    return 0


if __name__ == "__main__":
    sys.exit(main())
