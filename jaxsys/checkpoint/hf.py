"""Hugging Face Llama weights in and out: safetensors <-> a jaxsys workdir (`python -m jaxsys.convert`
is the command).

`from_hf` reads DIR/config.json and DIR/*.safetensors of a Llama-family model (Llama, Mistral,
Qwen2 with its q/k/v biases, Qwen3 with its q/k norms, Gemma 2 (soft-capped), Gemma 3's text model (also out of its
image-text checkpoint), Phi-3 / Phi-4 with fused projections, Mixtral, Qwen2-MoE (gated shared
expert) and Qwen3-MoE experts,
sliding windows; GQA/MQA, any rope
theta and Llama 3.1's, linear or YaRN rope scaling, tied or untied embeddings; other rope scalings, biases
and other activations are refused by name),
sets `config.model` from it on top of a config (training, data and mesh settings), and writes the
resolved config.json and checkpoint step 0 (the weights and a fresh optimizer state) into a workdir,
which must not already hold a run, with the model's tokenizer (the directory's tokenizer.json and
companions copied into W/tokenizer/, or a record that it has none: jaxsys/tokenizer.py). `to_hf`
writes config.json and model.safetensors (and the tokenizer files) from a workdir's checkpoint.
Safetensors only: pickle files (`*.bin`, `*.pt`) are never read. FP8 checkpoints with block
scales (config.json's quantization_config quant_method "fp8" with weight_block_size: DeepSeek-V3's
released weights, Qwen3's FP8 ones) are read dequantized (`dequantized`); other quantized
checkpoints (GPTQ, AWQ, bitsandbytes) are refused by name.

The mapping is a transpose and reshape per tensor: HF's `nn.Linear` weights are [out, in], jaxsys's
are [in, out] with heads split out (wq [D, N, H]) and stacked over layers. HF's Llama applies RoPE
to the two halves of each head (`rotate_half`), as jaxsys does, so q/k need no permutation.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys import tokenizer as tokenizer_lib
from jaxsys.checkpoint import ONE_DEVICE, Checkpointer, hf_deepseek, load, require_new_workdir, saved_config
from jaxsys.config import ConfigError, apply_overrides, base_config, layer_pattern, mlp_pattern, validate


class ConversionError(ValueError):
    """Input that cannot be converted: the message names the file, key or tensor and the fix."""


# jaxsys layer parameter -> (HF tensor name in layer i, how to turn HF's array into jaxsys's)
def _layer_map(m):
    """jaxsys layer leaf -> (HF tensor name in layer i, HF array -> jaxsys array); an MLA model's
    attention leaves are hf_deepseek's."""
    full = _full_layer_map(m)
    return {k: v for k, v in full.items() if k not in ("wq", "wk", "wv", "wo")} if _mla(m) else full


def _mla(m) -> bool:
    return bool(m.mla.kv_lora_rank)


