"""FP8 training (config.model.quant_train='fp8', jaxsys/models/quant.py `fp8_matmul`):

- the quantizer (current per-tensor scale, round to nearest, saturation, round-trip error) against a
  NumPy statement of it on ml_dtypes' float8 arrays;
- fp8_matmul's product and both gradients against the NumPy statement of quantize-then-multiply
  (float64 sums of the same fp8 codes) and against the fp32 products within the formats' error bound;
- three AdamW steps of the test model follow float training, on one device and on
  data=2 x fsdp=2 x tensor=2 (which matches the one-device fp8 run), with a wrong-scale control;
- the train step compiled ahead of time for an H100 (XLA:GPU deviceless) multiplies fp8 operands.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxsys.analysis import targets
from jaxsys.models import quant
from tests.helpers import run, small_config

# format -> (NumPy dtype, max, mantissa bits, spacing of the subnormals)
FORMATS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 3, 2.0**-9),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 2, 2.0**-16),
}
JAX_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def _np_quantize(x, fmt, scale=None):
    """Independent statement: scale = amax / max (1 for an all-zero x), codes = x / scale saturated
    at +-max and rounded to the nearest float8 (ml_dtypes' cast: round to nearest even)."""
    dtype, fmax, _, _ = FORMATS[fmt]
    x = np.asarray(x, np.float32)
    if scale is None:
        amax = np.float32(np.abs(x).max())
        scale = amax / np.float32(fmax) if amax > 0 else np.float32(1.0)
    return np.clip(x / np.float32(scale), -fmax, fmax).astype(dtype), np.float32(scale)


def _error_bound(x, fmt, scale):
    """|q(x) * scale - x| <= 2^-(m+1) |x| (round to nearest, m mantissa bits) in the normal range,
    half a subnormal step (times the scale) below it."""
    _, _, m, sub = FORMATS[fmt]
    return 2.0 ** -(m + 1) * np.abs(x) + 0.5 * sub * scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizer_follows_the_numpy_statement(fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.uniform(-6, 3, (64, 96)))).astype(np.float32)
    q, s = jax.jit(lambda x: quant.fp8_quantize(x, JAX_DTYPES[fmt]))(x)
    want_q, want_s = _np_quantize(x, fmt)
    assert float(s) == pytest.approx(float(want_s), rel=1e-7)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))  # bit for bit
    back = np.asarray(q).astype(np.float64) * float(s)
    assert np.all(np.abs(back - x) <= _error_bound(x, fmt, float(s)))
    assert np.abs(back - x).max() > 0  # the cast is lossy: the bound above is not vacuous
    assert np.abs(np.asarray(q).astype(np.float32)).max() == FORMATS[fmt][1]  # amax maps onto max
    # all zero: scale 1, codes 0 (no 0/0)
    q0, s0 = quant.fp8_quantize(jnp.zeros((4, 4)), JAX_DTYPES[fmt])
    assert float(s0) == 1.0 and not np.any(np.asarray(q0).astype(np.float32))
    # a stale scale 16x too small saturates at +-max instead of overflowing (e4m3fn: NaN)
    q16, _ = quant.fp8_quantize(jnp.asarray(x), JAX_DTYPES[fmt], scale=want_s / 16)
    q16 = np.asarray(q16).astype(np.float32)
    assert np.all(np.isfinite(q16)) and np.abs(q16).max() == FORMATS[fmt][1]
    np.testing.assert_array_equal(q16, _np_quantize(x, fmt, want_s / 16)[0].astype(np.float32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantizer_agrees_with_flax_fp8_ops(fmt):
    """Flax's fp8 recipe (flax.linen.fp8_ops, Transformer Engine's): its scale from the same amax
    (with a fresh history, current scaling) and its quantize with our scale give our codes."""
    fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
    rng = np.random.default_rng(2)
    x = jnp.asarray((rng.standard_normal((32, 48)) * np.exp(rng.uniform(-4, 2, (32, 48)))).astype(np.float32))
    dtype = JAX_DTYPES[fmt]
    q, s = quant.fp8_quantize(x, dtype)
    fmax = jnp.asarray(FORMATS[fmt][1], jnp.float32)
    flax_s = fp8_ops.compute_scale(jnp.max(jnp.abs(x)), jnp.float32(1.0), fmax)
    assert float(flax_s) == pytest.approx(float(s), rel=1e-6)
    flax_q = fp8_ops.quantize(x, dtype, s, jnp.float32)
    np.testing.assert_array_equal(np.asarray(flax_q).view(np.uint8), np.asarray(q).view(np.uint8))


def test_fp8_matmul_agrees_with_qwix():
    """Qwix's quantized-training dot_general (`dot_general_qt`) set up as our recipe: per-tensor
    absmax e4m3 operands, e5m2 incoming gradients, the quantized forward operands reused in the
    backward. Qwix folds the residual's scale into dy before quantizing it, which moves no e5m2
    code of a per-tensor quantizer; so the forward and both gradients agree to fp32 rounding
    (rtol 1e-6 of the largest entry: measured 7e-8, 0, 2e-7), far below one e4m3 or e5m2 step."""
    pytest.importorskip("qwix")
    from qwix._src.core import dot_general_qt as qwix_qt

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((24, 64)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((64, 48)) * 0.1).astype(np.float32))
    dy = jnp.asarray((rng.standard_normal((24, 48)) * 1e-3).astype(np.float32))
    cfg = qwix_qt.DotGeneralQtConfig(  # the *_disable_channelwise_axes: one scale per tensor
        lhs_qtype=jnp.float8_e4m3fn,
        rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2,
        drhs_grad_qtype=jnp.float8_e5m2,
        lhs_disable_channelwise_axes=True,
        rhs_disable_channelwise_axes=True,
        dlhs_grad_disable_channelwise_axes=True,
        drhs_grad_disable_channelwise_axes=True,
    )
    qwix_matmul = lambda a, b: qwix_qt.dot_general_qt(a, b, (((1,), (0,)), ((), ())), cfg)
    want_y, want_vjp = jax.vjp(qwix_matmul, x, w)
    got_y, got_vjp = jax.vjp(quant.fp8_matmul, x, w)
    for got, want in zip((got_y, *got_vjp(dy)), (want_y, *want_vjp(dy))):
        want = np.asarray(want, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-6 * np.abs(want).max())


def _np_product(a, b, fa, fb):
    """NumPy quantize-then-multiply: codes of a and b (per-tensor scales), exact float64 sums."""
    qa, sa = _np_quantize(a, fa)
    qb, sb = _np_quantize(b, fb)
    return (qa.astype(np.float64) @ qb.astype(np.float64)) * float(sa) * float(sb)


def _product_bound(a, b, fa, fb):
    """|q(a) q(b) - a b| elementwise, from |q(a) - a| <= Ea (`_error_bound`) and the same for b:
    Ea |b| + (|a| + Ea) Eb, summed over k."""
    ea = _error_bound(a, fa, float(_np_quantize(a, fa)[1]))
    eb = _error_bound(b, fb, float(_np_quantize(b, fb)[1]))
    return ea @ np.abs(b) + (np.abs(a) + ea) @ eb


def test_fp8_matmul_and_its_gradients():
    """Forward e4m3 x e4m3, dx = e5m2(dy) e4m3(w)^T, dw = e4m3(x)^T e5m2(dy): equal to NumPy's
    quantize-then-multiply to fp32 summation (rtol 1e-5: K <= 48 fp32 additions of exact
    products), and within the formats' bound of the fp32 products (e4m3: 3 mantissa bits, a
    relative rounding of at most 2^-4 per operand; e5m2: 2 bits, 2^-3)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((24, 48)) * 1e-3).astype(np.float32)
    y, vjp = jax.vjp(quant.fp8_matmul, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    cases = [
        (y, (x, w, "e4m3", "e4m3"), x @ w),
        (dx, (dy, w.T, "e5m2", "e4m3"), dy @ w.T),
        (dw, (x.T, dy, "e4m3", "e5m2"), x.T @ dy),
    ]
    for got, (a, b, fa, fb), exact in cases:
        got = np.asarray(got, np.float64)
        want = _np_product(a, b, fa, fb)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        err = np.abs(got - exact)
        assert np.all(err <= _product_bound(a, b, fa, fb) * (1 + 1e-5) + 1e-6 * np.abs(exact).max())
        assert np.linalg.norm(err) / np.linalg.norm(exact) > 1e-3  # fp8 rounding is there: not fp32
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32  # fp32 master weights get fp32 grads


# ----------------------------------------------------------------------------- training

LAYOUT = {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.fixture(scope="module")
def runs():
    """Three AdamW steps of the test model: float, fp8 on one device, fp8 on LAYOUT."""
    return {
        "none": run(small_config(), 3),
        "fp8": run(small_config(quant_train="fp8"), 3),
        "fp8_sharded": run(small_config(LAYOUT, quant_train="fp8"), 3),
    }


def _grad_distance(a, b):
    return {
        n: np.linalg.norm(a["layers"][n] - b["layers"][n]) / np.linalg.norm(b["layers"][n])
        for n in quant.CONTRACTED
        if n in b["layers"]
    }


# fp8 against float over three AdamW steps. Losses: e4m3 rounds each forward operand by at most
# 2^-4 relative (~2% rms), which averages out over the logits: measured 9e-4, bound 2e-3. Step-0
# gradients of the dense weights: dominated by e5m2's rounding of dy (2 mantissa bits: up to 2^-3,
# ~4% rms per element) compounded through the two layers' backward: measured 5-9%, bound 12%.
LOSS_ATOL, GRAD_RTOL = 2e-3, 0.12


def test_fp8_training_follows_float_training(runs):
    l0, g0, losses0, _ = runs["none"]
    l1, g1, losses1, _ = runs["fp8"]
    np.testing.assert_allclose(losses1, losses0, atol=LOSS_ATOL)
    assert abs(l1 - l0) > 1e-6  # the fp8 path ran
    for name, d in _grad_distance(g1, g0).items():
        assert 0.01 < d < GRAD_RTOL, (name, d)


def test_fp8_on_a_sharded_layout_matches_one_device(runs):
    """Each scale comes from the amax of the whole tensor (the shards' absmaxes reduced over the
    mesh), so the sharded run quantizes the same values as one device: step-0 gradients to 1e-5
    (measured 2e-7: fp32 sums in another order), losses of three steps to 1e-4 (measured 3e-5: after
    an update a value can land on the other side of an fp8 rounding boundary). Per-shard scales
    (local amax) missed this by 0.1 in gradients and 2e-3 in loss."""
    l1, g1, losses1, _ = runs["fp8"]
    l2, g2, losses2, _ = runs["fp8_sharded"]
    assert abs(l2 - l1) < 1e-5
    np.testing.assert_allclose(losses2, losses1, atol=1e-4)
    for name, d in _grad_distance(g2, g1).items():
        assert d < 1e-5, (name, d)


FACTOR = 2.0**16


def test_a_wrong_scale_breaks_the_tolerance(runs, monkeypatch):
    """Negative control: the same fp8 run with every scale 2^16 too large (e4m3 codes then span a few
    subnormal steps; e5m2 keeps most of its range) leaves both tolerances above (measured: loss
    0.07, gradients 0.5-0.9). A factor of 2^12 stays inside them: the gradients' distance is
    e5m2's rounding of dy, not the forward's."""
    real = quant.fp8_scale
    monkeypatch.setattr(quant, "fp8_scale", lambda amax, dtype: real(amax, dtype) * FACTOR)
    _, g0, losses0, _ = runs["none"]
    _, g3, losses3, _ = run(small_config(quant_train="fp8"), 3)
    assert np.abs(losses3 - losses0).max() > LOSS_ATOL and max(_grad_distance(g3, g0).values()) > GRAD_RTOL


# ----------------------------------------------------------------------------- H100 (deviceless)


@pytest.mark.skipif(not targets.has_cuda_plugin(), reason=targets.GPU_INSTALL_HINT)
def test_the_train_step_compiled_for_an_h100_multiplies_fp8_operands():
    """XLA:GPU (sm90, deviceless) keeps the dot_generals on fp8 operands: every GEMM of a dense
    layer is a Triton GEMM fusion whose dot reads f8e4m3fn x f8e4m3fn (forward) or f8e5m2 with
    f8e4m3fn (the two gradients), none a cuBLAS custom call (deviceless: no autotuning)."""
    from tests.test_tpu_compile import compile_on_tpu

    devices = targets.devices(targets.parse("h100-8"))
    text = compile_on_tpu(small_config(quant_train="fp8"), devices).as_text()
    params = dict(re.findall(r"%(\S+) = (\w+)\[[^\]]*\]\{[^}]*\} parameter\(", text))
    operands = set()
    for lhs, rhs in re.findall(r"= f32\[[^\]]*\]\{[^}]*\} dot\(%([^,]+), %([^)]+)\)", text):
        operands.add((params.get(lhs), params.get(rhs)))
    assert ("f8e4m3fn", "f8e4m3fn") in operands  # forward
    assert ("f8e5m2", "f8e4m3fn") in operands and ("f8e4m3fn", "f8e5m2") in operands  # dx, dw
    assert '"kind":"__triton_nested_gemm_fusion"' in text or "__cublas$lt$matmul$f8" in text


def test_fp8_configs_that_cannot_combine_are_named():
    """fp8 is refused where int8 training is (a quantized checkpoint, LoRA's frozen base, a Flax
    model) and with DiLoCo, whose islands its amax reduction would join every matmul."""
    from jaxsys.config import ConfigError, validate

    validate(small_config(quant_train="fp8"))
    for key, value, match in [
        ("quant", "w8a16", "exclude each other"),
        ("quant_train", "fp16", r"choose one of \('none', 'int8', 'fp8'\)"),
    ]:
        c = small_config(quant_train="fp8")
        c.model[key] = value
        with pytest.raises(ConfigError, match=match):
            validate(c)
    c = small_config(quant_train="fp8")
    c.lora.rank = 4
    with pytest.raises(ConfigError, match="config.model.quant_train='fp8'"):
        validate(c)
    c = small_config({"data": 2}, quant_train="fp8")
    c.train.outer.method = "diloco"
    with pytest.raises(ConfigError, match="DiLoCo"):
        validate(c)
