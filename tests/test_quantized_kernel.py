"""kernels/quantized_matmul/kernel.py in interpret mode against reference.py.

The kernels sum the same products in another order (K blocks; W4A16 scales each group's partial
sum instead of each weight), so fp32 results agree to fp32 rounding of a K-term sum:
rtol 1e-5 + atol 1e-5 * max|y| (K <= 512). With bf16 activations both round the fp32 result to
bf16 at the end: they may differ by one bf16 ulp (2^-8 relative) where the fp32 sums straddle a
rounding boundary.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.quantized_matmul import kernel
from jaxsys.kernels.quantized_matmul import reference as ref

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
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_kernel_equals_reference(m, dtype):
    x, w = _xw(m, 256, 256, dtype)
    q, s = ref.quantize_w8(w)
    got = jax.jit(lambda x: kernel.matmul_w8a16(x, q, s, block_m=16, block_n=128, block_k=64, interpret=True))(x)
    assert got.shape == (m, 256) and got.dtype == dtype
    _close(got, ref.matmul_w8a16(x, q, s), dtype)


@pytest.mark.parametrize("group_size,zero_point", [(32, False), (64, True), (128, False), (128, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w4a16_kernel_equals_reference(group_size, zero_point, dtype):
    x, w = _xw(7, 256, 256, dtype)
    q, s, z = ref.quantize_w4(w, group_size, zero_point)
    packed = ref.pack_int4(q)
    got = kernel.matmul_w4a16(x, ref.repack_w4(packed, group_size), s, z, block_m=8, block_n=128, interpret=True)
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


class W8A8VariantsTest(chex.TestCase):
    """The kernel called as is and under jax.jit (chex.variants) gives the reference bit for bit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_w8a8_kernel_equals_reference_bitwise(self):
        x, w = _xw(5, 256, 128)
        xq, sx = ref.quantize_per_token(x)
        wq, sw = ref.quantize_w8(w)
        matmul = self.variant(lambda *a: kernel.matmul_w8a8(*a, jnp.float32, block_k=128, interpret=True))
        chex.assert_trees_all_equal(matmul(xq, sx, wq, sw), ref.matmul_w8a8(xq, sx, wq, sw, jnp.float32))


# ----------------------------------------------------------------------------- shapes that are not tiles


def test_tiles_divide_the_shape_or_pad_it():
    """Triton (generic): the largest power of two in [16, requested] dividing the dimension (8 for
    N narrower than one tile), else the weights are padded. Mosaic (tpu): multiples of 128 or the
    whole dimension (<= 512)."""
    t = lambda m, k, n, variant="generic", **kw: kernel.tiles(
        m, k, n, **(dict(block_m=16, block_n=128, block_k=128, dtypes=(jnp.bfloat16,)) | kw), variant=variant
    )
    g = t(1, 4096, 11008)
    assert (g.block_m, g.block_n, g.n_padded, g.block_k, g.k_padded) == (16, 128, 11008, 128, 4096)
    assert (t(5, 320, 192).block_n, t(5, 320, 192).block_k) == (64, 64)
    assert (t(5, 320, 200).block_n, t(5, 320, 200).n_padded) == (128, 256)  # 200 = 8 * 25: pad
    assert (t(5, 100, 24).block_n, t(5, 100, 24).n_padded, t(5, 100, 24).k_padded) == (8, 24, 128)
    assert (t(5, 64, 20).block_n, t(5, 64, 20).n_padded) == (32, 32)
    assert t(33, 64, 64, block_m=64).block_m == 64 and t(3, 64, 64, block_m=64).block_m == 16
    assert t(3, 64, 64, block_m=8).block_m == 16  # tl.dot's minimum
    tp = t(1, 4096, 11008, "tpu")
    assert (tp.block_m, tp.block_n, tp.n_padded, tp.block_k) == (16, 128, 11008, 128)
    assert (t(5, 320, 192, "tpu").block_n, t(5, 320, 192, "tpu").block_k) == (192, 320)
    assert (t(5, 320, 1000, "tpu").block_n, t(5, 320, 1000, "tpu").n_padded) == (128, 1024)
    assert t(5, 64, 64, "tpu", dtypes=(jnp.int8,), block_m=64).block_m == 32  # int8: 32-row tiles
    assert t(33, 64, 64, "tpu", dtypes=(jnp.float32,), block_m=4).block_m == 8


