"""Multi-head latent attention (config.model.mla, models/mla.py) through the training step: an
independent NumPy forward of one MLA layer, sharded / pipelined / context-parallel runs equal to one
device's, the FLOP count, greedy decoding through the paged engine, and bad settings refused by
name. Conversion and decoding against transformers' DeepSeek-V2 / V3 are in tests/test_convert.py
and tests/test_generate.py (goldens `deepseek_v2`, `deepseek_v3`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.config import ConfigError, validate
from tests.helpers import assert_trees_close_leafwise, generate_contiguous, loss_and_grads, program_for, small_config

RTOL = 1e-5  # fp32; sharded runs sum in other orders (tests/test_gemma2.py's tolerances)

# the test model's MLA: N = 8 heads of H = 12 (8 nope + 4 rope), values of 8, latents C = 16, Q = 8
MLA = dict(kv_lora_rank=16, q_lora_rank=8, rope_head_dim=4, v_head_dim=8)


def mla_config(mesh=None, mla=None, **model):
    c = small_config(mesh, n_kv_heads=8, head_dim=12, **model)
    for key, value in (MLA if mla is None else mla).items():
        c.model.mla[key] = value
    return c


def _close(got, want):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    assert_trees_close_leafwise(got_grads, want_grads, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(mla_config())


def _numpy_mla_layer(x, w, m, positions):
    """One MLA attention sublayer (its output before the residual add) in NumPy, from the formulas
    of DeepSeek-V2's section 2.1 with the RoPE of layers.rope written out: the independent statement."""
    eps, R, Hv, H = m.norm_eps, m.mla.rope_head_dim, m.mla.v_head_dim, m.head_dim
    norm = lambda a, g, eps=eps: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * g

    def rotate(a):  # the two halves of the last R dims, frequencies theta^(-2i/R)
        half = R // 2
        freqs = m.rope_theta ** (-np.arange(half) * 2.0 / R)
        ang = positions[:, None] * freqs[None]  # [T, R/2]
        cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        x1, x2 = a[..., -R:-half], a[..., -half:]
        return np.concatenate([a[..., :-R], x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    h = norm(x, w["attn_norm"])
    q = np.einsum("btq,qnh->btnh", norm(h @ w["wq_a"], w["q_a_norm"], 1e-6), w["wq_b"])  # DeepSeek's latent eps
    c = norm(h @ w["wkv_a"], w["kv_a_norm"], 1e-6)
    k_rope = (h @ w["wk_rope"])[:, :, None, :].repeat(m.n_heads, 2)
    k = np.concatenate([np.einsum("btc,cnh->btnh", c, w["wk_b"]), k_rope], -1)
    v = np.einsum("btc,cnh->btnh", c, w["wv_b"])
    q, k = rotate(q), rotate(k)
    T = x.shape[1]
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", p, v)
    assert o.shape[-1] == Hv
    return np.einsum("btnh,nhd->btd", o, w["wo"])


def test_one_layer_matches_numpy():
    """transformer.block's attention half (MLP output zeroed) equals the NumPy statement of MLA."""
    from jaxsys.models import transformer
    from jaxsys.sharding import Layout

    c = mla_config(init_std=0.3)
    m = c.model
    p = program_for(c).init(0).params
    w = jax.tree.map(lambda a: np.asarray(a[0], np.float64), p["layers"])
    w["w_down"] = np.zeros_like(w["w_down"])  # the block's MLP adds nothing
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 10, m.d_model)), np.float64)
    positions = np.arange(10)
    got, *_ = transformer.block(
        jnp.asarray(x, jnp.float32),
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), w),
        jnp.asarray(positions),
        m,
        Layout.from_config(c),
    )
    want = x + _numpy_mla_layer(x, w, m, positions.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_sharded_with_the_pallas_kernel_matches_one_device(one_device):
    """data 2 x fsdp 2 x tensor 2 with sequence parallelism: the down-projections replicated over
    tensor and their latent all-gathered, the up-projections' latent rows split over fsdp, values
    padded for the flash kernel."""
    sharded = mla_config({"data": 2, "fsdp": 2, "tensor": 2}, attention_impl="pallas")
    sharded.parallel.sequence_parallel = True
    sharded.parallel.vocab_parallel = True
    _close(loss_and_grads(sharded), one_device)


LITE = dict(MLA, q_lora_rank=0)  # q projected from x directly (DeepSeek-V2-Lite)


@pytest.mark.slow  # nothing in a pipeline or a ring is MLA's own: q, k, v are ordinary by then
@pytest.mark.parametrize("layout", ["pipeline", "ring"])
def test_pipeline_and_context_parallelism_match_one_device(layout):
    """pipe 2 x data 2 (two micro-batches), and ring context parallelism on seq 2 x tensor 2 x
    data 2, each against its one-device run, with q_lora_rank 0."""
    if layout == "pipeline":
        piped = mla_config({"pipe": 2, "data": 2}, mla=LITE, n_layers=4)
        piped.train.microbatches = 2
        _close(loss_and_grads(piped), loss_and_grads(mla_config(mla=LITE, n_layers=4)))
    else:
        cp = mla_config({"seq": 2, "tensor": 2, "data": 2}, mla=LITE, context_parallel="ring")
        _close(loss_and_grads(cp), loss_and_grads(mla_config(mla=LITE)))


def test_flops_count_the_latent_projections():
    """flops.matmul_params counts every MLA matrix a token multiplies with: the parameters of the
    attention leaves (norms excluded), layer by layer."""
    from jaxsys.analysis import flops
    from jaxsys.models import mla, params, transformer

    for q_rank in (0, 8):
        m = mla_config(mla=dict(MLA, q_lora_rank=q_rank)).model
        layer = transformer.param_specs(m)["layers"]
        attention = sum(params.count(layer[name]) for name in mla.param_specs(m, 1.0, 1.0) if "norm" not in name)
        assert mla.matmul_params(m) * m.n_layers == attention
        dense = dict(m.to_dict(), mla=dict(m.mla.to_dict(), kv_lora_rank=0, q_lora_rank=0))
        assert (
            flops.matmul_params(m) - mla.matmul_params(m) * m.n_layers
            == flops.matmul_params(type(m)(dense)) - 2 * m.d_model * m.n_heads * m.head_dim * 2 * m.n_layers
        )


@pytest.mark.parametrize(
    "cache,mesh",
    [
        ("latent", {"tensor": 2, "data": 2}),  # the latent pool whole on each tensor rank
        pytest.param("expanded", None, marks=pytest.mark.slow),  # CI time: the cached forward test has it
        pytest.param("latent", None, marks=pytest.mark.slow),
        pytest.param("expanded", {"tensor": 2, "data": 2}, marks=pytest.mark.slow),
    ],
)
def test_greedy_decoding_through_the_caches_matches_the_forward(cache, mesh):
    """The serving engine's paged cache (and the contiguous one), holding MLA's latent rows or the
    expanded keys and padded values: greedy tokens equal argmax of the training forward re-run on
    the growing sequence."""
    from jaxsys.cache import base as cache_base
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from jaxsys.serve.sampling import Sampling

    config = mla_config(mesh, init_std=0.2)
    config.model.mla.cache = cache
    program = program_for(config)
    params = program.init(3).params
    prompts, n = [[10, 20, 30, 40, 50], [7, 8, 9]], 8
    paged = engine.Engine(program, params, num_pages=16, page_size=4, token_budget=64, chunk_size=32, max_seqs=2)
    m, shards = config.model, 2 if mesh else 1
    # latent: one pool of [C + R = 20 -> 32] rows, 1 "kv head"; expanded: k and v of 8 heads x 16
    rows, kv, width = (1, 1, 32) if cache == "latent" else (2, 8, 16)
    assert len(paged.cache.per_layer()) == rows and (paged.cache.v is None) == (cache == "latent")
    assert paged.cache.k.shape == (m.n_layers, shards * 17, 4, kv, width)
    assert cache_base.token_bytes(m) == rows * m.n_layers * kv * width * 4  # fp32
    got_paged = engine.generate(paged, prompts, n, Sampling())
    got_contiguous = generate_contiguous(program, params, prompts, n, max_len=32)
    if cache == "latent" and mesh:  # pages swapped out and back, and self-speculation's window view
        from jaxsys.serve.speculation import SelfSpeculation

        small = engine.Engine(
            program,
            params,
            num_pages=5,  # a shard's two sequences need 4 + 4 or 3 + 3 pages at the end: preempted
            page_size=4,
            token_budget=64,
            chunk_size=32,
            max_seqs=2,
            preemption="swap",
            drafter=SelfSpeculation(window=4, sink=4),
            k=2,
        )
        assert engine.generate(small, prompts * 2, n, Sampling()) == got_paged * 2
        assert small.stats["swapped_out"] > 0 and small.stats["accepted"] > 0
    one = program_for(mla_config(init_std=0.2))
    host = jax.device_put(jax.tree.map(np.asarray, params), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    fn = jax.jit(lambda p, ids: transformer.logits(p, ids, one.config.model, one.layout, one.specs))
    for prompt, paged_tokens, contiguous_tokens in zip(prompts, got_paged, got_contiguous):
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(jnp.argmax(fn(host, jnp.asarray([seq], jnp.int32))[0, -1])))
        assert paged_tokens == contiguous_tokens == seq[len(prompt) :]


@pytest.fixture(scope="module")
def cached_forward():
    """f(mla.cache, ids [1, T], chunks) -> logits [T, V] of a one-device forward that prefills the
    first chunk into a contiguous cache and then feeds the rest a chunk at a time, with the cache's
    arrays; and the training forward's logits of the same ids."""
    from jaxsys.cache import ContiguousCache
    from jaxsys.models import transformer

    programs = {}

    def run(cache_kind, ids, chunks):
        if cache_kind not in programs:
            c = mla_config(init_std=0.2)
            c.model.mla.cache = cache_kind
            programs[cache_kind] = program_for(c)
        program = programs[cache_kind]
        m, params = program.config.model, program.init(5).params
        step = jax.jit(
            lambda p, tok, pos, cache: transformer.forward(p, tok, pos, m, program.layout, program.specs, cache)
        )
        cache, out, start = ContiguousCache.zeros(program, 1, 16), [], 0
        for size in chunks:
            positions = jnp.arange(start, start + size)[None]
            logits, cache = step(params, ids[:, start : start + size], positions, cache)
            out.append(np.asarray(logits[0]))
            start += size
        full = jax.jit(lambda p, ids: transformer.logits(p, ids, m, program.layout, program.specs))(params, ids)
        return np.concatenate(out), np.asarray(full[0]), cache, params

    return run


def test_latent_cache_logits_equal_the_training_forward(cached_forward):
    """DeepSeek-V2's absorbed form over the latent cache (W_k_b in the query, W_v_b after the
    attention over [c, k_r] rows) gives the logits of the training forward, which expands every
    head's keys and values: a prefill of 6 tokens, then decodes of 1, 1 and 2. The cache holds one
    row of C + R = 20 (padded to 32) per token and layer, no values."""
    ids = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], jnp.int32)
    got, want, cache, params = cached_forward("latent", ids, (6, 1, 1, 2))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale  # fp32: the two forms sum in other orders
    expanded, _, expanded_cache, _ = cached_forward("expanded", ids, (6, 1, 1, 2))
    assert expanded_cache.k.shape[-2:] == (8, 16)
    assert np.abs(expanded - want).max() <= 1e-5 * scale
    # what the latent cache holds: layer 0's rows are c = RMSNorm(RMSNorm(x) W_kv_a) of the
    # embeddings x (NumPy), then the R rotated key dims, then zeros to 32
    assert cache.v is None and cache.k.shape == (2, 1, 16, 1, 32)
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    norm = lambda a, g, eps: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * g
    h = norm(w["embed"][np.asarray(ids[0])], w["layers"]["attn_norm"][0], 1e-5)
    c = norm(h @ w["layers"]["wkv_a"][0], w["layers"]["kv_a_norm"][0], 1e-6)
    rows = np.asarray(cache.k[0, 0, :10, 0])
    np.testing.assert_allclose(rows[:, :16], c, rtol=1e-5, atol=1e-5)
    assert np.abs(rows[:, 16:20]).min() > 0 and not rows[:, 20:].any()


