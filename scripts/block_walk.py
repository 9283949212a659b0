"""Which files an activation's walk through one block enters: trace one layer of the training
forward (configs/tiny.py:test, one layer, data 2 x tensor 2 with sequence parallelism, so every
tensor-parallel collective is on the path) and count, per jaxsys source file, how many times the
walk enters it from another file (a call whose nearest jaxsys caller is in another file).

    python scripts/block_walk.py      # prints "<entries> <file>" per file and the totals

Run under 4 simulated devices (set here). The count is of Python calls while JAX traces the
block, so it measures how the code is organised, not what runs on the device.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    import collections
    import importlib.util

    import jax
    import jax.numpy as jnp

    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh
    from jaxsys.models import transformer

    spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("test")
    config.model.n_layers, config.model.n_kv_heads = 1, 4
    config.mesh.data, config.mesh.tensor = 2, 2
    config.parallel.sequence_parallel = True
    program = program_lib.build(config, make_mesh(config, jax.devices()[:4]))
    m, layout, specs = config.model, program.layout, program.specs
    abstract = program.abstract_state().params["layers"]
    B, T, D = config.train.batch_size, config.data.seq_len, m.d_model
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    source = os.path.join(ROOT, "jaxsys") + os.sep
    entries: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        """A call enters a jaxsys file when the nearest jaxsys frame below it is in another file
        (JAX's own frames between them, e.g. a jax.checkpoint or a tree map, do not count)."""
        if event != "call" or not frame.f_code.co_filename.startswith(source):
            return
        below = frame.f_back
        while below is not None and not below.f_code.co_filename.startswith(source):
            below = below.f_back
        if below is not None and below.f_code.co_filename != frame.f_code.co_filename:
            entries[os.path.relpath(frame.f_code.co_filename, ROOT)] += 1

    def block(w, x):
        return transformer.layer_stack(w, x, jnp.arange(T), m, layout, specs)[0]

    # x[B, T/tp, D] under sequence parallelism: the batch over its axes, T over `tensor`
    sp = jax.sharding.PartitionSpec(layout.compute_spec(("batch",))[0], "tensor", None)
    # a plain shard_map (not the library's): this script also runs on commits before parallel/spmd.py
    fn = jax.shard_map(
        block, mesh=program.mesh, in_specs=(program.param_pspecs["layers"], sp), out_specs=sp, check_vma=False
    )
    sys.setprofile(profile)
    try:
        jax.jit(fn).trace(abstract, x)
    finally:
        sys.setprofile(None)
    for path, n in sorted(entries.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:4d} {path}")
    print(f"{sum(entries.values()):4d} entries into {len(entries)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