def _full_layer_map(m):
    D, N, K, H = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    if m.post_norms:  # Gemma 2 / 3: four norms a layer (and Gemma 3's q/k norms), each scaling by (1 + w)
        plus_one = lambda w: (w.astype(np.float32) + 1.0).astype(w.dtype)  # exact with fp32 params
        qk = {"q_norm": ("self_attn.q_norm.weight", plus_one), "k_norm": ("self_attn.k_norm.weight", plus_one)}
        return {
            **(qk if m.qk_norm else {}),
            "attn_norm": ("input_layernorm.weight", plus_one),
            "wq": ("self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H)),
            "wk": ("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H)),
            "wv": ("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H)),
            "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D)),
            "attn_out_norm": ("post_attention_layernorm.weight", plus_one),
            "mlp_norm": ("pre_feedforward_layernorm.weight", plus_one),
            "mlp_out_norm": ("post_feedforward_layernorm.weight", plus_one),
            "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
            "w_up": ("mlp.up_proj.weight", lambda w: w.T),
            "w_down": ("mlp.down_proj.weight", lambda w: w.T),
        }
    qk_norm = {"q_norm": ("self_attn.q_norm.weight", lambda w: w), "k_norm": ("self_attn.k_norm.weight", lambda w: w)}
    bias = {
        "bq": ("self_attn.q_proj.bias", lambda w: w.reshape(N, H)),
        "bk": ("self_attn.k_proj.bias", lambda w: w.reshape(K, H)),
        "bv": ("self_attn.v_proj.bias", lambda w: w.reshape(K, H)),
    }
    return {
        **(qk_norm if m.qk_norm else {}),
        **(bias if m.qkv_bias else {}),
        "attn_norm": ("input_layernorm.weight", lambda w: w),
        "wq": ("self_attn.q_proj.weight", lambda w: w.T.reshape(D, N, H)),
        "wk": ("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, H)),
        "wv": ("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, H)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(N, H, D)),
        "mlp_norm": ("post_attention_layernorm.weight", lambda w: w),
        "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": ("mlp.up_proj.weight", lambda w: w.T),
        "w_down": ("mlp.down_proj.weight", lambda w: w.T),
    }


def _layer_unmap(m):
    """The inverse of `_layer_map`: jaxsys array of one layer -> HF's [out, in]."""
    full = _full_layer_unmap(m)
    return {k: v for k, v in full.items() if k not in ("wq", "wk", "wv", "wo")} if _mla(m) else full


def _full_layer_unmap(m):
    D, N, K, H = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    if m.post_norms:
        minus_one = lambda w: w.astype(np.float32) - 1.0
        norms = ("q_norm", "k_norm") * m.qk_norm + ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
        return {
            **dict.fromkeys(norms, minus_one),
            "wq": lambda w: w.reshape(D, N * H).T,
            "wk": lambda w: w.reshape(D, K * H).T,
            "wv": lambda w: w.reshape(D, K * H).T,
            "wo": lambda w: w.reshape(N * H, D).T,
            "w_gate": lambda w: w.T,
            "w_up": lambda w: w.T,
            "w_down": lambda w: w.T,
        }
    return {
        **({"q_norm": lambda w: w, "k_norm": lambda w: w} if m.qk_norm else {}),
        **(
            {"bq": lambda w: w.reshape(-1), "bk": lambda w: w.reshape(-1), "bv": lambda w: w.reshape(-1)}
            if m.qkv_bias
            else {}
        ),
        "attn_norm": lambda w: w,
        "wq": lambda w: w.reshape(D, N * H).T,
        "wk": lambda w: w.reshape(D, K * H).T,
        "wv": lambda w: w.reshape(D, K * H).T,
        "wo": lambda w: w.reshape(N * H, D).T,
        "mlp_norm": lambda w: w,
        "w_gate": lambda w: w.T,
        "w_up": lambda w: w.T,
        "w_down": lambda w: w.T,
    }


# ----------------------------------------------------------------------------- HF config


def _hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(
            f"{hf_dir} has no config.json: pass the directory of a Hugging Face model (config.json and *.safetensors)"
        )
    with open(path) as f:
        return json.load(f)


def _set_rope(hf: dict, model) -> None:
    """RoPE's theta and scaling into `model`: transformers >= 5 nests them in `rope_parameters`
    (Gemma 3's per layer type: the global layers' and the local ones', unscaled), earlier versions
    have a top-level `rope_theta` (Gemma 3: and `rope_local_base_freq`) and a `rope_scaling` dict
    (Llama 3.1-3.3's llama3, YaRN, linear)."""
    rope = hf.get("rope_parameters") or {}
    model.rope_local_theta = 0.0
    if hf.get("model_type") == "gemma3_text":  # per layer type: global layers as below, local unscaled
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConversionError(
                f"the local layers' rope type {local['rope_type']!r}: jaxsys scales only the global ones"
            )
        model.rope_local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        rope = rope.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1e6)}
    scaling = {**(hf.get("rope_scaling") or {}), **rope}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ConversionError(
            f"rope type {kind!r} is not supported: jaxsys implements plain RoPE and the 'linear', 'llama3' and "
            "'yarn' scalings"
        )
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError("partial_rotary_factor != 1: jaxsys rotates every dimension of a head")
    model.rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    model.rope_scaling = "none" if kind == "default" else kind
    if kind == "yarn":
        # as transformers reads it: the original context defaults to max_position_embeddings, the
        # factor to the ratio of the two (DeepSeek-V3), the attention factor to mscale's rule
        original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        if not original:
            raise ConversionError(
                "rope type 'yarn' needs original_max_position_embeddings (or max_position_embeddings)"
            )
        factor = scaling.get("factor") or hf["max_position_embeddings"] / original
        attention_factor = scaling.get("attention_factor")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim and factor > 1:
            attention_factor = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
        model.rope_factor = float(factor)
        model.rope_original_max_position = int(original)
        model.rope_beta_fast = float(scaling.get("beta_fast") or 32.0)
        model.rope_beta_slow = float(scaling.get("beta_slow") or 1.0)
        model.rope_attention_factor = float(attention_factor or 0.0)
        model.rope_truncate = bool(scaling.get("truncate", True))
    elif kind != "default":
        model.rope_factor = float(scaling["factor"])
    if kind == "llama3":
        model.rope_low_freq_factor = float(scaling["low_freq_factor"])
        model.rope_high_freq_factor = float(scaling["high_freq_factor"])
        model.rope_original_max_position = int(scaling["original_max_position_embeddings"])


def _hf_rope(m) -> dict:
    """`rope_parameters` (transformers 5; its older `rope_scaling` holds the same keys but theta)."""
    out = {"rope_theta": m.rope_theta, "rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling}
    if m.rope_scaling != "none":
        out["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        out.update(
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_position,
        )
    if m.rope_scaling == "yarn":
        out["original_max_position_embeddings"] = m.rope_original_max_position
        for key, value, default in (  # what differs from transformers' defaults
            ("beta_fast", m.rope_beta_fast, 32.0),
            ("beta_slow", m.rope_beta_slow, 1.0),
            ("truncate", m.rope_truncate, True),
            ("attention_factor", m.rope_attention_factor, 0.0),
        ):
            if value != default:
                out[key] = value
    return out


# Qwen2 (and 2.5): Llama's layout plus q/k/v biases; Qwen3: plus a per-head RMSNorm of q and k instead
MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    *hf_deepseek.FAMILIES,
)

# the MoE families: the router and each expert's SwiGLU matrices under the layer's prefix
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.{w}.weight", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{e}.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
    **dict.fromkeys(hf_deepseek.FAMILIES, hf_deepseek.MOE_NAMES),
}
# Qwen2-MoE's gated shared expert: one SwiGLU of shared_experts x F units, its output times
# sigmoid(h w_g) (config.model.moe.shared_expert_gate)
_SHARED_NAMES = {
    "shared_gate": "mlp.shared_expert.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
}


def _moe_family(m) -> str:
    """The Hugging Face family of a jaxsys MoE model: DeepSeek-V2 / V3 with MLA, Qwen3-MoE with q/k
    norms, Qwen2-MoE with q/k/v biases, else Mixtral."""
    if _mla(m):
        return hf_deepseek.family(m)
    return "qwen3_moe" if m.qk_norm else "qwen2_moe" if m.qkv_bias else "mixtral"


def _shared_names(m) -> dict:
    """The shared experts' tensors under a MoE layer's prefix: DeepSeek's, or Qwen2-MoE's gated one."""
    return hf_deepseek.SHARED_NAMES if _mla(m) else _SHARED_NAMES


def _mlp_kinds(m) -> list[str]:
    """Each layer's MLP kind ("dense" | "moe"), in order."""
    pattern = mlp_pattern(m)
    return [pattern[i % len(pattern)] for i in range(m.n_layers)]


def _shortest_period(kinds: list[str]) -> str:
    """The comma-separated shortest prefix of `kinds` that repeats to all of it."""
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
    return ",".join(kinds[:period])


def _set_moe(hf: dict, model) -> None:
    """Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts into `model.moe` (dropless, softmax top-k
    routing as theirs: Mixtral renormalises the k gates, the Qwens when norm_topk_prob; Qwen2-MoE's
    gated shared expert of shared_expert_intermediate_size units as shared_experts of F each) and
    the MoE layers into `model.mlp_pattern` (the Qwens: every decoder_sparse_step-th layer not in
    mlp_only_layers)."""
    n = hf["num_hidden_layers"]
    if hf["model_type"] == "mixtral":
        experts, expert_ff, renormalize = hf["num_local_experts"], hf["intermediate_size"], True
        moe_layers = [True] * n
    else:
        # transformers 5 names it num_local_experts, as Mixtral; the Hub's configs num_experts
        experts, expert_ff = hf.get("num_experts") or hf["num_local_experts"], hf["moe_intermediate_size"]
        renormalize = bool(hf.get("norm_topk_prob", False))
        step, dense_only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
        moe_layers = [i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(n)]
    if hf["model_type"] == "qwen2_moe" and not hf.get("qkv_bias", True):
        raise ConversionError("a Qwen2-MoE with qkv_bias=false: jaxsys reads Qwen2-MoE's layout with q/k/v biases")
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    if shared and hf["model_type"] != "qwen2_moe":
        raise ConversionError(
            f"shared_expert_intermediate_size={shared} in a {hf['model_type']} config: only Qwen2-MoE's gated "
            "shared expert converts"
        )
    if shared % expert_ff:
        raise ConversionError(
            f"shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size={expert_ff}: "
            "jaxsys's shared experts are whole experts of F units (config.model.moe.shared_experts)"
        )
    model.mlp_pattern = _shortest_period(["moe" if k else "dense" for k in moe_layers])
    moe = model.moe
    moe.experts, moe.top_k, moe.d_ff = int(experts), int(hf["num_experts_per_tok"]), int(expert_ff)
    moe.router, moe.renormalize, moe.capacity_factor = "softmax", renormalize, 0.0
    moe.shared_experts, moe.shared_expert_gate = shared // int(expert_ff), bool(shared)
    moe.aux_loss_weight, moe.z_loss_weight = float(hf.get("router_aux_loss_coef", 0.001)), 0.0


def _window_layers(hf: dict) -> tuple[int | None, list[bool]]:
    """(W, which layers are windowed) as transformers reads config.json: Mistral's
    `sliding_window` (4096 when absent, as MistralConfig) applies to every layer; Qwen2's and
    Qwen3's only with `use_sliding_window`, to the layers `layer_types` marks "sliding_attention"
    (transformers 5) or else those from `max_window_layers` on; Gemma 3's to those `layer_types`
    marks, or else all but every `sliding_window_pattern`-th (6th); Gemma 2's likewise, every
    second layer global; Llama has none."""
    n = hf["num_hidden_layers"]
    kind = hf["model_type"]
    if kind in ("gemma2", "gemma3_text"):  # layer_types, or every sliding_window_pattern-th layer global
        pattern = 2 if kind == "gemma2" else hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        if not hf.get("layer_types"):
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
            hf = {**hf, "layer_types": types}
        window = hf.get("sliding_window", 4096)
    elif kind == "mistral":
        window = hf.get("sliding_window", 4096)
    elif kind in ("mixtral", "phi3"):
        window = hf.get("sliding_window")
    elif kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window", False):
        window = hf.get("sliding_window")
    else:
        window = None
    if not window:
        return None, [False] * n
    if kind in ("mistral", "mixtral", "phi3"):
        return int(window), [True] * n
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(n)
    ]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ConversionError(f"layer_types {types!r}: expected {n} of 'full_attention' / 'sliding_attention'")
    return int(window), [t == "sliding_attention" for t in types]


def _set_window(hf: dict, model) -> None:
    """Sliding-window layers into `model`: layer_pattern of "local" / "softmax" (the shortest
    period that repeats to the layers) and sliding_window W."""
    window, windowed = _window_layers(hf)
    model.layer_pattern = _shortest_period(["local" if w else "softmax" for w in windowed])
    model.sliding_window = window if any(windowed) else 0


def _hf_window(m, family: str) -> dict:
    """config.json's sliding-window keys for `m` in `family` (llama turns into mistral for a model
    whose every layer is windowed); {} without local layers."""
    kinds = [kind == "local" for kind in layer_pattern(m)] * (m.n_layers // len(layer_pattern(m)))
    if family == "llama":
        if not any(kinds):
            return {}
        if not all(kinds):
            raise ConversionError(
                f"config.model.layer_pattern={m.layer_pattern!r} mixes windowed and full layers, which a Hugging "
                "Face Mistral cannot express (its window applies to every layer); Qwen2's config can, but this "
                "model has no q/k/v biases"
            )
        return {"sliding_window": m.sliding_window}
    if not any(kinds):
        return {"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * len(kinds)}
    first = kinds.index(True)
    if kinds != [False] * first + [True] * (len(kinds) - first):
        raise ConversionError(
            f"config.model.layer_pattern={m.layer_pattern!r}: Qwen's config windows the layers from "
            "max_window_layers on; this model's windowed layers are not the last ones"
        )
    return {
        "use_sliding_window": True,
        "sliding_window": m.sliding_window,
        "max_window_layers": first,
        "layer_types": ["sliding_attention" if k else "full_attention" for k in kinds],
    }


# A multimodal checkpoint whose language model converts on its own: Gemma 3 4B-27B
# (Gemma3ForConditionalGeneration, model_type "gemma3"): the text config nested, its tensors
# prefixed; the vision tower and projector are left behind
MULTIMODAL_TEXT = {"gemma3": "gemma3_text"}
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def text_config(hf: dict) -> dict:
    """The language model's config.json dict: `hf` itself, or a multimodal model's `text_config`
    (with the top level's tie_word_embeddings when the text config has none)."""
    if hf.get("model_type") not in MULTIMODAL_TEXT:
        return hf
    text = dict(hf.get("text_config") or {})
    text["model_type"] = MULTIMODAL_TEXT[hf["model_type"]]
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return text


def text_tensors(tensors: dict) -> dict:
    """A multimodal checkpoint's language-model tensors under the text model's own names (the
    others dropped); a text model's tensors unchanged."""
    if not any(name.startswith(old) for name in tensors for old, _ in _TEXT_PREFIXES):
        return tensors
    out = {}
    for name, array in tensors.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name[len(old) :]] = array
    return out


def unfused(tensors: dict, m) -> dict:
    """Phi-3 / Phi-4's fused projections split into Llama's: qkv_proj's rows are q (N H), k (K H),
    v (K H); gate_up_proj's the gate (F) then the up projection (F)."""
    out = dict(tensors)
    N, K, H, F = m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    for name in tensors:
        prefix = name[: -len("self_attn.qkv_proj.weight")]
        if name.endswith("self_attn.qkv_proj.weight"):
            qkv = out.pop(name)
            if qkv.shape[0] != (N + 2 * K) * H:
                raise ConversionError(
                    f"tensor {name} has {qkv.shape[0]} rows but config.json implies {(N + 2 * K) * H}"
                )
            for part, rows in zip("qkv", np.split(qkv, [N * H, (N + K) * H])):
                out[f"{prefix}self_attn.{part}_proj.weight"] = rows
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("mlp.gate_up_proj.weight")]
            gate_up = out.pop(name)
            if gate_up.shape[0] != 2 * F:
                raise ConversionError(f"tensor {name} has {gate_up.shape[0]} rows but config.json implies {2 * F}")
            out[f"{prefix}mlp.gate_proj.weight"], out[f"{prefix}mlp.up_proj.weight"] = np.split(gate_up, 2)
    return out


def model_config_from_hf(hf: dict, model) -> None:
    """Set `config.model` (in place) from a Hugging Face Llama (or Mistral, Qwen3) config.json dict."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise ConversionError(
            f"model_type {hf.get('model_type')!r}: only Llama-family models (model_type one of {MODEL_TYPES}) convert"
        )
    # Qwen2's q/k/v biases are not switched by attention_bias; Qwen2-MoE's by qkv_bias
    qwen2 = hf["model_type"] == "qwen2" or (hf["model_type"] == "qwen2_moe" and hf.get("qkv_bias", True))
    gemma2, gemma3 = hf["model_type"] == "gemma2", hf["model_type"] == "gemma3_text"
    gemma = gemma2 or gemma3
    want_act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    checks = [want_act, ("attention_bias", False), ("mlp_bias", False)]
    if gemma:
        checks += [("use_bidirectional_attention", False)]
    for key, want in checks:
        if key == "attention_bias" and qwen2:
            continue
        if hf.get(key) is not None and hf[key] != want:  # absent or null: the family's default
            raise ConversionError(f"config.json has {key}={hf[key]!r}; jaxsys's {hf['model_type']} needs {want!r}")
    n_heads = hf["num_attention_heads"]
    model.vocab_size = hf["vocab_size"]
    model.d_model = hf["hidden_size"]
    model.n_layers = hf["num_hidden_layers"]
    model.n_heads = n_heads
    model.n_kv_heads = hf.get("num_key_value_heads") or n_heads
    model.head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    model.d_ff = hf["intermediate_size"]
    _set_rope(hf, model)
    _set_window(hf, model)
    if "local" not in model.layer_pattern:  # a Gemma 3 without local layers: no local RoPE base
        model.rope_local_theta = 0.0
    model.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    model.tie_embeddings = bool(hf.get("tie_word_embeddings", gemma))
    model.qk_norm = hf["model_type"] in ("qwen3", "gemma3_text", "qwen3_moe")
    model.mlp_pattern = "dense"
    if hf["model_type"] in _MOE_NAMES and hf["model_type"] not in hf_deepseek.FAMILIES:
        _set_moe(hf, model)
    model.qkv_bias = qwen2
    model.embed_scale = model.post_norms = gemma
    model.mlp_activation = "gelu_tanh" if gemma else "silu"
    scalar = hf.get("query_pre_attn_scalar", 256 if gemma2 else model.head_dim)  # Gemma2Config's default: 256
    model.query_pre_attn_scalar = float(scalar) if gemma else 0.0
    model.mla.kv_lora_rank = model.mla.q_lora_rank = 0
    if hf["model_type"] in hf_deepseek.FAMILIES:  # MLA, DeepSeekMoE, YaRN's softmax factor
        hf_deepseek.set_model(hf, model, ConversionError)
    # soft-capping: Gemma2Config's defaults are 50 / 30 (null: off); Gemma 3 has none unless named
    for key, ours, default in (
        ("attn_logit_softcapping", "attn_logit_softcap", 50.0),
        ("final_logit_softcapping", "final_logit_softcap", 30.0),
    ):
        model[ours] = float(hf.get(key, default if gemma2 else None) or 0.0) if gemma else 0.0


def _require_convertible(m) -> None:
    """The Llama family's layout: softmax attention (windowed or not) in every layer; SwiGLU MLPs,
    dense or MoE (Mixtral's, Qwen3-MoE's: softmax routing, no shared experts)."""
    if not set(layer_pattern(m)) <= {"softmax", "local"}:
        raise ConversionError(
            f"jaxsys.convert reads and writes Llama-family checkpoints (softmax attention), but this model has "
            f"layer_pattern={m.layer_pattern!r}; linear-attention layers have no Hugging Face equivalent"
        )
    gated = m.moe.shared_experts and m.moe.shared_expert_gate and m.qkv_bias
    if (
        "moe" in mlp_pattern(m)
        and not _mla(m)
        and (m.moe.router != "softmax" or (m.moe.shared_experts and not gated) or m.post_norms)
    ):
        raise ConversionError(
            f"config.model.moe (router={m.moe.router!r}, shared_experts={m.moe.shared_experts}, "
            f"shared_expert_gate={m.moe.shared_expert_gate}) converts as a Mixtral or Qwen3-MoE, which route "
            "by softmax scores with no shared experts, or a Qwen2-MoE (q/k/v biases), whose shared experts "
            "are gated"
        )


def _hf_shape(m) -> dict:
    """The config.json keys every family shares: the model's sizes and its norms' epsilon."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.d_ff,
        "rms_norm_eps": m.norm_eps,
    }