def test_decode_analysis_prices_the_latent_cache():
    """analysis/decode.py on DeepSeek-V2-Lite's shapes at tensor 2: the latent cache's row of
    C + R = 576 per layer, whole on each rank, against 2 N H_c = 2 x 16 x 256 split over the
    ranks; the attention FLOPs in each one's width."""
    from jaxsys.analysis import hardware
    from jaxsys.analysis.decode import DecodeStep, kv_transfer_bytes
    from jaxsys.config import load_config

    steps = {}
    for kind in ("latent", "expanded"):
        c = load_config(
            "configs/deepseek_v2_lite.py",
            ["--config.mesh.fsdp=1", "--config.mesh.tensor=2", f"--config.model.mla.cache={kind}"],
        )
        steps[kind] = DecodeStep.for_config(c, hardware.profile("h100"))
    m = steps["latent"].model
    assert steps["latent"].kv_bytes_per_token == 27 * 576 * 2  # bf16
    assert steps["expanded"].kv_bytes_per_token == 2 * 27 * 16 * 256 * 2 // 2
    assert kv_transfer_bytes(m, 100, 16, tensor=2) == 2 * 112 * 27 * 576 * 2  # each rank the whole latent
    (_, latent_s, _), (_, expanded_s, _) = (steps[k].times(1, 10**6) for k in ("latent", "expanded"))
    matmul = 2 * steps["latent"].matmul_params / steps["latent"].peak
    # attention FLOPs 2 L S N (2 H_c) / t: 576 + 576 per head against 256 + 256 (192 padded)
    assert (latent_s - matmul) / (expanded_s - matmul) == pytest.approx(1152 / 512)


