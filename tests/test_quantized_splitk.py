"""Split-K and 16-bit scales of kernels/quantized_matmul/kernel.py (generic variant).

Interpret mode against reference.py and against the unsplit kernel (split_k=1), the chooser by
hand, and for an H100 ahead of time: the Triton IR's dots (int8 x int8 -> int32 for W8A8) and a
deviceless compile. Each interpreted call asserts the split it asked for really happened (the
partials' [splits, M, N] array in the jaxpr): equal results alone would not show it. Shapes stay
small (K <= 512, N <= 256). Tolerances as tests/test_quantized_kernel.py: fp32 to fp32 rounding
of a K-term sum, bf16 to two bf16 ulps.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.kernels.quantized_matmul import kernel
from jaxsys.kernels.quantized_matmul import reference as ref

RNG = np.random.default_rng(35)
K, N = 512, 97  # N odd: no tile divides it, the weights are padded to 128 columns


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _x(m, k=K, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal((m, k)) - 0.25, dtype)


def _w(k=K, n=N):
    return jnp.asarray(RNG.standard_normal((k, n)) * 0.05, jnp.float32)


def _partials(fn, *args):
    """The [splits, rows, cols] shapes of the split-K partials in fn's jaxpr ('f32[3,16,128]')."""
    return set(re.findall(r"(?:f32|i32)\[(\d+),(\d+),(\d+)\]", str(jax.make_jaxpr(fn)(*args))))


# ----------------------------------------------------------------------------- the chooser


def test_choose_split_k_by_hand():
    """Programs aimed at: 2 per SM (264 on 132 SMs); each split keeps >= 512 of K."""
    c = lambda m, k, n, k_step=128, cores=132, **kw: kernel.choose_split_k(
        m, k, n, **(dict(block_m=16, block_n=128) | kw), k_step=k_step, cores=cores
    )
    # Llama-7B qkv, M = 1: 32 programs want ceil(264 / 32) = 9 splits; 32 K steps allow 32 / 4 = 8
    assert c(1, 4096, 4096) == 8
    # gate/up: 86 programs want ceil(264 / 86) = 4; down (K = 11008, 86 groups of 128): 32 programs
    # want 9 -> 10 groups per split, 9 splits (8 x 10 + 6)
    assert c(1, 4096, 11008) == 4 and c(16, 11008, 4096) == 9
    # Llama-70B: 64 programs want 5 (64 groups -> 13 per split, 5 splits); 224 programs want 2
    assert c(1, 8192, 8192) == 5 and c(1, 8192, 28672) == 2
    # W4A16 at G = 32 steps a group of 32: 512 of K is 16 steps, 4096 / 512 = 8 splits at most
    assert c(1, 4096, 4096, k_step=32) == 8
    # rows count: M = 64 in 16-row tiles is 4 x 32 programs -> 3 splits (ceil(264 / 128));
    # in one 64-row tile it is 32 programs, as M = 1
    assert c(64, 4096, 4096) == 3 and c(64, 4096, 4096, block_m=64) == 8
    # partial traffic: S splits of [64, N] fp32 written and read (512 S bytes per column) within the
    # weights' 4096 * 4 / 8 = 2048 bytes per column: S <= 4 for 4-bit weights (8 for int8, above)
    assert c(64, 4096, 4096, block_m=64, weight_bits=4) == 4 and c(1, 4096, 4096, weight_bits=4) == 8
    assert c(64, 4096, 4096, block_m=64, max_partial_ratio=0.25) == 2
    assert c(65, 4096, 4096) == 1  # above SPLIT_K_MAX_M: the row tiles fill the GPU
    assert c(1, 4096, 4096, cores=None) == 1 and c(1, 4096, 4096, cores=0) == 1  # CPU / TPU
    assert c(1, 4096, 65536) == 1  # 512 programs: enough already
    assert c(1, 768, 4096) == 1  # 768 / 512: one split's worth of K
    assert c(1, 4096, 4096, cores=16) == 1 and c(1, 4096, 4096, cores=40) == 3  # ceil(80 / 32)


def test_split_k_for_resolves_what_the_kernels_run():
    """The tiles first (N = 11008: block_n 128 divides it; N = 200: padded to 256), then the
    chooser or the explicit value, made even."""
    assert kernel.split_k_for(1, 4096, 4096, cores=132) == 8
    assert kernel.split_k_for(1, 11008, 4096, block_k=0, group_size=128, cores=132) == 9
    assert kernel.split_k_for(1, 4096, 11008, group_size=32, cores=132) == 4
    assert kernel.split_k_for(1, 4096, 4096, cores=None) == 1 and kernel.split_k_for(128, 4096, 4096, cores=132) == 1
    assert kernel.split_k_for(1, 1280, 200, split_k=6) == 5  # 10 K blocks: 5 splits of 2
    assert kernel.split_k_for(1, 256, 200, split_k=64) == 2  # at most one split per K block


