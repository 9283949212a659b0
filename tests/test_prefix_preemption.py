"""Prefix caching and on-demand pages with preemption (jaxsys/serve/scheduler.py; issue 31).

- The pool and scheduler alone (no device), on random traces with shared prefixes and a pool too
  small for them all: after every step the pool's invariants hold (reference counts equal the
  holdings, never negative; no page both free and referenced), every request finishes with the
  tokens its stand-in sampler gives it, nothing is starved, every page is free at the end, and
  the trace both hit the prefix cache and preempted.
- The engine: requests sharing a system prompt, a pool small enough to preempt, give every
  request its greedy tokens alone (the contiguous cache), with and without speculation and with
  the KIVI cache (kv_residual 0, where pages are shared).
"""

import numpy as np
import pytest

from jaxsys.serve import engine, speculation
from jaxsys.serve.scheduler import PagePool, Request, Scheduler, page_hashes
from tests.helpers import generate_contiguous, program_for, small_config


def _token(rid, n):
    """The stand-in sampler: request `rid`'s n-th generated token."""
    return (7 * hash(rid) + 13 * n) % 50


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_keep_the_pools_invariants(seed):
    rng = np.random.default_rng(seed)
    page = 4
    pool = PagePool(int(rng.integers(10, 14)), page)  # a request needs up to 10 pages
    sched = Scheduler(pool, 24, 6, 5, allocation="on_demand", prefix_cache=True)
    systems = [rng.integers(0, 50, size=int(rng.integers(4, 14))).tolist() for _ in range(3)]
    pending = []
    for i in range(30):
        prompt = systems[i % 3][: int(rng.integers(1, 20))] + rng.integers(0, 50, size=int(rng.integers(0, 6))).tolist()
        pending.append(Request(i, prompt or [1], int(rng.integers(1, 15))))
    steps = 0
    while pending or not sched.idle:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                sched.add(pending.pop(0))
        work = sched.plan()
        sampled = {}
        for w in work:
            r = w.request
            if w.kind == "decode" or w.start + w.tokens == len(r.prefix):
                sampled[r.id] = _token(r.id, len(r.generated))
        sched.commit(work, sampled)
        pool.check()
        steps += 1
        assert steps < 2000, "starved"
    assert len(sched.finished) == 30 and pool.free_pages == pool.num_pages
    for r in sched.finished:
        assert r.generated == [_token(r.id, n) for n in range(r.max_new_tokens)]
    assert pool.hits > 0 and sched.preemptions > 0, (pool.hits, sched.preemptions)


def test_page_names_are_a_chain():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = page_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)
    c = page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1] and c[1] != a[1]  # page 2 names pages 1-2
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, a) == page_hashes(
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4
    )


@pytest.fixture(scope="module")
def tiny():
    program = program_for(small_config(n_kv_heads=4))
    return program, program.init(3).params


def _requests(n=8, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, size=13).tolist()
    prompts = [system + rng.integers(0, 256, size=int(rng.integers(1, 6))).tolist() for _ in range(n)]
    return prompts, [int(rng.integers(4, 14)) for _ in range(n)]


@pytest.mark.parametrize(
    "variant",
    ["plain", pytest.param("self-speculation", marks=pytest.mark.slow), "kivi4"],  # CI time
)
def test_shared_prefixes_and_preemption_keep_every_requests_tokens(tiny, variant):
    program, params = tiny
    prompts, news = _requests()
    kw = dict(num_pages=14, page_size=4, token_budget=16, chunk_size=8, max_seqs=6)  # too few pages for all
    if variant == "self-speculation":
        kw.update(drafter=speculation.SelfSpeculation(window=4, sink=0), k=2)
    if variant == "kivi4":
        kw.update(kv_quant="kivi4")
        ref = engine.Engine(program, params, **{**kw, "num_pages": 64}, allocation="reserve", prefix_cache=False)
        want = {}
        for i, (p, n) in enumerate(zip(prompts, news)):
            ref.submit(i, p, n)
            ref.run()
            want[i] = ref.finished[-1].generated
    else:
        want = {i: generate_contiguous(program, params, [p], n)[0] for i, (p, n) in enumerate(zip(prompts, news))}
    eng = engine.Engine(program, params, **kw)
    assert eng.prefix_cache
    rng = np.random.default_rng(1)
    pending = list(range(len(prompts)))
    while pending or not eng.idle:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i = pending.pop(0)
                eng.submit(i, prompts[i], news[i])
        eng.step()
        eng.pools[0].check()
    got = {r.id: r.generated for r in eng.finished}
    assert got == want
    assert eng.pools[0].hits > 0 and eng.schedulers[0].preemptions > 0
    assert all(p.free_pages == p.num_pages for p in eng.pools)
    assert not eng.residual or all(p.free_pages == p.num_pages for p in eng.residual)