def hf_config_from_model(m, dtype: str) -> dict:
    """A transformers config dict for `config.model`: Llama's, Mistral's (a window in every layer),
    Qwen2's (q/k/v biases) or Qwen3's (q/k norms); both the transformers 5 `rope_parameters` and the
    older top-level `rope_theta`, so either version reads it."""
    if _mla(m):  # DeepSeek-V2 / V3
        return hf_deepseek.hf_config(m, _hf_shape(m), _hf_rope(m), dtype, ConversionError)
    if m.qk_norm and m.qkv_bias:
        raise ConversionError(
            "config.model.qk_norm with qkv_bias has no Hugging Face Llama-family equivalent (Qwen3 has the "
            "norms, Qwen2 the biases)"
        )
    if m.post_norms:
        return _gemma_config(m, dtype)
    gemma_pieces = dict(
        embed_scale=m.embed_scale,
        mlp_activation=m.mlp_activation != "silu",
        query_pre_attn_scalar=m.query_pre_attn_scalar,
        rope_local_theta=m.rope_local_theta,
        attn_logit_softcap=m.attn_logit_softcap,
        final_logit_softcap=m.final_logit_softcap,
    )
    if any(gemma_pieces.values()):
        raise ConversionError(
            f"config.model.{next(k for k, v in gemma_pieces.items() if v)} without post_norms: Gemma's pieces convert "
            "together, as a Gemma 2 or 3 (Gemma2ForCausalLM / Gemma3ForCausalLM), and this model is not one"
        )
    family = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    window = _hf_window(m, family)
    if family == "llama" and window:  # Llama's layout with a window in every layer
        family = "mistral"
    moe = _hf_moe(m, family)
    if moe:
        family = moe.pop("model_type")
        if family == "mixtral":  # MixtralConfig's window is off unless named
            window = window or {"sliding_window": None}
    rope = _hf_rope(m)
    architecture = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mixtral": "Mixtral",
        "qwen2_moe": "Qwen2Moe",
        "qwen3_moe": "Qwen3Moe",
    }[family]
    return {
        "architectures": [architecture + "ForCausalLM"],
        "model_type": family,
        **_hf_shape(m),
        "hidden_act": "silu",
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
        **({} if m.rope_scaling == "none" else {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}),
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        **window,
        **moe,  # after intermediate_size: Mixtral's is the experts'
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _hf_moe(m, family: str) -> dict:
    """config.json's MoE keys (and model_type) for a model with MoE layers; {} without. Mixtral:
    every layer MoE, gates renormalised; Qwen3-MoE (q/k norms): dense layers as mlp_only_layers."""
    kinds = _mlp_kinds(m)
    if "moe" not in kinds:
        return {}
    moe = m.moe
    if family == "qwen2" and moe.shared_experts and moe.shared_expert_gate:
        return {
            "model_type": "qwen2_moe",
            "num_experts": moe.experts,
            "moe_intermediate_size": moe.d_ff,
            "shared_expert_intermediate_size": moe.shared_experts * moe.d_ff,
            "norm_topk_prob": bool(moe.renormalize),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "dense"],
            "qkv_bias": True,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_weight,
        }
    if family == "qwen2" or (family in ("llama", "mistral") and ("dense" in kinds or not moe.renormalize)):
        raise ConversionError(
            f"this MoE model (mlp_pattern={m.mlp_pattern!r}, renormalize={moe.renormalize}, "
            f"qkv_bias={m.qkv_bias}) is neither a Mixtral (MoE in every layer, gates renormalised, no biases) nor "
            "a Qwen3-MoE (q/k norms)"
        )
    common = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_weight}
    if family in ("llama", "mistral"):
        return {"model_type": "mixtral", "num_local_experts": moe.experts, "intermediate_size": moe.d_ff, **common}
    return {
        "model_type": "qwen3_moe",
        "num_experts": moe.experts,  # transformers 4's name, and 5's
        "num_local_experts": moe.experts,
        "moe_intermediate_size": moe.d_ff,
        "norm_topk_prob": bool(moe.renormalize),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "dense"],
        **common,
    }


