"""Attention logit soft-capping (Gemma 2: the scaled scores s become c * tanh(s / c) before the
masks and the softmax) in the flash-attention kernels: the reference against a float64 NumPy
statement, its backward against autodiff of its forward (jax.vjp through the tanh is the
independent statement of the cap's derivative), the generic kernel and the TPU kernel (interpret
mode) against the reference (o, lse and dq, dk, dv with both cotangents; causal and full, GQA,
windows, packed segment ids, ragged T), the per-block backward summed over kv halves as ring
attention does, the Mosaic GPU kernels kept out, the lowering for a GPU (Triton) and for a TPU
(Mosaic), and the errors.

The inputs make the cap matter: q is scaled by 3, so with H = 16 the scores are ~N(0, 3^2) against
c = 2 (half of them beyond 0.7 c, where tanh bends); every comparison also checks that the capped
and the uncapped reference differ by O(1e-1), so a kernel that ignored the cap (or applied it
twice, or after the mask) would fail it.

Tolerances as in tests/test_flash_attention.py: fp32 kernel against the fp32 reference 1e-5 (abs and
rel): the same terms summed in another order (tiles with an online softmax against one pass) and
tanh(x * (scale / c)) * c in place of c * tanh(x * scale / c), a few ulps of the largest terms;
a missing or misplaced cap, or a missing 1 - tanh^2 in dS, is O(1e-2) or more. The fp32 reference
against float64 NumPy at 1e-5 likewise (fp32 rounding of O(1) sums over <= 64 keys).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    kernel,
    reference,
    reference_attention,
    reference_attention_backward,
)

FAST_COMPILE = {"xla_backend_optimization_level": 0}
SOFTCAP = 2.0
TOL = 1e-5  # fp32 against fp32 (or float64): see the module docstring
CAP_MATTERS = 1e-1  # the least max |capped - uncapped| of the outputs on these inputs


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(b, t, n, kh, h, seed=0, s=None):
    """q scaled by 3 so that the cap bends most scores (module docstring)."""
    s = t if s is None else s
    return 3.0 * _normal(seed, (b, t, n, h)), _normal(seed + 1, (b, s, kh, h)), _normal(seed + 2, (b, s, kh, h))


def _packed(b, t):
    """Documents of 23 / 41 / rest tokens, shifted by one per row (every row sees itself)."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        ids[row, 23 + row :] += 1
        ids[row, 64 + row :] += 1
    return jnp.asarray(ids)