def test_even_splits_leave_no_split_empty():
    assert kernel._even_splits(6, 10) == 5  # 2 + 2 + 2 + 2 + 2, not a sixth empty split
    assert kernel._even_splits(4, 10) == 4  # 3 + 3 + 3 + 1
    assert kernel._even_splits(20, 3) == 3 and kernel._even_splits(1, 7) == 1


def test_device_cores_from_the_abstract_mesh():
    """No GPU here: None (no split by default); an abstract GPU's num_cores inside its mesh; an
    abstract TPU's cores are not SMs (None)."""
    assert kernel.device_cores() is None
    for platform, cores, want in (("gpu", 132, 132), ("gpu", None, None), ("tpu", 4, None)):
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=cores, platform=platform)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
            assert kernel.device_cores() == want, platform


def test_split_k_argument_is_checked():
    x, w = _x(2, 256), _w(256, 128)
    q, s = ref.quantize_w8(w)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="split_k must be"):
            kernel.matmul_w8a16(x, q, s, split_k=bad, interpret=True)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16 scales"):
        kernel.matmul_w8a16(x, q, s.astype(jnp.int32), interpret=True)
    q4, s4, _ = ref.quantize_w4(w, 64)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16 scales"):
        kernel.matmul_w4a16(x, ref.repack_w4(ref.pack_int4(q4), 64), s4.astype(jnp.int8), interpret=True)


def test_auto_split_k_is_off_on_the_cpu():
    """split_k=None on this CPU host (no SM count): the unsplit kernel, no partials."""
    x, w = _x(1, 256), _w(256, 128)
    q, s = ref.quantize_w8(w)
    assert _partials(lambda x: kernel.matmul_w8a16(x, q, s, block_k=32, interpret=True), x) == set()


# ----------------------------------------------------------------------------- interpret mode vs reference


@pytest.mark.parametrize("m,dtype", [(1, jnp.float32), (7, jnp.bfloat16), (16, jnp.float32), (64, jnp.bfloat16)])
def test_w8a16_split_k_equals_reference_and_unsplit(m, dtype):
    """K = 512 in 8 steps of 64, 3 splits of 3 + 3 + 2 steps (uneven: a dynamic trip count)."""
    x, w = _x(m, dtype=dtype), _w()
    q, s = ref.quantize_w8(w)
    call = lambda split_k: (
        lambda x: kernel.matmul_w8a16(x, q, s, block_m=64, block_k=64, split_k=split_k, interpret=True)
    )
    rows = 64 if m > 16 else 16  # block_m 64 shrinks to M's next power of two, at least 16
    assert ("3", str(rows), "128") in _partials(call(3), x)
    got = call(3)(x)
    assert got.shape == (m, N) and got.dtype == dtype
    _close(got, ref.matmul_w8a16(x, q, s), dtype)
    _close(got, call(1)(x), dtype)


@pytest.mark.parametrize(
    "m,group_size,zero_point,split_k,splits",
    [
        (1, 32, False, 3, 3),  # 16 groups: 6 + 6 + 4
        (7, 32, True, 4, 4),  # 4 groups each
        (16, 128, False, 4, 4),  # one group each
        (64, 128, True, 3, 2),  # 4 groups in 3 -> 2 + 2: no empty split
    ],
)
def test_w4a16_split_k_equals_reference_and_unsplit(m, group_size, zero_point, split_k, splits):
    """Splits of whole groups, codes at both ends of their range, bf16 activations."""
    x, w = _x(m, dtype=jnp.bfloat16), _w()
    q, s, z = ref.quantize_w4(w, group_size, zero_point)
    packed = ref.pack_int4(q)
    kp = ref.repack_w4(packed, group_size)
    call = lambda sk: lambda x: kernel.matmul_w4a16(x, kp, s, z, block_m=64, split_k=sk, interpret=True)
    assert {p[0] for p in _partials(call(split_k), x)} == {str(splits)}
    got = call(split_k)(x)
    assert got.shape == (m, N) and got.dtype == jnp.bfloat16
    _close(got, ref.matmul_w4a16(x, packed, s, z), jnp.bfloat16)
    _close(got, call(1)(x), jnp.bfloat16)