def _codes_with_edges(k, n, zero_point):
    """4-bit codes with both ends of the range present, scales and zero points (0 and 15 present)."""
    if zero_point:
        q = RNG.integers(0, 16, (k, n)).astype(np.int8)
        q[0, 0], q[1, 0] = 0, 15
    else:
        q = RNG.integers(-8, 8, (k, n)).astype(np.int8)
        q[0, 0], q[1, 0], q[2, 1], q[3, 1] = -8, 7, 7, -8
    return jnp.asarray(q)


@pytest.mark.parametrize("group_size", ref.GROUP_SIZES)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("m,n", [(1, 192), (5, 200), (33, 64)])
@pytest.mark.parametrize("backend", ["generic", "tpu"])
def test_w4a16_any_shape_int4_edges(group_size, zero_point, m, n, backend):
    """Codes at -8 / 7 (or 0 / 15 with zero points 0 and 15), negative activations, N that the
    default tile does not divide, M padded; both variants' tilings run in interpret mode."""
    k = 3 * group_size
    q = _codes_with_edges(k, n, zero_point)
    groups = k // group_size
    s = jnp.asarray(RNG.uniform(0.01, 0.1, (groups, n)), jnp.float32)
    z = None
    if zero_point:
        z_np = RNG.integers(0, 16, (groups, n)).astype(np.int8)
        z_np[0, 0], z_np[1, 0] = 0, 15
        z = jnp.asarray(z_np)
    x = jnp.asarray(RNG.standard_normal((m, k)) - 0.5, jnp.bfloat16)
    packed = ref.pack_int4(q)
    got = kernel.matmul_w4a16(x, ref.repack_w4(packed, group_size), s, z, interpret=True, backend=backend)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    _close(got, ref.matmul_w4a16(x, packed, s, z), jnp.bfloat16)


@pytest.mark.parametrize("m,k,n", [(1, 320, 192), (5, 320, 200), (33, 256, 192), (2, 100, 24)])
@pytest.mark.parametrize("backend", ["generic", "tpu"])
def test_w8_kernels_any_shape(m, k, n, backend):
    """K and N not multiples of 128, M not of block_m: W8A16 within rounding (fp32 and bf16), W8A8
    bit for bit (zero padding adds nothing to the int32 sum)."""
    x = jnp.asarray(RNG.standard_normal((m, k)) - 0.5, jnp.float32)
    w = jnp.asarray(RNG.standard_normal((k, n)) * 0.05, jnp.float32)
    q, s = ref.quantize_w8(w)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = kernel.matmul_w8a16(x.astype(dtype), q, s, interpret=True, backend=backend)
        assert got.shape == (m, n) and got.dtype == dtype
        _close(got, ref.matmul_w8a16(x.astype(dtype), q, s), dtype)
    xq, sx = ref.quantize_per_token(x)
    assert int(jnp.min(xq)) == -127 and int(jnp.min(q)) < 0
    got = kernel.matmul_w8a8(xq, sx, q, s, jnp.float32, interpret=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref.matmul_w8a8(xq, sx, q, s, jnp.float32)))


