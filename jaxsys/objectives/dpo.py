"""Direct Preference Optimization (Rafailov et al. 2023), on pairs laid out as batch rows 2i
(chosen) and 2i + 1 (rejected) (config.data.format='preference', docs/finetune.md).

With log pi(y|x) the sum of a completion's token log-probabilities (its loss weights select the
completion's tokens) under the policy and pi_ref under the frozen reference model,

    r(y) = beta * (log pi(y|x) - log pi_ref(y|x))              the implicit reward
    loss = -log sigmoid(r(y_chosen) - r(y_rejected))           per pair, averaged over the pairs

and the logged terms are the mean rewards of the chosen and rejected completions, their margin
r(y_chosen) - r(y_rejected) and the accuracy (the fraction of pairs whose margin is > 0; a tie, as
at the start when the policy is the reference, counts as wrong, as in TRL).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TERMS = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logp_chosen", "logp_rejected")


def sequence_logps(token_losses, weights):
    """[B] log-probabilities of each row's weighted tokens, from per-token cross-entropies [B, T]
    (the negative log-probabilities of the targets) and loss weights [B, T]."""
    return -jnp.sum(token_losses.astype(jnp.float32) * weights.astype(jnp.float32), axis=-1)


def pair_terms(logp, ref_logp, beta: float) -> dict:
    """Per pair ([B/2] each): the DPO `loss` and the logged TERMS, from the policy's and the
    reference's sequence log-probabilities [B] (chosen at even rows, rejected at odd ones). Only
    `loss` carries a gradient; the reference's log-probabilities never do."""
    ref_logp = jax.lax.stop_gradient(ref_logp)
    chosen, rejected = logp[0::2], logp[1::2]
    reward_chosen = beta * (chosen - ref_logp[0::2])
    reward_rejected = beta * (rejected - ref_logp[1::2])
    margin = reward_chosen - reward_rejected
    out = {"loss": -jax.nn.log_sigmoid(margin)}
    logged = {
        "reward_chosen": reward_chosen,
        "reward_rejected": reward_rejected,
        "margin": margin,
        "accuracy": (margin > 0).astype(jnp.float32),
        "logp_chosen": chosen,
        "logp_rejected": rejected,
    }
    out.update(jax.lax.stop_gradient(logged))
    return out