@pytest.mark.parametrize(
    "mla,model,match",
    [
        (dict(MLA), dict(n_kv_heads=4), "n_kv_heads=4 with multi-head latent attention"),
        (dict(MLA, rope_head_dim=12), {}, "rope_head_dim=12 must be even and between 0 and head_dim=12"),
        (dict(MLA, v_head_dim=16), {}, "v_head_dim=16 exceeds head_dim=12"),
        (dict(MLA, kv_lora_rank=0), {}, "q_lora_rank=8 compresses MLA's queries, but MLA is off"),
        (dict(MLA), dict(qk_norm=True), "qk_norm=True with multi-head latent attention"),
        (dict(MLA), dict(layer_pattern="linear,softmax"), "MLA layers are full softmax attention"),
        (dict(MLA, kv_lora_rank=-1), {}, "kv_lora_rank=-1 must be an integer >= 0"),
        (dict(MLA, cache="heads"), {}, "mla.cache='heads': choose one of"),
    ],
)
def test_bad_settings_are_refused_by_name(mla, model, match):
    kw = dict(dict(n_kv_heads=8, head_dim=12), **model)
    c = small_config(**kw)
    for key, value in mla.items():
        c.model.mla[key] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_quantized_kv_pages_with_the_latent_cache_are_refused():
    c = mla_config()
    c.serve.kv_quant = "int8"
    with pytest.raises(ConfigError, match="MLA's latent cache"):
        validate(c)
    c.model.mla.cache = "expanded"
    validate(c)