def test_kernels_name_bad_input():
    x, w = _xw(4, 256, 192)
    q, s = ref.quantize_w8(w)
    with pytest.raises(ValueError, match=r"int8 q\[K, N\]"):
        kernel.matmul_w8a16(x[:, :100], q, s, interpret=True)
    with pytest.raises(ValueError, match=r"int8 q\[K, N\]"):
        kernel.matmul_w8a16(x, q.astype(jnp.int32), s, interpret=True)
    with pytest.raises(ValueError, match="floating-point activations"):
        kernel.matmul_w8a16(x.astype(jnp.int8), q, s, interpret=True)
    with pytest.raises(ValueError, match="block_n must be a positive integer"):
        kernel.matmul_w8a16(x, q, s, block_n=0, interpret=True)
    q4, s4, _ = ref.quantize_w4(w, 64)
    p4 = ref.repack_w4(ref.pack_int4(q4), 64)
    with pytest.raises(ValueError, match="the packed weights K=256"):
        kernel.matmul_w4a16(x[:, :128], p4, s4, interpret=True)
    with pytest.raises(ValueError, match=r"uint8 packed\[K / 2, N\]"):
        kernel.matmul_w4a16(x, p4.astype(jnp.int8), s4, interpret=True)
    with pytest.raises(ValueError, match="do not match weights"):
        kernel.matmul_w4a16(x, p4, s4[:3], interpret=True)  # 256 / 3 groups
    with pytest.raises(ValueError, match="group size K / groups = 256"):
        kernel.matmul_w4a16(x, p4, s4[:1], interpret=True)
    with pytest.raises(ValueError, match="group size K / groups = 16"):
        kernel.matmul_w4a16(x, p4, jnp.ones((16, 192)), interpret=True)
    with pytest.raises(ValueError, match="int8 operands"):
        kernel.matmul_w8a8(x, jnp.ones(4), q, s, interpret=True)
    with pytest.raises(ValueError, match=r"xq\[M, K\], sx\[M\]"):
        kernel.matmul_w8a8(q[:4], jnp.ones(3), q, s, interpret=True)


# ----------------------------------------------------------------------------- TPU compiler (ahead of time)