def _numpy_attention(q, k, v, *, softcap, causal=False, window=None, seg=None):
    """float64 (o, lse): scores q.k / sqrt(H) -> softcap * tanh(s / softcap) -> mask -> softmax,
    GQA by repeating the kv heads. Every row here sees at least one key."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, g = k.shape[1], n // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    visible = np.ones((b, 1, t, s), bool)
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    if causal:
        visible &= cols <= rows
    if window is not None:
        visible &= cols > rows - window
    if seg is not None:
        seg = np.asarray(seg)
        visible &= (seg[:, :, None] == seg[:, None, :])[:, None]
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(-1, keepdims=True)
    p = np.exp(scores - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v), lse


# ---------------------------------------------------------------------------------------------
# The reference.


def test_softcapped_helper():
    x = jnp.linspace(-40.0, 40.0, 81)
    assert reference.softcapped(x, None) is x and reference.softcapped(x, 0) is x
    capped = np.asarray(reference.softcapped(x, 5.0))
    np.testing.assert_allclose(capped, 5.0 * np.tanh(np.asarray(x, np.float64) / 5.0), rtol=1e-6, atol=1e-6)
    assert np.abs(capped).max() <= 5.0  # bounded by c (equal where fp32 tanh rounds to 1)
    # ~identity near 0: c tanh(x / c) = x (1 - x^2 / (3 c^2) + ...), 2e-7 relative at |x| <= 4e-3
    np.testing.assert_allclose(reference.softcapped(x * 1e-4, 5.0), x * 1e-4, rtol=1e-6)


# name: (B, T, N, K, H, causal, window, packed)
REFERENCE_CASES = {
    "full_gqa": (2, 24, 4, 2, 16, False, None, False),
    "causal_mqa": (1, 24, 4, 1, 16, True, None, False),
    "causal_window": (2, 24, 4, 2, 16, True, 5, False),
    "full_packed": (2, 80, 2, 1, 16, False, None, True),
}


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_equals_numpy(name):
    b, t, n, kh, h, causal, window, packed = REFERENCE_CASES[name]
    q, k, v = _qkv(b, t, n, kh, h, seed=len(name))
    seg = _packed(b, t) if packed else None
    segs = dict(q_segment_ids=seg, kv_segment_ids=seg)
    o, lse = reference_attention(q, k, v, causal=causal, window=window, softcap=SOFTCAP, return_lse=True, **segs)
    want_o, want_lse = _numpy_attention(q, k, v, softcap=SOFTCAP, causal=causal, window=window, seg=seg)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=TOL, atol=TOL)
    plain, _ = _numpy_attention(q, k, v, softcap=None, causal=causal, window=window, seg=seg)
    assert np.abs(plain - want_o).max() > CAP_MATTERS  # the cap matters on these inputs
    # softcap None and 0 are no cap
    for off in (None, 0, 0.0):
        got = reference_attention(q, k, v, causal=causal, window=window, softcap=off, **segs)
        np.testing.assert_allclose(np.asarray(got), plain, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_backward_equals_autodiff(name):
    """attention_backward (P recomputed from o and lse, dS times 1 - tanh^2) against jax.vjp of
    attention, whose tanh autodiff differentiates independently."""
    b, t, n, kh, h, causal, window, packed = REFERENCE_CASES[name]
    q, k, v = _qkv(b, t, n, kh, h, seed=10 + len(name))
    do = _normal(99, q.shape)
    seg = _packed(b, t) if packed else None
    kw = dict(causal=causal, window=window, softcap=SOFTCAP, q_segment_ids=seg, kv_segment_ids=seg)
    (o, lse), vjp = jax.vjp(functools.partial(reference_attention, return_lse=True, **kw), q, k, v)
    want = vjp((do, jnp.zeros_like(lse)))
    got = reference_attention_backward(q, k, v, o, lse, do, **kw)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=TOL, atol=TOL, err_msg=what)
    # without the cap's derivative dq and dk would be O(1) off: the uncapped backward on the capped o, lse
    uncapped = reference_attention_backward(q, k, v, o, lse, do, **dict(kw, softcap=None))
    assert np.abs(np.asarray(uncapped[0]) - np.asarray(want[0])).max() > CAP_MATTERS


# ---------------------------------------------------------------------------------------------
# The kernels against the reference.


def _loss(impl, q, k, v, w, u, seg, causal, window, softcap):
    """sum(o * w) + sum(lse * u): both cotangents reach the backward."""
    o, lse = impl(
        q, k, v, causal=causal, window=window, softcap=softcap, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True
    )
    return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (o, lse)


@functools.partial(jax.jit, static_argnames=("impl", "causal", "window", "softcap"), compiler_options=FAST_COMPILE)
def _outputs_and_grads(q, k, v, w, u, seg, *, impl, causal, window, softcap):
    grads, (o, lse) = jax.grad(functools.partial(_loss, impl), argnums=(0, 1, 2), has_aux=True)(
        q, k, v, w, u, seg, causal, window, softcap
    )
    return o, lse, grads


GENERIC = functools.partial(flash_attention, block_q=16, block_k=16)
GENERIC_UNEQUAL = functools.partial(flash_attention, block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
TPU = functools.partial(flash_attention, backend="tpu", interpret=True)

# name: (kernel, B, T, N, K, causal, window, packed); H = 16, T not a multiple of the tiles but 64
KERNEL_CASES = {
    "generic_full_gqa": (GENERIC, 2, 40, 4, 2, False, None, False),
    "generic_causal_gqa": (GENERIC, 2, 40, 4, 2, True, None, False),
    "generic_causal_window": (GENERIC, 2, 40, 4, 2, True, 7, False),
    "generic_causal_packed": (GENERIC, 2, 72, 4, 2, True, None, True),
    "generic_full_packed_unequal_tiles": (GENERIC_UNEQUAL, 2, 72, 2, 1, False, None, True),
    "tpu_causal_gqa": (TPU, 1, 200, 4, 2, True, None, False),
    "tpu_full_gqa_packed": (TPU, 1, 200, 2, 1, False, None, True),
    "tpu_causal_window": (TPU, 1, 300, 2, 1, True, 100, False),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_outputs_lse_and_grads_match_reference(name):
    impl, b, t, n, kh, causal, window, packed = KERNEL_CASES[name]
    q, k, v = _qkv(b, t, n, kh, 16, seed=t + n)
    w, u = _normal(7, (b, t, n, 16)), _normal(8, (b, n, t))
    seg = _packed(b, t) if packed else None
    kw = dict(causal=causal, window=window)
    got = _outputs_and_grads(q, k, v, w, u, seg, impl=impl, softcap=SOFTCAP, **kw)
    want = _outputs_and_grads(q, k, v, w, u, seg, impl=reference_attention, softcap=SOFTCAP, **kw)
    for g, r, what in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), ("o", "lse", "dq", "dk", "dv")):
        assert np.isfinite(np.asarray(g)).all(), what
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=TOL, atol=TOL, err_msg=what)
    plain = _outputs_and_grads(q, k, v, w, u, seg, impl=reference_attention, softcap=None, **kw)
    for p, r, what in zip((plain[0], *plain[2]), (want[0], *want[2]), ("o", "dq", "dk", "dv")):
        assert np.abs(np.asarray(p) - np.asarray(r)).max() > CAP_MATTERS, what


@functools.partial(jax.jit, static_argnames=("causal",), compiler_options=FAST_COMPILE)
def _backward_over_kv_halves(q, k, v, o, lse, do, dlse, *, causal):
    """flash_attention_backward (generic kernel) per kv half with the final o and lse of the whole
    attention, dq summed and dk, dv concatenated, as a ring attention step does."""
    s2 = k.shape[1] // 2
    halves = ((k[:, :s2], v[:, :s2]), (k[:, s2:], v[:, s2:]))
    parts = [
        flash_attention_backward(q, kk, vv, o, lse, do, dlse, causal=causal, softcap=SOFTCAP, block_q=16, block_k=16)
        for kk, vv in halves
    ]
    return (
        parts[0][0] + parts[1][0],
        jnp.concatenate([parts[0][1], parts[1][1]], axis=1),
        jnp.concatenate([parts[0][2], parts[1][2]], axis=1),
    )


def test_per_block_backward_sums_over_kv_halves():
    """The cap's derivative is per score, so the per-block backward with the final (o, lse)
    summed over two kv halves gives the whole attention's gradients (both cotangents)."""
    b, t, s, n, kh, h = 1, 24, 48, 4, 2, 16
    q, k, v = _qkv(b, t, n, kh, h, seed=5, s=s)
    do, dlse = _normal(6, (b, t, n, h)), _normal(7, (b, n, t))
    ref = functools.partial(reference_attention, softcap=SOFTCAP, return_lse=True)
    (o, lse), vjp = jax.vjp(ref, q, k, v)
    got = _backward_over_kv_halves(q, k, v, o, lse, do, dlse, causal=False)
    for g, w, what in zip(got, vjp((do, dlse)), ("dq", "dk", "dv")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=TOL, atol=TOL, err_msg=what)


