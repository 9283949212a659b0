"""Speculative decoding inside the continuous-batching engine (jaxsys/serve/speculation.py): greedy
requests get exactly the plain engine's tokens with a small draft model, with the target as its own
draft and with self-speculation, whatever k each request asks for (0 included) and whatever else
runs in the same steps; sampled requests keep the target's distribution (chi-square); bad input is
named; every page is freed."""

import jax
import numpy as np
import pytest

from jaxsys.cache import window
from jaxsys.config import ConfigError, validate
from jaxsys.models import transformer
from jaxsys.serve import engine, speculation
from tests.helpers import generate_contiguous, program_for, small_config


def speculative(target, tparams, k, draft, window=64, sink=4, **kw):
    """The engine with a drafter: "self" or (program, params) of a draft model."""
    return engine.Engine(target, tparams, **kw, drafter=speculation.make_drafter(draft, window, sink), k=k)


@pytest.fixture(scope="module")
def models():
    target = program_for(small_config(n_kv_heads=4))
    draft = program_for(small_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64))
    return target, target.init(3).params, draft, draft.init(5).params


def _serve(eng, prompts, news, ks=None, seed=1):
    """Submit the requests over the first steps (a few per step, while others run) and step until
    all finish; check that no step drafts past a request's reserved tokens."""
    rng = np.random.default_rng(seed)
    pending = list(range(len(prompts)))
    while pending or not eng.idle:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i = pending.pop(0)
                if ks is None:
                    eng.submit(i, prompts[i], news[i])
                else:
                    eng.submit(i, prompts[i], news[i], k=ks[i])
        work, _ = eng.step()
        for w in work:
            assert w.start + w.tokens <= len(w.request.prompt) + w.request.max_new_tokens
    assert all(p.free_pages == p.num_pages for p in eng.pools)
    return {r.id: r.generated for r in eng.finished}


KW = dict(num_pages=48, page_size=4, token_budget=24, chunk_size=5, max_seqs=4)


@pytest.mark.parametrize("source", ["small", "same", "self"])
def test_greedy_speculation_in_the_engine_gives_the_plain_engines_tokens(models, source):
    target, tparams, draft, dparams = models
    rng = np.random.default_rng(0)
    n = 7
    prompts = [rng.integers(0, 256, size=int(rng.integers(1, 22))).tolist() for _ in range(n)]
    news = [int(rng.integers(2, 16)) for _ in range(n)]
    ks = [0, 1, 2, 3, 4, 2, 8]  # per request; 0 decodes plainly beside the others
    plain = _serve(engine.Engine(target, tparams, **KW), prompts, news)
    draft_arg = {"small": (draft, dparams), "same": (target, tparams), "self": "self"}[source]
    eng = speculative(target, tparams, **KW, k=3, draft=draft_arg, window=4, sink=2)
    assert _serve(eng, prompts, news, ks) == plain
    s = eng.stats
    assert s["rounds"] > 0 and 0 <= s["accepted"] <= s["drafted"]
    assert s["target_steps"] < sum(news)  # the engine took fewer target steps than tokens
    if source == "same":  # the target drafting from its own second cache: every draft accepted
        assert s["accepted"] == s["drafted"]  # (this checks the draft cache's catch-up bookkeeping)
    if source == "self":  # the sparse view reads less than the whole cache and rejects some drafts
        assert s["draft_read"] < s["full_read"] and s["accepted"] < s["drafted"]
    assert plain[6] == generate_contiguous(target, tparams, [prompts[6]], news[6])[0]


