"""Overlapped scheduling (config.serve.overlap; jaxsys/serve/engine.py, issue 31): each step is
dispatched before the previous step's sampled tokens are read, its decodes fed those tokens on the
device. References: the synchronous engine on the same trace, and for greedy requests the tokens
generated alone (the contiguous cache). The host learns a token one step late, so the trace's
arrivals and aborts are given per step index of the trace, not per token seen.

Page tables stay on the device between steps: a step sends the rows that changed (a sequence that
took a page, another sequence in that row), tested by counting rows sent against pages taken."""

import jax
import numpy as np
import pytest

from jaxsys.serve import engine, sampling, speculation
from jaxsys.serve.sampling import Sampling
from tests.helpers import generate_contiguous, program_for, small_config


def _trace(seed: int = 1, n: int = 8):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, size=9).tolist()  # a shared prefix: prefix-cache hits
    prompts = [
        (system if i % 2 else []) + rng.integers(0, 256, size=int(rng.integers(1, 14))).tolist() for i in range(n)
    ]
    news = [int(rng.integers(2, 12)) for _ in range(n)]
    arrivals = sorted(int(a) for a in rng.integers(0, 6, size=n))
    return prompts, news, arrivals


def _serve(eng, prompts, news, arrivals, samplings):
    """Run the trace (request i submitted before step arrivals[i]); returns ({id: tokens}, {id:
    streamed tokens}, finish reasons)."""
    streamed: dict = {i: [] for i in range(len(prompts))}
    eng.verify_steady = True  # every steady step's device inputs against the rows the host builds
    step = 0
    while step <= max(arrivals) or not eng.idle:
        for i, a in enumerate(arrivals):
            if a == step:
                eng.submit(i, prompts[i], news[i], samplings[i])
        _, sampled = eng.step()
        for rid, tokens in sampled.items():
            streamed[rid] += tokens if isinstance(tokens, list) else [tokens]
        for pool in eng.pools:
            pool.check()
        step += 1
        assert step < 500, "starved"
    done = {r.id: r.generated for r in eng.finished}
    assert all(p.free_pages == p.num_pages for p in eng.pools) and eng.inflight is None
    return done, streamed, {r.id: r.finish_reason for r in eng.finished}


@pytest.mark.parametrize(
    "mesh,kv_quant",
    [(None, "none"), ({"data": 2, "tensor": 2}, "none"), pytest.param(None, "kivi4", marks=pytest.mark.slow)],
    ids=str,
)
def test_overlap_gives_the_synchronous_tokens_with_preemption(mesh, kv_quant):
    """Mixed prefill chunks and decodes, arrivals over the first steps, a pool small enough to
    preempt, greedy and drawn requests and a stop id: the same tokens (and the same tokens
    streamed) as the synchronous engine, greedy ones as generated alone (full precision); every
    page free at the end, the pools' invariants after every step."""
    program = program_for(small_config(mesh, n_kv_heads=4))
    params = program.init(3).params
    prompts, news, arrivals = _trace()
    samplings = [Sampling(temperature=1.0, seed=5) if i == 3 else Sampling() for i in range(len(prompts))]
    alone = {i: generate_contiguous(program, params, [prompts[i]], news[i])[0] for i in range(len(prompts)) if i != 3}
    samplings[6] = Sampling(stop_ids=(alone[6][2],))  # ends at its third token (or before)
    kw = dict(num_pages=9, page_size=4, token_budget=16, chunk_size=5, max_seqs=4, kv_quant=kv_quant)
    out = {}
    for overlap in (False, True):
        eng = engine.Engine(program, params, **kw, overlap=overlap)
        done, streamed, reasons = _serve(eng, prompts, news, arrivals, samplings)
        assert streamed == done, overlap
        out[overlap] = (done, reasons, sum(s.preemptions for s in eng.schedulers))
    assert out[True][:2] == out[False][:2]
    assert out[True][2] > 0 and out[False][2] > 0  # the pool preempted both ways
    done, reasons, _ = out[True]
    assert reasons[6] == "stop"
    for i, want in alone.items() if kv_quant == "none" else ():  # a quantized cache has its own tokens
        if i == 6:
            want = want[: want.index(want[2]) + 1]
        assert done[i] == want, i


