"""Minimal reproduction: ring attention (jaxsys.parallel.context) inside a differentiated `lax.scan`
over layers keeps score-sized buffers for every block of every ring step, so its temporaries grow
like T^2/P instead of (T/P)^2; the same two layers written out as a Python loop do not.

    .venv/bin/python experiments/sp_vs_tp_memory/scan_residuals_repro.py            # the standalone case
    .venv/bin/python experiments/sp_vs_tp_memory/scan_residuals_repro.py --model    # + the train step

`--model` also compiles run.py's ring layout (tiny model, seq=8, B=8, remat full) at T = 2048 and 4096,
each twice: as
jaxsys builds it (layer lax.scan) and with the layer scan replaced by a Python loop inside this
process only (a diagnostic; no jaxsys file is changed), and prints XLA's peak of each.

Two layers x <- x + ring_attention(x * w, x, x), P = 4 fake CPU devices on `seq`, zigzag, reference
block attention, B = 1, N = 4, H = 16, fp32; gradient w.r.t. x and w; XLA's temp bytes of the compiled
step. `case ops` counts the lowered `stablehlo.case` ops (the ring's lax.switch blocks) by number of
results: 2 = (o, lse) forward block, 3 = (dq, dk, dv) backward block, 9 = a forward block that
also returns 7 residuals (its mask, scores, probabilities and row statistics), which only the
scan version has. The transformer's layer stack is a lax.scan (models/transformer.py), so the
train step has them too: 32 nine-result cases at P = 8.
"""

import collections
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as Ps

from jaxsys.models import attention  # noqa: E402
from jaxsys.parallel import context  # noqa: E402

P, B, N, H = 4, 1, 4, 16
mesh = jax.make_mesh((P,), ("seq",), devices=jax.devices()[:P])
seq = context.SeqLayout(("seq",), P, True, "ring")
blocks = attention.BlockAttention("reference")


def layer(x, w):
    return x + context.attention(x * w, x, x, seq, blocks)


def loss(x, ws, use_scan):
    if use_scan:
        x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)
    else:
        for i in range(ws.shape[0]):
            x = layer(x, ws[i])
    return jnp.sum(x**2)


def case_ops(text):
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.search(r'%\S+?(?::(\d+))? = "stablehlo.case"', line)
        if m:
            counts[int(m.group(1) or 1)] += 1
    return dict(sorted(counts.items()))


for T in (2048, 4096):
    block = B * N * (T // (2 * P)) ** 2 * 4
    for use_scan in (False, True):
        grad = jax.shard_map(
            jax.grad(lambda x, w: loss(x, w, use_scan), argnums=(0, 1)),
            mesh=mesh,
            in_specs=(Ps(None, "seq"), Ps()),
            out_specs=(Ps(None, "seq"), Ps()),
            check_vma=False,
        )
        x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32, sharding=NamedSharding(mesh, Ps(None, "seq")))
        w = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, Ps()))
        lowered = jax.jit(grad).lower(x, w)
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        print(
            f"T={T:5d} {'lax.scan   ' if use_scan else 'python loop'} temp {temp / 2**20:6.1f} MiB "
            f"= {temp / block:5.1f} score blocks of [B,N,T/2P,T/2P] fp32; case ops by #results "
            f"{case_ops(lowered.as_text())}",
            flush=True,
        )


def python_loop_scan(f, init, xs, length=None, unroll=1, **_):
    """lax.scan over the layer groups written out as a Python loop (the model's scan has no ys)."""
    carry = init
    for i in range(jax.tree.leaves(xs)[0].shape[0]):
        carry, y = f(carry, jax.tree.map(lambda a: a[i], xs))
        assert y is None
    return carry, None


def model_peaks(T=2048, n=8):
    import time

    from jaxsys import train
    from jaxsys.analysis import report
    from jaxsys.config import load_config
    from jaxsys.mesh import make_mesh
    from jaxsys.models import transformer

    class _Lax:
        scan = staticmethod(python_loop_scan)

        def __getattr__(self, name):
            return getattr(jax.lax, name)

    class _Jax:
        lax = _Lax()

        def __getattr__(self, name):
            return getattr(jax, name)

    config = load_config(
        "configs/tiny.py",
        [
            "--config.model.n_kv_heads=8",
            "--config.model.remat=full",
            "--config.train.batch_size=8",
            f"--config.mesh.seq={n}",
            "--config.model.context_parallel=ring",
            f"--config.data.seq_len={T}",
        ],
    )
    for label, patched in (("layer lax.scan (jaxsys)", False), ("layers as a Python loop", True)):
        saved = transformer.jax
        if patched:
            transformer.jax = _Jax()
        try:
            t0 = time.time()
            program = train.build(config, make_mesh(config, jax.devices()[:n]))
            compiled = program.train_step_fn().lower(program.abstract_state(), report._batch(program)).compile()
            mem = report.memory_report(program, compiled)
        finally:
            transformer.jax = saved
        print(
            f"train step, seq={n}, T={T}, {label:24s}: XLA peak {mem['peak_bytes_per_device'] / 2**20:6.1f} MiB, "
            f"temp {mem['temp_bytes'] / 2**20:6.1f} MiB ({time.time() - t0:.0f} s)",
            flush=True,
        )


if "--model" in sys.argv:
    for T in (2048, 4096):
        model_peaks(T)