def test_w4a16_split_k_fp32_activations():
    x, w = _x(5), _w()
    q, s, _ = ref.quantize_w4(w, 64)
    packed = ref.pack_int4(q)
    got = kernel.matmul_w4a16(x, ref.repack_w4(packed, 64), s, split_k=3, interpret=True)
    _close(got, ref.matmul_w4a16(x, packed, s), jnp.float32)


@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_w8a8_split_k_is_bitwise(m):
    """int32 partial sums add exactly: split or not, the reference's bits (3 uneven splits)."""
    x, w = _x(m), _w()
    xq, sx = ref.quantize_per_token(x)
    wq, sw = ref.quantize_w8(w)
    call = lambda sk, out=jnp.float32: (
        lambda xq: kernel.matmul_w8a8(xq, sx, wq, sw, out, block_m=64, block_k=64, split_k=sk, interpret=True)
    )
    assert {p[0] for p in _partials(call(3), xq)} == {"3"}
    want = np.asarray(ref.matmul_w8a8(xq, sx, wq, sw, jnp.float32))
    np.testing.assert_array_equal(np.asarray(call(3)(xq)), want)
    np.testing.assert_array_equal(np.asarray(call(1)(xq)), want)
    if m == 7:
        np.testing.assert_array_equal(
            np.asarray(call(3, jnp.bfloat16)(xq)), np.asarray(ref.matmul_w8a8(xq, sx, wq, sw, jnp.bfloat16))
        )


# ----------------------------------------------------------------------------- 16-bit scales


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_16_bit_scales(scale_dtype, split_k):
    """Scales in bf16 / fp16 reach the kernel as they are (half the bytes: the pallas_call's
    operand is 16-bit, no fp32 copy) and are applied in fp32: equal to the reference given the
    same 16-bit scales."""
    x, w = _x(7, 256, jnp.bfloat16), _w(256, 200)
    q4, s4, z4 = ref.quantize_w4(w, 32, zero_point=True)
    s4 = s4.astype(scale_dtype)
    packed = ref.pack_int4(q4)
    f = lambda x: kernel.matmul_w4a16(x, ref.repack_w4(packed, 32), s4, z4, split_k=split_k, interpret=True)
    jaxpr = str(jax.make_jaxpr(f)(x))
    short = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[scale_dtype]
    assert f"{short}[8,256]" in jaxpr  # the padded scales [K / G, 256] in their own dtype
    _close(f(x), ref.matmul_w4a16(x, packed, s4, z4), jnp.bfloat16)
    q8, s8 = ref.quantize_w8(w)
    s8 = s8.astype(scale_dtype)
    got = kernel.matmul_w8a16(x, q8, s8, block_k=64, split_k=split_k, interpret=True)
    _close(got, ref.matmul_w8a16(x, q8, s8), jnp.bfloat16)


# ----------------------------------------------------------------------------- GPU (Triton), ahead of time

S = jax.ShapeDtypeStruct