MLA_LORA = "wq_a,wq_b,wkv_a,wk_rope,wk_b,wv_b,wo"


@pytest.fixture(scope="module")
def lora_one_device():
    """An MLA model with LoRA adapters on every MLA projection (B drawn at random: at B = 0 A has
    no gradient) on one device: (config, program, params)."""
    from tests.test_finetune import _with_random_b

    c = mla_config(init_std=0.2)
    c.lora.rank, c.lora.targets = 4, MLA_LORA
    program = program_for(c)
    return c, program, _with_random_b(program.init().params)


def test_lora_on_the_latent_projections_sharded_equals_one_device(lora_one_device):
    """fsdp 2 x tensor 2: the factors of the down-projections (wq_a, wkv_a, wk_rope), replicated
    over tensor and fed by each rank's heads only, get their gradients summed over tensor (their
    base's `partial`), the up-projections' split with the heads."""
    from jaxsys import data

    c, program, params = lora_one_device
    batch = lambda p: data.global_batch(data.load_corpus(c.data), p.batch_sharding, c.seed, 0, 8, 32)
    want_loss, want = program.loss_and_grads_fn()(params, batch(program))
    sharded = mla_config({"fsdp": 2, "tensor": 2}, init_std=0.2)
    sharded.lora.rank, sharded.lora.targets = 4, MLA_LORA
    other = program_for(sharded)
    loss, got = other.loss_and_grads_fn()(jax.device_put(params, other.param_shardings), batch(other))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL)
    assert set(got["layers"]) == set(MLA_LORA.split(","))  # only the adapters have gradients
    assert_trees_close_leafwise(got, want, rtol=1e-4, atol=lambda w: 1e-5 * np.abs(w).max())


def test_lora_model_decodes_through_the_latent_cache(lora_one_device):
    """The latent cache's absorbed attention folds the wk_b / wv_b adapters into the weights it
    multiplies with outside quant.linear: greedy tokens equal argmax of the adapted forward."""
    from jaxsys.models import transformer
    from jaxsys.serve import engine
    from jaxsys.serve.sampling import Sampling

    c, program, params = lora_one_device
    eng = engine.Engine(program, params, num_pages=16, page_size=4, token_budget=64, chunk_size=32, max_seqs=2)
    assert eng.cache.v is None  # the latent cache
    prompt, n = [10, 20, 30, 40, 50], 6
    got = engine.generate(eng, [prompt], n, Sampling())[0]
    fn = jax.jit(lambda p, ids: transformer.logits(p, ids, c.model, program.layout, program.specs))
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(fn(params, jnp.asarray([seq], jnp.int32))[0, -1])))
    assert got == seq[len(prompt) :]


