"""The TPU (Mosaic) variant of the linear-attention kernel (kernels/linear_attention/kernel_tpu.py):
its numerics in Pallas interpret mode on CPU against the recurrence (`reference.recurrent`):
outputs, final state and gradients for q, k, v, log_decay and initial_state with cotangents on o
and final_state; with and without decay; T not a multiple of the chunk or of the block (padded
chunks skipped), T < C, Hv != H, several chunks per grid step and one; fp32 and bf16 (float16 is
computed in fp32); two calls carrying the state equal one. Then the automatic choice of the
variant when a program is lowered for TPU (compiled ahead of time for v5p and v6e topologies by
libtpu on this CPU machine: the Mosaic custom calls must be in the compiled HLO, no generic
kernel, and the kernels' cost estimates in the compiler's FLOP count), and the input errors.

Tolerances, as in tests/test_linear_attention.py: errors are max-normalised,
max|err| <= tol * max(1, max|ref|) (entries near zero have no meaningful relative error). fp32:
2e-5. The chunked form sums the same terms as the recurrence in another order, so results differ
by fp32 rounding only (a few ulps of the largest partial sums; <= 1.5e-6 of max|ref| seen here,
gradients included), while a real bug (a wrong decay power, a missed or doubly counted chunk, a
dropped state term) is O(1e-2) or more. bf16: the kernel rounds its matmul operands (q, k, v, dO,
the [C, C] blocks and the state) to bf16 (8-bit mantissa, ~4e-3 relative per rounding) and
returns o and dq, dk, dv in bf16, so it is compared with the fp32 recurrence on the same
bf16-rounded inputs at 3e-2 (<= 3e-3 seen, d log_decay included: kernel.py derives it from the
fp32 dq, dk that the kernels return).

Interpret mode is `interpret=True` of pallas_call via `backend="tpu", interpret=True` (the grid runs
as a loop in order, the VMEM scratch persists across grid steps, the scalar-prefetch decay is an
ordinary operand; dimension semantics, DMA and Mosaic's lowering are not simulated): it checks the
kernels' arithmetic, index maps (the reverse pass's included), padding and the state carried in
scratch, not Mosaic, which the compile tests cover. Shapes are tiny; each configuration is jitted
once at XLA:CPU's lowest optimisation level.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys.analysis import targets
from jaxsys.kernels.linear_attention import kernel_tpu, linear_attention, recurrent
from jaxsys.kernels.linear_attention.tpu_compile import CUSTOM_CALL, compile_case, expected_kernels, tpu_mesh

FAST_COMPILE = {"xla_backend_optimization_level": 0}
TPU_INTERPRET = dict(backend="tpu", interpret=True)
FP32_TOL, BF16_TOL = 2e-5, 3e-2
H, SCALE = 16, 0.25


def _inputs(seed, b=1, t=40, n=2, hv=H, dtype=jnp.float32, decay=True, state=True):
    """q, k, v, log_decay, initial_state and the cotangents do, dS_T (NumPy draws)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = (jnp.asarray(draw(b, t, n, d)).astype(dtype) for d in (H, H, hv))
    # Decays from mild to strong (gamma 0.97 .. 0.3), so both regimes are exercised.
    ld = jnp.asarray(np.log(np.linspace(0.97, 0.3, n, dtype=np.float32))) if decay else None
    s0 = jnp.asarray(draw(b, n, H, hv)) if state else None
    cts = (jnp.asarray(draw(b, t, n, hv)).astype(dtype), jnp.asarray(draw(b, n, H, hv)))
    return (q, k, v, ld, s0), cts


def _close(got, want, tol, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), what
    err = float(np.max(np.abs(got - want)))
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    assert err <= bound, f"{what}: max|err|={err:.3g} > {bound:.3g}"


@functools.partial(jax.jit, static_argnames=("impl",), compiler_options=FAST_COMPILE)
def _outputs_and_grads(args, cts, *, impl):
    """(o, final_state) and the cotangents of (q, k, v, log_decay, initial_state), one program."""
    out, pullback = jax.vjp(impl, *args)
    return out, pullback(cts)


