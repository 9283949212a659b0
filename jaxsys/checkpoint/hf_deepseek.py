"""DeepSeek-V2 / V3 (model_type deepseek_v2, deepseek_v3) for jaxsys/checkpoint/hf.py: their
config.json keys, their multi-head latent attention tensors (models/mla.py) and their MoE names.

Attention tensors of layer i (HF [out, in] -> jaxsys [in, out], heads split out):

    self_attn.q_proj            [N (n + R), D]   -> wq [D, N, H]          (q_lora_rank null)
    self_attn.q_a_proj          [Q, D]           -> wq_a [D, Q]
    self_attn.q_a_layernorm     [Q]              -> q_a_norm
    self_attn.q_b_proj          [N (n + R), Q]   -> wq_b [Q, N, H]
    self_attn.kv_a_proj_with_mqa [C + R, D]      -> wkv_a [D, C] (first C rows), wk_rope [D, R]
    self_attn.kv_a_layernorm    [C]              -> kv_a_norm
    self_attn.kv_b_proj         [N (n + H_v), C] -> wk_b [C, N, n], wv_b [C, N, H_v]
    self_attn.o_proj            [D, N H_v]       -> wo [N, H_v, D]

with n = qk_nope_head_dim, H = n + R. DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...
of the R rotary dims (V2 as complex numbers; V3 with `rope_interleave`, the default), jaxsys the two
halves: the rotary rows of q and k are permuted (evens, then odds), which leaves q.k unchanged, and
permuted back on the way out. The softmax scale: H^-0.5 times mscale^2 with YaRN's `mscale_all_dim`
(mscale = 0.1 mscale_all_dim ln(factor) + 1), carried as config.model.query_pre_attn_scalar =
H / mscale^4. MoE (DeepSeekMoE): layers from first_k_dense_replace on, routed experts
`mlp.experts.{e}.*`, `n_shared_experts` always-on experts as one SwiGLU `mlp.shared_experts.*`;
V2's softmax router ('greedy', or 'group_limited_greedy': a group scored by its best expert),
V3's sigmoid router with `e_score_correction_bias` and groups scored by their best two.
"""

from __future__ import annotations

import math

import numpy as np

FAMILIES = ("deepseek_v2", "deepseek_v3")
MOE_NAMES = ("mlp.gate.weight", "mlp.experts.{e}.{w}.weight", ("gate_proj", "up_proj", "down_proj"))
SHARED_NAMES = {
    "shared_gate": "mlp.shared_experts.gate_proj.weight",
    "shared_up": "mlp.shared_experts.up_proj.weight",
    "shared_down": "mlp.shared_experts.down_proj.weight",
}
BIAS_NAME = "mlp.gate.e_score_correction_bias"


def family(m) -> str:
    """deepseek_v3 for V3's routing (sigmoid scores, a choice bias, groups by their best two), else v2."""
    moe = m.moe
    return "deepseek_v3" if moe.router == "sigmoid" or moe.score_bias or moe.group_score == "top2" else "deepseek_v2"


def _mscale(factor: float, mscale_all_dim: float) -> float:
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0


