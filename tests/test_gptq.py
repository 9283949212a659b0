"""GPTQ (jaxsys/quantization/gptq.py) against round-to-nearest and against a naive implementation of the paper.

- A diagonal Hessian (uncorrelated inputs) leaves nothing for the error feedback to do
  (U = chol(H^-1) is diagonal, dampening keeps it so): GPTQ must then return exactly RTN's codes,
  scales and zeros (reference.quantize_w8 / quantize_w4), bit for bit.
- On correlated calibration activations (mixed Gaussian inputs, a few outlier channels) the layer
  output error on held-out activations of the same distribution is clearly below RTN's.
- The codes are in the formats' ranges and dequantize, through the reference functions, to the
  very weights GPTQ propagated its errors against.
- The lazy-batch, Cholesky-form implementation equals a naive one written from the paper's OBS
  equations (2) and (3): the explicit inverse Hessian, downdated after every row, no blocks. The
  attained proxy loss equals tr(dW^T H dW) (for a quadratic the per-step OBS increases add up).
- Hessian accumulation over batches, dead inputs, and bad input.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.quantized_matmul import reference as ref
from jaxsys.quantization import gptq

CASES = [("w8", 128, False)] + [("w4", g, zp) for g in ref.GROUP_SIZES for zp in (False, True)]


def _weight(rng, k, n):
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0  # a zero channel: scale 1, codes 0 (or z)
    w[7, :] *= 6.0  # a large row, so that groups have different ranges
    return w


def _rtn(w, fmt, group_size, zero_point):
    if fmt == "w8":
        q, s = ref.quantize_w8(jnp.asarray(w))
        return np.asarray(q), np.asarray(s), None
    q, s, z = ref.quantize_w4(jnp.asarray(w), group_size, zero_point)
    return np.asarray(q), np.asarray(s), None if z is None else np.asarray(z)


def _dequantize(q, s, z, fmt):
    """The reference formats' dequantization: q * s (w8), reference.dequantize_w4 of the packed codes."""
    if fmt == "w8":
        return np.asarray(q, np.float32) * np.asarray(s, np.float32)[None, :]
    return np.asarray(
        ref.dequantize_w4(ref.pack_int4(jnp.asarray(q)), jnp.asarray(s), None if z is None else jnp.asarray(z))
    )


def _bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _activations(rng, k, kind):
    """A sampler of calibration / held-out activations [m, k] from one fixed distribution."""
    if kind == "mixed":  # correlated inputs: x = z A (+ a little isotropic noise)
        a = rng.standard_normal((k, k)) / np.sqrt(k)
        return lambda m: rng.standard_normal((m, k)) @ a + 0.1 * rng.standard_normal((m, k))
    # a few large-magnitude outlier channels (x 20) over correlated inputs
    a = rng.standard_normal((k, k)) / np.sqrt(k)
    gain = np.ones(k)
    gain[rng.choice(k, 6, replace=False)] = 20.0
    return lambda m: (rng.standard_normal((m, k)) @ a + 0.1 * rng.standard_normal((m, k))) * gain


# ----------------------------------------------------------------------------- diagonal H == RTN


@pytest.mark.parametrize("fmt,group_size,zero_point", CASES)
def test_diagonal_hessian_gives_rtn_bitwise(fmt, group_size, zero_point):
    rng = np.random.default_rng(1)
    k, n = 256, 40
    w = _weight(rng, k, n)
    want = _rtn(w, fmt, group_size, zero_point)
    hessians = [
        np.eye(k),  # unit-variance uncorrelated inputs
        np.diag(rng.uniform(0.1, 10.0, k)) * 1000.0,
    ]  # uncorrelated, unequal variances
    for h in hessians:
        for act_order in (False, True):  # act_order: another order, static (= RTN's) groups
            got = gptq.quantize(
                w, h, 1000, fmt, group_size=group_size, zero_point=zero_point, block_size=64, act_order=act_order
            )
            for g, r in zip(got, want):
                if r is None:
                    assert g is None
                else:
                    _bitwise_equal(g, r)


# ----------------------------------------------------------------------------- better than RTN


