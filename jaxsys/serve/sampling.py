"""Sampling the next token on the device, per sequence.

Temperature 0 is greedy; otherwise softmax of logits / temperature restricted to the top_k (0: all)
most likely tokens and to the smallest set whose probability reaches top_p (1: all). A sequence's
n-th token draws with the key fold_in(key(seed), n), so its tokens do not depend on what it was
batched with (speculation folds 1 and 2 into that key for its drafts and verdicts).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self, what: str = "sampling") -> None:
        """ValueError naming the bad setting."""
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"{what} needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}"
            )


def sample(logits, key, temperature, top_k, top_p):
    """Next tokens [B] from logits [B, V] (fp32), drawn with `key` (module docstring)."""
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1)
    drawn = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def filtered_logits(logits, temperature, top_k, top_p):
    """The logits `sample` draws from when temperature > 0 (scaled, -inf outside the top-k and
    top-p sets); their softmax is the sampling distribution (speculation's p and q)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # one sort: the filters below keep its order
    vocab = logits.shape[-1]
    kth = ordered[:, jnp.clip(top_k - 1, 0, vocab - 1)][:, None]
    drop_k = (top_k > 0) & (ordered < kth)
    ordered = jnp.where(drop_k, -jnp.inf, ordered)
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep = before < top_p  # the first token is always kept
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


def token_key(seed, n):
    """The key of a sequence's n-th token."""
    return jax.random.fold_in(jax.random.key(seed), n)


# per sequence: its own settings, and its own key; rows `at` of the step's logits
sample_at = jax.jit(
    lambda logits, at, seed, n, t, k, p: jax.vmap(
        lambda lg, seed, n, t, k, p: sample(lg[None], token_key(seed, n), t, k, p)[0]
    )(logits[at], seed, n, t, k, p)
)


def pad(values: list, size: int | None = None) -> list:
    """`values` padded to a power of two (or `size`) by repeating the first: the jitted helpers
    compile once per padded size, not once per count."""
    size = size or 1 << (len(values) - 1).bit_length()
    return values + [values[0]] * (size - len(values))