def _gemma_config(m, dtype: str) -> dict:
    """A Gemma3TextConfig dict (Gemma3ForCausalLM; with q/k norms) or a Gemma2Config dict
    (Gemma2ForCausalLM; without) for a model with Gemma's pieces, refused by name where
    transformers' Gemma would compute something else."""
    need = dict(
        embed_scale=m.embed_scale,
        mlp_activation=m.mlp_activation == "gelu_tanh",
        qkv_bias=not m.qkv_bias,
    )
    if not all(need.values()):
        raise ConversionError(
            "config.model.post_norms converts as a Gemma 2 or 3, which also have embed_scale=True, "
            f"mlp_activation='gelu_tanh' and no qkv_bias; this model differs in {[k for k, v in need.items() if not v]}"
        )
    kinds = [kind == "local" for kind in layer_pattern(m)] * (m.n_layers // len(layer_pattern(m)))
    common = {
        **_hf_shape(m),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": m.query_pre_attn_scalar or m.head_dim,
        "sliding_window": m.sliding_window if any(kinds) else None,
        "layer_types": ["sliding_attention" if k else "full_attention" for k in kinds],
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": False,
        "final_logit_softcapping": m.final_logit_softcap or None,
        "attn_logit_softcapping": m.attn_logit_softcap or None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if not m.qk_norm:  # Gemma 2: one RoPE for every layer
        if m.rope_local_theta and m.rope_local_theta != m.rope_theta:
            raise ConversionError(
                f"config.model.rope_local_theta={m.rope_local_theta}: a model without q/k norms converts as a "
                "Gemma 2, whose local layers share the global RoPE base; set it to 0"
            )
        return {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            **common,
            "rope_parameters": _hf_rope(m),
        }
    if any(kinds) and not m.rope_local_theta and m.rope_scaling != "none":
        raise ConversionError(
            "Gemma 3's local layers use unscaled RoPE: set config.model.rope_local_theta (10000.0 in Gemma 3) "
            f"for a model with rope_scaling={m.rope_scaling!r}"
        )
    local_theta = m.rope_local_theta or m.rope_theta
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "rope_parameters": {
            "full_attention": _hf_rope(m),
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_local_base_freq": local_theta,
    }


# ----------------------------------------------------------------------------- tensors


def fp8_block(hf: dict) -> tuple[int, int] | None:
    """The [rows, columns] weight block of config.json's FP8 quantization_config (None: not
    quantized); ConversionError for a quantization jaxsys.convert does not read."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2 and all(b >= 1 for b in block)):
        raise ConversionError(
            f"config.json has quantization_config quant_method={method!r} weight_block_size={block!r}: "
            "jaxsys.convert reads float checkpoints and block-scaled FP8 ones (quant_method 'fp8' with a "
            "[rows, columns] weight_block_size); dequantize this one to bf16 first (transformers: load it "
            "and save_pretrained without the quantization_config)"
        )
    return int(block[0]), int(block[1])


def dequantized(tensors: dict[str, np.ndarray], block: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """FP8 block-quantized weights as float32: each float8 tensor X [R, C] times its
    `X_scale_inv` [ceil(R / b0), ceil(C / b1)] repeated over its b0 x b1 blocks (the last ones
    partial); the scale tensors dropped. A float8 tensor without its scale is named."""
    fp8 = {name for name, a in tensors.items() if "float8" in a.dtype.name}
    if not fp8:
        return tensors
    if block is None:
        raise ConversionError(
            f"tensor {sorted(fp8)[0]} is float8 ({tensors[sorted(fp8)[0]].dtype}) but config.json has no FP8 "
            "quantization_config (quant_method 'fp8', weight_block_size): its scales cannot be read"
        )
    out = {name: a for name, a in tensors.items() if not name.endswith("_scale_inv")}
    b0, b1 = block
    for name in sorted(fp8):
        w, scale = tensors[name], tensors.get(name + "_scale_inv")
        want = (math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)) if w.ndim == 2 else None
        if scale is None or want is None or tuple(scale.shape) != want:
            raise ConversionError(
                f"float8 tensor {name} {tuple(w.shape)} needs {name}_scale_inv of shape {want} "
                f"(one scale per {b0} x {b1} block); the safetensors have "
                f"{'none' if scale is None else tuple(scale.shape)}"
            )
        full = np.repeat(np.repeat(scale.astype(np.float32), b0, axis=0), b1, axis=1)
        out[name] = w.astype(np.float32) * full[: w.shape[0], : w.shape[1]]
    return out


def _safetensors_header(path: str) -> tuple[dict, int]:
    """A safetensors file's JSON header and the byte offset its data starts at."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _read_fp8_file(path: str, header: dict, start: int) -> dict[str, np.ndarray]:
    """A safetensors file with float8 tensors (which safetensors.numpy cannot load), memory-mapped
    with ml_dtypes' float8 types."""
    import ml_dtypes

    dtypes = {
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "BF16": ml_dtypes.bfloat16,
        "F16": np.float16,
        "F32": np.float32,
        "F64": np.float64,
        "I64": np.int64,
        "I32": np.int32,
        "I8": np.int8,
        "U8": np.uint8,
        "BOOL": np.bool_,
    }
    data = np.memmap(path, np.uint8, mode="r", offset=start)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ConversionError(
                f"{path}: tensor {name} has dtype {info['dtype']}, which jaxsys.convert does not read"
            )
        begin, end = info["data_offsets"]
        out[name] = np.asarray(data[begin:end]).view(dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def _read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors.numpy needs)
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        pickles = [
            os.path.basename(p)
            for p in glob.glob(os.path.join(hf_dir, "*.bin")) + glob.glob(os.path.join(hf_dir, "*.pt"))
        ]
        hint = (
            (
                f" (it has {pickles}: pickle files are never read; convert them to safetensors with "
                "transformers' save_pretrained(safe_serialization=True))"
            )
            if pickles
            else ""
        )
        raise ConversionError(f"{hf_dir} has no *.safetensors file{hint}")
    tensors = {}
    for path in files:
        try:
            header, start = _safetensors_header(path)
            fp8 = any(str(v.get("dtype", "")).startswith("F8") for k, v in header.items() if k != "__metadata__")
            tensors.update(_read_fp8_file(path, header, start) if fp8 else load_file(path))
        except ConversionError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ConversionError(f"{path} could not be read as safetensors ({type(e).__name__}: {e})") from e
    return tensors


def _layers_of(m, key: str) -> list[int]:
    """The layers whose weights leaf `key` stacks: the dense-MLP leaves the dense layers, "moe" the
    MoE ones, the others every layer."""
    from jaxsys.models import transformer

    kind = transformer.leaf_kind(key)
    return [i for i, mlp in enumerate(_mlp_kinds(m)) if kind == "all" or mlp == kind]


def params_from_hf(tensors: dict[str, np.ndarray], m, dtype) -> dict:
    """jaxsys parameters (numpy, `dtype`) from HF tensors; checks every name and shape."""

    def take(name, shape):
        if name not in tensors:
            raise ConversionError(
                f"the safetensors have no tensor {name!r} (config.json says "
                f"{m.n_layers} layers{', untied embeddings' if 'lm_head' in name else ''})"
            )
        array = tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise ConversionError(
                f"tensor {name} has shape {tuple(array.shape)} but config.json implies {tuple(shape)}"
            )
        return array.astype(dtype)

    D, N, K, H, F, V = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size
    hf_shapes = {
        "q_norm": (H,),
        "k_norm": (H,),
        "bq": (N * H,),
        "bk": (K * H,),
        "bv": (K * H,),
        "attn_norm": (D,),
        "wq": (N * H, D),
        "wk": (K * H, D),
        "wv": (K * H, D),
        "wo": (D, N * H),
        "mlp_norm": (D,),
        "attn_out_norm": (D,),
        "mlp_out_norm": (D,),
        "w_gate": (F, D),
        "w_up": (F, D),
        "w_down": (D, F),
    }
    layers = {
        key: np.stack([convert(take(f"model.layers.{i}.{name}", hf_shapes[key])) for i in _layers_of(m, key)])
        for key, (name, convert) in _layer_map(m).items()
        if _layers_of(m, key)
    }
    if _mla(m):
        layers.update(hf_deepseek.params(take, m, list(range(m.n_layers))))
    moe_layers = _layers_of(m, "moe")
    if moe_layers:  # router [E, D] and experts' [out, in] per layer -> [n, D, E], [n, E, D, F], [n, E, F, D]
        router, expert, (gate, up, down) = _MOE_NAMES[_moe_family(m)]
        E, Fe = m.moe.experts, m.moe.d_ff
        experts = lambda i, w, shape: np.stack(
            [take(f"model.layers.{i}.{expert.format(e=e, w=w)}", shape).T for e in range(E)]
        )
        layers["moe"] = {
            "router": np.stack([take(f"model.layers.{i}.{router}", (E, D)).T for i in moe_layers]),
            "w_gate": np.stack([experts(i, gate, (Fe, D)) for i in moe_layers]),
            "w_up": np.stack([experts(i, up, (Fe, D)) for i in moe_layers]),
            "w_down": np.stack([experts(i, down, (D, Fe)) for i in moe_layers]),
        }
        if m.moe.shared_experts:  # DeepSeek's, or Qwen2-MoE's gated shared expert ([out, in] -> [in, out])
            Fs = m.moe.shared_experts * Fe
            shapes = {
                "shared_gate": (Fs, D),
                "shared_up": (Fs, D),
                "shared_down": (D, Fs),
                "shared_expert_gate": (1, D),
            }
            for key, name in _shared_names(m).items():
                stacked = np.stack([take(f"model.layers.{i}.{name}", shapes[key]).T for i in moe_layers])
                layers["moe"][key] = stacked[..., 0] if key == "shared_expert_gate" else stacked
        if m.moe.score_bias:  # DeepSeek-V3's e_score_correction_bias (kept in fp32 by transformers)
            bias = [take(f"model.layers.{i}.{hf_deepseek.BIAS_NAME}", (E,)) for i in moe_layers]
            layers["moe"]["router_bias"] = np.stack(bias)
    params = {
        "embed": take("model.embed_tokens.weight", (V, D)),
        "layers": layers,
        # Gemma's final norm scales by (1 + w), as its layers' norms (_layer_map)
        "final_norm": (take("model.norm.weight", (D,)).astype(np.float32) + (1.0 if m.post_norms else 0.0)).astype(
            dtype
        ),
    }
    if not m.tie_embeddings:
        params["unembed"] = take("lm_head.weight", (V, D)).T
    if m.mtp.depth:
        params["mtp"] = _mtp_from_hf(tensors, take, m, dtype)
    return params


# DeepSeek-V3's multi-token-prediction module k is checkpoint layer n + k - 1 (n = num_hidden_layers):
# a layer of the main model's last kind plus these, and copies of the embedding and output head
MTP_NAMES = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "norm": "shared_head.norm.weight"}
MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def _mtp_from_hf(tensors, take, m, dtype) -> dict:
    """params["mtp"] from checkpoint layers n .. n + D_m - 1 (models/mtp.py's table): the norms,
    eh_proj [D, 2D] split into its embedding and hidden halves, and the layer read as layer k - 1
    of a model of the modules' layers (`mtp.layer_config`). The modules' copies of the embedding
    and output head are not read: jaxsys shares the main model's, as V3 does."""
    from jaxsys.models import mtp

    n, D = m.n_layers, m.d_model
    out = {
        key: np.stack([take(f"model.layers.{n + k}.{name}", (D,)) for k in range(m.mtp.depth)])
        for key, name in MTP_NAMES.items()
    }
    halves = lambda w: np.stack([w[:, :D].T, w[:, D:].T])  # [D, 2D] (out, in) -> [2, D in, D out]
    out["proj"] = np.stack(
        [halves(take(f"model.layers.{n + k}.eh_proj.weight", (D, 2 * D))) for k in range(m.mtp.depth)]
    )
    renamed = {}
    for k in range(m.mtp.depth):
        prefix = f"model.layers.{n + k}."
        renamed.update(
            {f"model.layers.{k}.{name[len(prefix) :]}": a for name, a in tensors.items() if name.startswith(prefix)}
        )
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if name in tensors:
            renamed[name] = tensors[name]
    out["layers"] = params_from_hf(renamed, mtp.layer_config(m), dtype)["layers"]
    return out


def _mtp_to_hf(params, m, dtype) -> dict:
    """The inverse of `_mtp_from_hf`, with the embedding and output head copied into each module as
    the released checkpoints have them."""
    from jaxsys.models import mtp

    n, w = m.n_layers, jax.tree.map(np.asarray, params["mtp"])
    sub = {"embed": params["embed"], "final_norm": params["final_norm"], "layers": w["layers"]}
    if not m.tie_embeddings:
        sub["unembed"] = params["unembed"]
    layer_tensors = hf_tensors_from_params(sub, mtp.layer_config(m), dtype)
    out = {}
    for k in range(m.mtp.depth):
        prefix = f"model.layers.{n + k}."
        own = f"model.layers.{k}."
        out.update({prefix + name[len(own) :]: a for name, a in layer_tensors.items() if name.startswith(own)})
        out.update({prefix + name: w[key][k] for key, name in MTP_NAMES.items()})
        out[prefix + "eh_proj.weight"] = np.concatenate([w["proj"][k, 0].T, w["proj"][k, 1].T], axis=1)
        for name, main in MTP_SHARED.items():
            out[prefix + name] = layer_tensors[main]
    return out


def _mtp_in_checkpoint(hf_dir: str, m) -> bool:
    """Whether the safetensors hold layer n's eh_proj (only their headers are read)."""
    name = f"model.layers.{m.n_layers}.eh_proj.weight"
    return any(name in _safetensors_header(p)[0] for p in glob.glob(os.path.join(hf_dir, "*.safetensors")))


def hf_tensors_from_params(params, m, dtype) -> dict[str, np.ndarray]:
    """HF tensor names -> contiguous numpy arrays in `dtype` (the inverse of `params_from_hf`)."""
    final = np.asarray(params["final_norm"], np.float32) - (1.0 if m.post_norms else 0.0)
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": final}
    names = {key: name for key, (name, _) in _layer_map(m).items()}
    for key, unmap in _layer_unmap(m).items():
        for j, i in enumerate(_layers_of(m, key)):
            out[f"model.layers.{i}.{names[key]}"] = unmap(np.asarray(params["layers"][key][j]))
    if _layers_of(m, "moe"):
        router, expert, ws = _MOE_NAMES[_moe_family(m)]
        moe = {k: np.asarray(v) for k, v in params["layers"]["moe"].items()}
        for j, i in enumerate(_layers_of(m, "moe")):
            out[f"model.layers.{i}.{router}"] = moe["router"][j].T
            for w, key in zip(ws, ("w_gate", "w_up", "w_down")):
                for e in range(m.moe.experts):
                    out[f"model.layers.{i}.{expert.format(e=e, w=w)}"] = moe[key][j, e].T
            if m.moe.shared_experts:
                for key, name in _shared_names(m).items():
                    array = moe[key][j][None] if key == "shared_expert_gate" else moe[key][j].T
                    out[f"model.layers.{i}.{name}"] = array
            if m.moe.score_bias:
                out[f"model.layers.{i}.{hf_deepseek.BIAS_NAME}"] = moe["router_bias"][j]
    if _mla(m):
        out.update(hf_deepseek.tensors(params["layers"], m))
    if not m.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["unembed"]).T
    if m.mtp.depth and _mla(m):  # DeepSeek-V3's layout; other families have no MTP tensors
        out.update(_mtp_to_hf(params, m, dtype))
    return {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in out.items()}


