"""Each layer function against a direct reference, and the whole model against an unstacked,
loop-per-layer reference written from the formulas."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys.config import base_config
from jaxsys.models import layers, transformer
from jaxsys.models.params import init_params
from jaxsys.parallel import tensor
from jaxsys.sharding import Layout

RNG = np.random.default_rng(0)


def normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_rms_norm():
    x, scale = normal(2, 5, 16), normal(16)
    want = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(layers.rms_norm(x, scale, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_rope_is_complex_rotation_of_half_pairs():
    b, t, n, h = 2, 7, 3, 8
    x, pos = normal(b, t, n, h), np.arange(t) + 3
    freqs = 10000.0 ** (-np.arange(h // 2) / (h // 2))
    z = (x[..., : h // 2] + 1j * x[..., h // 2 :]) * np.exp(1j * pos[None, :, None, None] * freqs)
    want = np.concatenate([z.real, z.imag], axis=-1)
    np.testing.assert_allclose(layers.rope(x, jnp.asarray(pos), 10000.0), want, rtol=1e-4, atol=1e-5)


def test_rope_scaling_frequencies():
    """'linear' divides every frequency by the factor; 'llama3' (Llama 3.1, golden-tested against
    transformers in tests/test_convert.py) keeps the fast ones, divides the slow ones and blends the
    band between: here theta 5e5, H = 16, original context 64 puts one frequency in each regime."""
    base = np.asarray(layers.rope_frequencies(16, 5e5))
    linear = layers.RopeScaling("linear", factor=4.0)
    np.testing.assert_allclose(np.asarray(layers.rope_frequencies(16, 5e5, linear)), base / 4, rtol=1e-6)
    llama3 = layers.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    got = np.asarray(layers.rope_frequencies(16, 5e5, llama3))
    wavelength = 2 * np.pi / base
    assert wavelength[0] < 64 / 4 < wavelength[1] < 64 < wavelength[2]
    s = (64 / wavelength[1] - 1) / (4 - 1)
    want = np.concatenate([base[:1], [(1 - s) * base[1] / 8 + s * base[1]], base[2:] / 8])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_yarn_frequencies_and_magnitude():
    """YaRN (golden-tested against transformers in tests/test_convert.py): per index i of the H/2,
    the frequency theta^(-2i/H) is kept where it turns more than beta_fast times over the original
    context, divided by the factor where fewer than beta_slow times, linearly blended in i between;
    here H = 16, theta 1e4, context 64, betas 32 / 1: the ramp's ends, the indices at 32 and 1
    turns rounded out and clipped to [0, H - 1], are 0 and 3: i = 0 kept, 1 and 2 at 1/3 and 2/3,
    3.. divided. Without truncation the ends are the unrounded indices. cos and sin carry
    0.1 ln(factor) + 1."""
    base = np.asarray(layers.rope_frequencies(16, 1e4))
    index_of = lambda turns: 16 * np.log(64 / (turns * 2 * np.pi)) / (2 * np.log(1e4))
    assert index_of(32.0) < 0 and 2 < index_of(1.0) < 3
    yarn = layers.RopeScaling("yarn", 4.0, original_max_position=64)
    weight = np.asarray([0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    want = base * (1 - weight) + base / 4 * weight
    np.testing.assert_allclose(np.asarray(layers.rope_frequencies(16, 1e4, yarn)), want, rtol=1e-6)
    untruncated = dataclasses.replace(yarn, truncate=False, beta_fast=8.0, beta_slow=2.0)
    weight = np.clip((np.arange(8) - index_of(8.0)) / (index_of(2.0) - index_of(8.0)), 0, 1)
    want = base * (1 - weight) + base / 4 * weight
    np.testing.assert_allclose(np.asarray(layers.rope_frequencies(16, 1e4, untruncated)), want, rtol=1e-6)
    assert yarn.magnitude == pytest.approx(0.1 * np.log(4) + 1)
    assert dataclasses.replace(yarn, attention_factor=1.5).magnitude == 1.5
    x = jnp.asarray(RNG.normal(size=(1, 5, 2, 16)), jnp.float32)
    pos = jnp.arange(5)
    unscaled = layers.rope(x, pos, 1e4, dataclasses.replace(yarn, attention_factor=1.0))
    np.testing.assert_allclose(layers.rope(x, pos, 1e4, yarn), unscaled * yarn.magnitude, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"rope_scaling": "ntk"}, r"rope_scaling='ntk': choose one of \('none', 'linear', 'llama3', 'yarn'\)"),
        ({"rope_scaling": "yarn", "rope_factor": 4.0, "rope_beta_slow": 40.0}, "need 0 < beta_slow < beta_fast"),
        ({"rope_scaling": "yarn", "rope_factor": 4.0, "rope_attention_factor": -1.0}, "rope_attention_factor=-1.0"),
        ({"rope_scaling": "yarn", "rope_original_max_position": 0}, "rope_original_max_position=0"),
        ({"rope_scaling": "linear", "rope_factor": 0.0}, "rope_factor=0.0 must be > 0"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "need 0 < low < high"),
        ({"rope_scaling": "llama3", "rope_original_max_position": 0}, "rope_original_max_position=0"),
    ],
)
def test_bad_rope_scaling_is_named(settings, match):
    from jaxsys.config import ConfigError, validate

    c = base_config()
    for key, value in settings.items():
        c.model[key] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_rope_scores_depend_only_on_relative_position():
    q, k = normal(1, 1, 1, 16), normal(1, 1, 1, 16)
    score = lambda m, n: float(jnp.sum(layers.rope(q, jnp.array([m]), 1e4) * layers.rope(k, jnp.array([n]), 1e4)))
    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention(causal):
    b, t, n, kv, h = 2, 6, 8, 2, 4
    q, k, v = normal(b, t, n, h), normal(b, t, kv, h), normal(b, t, kv, h)
    want = np.zeros((b, t, n, h), np.float32)
    for head in range(n):
        g = head // (n // kv)  # query heads share key/value heads in contiguous groups
        s = np.einsum("bth,bsh->bts", q[:, :, head], k[:, :, g]) / np.sqrt(h)
        if causal:
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want[:, :, head] = np.einsum("bts,bsh->bth", p, v[:, :, g])
    np.testing.assert_allclose(layers.attention(q, k, v, causal), want, rtol=1e-5, atol=1e-5)


def test_swiglu():
    x, wg, wu, wd = normal(2, 3, 8), normal(8, 12), normal(8, 12), normal(12, 8)
    g = x @ wg
    want = (g / (1 + np.exp(-g)) * (x @ wu)) @ wd
    np.testing.assert_allclose(layers.swiglu(x, wg, wu, wd), want, rtol=1e-4, atol=1e-4)


def _tensor_mesh():
    return jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))


def test_vocab_parallel_cross_entropy_and_gradient():
    logits, targets = normal(2, 5, 64) * 3, RNG.integers(0, 64, (2, 5))
    dense = lambda l: optax.softmax_cross_entropy_with_integer_labels(l, targets)
    sharded = jax.shard_map(
        lambda l, t: tensor.cross_entropy(l, t, ("tensor",)),
        mesh=_tensor_mesh(),
        in_specs=(P(None, None, "tensor"), P()),
        out_specs=P(),
        check_vma=False,
    )
    np.testing.assert_allclose(sharded(logits, targets), dense(logits), rtol=1e-5, atol=1e-6)
    # the gradient is taken per shard, inside the shard_map, as the train step does
    local_grad = lambda l, t: jax.grad(lambda l: jnp.sum(tensor.cross_entropy(l, t, ("tensor",))))(l)
    g_sharded = jax.shard_map(
        local_grad,
        mesh=_tensor_mesh(),
        in_specs=(P(None, None, "tensor"), P()),
        out_specs=P(None, None, "tensor"),
        check_vma=False,
    )(logits, targets)
    g_dense = jax.grad(lambda l: jnp.sum(dense(l)))(logits)
    np.testing.assert_allclose(g_sharded, g_dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding(sequence_parallel):
    table, ids = normal(64, 8), RNG.integers(0, 64, (2, 16))
    out_spec = P(None, "tensor") if sequence_parallel else P()
    lookup = jax.shard_map(
        lambda w, i: tensor.embed_lookup(w, i, ("tensor",), ("tensor",) if sequence_parallel else ()),
        mesh=_tensor_mesh(),
        in_specs=(P("tensor"), P()),
        out_specs=out_spec,
        check_vma=False,
    )
    np.testing.assert_allclose(lookup(table, ids), table[ids], rtol=1e-6)


def _reference_token_losses(params, tokens, m):
    """The transformer written out layer by layer, without scan, shard_map or jaxsys.parallel;
    attention is kernels/flash_attention's reference (its own softmax scale and window), Gemma's
    pieces (embed_scale, post_norms, query_pre_attn_scalar, gelu_tanh, local layers' own RoPE
    base, the caps c tanh(x / c) of the scores (the reference's softcap) and of the logits) from
    their formulas."""
    from jaxsys.kernels.flash_attention import reference_attention

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    pos = jnp.arange(inputs.shape[1])
    x = params["embed"][inputs]
    if m.embed_scale:
        x = x * m.d_model**0.5
    kinds = (m.layer_pattern.split(",") * m.n_layers)[: m.n_layers]
    gelu_tanh = lambda a: 0.5 * a * (1 + jnp.tanh((2 / np.pi) ** 0.5 * (a + 0.044715 * a**3)))
    for i in range(m.n_layers):
        w = jax.tree.map(lambda a: a[i], params["layers"])
        h = layers.rms_norm(x, w["attn_norm"], m.norm_eps)
        q, k = jnp.einsum("btd,dnh->btnh", h, w["wq"]), jnp.einsum("btd,dkh->btkh", h, w["wk"])
        v = jnp.einsum("btd,dkh->btkh", h, w["wv"])
        if m.qkv_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        if m.qk_norm:
            q, k = layers.rms_norm(q, w["q_norm"], m.norm_eps), layers.rms_norm(k, w["k_norm"], m.norm_eps)
        local = kinds[i] == "local"
        theta, scaling = m.rope_theta, layers.rope_scaling(m)
        if local and m.rope_local_theta:
            theta, scaling = m.rope_local_theta, layers.RopeScaling()
        q, k = layers.rope(q, pos, theta, scaling), layers.rope(k, pos, theta, scaling)
        scale = (m.query_pre_attn_scalar or m.head_dim) ** -0.5
        o = reference_attention(
            q,
            k,
            v,
            causal=True,
            softmax_scale=scale,
            window=m.sliding_window if local else None,
            softcap=m.attn_logit_softcap or None,
        )
        y = jnp.einsum("btnh,nhd->btd", o, w["wo"])
        x = x + (layers.rms_norm(y, w["attn_out_norm"], m.norm_eps) if m.post_norms else y)
        h = layers.rms_norm(x, w["mlp_norm"], m.norm_eps)
        act = jax.nn.silu if m.mlp_activation == "silu" else gelu_tanh
        y = (act(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        x = x + (layers.rms_norm(y, w["mlp_out_norm"], m.norm_eps) if m.post_norms else y)
    x = layers.rms_norm(x, params["final_norm"], m.norm_eps)
    unembed = params["embed"].T if m.tie_embeddings else params["unembed"]
    logits = x @ unembed
    if m.final_logit_softcap:
        logits = m.final_logit_softcap * jnp.tanh(logits / m.final_logit_softcap)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@pytest.mark.parametrize(
    "tied,remat,qwen3_like,gemma3_like,softcaps",
    [
        (False, "none", False, False, False),
        (True, "none", False, False, False),
        (False, "full", False, False, False),
        (False, "dots", False, False, False),
        (True, "none", True, False, False),
        (True, "none", True, True, False),
        (True, "full", False, True, True),
    ],
)
def test_model_matches_unstacked_reference(tied, remat, qwen3_like, gemma3_like, softcaps):
    """qwen3_like: q/k norms (config.model.qk_norm), q/k/v biases (qkv_bias: Qwen2's, here with
    the norms to run both) and Llama 3.1's rope scaling. gemma3_like adds Gemma 3's pieces: local
    layers with a window and their own RoPE base, embeddings times sqrt(D), GeGLU, post norms and
    a softmax scale of query_pre_attn_scalar^-0.5; softcaps Gemma 2's soft-capping of the attention
    scores and of the logits (caps small enough to matter here: checked)."""
    c = base_config()
    c.model.tie_embeddings, c.model.remat = tied, remat
    c.model.n_layers, c.model.d_model, c.model.d_ff = 3, 32, 64
    if qwen3_like:
        c.model.qk_norm, c.model.qkv_bias, c.model.rope_scaling, c.model.rope_factor = True, True, "llama3", 8.0
        c.model.rope_original_max_position = 64
    if gemma3_like:
        c.model.layer_pattern, c.model.sliding_window, c.model.rope_local_theta = "local,local,softmax", 5, 1e4
        c.model.rope_theta, c.model.embed_scale, c.model.mlp_activation = 1e6, True, "gelu_tanh"
        c.model.post_norms, c.model.query_pre_attn_scalar = True, 24.0
    if softcaps:
        c.model.attn_logit_softcap, c.model.final_logit_softcap = 0.2, 0.05
    layout = Layout.from_config(c)
    specs = transformer.param_specs(c.model)
    params = init_params(specs, jax.random.key(1), jnp.float32)
    params["layers"]["attn_norm"] = params["layers"]["attn_norm"] * 1.5  # not all ones
    if qwen3_like:
        params["layers"]["q_norm"] = params["layers"]["q_norm"] * jnp.linspace(0.5, 2.0, c.model.head_dim)
        params["layers"]["k_norm"] = params["layers"]["k_norm"] * 1.7
        for i, name in enumerate(("bq", "bk", "bv")):  # zeros at initialisation
            params["layers"][name] = jax.random.normal(jax.random.key(10 + i), params["layers"][name].shape)
    if gemma3_like:
        params["layers"]["attn_out_norm"] = params["layers"]["attn_out_norm"] * 0.7
        params["layers"]["mlp_out_norm"] = params["layers"]["mlp_out_norm"] * jnp.linspace(0.5, 1.5, 32)
    if softcaps:  # scores of order 1 at init_std 0.02 need larger q/k projections
        params["layers"]["wq"], params["layers"]["wk"] = params["layers"]["wq"] * 10, params["layers"]["wk"] * 10
    tokens = jnp.asarray(RNG.integers(0, 256, (2, 17)))
    loss = jax.jit(jax.value_and_grad(lambda p: jnp.mean(transformer.token_losses(p, tokens, c.model, layout)[0])))
    ref = jax.jit(jax.value_and_grad(lambda p: jnp.mean(_reference_token_losses(p, tokens, c.model))))
    (got_loss, got_grads), (want_loss, want_grads) = loss(params), ref(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    if softcaps:  # the caps' tanh' factors make cancelling sums (an entry 1e-7 off at 2e-2 seen): per-leaf atol
        from tests.helpers import assert_trees_close_leafwise

        assert_trees_close_leafwise(got_grads, want_grads, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())
    else:
        chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-4, atol=1e-7)
    if softcaps:  # each cap changes the loss by 10x the tolerance above or more: the check has teeth
        for key in ("attn_logit_softcap", "final_logit_softcap"):
            m = c.model.copy_and_resolve_references()
            m[key] = 0.0
            uncapped = jnp.mean(transformer.token_losses(params, tokens, m, layout)[0])
            assert abs(float(uncapped) - float(want_loss)) > 10 * 1e-5 * abs(float(want_loss)), key


def test_bfloat16_compute_stays_close_to_float32():
    c = base_config()
    layout = Layout.from_config(c)
    params = init_params(transformer.param_specs(c.model), jax.random.key(2), jnp.float32)
    tokens = jnp.asarray(RNG.integers(0, 256, (2, 33)))
    mean_loss = lambda m: jax.jit(lambda p: jnp.mean(transformer.token_losses(p, tokens, m, layout)[0]))(params)
    f32 = mean_loss(c.model)
    c.model.compute_dtype = "bfloat16"
    bf16 = mean_loss(c.model)
    assert bf16.dtype == jnp.float32  # the loss is always accumulated in fp32
    np.testing.assert_allclose(bf16, f32, rtol=2e-2)  # bf16 has 8 mantissa bits


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_qk_norm_and_qkv_bias_sharded_match_one_device(sequence_parallel):
    """q/k norms and q/k/v biases (config.model.qk_norm, qkv_bias) on data 2 x fsdp 2 x tensor 2,
    with and without sequence parallelism: the [H] scales are whole on every rank (tensor splits
    heads, not H) and each rank's gradient of them covers its own heads only, so it is summed over
    tensor (ParamSpec.partial; without SP nothing else sums it), the biases split over heads with
    their projections; loss and gradients equal one device's, the norms' and biases' gradients
    included. With YaRN's rope scaling (Qwen3's long context): its frequencies and the attention
    factor on q and k are the same on every rank."""
    from tests.helpers import assert_trees_close_leafwise, loss_and_grads, small_config

    kw = dict(
        qk_norm=True, qkv_bias=True, n_kv_heads=4, rope_scaling="yarn", rope_factor=4.0, rope_original_max_position=8
    )
    one = small_config(**kw)
    sharded = small_config({"data": 2, "fsdp": 2, "tensor": 2}, **kw)
    sharded.parallel.sequence_parallel = sequence_parallel
    (want_loss, want), (got_loss, got) = loss_and_grads(one), loss_and_grads(sharded)
    assert min(np.abs(want["layers"][k]).max() for k in ("q_norm", "k_norm", "bq", "bk", "bv")) > 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(got, want, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


def test_gemma3_pieces_sharded_match_one_device():
    """Gemma 3's pieces (embeddings times sqrt(D), GeGLU, post norms, query_pre_attn_scalar, local
    layers with a window and their own RoPE base, q/k norms) on data 2 x fsdp 2 x tensor 2 with
    sequence parallelism and the Pallas kernel: loss and gradients equal one device's reference
    (the post norms' gradients included, and nonzero)."""
    from tests.helpers import GEMMA3_PIECES, assert_trees_close_leafwise, loss_and_grads, small_config

    kw = dict(GEMMA3_PIECES, n_kv_heads=4, layer_pattern="local,softmax", sliding_window=8)
    one = small_config(**kw)
    sharded = small_config({"data": 2, "fsdp": 2, "tensor": 2}, attention_impl="pallas", **kw)
    sharded.parallel.sequence_parallel = True
    (want_loss, want), (got_loss, got) = loss_and_grads(one), loss_and_grads(sharded)
    assert min(np.abs(want["layers"][k]).max() for k in ("attn_out_norm", "mlp_out_norm")) > 0
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close_leafwise(got, want, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())
