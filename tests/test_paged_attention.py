"""kernels/paged_attention: the Pallas kernels (interpret mode) against reference.py, the reference
against attention over the same cache laid out contiguously, bad input, and ahead-of-time compiles
(Mosaic for a v5p slice, Triton for an abstract / deviceless H100).

Tolerances. fp32: kernel and reference form the same fp32 scores and softmax, in another order (page
by page with an online softmax against one softmax over the whole row): they agree to fp32 rounding,
rtol 1e-5 + atol 1e-5 * max|o|. bf16 inputs: both read the same bf16 values and compute in fp32;
the generic kernel's products are fp32, the TPU variant (like any flash kernel) rounds the
probabilities P to bf16 before P V (2^-9 relative each, averaged over the keys), and both round the
output to bf16 (one ulp = 2^-8 relative, and the two fp32 results may straddle a rounding
boundary): rtol = atol / max|o| = 2^-7, i.e. two bf16 ulps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.kernels.paged_attention import kernel
from jaxsys.kernels.paged_attention import reference as ref

RNG = np.random.default_rng(7)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _case(b=6, n=4, k=2, h=32, page_size=8, max_pages=4, spare=5, dtype=jnp.float32, lengths=None):
    """A shared pool of b * max_pages + spare pages, shuffled over the sequences; lengths cover one
    token, exactly full pages (one and all), and partial last pages. Table entries past a
    sequence's pages are 0."""
    if lengths is None:
        cap = max_pages * page_size
        lengths = [1, page_size, cap, page_size + 3, cap - 1, 2 * page_size + 1][:b]
        lengths += list(RNG.integers(1, cap + 1, b - len(lengths)))
    lengths = np.asarray(lengths, np.int32)
    num_pages = b * max_pages + spare
    ids = RNG.permutation(num_pages)[: b * max_pages].reshape(b, max_pages)
    used = -(-lengths // page_size)
    table = np.where(np.arange(max_pages)[None, :] < used[:, None], ids, 0).astype(np.int32)
    q = jnp.asarray(RNG.standard_normal((b, n, h)), dtype)
    kp = jnp.asarray(RNG.standard_normal((num_pages, page_size, k, h)), dtype)
    vp = jnp.asarray(RNG.standard_normal((num_pages, page_size, k, h)), dtype)
    return q, kp, vp, jnp.asarray(table), jnp.asarray(lengths)


# ----------------------------------------------------------------------------- numerics (interpret)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_generic_kernel_equals_reference(group, dtype):
    k = 2
    args = _case(n=k * group, k=k, dtype=dtype)
    got = jax.jit(lambda *a: kernel.paged_attention(*a, interpret=True))(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    _close(got, ref.paged_attention_reference(*args), dtype)


@pytest.mark.parametrize("h", [48, 80])
def test_generic_kernel_takes_a_head_dim_in_power_of_two_parts(h):
    """H = 48 (32 + 16) or 80 (64 + 16): scores summed over the parts, the output written part by
    part (MLA's latent rows: 576 = 512 + 64, kept unpadded); one kv head for all the heads."""
    args = _case(n=8, k=1, h=h)
    assert [part.size for part in kernel.head_parts(h)] == {48: [32, 16], 80: [64, 16]}[h]
    got = jax.jit(lambda *a: kernel.paged_attention(*a, interpret=True))(*args)
    _close(got, ref.paged_attention_reference(*args), jnp.float32)


@pytest.mark.parametrize(
    "group,dtype,h",
    [
        (1, jnp.float32, 128),
        (4, jnp.float32, 128),
        (2, jnp.bfloat16, 128),
        (2, jnp.float32, 32),
        (2, jnp.float32, 192),  # past a multiple of the 128 lanes (platforms.lanes cuts the statistics)
    ],
)
def test_tpu_variant_in_interpret_mode_equals_reference(group, dtype, h):
    """kernel_tpu.py's grid (B, K, max_pages), scalar-prefetched page table and index maps, run
    by the Pallas interpreter (its Mosaic compile is tested below; nothing runs on a TPU here).
    H = 32: the all-kv-heads-per-program layout (lane blocks of K * H)."""
    args = _case(b=4, n=2 * group, k=2, h=h, page_size=16, max_pages=3, dtype=dtype)
    got = kernel.paged_attention(*args, backend="tpu", interpret=True)
    assert got.shape == args[0].shape and got.dtype == dtype
    _close(got, ref.paged_attention_reference(*args), dtype)


def test_scale_mqa_and_the_default_platform_choice():
    """interpret=None: lax.platform_dependent traces the Mosaic branch too (H = 64, K = 2 takes
    its all-heads layout) and runs the interpreted generic one on CPU."""
    args = _case(b=3, n=4, k=1, h=16, page_size=4, max_pages=5)
    _close(kernel.paged_attention(*args, scale=0.3), ref.paged_attention_reference(*args, scale=0.3), jnp.float32)
    args = _case(b=3, n=4, k=2, h=64, page_size=4, max_pages=3)
    _close(jax.jit(kernel.paged_attention)(*args), ref.paged_attention_reference(*args), jnp.float32)


@pytest.mark.parametrize("backend", ["generic", "tpu"])
def test_pages_past_the_length_are_never_read(backend):
    """Table entries past a sequence's ceil(length / page_size) pages may hold anything: pointing
    them at a page full of NaN (no sequence's live page) leaves the output unchanged."""
    q, kp, vp, table, lengths = _case(b=4, h=128, page_size=16, max_pages=4, spare=1)
    used = np.arange(4)[None, :] < -(-np.asarray(lengths) // 16)[:, None]
    live = set(np.asarray(table)[used].ravel())
    dead = next(p for p in range(kp.shape[0]) if p not in live)
    poisoned = jnp.asarray(np.where(used, np.asarray(table), dead).astype(np.int32))
    kp_nan, vp_nan = kp.at[dead].set(jnp.nan), vp.at[dead].set(jnp.nan)
    run = lambda t, k_, v_: kernel.paged_attention(q, k_, v_, t, lengths, backend=backend, interpret=True)
    want = run(table, kp, vp)
    got = run(poisoned, kp_nan, vp_nan)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_equals_contiguous_attention(dtype):
    """The paged reference over a shuffled pool == attention over the same tokens written into a
    contiguous [B, S, K, H] cache (independently of gather_pages: token t of sequence b written from
    page table[b, t // page_size], slot t % page_size)."""
    q, kp, vp, table, lengths = _case(dtype=dtype)
    b, max_pages = table.shape
    page_size = kp.shape[1]
    s = max_pages * page_size
    t = np.arange(s)
    kc = np.zeros((b, s) + kp.shape[2:], np.float32)
    vc = np.zeros_like(kc)
    for i in range(b):
        pages, slots = np.asarray(table)[i, t // page_size], t % page_size
        kc[i], vc[i] = np.asarray(kp, np.float32)[pages, slots], np.asarray(vp, np.float32)[pages, slots]
    kc, vc = jnp.asarray(kc, dtype), jnp.asarray(vc, dtype)
    want = ref.contiguous_attention(q, kc, vc, lengths)
    np.testing.assert_array_equal(
        np.asarray(ref.paged_attention_reference(q, kp, vp, table, lengths), np.float32), np.asarray(want, np.float32)
    )
    # and contiguous_attention itself against a per-sequence softmax in numpy (fp64)
    n, h, k = q.shape[1], q.shape[2], kp.shape[2]
    for i in range(b):
        L = int(lengths[i])
        qi = np.asarray(q[i], np.float64).reshape(k, n // k, h)
        ki, vi = np.asarray(kc[i, :L], np.float64), np.asarray(vc[i, :L], np.float64)
        sc = np.einsum("kgh,skh->kgs", qi, ki) * h**-0.5
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        oi = np.einsum("kgs,skh->kgh", p, vi).reshape(n, h)
        _close(want[i], oi, dtype)


def test_bad_input_is_named():
    q, kp, vp, table, lengths = _case(b=2, n=4, k=2, page_size=8, max_pages=2)
    pa = lambda *a: kernel.paged_attention(*a, interpret=True)
    with pytest.raises(ValueError, match="multiple of the number of kv heads"):
        pa(q[:, :3], kp, vp, table, lengths)
    with pytest.raises(ValueError, match=r"page_table must have shape \[B, max_pages\]"):
        pa(q, kp, vp, table[0], lengths)
    with pytest.raises(ValueError, match=r"page_table must have shape \[B, max_pages\]"):
        pa(q, kp, vp, table[:1], lengths)
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\]"):
        pa(q, kp, vp, table, lengths[:1])
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, max_pages \* page_size\] = \[1, 16\]"):
        pa(q, kp, vp, table, jnp.asarray([3, 17], jnp.int32))
    with pytest.raises(ValueError, match=r"lengths must lie in"):
        pa(q, kp, vp, table, jnp.asarray([0, 5], jnp.int32))
    with pytest.raises(ValueError, match="head dims differ"):
        pa(q[..., :16], kp, vp, table, lengths)
    with pytest.raises(ValueError, match="same shape"):
        pa(q, kp, vp[:-1], table, lengths)
    with pytest.raises(ValueError, match="must be integer"):
        pa(q, kp, vp, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="backend must be"):
        kernel.paged_attention(q, kp, vp, table, lengths, backend="cuda")
    # compiled variants' shape rules, named when traced (before any compiler sees them)
    odd = _case(b=2, n=2, k=1, h=32, page_size=6, max_pages=2)
    with pytest.raises(ValueError, match="powers of two"):
        jax.jit(lambda *a: kernel.paged_attention(*a, backend="generic", interpret=False)).trace(*odd)


# ----------------------------------------------------------------------------- TPU compiler (ahead of time)


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "n,k,page_size,h",
    [(8, 2, 16, 128), (32, 8, 64, 128), (8, 1, 16, 64), (8, 2, 128, 256), (16, 4, 32, 64), (16, 1, 16, 576)],
)
def test_tpu_variant_compiles_for_v5p_with_mosaic(n, k, page_size, h, dtype):
    """interpret=False lowered for a v5p slice inside a shard_map (sequences split over "data",
    the pool replicated): Mosaic accepts the scalar-prefetch grid and the compiled program holds
    its custom call. Nothing runs: there is no TPU here."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsys.kernels.tpu_compile_grid import tpu_mesh

    mesh = tpu_mesh("v5p:2x2x1")
    b, max_pages, num_pages = 8 * mesh.size, 8, 128
    arg = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    args = (
        arg((b, n, h), dtype, P("data")),
        arg((num_pages, page_size, k, h), dtype),
        arg((num_pages, page_size, k, h), dtype),
        arg((b, max_pages), jnp.int32, P("data")),
        arg((b,), jnp.int32, P("data")),
    )
    f = jax.jit(
        jax.shard_map(
            lambda *a: kernel.paged_attention(*a, interpret=False),
            mesh=mesh,
            in_specs=(P("data"), P(), P(), P("data"), P("data")),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    assert "tpu_custom_call" in f.lower(*args).compile().as_text()


# ----------------------------------------------------------------------------- GPU (Triton), ahead of time


def _gpu_args(dtype, n, k, b=4, h=128, page_size=16, max_pages=8, num_pages=64):
    S = jax.ShapeDtypeStruct
    return (
        S((b, n, h), dtype),
        S((num_pages, page_size, k, h), dtype),
        S((num_pages, page_size, k, h), dtype),
        S((b, max_pages), jnp.int32),
        S((b,), jnp.int32),
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n,k", [(8, 2), (8, 8), (12, 4)])
def test_lowers_through_triton_for_a_gpu_ahead_of_time(n, k, dtype):
    """The generic variant, interpret=False, lowered for an abstract H100 (platform "cuda"):
    Pallas's Triton lowering accepts it (G = 3 is padded to 4), and the Mosaic branch is not lowered."""
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    fn = lambda *a: kernel.paged_attention(*a, interpret=False)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        text = jax.jit(fn).trace(*_gpu_args(dtype, n, k)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tpu_custom_call" not in text


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin (.[gpu-aot])")
def test_compiles_to_sass_for_an_h100_deviceless():
    """Deviceless XLA:GPU compile (docs/gpu_aot_findings.md): Triton's passes and ptxas run for
    sm_90a. Nothing runs: numerics on a GPU are unchecked."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    fn = lambda *a: kernel.paged_attention(*a, interpret=False)
    cases = [
        _gpu_args(jnp.bfloat16, 8, 2),
        _gpu_args(jnp.float32, 8, 2),
        # B, K, max_pages and the pool size need not be powers of two (whole-array refs)
        _gpu_args(jnp.bfloat16, 6, 3, b=3, h=64, max_pages=5, num_pages=100),
        # MLA's latent rows, 576 = 512 + 64 unpadded: loaded and multiplied in power-of-two parts
        _gpu_args(jnp.bfloat16, 16, 1, h=576),
    ]
    for case in cases:
        dtype = case[0].dtype
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())) for a in case]
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False))
        assert "__gpu$xla.gpu.triton" in f.lower(*args).compile().as_text(), dtype
