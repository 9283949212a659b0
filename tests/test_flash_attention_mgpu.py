"""The Mosaic GPU (Hopper) flash-attention forward, kernels/flash_attention/kernel_mgpu.py, on a CPU.

- Numerics in Pallas' GPU interpret mode against the reference (the interpreted variant differs
  from the compiled one only in how P reaches the P V matmul: kernel_mgpu's docstring).
  Tolerance: bf16/fp16 inputs, both sides compute in fp32, the kernel rounds P to the input dtype
  before P V (2^-9 relative each, averaged over the keys) and rounds o to it (one ulp = 2^-8
  relative for bf16): o within 2^-7 * max|o| (two bf16 ulps); lse is fp32 from unrounded scores,
  1e-5 absolute (exp2 / log2 against exp / log in another order).
- Lowering for an abstract H100 (no GPU, no compile-only devices needed): the Mosaic GPU MLIR has
  wgmma and TMA loads, its shared memory fits sm_90, and backend=None picks this kernel exactly
  where it should (the custom calls in the lowered HLO). Mosaic's compile to SASS needs the CUDA
  driver: tests/test_mgpu_ptx.py stands one in; the compiled numerics and speed are GPU-only (bench.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.kernels import platforms
from jaxsys.kernels.flash_attention import flash_attention, kernel, kernel_mgpu, reference_attention

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")


def _mesh(device_kind: str, platform: str = "gpu"):
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform=platform)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


def _inputs(b, t, n, k, h, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(keys[0], (b, t, n, h), dtype),
        jax.random.normal(keys[1], (b, t, k, h), dtype),
        jax.random.normal(keys[2], (b, t, k, h), dtype),
    )


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


# ------------------------------------------------------------------------------ numerics (interpret)

CASES = {
    # H = 256: key block 64, a 2-slot ring over 4 kv blocks (wraps), warpgroup 0 skips blocks
    "causal_h256": (1, 256, 2, 1, 256, True, jnp.bfloat16),
    # H = 64: key block 256, GQA G = 2, not causal
    "gqa_h64": (1, 256, 4, 2, 64, False, jnp.float16),
}


@pytest.mark.parametrize("name", CASES)
def test_interpreted_kernel_matches_reference(name):
    b, t, n, k, h, causal, dtype = CASES[name]
    q, kk, v = _inputs(b, t, n, k, h, dtype)
    o, lse = flash_attention(q, kk, v, causal=causal, return_lse=True, backend="mosaic_gpu")  # interpreted on CPU
    want_o, want_lse = reference_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), causal=causal, return_lse=True)
    assert o.dtype == dtype and lse.shape == (b, n, t)
    tol = 2**-7 * float(np.abs(_f32(want_o)).max())
    np.testing.assert_allclose(_f32(o), _f32(want_o), rtol=0, atol=tol)
    np.testing.assert_allclose(_f32(lse), _f32(want_lse), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_interpreted_kernel_long_causal_rows():
    """T = 1024, H = 64: key block 256, a 3-slot ring over 4 blocks, four q tiles."""
    q, kk, v = _inputs(1, 1024, 2, 1, 64, jnp.bfloat16, seed=1)
    o, lse = flash_attention(q, kk, v, causal=True, return_lse=True, backend="mosaic_gpu")
    want_o, want_lse = reference_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), causal=True, return_lse=True)
    np.testing.assert_allclose(_f32(o), _f32(want_o), rtol=0, atol=2**-7 * float(np.abs(_f32(want_o)).max()))
    np.testing.assert_allclose(_f32(lse), _f32(want_lse), rtol=0, atol=1e-5)


GRAD_CASES = {
    # Mosaic backward (H = 64, fused: dQ added into an fp32 accumulator by the dK/dV kernel; its
    # interpreted variant stores one part per warpgroup and kv tile): causal, G = 2, the lse cotangent
    "mosaic_causal_gqa": (1, 256, 2, 1, 64, True),
    # Mosaic backward, full attention, G = 2 of K = 2
    "mosaic_full_gqa": (1, 128, 4, 2, 64, False),
    # H = 128 (the fused kernel's two-slot ring), causal, G = 2; and the split backward there
    "mosaic_causal_gqa_h128": (1, 256, 2, 1, 128, True),
    "mosaic_split_causal_gqa_h128": (1, 256, 2, 1, 128, True),
    # H = 256: dK/dV warpgroups split the head dim over shared 64-key programs, dQ streams 32-key
    # blocks through a ring that wraps; causal, G = 2
    "mosaic_h256_causal_gqa": (1, 128, 2, 1, 256, True),
    # H = 256, full, G = 2 of K = 2: four q blocks per head through the dK/dV ring
    "mosaic_h256_full_gqa": (1, 256, 4, 2, 256, False),
}
SLOW = {"mosaic_h256_full_gqa"}


@pytest.mark.parametrize("name", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in GRAD_CASES])
def test_gradients_match_reference(name):
    """dq, dk, dv of sum(o^2) + sum(w * lse) (so the lse cotangent is used too) against the
    reference's. bf16 inputs; P and dS are rounded to bf16 inside the backward: 2^-6 of each
    gradient's max."""
    b, t, n, k, h, causal = GRAD_CASES[name]
    q, kk, v = _inputs(b, t, n, k, h, jnp.bfloat16, seed=2)
    w = jax.random.normal(jax.random.PRNGKey(3), (b, n, t), jnp.float32)

    def loss(f):
        def value(*a):
            o, lse = f(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(w * lse)

        return value

    mgpu = lambda *a: flash_attention(*a, causal=causal, return_lse=True, backend="mosaic_gpu")
    with kernel_mgpu.backward_variant("split" if "split" in name else "fused"):
        got = jax.grad(loss(mgpu), argnums=(0, 1, 2))(q, kk, v)
    f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
    ref = lambda *a: reference_attention(*a, causal=causal, return_lse=True)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*f32)
    for g, wnt in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(_f32(g), _f32(wnt), rtol=0, atol=2**-6 * float(np.abs(_f32(wnt)).max()))