def _tpu(chunk_size, block_t=None):
    return functools.partial(
        lambda q, k, v, ld, s0, **kw: linear_attention(q, k, v, log_decay=ld, initial_state=s0, **kw),
        scale=SCALE,
        chunk_size=chunk_size,
        block_t=block_t,
        **TPU_INTERPRET,
    )


def _reference(q, k, v, ld, s0):
    return recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=SCALE)


# name: (t, hv, chunk_size, block_t, decay, state, dtype)
CASES = {
    # T = 40: 5 chunks of 8, blocks of 2 chunks (Tp = 48; the 6th chunk is padding, skipped).
    "decay_state_hv32_two_chunks_per_block": (40, 32, 8, 16, True, True, jnp.float32),
    # T % C != 0 (last chunk holds 5 real rows), default block_t (= T rounded up to C: one block).
    "decay_ragged_default_block": (45, 16, 8, None, True, True, jnp.float32),
    # One chunk per grid step, no decay, no initial state (None in, None out for log_decay).
    "nodecay_one_chunk_per_block": (24, 16, 8, 8, False, False, jnp.float32),
    # T < C: one padded chunk.
    "t_below_chunk": (13, 16, 16, None, True, True, jnp.float32),
    # bf16, C = 16 (the model's test chunk), T = 40 in blocks of 32 (Tp = 64).
    "bf16_decay_state": (40, 16, 16, 32, True, True, jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_variant_matches_recurrence(name):
    t, hv, chunk, block_t, decay, state, dtype = CASES[name]
    args, cts = _inputs(list(CASES).index(name), t=t, hv=hv, dtype=dtype, decay=decay, state=state)
    (o, st), grads = _outputs_and_grads(args, cts, impl=_tpu(chunk, block_t))
    assert o.dtype == dtype and st.dtype == jnp.float32
    # The truth: the fp32 recurrence on the same (bf16-rounded) values.
    up = lambda x: None if x is None else x.astype(jnp.float32)
    (o_r, st_r), grads_r = _outputs_and_grads(tuple(map(up, args)), tuple(map(up, cts)), impl=_reference)
    tol = BF16_TOL if dtype == jnp.bfloat16 else FP32_TOL
    _close(o, o_r, tol, "o")
    _close(st, st_r, tol, "final_state")
    for what, g, g_r, x in zip(("dq", "dk", "dv", "dlog_decay", "dinitial_state"), grads, grads_r, args):
        if x is None:
            assert g is None, what
            continue
        assert g.dtype == x.dtype, what
        _close(g, g_r, tol, what)


def test_tpu_variant_equals_generic_variant():
    """Both variants on the same input, fp32: the same chunked sums, so they agree to rounding."""
    args, cts = _inputs(3, t=40, hv=32)
    generic = functools.partial(
        lambda q, k, v, ld, s0: linear_attention(
            q, k, v, log_decay=ld, initial_state=s0, scale=SCALE, chunk_size=8, backend="generic", interpret=True
        )
    )
    (o_t, st_t), g_t = _outputs_and_grads(args, cts, impl=_tpu(8, 16))
    (o_g, st_g), g_g = _outputs_and_grads(args, cts, impl=generic)
    for a, b in zip((o_t, st_t, *g_t), (o_g, st_g, *g_g)):
        _close(a, b, FP32_TOL)


def test_chunk_continuation():
    """Two calls, the second starting from the first's final_state, equal one call (LASP-2,
    decoding); the cut (24) is inside a block of the single call."""
    (q, k, v, ld, s0), _ = _inputs(4, t=40)
    run = jax.jit(_tpu(8, 16), compiler_options=FAST_COMPILE)
    o_full, s_full = run(q, k, v, ld, s0)
    cut = 24
    o1, s1 = run(q[:, :cut], k[:, :cut], v[:, :cut], ld, s0)
    o2, s2 = run(q[:, cut:], k[:, cut:], v[:, cut:], ld, s1)
    _close(jnp.concatenate([o1, o2], axis=1), o_full, FP32_TOL, "o")
    _close(s2, s_full, FP32_TOL, "final_state")


def test_strong_decay_is_finite():
    """gamma = exp(-60): every exponent is clamped <= 0, so nothing overflows, forward or back."""
    (q, k, v, _, s0), cts = _inputs(5, t=20)
    ld = jnp.full((2,), -60.0)
    (o, st), grads = _outputs_and_grads((q, k, v, ld, s0), cts, impl=_tpu(8))
    (o_r, st_r), _ = _outputs_and_grads((q, k, v, ld, s0), cts, impl=_reference)
    _close(o, o_r, FP32_TOL, "o")
    _close(st, st_r, FP32_TOL, "final_state")
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


def test_tpu_interpret_mode_with_memory_simulation():
    """The kernels under Pallas's TPU interpret mode (`pltpu.InterpretParams`), which simulates
    TPU memory: uninitialised VMEM/scratch reads give NaN, out-of-bounds reads raise, and races
    between grid steps are detected. Called on kernel_tpu directly (the public `interpret` is a
    bool); one small case, forward and backward."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    (q, k, v, ld, s0), (do, dst) = _inputs(7, t=40, hv=32)
    cfg = kernel_tpu.tpu_config(chunk_size=8, block_t=16, scale=SCALE, has_decay=True, seq_len=40)
    cfg = dataclasses.replace(
        cfg, interpret=pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise", detect_races=True)
    )
    o, st = kernel_tpu.forward(q, k, v, s0, ld, cfg)
    dq, dk, dv, ds0 = kernel_tpu.backward(q, k, v, s0, ld, do, dst, cfg)
    assert not interpret_pallas_call.races.races_found
    (o_r, st_r), grads_r = _outputs_and_grads((q, k, v, ld, s0), (do, dst), impl=_reference)
    for what, got, want in (
        ("o", o, o_r),
        ("final_state", st, st_r),
        ("dq", dq, grads_r[0]),
        ("dk", dk, grads_r[1]),
        ("dv", dv, grads_r[2]),
        ("dinitial_state", ds0, grads_r[4]),
    ):
        _close(got, want, FP32_TOL, what)


def test_float16_is_computed_in_float32():
    (q, k, v, ld, s0), _ = _inputs(6, t=16)
    q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
    o, st = jax.jit(_tpu(8), compiler_options=FAST_COMPILE)(q16, k16, v16, ld, s0)
    o_r, st_r = _reference(*(x.astype(jnp.float32) for x in (q16, k16, v16)), ld, s0)
    assert o.dtype == jnp.float16
    _close(o, o_r, 2e-3, "o")  # float16 output rounding (11-bit mantissa)
    _close(st, st_r, FP32_TOL, "final_state")


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compiles for TPU topologies: the public function picks the Mosaic kernels.

needs_libtpu = pytest.mark.skipif(
    not targets.has_libtpu(), reason="needs libtpu (the TPU compiler): pip install -e '.[tpu]'"
)


@functools.cache
def _mesh(target):
    return tpu_mesh(target)


def _kernel_flops(n, t, chunk, h, hv, backward):
    """The three pallas_calls' cost estimates (B = 1 per device, T a multiple of C)."""
    per = lambda intra, state: intra * chunk * chunk * (h + hv) + state * 2 * chunk * h * hv
    total = per(2, 2) + ((per(2, 2) + per(4, 3)) if backward else 0)
    return n * (t // chunk) * total


@needs_libtpu
@pytest.mark.parametrize(
    "target, dtype, chunk, t, h, hv",
    [
        ("v5p:2x2x1", jnp.bfloat16, 64, 1024, 128, 128),  # the model's default chunk
        ("v6e:2x2", jnp.float32, 16, 512, 64, 128),  # the model tests' chunk, Hv != H
    ],
)
def test_linear_attention_picks_mosaic_when_lowered_for_tpu(target, dtype, chunk, t, h, hv):
    """linear_attention with no backend argument (as the model calls it), grad through the
    custom_vjp (decay, initial state, both cotangents), compiled for a TPU topology: three Mosaic
    custom calls (forward, dq pass, dk/dv pass), no generic kernel, and the compiler's FLOP
    count includes the kernels' cost estimates (the rest is XLA's elementwise work)."""
    n = 4
    with targets.quiet_libtpu():
        compiled = compile_case(_mesh(target), t, h, dtype, backward=True, heads=n, hv=hv, chunk_size=chunk)
    text = compiled.as_text()
    assert text.count(CUSTOM_CALL) == 3
    for name in ("linear_attention_tpu_fwd", "linear_attention_tpu_bwd_dq", "linear_attention_tpu_bwd_dkdv"):
        assert name in text
    assert "linear_attention_fwd" not in text and "linear_attention_bwd" not in text
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    kernel_flops = _kernel_flops(n, t, chunk, h, hv, backward=True)
    assert kernel_flops <= cost["flops"] <= 1.02 * kernel_flops


@needs_libtpu
@pytest.mark.parametrize(
    "backward, decay, dtype, kwargs",
    [
        (False, True, jnp.bfloat16, dict(block_t=256)),  # forward only
        (True, False, jnp.float32, dict(t=1000)),  # no decay: the forward is dead code in the grad
        (True, True, jnp.float16, dict(t=256, h=64, chunk_size=8)),  # computed in fp32 inside
    ],
)
def test_other_cases_compile_for_tpu(backward, decay, dtype, kwargs):
    kwargs = {"t": 2048, "h": 128, **kwargs}
    with targets.quiet_libtpu():
        compiled = compile_case(
            _mesh("v5p:2x2x1"), kwargs.pop("t"), kwargs.pop("h"), dtype, backward=backward, decay=decay, **kwargs
        )
    text = compiled.as_text()
    want = expected_kernels(backward, decay)
    assert text.count(CUSTOM_CALL) == len(want)
    assert all(name in text for name in want)


@needs_libtpu
def test_cpu_lowering_keeps_the_generic_kernel():
    """The same shard_map'd program lowered for CPU devices has no Mosaic call."""
    cpu_mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2], axis_types=(jax.sharding.AxisType.Auto,))
    data = P("data")
    local = lambda q, k, v: linear_attention(q, k, v, chunk_size=16)
    fn = jax.jit(jax.shard_map(local, mesh=cpu_mesh, in_specs=(data,) * 3, out_specs=(data, data), check_vma=False))
    x = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32, sharding=NamedSharding(cpu_mesh, data))
    text = fn.lower(x, x, x).as_text()
    assert "tpu_custom_call" not in text