# ----------------------------------------------------------------------------- the two directions


def _tokenizer_source(hf_dir: str, tokenizer: str | None) -> tuple[str, str | None]:
    """(what to attach, a note): `tokenizer` if given, else the HF directory's own files, else "none"."""
    if tokenizer is not None:
        return tokenizer, None
    if tokenizer_lib.hf_files(hf_dir):
        return hf_dir, None
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return "none", (
            f"{hf_dir} has tokenizer.model but no tokenizer.json; make one with transformers "
            "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) and attach it"
        )
    return "none", f"{hf_dir} has no tokenizer.json"


def from_hf(hf_dir: str, workdir: str, config=None, overrides=(), tokenizer: str | None = None):
    """Convert a Hugging Face Llama directory into workdir's config.json and checkpoint step 0, and
    record the model's tokenizer (jaxsys/tokenizer.py): `tokenizer` (a Hugging Face directory or
    tokenizer.json, "bytes" or "none") if given, else the directory's own tokenizer files, else
    none (the model then takes and prints token ids, whatever config.data says). Returns the
    resolved config."""
    from jaxsys import program as program_lib
    from jaxsys.mesh import make_mesh

    require_new_workdir(workdir, ConversionError)
    config = base_config() if config is None else config
    hf = _hf_config(hf_dir)
    block = fp8_block(hf)  # a quantization it cannot read is refused before anything is read
    model_config_from_hf(text_config(hf), config.model)
    if config.model.mtp.depth and not _mtp_in_checkpoint(hf_dir, config.model):
        print(
            f"jaxsys.convert: config.json names {config.model.mtp.depth} multi-token-prediction layer(s), but the "
            f"safetensors hold no layer {config.model.n_layers} (a checkpoint saved by transformers drops them): "
            "converted without (config.model.mtp.depth=0)",
            file=sys.stderr,
        )
        config.model.mtp.depth = 0
    apply_overrides(config, overrides)  # e.g. a mesh to save on, or param_dtype
    _require_convertible(config.model)
    validate(config)
    source, note = _tokenizer_source(hf_dir, tokenizer)
    try:  # a tokenizer that does not fit the model is refused before anything is written
        tokenizer_lib.check_source(source, config.model.vocab_size)
    except tokenizer_lib.TokenizerError as e:
        raise ConversionError(str(e)) from None
    # after every check on the config: reading is the slow part
    tensors = unfused(text_tensors(dequantized(_read_safetensors(hf_dir), block)), config.model)
    params = params_from_hf(tensors, config.model, jnp.dtype(config.model.param_dtype))
    n = int(np.prod([config.mesh[a] for a in config.mesh]))
    if n > jax.device_count():
        raise ConfigError(f"config.mesh asks for {n} devices but {jax.device_count()} are available")
    program = program_lib.build(config, make_mesh(config, jax.devices()[:n]))  # any mesh up to all devices
    shardings = program.state_shardings
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(program.optimizer.init, out_shardings=shardings.opt_state)(params)
    state = program_lib.TrainState(jax.device_put(np.int32(0), shardings.step), params, opt_state)
    os.makedirs(workdir, exist_ok=True)
    checkpointer = Checkpointer(workdir, config.checkpoint)
    checkpointer.save(0, state, config)
    checkpointer.close()
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        tokenizer_lib.attach(workdir, source, config.model.vocab_size, note)
    return config