@pytest.mark.parametrize("source", ["self", pytest.param("small", marks=pytest.mark.slow)])  # CI time
def test_speculation_over_a_kivi_cache_gives_the_plain_kivi_engines_tokens(models, source):
    """A drafter composes with any cache: over the KIVI-quantized paged cache (kivi4, one residual
    page), greedy speculation gives exactly the plain kivi4 engine's tokens. Self-speculation's
    window view then reads the sealed pages of its view quantized (window.sealed_in_view) and
    less than the whole cache; a draft model drafts from a full-precision cache of its own."""
    target, tparams, draft, dparams = models
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=int(rng.integers(6, 22))).tolist() for _ in range(5)]
    news = [int(rng.integers(6, 16)) for _ in range(5)]
    kw = dict(KW, kv_quant="kivi4", kv_residual=1)
    plain = _serve(engine.Engine(target, tparams, **kw), prompts, news)
    draft_arg = "self" if source == "self" else (draft, dparams)
    eng = speculative(target, tparams, **kw, k=3, draft=draft_arg, window=4, sink=2)
    assert _serve(eng, prompts, news, [3, 1, 0, 2, 3]) == plain
    assert eng.stats["rounds"] > 0 and all(p.free_pages == p.num_pages for p in eng.residual)
    if source == "self":
        assert eng.stats["draft_read"] < eng.stats["full_read"]


@pytest.mark.slow
def test_greedy_speculation_on_two_batch_shards_and_tensor_parallel():
    target = program_for(small_config({"tensor": 2, "data": 2}, n_kv_heads=4))
    draft = program_for(
        small_config({"tensor": 2, "data": 2}, n_layers=1, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64)
    )
    tparams, dparams = target.init(3).params, draft.init(5).params
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, size=int(rng.integers(1, 20))).tolist() for _ in range(6)]
    news = [int(rng.integers(2, 12)) for _ in range(6)]
    plain = _serve(engine.Engine(target, tparams, **KW), prompts, news)
    for draft_arg in [(draft, dparams), "self"]:
        eng = speculative(target, tparams, **KW, k=2, draft=draft_arg, window=4, sink=1)
        assert _serve(eng, prompts, news, [2, 0, 3, 1, 2, 4]) == plain


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("source", ["small", pytest.param("self", marks=pytest.mark.slow)])
def test_sampled_speculation_keeps_the_targets_distribution(source):
    """V = 8, temperature 0.3, k = 2, 1000 requests of one prompt, seeds 0..999: the first token of
    the first speculative round (generated[1]) must follow the target's marginal
    sum_x p(x | prompt) p(. | prompt, x). Chi-square with 7 degrees of freedom below 24.32
    (p = 0.001); against the small draft's own marginal the same counts are far above it."""
    V, T, N = 8, 0.3, 1000
    target = program_for(small_config(n_kv_heads=4, vocab_size=V))
    draft = program_for(small_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=V))
    tparams, dparams = target.init(3).params, draft.init(5).params
    prompt = [1, 2, 3, 4, 5]

    def probs(program, params, seqs):
        m, layout, specs = program.config.model, program.layout, program.specs
        forward = jax.jit(lambda p, ids: transformer.logits(p, ids, m, layout, specs))
        out = []
        for s in seqs:
            logits = forward(params, np.asarray([s], np.int32))[0, -1]
            out.append(np.asarray(jax.nn.softmax(logits / T), np.float64))
        return np.asarray(out)

    first = probs(target, tparams, [prompt])[0]
    marginal = first @ probs(target, tparams, [prompt + [x] for x in range(V)])
    # self: pages of 2 tokens, the draft reads the last page only (no sink)
    eng = speculative(
        target,
        tparams,
        num_pages=1000,
        page_size=2,
        token_budget=512,
        chunk_size=64,
        max_seqs=200,
        k=2,
        draft=(draft, dparams) if source == "small" else "self",
        window=1,
        sink=0,
    )
    for i in range(N):
        eng.submit(i, prompt, 4, engine.Sampling(temperature=T, seed=i))
    eng.run()
    counts = np.bincount([r.generated[1] for r in eng.finished], minlength=V)
    assert _chi2(counts, marginal) < 24.32, (counts, marginal * N)
    assert 0 < eng.stats["accepted"] < eng.stats["drafted"]  # the rule both accepted and rejected
    if source == "small":
        draft_marginal = first @ probs(draft, dparams, [prompt + [x] for x in range(V)])
        assert _chi2(counts, draft_marginal) > 60  # the test tells the draft's distribution apart
    assert all(p.free_pages == p.num_pages for p in eng.pools)