@pytest.mark.slow
def test_prefix_cache_and_preemption_on_data_2_tensor_2():
    program = program_for(small_config({"data": 2, "tensor": 2}, n_kv_heads=4))
    params = program.init(3).params
    prompts, news = _requests(10, seed=2)
    want = {i: generate_contiguous(program, params, [p], n)[0] for i, (p, n) in enumerate(zip(prompts, news))}
    eng = engine.Engine(program, params, num_pages=12, page_size=4, token_budget=16, chunk_size=8, max_seqs=5)
    for i, (p, n) in enumerate(zip(prompts, news)):
        eng.submit(i, p, n)
    got = {r.id: r.generated for r in eng.run()}
    assert got == want
    assert sum(p.hits for p in eng.pools) > 0 and sum(s.preemptions for s in eng.schedulers) > 0


@pytest.mark.parametrize(  # CI time: one variant runs in CI
    "mesh,overlap",
    [
        pytest.param(None, False, marks=pytest.mark.slow),
        (None, True),
        pytest.param({"data": 2, "tensor": 2}, False, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_swap_preemption_keeps_every_requests_tokens(mesh, overlap):
    """preemption='swap': a preempted sequence's pages go to host memory and back into its new
    pages when it resumes, so it prefills only the token not yet in its cache. Under a pool small
    enough to preempt (prefix caching on), every request gets its tokens generated alone, no request
    starves, every page is free at the end and nothing stays swapped; the tokens swapped in are the
    tokens swapped out, and the steps computed fewer prefill rows than recompute preemption."""
    program = program_for(small_config(mesh, n_kv_heads=4))
    params = program.init(3).params
    prompts, news = _requests(8, seed=2)
    want = {i: generate_contiguous(program, params, [p], n)[0] for i, (p, n) in enumerate(zip(prompts, news))}
    rows = {}
    for preemption in ("recompute", "swap"):
        eng = engine.Engine(
            program,
            params,
            num_pages=10,
            page_size=4,
            token_budget=16,
            chunk_size=8,
            max_seqs=6,
            preemption=preemption,
            overlap=overlap,
        )
        prefill = 0
        for i, (p, n) in enumerate(zip(prompts, news)):
            eng.submit(i, p, n)
        for step in range(400):
            if eng.idle:
                break
            work, _ = eng.step()
            prefill += sum(w.tokens for w in work if w.kind == "prefill")
            for pool in eng.pools:
                pool.check()
            for _, block in eng.swapped.values():  # copied out without blocking: host memory (CPU has it)
                assert all(a.sharding.memory_kind == "pinned_host" for a in block.values())
        assert eng.idle, "starved"
        assert {r.id: r.generated for r in eng.finished} == want, preemption
        assert all(p.free_pages == p.num_pages for p in eng.pools) and not eng.swapped
        assert sum(s.preemptions for s in eng.schedulers) > 0
        rows[preemption] = prefill
        if preemption == "swap":
            assert eng.stats["swapped_in"] == eng.stats["swapped_out"] > 0
    assert rows["swap"] < rows["recompute"], rows
    with pytest.raises(ValueError, match="swap"):
        engine.Engine(program, params, num_pages=10, page_size=4, kv_quant="kivi4", preemption="swap")