def _gpu_cases():
    """(name, fn, abstract args) at M = 1, split-K chosen automatically (K = 1024, N = 256: 2
    programs per split; 8 K steps of 128 or groups of 128 -> 2 splits, one of 32-groups -> 2)."""
    m, k, n = 1, 1024, 256
    return [
        (
            "w8a16_bf16_scales",
            lambda x, q, s: kernel.matmul_w8a16(x, q, s, interpret=False),
            (S((m, k), jnp.bfloat16), S((k, n), jnp.int8), S((n,), jnp.bfloat16)),
        ),
        (
            "w4a16_g32_zero_point_fp16_scales",
            lambda x, p, s, z: kernel.matmul_w4a16(x, p, s, z, interpret=False),
            (
                S((m, k), jnp.bfloat16),
                S((k // 2, n), jnp.uint8),
                S((k // 32, n), jnp.float16),
                S((k // 32, n), jnp.int8),
            ),
        ),
        (
            "w4a16_g128_uneven",  # 8 groups in 3 splits: 3 + 3 + 2, a dynamic trip count
            lambda x, p, s: kernel.matmul_w4a16(x, p, s, split_k=3, interpret=False),
            (S((m, k), jnp.bfloat16), S((k // 2, n), jnp.uint8), S((k // 128, n), jnp.float32)),
        ),
        (
            "w8a8",
            lambda x, sx, q, s: kernel.matmul_w8a8(x, sx, q, s, interpret=False),
            (S((m, k), jnp.int8), S((m,), jnp.float32), S((k, n), jnp.int8), S((n,), jnp.float32)),
        ),
        (
            "w4a8",
            lambda x, sx, p, s: kernel.matmul_w4ax(x, sx, p, s, interpret=False),
            (S((m, k), jnp.int8), S((m,), jnp.float32), S((k // 2, n), jnp.uint8), S((k // 128, n), jnp.float32)),
        ),
        (
            "w4a4_g32",  # activation scales per token and group: a [16, 32] tile, one column per group
            lambda x, sx, p, s: kernel.matmul_w4ax(x, sx, p, s, interpret=False),
            (
                S((m, k), jnp.int8),
                S((m, k // 32), jnp.float32),
                S((k // 2, n), jnp.uint8),
                S((k // 32, n), jnp.float32),
            ),
        ),
    ]


INTEGER_DOTS = ("w8a8", "w4a8", "w4a4_g32")  # int8 x int8 -> int32 in the Triton IR


def _lower_for_an_h100(fn, args, cores=132):
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=cores, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _triton_modules(lowered) -> list[str]:
    """The Triton IR (TTIR) of each Pallas call: the bytecode in its custom call's backend_config."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call":
                        calls.append(o)
                    walk(o.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with ir.Context() as ctx:
            triton_dialect.register_dialect(ctx)
            out.append(str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)))
    return out


@pytest.mark.parametrize("name,fn,args", _gpu_cases(), ids=[c[0] for c in _gpu_cases()])
def test_split_k_lowers_to_triton_for_an_h100(name, fn, args):
    """Lowered for an abstract H100 with 132 SMs: split-K is chosen by itself at M = 1 (the
    Triton call returns [splits, 16, 256] partials), and each dot in the Triton IR is 16-bit
    float x 16-bit float -> fp32 (A16) or int8 x int8 -> int32 (W8A8, W4A8, W4A4)."""
    lowered = _lower_for_an_h100(fn, args)
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    splits = 3 if name.endswith("uneven") else 2
    partial = "i32" if name == "w8a8" else "f32"
    assert f"-> tensor<{splits}x16x256x{partial}>" in text
    dots = [line for module in _triton_modules(lowered) for line in module.splitlines() if "tt.dot" in line]
    assert dots
    for line in dots:
        operand_types = re.findall(r"tensor<\d+x\d+x(\w+)>", line)
        if name in INTEGER_DOTS:
            assert operand_types == ["i8", "i8", "i32"], line
        else:
            assert operand_types[:2] == ["bf16", "bf16"] and operand_types[2] == "f32", line
    # an abstract GPU without an SM count: the automatic choice does not split (split_k=3 does)
    unknown = _lower_for_an_h100(fn, args, cores=None).as_text()
    assert (f"-> tensor<3x16x256x{partial}>" in unknown) == name.endswith("uneven")


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason="needs jax-cuda13-plugin (.[gpu-aot])")
def test_split_k_compiles_to_sass_for_an_h100_deviceless():
    """Deviceless XLA:GPU compile of the split-K kernels (Triton's passes and ptxas for sm_90a):
    the devices' core_count (132) picks the split inside shard_map. Nothing runs."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(targets.devices(targets.parse("h100-1"))), ("x",))
    for name, fn, args in _gpu_cases():
        args = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, P())) for a in args]
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False))
        lowered = f.lower(*args)
        assert re.search(r"-> tensor<[23]x16x256x[fi]32>", lowered.as_text()), name
        assert "__gpu$xla.gpu.triton" in lowered.compile().as_text(), name


@pytest.mark.parametrize("fmt", ["w4a16", "w8a16", "w8a8"])
def test_model_decode_path_splits_k_on_an_h100(fmt):
    """jaxsys/models/quant.py's kernel call, lowered for an H100 (132 SMs) at a Llama-7B qkv shape:
    a decode step (M = 1) gets 8 splits (choose_split_k), a prefill-sized M = 128 none."""
    from jaxsys.models import quant

    k = n = 4096
    if fmt == "w4a16":
        w = {"packed": S((k // 2, n), jnp.uint8), "scale": S((k // 128, n), jnp.float32)}
    else:
        w = {"q": S((k, n), jnp.int8), "scale": S((n,), jnp.float32)}
    partial = "i32" if fmt == "w8a8" else "f32"
    for m, want in ((1, f"-> tensor<8x16x{n}x{partial}>"), (128, None)):
        text = _lower_for_an_h100(
            lambda x, w: quant._quantized_forward(x, w, fmt, "pallas"), (S((m, k), jnp.bfloat16), w)
        ).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        if want:
            assert want in text
        else:
            assert not re.search(r"-> tensor<\d+x\d+x\d+x[fi]32>", text)


# ----------------------------------------------------------------------------- bench.py --split-k


def test_bench_split_k_smoke(tmp_path, capsys):
    """bench.py --split-k --interpret-smoke: the side-by-side path end to end in interpret mode (as
    if on 132 SMs, so the automatic choice splits): both kernels timed, checked against the
    reference, the bf16 dot timed, the ratios filled in."""
    import json

    from jaxsys.kernels.quantized_matmul import bench

    out = tmp_path / "split.json"
    argv = ["--split-k", "--interpret-smoke", "--split-formats", "w4a16", "--extra-split-ks", "4", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["M"], r["format"], r["split_k"]) for r in rows] == [(1, "w4a16", 2), (5, "w4a16", 2)]
    for r in rows:
        assert "error" not in r
        assert r["us_auto"] > 0 and r["us_split1"] > 0 and r["bf16_us"] > 0
        assert r["speedup_auto"] == pytest.approx(r["bf16_us"] / r["us_auto"])
        assert 0.0 <= r["err_auto"] <= bench.TOLERANCE and 0.0 <= r["err_split1"] <= bench.TOLERANCE
        assert r["us_split4"] > 0 and 0.0 <= r["err_extra_max"] <= bench.TOLERANCE  # --extra-split-ks 4
    table = capsys.readouterr().out
    assert "| splits | auto µs | split_k=1 µs | bf16 µs | bf16/auto |" in table and "split_k=4 µs |" in table
    assert "| smoke | 1024 | 192 | 1 | w4a16 | 2 |" in table


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None,
    reason="needs the standalone triton package (pip install --target DIR triton; PYTHONPATH=DIR)",
)
def test_w8a8_sass_has_integer_mma_for_an_h100(tmp_path):
    """The Triton IR Pallas hands XLA, compiled by the standalone Triton for sm_90 (no GPU needed)
    and disassembled with its bundled nvdisasm: W8A8's dot, split or not, and W4A8's are the int8 tensor-core
    MMA (PTX mma.sync ... s32.s8.s8.s32, SASS IMMA), the A16 dot a bf16 one (HMMA ... BF16). XLA
    runs its own build of Triton on the same IR; this shows what that IR becomes, not XLA's binary."""
    import os
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget

    k, n = 1024, 256
    w8a8 = (S((1, k), jnp.int8), S((1,), jnp.float32), S((k, n), jnp.int8), S((n,), jnp.float32))
    cases = [
        ("w8a8_split", lambda *a: kernel.matmul_w8a8(*a, interpret=False), w8a8, "IMMA.16832.S8.S8"),
        ("w8a8_unsplit", lambda *a: kernel.matmul_w8a8(*a, split_k=1, interpret=False), w8a8, "IMMA.16832.S8.S8"),
        (
            "w4a16_split",
            lambda *a: kernel.matmul_w4a16(*a, interpret=False),
            (S((1, k), jnp.bfloat16), S((k // 2, n), jnp.uint8), S((k // 128, n), jnp.bfloat16)),
            "HMMA.16816.F32.BF16",
        ),
        (
            "w4a8_split",  # 4-bit codes unpacked to int8 in the tile, then the int8 MMA
            lambda *a: kernel.matmul_w4ax(*a, interpret=False),
            (S((1, k), jnp.int8), S((1,), jnp.float32), S((k // 2, n), jnp.uint8), S((k // 128, n), jnp.float32)),
            "IMMA.16832.S8.S8",
        ),
    ]
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    for name, fn, args, sass_op in cases:
        lowered = _lower_for_an_h100(fn, args)
        assert ("x16x256x" in lowered.as_text()) == (name != "w8a8_unsplit")
        (ttir,) = _triton_modules(lowered)
        path = tmp_path / f"{name}.ttir"
        path.write_text(ttir)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        ptx = compiled.asm["ptx"]
        if not name.startswith("w4a16"):
            assert re.search(r"mma\.sync\.aligned\.m16n8k32\.row\.col(\.satfinite)?\.s32\.s8\.s8\.s32", ptx), name
        (tmp_path / f"{name}.cubin").write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, str(tmp_path / f"{name}.cubin")], capture_output=True, text=True, check=True)
        assert sass_op in sass.stdout, name
        assert "IMMA" not in sass.stdout if name.startswith("w4a16") else "HMMA" not in sass.stdout, name