def test_overlap_abort_finish_failure_and_synchronous_steps():
    """Under overlap: an abort and a stop string (finish) while a token is in flight drop it;
    requests with log-probabilities, penalties or forks run their steps synchronously and get the
    synchronous engine's tokens and log-probabilities; a failing step fails only its requests;
    speculation and multi-step decoding are refused by name."""
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(3).params
    kw = dict(num_pages=32, page_size=4, token_budget=16, chunk_size=5, max_seqs=4)
    prompt = [11, 22, 33, 44, 55, 66, 77]
    want = generate_contiguous(program, params, [prompt], 8)[0]
    results = {}
    for overlap in (False, True):
        eng = engine.Engine(program, params, **kw, overlap=overlap)
        eng.submit("lp", prompt, 6, Sampling(logprobs=2))
        eng.submit("pen", prompt, 6, Sampling(presence_penalty=0.5))
        eng.submit("plain", prompt, 8)
        eng.submit("fork", prompt, 5, Sampling(temperature=1.0, seed=2), fork_of="plain")
        eng.run()
        got = {r.id: (r.generated, r.finish_reason, r.logprobs, r.top_logprobs) for r in eng.finished}
        results[overlap] = got
        assert all(p.free_pages == p.num_pages for p in eng.pools)
    assert results[True] == results[False] and results[True]["plain"][0] == want

    eng = engine.Engine(program, params, **kw, overlap=True)
    a, b = eng.submit("a", prompt, 8), eng.submit("b", prompt, 8)
    for _ in range(4):  # two prefill chunks, then decodes: a token of each is in flight
        eng.step()
    assert a.pending == 1 and b.pending == 1
    seen = len(a.generated)
    assert eng.abort("a") and eng.finish("b", "stop")
    eng.run()
    assert len(a.generated) == seen and a not in eng.finished and a.finish_reason == "abort"
    assert b.finish_reason == "stop" and b in eng.finished and b.generated == want[: len(b.generated)]

    last = eng.submit("last", prompt, 1)  # its only token in flight: finished (pages free) but not listed
    while not last.pending:
        eng.step()
    assert last.pending == 1 and last not in eng.finished and not eng.idle
    assert eng.finish("last", "stop") and eng.run() and last.generated == [] and last.finish_reason == "stop"

    original = eng.runner

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("device lost")

    c = eng.submit("c", prompt, 8)
    for _ in range(3):
        eng.step()
    eng.runner = Broken()
    d = eng.submit("d", prompt, 4)
    eng.step()
    assert c.finish_reason == "error" and d.finish_reason == "error" and "device lost" in d.error
    eng.runner = original
    e = eng.submit("e", prompt, 4)
    eng.run()
    assert e.generated == want[:4] and all(p.free_pages == p.num_pages for p in eng.pools)

    with pytest.raises(ValueError, match="overlap"):
        engine.Engine(program, params, **kw, overlap=True, decode_steps=4)
    with pytest.raises(ValueError, match="overlap"):
        engine.Engine(program, params, **kw, overlap=True, drafter=speculation.make_drafter("self", 4, 0), k=2)


def test_overlap_compiles_nothing_after_warmup():
    """warmup() compiles the gather of pending tokens into every row bucket too: an overlapped run
    with greedy and drawn requests compiles nothing more."""
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(0).params
    eng = engine.Engine(
        program, params, num_pages=24, page_size=4, token_budget=16, chunk_size=4, max_seqs=3, overlap=True
    )
    eng.warmup()
    counts = lambda: (
        eng.runner.compiled(),
        sampling.sample_at._cache_size(),
        eng._feed_fn()._cache_size(),
        eng._scatter_fn()._cache_size(),
        eng._advance_fn()._cache_size(),
        sampling.greedy_at._cache_size(),
    )
    compiled = counts()
    for i, (length, new) in enumerate([(3, 6), (9, 2), (5, 4), (2, 7)]):
        eng.submit(i, list(range(1, length + 1)), new, Sampling(temperature=1.0, seed=i) if i % 2 else None)
    eng.run()
    assert len(eng.finished) == 4 and counts() == compiled


@pytest.mark.parametrize("overlap", [False, True])
def test_page_tables_take_only_their_changed_rows(overlap):
    """Four sequences decoding together: a decode step sends the device exactly the table rows of
    the sequences that took a page in it (none in most steps), and the tokens are those generated
    alone. Steady decoding: these steps run from inputs the last step left on the device, equal to
    the rows the host would build (verify_steady); a step in which no sequence takes a page sends
    the device nothing at all (JAX's transfer guard, implicit and explicit uploads)."""
    program = program_for(small_config(n_kv_heads=4))
    params = program.init(3).params
    eng = engine.Engine(
        program, params, num_pages=32, page_size=4, token_budget=16, chunk_size=8, max_seqs=4, overlap=overlap
    )
    eng.verify_steady = True
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4], [7]]
    reqs = [eng.submit(i, p, 14) for i, p in enumerate(prompts)]
    for _ in range(3):  # the prefills, then a decode step of this width
        eng.step()
    assert all(r.decoding for r in reqs)
    grown_total, steady, guarded = 0, eng.stats["steady_steps"], 0
    for _ in range(8):
        pages = [len(eng.pools[0].table(r.id)) for r in reqs]
        sent = eng.stats["table_rows_sent"]
        if any(r.cached % 4 == 0 for r in reqs):  # a sequence takes a page: its row is sent
            eng.step()
        else:
            with jax.transfer_guard_host_to_device("disallow_explicit"):
                eng.step()
            guarded += 1
        grown = sum(len(eng.pools[0].table(r.id)) != n for r, n in zip(reqs, pages))
        assert eng.stats["table_rows_sent"] - sent == grown
        grown_total += grown
    assert 0 < grown_total < 8 * len(reqs)
    assert eng.stats["steady_steps"] - steady == 8 and guarded >= 2
    eng.run()
    for r, p in zip(reqs, prompts):
        assert r.generated == generate_contiguous(program, params, [p], 14)[0]


def test_bench_serve_host_gap_with_overlap_off_and_on(capsys):
    """`bench_serve --host-gap N --overlap-both` measures both engines in turn and reports both
    (the figures themselves are the benchmark's, not asserted)."""
    import json

    from jaxsys import bench_serve

    args = ["--config", "configs/tiny.py:test", "--host-gap", "4", "--overlap-both", "--host-gap-rounds", "1", "--json"]
    args += ["--pages", "128"]
    args += ["--max-seqs", "4", "--token-budget", "16", "--chunk-size", "16", "--config.mesh.tensor=1"]
    assert bench_serve.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"sync", "overlap"}
    for r in result.values():
        assert len(r["host_gap_ratios"]) == 3 and r["compiled_step_s"] > 0 and r["engine_step_s"] > 0