@pytest.mark.parametrize("kind", ["mixed", "outliers"])
def test_gptq_output_error_is_well_below_rtn_on_correlated_inputs(kind, record_property):
    rng = np.random.default_rng(2)
    k, n = 256, 64
    w = _weight(rng, k, n)
    sample = _activations(rng, k, kind)
    h, rows = gptq.hessian(sample(1024))
    h, rows = gptq.hessian(sample(1024), (h, rows))  # two calibration batches
    x = sample(2048)  # held out
    y = x @ w.astype(np.float64)

    def out_error(q, s, z, fmt):
        return np.sum((y - x @ _dequantize(q, s, z, fmt).astype(np.float64)) ** 2)

    ratios = {}
    for fmt, group_size, zero_point in [("w4", 32, False), ("w4", 128, False), ("w4", 128, True), ("w8", 128, False)]:
        rtn = out_error(*_rtn(w, fmt, group_size, zero_point), fmt)
        for act_order in (False, True):
            got = gptq.quantize(w, h, rows, fmt, group_size=group_size, zero_point=zero_point, act_order=act_order)
            ratios[(fmt, group_size, zero_point, act_order)] = out_error(*got, fmt) / rtn
    for key, ratio in ratios.items():
        print(f"{kind}: GPTQ/RTN held-out output error {key}: {ratio:.3f}")
        record_property(f"ratio_{kind}_{'_'.join(map(str, key))}", round(float(ratio), 4))
    for key, ratio in ratios.items():
        assert ratio <= 0.8, (key, ratio)


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("fmt,group_size,zero_point", CASES)
def test_codes_in_range_and_dequantize_to_the_tracked_weights(fmt, group_size, zero_point):
    rng = np.random.default_rng(3)
    k, n = 256, 32
    w = _weight(rng, k, n)
    x = _activations(rng, k, "outliers")(1024)
    h, rows = gptq.hessian(x)
    r = gptq.quantize_detailed(w, h, rows, fmt, group_size=group_size, zero_point=zero_point, block_size=48)
    assert r.q.dtype == np.int8 and r.q.shape == (k, n)
    assert r.s.dtype == np.float32 and np.all(r.s > 0)
    lo, hi = {"w8": (-127, 127), "w4": (0, 15) if zero_point else (-8, 7)}[fmt]
    assert r.q.min() >= lo and r.q.max() <= hi
    if fmt == "w8":
        assert r.s.shape == (n,) and r.z is None
    else:
        assert r.s.shape == (k // group_size, n)
        if zero_point:
            assert r.z.dtype == np.int8 and r.z.shape == r.s.shape
            assert r.z.min() >= 0 and r.z.max() <= 15
        else:
            assert r.z is None
    _bitwise_equal(_dequantize(r.q, r.s, r.z, fmt), r.dequantized)
    # the zero channel stays exactly zero
    assert np.all(r.dequantized[:, 3] == 0)
    # quantize is quantize_detailed's first three
    for a, b in zip(gptq.quantize(w, h, rows, fmt, group_size=group_size, zero_point=zero_point), r[:3]):
        if b is None:
            assert a is None
        else:
            _bitwise_equal(a, b)


# ----------------------------------------------------------------------------- the naive algorithm


def _naive_gptq(w, h, n_rows, fmt, group_size, zero_point, damp, order):
    """GPTQ straight from the paper (eqs. 2, 3: OBS with the explicit inverse Hessian of the rows
    not yet rounded, downdated after each one), rows in `order`, no blocks, no Cholesky. Group
    parameters: non-static (current rows at the group's start) in the natural order, static (the
    original rows) otherwise; w8 scales from the original weights. Quantization by the formats'
    formulas in float32, the scales/zeros from the reference quantizers."""
    k, n = w.shape
    w_cur = w.astype(np.float32).astype(np.float64)
    hess = 2.0 * h.astype(np.float64) / n_rows
    if fmt == "w8":
        _, s8 = ref.quantize_w8(jnp.asarray(w_cur.astype(np.float32)))
        s8 = np.asarray(s8)
    dead = np.diag(hess) == 0
    for i in np.flatnonzero(dead):
        hess[i, i] = 1.0
        w_cur[i] = 0.0
    natural = np.array_equal(order, np.arange(k))
    if fmt == "w4":
        _, s_st, z_st = ref.quantize_w4(jnp.asarray(w_cur.astype(np.float32)), group_size, zero_point)
        s_st = np.asarray(s_st)
        z_st = None if z_st is None else np.asarray(z_st).astype(np.float32)
        s_out, z_out = s_st.copy(), None if z_st is None else z_st.copy()
    hess += damp * np.mean(np.diag(hess)) * np.eye(k)
    h_inv = np.linalg.inv(hess)
    deq = np.zeros((k, n), np.float32)
    codes = np.zeros((k, n), np.int8)
    loss = 0.0
    for t, i in enumerate(order):
        z = None
        if fmt == "w8":
            s = s8
        else:
            g = i // group_size
            if natural and i % group_size == 0:
                _, s_g, z_g = ref.quantize_w4(
                    jnp.asarray(w_cur[i : i + group_size].astype(np.float32)), group_size, zero_point
                )
                s_out[g] = np.asarray(s_g)[0]
                if zero_point:
                    z_out[g] = np.asarray(z_g)[0]
            s = s_out[g] if natural else s_st[g]
            z = None if not zero_point else (z_out[g] if natural else z_st[g])
        v = w_cur[i].astype(np.float32) / s
        if fmt == "w8":
            q = np.clip(np.round(v), -127, 127)
            d = q * s
        elif zero_point:
            q = np.clip(np.round(v) + z, 0, 15)
            d = (q - z) * s
        else:
            q = np.clip(np.round(v), -8, 7)
            d = q * s
        codes[i], deq[i] = q, d
        delta = w_cur[i] - d.astype(np.float64)
        rest = order[t + 1 :]
        loss += np.sum(delta**2) / h_inv[i, i]
        # eq. (2): delta_F = -(w_q - quant(w_q)) / [H_F^-1]_qq * (H_F^-1)_{:, q}
        w_cur[rest] -= np.outer(h_inv[rest, i] / h_inv[i, i], delta)
        # eq. (3): H_{-q}^-1 = H^-1 - H^-1_{:, q} H^-1_{q, :} / [H^-1]_qq
        h_inv = h_inv - np.outer(h_inv[:, i], h_inv[i, :]) / h_inv[i, i]
    z_final = None if fmt == "w8" or not zero_point else z_out.astype(np.int8)
    return codes, (s8 if fmt == "w8" else s_out), z_final, deq, loss


@pytest.mark.parametrize(
    "fmt,group_size,zero_point,act_order",
    [
        ("w8", 128, False, False),
        ("w4", 32, False, False),
        ("w4", 32, True, False),
        ("w4", 64, True, False),
        ("w4", 32, False, True),
        ("w8", 128, False, True),
    ],
)
def test_lazy_blocks_equal_the_naive_row_by_row_algorithm(fmt, group_size, zero_point, act_order):
    rng = np.random.default_rng(4)
    k, n = 128, 24
    w = _weight(rng, k, n)
    x = _activations(rng, k, "outliers")(512)
    x[:, 20] = 0.0  # a dead input
    h, rows = gptq.hessian(x)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    assert act_order == (not np.array_equal(order, np.arange(k)))
    want = _naive_gptq(w, h, rows, fmt, group_size, zero_point, 0.01, order)
    assert np.abs(want[3] - w).max() > 0  # the feedback did something
    # block sizes: one row, several groups per block, groups straddling blocks, one block
    for block_size in (1, 16, 24, 48, 128):
        r = gptq.quantize_detailed(
            w,
            h,
            rows,
            fmt,
            group_size=group_size,
            zero_point=zero_point,
            damp=0.01,
            block_size=block_size,
            act_order=act_order,
        )
        np.testing.assert_array_equal(r.q, want[0])
        np.testing.assert_array_equal(r.s, want[1])
        if want[2] is None:
            assert r.z is None
        else:
            np.testing.assert_array_equal(r.z, want[2])
        np.testing.assert_array_equal(r.dequantized, want[3])
        assert r.loss == pytest.approx(want[4], rel=1e-9)
    # the naive run differs from RTN (non-trivial case)
    assert not np.array_equal(want[0], _rtn(w, fmt, group_size, zero_point)[0])


@pytest.mark.parametrize("act_order", [False, True])
def test_loss_is_the_proxy_objective_and_dead_inputs_are_zeroed(act_order):
    rng = np.random.default_rng(5)
    k, n = 128, 16
    w = _weight(rng, k, n)
    x = _activations(rng, k, "mixed")(600)
    dead = [5, 17, 64]
    x[:, dead] = 0.0
    h, rows = gptq.hessian(x)
    damp = 0.05
    for fmt, zero_point in [("w4", False), ("w4", True), ("w8", False)]:
        r = gptq.quantize_detailed(
            w, h, rows, fmt, group_size=32, zero_point=zero_point, damp=damp, block_size=32, act_order=act_order
        )
        assert np.all(np.isfinite(r.dequantized))
        assert np.all(r.dequantized[dead] == 0)  # dead rows are set to 0 and quantize to 0
        if fmt == "w8" or not zero_point:
            assert np.all(r.q[dead] == 0)
        else:
            assert np.all(r.q[dead] == r.z[np.array(dead) // 32])
        # GPTQ's accumulated OBS loss is tr(dW^T H' dW), H' = 2 X^T X / M (dead: 1) + damping
        hp = 2.0 * h / rows
        hp[dead, dead] = 1.0
        hp += damp * np.mean(np.diag(hp)) * np.eye(k)
        w0 = w.astype(np.float64)
        w0[dead] = 0.0
        dw = w0 - r.dequantized.astype(np.float64)
        assert r.loss == pytest.approx(np.trace(dw.T @ hp @ dw), rel=1e-8)


# ----------------------------------------------------------------------------- the Hessian


def test_hessian_streams_batches_and_flattens_leading_dims():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((2, 5, 8)).astype(np.float32)  # [batch, seq, K]
    b = rng.standard_normal((7, 8)).astype(np.float32)
    h, count = gptq.hessian(a)
    h, count = gptq.hessian(b, (h, count))
    x = np.concatenate([a.reshape(-1, 8), b]).astype(np.float64)
    assert count == 17
    assert h.dtype == np.float64 and h.shape == (8, 8)
    np.testing.assert_allclose(h, x.T @ x, rtol=1e-12)
    with pytest.raises(ValueError, match="K=9 but the running Hessian is"):
        gptq.hessian(rng.standard_normal((3, 9)), (h, count))
    with pytest.raises(ValueError, match="the \\(H, count\\) pair"):
        gptq.hessian(b, h)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_named():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    h = np.eye(64)
    with pytest.raises(ValueError, match="format 'w2' is not supported"):
        gptq.quantize(w, h, 10, "w2")
    with pytest.raises(ValueError, match="format 'w4a16' is not supported"):
        gptq.quantize(w, h, 10, "w4a16")
    with pytest.raises(ValueError, match="K=64 is not a multiple of group_size=128"):
        gptq.quantize(w, h, 10, "w4", group_size=128)
    with pytest.raises(ValueError, match="group_size=48"):
        gptq.quantize(w, h, 10, "w4", group_size=48)
    with pytest.raises(ValueError, match=r"Hessian must be \[K, K\] = \[64, 64\]"):
        gptq.quantize(w, np.eye(63), 10, "w8")
    with pytest.raises(ValueError, match="2-D weight"):
        gptq.quantize(w[:, 0], h, 10, "w8")
    with pytest.raises(ValueError, match="n_rows"):
        gptq.quantize(w, h, 0, "w8")
    with pytest.raises(ValueError, match="block_size"):
        gptq.quantize(w, h, 10, "w8", block_size=0)
    with pytest.raises(ValueError, match="damp"):
        gptq.quantize(w, h, 10, "w8", damp=-0.1)
    with pytest.raises(ValueError, match="non-finite"):
        gptq.quantize(np.full_like(w, np.nan), h, 10, "w8")
    # a singular Hessian without dampening: named, not a LinAlgError
    x = rng.standard_normal((4, 64))
    with pytest.raises(ValueError, match="not positive definite: raise `damp`"):
        gptq.quantize(w, x.T @ x, 4, "w8", damp=0.0)
    # the same Hessian with the default dampening is fine
    q, s, z = gptq.quantize(w, x.T @ x, 4, "w4", group_size=32)
    assert q.shape == w.shape and s.shape == (2, 8) and z is None
