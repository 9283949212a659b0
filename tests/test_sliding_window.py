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


# ---------------------------------------------------------------------------------------------
# Serving: the paged kernels' window, and the engine.


def _numpy_decode(q, keys, values, length, window):
    """fp64 attention of one decode query q [N, H] over keys/values [L, K, H] at positions
    length - window .. length - 1."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    n, h = q.shape
    kh = keys.shape[1]
    lo = max(length - window, 0)
    sc = np.einsum("kgh,skh->kgs", q.reshape(kh, n // kh, h), keys[lo:length]) / np.sqrt(h)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("kgs,skh->kgh", p / p.sum(-1, keepdims=True), values[lo:length]).reshape(n, h)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_paged_decode_kernels_attend_over_the_window(window):
    """The per-row paged kernel (generic and TPU, interpreted) and the quantized one equal their
    references with the window; the reference equals fp64 NumPy over the row's last W positions;
    NaN in the pages before every row's window does not reach the output (never read)."""
    from jaxsys.kernels.paged_attention import kernel, kernel_quant, quant
    from jaxsys.kernels.paged_attention import reference as paged_ref
    from tests.test_paged_attention import _case

    args = _case(b=4, n=4, k=2, h=128, page_size=8, max_pages=4, lengths=[1, 9, 27, 32])
    q, kp, vp, table, lengths = args
    want = paged_ref.paged_attention_reference(*args, window=window)
    for b in range(4):
        rows = [int(table[b, p // 8]) for p in range(int(lengths[b]))]
        keys, values = kp[np.asarray(rows), np.arange(len(rows)) % 8], vp[np.asarray(rows), np.arange(len(rows)) % 8]
        np.testing.assert_allclose(want[b], _numpy_decode(q[b], keys, values, int(lengths[b]), window), atol=1e-5)
    poisoned_k, poisoned_v = np.asarray(kp).copy(), np.asarray(vp).copy()
    for b in range(4):  # the pages wholly before row b's window
        for page in range(max(int(lengths[b]) - window, 0) // 8):
            poisoned_k[int(table[b, page])] = np.nan
            poisoned_v[int(table[b, page])] = np.nan
    for backend in ("generic", "tpu"):
        run = lambda k_, v_: kernel.paged_attention(
            q, k_, v_, table, lengths, backend=backend, interpret=True, window=window
        )
        np.testing.assert_allclose(run(kp, vp), want, rtol=1e-5, atol=1e-5, err_msg=backend)
        got = run(jnp.asarray(poisoned_k), jnp.asarray(poisoned_v))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend + " poisoned")
    qp = quant.quantize_pages(kp, vp, "kivi4", jnp.float32)
    kw = dict(mode="kivi4", residual=1, window=window)
    got = kernel_quant.paged_attention_quant(q, kp, vp, qp, table, table, lengths, interpret=True, **kw)
    want_q = quant.paged_attention_quant_reference(q, kp, vp, qp, table, table, lengths, **kw)
    np.testing.assert_allclose(got, want_q, rtol=1e-5, atol=1e-5)
    if window < 27:
        full = paged_ref.paged_attention_reference(*args)
        assert np.abs(np.asarray(full) - np.asarray(want)).max() > 1e-2


@pytest.mark.parametrize("window", [3, 12])
def test_ragged_kernels_attend_over_the_window(window):
    """The ragged kernels (generic and TPU, interpreted; and the quantized one) equal their
    references with the window, and the reference equals fp64 NumPy per query row (decodes,
    prefill chunks crossing pages); rows past the window's pages read none of them."""
    from jaxsys.kernels.paged_attention import ragged
    from tests.test_ragged_paged_attention import _case, _quant_case

    args = _case(n=4, k=2, h=128, page_size=8)
    q, kp, vp, table, cu, lens, ns = args
    want = ragged.ragged_paged_attention_reference(*args, window=window)
    for s in range(int(ns)):
        length, q_len = int(lens[s]), int(cu[s + 1] - cu[s])
        rows = np.asarray([int(table[s, p // 8]) for p in range(length)])
        keys, values = kp[rows, np.arange(length) % 8], vp[rows, np.arange(length) % 8]
        for j in range(q_len):
            got_row = want[int(cu[s]) + j]
            pos = length - q_len + j
            np.testing.assert_allclose(
                got_row, _numpy_decode(q[int(cu[s]) + j], keys, values, pos + 1, window), atol=1e-5
            )
    poisoned_k, poisoned_v = np.asarray(kp).copy(), np.asarray(vp).copy()
    for s in range(int(ns)):  # pages wholly behind the window of the sequence's first query
        first = int(lens[s]) - int(cu[s + 1] - cu[s])
        for page in range(max(first - window + 1, 0) // 8):
            poisoned_k[int(table[s, page])] = poisoned_v[int(table[s, page])] = np.nan
    assert np.isnan(poisoned_k).any()
    for backend in ("generic", "tpu"):
        run = lambda k_, v_: ragged.ragged_paged_attention(
            q, k_, v_, table, cu, lens, ns, backend=backend, block_q=8, interpret=True, window=window
        )
        np.testing.assert_allclose(run(kp, vp), want, rtol=1e-5, atol=1e-5, err_msg=backend)
        got = run(jnp.asarray(poisoned_k), jnp.asarray(poisoned_v))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend + " poisoned")
    qargs = _quant_case("int8")
    kw = dict(mode="int8", residual=0, window=window)
    got = ragged.ragged_paged_attention_quant(*qargs, block_q=8, interpret=True, **kw)
    np.testing.assert_allclose(got, ragged.ragged_paged_attention_quant_reference(*qargs, **kw), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(ragged.ragged_paged_attention_reference(*args)) - np.asarray(want)).max() > 1e-2


@pytest.mark.parametrize(
    "cache,gemma",
    [
        pytest.param("paged", False, marks=pytest.mark.slow),
        pytest.param("contiguous", False, marks=pytest.mark.slow),  # CI time
        ("paged", True),
    ],
)
def test_engine_serves_local_layers_past_the_window(cache, gemma):
    """W = 6 and requests of 20 tokens: greedy tokens from the engine (prefill chunks through the
    ragged kernel, then decodes through the per-row one; or the contiguous cache) equal the
    training forward's over the whole sequence with the window mask, and differ from a model
    without the window. gemma: with Gemma 3's pieces too (the local layers' own RoPE base, the
    softmax scale folded into q before the cache, embeddings times sqrt(D), post norms, GeGLU)."""
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from tests.helpers import GEMMA3_PIECES, program_for, small_config

    config = small_config(
        layer_pattern="local,softmax", sliding_window=6, n_kv_heads=4, init_std=0.2, **(GEMMA3_PIECES if gemma else {})
    )
    program = program_for(config)
    params = program.init(3).params
    greedy = {}
    for window in (6, 0):
        m = config.model.copy_and_resolve_references()
        if not window:
            m.layer_pattern, m.sliding_window = "softmax", 0
        forward = jax.jit(lambda p, ids, m=m: transformer.logits(p, ids, m, program.layout, program.specs))
        for prompt in ([5, 17, 29, 41, 53, 65, 77, 89, 101], [7, 3]):
            seq = list(prompt)
            for _ in range(11):
                seq.append(int(np.argmax(np.asarray(forward(params, jnp.asarray([seq]))[0, -1]))))
            greedy[window, len(prompt)] = seq[len(prompt) :]
    assert greedy[6, 9] != greedy[0, 9] or greedy[6, 2] != greedy[0, 2]
    kw = dict(cache="contiguous", max_len=32) if cache == "contiguous" else dict(num_pages=16, page_size=4)
    eng = engine.Engine(program, params, token_budget=16, chunk_size=4, max_seqs=2, **kw)
    a = eng.submit("a", [5, 17, 29, 41, 53, 65, 77, 89, 101], 11)
    b = eng.submit("b", [7, 3], 11)
    eng.run()
    assert (a.generated, b.generated) == (greedy[6, 9], greedy[6, 2])


def test_decode_roofline_reads_the_window():
    """The decode analysis prices a local layer's KV read at min(S, W) positions: with half the
    layers windowed (W = 16), a row at S = 1024 reads (1024 + 16) / 2 positions a layer."""
    from jaxsys.analysis import decode, hardware
    from tests.helpers import small_config

    hw = hardware.profile("h100")
    plain = decode.DecodeStep.for_config(small_config(), hw)
    local = decode.DecodeStep.for_config(small_config(layer_pattern="local,softmax", sliding_window=16), hw)
    assert plain.read_context(1024) == 1024 and local.read_context(1024) == (1024 + 16) / 2
    assert local.read_context(8) == 8
    report = decode.decode_report(small_config(layer_pattern="local,softmax", sliding_window=16), hw, [1024], [1])
    want = local.times(1, (1024 + 16) / 2)[0]
    assert report["rows"][0]["memory_s"] == pytest.approx(want) and want < plain.times(1, 1024)[0]


def test_decode_capacity_counts_the_ring():
    """Every layer local and rolling pages on: a sequence holds R pages whatever its length, so the
    decode analysis's KV per sequence and batch that fits use min(S, R page_size); off, or with a
    global layer, all S."""
    from jaxsys.analysis import decode, hardware
    from jaxsys.serve import scheduler
    from tests.helpers import small_config

    hw = hardware.profile("h100")
    local = small_config(layer_pattern="local", sliding_window=16)
    ring = scheduler.ring_pages(local.model, local.serve.page_size, local.serve.chunk_size)
    held = ring * local.serve.page_size
    assert 16 < held < 1024
    report = decode.decode_report(local, hw, [1024], [1])
    assert report["kv_bytes_per_sequence"][1024] == held * report["kv_bytes_per_token"]
    local.serve.rolling = False
    assert (
        decode.decode_report(local, hw, [1024], [1])["kv_bytes_per_sequence"][1024]
        == 1024 * report["kv_bytes_per_token"]
    )
    mixed = small_config(layer_pattern="local,softmax", sliding_window=16)
    assert decode.held_context(mixed)(1024) == 1024


def test_local_gemma_layers_under_a_pipeline_match_one_device():
    """Local layers with Gemma 3's pieces split over pipe 2 x data 2 (two micro-batches; each
    stage holds whole periods of 'local,softmax'): loss and gradients equal one device's."""
    from tests.helpers import GEMMA3_PIECES, assert_trees_close_leafwise, loss_and_grads, small_config

    kw = dict(GEMMA3_PIECES, layer_pattern="local,softmax", sliding_window=8, n_layers=4, n_kv_heads=4)
    piped = small_config({"pipe": 2, "data": 2}, **kw)
    piped.train.microbatches = 2
    (want_loss, want), (got_loss, got) = loss_and_grads(small_config(**kw)), loss_and_grads(piped)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(got, want, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


@pytest.mark.parametrize(
    "allocation,extra",
    [
        ("on_demand", {}),
        pytest.param("reserve", {}, marks=pytest.mark.slow),
        pytest.param("on_demand", dict(decode_steps=4), marks=pytest.mark.slow),
        pytest.param("on_demand", dict(overlap=True), marks=pytest.mark.slow),
    ],
)
def test_rolling_pages_serve_a_windowed_model_in_a_ring(allocation, extra):
    """Every layer local (W = 6, pages of 4, chunks of 4): each sequence holds R = (6 + 4 - 2) // 4
    + 2 = 4 pages, used in a ring, instead of the 7 its 25 tokens span. Two such sequences run
    together in a pool of 8 pages (without the ring one would wait or be preempted), and their
    greedy tokens equal the training forward's over the whole sequence and the engine's without
    the ring. The same with multi-step decoding (the device loop's writes go round the ring) and
    with overlapped scheduling."""
    from jaxsys.models import transformer
    from jaxsys.serve import engine, scheduler
    from tests.helpers import program_for, small_config

    config = small_config(layer_pattern="local", sliding_window=6, n_kv_heads=4, init_std=0.2)
    program = program_for(config)
    params = program.init(3).params
    forward = jax.jit(lambda p, ids: transformer.logits(p, ids, config.model, program.layout, program.specs))
    prompts = {"a": [5, 17, 29, 41, 53, 65, 77, 89, 101], "b": [7, 3, 250, 9, 9, 14, 2, 8, 61]}
    want = {}
    for name, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(16):
            seq.append(int(np.argmax(np.asarray(forward(params, jnp.asarray([seq]))[0, -1]))))
        want[name] = seq[len(prompt) :]
    assert scheduler.ring_pages(config.model, 4, 4) == 4
    kw = dict(page_size=4, token_budget=16, chunk_size=4, max_seqs=2, allocation=allocation, **extra)
    ring = engine.Engine(program, params, num_pages=8, **kw)
    assert ring.ring == 4 and not ring.prefix_cache
    requests = {name: ring.submit(name, prompt, 16) for name, prompt in prompts.items()}
    most = 0
    while not ring.idle or ring.inflight is not None:
        ring.step()
        most = max(most, ring.pools[0].used_pages)
        assert all(len(set(ring.pools[0].table(r.id))) <= 4 for r in ring.schedulers[0].running)
    assert {name: r.generated for name, r in requests.items()} == want
    assert most == 8 and ring.schedulers[0].preemptions == 0  # both sequences at once, 4 pages each
    assert ring.stats["loop_steps"] > 0 if extra.get("decode_steps") else True
    assert ring.pools[0].free_pages == 8
    plain = engine.Engine(program, params, num_pages=16, rolling=False, **kw)
    assert plain.ring == 0
    again = {name: plain.submit(name, prompt, 16) for name, prompt in prompts.items()}
    plain.run()
    assert {name: r.generated for name, r in again.items()} == want
    # a model with a global layer keeps every page
    assert scheduler.ring_pages(small_config(layer_pattern="local,softmax", sliding_window=6).model, 4, 4) == 0


@pytest.mark.parametrize("preemption", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_rolling_pages_survive_preemption(preemption):
    """A pool of 6 pages cannot hold two rings of 4: the younger sequence is preempted (recomputed,
    or its 4 ring pages copied to host memory and back) and still decodes the training forward's
    greedy tokens."""
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from tests.helpers import program_for, small_config

    config = small_config(layer_pattern="local", sliding_window=6, n_kv_heads=4, init_std=0.2)
    program = program_for(config)
    params = program.init(3).params
    forward = jax.jit(lambda p, ids: transformer.logits(p, ids, config.model, program.layout, program.specs))
    prompts = {"a": [5, 17, 29, 41, 53, 65, 77, 89, 101], "b": [7, 3, 250, 9, 9, 14, 2, 8, 61]}
    eng = engine.Engine(
        program,
        params,
        num_pages=6,
        page_size=4,
        token_budget=16,
        chunk_size=4,
        max_seqs=2,
        preemption=preemption,
        max_len=32,  # longer than the pool holds: the ring holds the window
    )
    requests = {name: eng.submit(name, prompt, 16) for name, prompt in prompts.items()}
    eng.run()
    assert eng.schedulers[0].preemptions > 0
    for name, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(16):
            seq.append(int(np.argmax(np.asarray(forward(params, jnp.asarray([seq]))[0, -1]))))
        assert requests[name].generated == seq[len(prompt) :], name
    assert eng.pools[0].free_pages == 6
