"""kernels/quantized_matmul/reference.py: the integer semantics against NumPy.

NumPy recomputes every quantizer and matmul independently (float64, int64). Scales may differ by
one ulp (XLA may turn max/qmax into a multiply by the reciprocal); given the scales, integer
results (codes, zero points, packed bytes, the W8A8 int32 accumulator) must be equal exactly. Float results differ from
the float64 recomputation only by fp32 rounding of the dot products: |err| <= K * 2^-23 *
sum_k |x_k w_k|-scale, taken as rtol 1e-5 + atol 1e-5 * max|y| for K <= 512.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.quantized_matmul import reference as ref

RNG = np.random.default_rng(0)


def _w(k=256, n=96):
    w = RNG.standard_normal((k, n)).astype(np.float32) * 0.05
    w[:, 3] = 0.0  # a zero channel: scale 1, codes 0
    return w


def _np_round(a):
    return np.round(a)  # NumPy rounds half to even, as jnp.round does


def test_w8_codes_and_scales_equal_numpy_and_error_is_half_a_step():
    w = _w()
    q, s = ref.quantize_w8(jnp.asarray(w))
    absmax = np.abs(w).max(axis=0)
    s_np = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    np.testing.assert_allclose(np.asarray(s), s_np, rtol=2.0**-23)  # XLA may divide by reciprocal
    s_np = np.asarray(s)  # the codes must then be exact given the scales
    q_np = np.clip(_np_round(w / s_np), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(q), q_np)
    assert q.dtype == jnp.int8
    assert np.all(np.abs(q_np.astype(np.float32) * s_np - w) <= s_np / 2 + 1e-7)
    assert np.all(np.asarray(q)[:, 3] == 0) and float(s[3]) == 1.0


def test_w8a16_matmul_equals_numpy():
    w = _w()
    x = RNG.standard_normal((5, w.shape[0])).astype(np.float32)
    q, s = ref.quantize_w8(jnp.asarray(w))
    y = ref.matmul_w8a16(jnp.asarray(x), q, s)
    want = (x.astype(np.float64) @ np.asarray(q).astype(np.float64)) * np.asarray(s, np.float64)
    assert y.shape == (5, w.shape[1])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert ref.matmul_w8a16(jnp.asarray(x, jnp.bfloat16), q, s).dtype == jnp.bfloat16


@pytest.mark.parametrize("group_size", ref.GROUP_SIZES)
@pytest.mark.parametrize("zero_point", [False, True])
def test_w4_codes_pack_and_dequantize_equal_numpy(group_size, zero_point):
    w = _w()
    k, n = w.shape
    q, s, z = ref.quantize_w4(jnp.asarray(w), group_size, zero_point)
    g = w.reshape(k // group_size, group_size, n).astype(np.float32)
    if zero_point:
        lo, hi = g.min(axis=1), g.max(axis=1)
        s_np = np.where(hi - lo > 0, (hi - lo) / np.float32(15.0), 1.0).astype(np.float32)
        np.testing.assert_allclose(np.asarray(s), s_np, rtol=2.0**-23)
        s_np = np.asarray(s)  # codes exact given the scales
        z_np = np.clip(_np_round(-lo / s_np), 0, 15)
        q_np = np.clip(_np_round(g / s_np[:, None]) + z_np[:, None], 0, 15)
        lo_code, hi_code = 0, 15
        np.testing.assert_array_equal(np.asarray(z), z_np.astype(np.int8))
    else:
        absmax = np.abs(g).max(axis=1)
        s_np = np.where(absmax > 0, absmax / np.float32(7.0), 1.0).astype(np.float32)
        np.testing.assert_allclose(np.asarray(s), s_np, rtol=2.0**-23)
        s_np = np.asarray(s)
        z_np = np.zeros_like(s_np)
        q_np = np.clip(_np_round(g / s_np[:, None]), -8, 7)
        lo_code, hi_code = -8, 7
        assert z is None
    q_np = q_np.reshape(k, n).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(q), q_np)
    assert q_np.min() >= lo_code and q_np.max() <= hi_code

    packed = ref.pack_int4(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (k // 2, n)
    nib = q_np.astype(np.uint8) & 0xF
    np.testing.assert_array_equal(np.asarray(packed), nib[0::2] | (nib[1::2] << 4))
    np.testing.assert_array_equal(np.asarray(ref.unpack_int4(packed, signed=not zero_point)), q_np)

    deq = (q_np.reshape(k // group_size, group_size, n) - z_np[:, None]) * s_np[:, None]
    np.testing.assert_allclose(np.asarray(ref.dequantize_w4(packed, s, z)), deq.reshape(k, n), rtol=1e-6)
    # round to nearest: within half a step of w, except where the asymmetric zero point was clipped
    err = np.abs(deq.reshape(k, n) - w)
    step = np.repeat(s_np, group_size, axis=0)
    assert np.mean(err <= step / 2 + 1e-7) > 0.99

    x = RNG.standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ deq.reshape(k, n).astype(np.float64)
    y = ref.matmul_w4a16(jnp.asarray(x), packed, s, z)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("group_size", ref.GROUP_SIZES)
def test_repack_w4_round_trips_and_moves_each_nibble_to_its_kernel_position(group_size):
    """Kernel layout: in group g, byte row g*G/2 + r holds k = g*G + r (low nibble) and
    k = g*G + G/2 + r (high nibble). Checked nibble by nibble in NumPy, and unrepack inverts it."""
    k, n, half = 4 * group_size, 6, group_size // 2
    q = RNG.integers(-8, 8, (k, n)).astype(np.int8)
    q[0, 0], q[1, 0] = -8, 7  # both int4 edges
    packed = ref.pack_int4(jnp.asarray(q))
    repacked = np.asarray(ref.repack_w4(packed, group_size))
    assert repacked.shape == (k // 2, n) and repacked.dtype == np.uint8
    nib = q.astype(np.uint8) & 0xF
    for g in range(k // group_size):
        for r in range(half):
            row = repacked[g * half + r]
            np.testing.assert_array_equal(row & 0xF, nib[g * group_size + r])
            np.testing.assert_array_equal(row >> 4, nib[g * group_size + half + r])
    np.testing.assert_array_equal(np.asarray(ref.unrepack_w4(jnp.asarray(repacked), group_size)), np.asarray(packed))
    # a shard of whole groups along K (tensor parallelism) is the repacking of that shard
    shard = slice(group_size, 3 * group_size)
    np.testing.assert_array_equal(
        repacked[shard.start // 2 : shard.stop // 2],
        np.asarray(ref.repack_w4(ref.pack_int4(jnp.asarray(q[shard])), group_size)),
    )


def test_repack_w4_by_hand():
    """G = 32, one group, q[k] = k mod 16 (unsigned codes): the canonical bytes pair k = 2i, 2i+1
    (0x10, 0x32, ..., 0xFE, twice); the kernel layout pairs k = r and r + 16, equal codes, so
    byte r is 0x11 * r. Column 1: symmetric codes -8 at k = 0 and 7 at k = 16 (the rest 0) sit in
    kernel byte 0 as 0x78 (low nibble 0x8 = -8, high 0x7)."""
    q = np.zeros((32, 2), np.int8)
    q[:, 0] = np.arange(32) % 16
    q[0, 1], q[16, 1] = -8, 7
    packed = np.asarray(ref.pack_int4(jnp.asarray(q)))
    assert list(packed[:, 0]) == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    assert list(packed[:, 1]) == [0x08] + [0] * 7 + [0x07] + [0] * 7
    repacked = np.asarray(ref.repack_w4(jnp.asarray(packed), 32))
    assert list(repacked[:, 0]) == [0x11 * r for r in range(16)]
    assert list(repacked[:, 1]) == [0x78] + [0] * 15


def test_w8a8_accumulates_exactly_in_int32():
    x = RNG.standard_normal((7, 512)).astype(np.float32)
    w = _w(512, 64)
    xq, sx = ref.quantize_per_token(jnp.asarray(x))
    wq, sw = ref.quantize_w8(jnp.asarray(w))
    acc = np.asarray(xq).astype(np.int64) @ np.asarray(wq).astype(np.int64)
    y = ref.matmul_w8a8(xq, sx, wq, sw, out_dtype=jnp.float32)
    want = acc.astype(np.float32) * np.asarray(sx)[:, None] * np.asarray(sw)[None, :]
    np.testing.assert_array_equal(np.asarray(y), want)  # the int32 sum is exact; the scaling is fp32 in both
    # the extremes: K * 127 * 127 stays inside int32
    big = jnp.full((1, 512), 127, jnp.int8)
    assert int(jax.lax.dot(big, big.T, preferred_element_type=jnp.int32)[0, 0]) == 512 * 127 * 127


def test_bad_input_is_named():
    w = jnp.asarray(_w())
    with pytest.raises(ValueError, match="group_size=48: choose one of"):
        ref.quantize_w4(w, 48)
    with pytest.raises(ValueError, match="K=96 is not a multiple of group_size=64"):
        ref.quantize_w4(w[:96], 64)
    with pytest.raises(ValueError, match="even K"):
        ref.pack_int4(jnp.zeros((3, 4), jnp.int8))
    q, s = ref.quantize_w8(w)
    with pytest.raises(ValueError, match=r"x\[M, K\], int8 q\[K, N\]"):
        ref.matmul_w8a16(jnp.zeros((2, 100)), q, s)
    with pytest.raises(ValueError, match="int8 operands"):
        ref.matmul_w8a8(jnp.zeros((2, 256)), jnp.ones(2), q, s)
    with pytest.raises(ValueError, match="must be uint8"):
        ref.unpack_int4(jnp.zeros((2, 2), jnp.int8), signed=True)
    with pytest.raises(ValueError, match="K=96 is not a multiple of group_size=64"):
        ref.repack_w4(jnp.zeros((48, 4), jnp.uint8), 64)
    with pytest.raises(ValueError, match="group_size=16: choose one of"):
        ref.unrepack_w4(jnp.zeros((48, 4), jnp.uint8), 16)
    with pytest.raises(ValueError, match=r"uint8 packed\[K / 2, N\]"):
        ref.repack_w4(jnp.zeros((16, 4), jnp.int8), 32)
