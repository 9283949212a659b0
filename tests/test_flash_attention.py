"""The Pallas flash-attention kernel (interpret mode on CPU) against the pure-JAX reference:
outputs, lse and gradients (including the lse cotangent), GQA/MQA, segment ids, ragged lengths,
fp32 and bf16, the per-block forward/backward API merged over kv halves as context parallelism
does, heads split over `tensor` inside shard_map, and the input errors.

Tolerances. fp32: the kernel and the reference sum the same O(S) fp32 terms in a different order
(blocked online softmax vs one pass), so they differ by a few ulps of the largest terms
(~1e-6 seen at these sizes); 1e-5 (abs and rel) leaves a margin and still catches any real bug
(a wrong mask or a missing term is O(1e-2) or more). bf16: the kernel rounds P and dS to bf16
before its matmuls and returns bf16 (8 bits of mantissa, 4e-3 relative per rounding), so it is
compared with the fp32 reference on the same bf16-rounded inputs at 2e-2.

Interpret mode is compiled by XLA:CPU, and that compile dominates the time of this file, so each
kernel configuration is jitted once (shared between tests through the jit cache) at XLA's lowest
backend optimisation level, which halves the compile and changes nothing that is checked here.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    reference_attention,
    reference_attention_backward,
)

FAST_COMPILE = {"xla_backend_optimization_level": 0}
BLOCKS = dict(block_q=16, block_k=16)


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(b, t, s, n, kh, h, dtype=jnp.float32, seed=0):
    return (
        _normal(seed, (b, t, n, h), dtype),
        _normal(seed + 1, (b, s, kh, h), dtype),
        _normal(seed + 2, (b, s, kh, h), dtype),
    )


def _loss(impl, q, k, v, w, u, q_seg, kv_seg, causal):
    """sum(o * w) + sum(lse * u): exercises both cotangents. Empty rows (lse = -inf) are left out
    of the lse term, as any consumer of lse has to do."""
    o, lse = impl(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
    lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
    return jnp.sum(o.astype(jnp.float32) * w) + lse_term, (o, lse)


@functools.partial(jax.jit, static_argnames=("impl", "causal"), compiler_options=FAST_COMPILE)
def _outputs_and_grads(q, k, v, w, u, q_seg, kv_seg, *, impl, causal):
    """(o, lse, (dq, dk, dv)) of `impl` for the loss above."""
    grad_fn = jax.grad(functools.partial(_loss, impl), argnums=(0, 1, 2), has_aux=True)
    grads, (o, lse) = grad_fn(q, k, v, w, u, q_seg, kv_seg, causal)
    return o, lse, grads


KERNEL = functools.partial(flash_attention, **BLOCKS)  # interpret=None: interpret mode on CPU
# Unequal tiles, and backward tiles that differ from the forward ones (other padding, other
# causal loop bounds).
KERNEL_WIDE_K = functools.partial(flash_attention, block_q=16, block_k=32)
KERNEL_BWD_TILES = functools.partial(flash_attention, **BLOCKS, block_q_bwd=32, block_k_bwd=16)
REFERENCE = reference_attention


def _segments(b, length, bounds, seed):
    """Packed-sequence segment ids: ids 0, 1, ... changing at `bounds`, per batch row shifted."""
    ids = np.zeros((b, length), np.int32)
    for row in range(b):
        for cut in bounds:
            ids[row, min(length, cut + 3 * row + seed) :] += 1
    return jnp.asarray(ids)


# name: (B, T, S, N, K, H, causal, segments, dtype, kernel)
CASES = {
    "full_gqa_ragged": (2, 40, 40, 4, 2, 16, False, None, jnp.float32, KERNEL),
    "causal_gqa_ragged": (2, 40, 40, 4, 2, 16, True, None, jnp.float32, KERNEL_BWD_TILES),
    "cross_mqa": (1, 24, 56, 4, 1, 32, False, None, jnp.float32, KERNEL_WIDE_K),
    "causal_packed": (2, 48, 48, 2, 2, 16, True, "packed", jnp.float32, KERNEL),
    "segments_empty_rows": (1, 32, 40, 2, 1, 16, False, "empty_rows", jnp.float32, KERNEL),
    "causal_gqa_bf16": (2, 32, 32, 4, 2, 32, True, None, jnp.bfloat16, KERNEL),
    # head dims the kernels do not take run zero-padded at the true H's scale (12 -> 16, 40 -> 48)
    "causal_h12_padded": (2, 40, 40, 4, 2, 12, True, None, jnp.float32, KERNEL),
    "packed_h40_padded": (2, 48, 48, 2, 1, 40, True, "packed", jnp.float32, KERNEL),
}


def _case_inputs(name):
    b, t, s, n, kh, h, causal, segments, dtype, kernel = CASES[name]
    q, k, v = _qkv(b, t, s, n, kh, h, dtype)
    q_seg = kv_seg = None
    if segments == "packed":
        q_seg = kv_seg = _segments(b, t, (13, 30), 0)
    elif segments == "empty_rows":
        # q ids 0, 1, 2; kv ids 0, 1 only: the queries of segment 2 see nothing.
        q_seg = jnp.asarray(np.repeat([0, 1, 2], [10, 12, 10])[None], jnp.int32)
        kv_seg = jnp.asarray(np.repeat([0, 1], [25, 15])[None], jnp.int32)
    w = _normal(7, (b, t, n, h))
    u = _normal(8, (b, n, t))
    return (q, k, v, w, u, q_seg, kv_seg), causal, dtype, kernel


def _assert_close(got, want, tol, what):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol, err_msg=what
    )


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_lse_and_grads_match_reference(name):
    args, causal, dtype, kernel = _case_inputs(name)
    got = _outputs_and_grads(*args, impl=kernel, causal=causal)
    if dtype == jnp.bfloat16:  # the truth: fp32 reference on the same bf16-rounded values
        args = tuple(None if a is None else (a.astype(jnp.float32) if a.dtype == dtype else a) for a in args)
    want = _outputs_and_grads(*args, impl=REFERENCE, causal=causal)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    o, lse, grads = got
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert all(g.dtype == dtype for g in grads)
    for value in (o, lse, *grads):
        assert not np.isnan(np.asarray(value, np.float32)).any()
    _assert_close(o, want[0], tol, "o")
    _assert_close(lse, want[1], tol, "lse")
    for g, wg, what in zip(grads, want[2], ("dq", "dk", "dv")):
        _assert_close(g, wg, tol, what)


def test_backward_at_a_padded_head_dim_matches_reference():
    """flash_attention_backward (context parallelism's block backward) at H = 12, which runs
    zero-padded to 16: dq, dk, dv equal the reference's, cut back to H."""
    q, k, v = _qkv(1, 32, 32, 4, 2, 12, seed=5)
    o, lse = reference_attention(q, k, v, causal=True, return_lse=True)
    do = _normal(9, o.shape)
    got = flash_attention_backward(q, k, v, o, lse, do, causal=True, **BLOCKS)
    want = reference_attention_backward(q, k, v, o, lse, do, causal=True)
    for g, w, x, what in zip(got, want, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == w.shape == x.shape
        _assert_close(g, w, 1e-5, what)


class ForwardVariantsTest(chex.TestCase):
    """The kernel called as is and under jax.jit (chex.variants) gives the reference's o and lse."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_equals_reference(self):
        q, k, v = _qkv(1, 32, 32, 4, 2, 16, seed=21)
        attend = self.variant(lambda q, k, v: KERNEL(q, k, v, causal=True, return_lse=True))
        chex.assert_trees_all_close(
            attend(q, k, v), REFERENCE(q, k, v, causal=True, return_lse=True), rtol=1e-5, atol=1e-5
        )


def test_empty_rows_give_zero_output_and_minus_inf_lse():
    args, causal, _, kernel = _case_inputs("segments_empty_rows")
    o, lse, grads = _outputs_and_grads(*args, impl=kernel, causal=causal)
    empty = np.asarray(args[5][0] == 2)  # queries of the segment absent from kv
    assert empty.sum() == 10
    assert np.all(np.asarray(o)[:, empty] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, empty]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~empty]))
    assert np.all(np.asarray(grads[0])[:, empty] == 0.0)  # dq of the empty rows


def _poisoned_outside(x, keep):
    """x with NaN at every position (axis 1) outside `keep` [T] bool."""
    return jnp.where(jnp.asarray(keep)[None, :, None, None], x, jnp.nan)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_blocks_masked_by_segment_ids_are_skipped(causal):
    """Tiles whose query and key segment ids share no id are not computed at all. Segment 1 fills
    the first two 16-wide blocks and has NaN in its q, k and v: a computed-then-masked tile would
    spread it into segment 2 (0 * NaN = NaN in P V, in dS = P (dP - Delta) through Delta of the
    poisoned rows, and in dS^T Q). Segment 2's outputs and its dq, dk, dv stay finite and equal
    to the reference on clean inputs only if all three kernels skip those tiles."""
    b, t, n, kh, h = 1, 64, 2, 1, 16
    q, k, v = _qkv(b, t, t, n, kh, h, seed=31)
    seg = jnp.asarray(np.repeat([1, 2], [32, 32])[None], jnp.int32)
    keep = np.arange(t) >= 32
    w = jnp.where(jnp.asarray(keep)[None, :, None, None], _normal(9, (b, t, n, h)), 0.0)  # segment 2's outputs only
    u = jnp.zeros((b, n, t))

    poisoned = tuple(_poisoned_outside(x, keep) for x in (q, k, v))
    o, _, grads = _outputs_and_grads(*poisoned, w, u, seg, seg, impl=KERNEL, causal=causal)
    clean = tuple(jnp.where(jnp.asarray(keep)[None, :, None, None], x, 0.0) for x in (q, k, v))
    want_o, _, want_grads = _outputs_and_grads(*clean, w, u, seg, seg, impl=REFERENCE, causal=causal)
    for got, want, what in zip((o, *grads), (want_o, *want_grads), ("o", "dq", "dk", "dv")):
        got, want = np.asarray(got)[:, keep], np.asarray(want)[:, keep]
        assert np.isfinite(got).all(), what
        _assert_close(got, want, 1e-5, what)


def test_lse_cotangent_alone():
    """Only lse reaches the loss (w = 0): the gradient must come entirely through dlse
    (dS = P * dlse), which a kernel that drops the lse cotangent would get as zero."""
    (q, k, v, w, u, q_seg, kv_seg), causal, _, kernel = _case_inputs("causal_gqa_ragged")
    w = jnp.zeros_like(w)  # same shapes: reuses the compiled program of that case
    _, _, got = _outputs_and_grads(q, k, v, w, u, q_seg, kv_seg, impl=kernel, causal=causal)
    _, _, want = _outputs_and_grads(q, k, v, w, u, q_seg, kv_seg, impl=REFERENCE, causal=causal)
    for g, wg, what in zip(got, want, ("dq", "dk", "dv")):
        _assert_close(g, wg, 1e-5, what)
    assert np.abs(np.asarray(want[0])).max() > 1e-2 and np.abs(np.asarray(want[1])).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(got[2]), 0.0)  # lse does not depend on v


def _merge(o1, lse1, o2, lse2):
    """Combine the attention of one query over two disjoint key sets from their (o, lse), guarding
    rows that are empty in both (lse = -inf on both sides)."""
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.exp(lse1 - safe).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
    w2 = jnp.exp(lse2 - safe).transpose(0, 2, 1)[..., None]
    return w1 * o1 + w2 * o2, lse


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _blockwise(q, k, v, do, dlse, q_seg, kv_seg):
    """Attention over two kv halves, merged by lse, then the backward per half with the merged
    (o, lse): what one ring-attention step does on each side."""
    s2 = k.shape[1] // 2
    halves = [(k[:, :s2], v[:, :s2], kv_seg[:, :s2]), (k[:, s2:], v[:, s2:], kv_seg[:, s2:])]
    parts = [
        flash_attention_forward(q, kk, vv, q_segment_ids=q_seg, kv_segment_ids=ss, **BLOCKS) for kk, vv, ss in halves
    ]
    o, lse = _merge(*parts[0], *parts[1])
    grads = [
        flash_attention_backward(q, kk, vv, o, lse, do, dlse, q_segment_ids=q_seg, kv_segment_ids=ss, **BLOCKS)
        for kk, vv, ss in halves
    ]
    dq = grads[0][0] + grads[1][0]
    dk = jnp.concatenate([grads[0][1], grads[1][1]], axis=1)
    dv = jnp.concatenate([grads[0][2], grads[1][2]], axis=1)
    return o, lse, (dq, dk, dv), parts


def test_merge_of_kv_halves_equals_full_attention():
    b, t, s, n, kh, h = 1, 32, 64, 4, 2, 16
    q, k, v = _qkv(b, t, s, n, kh, h, seed=3)
    # q segments 0..3; kv segment 1 lies only in the first half, 2 only in the second, 3 nowhere:
    # rows that are empty in one half, in the other, and in both.
    q_seg = jnp.asarray(np.repeat([0, 1, 2, 3], 8)[None], jnp.int32)
    kv_seg = jnp.asarray(np.repeat([0, 1, 0, 2], [8, 24, 8, 24])[None], jnp.int32)
    do, dlse = _normal(4, (b, t, n, h)), _normal(5, (b, n, t))
    o, lse, grads, parts = _blockwise(q, k, v, do, dlse, q_seg, kv_seg)
    lse1, lse2 = np.asarray(parts[0][1]), np.asarray(parts[1][1])
    assert np.isneginf(lse1).any() and np.isneginf(lse2).any()

    ref = functools.partial(reference_attention, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
    (want_o, want_lse), vjp = jax.vjp(ref, q, k, v)
    _assert_close(o, want_o, 1e-5, "merged o")
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    for g, wg, what in zip(grads, vjp((do, dlse)), ("dq", "dk", "dv")):
        assert not np.isnan(np.asarray(g)).any(), what
        _assert_close(g, wg, 1e-5, what)


def test_inside_shard_map_heads_over_tensor():
    """N = 16 query heads and K = 8 kv heads split over `tensor` (8 devices: 2 query heads and 1 kv
    head each): outputs, lse and gradients equal the unsharded reference."""
    mesh = jax.make_mesh((8,), ("tensor",))
    b, t, n, kh, h = 1, 32, 16, 8, 16
    q, k, v = _qkv(b, t, t, n, kh, h, seed=11)
    w, u = _normal(12, (b, t, n, h)), _normal(13, (b, n, t))
    heads, rows = P(None, None, "tensor", None), P(None, "tensor", None)

    def local(q, k, v):
        return flash_attention(q, k, v, causal=True, return_lse=True, **BLOCKS)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads), out_specs=(heads, rows), check_vma=False)

    def loss(attn, q, k, v):
        o, lse = attn(q, k, v)
        return jnp.sum(o * w) + jnp.sum(lse * u), (o, lse)

    step = jax.jit(
        jax.grad(functools.partial(loss, sharded), argnums=(0, 1, 2), has_aux=True), compiler_options=FAST_COMPILE
    )
    put = lambda x: jax.device_put(x, NamedSharding(mesh, heads))
    grads, (o, lse) = step(put(q), put(k), put(v))
    assert o.sharding.spec == heads

    reference = functools.partial(reference_attention, causal=True, return_lse=True)
    want_grads, (want_o, want_lse) = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2), has_aux=True)(
        q, k, v
    )
    _assert_close(o, want_o, 1e-5, "o")
    _assert_close(lse, want_lse, 1e-5, "lse")
    for g, wg, what in zip(grads, want_grads, ("dq", "dk", "dv")):
        _assert_close(g, wg, 1e-5, what)


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 16, 4, 16), (1, 16, 3, 16)), {}, r"multiple of the number of kv heads K; got N=4, K=3"),
        (((1, 16, 2, 16), (1, 24, 2, 16)), {"causal": True}, r"needs T == S; got T=16, S=24"),
        (((1, 16, 2, 320), (1, 16, 2, 320)), {}, r"head dim H=320 is not supported"),
        (
            ((1, 16, 2, 320), (1, 16, 2, 320)),
            {"interpret": False},
            r"head dim H=320 is not supported; supported head dims: \(64, 128, 256\)",
        ),
        (((1, 16, 2, 16), (2, 16, 2, 16)), {}, r"batch sizes differ"),
        (((1, 16, 2, 16), (1, 16, 2, 16)), {"block_q": 24}, r"block_q must be a power of two >= 16"),
        (
            ((1, 16, 2, 16), (1, 16, 2, 16)),
            {"q_segment_ids": jnp.zeros((1, 16), jnp.int32)},
            r"pass both q_segment_ids and kv_segment_ids",
        ),
    ],
)
def test_bad_inputs_raise(shapes, kwargs, match):
    q, k = jnp.zeros(shapes[0]), jnp.zeros(shapes[1])
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, **kwargs)


def test_bad_inputs_raise_mismatched_kv_and_backward_shapes():
    q, k = jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 2, 16))
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        flash_attention(q, k, k[:, :8])
    with pytest.raises(ValueError, match=r"lse and dlse must have shape \[B, N, T\]"):
        flash_attention_backward(q, k, k, q, jnp.zeros((1, 16, 2)), q)
    with pytest.raises(ValueError, match=r"needs T == S"):
        reference_attention(q, k[:, :8], k[:, :8], causal=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("window", [None, 256], ids=["causal", "window"])
def test_lowers_through_triton_for_a_gpu_ahead_of_time(window):
    """No GPU here, but the Pallas -> Triton IR lowering runs in Python: lower the forward and both
    backward kernels for an abstract H100 (bf16, H=128, GQA, causal, segments, ragged T; and with
    a sliding window, which the Mosaic GPU kernels leave to these). This catches what Triton's
    lowering rejects (non-power-of-two tiles, unsupported primitives); Triton's own compile and
    the numerics on a GPU are not checked."""
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    b, t, n, kh, h = 1, 1000, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, seg):
        o, lse = flash_attention(
            q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True, interpret=False, window=window
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3  # fwd, dq, dk/dv


def test_kernels_use_exp2_not_exp():
    """The generic kernels fold scale * log2(e) into the scores and exponentiate with exp2 (one
    ex2 per element on a GPU): no `exp` is left in the forward or the two backward kernel bodies."""
    q = jnp.ones((1, 32, 2, 16), jnp.float32)
    bodies: dict = {}  # pallas_call name -> primitives of its kernel body

    def subjaxprs(eqn):
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "eqns"):
                    yield sub
                elif hasattr(sub, "jaxpr"):
                    yield sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr

    def walk(jaxpr, into=None):
        for eqn in jaxpr.eqns:
            if into is not None:
                into.add(eqn.primitive.name)
            if eqn.primitive.name == "pallas_call" and into is None:
                walk(eqn.params["jaxpr"], bodies.setdefault(eqn.params["name"], set()))
            else:
                for sub in subjaxprs(eqn):
                    walk(sub, into)

    loss = lambda q: jnp.sum(flash_attention(q, q, q, causal=True, interpret=True, **BLOCKS))
    walk(jax.make_jaxpr(jax.grad(loss))(q).jaxpr)
    assert set(bodies) == {"flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv"}
    for name, prims in bodies.items():
        assert "exp2" in prims and "exp" not in prims, (name, sorted(prims))
