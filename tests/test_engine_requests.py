"""What a request can ask of the engine (jaxsys/serve/engine.py, sampling.py; issue 30): stop ids,
log-probabilities of the generated and of the prompt tokens, n samples sharing one prefill
(fork_of), presence / frequency / repetition penalties, logit_bias and min_p, out-of-range settings
refused by name, a
request ended early (finish), and a failing step that fails only its own requests.

References are independent of the engine: the training forward (`transformer.logits` over the
whole sequence on one device), log_softmax and the penalty formulas in numpy. Tolerance for
log-probabilities: the engine's paged attention and the full forward sum in another order, fp32:
|difference| <= 1e-4 (seen ~1e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.models import transformer
from jaxsys.serve import engine, speculation
from jaxsys.serve.sampling import Sampling
from tests.helpers import program_for, small_config

KW = dict(num_pages=48, page_size=4, token_budget=24, chunk_size=5, max_seqs=4)
PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def model():
    config = small_config(n_kv_heads=4, init_std=0.2)  # logits with margins, as a trained model's
    program = program_for(config)
    params = program.init(3).params
    m = config.model
    forward = jax.jit(lambda p, ids: transformer.logits(p, ids, m, program.layout, program.specs))

    def logprobs(seq):
        """log_softmax of the full forward's logits at every position of `seq` (numpy [T, V])."""
        logits = np.asarray(forward(params, jnp.asarray([seq], jnp.int32))[0], np.float64)
        return (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )

    return program, params, forward, logprobs


def _greedy(model, prompt, n, penalty=None):
    """Greedy tokens by full forwards, with the penalties applied in numpy (presence, frequency,
    repetition) when given."""
    program, params, forward, _ = model
    seq = list(prompt)
    for _ in range(n):
        logits = np.asarray(forward(params, jnp.asarray([seq], jnp.int32))[0, -1], np.float64)
        if penalty:
            presence, frequency, repetition = penalty
            generated = seq[len(prompt) :]
            seen = set(seq)
            for t in seen:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
            for t in set(generated):
                c = generated.count(t)
                logits[t] -= frequency * c + presence
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt) :]


def test_stop_ids_end_a_request_at_the_stop_token(model):
    program, params, _, _ = model
    want = _greedy(model, PROMPT, 8)
    stop = want[3]
    cut = want[: want.index(stop) + 1]
    for drafter in (None, "self"):
        kw = {} if drafter is None else dict(drafter=speculation.make_drafter("self", 4, 0), k=3)
        eng = engine.Engine(program, params, **KW, **kw)
        r = eng.submit("a", PROMPT, 8, Sampling(stop_ids=(stop,)))
        plain = eng.submit("b", PROMPT, 8)
        eng.run()
        assert r.generated == cut and r.finish_reason == "stop"
        assert plain.generated == want and plain.finish_reason == "length"
        assert all(p.free_pages == p.num_pages for p in eng.pools)