def to_hf(workdir: str, out_dir: str, step: int | None = None, dtype: str | None = None) -> dict:
    """Write out_dir/config.json and model.safetensors from workdir's checkpoint (default: latest),
    read onto one device (`load`; the arrays are written from the host anyway), and the workdir's
    Hugging Face tokenizer files when it has them. A LoRA workdir's adapters are merged into the
    weights (`load(..., adapters="merge")`). Returns the HF config dict."""
    from safetensors.numpy import save_file

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        raise ConversionError(
            f"{out_dir} already has model.safetensors: pass a new output directory; nothing was overwritten"
        )
    config, step = saved_config(workdir, (), step)
    _require_convertible(config.model)  # before any array is read
    # adapters (config.lora) merged into the weights: W + scale A B, a quantized base dequantized
    _, params, config = load(workdir, ONE_DEVICE, step, jax.devices()[:1], adapters="merge")
    m = config.model
    dtype = dtype or m.param_dtype
    params = jax.tree.map(np.asarray, params)
    tensors = hf_tensors_from_params(params, m, jnp.dtype(dtype))
    if m.mtp.depth and not _mla(m):
        print(
            f"jaxsys.convert: the {m.mtp.depth} multi-token-prediction module(s) are not written: only "
            "DeepSeek-V3's checkpoint layout has them; the main model converts as it is",
            file=sys.stderr,
        )
    hf = hf_config_from_model(m, dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    tokenizer_lib.export_hf(workdir, out_dir)
    return hf
