"""kernels/quantized_matmul/kernel.py in interpret mode against reference.py.

The kernels sum the same products in another order (K blocks; W4A16 scales each group's partial
sum instead of each weight), so fp32 results agree to fp32 rounding of a K-term sum:
rtol 1e-5 + atol 1e-5 * max|y| (K <= 512). With bf16 activations both round the fp32 result to
bf16 at the end: they may differ by one bf16 ulp (2^-8 relative) where the fp32 sums straddle a
rounding boundary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.quantized_matmul import kernel, reference as ref

RNG = np.random.default_rng(1)


def _xw(m, k, n, dtype=jnp.float32):
    x = jnp.asarray(RNG.standard_normal((m, k)), dtype)
    w = jnp.asarray(RNG.standard_normal((k, n)) * 0.05, jnp.float32)
    return x, w


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_kernel_equals_reference(m, dtype):
    x, w = _xw(m, 256, 256, dtype)
    q, s = ref.quantize_w8(w)
    got = jax.jit(lambda x: kernel.matmul_w8a16(x, q, s, block_m=16, block_n=128, block_k=64,
                                                interpret=True))(x)
    assert got.shape == (m, 256) and got.dtype == dtype
    _close(got, ref.matmul_w8a16(x, q, s), dtype)


@pytest.mark.parametrize("group_size,zero_point", [(32, False), (64, True), (128, False), (128, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w4a16_kernel_equals_reference(group_size, zero_point, dtype):
    x, w = _xw(7, 256, 256, dtype)
    q, s, z = ref.quantize_w4(w, group_size, zero_point)
    packed = ref.pack_int4(q)
    got = kernel.matmul_w4a16(x, packed, s, z, block_m=8, block_n=128, interpret=True)
    assert got.shape == (7, 256) and got.dtype == dtype
    _close(got, ref.matmul_w4a16(x, packed, s, z), dtype)


@pytest.mark.parametrize("m", [3, 64])
def test_w8a8_kernel_equals_reference_bitwise(m):
    """The int32 sum is exact in both, and both scale it by sx sw in fp32 in the same order."""
    x, w = _xw(m, 512, 256)
    xq, sx = ref.quantize_per_token(x)
    wq, sw = ref.quantize_w8(w)
    got = kernel.matmul_w8a8(xq, sx, wq, sw, jnp.float32, block_k=128, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref.matmul_w8a8(xq, sx, wq, sw, jnp.float32)))


def test_kernels_name_bad_blocks_and_shapes():
    x, w = _xw(4, 256, 192)
    q, s = ref.quantize_w8(w)
    with pytest.raises(ValueError, match="N=192 is not a multiple of block_n=128"):
        kernel.matmul_w8a16(x, q, s, block_n=128, interpret=True)
    with pytest.raises(ValueError, match=r"int8 q\[K, N\]"):
        kernel.matmul_w8a16(x[:, :100], q, s, interpret=True)
    q4, s4, _ = ref.quantize_w4(w, 64)
    with pytest.raises(ValueError, match="the packed weights K=256"):
        kernel.matmul_w4a16(x[:, :128], ref.pack_int4(q4), s4, interpret=True)
    with pytest.raises(ValueError, match="int8 operands"):
        kernel.matmul_w8a8(x, jnp.ones(4), q, s, interpret=True)
    with pytest.raises(ValueError, match="group size K / groups = 256"):
        kernel.matmul_w4a16(x, ref.pack_int4(q4), s4[:1], interpret=True)


# ----------------------------------------------------------------------------- TPU compiler (ahead of time)

from jaxsys.analysis import targets  # noqa: E402


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("target", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("case", ["w8a16", "w4a16_g32", "w4a16_g128_zero_point", "w4a16_g64_fp32", "w8a8"])
def test_kernels_compile_for_a_tpu_slice_with_mosaic(case, target):
    """Each kernel, lowered with interpret=False for TPU devices, is accepted by Mosaic (K = N =
    1024, blocks 16 x 128) inside a shard_map over a v5p and a v6e slice, and the compiled program holds the
    Mosaic custom call. Nothing runs: there is no TPU here."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxsys.kernels.tpu_compile_grid import tpu_mesh
    mesh = tpu_mesh(target)
    k = n = 1024
    dtype = jnp.float32 if case.endswith("fp32") else jnp.bfloat16
    arg = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    x = arg((32 * mesh.size, k), dtype, P("data"))
    if case == "w8a8":
        args = (arg((32 * mesh.size, k), jnp.int8, P("data")), arg((32 * mesh.size,), jnp.float32, P("data")),
                arg((k, n), jnp.int8), arg((n,), jnp.float32))
        local = lambda x, sx, q, s: kernel.matmul_w8a8(x, sx, q, s, block_m=32, interpret=False)
    elif case == "w8a16":
        args = (x, arg((k, n), jnp.int8), arg((n,), jnp.float32))
        local = lambda x, q, s: kernel.matmul_w8a16(x, q, s, block_m=16, block_n=128, block_k=128,
                                                    interpret=False)
    else:
        g = int(case.split("_g")[1].split("_")[0])
        args = (x, arg((k // 2, n), jnp.uint8), arg((k // g, n), jnp.float32))
        if "zero_point" in case:
            args += (arg((k // g, n), jnp.int8),)
        local = lambda x, p, s, *z: kernel.matmul_w4a16(x, p, s, *z, block_m=16, block_n=128, interpret=False)
    data_args = 2 if case == "w8a8" else 1
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * data_args + (P(),) * (len(args) - data_args),
                              out_specs=P("data"), check_vma=False))
    assert "tpu_custom_call" in f.lower(*args).compile().as_text()
