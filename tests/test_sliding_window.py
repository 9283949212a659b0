"""Sliding-window attention (config.model.layer_pattern 'local', config.model.sliding_window W: a
query sees its last W keys, its own included): the reference mask against a NumPy statement, the
flash kernels (generic and TPU, interpret mode) against the reference, outputs, lse and gradients,
with the kv blocks outside every row's window never visited; cuDNN's window convention (through
jax.nn's XLA path, which shares it); the model with local layers against one device and across
attention implementations; the config's errors.

Tolerances as in tests/test_flash_attention.py: fp32 kernel against reference 1e-5 (same terms,
another summation order); a wrong window edge changes outputs by O(1e-1).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels.flash_attention import flash_attention, reference_attention
from jaxsys.models import layers

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(b, t, n, kh, h, seed=0):
    return _normal(seed, (b, t, n, h)), _normal(seed + 1, (b, t, kh, h)), _normal(seed + 2, (b, t, kh, h))


def _numpy_window_attention(q, k, v, window):
    """softmax over keys t - W < s <= t, float64, GQA by repeating kv heads."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    g = n // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    scores = np.where((cols <= rows) & (cols > rows - window), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_reference_and_layers_attention_equal_numpy(window):
    q, k, v = _qkv(2, 24, 4, 2, 8)
    want = _numpy_window_attention(q, k, v, window)
    np.testing.assert_allclose(reference_attention(q, k, v, causal=True, window=window), want, atol=1e-5)
    np.testing.assert_allclose(layers.attention(q, k, v, window=window), want, atol=1e-5)
    # decoding's mask (slot s holds position s): the same rows
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    np.testing.assert_allclose(layers.attention(q, k, v, q_positions=positions, window=window), want, atol=1e-5)
    if window < 24:  # the window matters
        assert np.abs(_numpy_window_attention(q, k, v, 24) - want).max() > 1e-2


def test_cudnn_window_convention():
    """attention.py hands cuDNN local_window_size = (W - 1, 0); jax.nn's XLA implementation
    reads the argument the same way, so it must give the reference's window."""
    q, k, v = _qkv(1, 20, 2, 2, 8)
    got = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(6 - 1, 0), implementation="xla")
    np.testing.assert_allclose(got, _numpy_window_attention(q, k, v, 6), atol=1e-5)


def _loss(impl, q, k, v, w, u, window, seg):
    o, lse = impl(q, k, v, causal=True, window=window, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
    return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (o, lse)


@functools.partial(jax.jit, static_argnames=("impl", "window"), compiler_options=FAST_COMPILE)
def _outputs_and_grads(q, k, v, w, u, seg, *, impl, window):
    grads, (o, lse) = jax.grad(functools.partial(_loss, impl), argnums=(0, 1, 2), has_aux=True)(
        q, k, v, w, u, window, seg
    )
    return o, lse, grads


GENERIC = functools.partial(flash_attention, block_q=16, block_k=16)
GENERIC_UNEQUAL = functools.partial(flash_attention, block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
TPU = functools.partial(flash_attention, backend="tpu", interpret=True)

# name: (kernel, T, window, packed segments)
CASES = {
    "generic_w1": (GENERIC, 40, 1, False),  # only the diagonal
    "generic_w7_ragged": (GENERIC, 40, 7, False),  # W < tile, T not a multiple of it
    "generic_w20_unequal": (GENERIC_UNEQUAL, 64, 20, False),  # W straddles tiles of 16 and 32
    "generic_w32_packed": (GENERIC, 64, 32, True),  # W a multiple of the tile, with documents
    "generic_w_past_t": (GENERIC, 40, 64, False),  # W >= T: plain causal
    "tpu_w100": (TPU, 384, 100, False),  # 128-wide tiles
    "tpu_w200_packed": (TPU, 300, 200, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_outputs_lse_and_grads_match_reference(name):
    kernel, t, window, packed = CASES[name]
    b, n, kh, h = (2, 4, 2, 16) if kernel is not TPU else (1, 2, 1, 16)
    q, k, v = _qkv(b, t, n, kh, h, seed=t + window)
    w, u = _normal(7, (b, t, n, h)), _normal(8, (b, n, t))
    seg = None
    if packed:  # documents of 23 / 41 / rest tokens, shifted per row
        ids = np.zeros((b, t), np.int32)
        for row in range(b):
            ids[row, 23 + row :] += 1
            ids[row, 64 + row :] += 1
        seg = jnp.asarray(ids)
    got = _outputs_and_grads(q, k, v, w, u, seg, impl=kernel, window=window)
    want = _outputs_and_grads(q, k, v, w, u, seg, impl=reference_attention, window=window)
    for g, r, what in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), ("o", "lse", "dq", "dk", "dv")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=what)
    if window < t:  # and the window is not causal attention
        plain = _outputs_and_grads(q, k, v, w, u, seg, impl=reference_attention, window=t)
        assert np.abs(np.asarray(plain[0]) - np.asarray(want[0])).max() > 1e-2


@pytest.mark.parametrize("kernel", ["generic", "tpu"])
def test_blocks_outside_the_window_are_not_visited(kernel):
    """Keys more than W behind every query of a tile are never read: NaN in the first 128
    positions' q, k and v cannot reach the outputs or gradients of the queries at 128 + W and
    beyond (a computed-then-masked tile gives 0 * NaN = NaN in P V, in dS and in dS^T Q). The
    gradients of those first keys from the late queries are zero, so the late rows are compared
    with the reference on clean inputs."""
    t, window = (512, 128) if kernel == "tpu" else (96, 16)
    impl = TPU if kernel == "tpu" else GENERIC
    first = 128 if kernel == "tpu" else 32  # whole tiles of poison
    q, k, v = _qkv(1, t, 2, 1, 16, seed=3)
    late = np.arange(t) >= first + window + (128 if kernel == "tpu" else 16)  # past the poison's tiles' windows
    w = jnp.where(jnp.asarray(late)[None, :, None, None], _normal(9, (1, t, 2, 16)), 0.0)
    u = jnp.zeros((1, 2, t))
    poison = np.arange(t) < first
    poisoned = tuple(jnp.where(jnp.asarray(poison)[None, :, None, None], jnp.nan, x) for x in (q, k, v))
    got = _outputs_and_grads(*poisoned, w, u, None, impl=impl, window=window)
    want = _outputs_and_grads(q, k, v, w, u, None, impl=reference_attention, window=window)
    for g, r, what in zip((got[0], *got[2]), (want[0], *want[2]), ("o", "dq", "dk", "dv")):
        g, r = np.asarray(g)[:, late], np.asarray(r)[:, late]
        assert np.isfinite(g).all(), what
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=what)


def test_window_needs_causal_and_a_positive_size():
    q, k, v = _qkv(1, 16, 2, 2, 16)
    for kwargs in (dict(causal=False, window=4), dict(causal=True, window=0)):
        with pytest.raises(ValueError, match="sliding window"):
            flash_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="mosaic_gpu.*no sliding window"):
        flash_attention(q, k, v, causal=True, window=4, backend="mosaic_gpu")


