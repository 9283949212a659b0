"""Sampling the next token on the device, per sequence.

Temperature 0 is greedy; otherwise softmax of logits / temperature restricted to the tokens whose
probability is at least min_p times the most likely one's (0: all), to the top_k (0: all) most
likely tokens and to the smallest set whose probability reaches top_p (1: all), in that order
(vLLM's). Before that, logit_bias (OpenAI's: {token id: b}, b in [-100, 100] added to the logit,
so -100 bans a token and +100 all but forces it, greedy decoding included), then penalties on the
tokens a sequence has seen (as vLLM applies them): repetition_penalty r (the
CTRL / Hugging Face rule over prompt and generated tokens: a seen token's logit l becomes l / r if
l > 0, else l r), then frequency and presence penalties (OpenAI's, over generated tokens: l - c f
- (c > 0) p for a token generated c times). A sequence's n-th token draws with the key
fold_in(key(seed), n), so its tokens do not depend on what it was batched with (speculation folds 1
and 2 into that key for its drafts and verdicts).

Log-probabilities (`logprobs`, prompt log-probabilities) are the model's own: log_softmax of the
logits before penalties, temperature and filters (what lm-evaluation-harness scores).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

INT32 = (-(2**31), 2**31 - 1)
MAX_LOGPROBS = 20  # top alternatives a request may ask for
MAX_LOGIT_BIAS = 300  # biased tokens a request may name (OpenAI's limit)


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the top k
    # each prompt token's log-probability given the tokens before it (and, with logprobs = k, the
    # top k there: lm-eval's is_greedy compares a continuation with them)
    prompt_logprobs: bool = False
    stop_ids: tuple = ()  # finish ("stop") on generating one of these
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely (0: all)
    logit_bias: tuple = ()  # ((token id, bias in [-100, 100]), ...) added to the logits

    def check(self, what: str = "sampling") -> None:
        """ValueError naming the setting that is out of range."""
        floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{what}: {name}={value!r} must be a finite number")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not INT32[0] <= value <= INT32[1]:
                raise ValueError(f"{what}: {name}={value!r} must be an integer in [-2**31, 2**31)")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"{what} needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{what}: {name}={getattr(self, name)} must lie in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"{what}: repetition_penalty={self.repetition_penalty} must be > 0 (1: none)")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"{what}: logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in self.stop_ids):
            raise ValueError(f"{what}: stop_ids={self.stop_ids!r} must be token ids")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"{what}: min_p={self.min_p} must lie in [0, 1] (0: off)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"{what}: logit_bias names {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2
            token, bias = pair if ok else (None, None)
            if not ok or isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                raise ValueError(f"{what}: logit_bias entry {pair!r} must be (token id >= 0, bias)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"{what}: logit_bias of token {token}: {bias!r} must be a number in [-100, 100]")

    @property
    def penalized(self) -> bool:
        """Penalties on seen tokens: the sampler needs the sequence's history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusted(self) -> bool:
        """Penalties, a logit bias or min_p: the sampler's per-row path (`sample_adjusted`), not
        the plain one, the multi-step loop or speculation."""
        return self.penalized or self.min_p > 0 or bool(self.logit_bias)


