"""4-bit weights met by integer activations (W4A8, W4A4: COMET's formats) and the block-Hadamard
rotation (config.model.quant_rotate, QuaRot's incoherence on blocks of G).

References are independent: NumPy int64 group sums for the integer product (reference.py), the
reference for the kernel (interpret mode), a dense block-diagonal matrix for the rotation and
its Hessian, the float model for the quantized one. Tolerances: given the same codes and scales,
each group's sum is an exact integer, so the kernel and NumPy differ only by the fp32 sum over
K / G scaled groups (rtol 1e-5 + atol 1e-5 max|y|); the model bounds are in test_quantized_model.py's
terms (a 4-bit weight's rms error ~9% of its sigma at G = 32; 4-bit activations per group of 32
add about as much again: < 35% of the logits' spread).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.config import ConfigError
from jaxsys.kernels.quantized_matmul import kernel
from jaxsys.kernels.quantized_matmul import reference as ref
from jaxsys.models import quant
from jaxsys.quantization.params import quantize_params, rotated_hessian
from tests.helpers import program_for, small_config
from tests.test_quantized_model import MODEL, _eval_loss, _float_params, _logits

RNG = np.random.default_rng(7)


def _np_w4ax(xq, sx, q, sw, z, group_size):
    """NumPy: per-group int64 sums of the codes (minus zero points), scaled, summed in float64."""
    m, k = xq.shape
    qg = q.astype(np.int64).reshape(k // group_size, group_size, -1)
    if z is not None:
        qg = qg - z.astype(np.int64)[:, None]
    xg = xq.astype(np.int64).reshape(m, k // group_size, group_size)
    sums = np.einsum("mgk,gkn->mgn", xg, qg)  # exact
    scaled = sums * sw.astype(np.float64)[None]
    if sx.ndim == 2:
        return np.einsum("mgn,mg->mn", scaled, sx.astype(np.float64))
    return scaled.sum(1) * sx.astype(np.float64)[:, None]


def _operands(m, k, n, group_size, zero_point, act_bits):
    x = jnp.asarray(RNG.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((k, n)) * 0.05, jnp.float32)
    q, sw, z = ref.quantize_w4(w, group_size, zero_point)
    if act_bits == 8:
        xq, sx = ref.quantize_per_token(x)
    else:
        xq, sx = ref.quantize_per_token_group(x, group_size, act_bits)
    return x, w, xq, sx, q, ref.pack_int4(q), sw, z


@pytest.mark.parametrize("act_bits,zero_point", [(8, False), (4, False), (4, True)])
def test_w4ax_reference_equals_numpy_integer_group_sums(act_bits, zero_point):
    _, _, xq, sx, q, packed, sw, z = _operands(5, 256, 96, 64, zero_point, act_bits)
    got = ref.matmul_w4ax(xq, sx, packed, sw, z, jnp.float32)
    want = _np_w4ax(*(np.asarray(a) for a in (xq, sx, q, sw)), None if z is None else np.asarray(z), 64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_activation_codes_per_token_and_group_are_in_range_and_within_half_a_step():
    x = jnp.asarray(RNG.standard_normal((6, 128)) * np.linspace(0.1, 10, 128), jnp.float32)
    xq, sx = ref.quantize_per_token_group(x, 32, 4)
    chex.assert_shape(sx, (6, 4))
    chex.assert_type(xq, jnp.int8)
    codes = np.asarray(xq)
    assert codes.min() >= -8 and codes.max() <= 7 and codes.max() == 7  # the group's absmax maps to 7
    back = codes.reshape(6, 4, 32) * np.asarray(sx)[:, :, None]
    err = np.abs(back.reshape(6, 128) - np.asarray(x))
    assert np.all(err <= np.repeat(np.asarray(sx), 32, axis=1) / 2 * (1 + 1e-6))


def test_hadamard_rotation_is_orthonormal_its_own_inverse_and_keeps_the_product():
    h = ref.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    x, w = RNG.standard_normal((3, 256)).astype(np.float32), RNG.standard_normal((256, 8)).astype(np.float32)
    dense = np.kron(np.eye(4), h)  # block-diagonal, blocks of 64
    np.testing.assert_allclose(np.asarray(ref.rotate_groups(jnp.asarray(x), 64)), x @ dense, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ref.rotate_groups(jnp.asarray(w), 64, axis=0)), dense @ w, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ref.rotate_groups(ref.rotate_groups(jnp.asarray(x), 64), 64)), x, atol=1e-5)
    hess = RNG.standard_normal((256, 256))
    hess = hess @ hess.T
    np.testing.assert_allclose(rotated_hessian(hess, 64), dense.T @ hess @ dense, rtol=1e-9, atol=1e-9)


def test_rotation_spreads_an_outlier_channel_and_cuts_w4a4_error():
    """The QuaRot claim on one matmul: activations with a few channels 50x the rest (LLMs' outlier
    features) lose their group's small channels to a 4-bit scale set by the outlier (here 0.23 of
    the product's norm); the rotation spreads the group's energy evenly, so its error falls to the
    Gaussian 4-bit floor of W4A4 (0.14: ~12% from the activations, ~9% from the weights)."""
    m, k, n, g = 64, 512, 128, 128
    x = RNG.standard_normal((m, k)).astype(np.float32)
    x[:, [5, 200, 333]] *= 50.0
    w = (RNG.standard_normal((k, n)) * 0.05).astype(np.float32)
    exact = x @ w

    def error(rotate):
        xs, ws = jnp.asarray(x), jnp.asarray(w)
        if rotate:
            xs, ws = ref.rotate_groups(xs, g), ref.rotate_groups(ws, g, axis=0)
        q, sw, _ = ref.quantize_w4(ws, g)
        xq, sx = ref.quantize_per_token_group(xs, g, 4)
        y = np.asarray(ref.matmul_w4ax(xq, sx, ref.pack_int4(q), sw, None, jnp.float32))
        return np.linalg.norm(y - exact) / np.linalg.norm(exact)

    plain, rotated = error(False), error(True)
    assert rotated < 0.7 * plain and rotated < 0.16, (plain, rotated)


@pytest.mark.parametrize(
    "act_bits,zero_point,split_k,out_dtype",
    [(8, False, 1, jnp.float32), (8, True, 2, jnp.bfloat16), (4, False, 2, jnp.float32), (4, True, 1, jnp.float32)],
)
def test_w4ax_kernel_equals_reference(act_bits, zero_point, split_k, out_dtype):
    _, _, xq, sx, _, packed, sw, z = _operands(7, 256, 128, 64, zero_point, act_bits)
    got = kernel.matmul_w4ax(
        xq, sx, ref.repack_w4(packed, 64), sw, z, out_dtype, block_m=32, block_n=64, split_k=split_k, interpret=True
    )
    chex.assert_shape(got, (7, 128))
    chex.assert_type(got, out_dtype)
    want = np.asarray(ref.matmul_w4ax(xq, sx, packed, sw, z, out_dtype), np.float32)
    tol = 1e-5 if out_dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


def test_w4ax_bad_input_is_named():
    _, _, xq, sx, _, packed, sw, _ = _operands(4, 128, 64, 32, False, 8)
    with pytest.raises(ValueError, match="int8 activation codes"):
        ref.matmul_w4ax(xq.astype(jnp.int32), sx, packed, sw)
    with pytest.raises(ValueError, match=r"sx\(3,\) must be \[M\]"):
        kernel.matmul_w4ax(xq, sx[:3], packed, sw, interpret=True)
    with pytest.raises(ValueError, match="takes int8 xq"):
        kernel.matmul_w4ax(xq.astype(jnp.float32), sx, packed, sw, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        ref.hadamard(48)


# ----------------------------------------------------------------------------- the model


def _config(fmt, rotate, impl="reference", mesh=None, zero_point=False):
    return small_config(
        mesh,
        quant=fmt,
        quant_group_size=32,
        quant_zero_point=zero_point,
        quant_impl=impl,
        quant_rotate=rotate,
        **MODEL,
    )


@pytest.fixture(scope="module")
def model():
    c, params = _float_params()
    return c, jax.tree.map(np.asarray, params), _logits(c, params)


@pytest.mark.parametrize(
    "fmt,rotate,bound", [("w4a8", False, 0.25), ("w4a4", False, 0.35), ("w4a4", True, 0.35), ("w4a16", True, 0.25)]
)
def test_w4ax_and_rotated_models_are_within_the_formats_bound_of_the_float_model(model, fmt, rotate, bound):
    c, params, want = model
    cq = _config(fmt, rotate)
    qparams = quantize_params(params, cq.model, fmt, 32, rotate=rotate)
    got = _logits(cq, qparams)
    deviation = np.linalg.norm(got - want) / np.linalg.norm(want - want.mean())
    assert 0 < deviation < bound, deviation
    # the stored codes are of H W: undoing the rotation gives back the float weight to 4-bit error
    w = params["layers"]["w_up"][0]
    back = np.asarray(
        quant.dequantize_layer(
            jax.tree.map(lambda a: jnp.asarray(a[0]), qparams["layers"]["w_up"]), fmt, 1, quant.rotation(cq.model)
        )
    )
    assert np.linalg.norm(back - w) < 0.15 * np.linalg.norm(w)


def test_w4a4_kernels_in_the_rotated_model_equal_the_reference_and_tensor4_equals_one_device(model):
    """The Pallas path (interpret mode) against the reference path; and W4A4's per-group
    activation scales and the rotation's blocks never straddle a tensor shard, so tensor=4 gives
    one device's loss to fp32 rounding (W4A8's per-token scales would not: per shard)."""
    c, params, _ = model
    qparams = quantize_params(params, _config("w4a4", True).model, "w4a4", 32, True, rotate=True)
    pallas = _logits(_config("w4a4", True, "pallas", zero_point=True), qparams)
    reference = _logits(_config("w4a4", True, "reference", zero_point=True), qparams)
    np.testing.assert_allclose(pallas, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    one = _eval_loss(_config("w4a4", True, zero_point=True), qparams)
    tp4 = _eval_loss(_config("w4a4", True, mesh={"tensor": 4}, zero_point=True), qparams)
    assert tp4 == pytest.approx(one, rel=1e-6)


def test_bad_w4ax_configs_are_named():
    with pytest.raises(ConfigError, match="zero points are for the 4-bit formats"):
        program_for(small_config(quant="w8a8", quant_zero_point=True, **MODEL))
    with pytest.raises(ConfigError, match="quant_rotate=True with quant='none'"):
        program_for(small_config(quant_rotate=True, **MODEL))
    with pytest.raises(ConfigError, match="quant='w8a16' with quant_rotate and quant_group_size=64"):
        program_for(small_config(dict(tensor=4), quant="w8a16", quant_rotate=True, quant_group_size=64, **MODEL))


def test_w4a4_rotated_weights_serve_from_a_kivi4_cache(model):
    """COMET's whole setting: 4-bit weights, 4-bit activations and a 4-bit KV cache. The serving
    engine with kv_quant='kivi4' over the rotated W4A4 checkpoint gives, for every row it runs,
    the logits of transformer.forward with the same weights over a contiguous cache seen
    fake-quantized (test_kv_quant.py's independent statement of the KIVI cache), to fp32 rounding."""
    from jaxsys.cache import ContiguousCache, kivi
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from tests.test_kv_quant import PAGE, _record, _rows, _submit

    c, params, _ = model
    cq = _config("w4a4", True)
    program = program_for(cq)
    qparams = jax.device_put(quantize_params(params, cq.model, "w4a4", 32, rotate=True), program.param_shardings)
    eng = engine.Engine(
        program, qparams, num_pages=40, page_size=PAGE, token_budget=16, chunk_size=5, max_seqs=4, kv_quant="kivi4"
    )
    steps = _record(eng)
    _submit(eng)
    eng.run()
    seqs = _rows(steps, eng.scratch)
    assert len(seqs) == 3
    m, fake = cq.model, kivi.FakeQuant.of_mode("kivi4", PAGE, 0)

    @jax.jit
    def forward(p, ids):
        zeros = jnp.zeros((m.n_layers, 1, ids.shape[1], m.n_kv_heads, m.head_dim), jnp.dtype(m.compute_dtype))
        positions = jnp.arange(ids.shape[1])[None]
        return transformer.forward(
            p, ids, positions, m, program.layout, program.specs, ContiguousCache(zeros, zeros, None, fake)
        )[0]

    for rows in seqs.values():
        ids = np.asarray([[rows[p][0] for p in range(len(rows))]], np.int32)
        want = np.asarray(forward(qparams, ids))[0]
        got = np.stack([rows[p][1] for p in range(len(rows))])
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
