"""Hugging Face Llama interop: `python -m jaxsys.convert --from-hf/--to-hf` against golden files.

tests/golden/hf_llama/{untied,tied,llama3,qwen3,yarn,qwen2,mistral,qwen2_window} hold tiny random
Llamas saved by `transformers` (GQA with rope theta 5e5 and untied embeddings; MQA with tied
embeddings; GQA with Llama 3.1's rope scaling; a Qwen3: q/k norms, tied; a Qwen3 with YaRN rope
scaling; a Qwen2: q/k/v biases; a Mistral with a sliding window of 8 in every layer; a Qwen2 whose
second layer has a window of 6),
with the logits transformers computed on fixed tokens. scripts/make_hf_golden.py made them
(PyTorch, Python 3.11); these tests need neither.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxsys import convert, data, train
from jaxsys.checkpoint import Checkpointer
from jaxsys.checkpoint import hf as hf_lib
from jaxsys.config import load_config
from jaxsys.mesh import make_mesh
from jaxsys.models import transformer
from tests.helpers import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden", "hf_llama")


def _restored(workdir, devices=1):
    ckpt = Checkpointer(str(workdir), None, read_only=True)
    config = ckpt.saved_config()
    for axis in config.mesh:
        config.mesh[axis] = 1
    program = train.build(config, make_mesh(config, jax.devices()[:devices]))
    state = ckpt.restore(program.abstract_state())
    ckpt.close()
    return config, program, state


def _logits_match_and_written_back(tmp_path, name):
    """--from-hf of golden `name` (logits equal transformers' to 1e-4), then --to-hf of the
    workdir: (the converted config, the golden's directory, the written one)."""
    golden = os.path.join(GOLDEN, name)
    workdir = tmp_path / "run"
    assert convert.main(["--from-hf", golden, "--workdir", str(workdir)]) == 0
    config, program, state = _restored(workdir)
    tokens = np.load(os.path.join(golden, "tokens.npy"))
    got = np.asarray(transformer.logits(state.params, jnp.asarray(tokens), config.model, program.layout))
    np.testing.assert_allclose(got, np.load(os.path.join(golden, "logits.npy")), atol=1e-4, rtol=0)
    out = tmp_path / "hf"
    assert convert.main(["--to-hf", str(out), "--workdir", str(workdir)]) == 0
    return config, golden, out


@pytest.mark.parametrize(
    "name",
    [
        "untied",
        "tied",
        "llama3",
        "qwen3",
        "yarn",
        "qwen2",
        "mistral",
        "qwen2_window",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
    ],
)
def test_from_hf_logits_match_transformers_and_to_hf_round_trips(tmp_path, name):
    golden = os.path.join(GOLDEN, name)
    workdir = tmp_path / "run"
    assert convert.main(["--from-hf", golden, "--workdir", str(workdir)]) == 0
    config, program, state = _restored(workdir)
    hf = json.load(open(os.path.join(golden, "config.json")))
    assert (config.model.n_kv_heads, config.model.tie_embeddings) == (
        hf["num_key_value_heads"],
        name in ("tied", "qwen3", "yarn", "gemma2", "gemma3"),
    )
    rope = hf["rope_parameters"].get("full_attention", hf["rope_parameters"])  # Gemma 3's per layer type
    assert config.model.rope_theta == rope["rope_theta"]

    tokens = np.load(os.path.join(golden, "tokens.npy"))
    want = np.load(os.path.join(golden, "logits.npy"))
    got = np.asarray(transformer.logits(state.params, jnp.asarray(tokens), config.model, program.layout))
    # fp32 on both sides; the two implementations sum in different orders (seen: ~4e-7).
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    qk_norm = name in ("qwen3", "yarn", "gemma3", "qwen3_moe")
    assert (config.model.qk_norm, config.model.qkv_bias) == (qk_norm, name.startswith("qwen2"))
    moe = config.model.moe
    experts = {
        "mixtral": ("moe", 4, 2, 96, True, 0),
        "qwen2_moe": ("moe,dense", 4, 2, 48, False, 2),
        "qwen3_moe": ("moe,dense", 4, 2, 48, True, 0),
        "deepseek_v2": ("dense,moe,moe", 8, 2, 32, False, 1),
        "deepseek_v3": ("dense,moe,moe", 8, 2, 32, True, 1),
    }
    if name in experts:
        got = (config.model.mlp_pattern, moe.experts, moe.top_k, moe.d_ff, moe.renormalize, moe.shared_experts)
        assert got == experts[name] and moe.shared_expert_gate == (name == "qwen2_moe")
        assert moe.capacity_factor == 0.0  # dropless, as transformers computes every routed copy
    else:
        assert config.model.mlp_pattern == "dense"
    m = config.model
    gemma = (m.embed_scale, m.post_norms, m.mlp_activation, m.query_pre_attn_scalar, m.rope_local_theta)
    want_gemma = {"gemma2": (True, True, "gelu_tanh", 24.0, 0.0), "gemma3": (True, True, "gelu_tanh", 24.0, 1e4)}
    if name.startswith("deepseek"):  # YaRN's softmax factor mscale(mscale_all_dim)^2 as H / mscale^4
        mscale = 0.1 * hf["rope_parameters"]["mscale_all_dim"] * np.log(4.0) + 1
        want_gemma[name] = (False, False, "silu", pytest.approx(16 / mscale**4, rel=1e-12), 0.0)
        mla = (m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, m.mla.v_head_dim, m.head_dim)
        assert mla == (16, 24 if name == "deepseek_v3" else 0, 8, 12, 16)
        routing = (m.moe.router, m.moe.groups, m.moe.group_top_k, m.moe.group_score, m.moe.score_bias)
        want_routing = {"deepseek_v2": ("softmax", 4, 1, "max", False), "deepseek_v3": ("sigmoid", 4, 2, "top2", True)}
        assert routing == want_routing[name] and m.moe.routed_scale == (2.0 if name == "deepseek_v2" else 2.5)
    assert gemma == want_gemma.get(name, (False, False, "silu", 0.0, 0.0))
    caps = (m.attn_logit_softcap, m.final_logit_softcap)
    assert caps == ((2.0, 0.5) if name == "gemma2" else (0.0, 0.0))
    if name == "gemma2":  # each cap matters at these sizes: without it the logits miss transformers'
        for key in ("attn_logit_softcap", "final_logit_softcap"):
            uncapped = m.copy_and_resolve_references()
            uncapped[key] = 0.0
            other = np.asarray(transformer.logits(state.params, jnp.asarray(tokens), uncapped, program.layout))
            assert np.abs(other - want).max() > 100 * 1e-4, key
    windows = {
        "mistral": ("local", 8),
        "qwen2_window": ("softmax,local", 6),
        "gemma2": ("local,softmax", 6),
        "gemma3": ("local,local,softmax", 6),
    }
    assert (config.model.layer_pattern, config.model.sliding_window) == windows.get(name, ("softmax", 0))
    if name in windows:  # the windows matter at these 24 positions
        full = config.model.copy_and_resolve_references()
        full.layer_pattern, full.sliding_window = "softmax", 0
        unwindowed = np.asarray(transformer.logits(state.params, jnp.asarray(tokens), full, program.layout))
        assert np.abs(unwindowed - want).max() > 100 * 1e-4
    if name in ("llama3", "yarn"):  # the scaling is read, and it matters at these 24 positions
        m = config.model
        factor = 8.0 if name == "llama3" else 4.0
        assert (m.rope_scaling, m.rope_factor, m.rope_original_max_position) == (name, factor, 64)
        plain = config.model.copy_and_resolve_references()
        plain.rope_scaling = "none"
        unscaled = np.asarray(transformer.logits(state.params, jnp.asarray(tokens), plain, program.layout))
        assert np.abs(unscaled - want).max() > 100 * 1e-4

    out = tmp_path / "hf"
    assert convert.main(["--to-hf", str(out), "--workdir", str(workdir)]) == 0
    original, written = load_file(os.path.join(golden, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key in original:
        assert written[key].dtype == original[key].dtype, key
        if name.startswith("gemma") and key.endswith("norm.weight"):  # stored as 1 + w: fp32 rounding of the sum
            np.testing.assert_allclose(written[key], original[key], rtol=0, atol=2**-24, err_msg=key)
        else:
            np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    written_config = json.load(open(out / "config.json"))
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "model_type",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "query_pre_attn_scalar",
        "hidden_activation",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "qkv_bias",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "norm_topk_prob",
        "mlp_only_layers",
    ):
        if key == "sliding_window" and not hf.get("use_sliding_window", True):  # off: null, or Qwen2-MoE's 0
            assert not written_config.get(key) and not hf.get(key), key
        elif key in hf and (key != "max_window_layers" or hf.get("use_sliding_window")):
            assert written_config[key] == hf[key], key
    assert written_config["rope_parameters"] == hf["rope_parameters"]


def test_rope_scaling_of_transformers_4_configs_is_read():
    """A Llama 3.1 config.json as the Hub has it (transformers 4: top-level rope_theta, a
    `rope_scaling` dict) sets the same model as transformers 5's `rope_parameters`; linear too."""
    new = json.load(open(os.path.join(GOLDEN, "llama3", "config.json")))
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    a, b = load_config(os.path.join(ROOT, "configs", "tiny.py")), load_config(os.path.join(ROOT, "configs", "tiny.py"))
    hf_lib.model_config_from_hf(new, a.model)
    hf_lib.model_config_from_hf(old, b.model)
    assert a.model.to_dict() == b.model.to_dict() and b.model.rope_scaling == "llama3"
    assert hf_lib.hf_config_from_model(b.model, "float32")["rope_scaling"] == old["rope_scaling"]
    old["rope_scaling"] = {"type": "linear", "factor": 4.0}
    hf_lib.model_config_from_hf(old, b.model)
    assert (b.model.rope_scaling, b.model.rope_factor) == ("linear", 4.0)


def test_sliding_windows_are_read_as_transformers_reads_them():
    """Mistral: `sliding_window` in every layer, 4096 when the key is absent (MistralConfig's
    default), none when null; Qwen2: only with use_sliding_window, from max_window_layers on or
    where transformers 5's layer_types say (an alternating list keeps its period); to_hf refuses
    what Mistral's or Qwen's config cannot say."""
    mistral = json.load(open(os.path.join(GOLDEN, "mistral", "config.json")))
    qwen = json.load(open(os.path.join(GOLDEN, "qwen2_window", "config.json")))
    m = load_config(os.path.join(ROOT, "configs", "tiny.py")).model
    read = lambda hf: (hf_lib.model_config_from_hf(hf, m), (m.layer_pattern, m.sliding_window))[1]
    assert read({k: v for k, v in mistral.items() if k != "sliding_window"}) == ("local", 4096)
    assert read(dict(mistral, sliding_window=None)) == ("softmax", 0)
    assert read(dict(qwen, use_sliding_window=False)) == ("softmax", 0)
    no_types = {k: v for k, v in qwen.items() if k != "layer_types"}
    assert read(dict(no_types, num_hidden_layers=4, max_window_layers=3)) == ("softmax,softmax,softmax,local", 6)
    alternating = ["sliding_attention", "full_attention"] * 2
    assert read(dict(qwen, num_hidden_layers=4, layer_types=alternating)) == ("local,softmax", 6)
    with pytest.raises(hf_lib.ConversionError, match="layer_types"):
        read(dict(qwen, layer_types=["chunked_attention", "full_attention"]))
    m.layer_pattern, m.sliding_window, m.n_layers = "local,softmax", 8, 2
    m.qk_norm = m.qkv_bias = False
    with pytest.raises(hf_lib.ConversionError, match="cannot express"):
        hf_lib.hf_config_from_model(m, "float32")
    m.qkv_bias = True
    with pytest.raises(hf_lib.ConversionError, match="not the last ones"):
        hf_lib.hf_config_from_model(m, "float32")


def test_phi3_fused_projections_convert_and_write_back_as_mistral(tmp_path):
    """Phi-3 / Phi-4 fuse q, k, v into qkv_proj and gate, up into gate_up_proj: --from-hf splits
    them (logits match transformers', Phi-3-mini's sliding window included); --to-hf writes the
    same computation as a Mistral (a window in every layer), whose split tensors are the fused
    ones' rows."""
    config, golden, out = _logits_match_and_written_back(tmp_path, "phi3")
    assert (config.model.layer_pattern, config.model.sliding_window) == ("local", 10)
    assert json.load(open(out / "config.json"))["model_type"] == "mistral"
    fused, written = load_file(os.path.join(golden, "model.safetensors")), load_file(str(out / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = np.concatenate([written[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        np.testing.assert_array_equal(qkv, fused[p + "self_attn.qkv_proj.weight"])
        gate_up = np.concatenate([written[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
        np.testing.assert_array_equal(gate_up, fused[p + "mlp.gate_up_proj.weight"])


# config.json of released models, as on the Hub (the keys that matter), and their published sizes
REAL_CONFIGS = {
    "gemma-3-1b": (
        dict(
            model_type="gemma3_text",
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=None,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        ),
        999_885_952,
    ),
    "gemma-2-2b": (
        dict(
            model_type="gemma2",
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
        2_614_341_888,
    ),
    "gemma-2-9b": (
        dict(
            model_type="gemma2",
            vocab_size=256000,
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
        9_241_705_984,
    ),
    "mixtral-8x7b": (
        dict(
            model_type="mixtral",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1000000.0,
            sliding_window=None,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        46_702_792_704,
    ),
    "qwen1.5-moe-a2.7b": (
        dict(
            model_type="qwen2_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            rope_theta=1000000.0,
            use_sliding_window=False,
            sliding_window=32768,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        14_315_784_192,
    ),
    "qwen3-30b-a3b": (
        dict(
            model_type="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_theta=1000000.0,
            use_sliding_window=False,
            sliding_window=None,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        30_532_122_624,
    ),
    "phi-4": (
        dict(
            model_type="phi3",
            vocab_size=100352,
            hidden_size=5120,
            intermediate_size=17920,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=10,
            rope_theta=250000.0,
            sliding_window=None,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        14_659_507_200,
    ),
    # DeepSeek-V2-Lite and DeepSeek-V3: their config.json; the counts are transformers' own
    # (DeepseekV2/V3ForCausalLM built on the meta device, 15.7B and 671B as published; V3's 58 x 256
    # e_score_correction_bias buffers counted, as jaxsys's router_bias leaf; its MTP layer not)
    "deepseek-v2-lite": (
        dict(
            model_type="deepseek_v2",
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2,
            n_routed_experts=64,
            num_experts_per_tok=6,
            routed_scaling_factor=1.0,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            hidden_act="silu",
            max_position_embeddings=163840,
            rope_theta=10000,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
            aux_loss_alpha=0.001,
        ),
        15_706_484_224,
    ),
    "deepseek-v3": (
        dict(
            model_type="deepseek_v3",
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1,
            n_routed_experts=256,
            num_experts_per_tok=8,
            routed_scaling_factor=2.5,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            first_k_dense_replace=3,
            topk_method="noaux_tc",
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            hidden_act="silu",
            max_position_embeddings=163840,
            rope_theta=10000,
            rope_scaling=dict(
                type="yarn",
                factor=40,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            num_nextn_predict_layers=1,
        ),
        671_026_419_200,
    ),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_released_configs_read_to_their_published_parameter_counts(name):
    """Each released model's config.json sets a valid jaxsys model whose parameters number
    exactly the published count (embeddings, every projection, the experts, the norms): the
    mapping holds at full size, where no weights can be downloaded here."""
    from jaxsys.config import validate
    from jaxsys.models import params

    hf, want = REAL_CONFIGS[name]
    config = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    hf_lib.model_config_from_hf(hf, config.model)
    validate(config)
    specs = transformer.param_specs(config.model)
    assert params.count({k: v for k, v in specs.items() if k != "mtp"}) == want
    m = config.model
    if name == "gemma-3-1b":  # 26 layers: five local, one global, the period cut by the layer count
        assert m.layer_pattern.split(",")[:6] == ["local"] * 5 + ["softmax"] and len(m.layer_pattern.split(",")) == 26
        assert (m.sliding_window, m.rope_local_theta, m.query_pre_attn_scalar) == (512, 1e4, 256.0)
    if name.startswith("gemma-2"):  # every second layer global; the caps read
        assert (m.layer_pattern, m.sliding_window, m.qk_norm) == ("local,softmax", 4096, False)
        assert (m.attn_logit_softcap, m.final_logit_softcap, m.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    if name == "qwen1.5-moe-a2.7b":  # 4 shared experts of 1408 = its 5632-unit shared expert, gated
        assert (m.moe.experts, m.moe.shared_experts, m.moe.shared_expert_gate, m.qkv_bias) == (60, 4, True, True)
    if name == "deepseek-v3":  # three dense layers, then group-limited sigmoid routing with the bias
        assert m.mlp_pattern.split(",")[:4] == ["dense"] * 3 + ["moe"] and m.n_layers == 61
        assert (m.moe.groups, m.moe.group_top_k, m.moe.group_score, m.moe.routed_scale) == (8, 4, "top2", 2.5)
        assert (m.mla.kv_lora_rank, m.mla.q_lora_rank, m.head_dim, m.rope_factor) == (512, 1536, 192, 40.0)
        # its multi-token-prediction layer: "14B" published (671B + 14B = 685B on the model card),
        # counting the layer's own copies of the embedding and head (2 V D), which jaxsys shares
        assert m.mtp.depth == 1
        module = params.count(specs["mtp"]) + 2 * m.vocab_size * m.d_model
        assert 13.0e9 < module < 14.5e9, module
    if name == "qwen3-30b-a3b":
        assert (m.mlp_pattern, m.moe.experts, m.moe.top_k, m.moe.renormalize) == ("moe", 128, 8, True)


def test_moe_configs_read_and_refused_as_transformers_names_them():
    """Qwen3-MoE as the Hub's configs have it (num_experts, transformers 4's name) reads as the
    golden's num_local_experts; decoder_sparse_step 2 makes every second layer MoE; to_hf refuses
    an MoE model neither Mixtral nor Qwen3-MoE can say, and a shared-expert Qwen2-MoE is refused."""
    hf = json.load(open(os.path.join(GOLDEN, "qwen3_moe", "config.json")))
    m = load_config(os.path.join(ROOT, "configs", "tiny.py")).model
    hub = {k: v for k, v in hf.items() if k != "num_local_experts"}
    hf_lib.model_config_from_hf(dict(hub, num_experts=4), m)
    assert (m.mlp_pattern, m.moe.experts, m.moe.renormalize) == ("moe,dense", 4, True)
    hf_lib.model_config_from_hf(dict(hf, num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2), m)
    assert m.mlp_pattern == "dense,moe"
    m.qk_norm = False  # MoE in every other layer, without q/k norms: not a Mixtral
    with pytest.raises(hf_lib.ConversionError, match="neither a Mixtral"):
        hf_lib.hf_config_from_model(m, "float32")
    m.qk_norm, m.moe.router = True, "sigmoid"
    with pytest.raises(hf_lib.ConversionError, match="route by softmax"):
        hf_lib._require_convertible(m)
    with pytest.raises(hf_lib.ConversionError, match="only Qwen2-MoE's gated shared expert converts"):
        hf_lib.model_config_from_hf(dict(hf, shared_expert_intermediate_size=64), m)
    qwen2_moe = json.load(open(os.path.join(GOLDEN, "qwen2_moe", "config.json")))
    with pytest.raises(hf_lib.ConversionError, match="not a multiple of moe_intermediate_size=48"):
        hf_lib.model_config_from_hf(dict(qwen2_moe, shared_expert_intermediate_size=100), m)
    with pytest.raises(hf_lib.ConversionError, match="qkv_bias=false"):
        hf_lib.model_config_from_hf(dict(qwen2_moe, qkv_bias=False), m)
    hf_lib.model_config_from_hf(qwen2_moe, m)
    m.moe.shared_expert_gate = False  # ungated shared experts (DeepSeek's) have no Hugging Face Llama-family form
    with pytest.raises(hf_lib.ConversionError, match="whose shared experts are gated"):
        hf_lib._require_convertible(m)


def test_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration (model_type gemma3: text_config
    nested, tensors under language_model.*, a vision tower beside): --from-hf converts the
    language model (its text-only logits match transformers'), --to-hf writes it as a
    Gemma3ForCausalLM whose tensors are the checkpoint's language-model ones."""
    config, golden, out = _logits_match_and_written_back(tmp_path, "gemma3_mm")
    assert (config.model.layer_pattern, config.model.post_norms, config.model.rope_factor) == (
        "local,softmax",
        True,
        8.0,
    )
    assert json.load(open(out / "config.json"))["model_type"] == "gemma3_text"
    original, written = load_file(os.path.join(golden, "model.safetensors")), load_file(str(out / "model.safetensors"))
    text = {k.replace("language_model.", "", 1): v for k, v in original.items() if k.startswith("language_model.")}
    assert sorted(written) == sorted(text) and not any("vision" in k for k in written)
    for key in text:
        np.testing.assert_allclose(written[key], text[key], rtol=0, atol=2**-24, err_msg=key)


def test_gemma3_configs_of_both_transformers_versions_are_read():
    """Gemma 3 as the Hub's transformers-4 config.json has it (rope_theta, rope_local_base_freq,
    a rope_scaling dict for the global layers, sliding_window_pattern instead of layer_types)
    sets the same model as the golden's transformers-5 form; soft-capping, where a Gemma 3 config
    names it, is read; to_hf refuses Gemma's pieces apart."""
    new = json.load(open(os.path.join(GOLDEN, "gemma3", "config.json")))
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old.update(
        num_hidden_layers=6,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=3,
    )
    a, b = load_config(os.path.join(ROOT, "configs", "tiny.py")), load_config(os.path.join(ROOT, "configs", "tiny.py"))
    hf_lib.model_config_from_hf(dict(new, num_hidden_layers=6, layer_types=new["layer_types"] * 2), a.model)
    hf_lib.model_config_from_hf(old, b.model)
    assert a.model.to_dict() == b.model.to_dict() and b.model.layer_pattern == "local,local,softmax"
    c = load_config(os.path.join(ROOT, "configs", "tiny.py"))
    hf_lib.model_config_from_hf(dict(new, final_logit_softcapping=30.0, attn_logit_softcapping=50.0), c.model)
    assert (c.model.attn_logit_softcap, c.model.final_logit_softcap, b.model.attn_logit_softcap) == (50.0, 30.0, 0.0)
    written = hf_lib.hf_config_from_model(c.model, "float32")
    assert (written["model_type"], written["attn_logit_softcapping"], written["final_logit_softcapping"]) == (
        "gemma3_text",
        50.0,
        30.0,
    )
    m = b.model
    m.embed_scale = False
    with pytest.raises(hf_lib.ConversionError, match="differs in \\['embed_scale'\\]"):
        hf_lib.hf_config_from_model(m, "float32")
    m.embed_scale, m.post_norms = True, False
    with pytest.raises(hf_lib.ConversionError, match="embed_scale without post_norms"):
        hf_lib.hf_config_from_model(m, "float32")
    m.embed_scale, m.mlp_activation, m.query_pre_attn_scalar, m.rope_local_theta = False, "silu", 0.0, 0.0
    m.attn_logit_softcap = 50.0  # a Llama has no cap
    with pytest.raises(hf_lib.ConversionError, match="attn_logit_softcap without post_norms"):
        hf_lib.hf_config_from_model(m, "float32")
    m.attn_logit_softcap, m.post_norms, m.embed_scale, m.mlp_activation = 0.0, True, True, "gelu_tanh"
    m.qk_norm, m.rope_local_theta = False, 5e3  # a Gemma 2 has one RoPE base
    with pytest.raises(hf_lib.ConversionError, match="rope_local_theta=5000.0: a model without q/k norms"):
        hf_lib.hf_config_from_model(m, "float32")


def test_yarn_settings_are_read_as_transformers_reads_them():
    """Qwen2.5's transformers-4 form ({"type": "yarn", factor, original context}) reads as the
    yarn golden's; DeepSeek-V3's form (no factor: max / original context; mscale and mscale_all_dim
    giving the attention factor) and explicit betas, attention factor and truncate are read and
    written back; a partial rotary factor is refused by name."""
    hf = json.load(open(os.path.join(GOLDEN, "yarn", "config.json")))
    qwen25 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    qwen25.update(rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    a, b = load_config(os.path.join(ROOT, "configs", "tiny.py")), load_config(os.path.join(ROOT, "configs", "tiny.py"))
    hf_lib.model_config_from_hf(hf, a.model)
    hf_lib.model_config_from_hf(qwen25, b.model)
    assert a.model.to_dict() == b.model.to_dict()
    assert (a.model.rope_beta_fast, a.model.rope_beta_slow, a.model.rope_attention_factor) == (32.0, 1.0, 0.0)
    deepseek = dict(
        hf,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e4,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=0.707,
            beta_fast=16,
            beta_slow=2,
            truncate=False,
        ),
    )
    hf_lib.model_config_from_hf(deepseek, b.model)
    m = b.model
    want = (1 + 0.1 * np.log(40)) / (1 + 0.1 * 0.707 * np.log(40))
    assert (m.rope_factor, m.rope_original_max_position, m.rope_beta_fast, m.rope_beta_slow) == (40.0, 4096, 16, 2)
    assert m.rope_attention_factor == pytest.approx(want) and m.rope_truncate is False
    written = hf_lib.hf_config_from_model(m, "float32")["rope_parameters"]
    assert written == dict(
        rope_theta=1e4,
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=16.0,
        beta_slow=2.0,
        truncate=False,
        attention_factor=pytest.approx(want),
    )
    with pytest.raises(hf_lib.ConversionError, match="partial_rotary_factor"):
        hf_lib.model_config_from_hf(dict(hf, partial_rotary_factor=0.5), b.model)


def test_converted_workdir_trains_on_another_mesh(tmp_path):
    """Convert sharded over fsdp=8, then `jaxsys.train --config W/config.json` resumes from step 0 on
    data=2 x fsdp=2 x tensor=2 (tensor=2 divides the 4 query and 2 key/value heads)."""
    workdir = tmp_path / "run"
    assert (
        convert.main(
            [
                "--from-hf",
                os.path.join(GOLDEN, "untied"),
                "--workdir",
                str(workdir),
                "--config",
                os.path.join(ROOT, "configs", "tiny.py:test"),
                "--config.mesh.fsdp=8",
            ]
        )
        == 0
    )
    converted_config, one_device, state = _restored(workdir)
    config = load_config(
        str(workdir / "config.json"),
        ["--config.mesh.fsdp=2", "--config.mesh.data=2", "--config.mesh.tensor=2", "--config.train.steps=2"],
    )
    assert config.model.d_ff == 160 and config.data.seq_len == 32  # HF model, tiny:test training
    records = train.main(config, str(workdir))
    assert [r["step"] for r in records] == [1, 2]
    # Step 1's loss is the converted weights' loss on batch 0, computed here on one device.
    batch = data.global_batch(
        data.load_corpus(config.data),
        one_device.batch_sharding,
        config.seed,
        0,
        config.train.batch_size,
        config.data.seq_len,
    )
    loss_of = lambda params: float(one_device.eval_loss_fn()(params, batch))
    assert records[0]["loss"] == pytest.approx(loss_of(state.params), rel=1e-5)
    assert abs(loss_of(one_device.init().params) - records[0]["loss"]) > 1e-3  # not a fresh init
    _, _, trained = _restored(workdir)
    assert int(trained.step) == 2
    assert not np.array_equal(np.asarray(trained.params["embed"]), np.asarray(state.params["embed"]))


def _copy_golden(tmp_path, name="untied"):
    target = tmp_path / f"hf_{name}"
    shutil.copytree(os.path.join(GOLDEN, name), target)
    return target


def test_bad_hf_input_is_named_before_anything_is_written(tmp_path, capsys):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(GOLDEN, "untied", "config.json"), pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hf_lib.ConversionError, match=r"no \*.safetensors.*pytorch_model.bin.*never read"):
        hf_lib.from_hf(str(pickled), str(tmp_path / "w1"))

    scaled = _copy_golden(tmp_path)
    hf = json.load(open(scaled / "config.json"))
    hf["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "longrope", "factor": 8.0}
    json.dump(hf, open(scaled / "config.json", "w"))
    with pytest.raises(hf_lib.ConversionError, match="rope type 'longrope'"):
        hf_lib.from_hf(str(scaled), str(tmp_path / "w2"))

    wrong = _copy_golden(tmp_path, "tied")
    tensors = load_file(str(wrong / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(tensors, str(wrong / "model.safetensors"))
    with pytest.raises(
        hf_lib.ConversionError,
        match=r"model.layers.1.mlp.up_proj.weight has shape \(100, 64\) but config.json implies \(160, 64\)",
    ):
        hf_lib.from_hf(str(wrong), str(tmp_path / "w3"))
    # the checkpoint says the model: a Llama read with MoE layers asked for has no experts to give
    with pytest.raises(hf_lib.ConversionError, match=r"no tensor 'model.layers.0.block_sparse_moe.gate.weight'"):
        hf_lib.from_hf(os.path.join(GOLDEN, "tied"), str(tmp_path / "w4"), overrides=["--config.model.mlp_pattern=moe"])
    assert not any((tmp_path / w).exists() for w in ("w1", "w2", "w3", "w4"))

    done = tmp_path / "done"
    assert convert.main(["--from-hf", os.path.join(GOLDEN, "tied"), "--workdir", str(done)]) == 0
    before = sorted(p.relative_to(done) for p in done.rglob("*"))
    assert convert.main(["--from-hf", os.path.join(GOLDEN, "untied"), "--workdir", str(done)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.relative_to(done) for p in done.rglob("*")) == before


def test_fp8_block_scaled_checkpoint_converts_dequantized(tmp_path):
    """DeepSeek-V3's released format: every linear weight float8 e4m3 with a float32
    `weight_scale_inv` per block (config.json quantization_config, here blocks of 12 x 10 so that
    the golden's weights end in partial blocks). The conversion equals converting a
    float checkpoint of the same weights dequantized here by NumPy, and its logits stay within
    fp8's rounding of transformers' on the float weights."""
    import ml_dtypes

    name = "deepseek_v3"
    fp8_dir, float_dir = _copy_golden(tmp_path, name), tmp_path / "dequantized"
    shutil.copytree(fp8_dir, float_dir)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for key, w in tensors.items():
        linear = key.endswith("proj.weight") and w.ndim == 2  # not the norms, router, embeddings, head
        if not linear:
            quantized[key] = dequantized[key] = w
            continue
        rows, cols = -(-w.shape[0] // 12), -(-w.shape[1] // 10)
        padded = np.zeros((rows * 12, cols * 10), np.float32)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = np.abs(padded.reshape(rows, 12, cols, 10)).max(axis=(1, 3))
        scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)  # e4m3's largest value
        full = np.kron(scale, np.ones((12, 10), np.float32))[: w.shape[0], : w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        quantized[key], quantized[key + "_scale_inv"] = q, scale
        dequantized[key] = q.astype(np.float32) * full
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    save_file(dequantized, str(float_dir / "model.safetensors"))
    hf = json.load(open(fp8_dir / "config.json"))
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [12, 10]}
    json.dump(hf, open(fp8_dir / "config.json", "w"))

    for src, out in ((fp8_dir, "w_fp8"), (float_dir, "w_float")):
        assert convert.main(["--from-hf", str(src), "--workdir", str(tmp_path / out)]) == 0
    config, program, got = _restored(tmp_path / "w_fp8")
    _, _, want = _restored(tmp_path / "w_float")
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.load(os.path.join(GOLDEN, name, "tokens.npy"))
    logits = np.asarray(transformer.logits(got.params, jnp.asarray(tokens), config.model, program.layout))
    golden = np.load(os.path.join(GOLDEN, name, "logits.npy"))
    # fp8 mattered, within its rounding: e4m3 keeps 3 mantissa bits, each weight within 2^-4 relative
    assert 1e-4 < np.abs(logits - golden).max() < 0.1 * np.abs(golden).max()

    # refused by name: a float8 weight without its scales, and a quantization not read
    del quantized["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    with pytest.raises(hf_lib.ConversionError, match=r"o_proj.weight \(64, 48\) needs .*_scale_inv of shape \(6, 5\)"):
        hf_lib.from_hf(str(fp8_dir), str(tmp_path / "w1"))
    hf["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(hf, open(fp8_dir / "config.json", "w"))
    with pytest.raises(hf_lib.ConversionError, match="quant_method='gptq'.*dequantize this one"):
        hf_lib.from_hf(str(fp8_dir), str(tmp_path / "w2"))
    assert not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()


def test_the_tokenizer_travels_with_the_conversion(tmp_path, capsys):
    """--from-hf copies a directory's tokenizer files into W/tokenizer/ or records that it has
    none; --tokenizer attaches one to a workdir, refusing one with more ids than the model's
    vocabulary before anything is written; --to-hf writes the tokenizer files back out."""
    from tokenizers import Tokenizer

    from jaxsys import tokenizer

    tok_dir = os.path.join(GOLDEN, "tokenizer")
    with_tok = _copy_golden(tmp_path, "tied")
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), with_tok)
    w = tmp_path / "w"
    assert convert.main(["--from-hf", str(with_tok), "--workdir", str(w)]) == 0
    assert "tokenizer: Hugging Face" in capsys.readouterr().out
    record = tokenizer.record(str(w))
    assert record["kind"] == "huggingface" and record["vocab_size"] == 384 and record["eos_ids"] == [2]
    for f in os.listdir(tok_dir):
        assert open(w / "tokenizer" / f, "rb").read() == open(os.path.join(tok_dir, f), "rb").read()
    out = tmp_path / "out"
    assert convert.main(["--to-hf", str(out), "--workdir", str(w)]) == 0
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", *os.listdir(tok_dir)])

    bare = tmp_path / "bare"
    assert convert.main(["--from-hf", os.path.join(GOLDEN, "tied"), "--workdir", str(bare)]) == 0
    assert "tokenizer: none" in capsys.readouterr().out
    assert tokenizer.record(str(bare))["kind"] == "none"

    bigger = tmp_path / "bigger.json"  # 385 ids for a 384-id model
    backend = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    backend.add_special_tokens(["<extra>"])
    backend.save(str(bigger))
    assert convert.main(["--tokenizer", str(bigger), "--workdir", str(bare)]) == 2
    assert "has 385 ids but the model's vocabulary is config.model.vocab_size=384" in capsys.readouterr().err
    assert tokenizer.record(str(bare))["kind"] == "none"
    refused = tmp_path / "refused"
    assert convert.main(["--from-hf", str(with_tok), "--workdir", str(refused), "--tokenizer", str(bigger)]) == 2
    assert "does not fit this model" in capsys.readouterr().err and not refused.exists()
    assert convert.main(["--tokenizer", os.path.join(tok_dir, "tokenizer.json"), "--workdir", str(bare)]) == 0
    assert tokenizer.record(str(bare))["files"] == ["tokenizer.json"]