def _ids(*runs):
    """[1, sum(lengths)] int32 ids from (id, length) runs."""
    return jnp.asarray(np.concatenate([np.full(length, i) for i, length in runs])[None], jnp.int32)


# q ids 0, 1, 2, 7 against kv ids 0, 1, 3, 5 (`causal_empty_rows`)
EMPTY_ROW_IDS = (_ids((0, 50), (1, 40), (2, 38), (7, 128)), _ids((0, 30), (1, 70), (3, 28), (5, 128)))

SEG_CASES = {
    # packed documents (q ids = kv ids) with boundaries inside blocks: the queries of the document
    # starting at 130 see no key of kv blocks 0-1; causal, GQA G = 2, key block 256
    "causal_packed_gqa": (256, 4, 2, 64, True, _ids((0, 50), (1, 80), (2, 70), (3, 56)), None),
    # q ids 0, 1, 2 against kv ids 0, 1, 3: queries of segment 2 see nothing (empty rows), full
    "full_empty_rows_gqa": (128, 4, 2, 64, False, _ids((0, 50), (1, 40), (2, 38)), _ids((0, 30), (1, 70), (3, 28))),
    # the same ids, causal: segment 1's first queries (50-69) see no key yet either; then a whole
    # tile of queries (id 7) and of keys (id 5) that meet nothing: kernels with no block to run
    "causal_empty_rows": (256, 2, 1, 64, True, *EMPTY_ROW_IDS),
    # H = 256 (dK/dV split over the head dim, dQ's 32-key blocks): packed, boundaries inside a
    # dK/dV program's 64 keys and inside a warpgroup's 32 query columns; causal, G = 2
    "causal_packed_gqa_h256": (128, 2, 1, 256, True, _ids((0, 20), (1, 50), (2, 58)), None),
    # causal_empty_rows at H = 256: a dK/dV program whose warpgroups share no block to run
    "causal_empty_rows_h256": (256, 2, 1, 256, True, *EMPTY_ROW_IDS),
}
SEG_SLOW = {"causal_empty_rows_h256"}


