"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a draft model proposes k tokens,
the target scores them in one forward, and the standard rejection rule keeps the output
distribution exactly the target's.

For drafted x_1..x_k with draft distributions q_i and target distributions p_i (p_{k+1} after the
last draft): accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)); at the first rejection i emit a
token from norm(max(p_i - q_i, 0)); if all k are accepted emit a bonus token from p_{k+1}. Greedy
mode (temperature 0): accept while x_i == argmax p_i, then emit argmax p_{n+1}, so the tokens are
exactly the target's greedy tokens.

`generate` runs it on the contiguous-cache decoders of jaxsys/serve/decode.py for one prompt: the
draft is any jaxsys model with the same vocabulary (a smaller one, or the target itself). Both
caches are written at per-sequence positions, so a rejected suffix is simply overwritten next
round (writes come before reads and attention masks by position). Inside the continuous-batching
engine, with a per-sequence k and self-speculation: serve/spec_engine.py (which reuses `accept`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def accept(p, q, drafted, key, greedy: bool = False):
    """One round's verdict for one sequence: p [k+1, V] target probabilities, q [k, V] draft
    probabilities, drafted [k] tokens -> (n accepted, the next token). Jittable."""
    k = drafted.shape[0]
    idx = jnp.arange(k)
    if greedy:
        ok = drafted == jnp.argmax(p[:k], axis=-1)
    else:
        u = jax.random.uniform(jax.random.fold_in(key, 0), (k,))
        ratio = p[idx, drafted] / jnp.maximum(q[idx, drafted], 1e-30)
        ok = u < jnp.minimum(1.0, ratio)
    n = jnp.argmin(jnp.concatenate([ok, jnp.array([False])]))  # the first rejection (k: none)
    if greedy:
        return n, jnp.argmax(p[n]).astype(jnp.int32)
    residual = jnp.maximum(p[n] - jnp.where(n < k, q[jnp.minimum(n, k - 1)], 0.0), 0.0)
    residual = jnp.where(jnp.sum(residual) > 0, residual, p[n])
    token = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(residual))
    return n, token.astype(jnp.int32)


_accept = jax.jit(accept, static_argnames=("greedy",))


def _probs(logits, temperature: float):
    if temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])
    return jax.nn.softmax(logits / temperature, axis=-1)


def generate(
    target,
    target_params,
    draft,
    draft_params,
    prompt: list,
    max_new_tokens: int,
    k: int = 4,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], dict]:
    """Continue `prompt` by `max_new_tokens` tokens with `draft` proposing `k` at a time and
    `target` (decode.Decoder, batch 1 each) verifying. Returns (tokens, stats: rounds, drafted,
    accepted, target_forwards)."""
    if k < 1:
        raise ValueError(f"k={k}: draft at least one token per round")
    if len(prompt) + max_new_tokens + k + 1 > min(target.max_len, draft.max_len):
        raise ValueError(f"prompt {len(prompt)} + {max_new_tokens} new + {k + 1} of lookahead exceed the caches")
    greedy = temperature == 0
    key = jax.random.key(seed)
    first_key, draft_key, accept_key = (jax.random.fold_in(key, i) for i in range(3))  # disjoint streams
    rows = lambda tokens: np.asarray([tokens], np.int32)
    t_cache, d_cache = target.init_cache(), draft.init_cache()
    length = np.asarray([len(prompt)], np.int32)
    t_logits, t_cache = target.prefill(target_params, rows(prompt), length, t_cache)
    _, d_cache = draft.prefill(draft_params, rows(prompt), length, d_cache)
    p0 = _probs(t_logits[0], temperature)
    first = int(jnp.argmax(p0)) if greedy else int(jax.random.categorical(first_key, jnp.log(p0)))
    out, pos, last = [first], len(prompt), first  # caches hold `pos` tokens; `last` is not yet in them
    stats = {"rounds": 0, "drafted": 0, "accepted": 0, "target_forwards": 1}
    behind = []  # tokens the draft's cache still lacks (the last accepted draft of a full round)
    while len(out) < max_new_tokens:
        for i, token in enumerate(behind):
            _, d_cache = draft.decode(draft_params, np.asarray([token]), np.asarray([pos - len(behind) + i]), d_cache)
        behind = []
        drafted, q = [], []
        token = last
        for i in range(k):
            d_logits, d_cache = draft.decode(draft_params, np.asarray([token]), np.asarray([pos + i]), d_cache)
            qi = _probs(d_logits[0], temperature)
            token = (
                int(jnp.argmax(qi))
                if greedy
                else int(jax.random.categorical(jax.random.fold_in(draft_key, stats["rounds"] * k + i), jnp.log(qi)))
            )
            drafted.append(token)
            q.append(qi)
        t_logits, t_cache = target.extend(target_params, rows([last] + drafted), np.asarray([pos], np.int32), t_cache)
        p = _probs(t_logits[0], temperature)
        n, nxt = _accept(
            p, jnp.stack(q), jnp.asarray(drafted), jax.random.fold_in(accept_key, stats["rounds"]), greedy=greedy
        )
        n, nxt = int(n), int(nxt)
        out += drafted[:n] + [nxt]
        if n == k:
            behind = [drafted[-1]]  # the draft never ran its own last proposal
        pos += n + 1
        last = nxt
        stats["rounds"] += 1
        stats["drafted"] += k
        stats["accepted"] += n
        stats["target_forwards"] += 1
    return out[:max_new_tokens], stats