def test_logprobs_of_generated_and_prompt_tokens_equal_the_training_forward(model):
    program, params, _, logprobs = model
    eng = engine.Engine(program, params, **KW)  # chunks of 5: the prompt's rows come in two steps
    r = eng.submit("a", PROMPT, 6, Sampling(logprobs=3, prompt_logprobs=True))
    eng.run()
    ref = logprobs(PROMPT + r.generated)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(PROMPT)
    want_prompt = [ref[p - 1, PROMPT[p]] for p in range(1, len(PROMPT))]
    np.testing.assert_allclose(r.prompt_logprobs[1:], want_prompt, atol=1e-4)
    # the top 3 at each prompt position (lm-eval's is_greedy reads them)
    assert r.prompt_top_logprobs[0] is None and len(r.prompt_top_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        top = r.prompt_top_logprobs[p]
        order = np.argsort(-ref[p - 1])[:3]
        assert [t for t, _ in top] == order.tolist()
        np.testing.assert_allclose([lp for _, lp in top], ref[p - 1, order], atol=1e-4)
    want = [ref[len(PROMPT) - 1 + i, t] for i, t in enumerate(r.generated)]
    np.testing.assert_allclose(r.logprobs, want, atol=1e-4)
    for i, top in enumerate(r.top_logprobs):  # greedy: the chosen token is the most likely
        assert len(top) == 3 and top[0][0] == r.generated[i]
        order = np.argsort(-ref[len(PROMPT) - 1 + i])[:3]
        assert [t for t, _ in top] == order.tolist()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_prompt_logprobs_survive_a_preemption_during_prefill(model, preemption):
    """A pool of 5 pages: the long prompt (chunks of 3) is preempted after 6 of its 14 rows when the
    short request grows; its prompt log-probabilities are still every row's, once each."""
    program, params, _, logprobs = model
    eng = engine.Engine(
        program, params, num_pages=5, page_size=4, token_budget=8, chunk_size=3, max_seqs=4, preemption=preemption
    )
    cut = []
    scheduler = eng.schedulers[0]
    preempt = scheduler.preempt
    scheduler.preempt = lambda r: (cut.append((r.id, r.prefilled, len(r.generated))), preempt(r))
    eng.submit("short", [1, 2, 3, 4], 14)
    prompt = list(range(30, 44))
    r = eng.submit("long", prompt, 3, Sampling(logprobs=2, prompt_logprobs=True))
    eng.run()
    assert cut and all(rid == "long" and 0 < done < len(prompt) and not gen for rid, done, gen in cut)
    ref = logprobs(prompt)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose(r.prompt_logprobs[1:], [ref[p - 1, prompt[p]] for p in range(1, len(prompt))], atol=1e-4)
    assert [[t for t, _ in top] for top in r.prompt_top_logprobs[1:]] == np.argsort(-ref[:-1])[:, :2].tolist()


def test_forks_share_the_prompts_prefill_and_equal_their_solo_runs(model):
    program, params, _, _ = model
    samplings = [Sampling(temperature=1.0, seed=s) for s in (5, 6, 7)]
    solo = []
    for s in samplings:
        eng = engine.Engine(program, params, **KW)
        solo.append(eng.submit("x", PROMPT, 6, s))
        eng.run()
    for kv_quant in ("none", "kivi4"):
        eng = engine.Engine(program, params, **{**KW, "max_seqs": 5}, kv_quant=kv_quant)
        first = eng.submit(0, PROMPT, 6, samplings[0])
        forks = [eng.submit(i, PROMPT, 6, samplings[i], fork_of=0) for i in (1, 2)]
        greedy = [eng.submit(g, PROMPT, 6, fork_of=0) for g in ("g1", "g2")]
        prefilled = 0
        while not eng.idle:
            work, _ = eng.step()
            prefilled += sum(w.tokens for w in work if w.kind == "prefill")
        assert prefilled == len(PROMPT)  # one prefill for the five requests (max_seqs 5: all fit)
        if kv_quant == "none":
            assert [r.generated for r in [first, *forks]] == [r.generated for r in solo]
        assert greedy[0].generated == greedy[1].generated  # the copied cache decodes as its own
        assert all(p.free_pages == p.num_pages for p in eng.pools)
        assert not eng.residual or all(p.free_pages == p.num_pages for p in eng.residual)
    eng = engine.Engine(program, params, **KW)
    with pytest.raises(ValueError, match="another prompt"):
        eng.submit(0, PROMPT, 4) and eng.submit(1, PROMPT[:3], 4, fork_of=0)
    with pytest.raises(ValueError, match="names no waiting or running request"):
        eng.submit(2, PROMPT, 4, fork_of="nobody")


def test_penalties_equal_the_formulas_on_the_training_forward(model):
    program, params, _, _ = model
    penalty = (0.5, 0.7, 1.8)  # presence, frequency, repetition
    eng = engine.Engine(program, params, **KW)
    r = eng.submit("p", PROMPT, 10, Sampling(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.8))
    plain = eng.submit("q", PROMPT, 10)
    eng.run()
    assert r.generated == _greedy(model, PROMPT, 10, penalty)
    assert plain.generated == _greedy(model, PROMPT, 10)
    assert r.generated != plain.generated  # the penalties changed something


def test_logit_bias_with_penalties_and_min_p_against_numpy(model):
    """logit_bias is added before the penalties (OpenAI's bias on the model's logits, then vLLM's
    penalties): greedy tokens equal the full forward's with both applied in numpy, in one batch with
    a plain request (the adjusted path's other rows unchanged). min_p's filter equals numpy's
    p >= min_p p_max on the temperature-scaled distribution."""
    from jaxsys.serve import sampling

    program, params, forward, _ = model
    eng = engine.Engine(program, params, **KW)
    bias = ((3, 4.0), (40, -100.0), (200, 2.5))
    r = eng.submit("b", PROMPT, 8, Sampling(logit_bias=bias, repetition_penalty=1.5))
    plain = eng.submit("q", PROMPT, 8)
    eng.run()
    seq = list(PROMPT)
    for _ in range(8):
        logits = np.asarray(forward(params, jnp.asarray([seq], jnp.int32))[0, -1], np.float64)
        for t, b in bias:
            logits[t] += b
        for t in set(seq):
            logits[t] = logits[t] / 1.5 if logits[t] > 0 else logits[t] * 1.5
        seq.append(int(np.argmax(logits)))
    assert r.generated == seq[len(PROMPT) :] and plain.generated == _greedy(model, PROMPT, 8)
    assert r.generated != plain.generated
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 64)).astype(np.float32) * 3
    min_p, temperature = np.asarray([0.0, 0.05, 0.5], np.float32), np.asarray([1.0, 0.7, 2.0], np.float32)
    got = np.asarray(sampling.filtered_logits(jnp.asarray(logits), temperature[:, None], 0, 1.0, min_p[:, None]))
    scaled = logits / temperature[:, None]
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    keep = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    np.testing.assert_array_equal(np.isfinite(got), keep)
    np.testing.assert_allclose(got[keep], scaled[keep], rtol=1e-6)
    assert keep[0].all() and not keep[2].all()


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_p", 1.5),
        ("logit_bias", ((5, 200.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((256, 1.0),)),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("seed", 2**31),
        ("top_k", 2**31),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
    ],
)
def test_out_of_range_settings_are_refused_by_name(model, field, value):
    program, params, _, _ = model
    eng = engine.Engine(program, params, **KW)
    with pytest.raises(ValueError, match=field):
        eng.submit("bad", PROMPT, 4, Sampling(**{field: value}))
    assert eng.idle