@pytest.mark.parametrize(
    "name", [pytest.param(c, marks=[pytest.mark.slow] if c in SEG_SLOW else []) for c in SEG_CASES]
)
def test_segment_ids_match_reference(name):
    """o, lse and dq, dk, dv (Mosaic forward and backward, bf16) with segment ids against the
    reference; rows with no visible key give o = 0, lse = -inf, dq = 0, and nothing is NaN. The loss
    leaves -inf lse out of its lse term, as any consumer of lse has to."""
    t, n, k, h, causal, q_seg, kv_seg = SEG_CASES[name]
    kv_seg = q_seg if kv_seg is None else kv_seg
    q, kk, v = _inputs(1, t, n, k, h, jnp.bfloat16, seed=4)
    u = jax.random.normal(jax.random.PRNGKey(5), (1, n, t), jnp.float32)

    def loss(f):
        def value(*a):
            o, lse = f(*a, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (o, lse)

        return value

    mgpu = lambda *a, **kw: flash_attention(*a, **kw, backend="mosaic_gpu")
    got, (o, lse) = jax.grad(loss(mgpu), argnums=(0, 1, 2), has_aux=True)(q, kk, v)
    f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
    want, (want_o, want_lse) = jax.grad(loss(reference_attention), argnums=(0, 1, 2), has_aux=True)(*f32)
    for x in (o, lse, *got):
        assert not np.isnan(_f32(x)).any()
    np.testing.assert_allclose(_f32(o), _f32(want_o), rtol=0, atol=2**-7 * float(np.abs(_f32(want_o)).max()))
    np.testing.assert_array_equal(np.isneginf(_f32(lse)), np.isneginf(_f32(want_lse)))
    finite = np.isfinite(_f32(want_lse))
    np.testing.assert_allclose(_f32(lse)[finite], _f32(want_lse)[finite], rtol=0, atol=1e-5)
    for g, wnt in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(wnt), rtol=0, atol=2**-6 * float(np.abs(_f32(wnt)).max()))
    empty = ~finite[0, 0]  # the same rows for every head: ids do not depend on the head
    assert empty.any() == ("packed" not in name)
    assert np.all(_f32(o)[0, empty] == 0.0) and np.all(_f32(got[0])[0, empty] == 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("h", [128, 256])
def test_segment_ids_forward_at_wider_heads(h):
    """Other key blocks and rings: H = 128 (key block 128), H = 256 (key block 64, a ring that wraps)."""
    q, kk, v = _inputs(1, 256, 2, 1, h, jnp.bfloat16, seed=6)
    seg = _ids((0, 30), (1, 100), (2, 126))
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
    o, lse = flash_attention(q, kk, v, **kw, backend="mosaic_gpu")
    want_o, want_lse = reference_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), **kw)
    np.testing.assert_allclose(_f32(o), _f32(want_o), rtol=0, atol=2**-7 * float(np.abs(_f32(want_o)).max()))
    np.testing.assert_allclose(_f32(lse), _f32(want_lse), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_check_on_gpu_with_segments_runs_interpreted():
    """The GPU check's segment case (what a Hopper run reports), interpreted: the interpret-mode
    tests' bounds hold; documents of 300 tokens shifted by 97 a row, so the ranges differ by row."""
    out = kernel_mgpu.check_on_gpu(b=2, t=256, n=2, k=1, h=64, segments=True, interpret=True)
    assert out["o_err"] <= 2**-7 * out["o_max"] and out["lse_err"] <= 1e-5
    for name in ("dq", "dk", "dv"):
        assert out[f"{name}_err"] <= 2**-6 * out[f"{name}_max"], (name, out)


def test_block_ranges_leave_out_only_disjoint_blocks():
    """Any ids (not only packed, non-decreasing ones): every block outside a tile's [first, end)
    shares no id with the tile, and the first and last blocks inside do share one's range."""
    rng = np.random.default_rng(0)
    for ids in (
        np.sort(rng.integers(0, 6, (2, 256))),
        rng.integers(0, 4, (2, 256)),
        np.repeat([[0, 3], [2, 2]], 128, 1),
    ):
        other = np.sort(rng.integers(0, 6, (2, 256)))
        ranges = np.asarray(kernel_mgpu._block_ranges(jnp.asarray(ids), jnp.asarray(other), 128, 64))
        for b in range(2):
            for tile in range(2):
                own = ids[b, tile * 128 : (tile + 1) * 128]
                meets = [own.min() <= blk.max() and blk.min() <= own.max() for blk in other[b].reshape(4, 64)]
                first, end = ranges[b, tile]
                assert not any(meets[:first]) and not any(meets[end:])
                assert (first, end) == (0, 0) if not any(meets) else meets[first] and meets[end - 1]


@pytest.mark.parametrize(
    "causal, h",
    [pytest.param(True, 128, marks=pytest.mark.slow), (False, 128), pytest.param(False, 256, marks=pytest.mark.slow)],
)
def test_blocks_of_another_document_are_never_read(causal, h):
    """Two documents of 128 tokens, H = 128 (key block 128, the backward's 64-row blocks; H = 256:
    dQ's 32-key blocks, 64-key dK/dV programs): Q, K and V of document 0 are NaN. The kernels load
    no block whose id range is disjoint from the tile's, so document 1's o, lse, dq and its keys'
    dk, dv equal the reference's on clean inputs; masking alone would let 0 * NaN into P V, dS K
    and dS^T Q."""
    t, n = 256, 2
    seg = _ids((0, 128), (1, 128))
    doc1 = jnp.arange(t) >= 128
    clean = _inputs(1, t, n, 1, h, jnp.bfloat16, seed=7)
    poisoned = [jnp.where(doc1[None, :, None, None], x, jnp.nan).astype(x.dtype) for x in clean]
    w = jnp.where(doc1[None, :, None, None], jax.random.normal(jax.random.PRNGKey(8), (1, t, n, h)), 0.0)
    u = jnp.where(doc1[None, None, :], jax.random.normal(jax.random.PRNGKey(9), (1, n, t)), 0.0)

    def loss(f):
        def value(*a):
            o, lse = f(*a, causal=causal, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
            o1, lse1 = jnp.where(doc1[None, :, None, None], o, 0.0), jnp.where(doc1[None, None, :], lse, 0.0)
            return jnp.sum(o1.astype(jnp.float32) * w) + jnp.sum(lse1 * u), (o, lse)

        return value

    mgpu = lambda *a, **kw: flash_attention(*a, **kw, backend="mosaic_gpu")
    got, (o, lse) = jax.grad(loss(mgpu), argnums=(0, 1, 2), has_aux=True)(*poisoned)
    f32 = [x.astype(jnp.float32) for x in clean]
    want, (want_o, want_lse) = jax.grad(loss(reference_attention), argnums=(0, 1, 2), has_aux=True)(*f32)
    keep = np.asarray(doc1)
    o1 = _f32(want_o)[:, keep]
    np.testing.assert_allclose(_f32(o)[:, keep], o1, rtol=0, atol=2**-7 * float(np.abs(o1).max()))
    np.testing.assert_allclose(_f32(lse)[..., keep], _f32(want_lse)[..., keep], rtol=0, atol=1e-5)
    for g, wnt in zip(got, want):
        g, wnt = _f32(g)[:, keep], _f32(wnt)[:, keep]
        np.testing.assert_allclose(g, wnt, rtol=0, atol=2**-6 * float(np.abs(wnt).max()))


# --------------------------------------------------------------------------------- choice of kernel


def _custom_calls(fn, shapes, dtype=jnp.bfloat16, device_kind=H100.device_kind, platform="cuda"):
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    with _mesh(device_kind):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return re.findall(r"custom_call @([\w$.]+)", text)


QKV = [(1, 256, 4, 128), (1, 256, 2, 128), (1, 256, 2, 128)]


def test_backend_none_picks_mosaic_on_hopper():
    """The forward and the fused backward kernel at H = 128 (the split backward: its two), with
    segment ids too (packed rows); at H = 256 the split backward (its dK/dV splits the head dim)."""
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True).astype(jnp.float32))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _custom_calls(grad, QKV) == ["mosaic_gpu_v2"] * 2
    with kernel_mgpu.backward_variant("split"):  # read when traced: a fresh function
        split_grad = jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2))
        assert _custom_calls(split_grad, QKV) == ["mosaic_gpu_v2"] * 3

    def packed(q, k, v):
        seg = jnp.cumsum(jnp.arange(q.shape[1]) % 100 == 99)[None].astype(jnp.int32)
        return jnp.sum(flash_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg))

    assert _custom_calls(jax.grad(packed, argnums=(0, 1, 2)), QKV) == ["mosaic_gpu_v2"] * 2
    wide = [(*shape[:3], 256) for shape in QKV]
    assert _custom_calls(grad, wide) == ["mosaic_gpu_v2"] * 3


