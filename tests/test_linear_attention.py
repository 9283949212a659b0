"""Causal linear attention: chunked reference and Pallas kernel (interpret mode) vs the recurrence.

Tolerances. fp32: the chunked form sums the same terms as the recurrence in another order (per chunk
matmuls, then a state contribution), so the outputs differ by fp32 rounding only: a few ulps of the
largest partial sums (observed <= ~5e-6 of max|ref| here, gradients included). We check
max|err| <= 2e-5 * max(1, max|ref|): a max-normalised error (entries near zero have no meaningful
relative error) with a few-x margin, while any real bug (a wrong decay power, a missed chunk, a
dropped state term) moves results by O(1e-2) or more. bf16: the kernel
rounds its matmul operands (q, k, v, the [C, C] attention block and the state) to bf16 (8-bit
mantissa, ~4e-3 relative), so a loose 3e-2 of max|ref| against the fp32 recurrence evaluated on the
same bf16-rounded inputs.

Shapes are tiny (interpret mode is slow); kernel calls go through one jitted function so the same
configuration compiles once for the whole file.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxsys.kernels.linear_attention import chunked, linear_attention, recurrent

H = 16
FP32_TOL = 2e-5


# Jitted once at module level so that equal shapes and settings compile once for the whole file.
_recurrent = jax.jit(recurrent, static_argnames=("scale",))
_chunked = jax.jit(chunked, static_argnames=("scale", "chunk_size"))


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "block_v"))
def _kernel(q, k, v, log_decay, initial_state, *, scale, chunk_size, block_v=None):
    return linear_attention(
        q, k, v, log_decay=log_decay, initial_state=initial_state, scale=scale, chunk_size=chunk_size, block_v=block_v
    )


def _inputs(seed, b=2, t=40, n=2, hv=H, dtype=jnp.float32, decay=True, state=True):
    # NumPy draws: no per-shape compilation of jax.random ops (they add up in this file).
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = (jnp.asarray(draw(b, t, n, d)).astype(dtype) for d in (H, H, hv))
    # Decays from mild to strong (gamma 0.97 .. 0.3) so both regimes are exercised.
    ld = jnp.asarray(np.log(np.linspace(0.97, 0.3, n, dtype=np.float32))) if decay else None
    s0 = jnp.asarray(draw(b, n, H, hv)) if state else None
    return q, k, v, ld, s0


def _close(got, want, tol=FP32_TOL):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float(np.max(np.abs(got - want)))
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    assert err <= bound, f"max|err|={err:.3g} > {bound:.3g}"


# ----------------------------------------------------------------------------------------------
# Pure-JAX chunked form vs the recurrence.


@pytest.mark.parametrize("chunk_size", [8, 16, 64])  # 40 % 16 != 0; 64 > T (one padded chunk)
@pytest.mark.parametrize("decay", [False, True])
def test_chunked_equals_recurrent(chunk_size, decay):
    q, k, v, ld, s0 = _inputs(0, decay=decay)  # with a carried-in initial state
    o_r, s_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)
    o_c, s_c = _chunked(q, k, v, chunk_size=chunk_size, log_decay=ld, initial_state=s0, scale=0.25)
    _close(o_c, o_r)
    _close(s_c, s_r)


def _vjp_all(f, args, cts):
    """(outputs, cotangents of all args) in one jitted program (one forward, one backward)."""

    def run(args, cts):
        out, pullback = jax.vjp(f, *args)
        return out, pullback(cts)

    return jax.jit(run)(args, cts)


def _f_recurrent(q, k, v, ld, s0):
    return recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)


def test_chunked_gradients_equal_recurrent():
    q, k, v, ld, s0 = _inputs(1, t=20)
    ct = _inputs(2, t=20)
    cts = (ct[2], ct[4])
    f_c = lambda q, k, v, ld, s0: chunked(q, k, v, log_decay=ld, initial_state=s0, scale=0.25, chunk_size=8)
    _, g_r = _vjp_all(_f_recurrent, (q, k, v, ld, s0), cts)
    _, g_c = _vjp_all(f_c, (q, k, v, ld, s0), cts)
    for a, b in zip(g_c, g_r):
        _close(a, b)


def test_strong_decay_is_finite():
    """gamma = exp(-60): exponents are kept <= 0, so nothing overflows (forward or backward)."""
    q, k, v, _, s0 = _inputs(3, t=20)
    ld = jnp.full((2,), -60.0)
    o_r, s_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)
    (o_c, s_c), g = _vjp_all(
        lambda ld: chunked(q, k, v, chunk_size=8, log_decay=ld, initial_state=s0, scale=0.25),
        (ld,),
        (jnp.ones_like(o_r), jnp.ones_like(s_r)),
    )
    _close(o_c, o_r)
    _close(s_c, s_r)
    assert np.all(np.isfinite(np.asarray(g[0])))


# ----------------------------------------------------------------------------------------------
# Pallas kernel (interpret mode) vs the recurrence.

KERNEL_CASES = [
    # (t, chunk_size, hv, block_v, decay, state): T % C != 0, value tiling, Hv != H, T < C.
    dict(t=40, chunk_size=16, hv=16, block_v=8, decay=True, state=True),
    dict(t=24, chunk_size=8, hv=8, block_v=None, decay=False, state=False),
    dict(t=13, chunk_size=16, hv=16, block_v=None, decay=True, state=True),
]


@pytest.mark.parametrize(
    "case", KERNEL_CASES, ids=lambda c: "t{t}-c{chunk_size}-hv{hv}-bv{block_v}-decay{decay}-state{state}".format(**c)
)
def test_kernel_equals_recurrent_fp32(case):
    q, k, v, ld, s0 = _inputs(4, t=case["t"], hv=case["hv"], decay=case["decay"], state=case["state"])
    o_r, s_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)
    o_k, s_k = _kernel(q, k, v, ld, s0, scale=0.25, chunk_size=case["chunk_size"], block_v=case["block_v"])
    assert o_k.dtype == jnp.float32 and s_k.dtype == jnp.float32
    _close(o_k, o_r)
    _close(s_k, s_r)


class KernelVariantsTest(chex.TestCase):
    """The kernel called as is and under jax.jit (chex.variants) against the recurrence."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_kernel_equals_recurrent(self):
        q, k, v, ld, s0 = _inputs(5, b=1, t=24, n=2)
        attend = self.variant(
            lambda q, k, v, ld, s0: linear_attention(q, k, v, log_decay=ld, initial_state=s0, scale=0.25, chunk_size=8)
        )
        o_k, s_k = attend(q, k, v, ld, s0)
        o_r, s_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)
        _close(o_k, o_r)
        _close(s_k, s_r)


