"""Speculative decoding (jaxsys/serve/speculation.py) for one request on the engine with a
contiguous cache and a draft model: greedy mode gives exactly the target's greedy tokens with any
draft; the sampled rule leaves the target's distribution unchanged (chi-square over a small
vocabulary with a fixed seed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.serve import engine, speculation
from jaxsys.serve.sampling import Sampling
from tests.helpers import generate_contiguous, program_for, small_config


@pytest.fixture(scope="module")
def models():
    target = program_for(small_config(n_kv_heads=4))
    draft = program_for(small_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64))
    return target, target.init(3).params, draft, draft.init(5).params


def _speculate(target, tparams, draft, dparams, prompt, n, k, **sampling):
    """One request through the engine (a contiguous cache of 48 slots) with `draft` proposing k
    tokens a step: (its tokens, the engine's counters)."""
    eng = engine.Engine(
        target,
        tparams,
        token_budget=64,
        chunk_size=48,
        max_seqs=1,
        cache="contiguous",
        max_len=48,
        drafter=speculation.DraftModel(draft, dparams),
        k=k,
    )
    return engine.generate(eng, [prompt], n, Sampling(**sampling))[0], eng.stats


@pytest.mark.parametrize("same_draft,k", [(True, 3), (False, 4), (False, 1)])
def test_greedy_speculation_gives_the_targets_greedy_tokens(models, same_draft, k):
    target, tparams, draft, dparams = models
    if same_draft:
        draft, dparams = target, tparams
    prompt, n = [11, 22, 33, 44], 14
    got, stats = _speculate(target, tparams, draft, dparams, prompt, n, k)
    assert got == generate_contiguous(target, tparams, [prompt], n, max_len=48)[0]
    if same_draft:  # a perfect draft: every proposal accepted, k + 1 tokens per target forward
        assert stats["accepted"] == stats["drafted"]
        assert stats["target_steps"] <= 1 + -(-(n - 1) // (k + 1))
    assert stats["target_steps"] <= n  # each round emits at least one token (prefill the first)


def test_the_rejection_rule_keeps_the_target_distribution():
    """k = 2 drafts from q, target p over V = 5: the first emitted token must be distributed as
    p[0] (Leviathan et al., Theorem 1). 20,000 trials; chi-square with 4 degrees of freedom stays
    below 18.47 (p = 0.001) for the exact rule, and is far above it if the residual is dropped."""
    p = jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.2, 0.3, 0.2, 0.2], [0.2] * 5], jnp.float32)
    q = jnp.asarray([[0.1, 0.4, 0.1, 0.3, 0.1], [0.3, 0.1, 0.2, 0.2, 0.2]], jnp.float32)
    trials = 20000
    keys = jax.random.split(jax.random.key(0), trials)

    def first_token(key):
        drafted = jax.vmap(lambda i, qi: jax.random.categorical(jax.random.fold_in(key, 10 + i), jnp.log(qi)))(
            jnp.arange(2), q
        )
        n, nxt = speculation.accept(p, q, drafted, key)
        return jnp.where(n > 0, drafted[0], nxt)

    counts = np.bincount(np.asarray(jax.vmap(first_token)(keys)), minlength=5)
    expected = np.asarray(p[0]) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (counts, chi2)

    # the same statistic detects a wrong rule: emitting from q after a rejection instead of p - q
    def wrong(key):
        drafted = jax.random.categorical(jax.random.fold_in(key, 10), jnp.log(q[0]))
        ok = jax.random.uniform(key) < jnp.minimum(1.0, p[0, drafted] / q[0, drafted])
        return jnp.where(ok, drafted, jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(q[0])))

    bad = np.bincount(np.asarray(jax.vmap(wrong)(keys)), minlength=5)
    assert float(((bad - expected) ** 2 / expected).sum()) > 100


def test_sampled_speculation_runs_and_is_reproducible(models):
    target, tparams, draft, dparams = models
    a, stats = _speculate(target, tparams, draft, dparams, [5, 6, 7], 10, 3, temperature=1.0, seed=4)
    b, _ = _speculate(target, tparams, draft, dparams, [5, 6, 7], 10, 3, temperature=1.0, seed=4)
    assert a == b and len(a) == 10 and all(0 <= t < 256 for t in a)
    assert 0 <= stats["accepted"] <= stats["drafted"]