@pytest.mark.parametrize(
    "device_kind, shapes, kwargs, dtype",
    [
        ("NVIDIA A100-SXM4-80GB", QKV, {}, jnp.bfloat16),  # Ampere: no wgmma
        ("NVIDIA B200", QKV, {}, jnp.bfloat16),  # Blackwell: no wgmma either
        (H100.device_kind, QKV, {}, jnp.float32),  # fp32 inputs
        (H100.device_kind, [(1, 192, 4, 128), (1, 192, 2, 128), (1, 192, 2, 128)], {}, jnp.bfloat16),  # T % 128
        (H100.device_kind, [(1, 256, 4, 32), (1, 256, 2, 32), (1, 256, 2, 32)], {}, jnp.bfloat16),  # H = 32
        (H100.device_kind, QKV, {"interpret": False, "softmax_scale": -1.0}, jnp.bfloat16),
    ],
)
def test_backend_none_falls_back_to_triton(device_kind, shapes, kwargs, dtype):
    kwargs = dict(kwargs)
    segments = kwargs.pop("segments", False)

    def fn(q, k, v):
        seg = jnp.zeros(q.shape[:2], jnp.int32) if segments else None
        return flash_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, **kwargs)

    assert _custom_calls(fn, shapes, dtype, device_kind) == ["__gpu$xla.gpu.triton"]


