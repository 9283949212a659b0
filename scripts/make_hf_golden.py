"""Generate golden files of tiny, randomly initialised Hugging Face Llama models.

The outputs let jaxsys tests compare its Llama implementation against
``transformers`` without needing PyTorch on the test interpreter (Python 3.12).
Nothing is downloaded: the models are built from ``LlamaConfig`` with
``LlamaForCausalLM(config)`` (Qwen2's and Qwen3's classes for ``qwen2`` and ``qwen3``) and
re-initialised from fixed torch seeds.

Outputs, per model ``<name>`` in ``tests/golden/hf_llama/<name>/``:

* ``config.json``        -- written by ``save_pretrained``
* ``model.safetensors``  -- fp32 weights, HF parameter names
* ``tokens.npy``         -- int32 [2, 24] input ids
* ``logits.npy``         -- float32 [2, 24, 384] logits (causal mask, no padding,
                            position_ids 0..T-1, eager attention, fp32)
* ``versions.json``      -- torch / transformers / safetensors / numpy versions

Both have a vocabulary of 384 ids: more than the 256 byte values, so that jaxsys cannot take a
converted model for a byte-level one (every golden prompt holds ids >= 256). They have no
tokenizer; ``tests/golden/hf_llama/tokenizer/`` is one for them (scripts/make_hf_tokenizer_golden.py,
run after this script and scripts/make_hf_greedy_golden.py).

Models:

* ``untied``: 2 layers, 4 query heads, 2 KV heads (GQA), rope_theta 5e5,
  separate ``lm_head.weight``.
* ``tied``:   3 layers, 4 query heads, 1 KV head (MQA), rope_theta 1e4,
  ``tie_word_embeddings=True`` (lm_head shares ``model.embed_tokens.weight``).
* ``llama3``: as ``untied`` (another seed) with Llama 3.1's rope scaling (rope_type ``llama3``,
  factor 8, low/high_freq_factor 1 / 4, original_max_position_embeddings 64, so that of the 8
  frequencies of head_dim 16 one is kept, one interpolated and six divided by 8).
* ``qwen3``: a Qwen3 (Llama's layout plus an RMSNorm over each head's q and k before RoPE,
  ``q_norm`` / ``k_norm`` [head_dim]), 2 layers, GQA 4/2, rope_theta 1e6, tied embeddings.
* ``yarn``: a Qwen3 as above (another seed, rope_theta 1e4) with YaRN rope scaling as Qwen3's
  long-context configs set it (rope_type ``yarn``, factor 4, original_max_position_embeddings 64:
  of the 8 frequencies one kept, two ramped, five divided by 4; q and k times 0.1 ln 4 + 1).
* ``mistral``: a Mistral v0.1 (Llama's layout with sliding-window attention in every layer:
  ``sliding_window`` 8 at 24 positions), 2 layers, GQA 4/2, untied.
* ``qwen2_window``: a Qwen2 with its sliding window switched on (``use_sliding_window``,
  ``sliding_window`` 6, ``max_window_layers`` 1: layer 0 full, layer 1 windowed).
* ``gemma3``: a Gemma 3 text model (``Gemma3ForCausalLM``), 3 layers: two local (window 6, RoPE
  base 1e4) and a global one (base 1e6, linear scaling 2), query_pre_attn_scalar 24, GeGLU,
  sandwich and (1 + w) norms, q/k norms, embeddings times sqrt(D), tied; its own NumPy check.
* ``gemma2``: a Gemma 2 (``Gemma2ForCausalLM``), 2 layers: a local one (window 6) and a global
  one, one RoPE base (1e4), query_pre_attn_scalar 24, the sandwich and (1 + w) norms, GeGLU, no
  q/k norms, tied, and its soft-capping: attention scores c tanh(s / c) with c = 2 and logits
  with c = 0.5 (small, so that both change the result: the scores' std is ~1.4 and the logits
  reach ~0.6); the Gemma NumPy check.
* ``gemma3_mm``: a Gemma 3 image-text model (``Gemma3ForConditionalGeneration``, as Gemma 3
  4B-27B ship) with a tiny vision tower: its language model is read on its own, and the logits are
  of text-only input (tokens below the image tokens 381-383).
* ``mixtral``: a Mixtral (Mistral's layout with a mixture of experts in every layer: 4 experts of
  96 units, top 2 of the router's softmax, gates renormalised), 2 layers, untied.
* ``qwen2_moe``: a Qwen2-MoE (q/k/v biases; layer 0 a mixture of 4 experts of 48, top 2, gates
  not renormalised, plus a shared expert of 96 units whose output is scaled by sigmoid(h w_g) per
  token, w_g drawn at 0.5 so that the gate varies; layer 1 dense through mlp_only_layers), untied.
* ``qwen3_moe``: a Qwen3-MoE (q/k norms; layer 0 a mixture of 4 experts of 48, top 2,
  norm_topk_prob; layer 1 dense through mlp_only_layers), untied.
* ``phi3``: a Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``; a sliding window of 10 in every
  layer, as Phi-3-mini's 2047), 2 layers, GQA 4/2, untied.
* ``deepseek_v2``: a DeepSeek-V2 (multi-head latent attention without a query latent, as V2-Lite:
  kv_lora_rank 16, heads of 8 + 8 rotary (interleaved) dims and values of 12; YaRN factor 4 with
  mscale 1 / mscale_all_dim 0.707, so that both the rotary magnitude and the softmax factor differ
  from 1), 3 layers, the first dense, then 8 routed experts of 32 (top 2 by softmax, limited to
  the best of 4 groups, gates times 2) and one shared expert.
* ``deepseek_v3``: a DeepSeek-V3 (a query latent of 24 besides, mscale = mscale_all_dim = 1 as
  V3's; sigmoid scores with a random e_score_correction_bias for the choice, groups scored by their
  best two, top 2 of 4 groups, gates renormalised and times 2.5), 3 layers, the first dense.
* ``qwen2``: a Qwen2 (Qwen2.5's architecture: Llama's layout plus biases on the q, k and v
  projections), 2 layers, GQA 4/2, rope_theta 1e6, untied embeddings.

Environment (Python 3.11, outside the repo; torch is the local CPU wheel)::

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install --no-deps /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors==0.8.0 numpy==2.4.6

(``pip install torch==2.13.0`` alone also resolves to the ``+cpu`` wheel via
the configured ``find-links=/opt/wheels``; the explicit wheel path just makes it
impossible to pull a CUDA build.)

Run from the repository root (``--only NAME`` regenerates one model)::

    /tmp/hfvenv/bin/python scripts/make_hf_golden.py

The script also checks the HF logits against an independent pure-numpy Llama
forward pass that reads the saved safetensors with ``safetensors.numpy``, so the
conventions documented for consumers (half-split / rotate_half RoPE, scaling
``head_dim ** -0.5``, fp32 RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))``,
``repeat_kv`` head grouping) are verified on every regeneration.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy
import torch
import transformers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO_ROOT / "tests" / "golden" / "hf_llama"

BATCH, SEQ = 2, 24
WEIGHT_STD = 0.02
QK_STD = 0.15

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)

MODELS = {
    "untied": dict(
        seed=0,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "tied": dict(
        seed=1,
        num_hidden_layers=3,
        num_key_value_heads=1,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "llama3": dict(
        seed=2,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen3": dict(
        seed=3,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        family="qwen3",
    ),
    "yarn": dict(
        seed=5,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        family="qwen3",
        # Qwen3's long-context setting (factor 4 over the original context), with a context of 64
        # so that of the 8 frequencies of head_dim 16 one is kept, two ramped and five divided by 4
        rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
    ),
    "mistral": dict(
        seed=6,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        family="mistral",
        sliding_window=8,  # Mistral v0.1's 4096 at 24 positions: every layer sees its last 8 keys
    ),
    "qwen2_window": dict(
        seed=7,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        family="qwen2",
        # Qwen2's switch: layers from max_window_layers on see their last sliding_window keys
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "gemma3": dict(
        seed=8,
        num_hidden_layers=3,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        family="gemma3",
        # Gemma 3 (text): two local layers (window 6, RoPE base 1e4) and a global one (base 1e6
        # with linear scaling, as the 4B-27B models have), a softmax scale of 24^-0.5 (not
        # head_dim's), GeGLU, sandwich norms and (1 + w) norms, embeddings times sqrt(D)
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=6,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        rope=dict(
            full_attention=dict(rope_type="linear", factor=2.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Gemma 2: the same pieces without q/k norms or a local RoPE base, plus soft-capping of the
    # attention scores and of the logits (caps small enough to matter at these sizes)
    "gemma2": dict(
        seed=13,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        family="gemma2",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=2.0,
        final_logit_softcapping=0.5,
    ),
    # Gemma 3 4B-27B ship as an image-text model: the same text model inside, the vision tower
    # beside it; text-only logits (tokens below the image tokens 381-383)
    "gemma3_mm": dict(
        seed=9,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        family="gemma3_mm",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=5,
        query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh",
        rope=dict(
            full_attention=dict(rope_type="linear", factor=8.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # mixture-of-experts: Mixtral (every layer, 4 experts of 96, top 2, gates renormalised) and
    # Qwen3-MoE (q/k norms; layer 0 MoE with 4 experts of 48, top 2, norm_topk_prob; layer 1 dense)
    "mixtral": dict(
        seed=10,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        family="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=96,
    ),
    "qwen3_moe": dict(
        seed=11,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        family="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Qwen2-MoE: Qwen2's biases, softmax top-2 of 4 experts without renormalising, and a shared
    # expert of 2 x 48 units gated per token
    "qwen2_moe": dict(
        seed=14,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        family="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # Phi-3 / Phi-4: Llama's computation with q, k, v in one fused projection and gate, up in
    # another; Phi-3-mini's sliding window (2047 there, 10 here)
    "phi3": dict(
        seed=12,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        family="phi3",
        sliding_window=10,
        pad_token_id=0,  # Phi3Config's default, 32000, is outside this vocabulary
        eos_token_id=2,
    ),
    "qwen2": dict(
        seed=4,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        family="qwen2",
    ),
    "deepseek_v2": dict(
        seed=15,
        num_hidden_layers=3,
        num_key_value_heads=4,
        rope_theta=10000.0,
        rope={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        tie_word_embeddings=False,
        family="deepseek_v2",
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=1,
        routed_scaling_factor=2.0,
    ),
    "deepseek_v3": dict(
        seed=16,
        num_hidden_layers=3,
        num_key_value_heads=4,
        rope_theta=10000.0,
        rope={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        family="deepseek_v3",
        head_dim=8,  # DeepseekV3Config keeps a head_dim it is given: the rotary dims, as it sets itself
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}

CLASSES = {
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "gemma3_mm": (Gemma3TextConfig, Gemma3ForConditionalGeneration),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}


def build_model(spec: dict) -> LlamaForCausalLM:
    spec = dict(spec)
    seed = spec.pop("seed")
    rope_theta = spec.pop("rope_theta")
    rope = spec.pop("rope", {"rope_type": "default"})
    family = spec.pop("family", "llama")
    config_class, model_class = CLASSES[family]
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        spec.setdefault("use_sliding_window", False)
    gemma = family.startswith("gemma")
    common = {k: v for k, v in COMMON.items() if not (gemma and k == "hidden_act")}
    if family.startswith("gemma3"):  # rope parameters per layer type; the global layers' theta is rope_theta
        rope_parameters = {**rope, "full_attention": {**rope["full_attention"], "rope_theta": rope_theta}}
    else:  # transformers>=5 stores rope_theta (and any scaling) inside rope_parameters
        rope_parameters = {**rope, "rope_theta": rope_theta}
    config = config_class(**{**common, **spec}, rope_parameters=rope_parameters, dtype="float32")
    if family == "gemma3_mm":  # the text config inside an image-text one, with a tiny SigLIP tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        config = Gemma3Config(
            text_config=config.to_dict(),
            vision_config=dict(vision, image_size=28, patch_size=14),
            mm_tokens_per_image=4,
            boi_token_index=381,
            eoi_token_index=382,
            image_token_index=383,
            dtype="float32",
        )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config)
    model = model.to(torch.float32)
    model.config._attn_implementation = "eager"

    # Re-initialise every parameter so the golden logits depend on all of them:
    # RMSNorm weights 1 + 0.1 * N(0, 1); every other weight 0.02 * N(0, 1),
    # except q_proj / k_proj which use QK_STD.  With std 0.02 everywhere the
    # attention scores have std ~0.03, attention is almost uniform and the
    # logits barely depend on q/k or on the RoPE convention; QK_STD = 0.15
    # gives scores of std ~1.4 so those errors show up clearly.
    # named_parameters() de-duplicates tied tensors, so a tied lm_head is only
    # touched once (through model.embed_tokens.weight).
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
                p.copy_(QK_STD * noise)  # DeepSeek's q and k come out of the latent up-projections
            elif name.endswith("_proj.bias"):  # Qwen2's q/k/v biases: as large as a row's product
                p.copy_(0.5 * noise)
            elif name.endswith("shared_expert_gate.weight"):  # Qwen2-MoE's gate: far from a constant 1/2
                p.copy_(0.5 * noise)
            else:
                p.copy_(WEIGHT_STD * noise)
        for name, b in model.named_buffers():  # DeepSeek-V3's choice bias, as large as the scores' spread
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))

    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == bool(config.tie_word_embeddings)
    assert model.config._attn_implementation == "eager"
    model.eval()
    return model


# --------------------------------------------------------------------------
# Independent numpy reference (float64) used as a self-check.
# --------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def numpy_inv_freq(cfg: dict) -> np.ndarray:
    """RoPE's frequencies, float64, from Meta's Llama 3.1 rule for rope_type llama3: a frequency
    whose wavelength 2 pi / f exceeds old_context / low_freq_factor is divided by factor, one
    whose wavelength is below old_context / high_freq_factor is kept, and in between the two are
    mixed with weight s = (old_context / wavelength - low) / (high - low) on the kept one."""
    rope, d = cfg["rope_parameters"], cfg["head_dim"]
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if rope.get("rope_type", "default") == "default":
        return inv_freq
    if rope["rope_type"] == "yarn":
        # YaRN as its authors' code (and transformers) apply it: index i of the d/2 is kept where
        # the frequency turns more than beta_fast = 32 times over the original context, divided by
        # factor where fewer than beta_slow = 1 times, linear in i between (the ends rounded out)
        old, dims = rope["original_max_position_embeddings"], np.arange(d // 2)
        index_of = lambda turns: d * np.log(old / (turns * 2 * np.pi)) / (2 * np.log(rope["rope_theta"]))
        low, high = max(np.floor(index_of(32.0)), 0), min(np.ceil(index_of(1.0)), d - 1)
        weight = np.clip((dims - low) / (high - low), 0, 1)  # on the divided frequency
        return inv_freq * (1 - weight) + inv_freq / rope["factor"] * weight
    assert rope["rope_type"] == "llama3", rope
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in inv_freq:
        wavelength = 2 * np.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.asarray(out)


def _moe_of(cfg: dict, i: int):
    """Layer i's MoE as (router name, expert name pattern, (gate, up, down), k, renormalise), or
    None for a dense layer: Mixtral's in every layer; Qwen3-MoE's where mlp_only_layers does not
    list it (decoder_sparse_step 1)."""
    if cfg["model_type"] == "mixtral":
        return (
            "block_sparse_moe.gate.weight",
            "block_sparse_moe.experts.{e}.{w}.weight",
            ("w1", "w3", "w2"),
            cfg["num_experts_per_tok"],
            True,
        )
    if cfg["model_type"] in ("qwen2_moe", "qwen3_moe") and i not in cfg.get("mlp_only_layers", []):
        names = ("gate_proj", "up_proj", "down_proj")
        return "mlp.gate.weight", "mlp.experts.{e}.{w}.weight", names, cfg["num_experts_per_tok"], cfg["norm_topk_prob"]
    return None


def numpy_llama_logits(weights: dict, cfg: dict, tokens: np.ndarray) -> np.ndarray:
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n_h, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    B, T = tokens.shape

    inv_freq = numpy_inv_freq(cfg)
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, d]
    cos, sin = np.cos(emb), np.sin(emb)
    if cfg["rope_parameters"].get("rope_type") == "yarn":  # YaRN's attention factor on q and k
        cos, sin = [a * (0.1 * np.log(cfg["rope_parameters"]["factor"]) + 1) for a in (cos, sin)]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    # sliding windows (transformers' rule: key j visible from query i iff i - W < j <= i): Mistral's
    # in every layer, Qwen2's in the layers layer_types marks (from max_window_layers on)
    windowed_family = cfg["model_type"] in ("mistral", "phi3")  # a window in every layer when set
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", windowed_family) else None
    kinds = cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"]
    back = np.arange(T)[:, None] - np.arange(T)[None, :]
    window_mask = mask if window is None else np.where(back < window, mask, -np.inf)

    x = w["model.embed_tokens.weight"][tokens]  # [B, T, D]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if p + "self_attn.qkv_proj.weight" in w:  # Phi-3: q, k, v rows in one matrix, gate and up in another
            qkv = np.split(w.pop(p + "self_attn.qkv_proj.weight"), [n_h * d, (n_h + n_kv) * d])
            w.update({p + f"self_attn.{n}_proj.weight": a for n, a in zip("qkv", qkv)})
            gate_up = np.split(w.pop(p + "mlp.gate_up_proj.weight"), 2)
            w.update({p + f"mlp.{n}_proj.weight": a for n, a in zip(("gate", "up"), gate_up)})
        proj = lambda name, x: x @ w[p + f"self_attn.{name}.weight"].T + w.get(p + f"self_attn.{name}.bias", 0.0)
        q = proj("q_proj", h).reshape(B, T, n_h, d).transpose(0, 2, 1, 3)
        k = proj("k_proj", h).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
        v = proj("v_proj", h).reshape(B, T, n_kv, d).transpose(0, 2, 1, 3)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: RMSNorm over each head's d, before RoPE
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # repeat_kv: query head j uses kv head j // (n_h // n_kv)
        k = np.repeat(k, n_h // n_kv, axis=1)
        v = np.repeat(v, n_h // n_kv, axis=1)
        s = (q @ k.transpose(0, 1, 3, 2)) * d**-0.5 + (window_mask if kinds[i] == "sliding_attention" else mask)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        a = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, n_h * d)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        silu = lambda a: a / (1.0 + np.exp(-a))
        moe = _moe_of(cfg, i)
        if moe is None:
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
            continue
        # top-k of the router's softmax, the k gates renormalised (Mixtral; Qwen3-MoE's norm_topk_prob)
        router, expert, (wg, wu, wd), k, renormalize = moe
        logits = h @ w[p + router].T  # [B, T, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[..., :k]
        gates = np.take_along_axis(probs, top, -1)
        if renormalize:
            gates = gates / gates.sum(-1, keepdims=True)
        y = np.zeros_like(x)
        for e in range(logits.shape[-1]):
            weight = (gates * (top == e)).sum(-1, keepdims=True)  # [B, T, 1], 0 where e is not chosen
            name = lambda m: p + expert.format(e=e, w=m)
            y = y + weight * ((silu(h @ w[name(wg)].T) * (h @ w[name(wu)].T)) @ w[name(wd)].T)
        if p + "mlp.shared_expert_gate.weight" in w:  # Qwen2-MoE: a shared SwiGLU, gated per token
            s = lambda n: w[p + f"mlp.shared_expert.{n}.weight"]
            shared = (silu(h @ s("gate_proj").T) * (h @ s("up_proj").T)) @ s("down_proj").T
            y = y + shared / (1.0 + np.exp(-(h @ w[p + "mlp.shared_expert_gate.weight"].T)))
        x = x + y
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * np.log(factor) + 1.0 if factor > 1 else 1.0


LATENT_EPS = 1e-6  # DeepSeek's latent norms are built with RMSNorm's default epsilon, not rms_norm_eps


def numpy_deepseek_logits(weights: dict, cfg: dict, tokens: np.ndarray) -> np.ndarray:
    """DeepSeek-V2 / V3 from the V2 paper's description of multi-head latent attention, float64:
    q from x (or its own normed latent), a normed kv latent expanded to each head's non-rotary key
    and value, one rotary key shared by the heads; RoPE on interleaved pairs of the rotary dims (as
    complex numbers) at YaRN's frequencies times the rotary magnitude, scores times
    (nope + rope)^-0.5 mscale(mscale_all_dim)^2; the first first_k_dense_replace layers a dense
    SwiGLU, then DeepSeekMoE: V2 softmax scores, top-k within the best group(s) by their best
    expert, V3 sigmoid scores plus the correction bias for the choice within the best groups by
    their best two, the gates (unbiased scores, V3 renormalised) times routed_scaling_factor, plus
    the shared experts."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    v3 = cfg["model_type"] == "deepseek_v3"
    N, nope, R, Hv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    C, eps = cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    B, T = tokens.shape
    rope = cfg["rope_parameters"]
    factor = rope.get("factor", 1.0)
    magnitude, scale = 1.0, (nope + R) ** -0.5
    if rope.get("rope_type") == "yarn":
        magnitude = _yarn_mscale(factor, rope["mscale"]) / _yarn_mscale(factor, rope["mscale_all_dim"])
        scale *= _yarn_mscale(factor, rope["mscale_all_dim"]) ** 2
    angles = np.arange(T, dtype=np.float64)[:, None] * numpy_inv_freq(cfg)[None, :]  # cfg head_dim is R
    turn = np.exp(1j * angles) * magnitude  # [T, R/2]

    def rotate(x):  # [..., T, R] interleaved pairs as complex numbers
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
        return np.stack([z.real, z.imag], -1).reshape(x.shape)

    silu = lambda a: a / (1.0 + np.exp(-a))
    swiglu = lambda h, p: (
        (silu(h @ w[p + "gate_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T
    )
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        if cfg.get("q_lora_rank"):
            q_latent = _rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], LATENT_EPS)
            q = q_latent @ w[a + "q_b_proj.weight"].T
        else:
            q = h @ w[a + "q_proj.weight"].T
        q = q.reshape(B, T, N, nope + R).transpose(0, 2, 1, 3)  # [B, N, T, H]
        kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        latent, k_rot = _rms(kv[..., :C], w[a + "kv_a_layernorm.weight"], LATENT_EPS), kv[..., C:]
        expanded = (latent @ w[a + "kv_b_proj.weight"].T).reshape(B, T, N, nope + Hv).transpose(0, 2, 1, 3)
        k_nope, v = expanded[..., :nope], expanded[..., nope:]
        s = q[..., :nope] @ k_nope.transpose(0, 1, 3, 2)
        s = s + rotate(q[..., nope:]) @ rotate(k_rot)[:, None].transpose(0, 1, 3, 2)
        s = s * scale + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, N * Hv)
        x = x + o @ w[a + "o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(h, p + "mlp.")
            continue
        logits = h @ w[p + "mlp.gate.weight"].T
        E, G = logits.shape[-1], cfg["n_group"]
        if v3:
            scores = 1 / (1 + np.exp(-logits))
            choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
            groups = np.sort(choice.reshape(B, T, G, E // G), -1)[..., -2:].sum(-1)
        else:
            scores = np.exp(logits - logits.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            choice = scores
            groups = choice.reshape(B, T, G, E // G).max(-1)
        best = np.argsort(-groups, -1)[..., : cfg["topk_group"]]
        kept = np.zeros(groups.shape, bool)
        np.put_along_axis(kept, best, True, -1)
        choice = np.where(np.repeat(kept, E // G, -1), choice, -np.inf)
        top = np.argsort(-choice, -1)[..., : cfg["num_experts_per_tok"]]
        gates = np.take_along_axis(scores, top, -1)
        if v3 and cfg["norm_topk_prob"]:
            gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
        gates = gates * cfg["routed_scaling_factor"]
        y = swiglu(h, p + "mlp.shared_experts.")
        for e in range(E):
            weight = (gates * (top == e)).sum(-1, keepdims=True)
            y = y + weight * swiglu(h, p + f"mlp.experts.{e}.")
        x = x + y
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def numpy_gemma_logits(weights: dict, cfg: dict, tokens: np.ndarray) -> np.ndarray:
    """Gemma 2's and Gemma 3's text model from their description, float64: embeddings times
    sqrt(D); per layer an RMSNorm scaling by (1 + w) before attention, (Gemma 3) q/k norms the same
    way over head_dim, RoPE with the layer type's parameters (Gemma 3's local layers: their own
    base; global: rope_theta, linear scaling divides the frequencies; Gemma 2: one plain RoPE),
    scores times query_pre_attn_scalar^-0.5, (Gemma 2) capped c tanh(s / c) by
    attn_logit_softcapping, a window of sliding_window keys on the local layers, (1 + w) norms on
    the attention and MLP outputs before each residual add and before the MLP, GeGLU with
    tanh-approximated gelu; a final (1 + w) norm, tied logits, capped by final_logit_softcapping."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n_h, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    B, T = tokens.shape
    norm = lambda x, weight: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + weight)
    gelu_tanh = lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))
    cap = lambda a, key: cfg[key] * np.tanh(a / cfg[key]) if cfg.get(key) else a
    back = np.arange(T)[:, None] - np.arange(T)[None, :]
    x = w["model.embed_tokens.weight"][tokens] * np.sqrt(cfg["hidden_size"])
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        rope = cfg["rope_parameters"].get(kind, cfg["rope_parameters"])  # Gemma 2: one for all layers
        inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if rope.get("rope_type") == "linear":
            inv_freq = inv_freq / rope["factor"]
        freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
        visible = back >= 0 if kind == "full_attention" else (back >= 0) & (back < cfg["sliding_window"])
        h = norm(x, w[p + "input_layernorm.weight"])
        proj = lambda name, heads: (
            (h @ w[p + f"self_attn.{name}.weight"].T).reshape(B, T, heads, d).transpose(0, 2, 1, 3)
        )
        q, k, v = proj("q_proj", n_h), proj("k_proj", n_kv), proj("v_proj", n_kv)
        if p + "self_attn.q_norm.weight" in w:  # Gemma 3
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, n_h // n_kv, axis=1), np.repeat(v, n_h // n_kv, axis=1)
        s = cap((q @ k.transpose(0, 1, 3, 2)) * cfg["query_pre_attn_scalar"] ** -0.5, "attn_logit_softcapping")
        s = np.where(visible, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, n_h * d)
        x = x + norm(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"])
        h = norm(x, w[p + "pre_feedforward_layernorm.weight"])
        y = (gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        x = x + norm(y, w[p + "post_feedforward_layernorm.weight"])
    return cap(norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T, "final_logit_softcapping")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(MODELS), help="regenerate this model only")
    only = parser.parse_args(argv).only
    torch.set_num_threads(1)
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    for name, spec in MODELS.items():
        if only and name != only:
            continue
        out = OUT_ROOT / name
        out.mkdir(parents=True, exist_ok=True)
        model = build_model(spec)
        model.save_pretrained(out, safe_serialization=True)
        gen_cfg = out / "generation_config.json"
        if gen_cfg.exists():
            gen_cfg.unlink()

        gen = torch.Generator().manual_seed(2000 + spec["seed"])
        vocab = 381 if spec.get("family") == "gemma3_mm" else COMMON["vocab_size"]  # no image tokens
        tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits.to(torch.float32)
        assert logits.shape == (BATCH, SEQ, COMMON["vocab_size"])

        np.save(out / "tokens.npy", tokens.numpy().astype(np.int32))
        np.save(out / "logits.npy", logits.numpy().astype(np.float32))
        (out / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")

        # Self-check: reload the saved artefacts torch-free and recompute.
        cfg = json.loads((out / "config.json").read_text())
        weights = safetensors.numpy.load_file(out / "model.safetensors")
        if cfg["model_type"] == "gemma3":  # its language model's config and tensors, renamed
            cfg = cfg["text_config"]
            weights = {k.replace("language_model.", "", 1): v for k, v in weights.items() if "language_model." in k}
        numpy_logits = numpy_gemma_logits if cfg["model_type"].startswith("gemma") else numpy_llama_logits
        numpy_logits = numpy_deepseek_logits if cfg["model_type"].startswith("deepseek") else numpy_logits
        ref = numpy_logits(weights, cfg, np.load(out / "tokens.npy"))
        err = float(np.max(np.abs(ref - np.load(out / "logits.npy"))))
        scale = float(np.max(np.abs(ref)))
        print(
            f"[{name}] saved to {out.relative_to(REPO_ROOT)}; "
            f"numpy-reference max|diff|={err:.3e} (max|logit|={scale:.3e})"
        )
        assert err < 1e-4 * max(scale, 1.0), err
        for f in sorted(os.listdir(out)):
            print(f"    {f}: {(out / f).stat().st_size} bytes")
    print(json.dumps(versions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