def test_kernel_bf16_loose():
    q, k, v, ld, s0 = _inputs(5, dtype=jnp.bfloat16)
    o_r, s_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)  # fp32 inside
    o_k, s_k = _kernel(q, k, v, ld, s0, scale=0.25, chunk_size=16, block_v=8)
    assert o_k.dtype == jnp.bfloat16 and s_k.dtype == jnp.float32
    _close(o_k, o_r, tol=3e-2)
    _close(s_k, s_r, tol=3e-2)


@pytest.mark.parametrize("case", KERNEL_CASES[:2], ids=["decay-tiled", "nodecay"])
def test_kernel_gradients_equal_recurrent(case):
    """dq, dk, dv, d initial_state (and d log_decay) with cotangents on o AND final_state."""
    q, k, v, ld, s0 = _inputs(6, t=case["t"], hv=case["hv"], decay=case["decay"])
    ct = _inputs(7, t=case["t"], hv=case["hv"])
    cts = (ct[2], ct[4])  # do [B, T, N, Hv], dS_T [B, N, H, Hv]
    f_k = lambda q, k, v, ld, s0: linear_attention(
        q, k, v, log_decay=ld, initial_state=s0, scale=0.25, chunk_size=case["chunk_size"], block_v=case["block_v"]
    )
    _, g_r = _vjp_all(_f_recurrent, (q, k, v, ld, s0), cts)
    _, g_k = _vjp_all(f_k, (q, k, v, ld, s0), cts)
    names = ["dq", "dk", "dv", "dlog_decay", "dinitial_state"]
    for name, a, b in zip(names, g_k, g_r):
        if b is None:  # log_decay=None
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        _close(a, b)