def set_model(hf: dict, model, error) -> None:
    """config.model's MLA and MoE keys (and head_dim, n_kv_heads) from a DeepSeek config.json;
    the rest (sizes, rope) is hf.model_config_from_hf's."""
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    model.head_dim = nope + rope
    model.n_kv_heads = model.n_heads
    mla = model.mla
    mla.kv_lora_rank, mla.q_lora_rank = int(hf["kv_lora_rank"]), int(hf.get("q_lora_rank") or 0)
    mla.rope_head_dim, mla.v_head_dim = rope, int(hf["v_head_dim"])
    if hf["model_type"] == "deepseek_v3" and hf.get("rope_interleave") is False:
        raise error("rope_interleave=false: jaxsys reads DeepSeek-V3's interleaved rotary rows (the default)")
    scaling = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    model.query_pre_attn_scalar = 0.0
    if kind != "default" and mscale_all_dim:  # transformers' yarn_apply_mscale
        model.query_pre_attn_scalar = model.head_dim / _mscale(model.rope_factor, mscale_all_dim) ** 4
    # V3's multi-token-prediction modules, layers n .. n + D_m - 1 of the checkpoint (models/mtp.py);
    # hf.from_hf turns them off when the safetensors do not hold them (transformers drops them)
    model.mtp.depth = int(hf.get("num_nextn_predict_layers") or 0)
    n, dense = hf["num_hidden_layers"], int(hf.get("first_k_dense_replace") or 0)
    experts = int(hf.get("n_routed_experts") or 0)
    kinds = ["moe" if experts and i >= dense else "dense" for i in range(n)]
    model.mlp_pattern = ",".join(kinds) if len(set(kinds)) > 1 else kinds[0]
    if not experts:
        return
    moe = model.moe
    moe.experts, moe.top_k, moe.d_ff = experts, int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"])
    moe.shared_experts, moe.shared_expert_gate = int(hf.get("n_shared_experts") or 0), False
    moe.routed_scale, moe.capacity_factor = float(hf.get("routed_scaling_factor") or 1.0), 0.0
    moe.aux_loss_weight, moe.z_loss_weight = float(hf.get("aux_loss_alpha", 0.001)), 0.0
    if hf["model_type"] == "deepseek_v2":
        method = hf.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise error(f"topk_method={method!r}: DeepSeek-V2 routes by 'greedy' or 'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        moe.router, moe.renormalize, moe.score_bias, moe.group_score = "softmax", False, False, "max"
    else:
        grouped = True
        moe.router, moe.renormalize, moe.score_bias, moe.group_score = "sigmoid", True, True, "top2"
        moe.renormalize = bool(hf.get("norm_topk_prob", True))
    moe.groups = int(hf.get("n_group") or 1) if grouped else 1
    moe.group_top_k = int(hf.get("topk_group") or 1) if grouped else 1


def hf_config(m, shape: dict, rope: dict, dtype: str, error) -> dict:
    """A DeepseekV2Config / DeepseekV3Config dict for an MLA model, refused by name where
    transformers' DeepSeek would compute something else."""
    from jaxsys.config import mlp_pattern

    kind = family(m)
    moe = m.moe
    kinds = [mlp_pattern(m)[i % len(mlp_pattern(m))] for i in range(m.n_layers)]
    dense = kinds.index("moe") if "moe" in kinds else m.n_layers
    if kinds != ["dense"] * dense + ["moe"] * (m.n_layers - dense):
        raise error(
            f"config.model.mlp_pattern={m.mlp_pattern!r}: DeepSeek's MoE layers are all those from "
            "first_k_dense_replace on (dense layers first, then MoE)"
        )
    if m.tie_embeddings or m.embed_scale or m.post_norms or m.mlp_activation != "silu" or m.final_logit_softcap:
        raise error("an MLA model converts as a DeepSeek-V2 / V3: untied embeddings and none of Gemma's pieces")
    out = {
        "architectures": ["DeepseekV3ForCausalLM" if kind == "deepseek_v3" else "DeepseekV2ForCausalLM"],
        "model_type": kind,
        **shape,
        "head_dim": m.mla.rope_head_dim,  # what DeepseekV3Config sets; the rope's dim
        "qk_nope_head_dim": m.head_dim - m.mla.rope_head_dim,
        "qk_rope_head_dim": m.mla.rope_head_dim,
        "v_head_dim": m.mla.v_head_dim or m.head_dim,
        "kv_lora_rank": m.mla.kv_lora_rank,
        "q_lora_rank": m.mla.q_lora_rank or None,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "first_k_dense_replace": dense,
        "num_nextn_predict_layers": m.mtp.depth,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    rope = dict(rope)
    if m.query_pre_attn_scalar:  # the softmax scale's mscale^2, as yarn's mscale_all_dim
        if m.rope_scaling != "yarn" or m.rope_factor <= 1:
            raise error(
                "config.model.query_pre_attn_scalar on an MLA model is DeepSeek's YaRN softmax factor "
                "(mscale_all_dim): it needs rope_scaling='yarn' with rope_factor > 1"
            )
        # mscale_all_dim from the softmax factor, and mscale so that transformers' ratio of the two
        # gives the rotary magnitude (config.json's own numbers back, to 10 digits)
        log_factor = 0.1 * math.log(m.rope_factor)
        all_dim = ((m.head_dim / m.query_pre_attn_scalar) ** 0.25 - 1.0) / log_factor
        magnitude = rope.pop("attention_factor", None) or _mscale(m.rope_factor, 1.0)
        rope["mscale"] = float(f"{(magnitude * _mscale(m.rope_factor, all_dim) - 1.0) / log_factor:.10g}")
        rope["mscale_all_dim"] = float(f"{all_dim:.10g}")
    out["rope_parameters"] = rope
    out["rope_theta"] = m.rope_theta
    if m.rope_scaling != "none":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if dense == m.n_layers:  # no MoE layer: the keys still name sizes transformers builds nothing with
        return {**out, "n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": m.d_ff}
    if moe.shared_expert_gate or moe.shared_experts < 1:
        raise error("DeepSeek's MoE layers have n_shared_experts >= 1 ungated shared experts (moe.shared_experts)")
    if kind == "deepseek_v2" and moe.renormalize:
        raise error("DeepSeek-V2 does not renormalise the k gates: set config.model.moe.renormalize=False")
    if kind == "deepseek_v3" and not (moe.router == "sigmoid" and moe.score_bias and moe.group_score == "top2"):
        raise error(
            "DeepSeek-V3's routing is sigmoid scores with a choice bias and groups scored by their best two: "
            "set moe.router='sigmoid', score_bias=True, group_score='top2' (or convert as a DeepSeek-V2)"
        )
    out.update(
        n_routed_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.d_ff,
        n_shared_experts=moe.shared_experts,
        routed_scaling_factor=moe.routed_scale,
        n_group=moe.groups,
        topk_group=moe.group_top_k,
        norm_topk_prob=bool(moe.renormalize),
    )
    if kind == "deepseek_v2":
        out["topk_method"] = "group_limited_greedy" if moe.groups > 1 else "greedy"
    return out


def _rope_rows(R: int) -> np.ndarray:
    """Interleaved rotary dims -> halves: the evens, then the odds."""
    return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def params(take, m, layers: list[int]) -> dict:
    """The MLA leaves [L, ...] from HF tensors (`take(name, shape)` checks and casts)."""
    D, N, H = m.d_model, m.n_heads, m.head_dim
    C, Q, R, Hv = m.mla.kv_lora_rank, m.mla.q_lora_rank, m.mla.rope_head_dim, m.mla.v_head_dim or m.head_dim
    nope, rows = H - R, _rope_rows(R)
    heads = np.concatenate([np.arange(nope), nope + rows])  # each q head's dims, rotary ones permuted

    def per_layer(i):
        t = lambda name, shape: take(f"model.layers.{i}.self_attn.{name}", shape)
        out = {}
        if Q:
            out["wq_a"] = t("q_a_proj.weight", (Q, D)).T
            out["q_a_norm"] = t("q_a_layernorm.weight", (Q,))
            out["wq_b"] = t("q_b_proj.weight", (N * H, Q)).reshape(N, H, Q)[:, heads].transpose(2, 0, 1)
        else:
            out["wq"] = t("q_proj.weight", (N * H, D)).reshape(N, H, D)[:, heads].transpose(2, 0, 1)
        kv_a = t("kv_a_proj_with_mqa.weight", (C + R, D))
        out["wkv_a"], out["wk_rope"] = kv_a[:C].T, kv_a[C:][rows].T
        out["kv_a_norm"] = t("kv_a_layernorm.weight", (C,))
        kv_b = t("kv_b_proj.weight", (N * (nope + Hv), C)).reshape(N, nope + Hv, C)
        out["wk_b"], out["wv_b"] = kv_b[:, :nope].transpose(2, 0, 1), kv_b[:, nope:].transpose(2, 0, 1)
        out["wo"] = t("o_proj.weight", (D, N * Hv)).T.reshape(N, Hv, D)
        return out

    per = [per_layer(i) for i in layers]
    return {key: np.stack([p[key] for p in per]) for key in per[0]}


def tensors(layer_params: dict, m) -> dict:
    """HF tensors of the MLA leaves (the inverse of `params`)."""
    D, N, H = m.d_model, m.n_heads, m.head_dim
    Q, R = m.mla.q_lora_rank, m.mla.rope_head_dim
    nope = H - R
    back = np.argsort(np.concatenate([np.arange(nope), nope + _rope_rows(R)]))  # jaxsys dims -> HF's
    out = {}
    for i in range(m.n_layers):
        w = {k: np.asarray(layer_params[k][i]) for k in layer_params if k in _MLA_LEAVES}
        name = lambda n: f"model.layers.{i}.self_attn.{n}"
        if Q:
            out[name("q_a_proj.weight")] = w["wq_a"].T
            out[name("q_a_layernorm.weight")] = w["q_a_norm"]
            out[name("q_b_proj.weight")] = w["wq_b"].transpose(1, 2, 0)[:, back].reshape(N * H, Q)
        else:
            out[name("q_proj.weight")] = w["wq"].transpose(1, 2, 0)[:, back].reshape(N * H, D)
        rope_back = np.argsort(_rope_rows(R))
        out[name("kv_a_proj_with_mqa.weight")] = np.concatenate([w["wkv_a"].T, w["wk_rope"].T[rope_back]])
        out[name("kv_a_layernorm.weight")] = w["kv_a_norm"]
        kv_b = np.concatenate([w["wk_b"].transpose(1, 2, 0), w["wv_b"].transpose(1, 2, 0)], axis=1)
        out[name("kv_b_proj.weight")] = kv_b.reshape(-1, kv_b.shape[-1])
        out[name("o_proj.weight")] = w["wo"].reshape(-1, D).T
    return out


_MLA_LEAVES = ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wk_rope", "wk_b", "wv_b", "wo")
