"""Analytic FLOPs of the transformer (Kaplan et al. 2020; PaLM appendix B)."""

from __future__ import annotations


def matmul_params(m) -> int:
    """Parameters that take part in a matmul per token: every weight matrix except the embedding
    lookup (the tied embedding counts once, as the output projection); of a MoE layer only the
    router and the k experts (and shared experts) a token uses, its active parameters."""
    from jaxsys.models import mla, moe, transformer

    if m.kind == "flax":  # a Flax module (docs/flax.md): every parameter, as C = 6N counts them
        from jaxsys.models import flax_model, params

        return params.count(flax_model.describe(m).specs)
    D, N, K, H, F, V, L = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    counts = transformer.layer_counts(m)
    attention = mla.matmul_params(m) if mla.enabled(m) else D * N * H * 2 + D * K * H * 2
    mlps = counts["dense"] * 3 * D * F + (counts["moe"] * moe.active_matmul_params(m) if counts["moe"] else 0)
    return L * attention + mlps + D * V


def train_flops_per_token(m, seq_len: int) -> float:
    """6 N (forward 2N, backward 4N) plus attention's 12 L T N H (QK^T and AV, forward and
    backward, counted without the causal halving as PaLM does; a sliding-window layer's T is
    min(T, W)). Remat is not counted: MFU measures useful work."""
    return 6.0 * matmul_params(m) + 12.0 * _attention_span(m, seq_len)


def forward_flops_per_token(m, seq_len: int) -> float:
    """The forward pass alone: 2 N + 4 L T N H (what full remat recomputes)."""
    return 2.0 * matmul_params(m) + 4.0 * _attention_span(m, seq_len)


def _attention_span(m, seq_len: int) -> float:
    """Sum over layers of N H times the keys a query's span covers (T; min(T, W) for the "local"
    layers): what attention's score and value FLOPs scale with per token. 0 for a Flax module (its
    attention is its own: only 6N is counted)."""
    if m.kind == "flax":
        return 0
    from jaxsys.models import attention, mla

    spans = [min(seq_len, m.sliding_window) if kind == "local" else seq_len for kind in attention.layer_types(m)]
    # QK^T over H dims and AV over H_v (MLA's values are narrower; their zero padding is not useful work)
    width = (m.head_dim + mla.v_head_dim(m)) / 2 if mla.enabled(m) else m.head_dim
    return m.n_heads * width * sum(spans)


def adapter_params(config) -> int:
    """The LoRA factors' parameters (config.lora; 0 without adapters): r (K' + N') per adapted
    projection and layer."""
    from jaxsys.models import adapters, params, transformer

    if not adapters.enabled(config):
        return 0
    return params.count(adapters.trainable(adapters.wrap_specs(transformer.param_specs(config.model), config)))


def step_flops_per_token(config) -> float:
    """Model FLOPs per token of one training step of `config`'s optimizer: forward and backward
    (`train_flops_per_token`), or two forwards for zeroth-order training (train.optimizer='zo').
    With LoRA the frozen weights' gradients are not computed: 4 N for them (forward 2N, the
    activations' gradients 2N) and 6 per adapter parameter. DPO adds the reference model's forward
    (2 N + attention's 4 L T N H; with LoRA the base alone)."""
    m, t = config.model, config.data.seq_len
    if config.train.optimizer == "zo":
        return 2.0 * forward_flops_per_token(m, t)
    if config.lora.rank > 0:
        flops = 4.0 * matmul_params(m) + 6.0 * adapter_params(config) + 12.0 * _attention_span(m, t)
    else:
        flops = train_flops_per_token(m, t)
    if config.train.objective == "dpo":
        flops += forward_flops_per_token(m, t)
    return flops