def test_lora_targets_an_mla_model_lacks_are_refused():
    c = mla_config()
    c.lora.rank, c.lora.targets = 4, "wk,wv"
    with pytest.raises(ConfigError, match="names no projection this model has"):
        validate(c)


def test_latent_rows_must_divide_the_fsdp_shards():
    c = mla_config({"fsdp": 8}, mla=dict(MLA, kv_lora_rank=12))
    with pytest.raises(ConfigError, match="mla.kv_lora_rank=12 is not divisible by the 8 shards"):
        validate(c)


def test_the_config_file_is_the_released_model():
    """configs/deepseek_v2_lite.py is the model DeepSeek-V2-Lite's config.json converts to
    (tests/test_convert.py REAL_CONFIGS), with its 15,706,484,224 parameters (transformers' count);
    its :cpu variant (V3's routing and query latent at toy size) validates."""
    from jaxsys.checkpoint import hf
    from jaxsys.config import load_config
    from jaxsys.models import params, transformer
    from tests.helpers import ROOT
    from tests.test_convert import REAL_CONFIGS

    ours = load_config(f"{ROOT}/configs/deepseek_v2_lite.py")
    converted = load_config(f"{ROOT}/configs/deepseek_v2_lite.py")
    hf.model_config_from_hf(REAL_CONFIGS["deepseek-v2-lite"][0], converted.model)
    flat = lambda c: {k: v for k, v in c.model.to_dict().items() if not isinstance(v, dict)}
    mine, theirs = flat(ours), flat(converted)
    same = lambda a, b: a == (pytest.approx(b, rel=1e-12) if isinstance(b, float) else b)
    differ = {k for k, v in theirs.items() if not same(mine[k], v)}
    assert differ <= {"compute_dtype", "remat", "attention_impl"}, differ  # training choices, not the model
    for group in ("mla", "moe"):
        assert ours.model[group].to_dict() == converted.model[group].to_dict(), group
    assert params.count(transformer.param_specs(ours.model)) == 15_706_484_224
    cpu = load_config(f"{ROOT}/configs/deepseek_v2_lite.py:cpu")
    assert cpu.model.moe.bias_update_rate > 0 and cpu.model.mla.q_lora_rank > 0


def test_quantized_mla_projections_decode_through_the_latent_cache():
    """`jaxsys.quantize` stores every MLA projection as 4-bit codes (C = Q = 32 so that groups of
    32 fit); GPTQ calibrates them through their own captured inputs. The quantized model's logits
    stay within 4-bit noise of the float model's (< 25% of their spread, test_quantized_model.py's
    bound), and the latent cache's absorbed attention, which dequantizes wk_b / wv_b itself,
    gives the greedy tokens of the quantized training forward."""
    from jaxsys import data
    from jaxsys.models import quant, transformer
    from jaxsys.quantization.params import gptq_params
    from jaxsys.serve import engine
    from jaxsys.serve.sampling import Sampling

    mla = dict(MLA, kv_lora_rank=32, q_lora_rank=32)
    c = mla_config(mla=mla)  # the default init: at init_std=0.2 the attention is sharp and 4-bit noise grows 7x
    params = jax.tree.map(np.asarray, program_for(c).init(3).params)
    cq = mla_config(mla=mla, quant="w4a16", quant_group_size=32, quant_impl="reference")
    qparams = gptq_params(params, c, data.load_corpus(c.data), "w4a16", 32, False, batches=1)
    for name in ("wq_a", "wq_b", "wkv_a", "wk_rope", "wk_b", "wv_b", "wo"):
        assert quant.is_quantized(qparams["layers"][name]), name
    program = program_for(cq)
    qparams = jax.device_put(qparams, program.param_shardings)
    fn = jax.jit(lambda p, ids: transformer.logits(p, ids, cq.model, program.layout, program.specs))
    fp = program_for(c)
    float_fn = jax.jit(lambda p, ids: transformer.logits(p, ids, c.model, fp.layout, fp.specs))
    ids = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79]], jnp.int32)
    want, got = np.asarray(float_fn(params, ids)), np.asarray(fn(qparams, ids))
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want - want.mean()) < 0.25
    eng = engine.Engine(program, qparams, num_pages=16, page_size=4, token_budget=64, chunk_size=32, max_seqs=2)
    assert eng.cache.v is None  # the latent cache
    prompt, n = [10, 20, 30, 40, 50], 6
    tokens = engine.generate(eng, [prompt], n, Sampling())[0]
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(jnp.argmax(fn(qparams, jnp.asarray([seq], jnp.int32))[0, -1])))
    assert tokens == seq[len(prompt) :]
