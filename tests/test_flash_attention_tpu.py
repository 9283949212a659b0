"""The TPU (Mosaic) variant of the flash-attention kernel (kernels/flash_attention/kernel_tpu.py):
its numerics in Pallas interpret mode on CPU against the pure-JAX reference (outputs, lse and
gradients with an lse cotangent; causal and full, GQA/MQA, segment ids with empty rows, ragged
lengths, unequal and backward-specific tiles, fp32 and bf16), the per-block forward/backward API
merged over kv halves as context parallelism does, the automatic choice of the variant when a
program is lowered for TPU (compiled ahead of time for v5p and v6e topologies by libtpu on this
CPU machine; the Mosaic custom calls must be in the compiled HLO and the kernels' cost estimates
in the compiler's FLOP count), the tile rules, and the input errors.

Tolerances, as in tests/test_flash_attention.py. fp32: the kernel and the reference sum the same
O(S) fp32 terms in a different order (128-wide tiles with an online softmax against one pass), so
they differ by a few ulps of the largest terms (~1e-6 seen here); 1e-5 (abs and rel) leaves a
margin and still catches any real bug (a wrong mask, tile offset or missing term is O(1e-2) or
more). bf16: the kernel rounds P and dS to bf16 before its matmuls and returns bf16 (8-bit
mantissa, 4e-3 relative per rounding), so it is compared with the fp32 reference on the same
bf16-rounded inputs at 2e-2.

Interpret mode here is `interpret=True` of pallas_call (the grid runs as a loop, VMEM scratch
persists across grid steps, dimension semantics and DMA are not simulated): it checks the
kernels' arithmetic, masks, index maps and accumulation order, not Mosaic's lowering, which the
compile tests cover. Tiles are at least 128 on TPU, so sequences here are 128..384 long, with
small head dims; each configuration is jitted once at XLA:CPU's lowest optimisation level.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys.analysis import targets
from jaxsys.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    kernel_tpu,
    reference_attention,
)
from jaxsys.kernels.flash_attention.tpu_compile import CUSTOM_CALL, compile_case, tpu_mesh

FAST_COMPILE = {"xla_backend_optimization_level": 0}
TPU_INTERPRET = dict(backend="tpu", interpret=True)


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _loss(impl, q, k, v, w, u, q_seg, kv_seg, causal):
    """sum(o * w) + sum(lse * u) over the non-empty rows: exercises both cotangents."""
    o, lse = impl(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
    return jnp.sum(o.astype(jnp.float32) * w) + lse_term, (o, lse)


@functools.partial(jax.jit, static_argnames=("impl", "causal"), compiler_options=FAST_COMPILE)
def _outputs_and_grads(q, k, v, w, u, q_seg, kv_seg, *, impl, causal):
    grad_fn = jax.grad(functools.partial(_loss, impl), argnums=(0, 1, 2), has_aux=True)
    grads, (o, lse) = grad_fn(q, k, v, w, u, q_seg, kv_seg, causal)
    return o, lse, grads


TPU = functools.partial(flash_attention, **TPU_INTERPRET)  # default tiles 128 x 128
# Unequal forward tiles and other backward tiles: T = 300 pads to 512 queries / 384 keys in the
# forward and 384 / 512 in the backward, so causal runs with Tp != Sp and skipped tiles both ways.
TPU_MIXED = functools.partial(
    flash_attention, **TPU_INTERPRET, block_q=256, block_k=128, block_q_bwd=128, block_k_bwd=256
)
# A model-style request (16) that the TPU rules round up to 128.
TPU_SMALL = functools.partial(flash_attention, **TPU_INTERPRET, block_q=16, block_k=16)

# name: (B, T, S, N, K, H, causal, segments, dtype, kernel)
CASES = {
    "full_gqa_ragged": (1, 200, 200, 4, 2, 32, False, None, jnp.float32, TPU),
    "causal_gqa": (2, 256, 256, 4, 2, 32, True, None, jnp.float32, TPU_SMALL),
    "causal_mixed_tiles": (1, 300, 300, 2, 1, 32, True, None, jnp.float32, TPU_MIXED),
    "cross_mqa_segments_empty_rows": (1, 130, 260, 4, 1, 32, False, "empty_rows", jnp.float32, TPU),
    "causal_packed_h64": (1, 256, 256, 2, 2, 64, True, "packed", jnp.float32, TPU),
    "causal_gqa_bf16": (1, 256, 256, 4, 2, 64, True, None, jnp.bfloat16, TPU),
}


def _case_inputs(name):
    b, t, s, n, kh, h, causal, segments, dtype, kernel = CASES[name]
    q = _normal(0, (b, t, n, h), dtype)
    k, v = _normal(1, (b, s, kh, h), dtype), _normal(2, (b, s, kh, h), dtype)
    q_seg = kv_seg = None
    if segments == "packed":  # three packed sequences, boundaries off the 128 tiles
        q_seg = kv_seg = jnp.asarray(np.repeat([0, 1, 2], [70, 100, t - 170])[None], jnp.int32)
    elif segments == "empty_rows":  # q ids 0, 1, 2; kv ids 0, 1: the queries of 2 see nothing
        q_seg = jnp.asarray(np.repeat([0, 1, 2], [50, 50, t - 100])[None], jnp.int32)
        kv_seg = jnp.asarray(np.repeat([0, 1], [140, s - 140])[None], jnp.int32)
    w, u = _normal(7, (b, t, n, h)), _normal(8, (b, n, t))
    return (q, k, v, w, u, q_seg, kv_seg), causal, dtype, kernel


def _assert_close(got, want, tol, what):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol, err_msg=what
    )


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_variant_matches_reference(name):
    args, causal, dtype, kernel = _case_inputs(name)
    o, lse, grads = _outputs_and_grads(*args, impl=kernel, causal=causal)
    if dtype == jnp.bfloat16:  # the truth: fp32 reference on the same bf16-rounded values
        args = tuple(None if a is None else (a.astype(jnp.float32) if a.dtype == dtype else a) for a in args)
    want = _outputs_and_grads(*args, impl=reference_attention, causal=causal)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert all(g.dtype == dtype for g in grads)
    for value in (o, lse, *grads):
        assert not np.isnan(np.asarray(value, np.float32)).any()
    _assert_close(o, want[0], tol, "o")
    _assert_close(lse, want[1], tol, "lse")
    for g, wg, what in zip(grads, want[2], ("dq", "dk", "dv")):
        _assert_close(g, wg, tol, what)


def test_tpu_variant_empty_rows():
    args, causal, _, kernel = _case_inputs("cross_mqa_segments_empty_rows")
    o, lse, grads = _outputs_and_grads(*args, impl=kernel, causal=causal)
    empty = np.asarray(args[5][0] == 2)
    assert empty.sum() == 30
    assert np.all(np.asarray(o)[:, empty] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, empty]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~empty]))
    assert np.all(np.asarray(grads[0])[:, empty] == 0.0)


def _merge(o1, lse1, o2, lse2):
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.exp(lse1 - safe).transpose(0, 2, 1)[..., None]
    w2 = jnp.exp(lse2 - safe).transpose(0, 2, 1)[..., None]
    return w1 * o1 + w2 * o2, lse


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _blockwise(q, k, v, do, dlse, q_seg, kv_seg):
    """Two kv halves through flash_attention_forward (TPU variant), merged by lse, then
    flash_attention_backward per half with the merged (o, lse), as a ring step does."""
    s2 = k.shape[1] // 2
    halves = [(k[:, :s2], v[:, :s2], kv_seg[:, :s2]), (k[:, s2:], v[:, s2:], kv_seg[:, s2:])]
    parts = [
        flash_attention_forward(q, kk, vv, q_segment_ids=q_seg, kv_segment_ids=ss, **TPU_INTERPRET)
        for kk, vv, ss in halves
    ]
    o, lse = _merge(*parts[0], *parts[1])
    grads = [
        flash_attention_backward(q, kk, vv, o, lse, do, dlse, q_segment_ids=q_seg, kv_segment_ids=ss, **TPU_INTERPRET)
        for kk, vv, ss in halves
    ]
    dq = grads[0][0] + grads[1][0]
    dk = jnp.concatenate([grads[0][1], grads[1][1]], axis=1)
    dv = jnp.concatenate([grads[0][2], grads[1][2]], axis=1)
    return o, lse, (dq, dk, dv), parts


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiles_masked_by_segment_ids_are_skipped(causal):
    """As tests/test_flash_attention.py's test of the generic kernel, with 128-wide tiles: segment 1
    fills the first tile and has NaN in q, k and v; segment 2's outputs and gradients stay finite
    and equal to the reference only if the forward, dq and dk/dv kernels skip the tiles whose
    segment ids share no id (a masked tile would give 0 * NaN = NaN)."""
    b, t, n, kh, h = 1, 256, 2, 1, 32
    keep = np.arange(t) >= 128
    keep4 = jnp.asarray(keep)[None, :, None, None]
    q, k, v = _normal(31, (b, t, n, h)), _normal(32, (b, t, kh, h)), _normal(33, (b, t, kh, h))
    seg = jnp.asarray(np.repeat([1, 2], [128, 128])[None], jnp.int32)
    w, u = jnp.where(keep4, _normal(9, (b, t, n, h)), 0.0), jnp.zeros((b, n, t))
    poisoned = tuple(jnp.where(keep4, x, jnp.nan) for x in (q, k, v))
    o, _, grads = _outputs_and_grads(*poisoned, w, u, seg, seg, impl=TPU, causal=causal)
    clean = tuple(jnp.where(keep4, x, 0.0) for x in (q, k, v))
    want_o, _, want_grads = _outputs_and_grads(*clean, w, u, seg, seg, impl=reference_attention, causal=causal)
    for got, want, what in zip((o, *grads), (want_o, *want_grads), ("o", "dq", "dk", "dv")):
        got, want = np.asarray(got)[:, keep], np.asarray(want)[:, keep]
        assert np.isfinite(got).all(), what
        _assert_close(got, want, 1e-5, what)


def test_per_block_api_merge_of_kv_halves():
    b, t, s, n, kh, h = 1, 128, 256, 2, 1, 32
    q = _normal(3, (b, t, n, h))
    k, v = _normal(4, (b, s, kh, h)), _normal(5, (b, s, kh, h))
    # kv segment 1 only in the first half, 2 only in the second, 3 nowhere: rows empty in one
    # half, in the other, and in both.
    q_seg = jnp.asarray(np.repeat([0, 1, 2, 3], 32)[None], jnp.int32)
    kv_seg = jnp.asarray(np.repeat([0, 1, 0, 2], [32, 96, 32, 96])[None], jnp.int32)
    do, dlse = _normal(6, (b, t, n, h)), _normal(7, (b, n, t))
    o, lse, grads, parts = _blockwise(q, k, v, do, dlse, q_seg, kv_seg)
    assert np.isneginf(np.asarray(parts[0][1])).any() and np.isneginf(np.asarray(parts[1][1])).any()

    ref = functools.partial(reference_attention, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
    (want_o, want_lse), vjp = jax.vjp(ref, q, k, v)
    _assert_close(o, want_o, 1e-5, "merged o")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    for g, wg, what in zip(grads, vjp((do, dlse)), ("dq", "dk", "dv")):
        assert not np.isnan(np.asarray(g)).any(), what
        _assert_close(g, wg, 1e-5, what)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compiles for TPU topologies: the public functions pick the Mosaic kernels.

needs_libtpu = pytest.mark.skipif(
    not targets.has_libtpu(), reason="needs libtpu (the TPU compiler): pip install -e '.[tpu]'"
)


@functools.cache
def _mesh(target):
    return tpu_mesh(target)


@needs_libtpu
@pytest.mark.parametrize(
    "target, dtype, segments", [("v5p:2x2x1", jnp.bfloat16, False), ("v6e:2x2", jnp.float32, True)]
)
def test_flash_attention_picks_mosaic_when_lowered_for_tpu(target, dtype, segments):
    """flash_attention with no backend argument (as the model calls it), grad through the
    custom_vjp, compiled for a TPU topology: three Mosaic custom calls (forward, dq, dk/dv), and
    the compiler's FLOP count includes the kernels' cost estimates (causal: 36 of 64 tiles)."""
    t, h, n, kh = 1024, 128, 8, 2
    with targets.quiet_libtpu():
        compiled = compile_case(_mesh(target), t, h, dtype, backward=True, heads=n, kv_heads=kh, segments=segments)
    text = compiled.as_text()
    assert text.count(CUSTOM_CALL) == 3
    # Only the TPU branch was lowered: no generic kernel (named flash_attention_fwd, ...).
    assert "flash_attention_fwd" not in text and "flash_attention_bwd" not in text
    tiles = 36  # 8 q blocks of 128: 1 + 2 + ... + 8 kv blocks each
    kernel_flops = (4 + 6 + 8) * tiles * 128 * 128 * h * n  # fwd, dq, dk/dv per device (B=1)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert kernel_flops <= cost["flops"] <= 1.01 * kernel_flops


@needs_libtpu
def test_per_block_api_picks_mosaic_when_lowered_for_tpu():
    """flash_attention_forward / flash_attention_backward as context parallelism calls them
    (causal, block 16 from the model config) inside shard_map, compiled for v5p; the same program
    lowered for the CPU has no Mosaic call (the generic kernel in interpret mode)."""
    mesh = _mesh("v5p:2x2x1")
    data = P("data")
    b, t, n, kh, h = mesh.size, 512, 4, 2, 64

    def local(q, k, v, do):
        o, lse = flash_attention_forward(q, k, v, causal=True, block_q=16, block_k=16)
        return flash_attention_backward(q, k, v, o, lse, do, causal=True, block_q=16, block_k=16)

    def program(mesh):
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(data,) * 4, out_specs=(data,) * 3, check_vma=False))

    shape = lambda m, heads: jax.ShapeDtypeStruct((b, t, heads, h), jnp.bfloat16, sharding=NamedSharding(m, data))
    with targets.quiet_libtpu():
        compiled = program(mesh).lower(shape(mesh, n), shape(mesh, kh), shape(mesh, kh), shape(mesh, n)).compile()
    assert compiled.as_text().count(CUSTOM_CALL) == 3  # forward, dq, dk/dv

    cpu_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices("cpu")[:4], axis_types=(jax.sharding.AxisType.Auto,))
    lowered = program(cpu_mesh).lower(shape(cpu_mesh, n), shape(cpu_mesh, kh), shape(cpu_mesh, kh), shape(cpu_mesh, n))
    assert "tpu_custom_call" not in lowered.as_text()


# ----------------------------------------------------------------------------------------------
# Tile rules and errors.


@pytest.mark.parametrize(
    "requested, length, tile", [(16, 40, 128), (128, 1000, 128), (300, 1000, 384), (512, 200, 256), (512, 32768, 512)]
)
def test_tiles_are_multiples_of_128_and_fit_the_sequence(requested, length, tile):
    assert kernel_tpu.tile(requested, length, "block_q") == tile


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"backend": "cuda"},
            r"backend must be None \(chosen by platform\) or one of "
            r"\('generic', 'tpu', 'mosaic_gpu'\); got backend='cuda'",
        ),
        ({"backend": "tpu", "block_q": 0}, r"block_q must be a positive integer; got block_q=0"),
        ({"backend": "tpu", "block_k_bwd": 2.5}, r"block_k_bwd must be a positive integer"),
        (  # H = 32 would run padded to 64; beyond 256 nothing is left to pad to
            {"backend": "tpu", "interpret": False, "head_dim": 320},
            r"head dim H=320 is not supported; supported head "
            r"dims: \(64, 128, 256\)",
        ),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    kwargs = dict(kwargs)
    q = jnp.zeros((1, 16, 2, kwargs.pop("head_dim", 32)))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, **kwargs)