from jaxsys.analysis import targets  # noqa: E402


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("target", ["v5p:2x2x1", "v6e:2x2"])
@pytest.mark.parametrize("case", ["w8a16", "w4a16_g32", "w4a16_g128_zero_point", "w4a16_g64_fp32", "w8a8", "w4a4_g32"])
def test_kernels_compile_for_a_tpu_slice_with_mosaic(case, target):
    """Each kernel, lowered with interpret=False for TPU devices, is accepted by Mosaic (K = N =
    1024, blocks 16 x 128) inside a shard_map over a v5p and a v6e slice, and the compiled program holds the
    Mosaic custom call. Nothing runs: there is no TPU here."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsys.kernels.tpu_compile_grid import tpu_mesh

    mesh = tpu_mesh(target)
    k = n = 1024
    dtype = jnp.float32 if case.endswith("fp32") else jnp.bfloat16
    arg = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
    x = arg((32 * mesh.size, k), dtype, P("data"))
    if case == "w4a4_g32":  # W4Ax with activation scales per token and group (the W4A8 tile is W8A8's)
        args = (
            arg((32 * mesh.size, k), jnp.int8, P("data")),
            arg((32 * mesh.size, k // 32), jnp.float32, P("data")),
            arg((k // 2, n), jnp.uint8),
            arg((k // 32, n), jnp.float32),
        )
        local = lambda x, sx, p, s: kernel.matmul_w4ax(x, sx, p, s, block_m=32, interpret=False)
    elif case == "w8a8":
        args = (
            arg((32 * mesh.size, k), jnp.int8, P("data")),
            arg((32 * mesh.size,), jnp.float32, P("data")),
            arg((k, n), jnp.int8),
            arg((n,), jnp.float32),
        )
        local = lambda x, sx, q, s: kernel.matmul_w8a8(x, sx, q, s, block_m=32, interpret=False)
    elif case == "w8a16":
        args = (x, arg((k, n), jnp.int8), arg((n,), jnp.float32))
        local = lambda x, q, s: kernel.matmul_w8a16(x, q, s, block_m=16, block_n=128, block_k=128, interpret=False)
    else:
        g = int(case.split("_g")[1].split("_")[0])
        args = (x, arg((k // 2, n), jnp.uint8), arg((k // g, n), jnp.float32))  # kernel layout
        if "zero_point" in case:
            args += (arg((k // g, n), jnp.int8),)
        local = lambda x, p, s, *z: kernel.matmul_w4a16(x, p, s, *z, block_m=16, block_n=128, interpret=False)
    data_args = 2 if case in ("w8a8", "w4a4_g32") else 1
    f = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("data"),) * data_args + (P(),) * (len(args) - data_args),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    assert "tpu_custom_call" in f.lower(*args).compile().as_text()


@pytest.mark.skipif(not targets.has_libtpu(), reason="needs libtpu (bash scripts/bootstrap --test)")
@pytest.mark.parametrize("case", ["w8a16", "w4a16_g32_zero_point", "w4a16_g64", "w8a8"])
def test_kernels_compile_for_a_tpu_with_ragged_shapes(case):
    """K = 320 and N = 200 / 1000 (not multiples of 128), M = 5: the tpu variant's tiles (whole
    dimensions up to 512, else multiples of 128 and padding) are accepted by Mosaic."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsys.kernels.tpu_compile_grid import tpu_mesh

    mesh = tpu_mesh("v5p:2x2x1")
    m, k = 5, 320
    n = 1000 if case == "w4a16_g64" else 200
    arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    if case == "w8a8":
        args = (arg((m, k), jnp.int8), arg((m,), jnp.float32), arg((k, n), jnp.int8), arg((n,), jnp.float32))
        f = lambda x, sx, q, s: kernel.matmul_w8a8(x, sx, q, s, interpret=False)
    elif case == "w8a16":
        args = (arg((m, k), jnp.bfloat16), arg((k, n), jnp.int8), arg((n,), jnp.float32))
        f = lambda x, q, s: kernel.matmul_w8a16(x, q, s, interpret=False)
    else:
        g = int(case.split("_g")[1].split("_")[0])
        args = (arg((m, k), jnp.bfloat16), arg((k // 2, n), jnp.uint8), arg((k // g, n), jnp.float32))
        if "zero_point" in case:
            args += (arg((k // g, n), jnp.int8),)
        f = lambda x, p, s, *z: kernel.matmul_w4a16(x, p, s, *z, interpret=False)
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False))
    assert "tpu_custom_call" in sharded.lower(*args).compile().as_text()


# ----------------------------------------------------------------------------- GPU (Triton), ahead of time


def _gpu_cases(m=5):
    """(name, fn, abstract args) for each kernel at shapes that exercise padding and odd tiles."""
    S = jax.ShapeDtypeStruct
    k4, n4 = 8192, 200  # W4A16: 256 groups of 32 in one loop body; N padded to 256
    return [
        (
            "w8a16",
            lambda x, q, s: kernel.matmul_w8a16(x, q, s, interpret=False),
            (S((m, 320), jnp.bfloat16), S((320, 192), jnp.int8), S((192,), jnp.float32)),
        ),
        (
            "w4a16",
            lambda x, p, s, z: kernel.matmul_w4a16(x, p, s, z, interpret=False),
            (
                S((m, k4), jnp.bfloat16),
                S((k4 // 2, n4), jnp.uint8),
                S((k4 // 32, n4), jnp.float32),
                S((k4 // 32, n4), jnp.int8),
            ),
        ),
        (
            "w4a16_fp32",
            lambda x, p, s: kernel.matmul_w4a16(x, p, s, interpret=False),
            (S((m, 1024), jnp.float32), S((512, 256), jnp.uint8), S((8, 256), jnp.float32)),
        ),
        (
            "w8a8",
            lambda x, sx, q, s: kernel.matmul_w8a8(x, sx, q, s, interpret=False),
            (S((m, 320), jnp.int8), S((m,), jnp.float32), S((320, 200), jnp.int8), S((200,), jnp.float32)),
        ),
    ]


@pytest.mark.parametrize("name,fn,args", _gpu_cases(), ids=[c[0] for c in _gpu_cases()])
def test_lowers_through_triton_for_a_gpu_ahead_of_time(name, fn, args):
    """No GPU here, but the Pallas -> Triton IR lowering runs in Python: lower each kernel with
    interpret=False for an abstract H100 (platform "cuda": the generic variant). Catches what
    Triton's Pallas lowering rejects; the Triton compile itself is the next test."""
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tpu_custom_call" not in text  # the Mosaic branch is not lowered for cuda


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin (.[gpu-aot])")
def test_compiles_to_sass_for_an_h100_deviceless():
    """Deviceless XLA:GPU compile (docs/gpu_aot_findings.md) of all kernels: Triton's own passes
    and ptxas run for sm_90a. Nothing runs: numerics on a GPU are unchecked."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    for name, fn, args in _gpu_cases():
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())) for a in args]
        # inside shard_map: Pallas reads the GPU model from the mesh's devices
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False))
        assert "__gpu$xla.gpu.triton" in f.lower(*args).compile().as_text(), name


# ----------------------------------------------------------------------------- bench.py


def test_bench_interpret_smoke_writes_checked_rows(tmp_path, capsys):
    """bench.py --interpret-smoke: one tiny shape per format through the timing path in interpret
    mode, results checked against the reference, JSON rows with the roofline fields."""
    from jaxsys.kernels.quantized_matmul import bench

    out = tmp_path / "smoke.json"
    assert bench.main(["--interpret-smoke", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["interpret_smoke"] and record["command"].endswith(f"--interpret-smoke --out {out}")
    assert {"date", "device", "hardware", "per_model"} <= set(record)
    rows = record["results"]
    assert {r["format"] for r in rows} == set(bench.FORMATS) and {r["M"] for r in rows} == {1, 5}
    assert not [r for r in rows if "error" in r]
    checked = [r for r in rows if "max_rel_err" in r]
    assert len(checked) == 2 * (len(bench.FORMATS)) and max(r["max_rel_err"] for r in checked) <= bench.TOLERANCE
    for r in rows:
        assert r["us"] > 0 and r["best"] and r["speedup_vs_bf16"] > 0 and "ideal_speedup" in r
    assert "| smoke | 256 | 192 | 5 | w4a16 | 64 |" in capsys.readouterr().out


def test_bench_bytes_and_ideal_by_hand():
    """Bytes moved and the roofline for a 4096 x 4096 layer on an H100 (3.35 TB/s, 989 TFLOP/s
    bf16, 1979 TOPS int8)."""
    from jaxsys.analysis import hardware
    from jaxsys.kernels.quantized_matmul import bench

    k = n = 4096
    assert bench.bytes_moved("bf16", 1, k, n)["total"] == 2 * k * n + 2 * k + 2 * n
    # W4A16, G = 128: half a byte per weight plus a 4-byte scale per 128: 0.53125 B per weight
    assert bench.bytes_moved("w4a16", 1, k, n)["weights"] == k * n * 0.53125
    assert bench.bytes_moved("w4a16", 1, k, n, zero_point=True)["weights"] == k * n * (0.5 + 5 / 128)
    assert bench.bytes_moved("w8a8", 4, k, n)["activations"] == 4 * k + 16
    h100 = hardware.PROFILES["h100"]
    ideal = lambda fmt, m: bench.ideal_seconds(fmt, m, k, n, h100)
    assert ideal("bf16", 1) == pytest.approx((2 * k * n + 2 * k + 2 * n) / 3.35e12)
    # 2 / 0.53125 = 3.76 for the weights alone; x and y (the same bytes in both) take off 0.1%
    assert ideal("bf16", 1) / ideal("w4a16", 1) == pytest.approx(2 / 0.53125, rel=2e-3)
    assert ideal("w4a16", 1024) == pytest.approx(2 * 1024 * k * n / 989e12)  # compute bound
    assert ideal("w8a8", 1024) == pytest.approx(2 * 1024 * k * n / 1979e12)
    # W4A8: W4A16's weight bytes, W8A8's activations, the int8 peak
    assert bench.bytes_moved("w4a8", 4, k, n)["weights"] == k * n * 0.53125
    assert bench.bytes_moved("w4a8", 4, k, n)["activations"] == 4 * k + 16
    assert ideal("w4a8", 1024) == pytest.approx(2 * 1024 * k * n / 1979e12)
