"""Multi-token prediction (MTP; DeepSeek-V3, DeepSeek-AI 2024, section 2.2), the training objective
of `config.model.mtp.depth` D_m > 0 sequential modules after the main model.

Module k (1..D_m) predicts the token k + 1 positions past each input. At position i it combines
the previous depth's representation h^{k-1}_i (h^0: the main model's last hidden state, before the
final norm) with the embedding of token t_{i+k}, through one transformer layer of its own:

    h'^k_i = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]       M_k [2D -> D]
    h^k    = TRM_k(h'^k)                                                one layer, causal as the main
    p^k_i  = OutHead(RMSNorm_k(h^k_i))  ->  cross-entropy against t_{i+k+1}

The embedding and the output head are the main model's (shared, as in the paper). The loss
L_MTP = lambda / D_m * sum_k L_k is added to the main cross-entropy (`config.model.mtp.loss_weight`
= lambda); each L_k is the weighted mean over the positions whose chain of next-token targets
i+1 .. i+k+1 is all real (the main loss weights, shifted and multiplied: no padding and no
document boundary inside; the last k + 1 positions of a row have no target). The module's layer
is the main model's last kind of layer (attention and MLP, MoE for DeepSeek-V3); its MoE losses
join the main ones.

Parameters (logical axes; `layers` indexes the D_m modules):

    mtp/enorm   [D_m, D]          layers, embed
    mtp/hnorm   [D_m, D]          layers, embed
    mtp/proj    [D_m, 2, D, D]    layers, -, embed, -      the halves of M_k: embedding, hidden
    mtp/norm    [D_m, D]          layers, embed            the shared head's own norm
    mtp/layers  one layer's leaves stacked [D_m, ...]

The concatenation order (embedding first) is that of the released checkpoints' `eh_proj` as
serving engines read it. The modules train only: generation uses the main model, and the
modules are not yet a speculative-decoding draft. The forward through them (embedding, layer,
head) is transformer.py's (`mtp_outputs`, `mtp_losses`, `mtp_logits`); this module holds what is
theirs alone.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp

from jaxsys.config import block_pattern
from jaxsys.models import layers
from jaxsys.models.params import ParamSpec


def enabled(m) -> bool:
    return bool(m.mtp.depth)


def layer_config(m, depth: int | None = None):
    """The model config of the modules' layers: `m` with n_layers = D_m (or `depth`) and the
    patterns of the main model's last layer, so that transformer.param_specs / layer_stack build
    and run them as a model of their own."""
    kind, mlp_kind = block_pattern(m)[(m.n_layers - 1) % len(block_pattern(m))]
    out = copy.deepcopy(m)
    out.n_layers = m.mtp.depth if depth is None else depth
    out.layer_pattern, out.mlp_pattern = kind, mlp_kind
    out.mtp.depth = 0
    return out


def param_specs(m, layer_specs: dict) -> dict:
    """The `mtp` subtree (the table above); `layer_specs`: the modules' layer leaves, those of a
    model of `layer_config(m)` (transformer.param_specs builds them)."""
    Dm, D = m.mtp.depth, m.d_model
    norm = lambda: ParamSpec((Dm, D), ("layers", "embed"), init="ones", decay=False)
    return {
        "enorm": norm(),
        "hnorm": norm(),
        "proj": ParamSpec((Dm, 2, D, D), ("layers", None, "embed", None), std=m.init_std),
        "norm": norm(),
        "layers": layer_specs,
    }


def shifted(tokens, k: int, length: int):
    """tokens[B, T+1] -> tokens[:, k : k + length], zero-padded past the row's end."""
    out = tokens[:, k : k + length]
    return jnp.pad(out, ((0, 0), (0, length - out.shape[1])))


def chain_weights(weights, k: int):
    """Weights [B, T] of depth k's targets: position i counts when the main targets i .. i + k are
    all real (the product of their weights; 0 where i + k runs past the row)."""
    out = weights
    for j in range(1, k + 1):
        out = out * shifted(weights, j, weights.shape[1])
    return out


def combine(e, h, k: int, weights, m):
    """Module k's input M_k [RMSNorm_e(e); RMSNorm_h(h)] [B, T, D] from the embeddings e of t_{i+k}
    and the previous depth's hidden state h, `weights` the gathered (enorm, hnorm, proj)."""
    enorm, hnorm, proj = weights
    en = layers.rms_norm(e, enorm[k - 1], m.norm_eps)
    hn = layers.rms_norm(h, hnorm[k - 1], m.norm_eps)
    return jnp.einsum("btd,de->bte", en, proj[k - 1, 0]) + jnp.einsum("btd,de->bte", hn, proj[k - 1, 1])
