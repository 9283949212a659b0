"""Collective matmul (config.parallel.collective_matmul, jaxsys/parallel/collective_matmul.py):

- the two primitives against jnp all_gather + dot and dot + psum_scatter, values and VJPs;
- the training step with collective_matmul=True against the same layout with False (sequence
  parallelism, tensor 2 and tensor 4 x data 2): losses and gradients equal to fp32 reassociation;
- the TPU compiler (ahead of time, v5p) schedules the decomposed collective-permutes asynchronously
  with dots between their start and done (docs/comm_overlap.md).

Tolerances. The decomposition changes no operation's inputs, only the order of some sums: each
output chunk of an all-gather-matmul is the same dot on the same rows; a reduce-scatter's t
partial sums are added in ring order instead of the collective's order; weight gradients are
summed over t chunks of T and then over the batch and T of other shards instead of in one
contraction. Each such fp32 sum of n terms moves by at most ~n * eps * sum|terms| (eps = 6e-8),
so for these sizes (n <= 4 reorderings, |terms| ~ the largest entry of a leaf) a relative 1e-5 of
the leaf's largest entry bounds it with a wide margin, the bound tests/test_parity.py uses against
one device; the loss (a mean of ~256 per-token terms) agrees to 1e-6 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxsys.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from tests.helpers import assert_trees_close_leafwise


def _mesh(t):
    return jax.sharding.Mesh(np.array(jax.devices()[:t]), ("tensor",))


def _two_proj(x, ws):  # two column-parallel projections of the same input, as q/k/v or gate/up
    return jnp.einsum("btd,df->btf", x, ws[0]), jnp.einsum("btd,dnh->btnh", x, ws[1])


def _down(o, w):
    return jnp.einsum("btf,fd->btd", o, w)


@pytest.mark.parametrize("t", [2, 4])
def test_all_gather_matmul_matches_all_gather_then_dot(t):
    B, T, D, F, N, H = 2, 16, 8, 12, 2, 3
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (B, T, D))
    w1 = jax.random.normal(k[1], (t, D, F))  # rank r's column shard: w1[r]
    w2 = jax.random.normal(k[2], (t, D, N, H))
    dy1 = jax.random.normal(k[3], (t, B, T, F))  # rank r's cotangent of its outputs
    dy2 = jax.random.normal(k[4], (t, B, T, N, H))
    mesh = _mesh(t)

    def run(decomposed):
        def local(x, w1, w2, dy1, dy2):
            ws = (w1[0], w2[0])
            if decomposed:
                f = lambda x, ws: all_gather_matmul(_two_proj, x, ws, ("tensor",), 1)
            else:
                f = lambda x, ws: _two_proj(lax.all_gather(x, "tensor", axis=1, tiled=True), ws)
            y, vjp = jax.vjp(f, x, ws)
            dx, (dw1, dw2) = vjp((dy1[0], dy2[0]))
            if not decomposed:  # all_gather's transpose under check_vma=False is not the reduce-scatter
                dx = None
            return y[0][None], y[1][None], dx, dw1[None], dw2[None]

        out_dx = P() if not decomposed else P(None, "tensor")
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, "tensor"), P("tensor"), P("tensor"), P("tensor"), P("tensor")),
            out_specs=(P("tensor"), P("tensor"), out_dx, P("tensor"), P("tensor")),
            check_vma=False,
        )
        return jax.jit(fn)(x, w1, w2, dy1, dy2)

    y1, y2, dx, dw1, dw2 = run(True)
    r1, r2, _, rw1, rw2 = run(False)
    # reference computed directly: y = x @ w[r] on every rank, dx = sum_r dy[r] @ w[r]^T, dw[r] = x^T dy[r]
    want_dx = sum(
        jnp.einsum("btf,df->btd", dy1[r], w1[r]) + jnp.einsum("btnh,dnh->btd", dy2[r], w2[r]) for r in range(t)
    )
    np.testing.assert_allclose(y1, r1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y2, r2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw1, rw1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw2, rw2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [2, 4])
def test_matmul_reduce_scatter_matches_dot_then_psum_scatter(t):
    B, T, F, D = 2, 16, 12, 8
    k = jax.random.split(jax.random.key(1), 3)
    o = jax.random.normal(k[0], (t, B, T, F))  # rank r's local activations (its heads / hidden units)
    w = jax.random.normal(k[1], (t, F, D))  # rank r's row shard
    dy = jax.random.normal(k[2], (B, T, D))  # split over T: rank r holds dy[:, r*T/t:(r+1)*T/t]

    def run(decomposed):
        def local(o, w, dy):
            def f(o, w):
                if decomposed:
                    return matmul_reduce_scatter(_down, o, w, ("tensor",), 1)
                return lax.psum_scatter(_down(o, w), "tensor", scatter_dimension=1, tiled=True)

            y, vjp = jax.vjp(f, o[0], w[0])
            do, dw = vjp(dy)
            return y, do[None], dw[None]

        fn = jax.shard_map(
            local,
            mesh=_mesh(t),
            in_specs=(P("tensor"), P("tensor"), P(None, "tensor")),
            out_specs=(P(None, "tensor"), P("tensor"), P("tensor")),
            check_vma=False,
        )
        return jax.jit(fn)(o, w, dy)

    y, do, dw = run(True)
    ry, rdo, rdw = run(False)
    want_y = sum(_down(o[r], w[r]) for r in range(t))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)
    # do[r] = dy @ w[r]^T over the full T; dw[r] = o[r]^T dy
    np.testing.assert_allclose(
        do, jnp.stack([jnp.einsum("btd,fd->btf", dy, w[r]) for r in range(t)]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        dw, jnp.stack([jnp.einsum("btf,btd->fd", o[r], dy) for r in range(t)]), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(do, rdo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-4)


def test_one_rank_is_the_plain_matmul():
    x, w = jnp.ones((2, 4, 3)), jnp.ones((3, 5))
    f = lambda x, w: jnp.einsum("btd,df->btf", x, w)
    np.testing.assert_array_equal(all_gather_matmul(f, x, w, (), 1), f(x, w))
    np.testing.assert_array_equal(matmul_reduce_scatter(f, x, w, (), 1), f(x, w))
    g = jax.grad(lambda x, w: jnp.sum(all_gather_matmul(f, x, w, (), 1) ** 2), argnums=(0, 1))(x, w)
    h = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(g[0], h[0])
    np.testing.assert_allclose(g[1], h[1])


# (mesh, model overrides): configs/tiny.py's model (D=128, L=4, T=128) on 8 devices or fewer
LAYOUTS = {
    "data2_tensor2": (dict(data=2, tensor=2), {}),
    "data2_tensor4": (dict(data=2, tensor=4), dict(n_kv_heads=4)),
    "data2_tensor2_tied": (dict(data=2, tensor=2), dict(tie_embeddings=True)),
}


def _config(mesh, model, collective: bool):
    from tests.helpers import config_file

    c = config_file("tiny")
    c.train.batch_size = 8
    for key, value in model.items():
        c.model[key] = value
    for axis, size in mesh.items():
        c.mesh[axis] = size
    c.parallel.sequence_parallel = True
    c.parallel.collective_matmul = collective
    return c


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n != "data2_tensor2" else n for n in LAYOUTS]
)
def test_collective_matmul_keeps_losses_and_gradients(name):
    mesh, model = LAYOUTS[name]
    from tests.helpers import run

    loss0, grads, losses, state = run(_config(mesh, model, True), steps=2)
    ref_loss0, ref_grads, ref_losses, ref_state = run(_config(mesh, model, False), steps=2)
    np.testing.assert_allclose(loss0, ref_loss0, rtol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close_leafwise(grads, ref_grads, rtol=1e-5, atol=lambda want: 1e-5 * np.abs(want).max())


@pytest.mark.parametrize("mesh, sp", [(dict(data=2, tensor=1), True), (dict(data=2, tensor=2), False)])
def test_collective_matmul_needs_tensor_and_sequence_parallelism(mesh, sp):
    from jaxsys.config import ConfigError, validate

    c = _config(mesh, {}, True)
    c.parallel.sequence_parallel = sp
    with pytest.raises(ConfigError, match="collective_matmul=True needs tensor parallelism with sequence parallelism"):
        validate(c, 2 * mesh["tensor"])


def test_tpu_schedule_overlaps_the_decomposed_permutes_with_dots():
    """The TPU compiler (libtpu, ahead of time, v5p:2x2x2) on the train step of data 2 x tensor 4
    with SP: with collective_matmul the TP all-gathers and reduce-scatters over T are gone (but
    the embedding's, which has no matmul beside it), every collective-permute is asynchronous,
    and most of their bytes have dots scheduled between start and done (77% seen: the first
    chunk ppermutes of a forward all-gather-matmul are issued back to back; docs/comm_overlap.md)."""
    from jaxsys.analysis import hlo, targets

    if not targets.has_libtpu():
        pytest.skip("libtpu is not installed: no TPU compiler")
    from tests.test_tpu_compile import compile_on_tpu

    devices = targets.devices(targets.parse("v5p:2x2x2"))
    counts = {}
    for collective in (False, True):
        c = _config(dict(data=2, tensor=4), dict(n_kv_heads=4), collective)
        cols = hlo.parse(compile_on_tpu(c, devices).as_text()).collectives({a: c.mesh[a] for a in c.mesh})
        tp = [k for k in cols if k.axes == ("tensor",)]
        counts[collective] = {
            kind: sum(k.executions for k in tp if k.kind == kind)
            for kind in ("all_gather", "reduce_scatter", "collective_permute")
        }
        if collective:
            permutes = [k for k in tp if k.kind == "collective_permute"]
            assert permutes and all(k.is_async for k in permutes)
            moved = sum(k.operand_bytes * k.executions for k in permutes)
            hidden = sum(k.operand_bytes * k.executions for k in permutes if k.overlapped_flops > 0)
            assert hidden / moved > 0.6, f"only {hidden / moved:.0%} of the permuted bytes have a dot beside them"
    plain, decomposed = counts[False], counts[True]
    assert plain["collective_permute"] == 0 and plain["all_gather"] > 1 and plain["reduce_scatter"] > 1
    assert decomposed["all_gather"] == 1 and decomposed["reduce_scatter"] == 1  # the embedding's leave
    # each TP all-gather / reduce-scatter (and its transpose backward) became t - 1 = 3 ppermutes
    assert decomposed["collective_permute"] == 3 * (plain["all_gather"] + plain["reduce_scatter"] - 2)


def test_under_a_pipeline_refused_on_cpu_compiles_for_tpu():
    """Inside the pipeline's per-stage branches XLA:CPU's collective-permute waits for every device
    of the mesh and deadlocks: refused by name on CPU; the TPU compiler builds it, decomposed."""
    from jaxsys.analysis import targets
    from jaxsys.config import ConfigError
    from tests.helpers import pipeline_config, program_for

    c = pipeline_config(dict(pipe=2, data=2, tensor=2), "1f1b", 2, vocab_parallel=True)
    c.parallel.sequence_parallel, c.parallel.collective_matmul = True, True
    with pytest.raises(ConfigError, match="collective_matmul=True with config.mesh.pipe=2"):
        program_for(c)
    if not targets.has_libtpu():
        pytest.skip("libtpu is not installed: no TPU compiler")
    from tests.test_tpu_compile import compile_on_tpu

    text = compile_on_tpu(c, targets.devices(targets.parse("v5p:2x2x2"))).as_text()
    assert "collective-permute-start" in text