@pytest.mark.parametrize(
    "kind, capability",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0)),
        ("NVIDIA H200", (9, 0)),
        ("NVIDIA GH200 480GB", (9, 0)),
        ("NVIDIA A100-SXM4-80GB", None),
        ("NVIDIA B200", None),
    ],
)
def test_capability_from_the_abstract_device_kind(kind, capability):
    with _mesh(kind):
        assert kernel_mgpu.gpu_capability() == capability


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin for compile-only H100 devices")
def test_deviceless_h100_compile_keeps_the_mosaic_kernels():
    """The AOT path: a CPU host, a mesh of compile-only H100 devices, the kernels in shard_map.
    XLA:GPU's deviceless compile of the gradient keeps the two Mosaic GPU custom calls (forward;
    dK/dV with dQ added in place into an fp32 accumulator the call aliases) (the kernels' own
    PTX/SASS is built when the executable runs on a GPU: no PTX in the compiled text)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P())) for s in QKV]
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True).astype(jnp.float32))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    f = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P(),) * 3, out_specs=(P(),) * 3, check_vma=False))
    lowered = f.lower(*args)
    assert re.findall(r"custom_call @([\w$.]+)", lowered.as_text()) == ["mosaic_gpu_v2"] * 2
    assert lowered.as_text().count("#stablehlo.output_operand_alias<") == 1  # the dQ accumulator, in place
    compiled = lowered.compile().as_text()
    assert re.findall(r'custom_call_target="([^"]+)"', compiled) == ["mosaic_gpu_v2"] * 2
    assert ".target sm_90" not in compiled


def test_plan_without_a_gpu_in_sight_has_no_mosaic_branch():
    """On this CPU host with no mesh in context, the capability is unknown: no CUDA branch."""
    q, kk, v = _inputs(1, 256, 4, 2, 128, jnp.bfloat16)
    assert kernel_mgpu.gpu_capability() is None
    with _mesh(H100.device_kind):
        assert kernel_mgpu.gpu_capability() == (9, 0)
    with _mesh("TPU v5p", platform="tpu"):
        assert kernel_mgpu.gpu_capability() is None
    plan = kernel._prepare(q, kk, v, None, None, **_PREPARE)[0]
    assert [variant for _, variant, _ in plan.branches] == ["generic", "tpu", "generic"]
    with _mesh(H100.device_kind):
        plan = kernel._prepare(q, kk, v, None, None, **_PREPARE)[0]
        assert (("cuda",), "mosaic_gpu") in [(p, variant) for p, variant, _ in plan.branches]
        plan = kernel._prepare(q, kk, v, None, None, **(_PREPARE | {"interpret": True}))[0]
        assert [variant for _, variant, _ in plan.branches] == ["generic"]


_PREPARE = dict(
    causal=True,
    softmax_scale=None,
    block_q=128,
    block_k=128,
    block_q_bwd=None,
    block_k_bwd=None,
    interpret=None,
    backend=None,
)


def test_explicit_backend_refuses_unsupported_calls():
    q, kk, v = _inputs(1, 192, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"backend='mosaic_gpu' cannot run this call: T = 192 is not a multiple of 128"
    ):
        flash_attention(q, kk, v, backend="mosaic_gpu")
    with pytest.raises(ValueError, match=r"one of \('generic', 'tpu', 'mosaic_gpu'\)"):
        flash_attention(q, kk, v, backend="mgpu")
    # other kernels have no Mosaic GPU variant
    with pytest.raises(ValueError, match=r"one of \('generic', 'tpu'\); got backend='mosaic_gpu'"):
        platforms.check_backend("mosaic_gpu")


# ------------------------------------------------------------------------- the Mosaic GPU MLIR


def _resources(path) -> dict:
    text = open(path).read()
    return {"smem_scratch_bytes": int(re.search(r"smem_scratch_bytes=(\d+)", text).group(1))}


def _packed_ids(t):
    """[1, t] ids of documents of 100 tokens: what the model passes with config.data.packing."""
    return (jnp.arange(t) // 100)[None].astype(jnp.int32)


@pytest.mark.parametrize(
    "h, causal, segments, variant",
    [
        (64, True, False, "fused"),
        (128, False, False, "fused"),
        (128, True, True, "fused"),
        (128, True, True, "split"),
        (256, True, False, "split"),
        (256, False, True, "split"),
    ],
)
def test_backward_kernels_lower_within_hopper_shared_memory(h, causal, segments, variant, tmp_path, monkeypatch):
    """With segment ids, two more TMA loads per kernel: the resident and the streamed ids. Fused:
    one kernel with five wgmmas a block (S^T, dV, dP^T, dK, dQ) whose dQ leaves by TMA reduce-add
    (`reduction_op` 0 is Add) beside the plain stores of dK and dV; split: a dQ kernel beside it.
    H = 256 (split only): the 64-byte swizzle and the dK/dV kernel's P^T / dS^T exchange buffer
    lower, in <= 227 KiB."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    t = 512
    seg = _packed_ids(t) if segments else None
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg, backend="mosaic_gpu", interpret=False)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, **kw))
    fused = variant == "fused"
    with kernel_mgpu.backward_variant(variant):
        calls = _custom_calls(jax.grad(loss, argnums=(0, 1, 2)), [(1, t, 4, h), (1, t, 2, h), (1, t, 2, h)])
    assert calls == ["mosaic_gpu_v2"] * (2 if fused else 3)
    assert not fused or not list(tmp_path.glob("flash_attention_mgpu_bwd_dq*"))
    for name, stores in (("fused", 2),) if fused else (("dq", 1), ("dkdv", 2)):
        (mlir,) = tmp_path.glob(f"flash_attention_mgpu_bwd_{name}*.after_layout_inference.txt")
        (resources,) = tmp_path.glob(f"flash_attention_mgpu_bwd_{name}*.resources.txt")
        text = mlir.read_text()
        ops = re.findall(r"mosaic_gpu\.(wgmma|async_load|async_store)\b", text)
        reduce_adds = len(re.findall(r"mosaic_gpu\.async_store[^}]*reduction_op = 0 : i32", text))
        # the masked and the unmasked loop each trace the step: its dQ add appears once per loop
        assert ops.count("async_store") == stores + reduce_adds and (reduce_adds >= 1) == fused, (name, ops)
        assert ops.count("wgmma") >= (5 if fused else 3), (name, ops)
        assert ops.count("async_load") >= (6 if segments else 4), (name, ops)
        assert _resources(resources)["smem_scratch_bytes"] <= kernel_mgpu.SMEM_LIMIT_BYTES