def sample(logits, key, temperature, top_k, top_p, min_p=None):
    """Next tokens [B] from logits [B, V] (fp32), drawn with `key` (module docstring)."""
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1)
    drawn = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p, min_p), axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def filtered_logits(logits, temperature, top_k, top_p, min_p=None):
    """The logits `sample` draws from when temperature > 0 (scaled, -inf outside the min-p, top-k
    and top-p sets); their softmax is the sampling distribution (speculation's p and q)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # one sort: the filters below keep its order
    if min_p is not None:  # p >= min_p p_max  <=>  scaled >= max + log(min_p); log(0) = -inf keeps all
        floor = ordered[:, :1] + jnp.log(jnp.asarray(min_p, jnp.float32))
        ordered = jnp.where(ordered < floor, -jnp.inf, ordered)
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
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


def penalize(logits, history, generated, presence, frequency, repetition):
    """The logits [R, V] of rows whose sequences have seen tokens history [R, H] (-1: padding;
    `generated` [R, H] marks those the sequence generated, the rest are its prompt's), with the
    repetition, then frequency and presence penalties (module docstring) per row."""
    rows = jnp.arange(logits.shape[0])[:, None]
    valid = history >= 0
    ids = jnp.where(valid, history, 0)
    seen = jnp.zeros(logits.shape, bool).at[rows, ids].max(valid)
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, ids].add((valid & generated).astype(jnp.float32))
    r = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def sample_rows(logits, seed, n, t, k, p, mp=None):
    """Each row's next token from its logits [R, V] with its own settings and key (seed, n), and
    min_p `mp` [R] when given."""
    if mp is None:
        return jax.vmap(lambda lg, seed, n, t, k, p: sample(lg[None], token_key(seed, n), t, k, p)[0])(
            logits, seed, n, t, k, p
        )
    return jax.vmap(lambda lg, seed, n, t, k, p, mp: sample(lg[None], token_key(seed, n), t, k, p, mp)[0])(
        logits, seed, n, t, k, p, mp
    )


def biased(logits, bias_ids, bias_values):
    """logits [R, V] plus each row's logit bias: bias_ids [R, B] (-1: padding), bias_values [R, B]."""
    rows = jnp.arange(logits.shape[0])[:, None]
    valid = bias_ids >= 0
    return logits.at[rows, jnp.where(valid, bias_ids, 0)].add(jnp.where(valid, bias_values, 0.0))


# per sequence: its own settings, and its own key; rows `at` of the step's logits
sample_at = jax.jit(lambda logits, at, seed, n, t, k, p: sample_rows(logits[at], seed, n, t, k, p))
# the same when every row is greedy (temperature 0): the argmax alone, no sort or draw
greedy_at = jax.jit(lambda logits, at: jnp.argmax(logits[at].astype(jnp.float32), axis=-1).astype(jnp.int32))


@jax.jit
def sample_adjusted(
    logits, at, seed, n, t, k, p, mp, history, generated, presence, frequency, repetition, bias_ids, bias_values
):
    """`sample_at` with each row's logit bias, penalties and min_p (compiled per history and bias
    bucket; only for steps that need it)."""
    lg = biased(logits[at].astype(jnp.float32), bias_ids, bias_values)
    lg = penalize(lg, history, generated, presence, frequency, repetition)
    return sample_rows(lg, seed, n, t, k, p, mp)


@functools.partial(jax.jit, static_argnames=("top",))
def logprobs_at(logits, at, tokens, top: int):
    """The model's log-probabilities at rows `at` of `tokens` [R], and the `top` most likely tokens
    and their log-probabilities ([R, top] each)."""
    lp = jax.nn.log_softmax(logits[at].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if top == 0:
        return chosen, None, None
    top_lp, top_ids = jax.lax.top_k(lp, top)
    return chosen, top_ids, top_lp


def logprobs_of_rows(logits, rows: list, tokens: list, ks: list) -> tuple[list, list]:
    """For each row r of `logits` (host lists, any count): the log-probability of its token and
    its top ks[r] alternatives [(id, logprob)] ([] for k 0), through `logprobs_at` padded to a
    power of two (one compile per padded size, one for top 0 and one for MAX_LOGPROBS)."""
    padded = pad(list(zip(rows, tokens)))
    chosen, top_ids, top_lp = logprobs_at(
        logits,
        np.asarray([row for row, _ in padded], np.int32),
        np.asarray([token for _, token in padded], np.int32),
        top=MAX_LOGPROBS if any(ks) else 0,
    )
    chosen = np.asarray(chosen).tolist()[: len(rows)]
    if not any(ks):
        return chosen, [[] for _ in rows]
    top_ids, top_lp = np.asarray(top_ids).tolist(), np.asarray(top_lp).tolist()
    return chosen, [list(zip(top_ids[i][:k], top_lp[i][:k])) if k else [] for i, k in enumerate(ks)]


def pad(values: list, size: int | None = None) -> list:
    """`values` padded to a power of two (or `size`) by repeating the first: the jitted helpers
    compile once per padded size, not once per count."""
    size = size or 1 << (len(values) - 1).bit_length()
    return values + [values[0]] * (size - len(values))