def test_softcap_zero_is_no_cap_in_the_kernel():
    q, k, v = _qkv(1, 32, 2, 1, 16, seed=4)
    off = flash_attention(q, k, v, causal=True, softcap=0, block_q=16, block_k=16)
    np.testing.assert_allclose(
        np.asarray(off), np.asarray(reference_attention(q, k, v, causal=True)), rtol=TOL, atol=TOL
    )


# ---------------------------------------------------------------------------------------------
# Platforms: the Mosaic GPU kernels give way, the generic kernel lowers through Triton, the TPU
# kernel compiles through Mosaic.


def test_softcap_keeps_the_mosaic_gpu_kernels_out(monkeypatch):
    """On a Hopper GPU a supported call plans the Mosaic GPU kernels for CUDA; with a soft-cap
    (which they do not implement) the plan has no Mosaic GPU branch and CUDA runs the generic one."""
    from jaxsys.kernels.flash_attention import kernel_mgpu

    monkeypatch.setattr(kernel_mgpu, "gpu_capability", lambda: (9, 0))
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    blocks = dict(block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None)

    def variants(softcap):
        plan, _, _ = kernel._prepare(
            q,
            q,
            q,
            None,
            None,
            causal=True,
            softmax_scale=None,
            interpret=None,
            backend=None,
            softcap=softcap,
            **blocks,
        )
        return {variant for _, variant, _ in plan.branches}

    assert "mosaic_gpu" in variants(None)  # the control: this call would take them
    assert variants(SOFTCAP) == {"generic", "tpu"}


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_lowers_through_triton_for_a_gpu_ahead_of_time():
    """As tests/test_flash_attention.py's test (no GPU here; the Pallas -> Triton lowering runs in
    Python): with a soft-cap, grad of flash_attention for an abstract H100 at a shape the Mosaic
    GPU kernels take (bf16, H=128, T=1024) lowers the three Triton kernels (tanh included)."""
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True, interpret=False, softcap=50.0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # fwd, dq, dk/dv
    assert "mosaic_gpu" not in text


def test_tpu_kernels_compile_for_a_tpu_ahead_of_time():
    """grad of flash_attention with a soft-cap compiled for a v5p topology by libtpu (Mosaic accepts
    the tanh in all three kernels): three Mosaic custom calls."""
    from jaxsys.analysis import targets
    from jaxsys.kernels.flash_attention.tpu_compile import CUSTOM_CALL, compile_case, tpu_mesh

    if not targets.has_libtpu():
        pytest.skip("needs libtpu (the TPU compiler): pip install -e '.[tpu]'")
    with targets.quiet_libtpu():
        compiled = compile_case(
            tpu_mesh("v5p:2x2x1"), 512, 128, jnp.bfloat16, backward=True, heads=4, kv_heads=2, softcap=50.0
        )
    assert compiled.as_text().count(CUSTOM_CALL) == 3


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("softcap", [-1.0, "x", True, float("nan"), float("inf"), [2.0]])
def test_bad_softcap_is_named(softcap):
    q = jnp.zeros((1, 16, 2, 16))
    for attend in (flash_attention, reference_attention):
        with pytest.raises(ValueError, match=r"softcap=.*positive number c .* or None \(or 0\) for no cap"):
            attend(q, q, q, softcap=softcap)
    with pytest.raises(ValueError, match=r"softcap="):
        flash_attention_backward(q, q, q, q, jnp.zeros((1, 2, 16)), q, softcap=softcap)


def test_mosaic_gpu_backend_with_softcap_names_the_fix():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"backend='mosaic_gpu' has no logit soft-capping .*backend=None"):
        flash_attention(q, q, q, causal=True, softcap=SOFTCAP, backend="mosaic_gpu")