@pytest.mark.parametrize("h, segments", [(h, False) for h in kernel_mgpu.HEAD_DIMS] + [(64, True), (256, True)])
def test_lowers_to_wgmma_and_tma_within_hopper_shared_memory(h, segments, tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    t = 512
    seg = _packed_ids(t) if segments else None
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, backend="mosaic_gpu", interpret=False)
    fn = lambda q, k, v: flash_attention(q, k, v, **kw)
    assert _custom_calls(fn, [(1, t, 4, h), (1, t, 2, h), (1, t, 2, h)]) == ["mosaic_gpu_v2"]
    (mlir,) = tmp_path.glob("flash_attention_mgpu_fwd*.after_layout_inference.txt")
    (resources,) = tmp_path.glob("flash_attention_mgpu_fwd*.resources.txt")
    ops = re.findall(r"mosaic_gpu\.(wgmma|async_load|async_store)\b", mlir.read_text())
    assert ops.count("wgmma") >= 2  # Q K^T and P V (the causal and unmasked loops have their own)
    # Q, K, V (and the q and kv segment ids) in; O, lse out
    assert ops.count("async_load") >= (5 if segments else 3) and ops.count("async_store") == 2
    smem = _resources(resources)["smem_scratch_bytes"]
    assert smem <= kernel_mgpu.SMEM_LIMIT_BYTES, smem
    block_k, stages = kernel_mgpu.tiles(h, t, has_segments=segments)
    stages = min(stages, t // block_k)  # the ring is no deeper than the kv blocks
    # the model of shared memory the tile choice uses is within alignment of Mosaic's own count
    assert 0 <= smem - kernel_mgpu._smem_bytes(h, block_k, stages, 2, segments) <= 4096


@pytest.mark.parametrize("segments", [False, True])
def test_tiles_use_the_widest_block_and_most_slots_that_fit(segments):
    budget = kernel_mgpu.SMEM_LIMIT_BYTES - 4096
    for h in kernel_mgpu.HEAD_DIMS:
        block_k, stages = kernel_mgpu.tiles(h, 4096, has_segments=segments)
        assert kernel_mgpu._smem_bytes(h, block_k, stages, 2, segments) <= budget
        assert stages == 4 or kernel_mgpu._smem_bytes(h, block_k, stages + 1, 2, segments) > budget
    assert kernel_mgpu.tiles(64, 4096)[0] == 256 and kernel_mgpu.tiles(64, 384)[0] == 128
    assert kernel_mgpu.tiles(128, 96) is None


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin for compile-only H100 devices")
@pytest.mark.slow  # CI time; the kernels' own H100 compiles stay
def test_the_models_train_step_for_an_h100_runs_the_mosaic_kernels():
    """config.model.attention_impl='pallas' in bf16 at H = 64: the whole train step compiled for one
    H100 (deviceless) calls the Mosaic GPU forward and fused backward kernels and no Triton attention."""
    from tests.helpers import small_config
    from tests.test_tpu_compile import compile_on_tpu

    c = small_config(attention_impl="pallas", head_dim=64, n_heads=4, n_kv_heads=2, d_model=256)
    c.data.seq_len, c.model.compute_dtype, c.mesh.data, c.mesh.fsdp = 256, "bfloat16", 1, 1
    devices = targets.devices(targets.parse("h100-1"))
    text = compile_on_tpu(c, devices).as_text()
    assert text.count('custom_call_target="mosaic_gpu_v2"') == 2  # forward, dK/dV + dQ (layers scanned)
    assert "__gpu$xla.gpu.triton" not in text
    c.model.attention_kernel = "generic"  # the config's opt-out: Triton's three kernels instead
    text = compile_on_tpu(c, devices).as_text()
    assert "mosaic_gpu_v2" not in text and text.count("__gpu$xla.gpu.triton") >= 3


@pytest.mark.slow
@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin for compile-only H100 devices")
def test_the_models_packed_train_step_for_an_h100_runs_the_mosaic_kernels():
    """config.data.packing=True (the model passes the document ids as segment ids): the train step
    compiled for one H100 calls the two Mosaic GPU kernels with the ids among their operands."""
    from tests.helpers import small_config
    from tests.test_tpu_compile import compile_on_tpu

    c = small_config(attention_impl="pallas", head_dim=64, n_heads=4, n_kv_heads=2, d_model=256)
    c.data.seq_len, c.model.compute_dtype, c.mesh.data, c.mesh.fsdp = 256, "bfloat16", 1, 1
    c.data.source, c.data.path, c.data.packing = "jsonl", "unread.jsonl", True  # nothing is read: abstract batch
    text = compile_on_tpu(c, targets.devices(targets.parse("h100-1"))).as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="mosaic_gpu_v2"' in line]
    assert len(calls) == 2 and "__gpu$xla.gpu.triton" not in text
    assert all(re.search(r"operand_layout_constraints=\{.*s32\[", line) for line in calls)  # the ids go in