# ---------------------------------------------------------------------------------------------
# The model's "local" layers.


def test_local_layers_sharded_and_pallas_match_one_device_reference():
    """layer_pattern 'local,softmax' (W = 8 of T = 32): the Pallas kernel on data 2 x fsdp 2 x
    tensor 2 with sequence parallelism gives one device's reference loss and gradients; with
    W >= T the local layers are the softmax ones (the same loss as an all-softmax model), and W
    changes the loss."""
    from tests.helpers import assert_trees_close_leafwise, loss_and_grads, small_config

    kw = dict(layer_pattern="local,softmax", sliding_window=8, n_kv_heads=4)
    one = small_config(**kw)
    sharded = small_config({"data": 2, "fsdp": 2, "tensor": 2}, attention_impl="pallas", **kw)
    sharded.parallel.sequence_parallel = True
    (want_loss, want), (got_loss, got) = loss_and_grads(one), loss_and_grads(sharded)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(got, want, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())
    wide, _ = loss_and_grads(small_config(**dict(kw, sliding_window=32)))
    plain, _ = loss_and_grads(small_config(n_kv_heads=4))
    assert wide == pytest.approx(plain, rel=1e-6) and abs(wide - want_loss) > 1e-4


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(layer_pattern="local"), "'local' layers need sliding_window > 0"),
        (dict(sliding_window=16), "a sliding window applies to 'local' layers only"),
        (dict(layer_pattern="local", sliding_window=-1), "sliding_window=-1 must be an integer >= 0"),
        (dict(layer_pattern="local", sliding_window=8, mesh_seq=2), "context parallelism .* does not implement"),
    ],
)
def test_bad_window_settings_are_named(settings, match):
    from jaxsys.config import ConfigError, validate
    from tests.helpers import small_config

    settings = dict(settings)
    c = small_config({"seq": settings.pop("mesh_seq")} if "mesh_seq" in settings else None, **settings)
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_training_flops_count_the_window():
    """A local layer's attention spans min(T, W) keys per query in the MFU's FLOP count."""
    from jaxsys.analysis import flops
    from tests.helpers import small_config

    plain, local = small_config(), small_config(layer_pattern="local,softmax", sliding_window=8)
    m, t = plain.model, plain.data.seq_len
    per_layer = 12.0 * m.n_heads * m.head_dim  # per token and key: QK^T and AV, forward and backward
    gap = flops.train_flops_per_token(plain.model, t) - flops.train_flops_per_token(local.model, t)
    assert gap == pytest.approx(per_layer * (t - 8) * (m.n_layers // 2))


def test_engine_serves_local_layers_within_the_window_and_refuses_longer_requests():
    """The KV caches read every cached token, which is the window's attention while a sequence
    fits in it: greedy tokens equal the training forward's (full sequence, window mask) for a
    request of W tokens, and a longer request is refused by name before it is queued."""
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from tests.helpers import program_for, small_config

    config = small_config(layer_pattern="local,softmax", sliding_window=12, n_kv_heads=4, init_std=0.2)
    program = program_for(config)
    params = program.init(3).params
    forward = jax.jit(lambda p, ids: transformer.logits(p, ids, config.model, program.layout, program.specs))
    prompt = [5, 17, 29, 41, 53, 65, 77]
    seq = list(prompt)
    for _ in range(5):
        seq.append(int(np.argmax(np.asarray(forward(params, jnp.asarray([seq]))[0, -1]))))
    eng = engine.Engine(program, params, num_pages=16, page_size=4, token_budget=16, chunk_size=4, max_seqs=2)
    r = eng.submit("a", prompt, 5)
    with pytest.raises(ValueError, match="7 prompt \\+ 6 new tokens exceed the model's sliding window of 12"):
        eng.submit("b", prompt, 6)
    eng.run()
    assert r.generated == seq[len(prompt) :]
