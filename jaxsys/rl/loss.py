"""GRPO's formulas (Shao et al. 2024, DeepSeekMath; the clipped surrogate of PPO, Schulman et al. 2017).

For a group of G samples of one prompt with rewards r_1..r_G, sample i's advantage is

    A_i = (r_i - mean(r)) / (std(r) + eps)          std over the group (population, ddof 0)

and every token t of its completion gets A_i. With the policy's log-probability logp_t, the
log-probability under the weights that generated the sample (the behaviour policy) old_t, and the
frozen reference's ref_t:

    ratio_t = exp(logp_t - old_t)                   the importance weight pi / pi_behaviour
    pg_t    = -min(ratio_t A, clip(ratio_t, 1 - e, 1 + e) A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (Schulman's k3 estimator, >= 0)
    loss    = sum_t mask_t (pg_t + beta kl_t) / sum_t mask_t  over the whole batch (token level)

mask_t is 1 on completion tokens and 0 on the prompt and padding. When the samples come from
weights k versions old (asynchronous training), ratio_t corrects for it and the clip bounds the
correction (the decoupled objective of AReaL / LlamaRL's AIPO, here with the one behaviour policy).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """Rewards [B] (G consecutive samples per prompt) -> advantages [B], float32."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    a = (g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + eps)
    return a.reshape(-1).astype(np.float32)


def token_terms(logp, old_logp, ref_logp, advantages, clip: float, beta: float) -> dict:
    """Per-token terms [B, T] of the objective (unmasked): `loss` = pg + beta kl, and `pg`, `kl`,
    `ratio`, `clipped` (1 where the clipped branch is the minimum: no gradient through it)."""
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantages
    pg = -jnp.minimum(unclipped, clipped)
    d = ref_logp - logp
    kl = jnp.exp(d) - d - 1.0
    return {
        "loss": pg + beta * kl,
        "pg": pg,
        "kl": kl,
        "ratio": ratio,
        "clipped": (clipped < unclipped).astype(logp.dtype),
    }