def test_speculation_refuses_bad_input(models):
    target, tparams, draft, dparams = models
    with pytest.raises(ValueError, match="k >= 1"):
        speculative(target, tparams, **KW, k=0, draft="self")
    other = program_for(small_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=128))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative(target, tparams, **KW, k=2, draft=(other, other.init(0).params))
    with pytest.raises(ValueError, match="'self' or"):
        speculative(target, tparams, **KW, k=2, draft="selfish")
    eng = speculative(target, tparams, **KW, k=2, draft="self")
    with pytest.raises(ValueError, match="k=-1"):
        eng.submit("neg", [1, 2], 3, k=-1)
    with pytest.raises(ValueError, match="outside"):
        eng.submit("bad", [300], 2)
    c = small_config()
    c.serve.spec_k = 2  # a k without a draft
    with pytest.raises(ConfigError, match="spec_k=2 with config.serve.draft='none'"):
        validate(c)
    c.serve.spec_k, c.serve.draft = 0, "self"  # a draft without a k
    with pytest.raises(ConfigError, match="spec_k >= 1"):
        validate(c)
    c.serve.spec_k, c.serve.spec_window = 2, 0
    with pytest.raises(ConfigError, match="spec_window"):
        validate(c)
    c.serve.spec_window, c.serve.spec_sink = 8, 2
    validate(c)
    c.serve.spec_k, c.serve.draft, c.serve.cache = 2, "self", "contiguous"
    with pytest.raises(ConfigError, match="self-speculation reads a window"):
        validate(c)
    assert engine.Engine.from_config(target, tparams).drafter is None  # target's config: spec_k = 0


def test_sparse_view_reads_the_sink_and_window_pages():
    # 22 tokens, pages of 4: sink 1 page, window 5 tokens = tokens 17..21 -> pages 4, 5 (16..21)
    assert window.view_pages(22, 4, 1, 5) == ([0, 4, 5], 4 + 6)
    assert window.view_pages(22, 4, 0, 2) == ([5], 2)
    assert window.view_pages(7, 4, 1, 5) == ([0, 1], 7)  # overlap: the whole cache
    # over a quantized cache: of the view's pages, those the sequence sealed are read quantized
    assert window.sealed_in_view([0, 4, 5], 5) == 2 and window.sealed_in_view([0, 4, 5], 0) == 0


def test_the_server_loop_streams_a_speculative_decode_token_by_token(models):
    """The HTTP server's engine loop streams a speculative decode's tokens one by one (the last
    marked finished), equal to the plain engine's."""
    from jaxsys.serve import server

    target, tparams, _, _ = models
    prompt, n = [5, 6, 7, 8, 9, 10], 9
    plain = engine.Engine(target, tparams, **KW)
    plain.submit(0, prompt, n)
    expected = plain.run()[0].generated
    loop = server.EngineLoop(speculative(target, tparams, **KW, k=3, draft="self", window=4, sink=0))
    try:
        _, q = loop.submit(prompt, n, engine.Sampling())
        items = [(p.token, p.done) for p in (q.get(timeout=120) for _ in range(n))]  # server.Piece
    finally:
        loop.stop()
    assert [t for t, _ in items] == expected and [done for _, done in items] == [False] * (n - 1) + [True]


@pytest.mark.slow
def test_bench_serve_builds_the_speculative_engine_from_the_config(capsys):
    """bench_serve builds the speculative engine from config.serve.spec_k / draft and counts every
    emitted token."""
    import json

    from jaxsys import bench_serve
    from jaxsys.serve import bench as serve_bench

    args = [
        "--config",
        "configs/tiny.py:test",
        "--requests",
        "5",
        "--rate",
        "100",
        "--prompt-len",
        "3:9",
        "--output-len",
        "4:7",
        "--pages",
        "32",
        "--page-size",
        "4",
        "--token-budget",
        "16",
        "--chunk-size",
        "4",
        "--max-seqs",
        "3",
        "--json",
        "--config.model.n_kv_heads=4",
        "--config.serve.spec_k=2",
        "--config.serve.draft=self",
        "--config.serve.spec_window=4",
    ]
    assert bench_serve.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trace = serve_bench.make_trace(5, 100.0, (3, 9), (4, 7), seed=0)
    assert result["requests"] == 5 and result["generated_tokens"] == sum(r["output_len"] for r in trace)