def test_split_sequence_carries_state():
    """Two calls, the second starting from the first's final_state, equal one call (LASP-2, decode)."""
    q, k, v, ld, s0 = _inputs(8)
    o_full, s_full = _kernel(q, k, v, ld, s0, scale=0.25, chunk_size=16, block_v=8)
    cut = 24
    o1, s1 = _kernel(q[:, :cut], k[:, :cut], v[:, :cut], ld, s0, scale=0.25, chunk_size=16, block_v=8)
    o2, s2 = _kernel(q[:, cut:], k[:, cut:], v[:, cut:], ld, s1, scale=0.25, chunk_size=16, block_v=8)
    _close(jnp.concatenate([o1, o2], axis=1), o_full)
    _close(s2, s_full)


def test_shard_map_heads_on_tensor_axis():
    """Heads split over an 8-device 'tensor' axis: forward and gradients equal the unsharded call."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("tensor",))
    q, k, v, ld, s0 = _inputs(9, b=1, t=16, n=8)
    ct = _inputs(10, b=1, t=16, n=8)
    cts = (ct[2], ct[4])
    heads = P(None, None, "tensor", None)
    state = P(None, "tensor", None, None)
    f = lambda q, k, v, ld, s0: linear_attention(q, k, v, log_decay=ld, initial_state=s0, scale=0.25, chunk_size=8)
    f_sharded = jax.shard_map(
        f, mesh=mesh, in_specs=(heads, heads, heads, P("tensor"), state), out_specs=(heads, state), check_vma=False
    )
    (o_s, st_s), g_s = _vjp_all(f_sharded, (q, k, v, ld, s0), cts)
    (o_u, st_u), g_u = _vjp_all(f, (q, k, v, ld, s0), cts)
    o_r, st_r = _recurrent(q, k, v, log_decay=ld, initial_state=s0, scale=0.25)
    _close(o_s, o_u)
    _close(st_s, st_u)
    for a, b in zip(g_s, g_u):
        _close(a, b)
    _close(o_u, o_r)
    _close(st_u, st_r)


# ----------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "k": a["k"][:, :5]}, r"k\.shape must equal q\.shape"),
        (lambda a: {**a, "v": a["v"][:, :, :1]}, r"v\.shape\[:3\] must equal q\.shape\[:3\]"),
        (lambda a: {**a, "q": a["q"][0]}, r"q must be 4-D"),
        (lambda a: {**a, "v": a["v"].astype(jnp.bfloat16)}, r"share one floating dtype"),
        (lambda a: {**a, "chunk_size": 12}, r"chunk_size must be a positive multiple of 8, got 12"),
        (lambda a: {**a, "chunk_size": 0}, r"chunk_size must be a positive multiple of 8, got 0"),
        (lambda a: {**a, "log_decay": jnp.zeros((3,))}, r"log_decay must have shape \[N\]=\(2,\), got \(3,\)"),
        (lambda a: {**a, "log_decay": jnp.array([-0.1, 0.2])}, r"log_decay must be <= 0"),
        (
            lambda a: {**a, "initial_state": jnp.zeros((2, 2, H, 8))},
            r"initial_state must have shape \[B, N, H, Hv\]=\(2, 2, 16, 16\), got \(2, 2, 16, 8\)",
        ),
        (lambda a: {**a, "block_v": 5}, r"block_v must be a positive divisor of Hv=16, got 5"),
        (lambda a: {**a, "scale": jnp.float32(0.5) * jnp.ones(())}, r"scale must be a Python/NumPy real"),
    ],
)
def test_bad_input_raises(mutate, match):
    q, k, v, ld, s0 = _inputs(11, t=8)
    args = mutate(dict(q=q, k=k, v=v, log_decay=ld, initial_state=s0, chunk_size=8))
    with pytest.raises(ValueError, match=match):
        linear_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