def test_finish_and_a_failing_step_end_only_their_requests(model):
    program, params, _, _ = model
    eng = engine.Engine(program, params, **KW)
    a = eng.submit("a", PROMPT, 8)
    eng.step()
    assert eng.finish("a", "stop") and a.finish_reason == "stop" and a in eng.finished
    original = eng.runner

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("device lost")

    eng.runner = Broken()
    b = eng.submit("b", PROMPT, 4)
    eng.step()
    assert b.finish_reason == "error" and "device lost" in b.error and eng.failed == [b]
    eng.runner = original
    c = eng.submit("c", PROMPT, 4)
    eng.run()
    assert c.generated == _greedy(model, PROMPT, 4) and c.finish_reason == "length"
    assert all(p.free_pages == p.num_pages for p in eng.pools)


@pytest.mark.parametrize("kv_quant", ["none", pytest.param("kivi4", marks=pytest.mark.slow)])  # CI time
def test_multi_step_decoding_gives_the_single_step_tokens(model, kv_quant):
    """decode_steps=4: when only decodes run, up to 4 decode steps in one compiled call; the tokens
    (greedy and sampled, cut at stop ids and max_new_tokens) are those of one step at a time, and
    nothing compiles after warmup."""
    program, params, _, _ = model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=int(rng.integers(3, 12))).tolist() for _ in range(5)]
    news = [int(rng.integers(3, 15)) for _ in range(5)]
    samplings = [Sampling(), Sampling(temperature=1.0, seed=3), Sampling(), Sampling(temperature=0.7, seed=9), None]
    out, engines = {}, {}
    for steps in (1, 4):
        eng = engines[steps] = engine.Engine(program, params, **KW, kv_quant=kv_quant, decode_steps=steps)
        eng.warmup()
        compiled = eng.runner.compiled()
        for i, (p, n, s) in enumerate(zip(prompts, news, samplings)):
            eng.submit(i, p, n, s)
        eng.run()
        assert eng.runner.compiled() == compiled
        out[steps] = ({r.id: r.generated for r in eng.finished}, eng.stats["loop_steps"])
    stop = out[1][0][4][2]  # request 4 is greedy: its third token
    for steps in (1, 4):  # the same (warm) engines, idle again
        eng = engines[steps]
        r = eng.submit("s", prompts[4], 14, Sampling(stop_ids=(stop,)))
        eng.run()
        out[steps] += (r.generated, r.finish_reason)
        assert all(p.free_pages == p.num_pages for p in eng.pools)
    assert out[4][0] == out[1][0] and out[4][2:] == out[1][2:] and out[1][3] == "stop"
    assert out[1][1] == 0 and out[4][1] > 0  # the loop ran