# ----------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"backend": "cuda"},
            r"backend must be None \(chosen by platform\) or one of "
            r"\('generic', 'tpu'\); got backend='cuda'",
        ),
        (
            {"backend": "tpu", "block_t": 12},
            r"block_t must be a positive multiple of chunk_size=8, "
            r"got block_t=12",
        ),
        ({"block_t": 0}, r"block_t must be a positive multiple of chunk_size=8, got block_t=0"),
        (
            {"backend": "tpu", "chunk_size": 12},
            r"chunk_size must be a positive multiple of 8, "
            r"got 12",
        ),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    q = jnp.zeros((1, 16, 2, H))
    with pytest.raises(ValueError, match=match):
        linear_attention(q, q, q, **{"chunk_size": 8, **kwargs})


def test_tpu_config_names_the_mosaic_rule():
    with pytest.raises(
        ValueError,
        match=r"the TPU kernel needs chunk_size to be a positive "
        r"multiple of 8 \(Mosaic's sublane tile\), got "
        r"chunk_size=20",
    ):
        kernel_tpu.tpu_config(chunk_size=20, block_t=None, scale=1.0, has_decay=False, seq_len=64)
    # The default block_t: the chunks spread evenly over the fewest blocks of <= 512 tokens.
    for chunk, t, block_t in ((64, 40, 64), (64, 32768, 512), (64, 520, 320), (48, 4096, 480), (1024, 5000, 1024)):
        cfg = kernel_tpu.tpu_config(chunk_size=chunk, block_t=None, scale=1.0, has_decay=False, seq_len=t)
        assert cfg.block_t == block_t, (chunk, t)
